"""The shipped Ascend C kernels compiled for the CPU against an emulated Ascend C API (``rope_sim``)."""
