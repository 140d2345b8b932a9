"""rope_ops' shared conformance suite against the CUDA kernels' code, run on the CPU.

The backend is CudaBackend routed to CPU tensors: its run() hands the KernelArgs to
rope_host_emulate() of csrc/rope_kernels.cu built with -DROPE_HOST_EMULATION (see
test_cuda_host_emulation.py), i.e. the real path choice, grid sizing and per-thread code.
Everything else is the public path: rope_ops.apply's validation, selection, autograd (backward =
inverse rotation of the output gradients), in place, packed views, torch.compile. float64 is not a
CUDA-backend dtype, so those cases are refused by the backend and skipped.

On a GPU machine run the same suite for real:
``pytest --pyargs rope_ops.testing --rope-backend cuda``.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import pytest
import torch

from rope_ops import registry
from rope_ops.testing import RopeConformance
from rope_ops_backends.cuda_backend import CudaBackend
from rope_ops_backends.torch_backend import TorchBackend

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_cuda_emu_helpers",
                                               _HERE / "test_cuda_host_emulation.py")
_emu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_emu)

# The fixture that builds the emulation library (nvcc; skips without it), shared with that module.
lib = _emu.lib


PAIRED_OUTPUT_BYTES = 8 << 20  # kPairedOutputBytes in csrc/rope_binding.cpp


def allocate_like_the_binding(q, k):
    """(q_out, k_out) as rope_eager in csrc/rope_binding.cpp makes them: empty_like's strides;
    small pairs over one storage, k_out 256-byte aligned after q_out."""
    if k is None or (q.numel() + k.numel()) * q.element_size() > PAIRED_OUTPUT_BYTES:
        return torch.empty_like(q), None if k is None else torch.empty_like(k)
    like_q, like_k = torch.empty_like(q), torch.empty_like(k)
    elem = q.element_size()
    offset = (q.numel() * elem + 255) // 256 * 256 // elem
    buf = torch.empty((offset + k.numel()) * elem, dtype=torch.uint8, device=q.device)
    q_out = q.new_empty(0).set_(buf.untyped_storage(), 0, q.shape, like_q.stride())
    k_out = k.new_empty(0).set_(buf.untyped_storage(), offset, k.shape, like_k.stride())
    return q_out, k_out


class CpuEmulatedCudaBackend(CudaBackend):
    """CudaBackend whose kernels run through the host emulation, on CPU tensors."""

    device_types = frozenset({"cpu"})

    def __init__(self, so):
        self.so = so
        self.calls = 0

    def availability(self) -> list[str]:
        return []

    def run(self, args):
        made = None
        if args.q_out is None:  # allocates_outputs (inherited): allocate as the C++ entry does
            made = allocate_like_the_binding(args.q, args.k)
            args = args._replace(q_out=made[0], k_out=made[1])
        pos = args.pos
        p = _emu.params(q=args.q, k=args.k, q_out=args.q_out, k_out=args.k_out,
                        layout=args.layout, rotary_dim=args.rotary_dim,
                        interleaved=args.interleaved, inplace=args.inplace, cos=args.cos,
                        sin=args.sin, pos=pos, pos_offset=args.pos_offset,
                        freq_turns=args.freq_turns, attention_factor=args.attention_factor,
                        inverse=args.inverse)
        rc = self.so.rope_host_emulate(ctypes.byref(p), 132)
        if rc != 0:
            raise RuntimeError(f"rope_host_emulate returned {rc}")
        self.calls += 1
        return made


class TestCudaKernelsOnCpu(RopeConformance):
    backend = "cuda"

    @pytest.fixture(autouse=True)
    def _cuda_on_cpu(self, lib, monkeypatch):
        monkeypatch.delenv("ROPE_OPS_BACKEND", raising=False)
        monkeypatch.delenv("ROPE_OPS_TEST_DEVICE", raising=False)
        backend = CpuEmulatedCudaBackend(lib)
        with registry.override({"cuda": backend, "torch": TorchBackend()}):
            yield backend

    def test_emulated_kernels_serve(self, _cuda_on_cpu, backend_name, device):
        import rope_ops

        q = torch.randn(2, 5, 4, 32, device=device, dtype=torch.bfloat16)
        k = torch.randn(2, 5, 2, 32, device=device, dtype=torch.bfloat16)
        before = _cuda_on_cpu.calls
        rope_ops.apply(q, k, 3, backend=backend_name)
        assert _cuda_on_cpu.calls == before + 1
