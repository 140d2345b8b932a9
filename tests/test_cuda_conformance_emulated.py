"""rope_ops' shared conformance suite against the CUDA backend's code, run on the CPU.

The backend is CudaBackend with its extension module replaced by the same module built for CPU
tensors over the host emulation of the kernels (tests/_cuda_tools.py, tests/csrc/): the real
KernelArgs handling, output allocation, kernel choice, bound launchers and per-thread kernel code.
Everything else is the public path: rope_ops.apply's validation, selection, autograd (backward =
inverse rotation of the output gradients), in place, packed views, torch.compile; and
rope_ops.qkv_prologue's cases through the extension's prologue functions. float64 is not a
CUDA-backend dtype, and the variants it does not declare are refused: those cases are skipped.

On a GPU machine run the same suite for real:
``pytest --pyargs rope_ops.testing --rope-backend cuda``.
"""

from __future__ import annotations

import pytest
import torch
from _cuda_tools import ext  # noqa: F401  (fixture)

from rope_ops import registry
from rope_ops.testing import RopeConformance
from rope_ops_backends.cuda_backend import CudaBackend, run_prologue, run_prologue_backward
from rope_ops_backends.torch_backend import TorchBackend


class CpuEmulatedCudaBackend(CudaBackend):
    """CudaBackend whose extension module runs the kernels through the host emulation, on CPU
    tensors."""

    device_types = frozenset({"cpu"})

    def __init__(self, module):
        self.module = module
        self.calls = 0

    def availability(self) -> list[str]:
        return []

    def run(self, args):
        self.calls += 1
        return self.module.run(args)

    def run_prologue(self, args):
        self.calls += 1
        run_prologue(self.module, args)

    def run_prologue_backward(self, args, grad_q, grad_k, grad_v):
        self.calls += 1
        return run_prologue_backward(self.module, args, grad_q, grad_k, grad_v)

    def bind(self, cos, sin, freq_turns, attention_factor, layout, rotary_dim, interleaved, inverse):
        if torch.compiler.is_compiling():
            return None
        return self.module.BoundRope(cos, sin, freq_turns, float(attention_factor), layout,
                                     int(rotary_dim), bool(interleaved), bool(inverse))


class TestCudaKernelsOnCpu(RopeConformance):
    backend = "cuda"

    @pytest.fixture(autouse=True)
    def _cuda_on_cpu(self, ext, monkeypatch):
        monkeypatch.delenv("ROPE_OPS_BACKEND", raising=False)
        monkeypatch.delenv("ROPE_OPS_TEST_DEVICE", raising=False)
        backend = CpuEmulatedCudaBackend(ext)
        with registry.override({"cuda": backend, "torch": TorchBackend()}):
            yield backend

    def test_emulated_kernels_serve(self, _cuda_on_cpu, backend_name, device):
        import rope_ops

        q = torch.randn(2, 5, 4, 32, device=device, dtype=torch.bfloat16)
        k = torch.randn(2, 5, 2, 32, device=device, dtype=torch.bfloat16)
        before = _cuda_on_cpu.calls
        rope_ops.apply(q, k, 3, backend=backend_name, inplace=True)
        assert _cuda_on_cpu.calls == before + 1
