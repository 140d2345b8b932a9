"""Test-only doubles for the Ascend backend (never shipped): a fake torch_npu (``fakes``) and a CPU
emulation of the Ascend C kernels (``cpu_sim``). Imported by tests/test_ascend_*.py as ``ascend``."""
