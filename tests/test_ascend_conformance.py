"""rope_ops' shared conformance suite (rope_ops.testing.RopeConformance) against AscendBackend on CPU.

The backend is routed to CPU tensors (fakes.CpuRoutedAscendBackend) with a fake torch_npu, and each
class restricts the tiers (ROPE_OPS_ASCEND_TIERS):
* TestAscendKernelTierOnCpu: the kernel tier runs the shipped host glue (ascend_kernels/rope_host.cpp,
  built for the CPU by tests/ascend/host_glue: every launch's tiling checked against the Python
  mirror) and the shipped Ascend C kernels compiled for the CPU (tests/ascend/cpu_sim); calls the kernels cannot take (float64, a float8 KV cache or q) fall to the
  torch tier. The variant and prologue tests must be served by the kernels alone.
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

from ascend import fakes, host_glue


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
            host_glue.use(backend)
        with registry.override({"ascend": backend, "torch": TorchBackend()}):
            yield backend

    def test_intended_tier_serves(self, _ascend_on_cpu, backend_name, device):
        import torch

        import rope_ops

        q = torch.randn(2, 5, 4, 32, device=device, dtype=torch.float16)
        k = torch.randn(2, 5, 2, 32, device=device, dtype=torch.float16)
        rope_ops.apply(q, k, 3, backend=backend_name)
        assert _ascend_on_cpu.last_tier == self.tiers.split(",")[0], _ascend_on_cpu.last_reasons


# Tests of the suite whose every call the kernel tier must serve (no torch-tier fallback).
KERNEL_ONLY_TESTS = ("test_per_token_tables", "test_position_tables_in_every_form", "test_mrope[",
                     "test_odd_head_dim_with_even_rotary_dim", "test_prologue_forward", "test_prologue_in_place",
                     "test_prologue_backward", "test_prologue_cache_write[same_dtype]", "test_prologue_compiled")


class TestAscendKernelTierOnCpu(_AscendOnCpu):
    tiers = "kernels,torch"
    with_kernels = True

    @pytest.fixture(autouse=True)
    def _kernels_serve_the_variants(self, _ascend_on_cpu, request):
        yield
        name = request.node.name
        if name.startswith(KERNEL_ONLY_TESTS):
            counts = _ascend_on_cpu.tier_counts
            assert counts["kernels"] > 0 and counts["torch"] == 0, (counts, _ascend_on_cpu.last_reasons)


class TestAscendRotaryMulTierOnCpu(_AscendOnCpu):
    tiers = "npu_rotary_mul,torch"
