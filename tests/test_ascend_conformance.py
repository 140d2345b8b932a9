"""rope_ops' shared conformance suite (rope_ops.testing.RopeConformance) against AscendBackend on CPU.

The backend is routed to CPU tensors (fakes.CpuRoutedAscendBackend) with a fake torch_npu, and each
class restricts the tiers (ROPE_OPS_ASCEND_TIERS):
* TestAscendKernelTierOnCpu: the kernel tier runs the shipped Ascend C kernels compiled for the CPU
  (tests/ascend/cpu_sim); calls the kernels cannot take (float64) fall to the torch tier.
* TestAscendRotaryMulTierOnCpu: the npu_rotary_mul tier with the documented-semantics fake.
Everything goes through rope_ops.apply: validation, selection, autograd, in place, torch.compile.
On an Ascend machine run the same suite for real:
``ROPE_OPS_BACKEND=ascend pytest --pyargs rope_ops.testing --rope-backend ascend``.
"""

from __future__ import annotations

import shutil

import pytest

from rope_ops import registry
from rope_ops.testing import RopeConformance
from rope_ops_backends.torch_backend import TorchBackend

from ascend import fakes


class _AscendOnCpu(RopeConformance):
    backend = "ascend"
    tiers = ""
    with_kernels = False

    @pytest.fixture(autouse=True)
    def _ascend_on_cpu(self, monkeypatch):
        monkeypatch.setenv("ROPE_OPS_ASCEND_TIERS", self.tiers)
        for var in ("ROPE_OPS_ASCEND_LIB", "ROPE_OPS_ASCEND_UB_SIZE", "ROPE_OPS_ASCEND_CORES", "ROPE_OPS_BACKEND"):
            monkeypatch.delenv(var, raising=False)
        fakes.install_fake_torch_npu(monkeypatch)
        backend = fakes.CpuRoutedAscendBackend()
        if self.with_kernels:
            if shutil.which("g++") is None and shutil.which("c++") is None:
                pytest.skip("no C++ compiler")
            fakes.use_sim_kernels(backend)
        with registry.override({"ascend": backend, "torch": TorchBackend()}):
            yield backend

    def test_intended_tier_serves(self, _ascend_on_cpu, backend_name, device):
        import torch

        import rope_ops

        q = torch.randn(2, 5, 4, 32, device=device, dtype=torch.float16)
        k = torch.randn(2, 5, 2, 32, device=device, dtype=torch.float16)
        rope_ops.apply(q, k, 3, backend=backend_name)
        assert _ascend_on_cpu.last_tier == self.tiers.split(",")[0], _ascend_on_cpu.last_reasons


class TestAscendKernelTierOnCpu(_AscendOnCpu):
    tiers = "kernels,torch"
    with_kernels = True


class TestAscendRotaryMulTierOnCpu(_AscendOnCpu):
    tiers = "npu_rotary_mul,torch"
