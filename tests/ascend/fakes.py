"""Test doubles for running AscendBackend without an NPU (used by tests/test_ascend_*.py; never shipped).

* ``install_fake_torch_npu(monkeypatch)``: a ``torch_npu`` module whose ``npu_rotary_mul`` follows
  the documented semantics (out = x*r1 + rotate(x)*r2, r1/r2 cast to x's dtype) and refuses, like
  CANN's error 561002, what the documentation says the op cannot take; plus a ``torch.npu``
  stand-in (one device, a SoC name, a vector core count).
* ``CpuRoutedAscendBackend``: AscendBackend accepting CPU tensors, so rope_ops' selection,
  validation and autograd route CPU tensors to it.
* ``sim_kernel_ops()``: replacements for ``torch.ops.rope_ops_ascend.rotary_embedding[_grad]`` that
  do what rope_host.cpp does (tiling from the tensors, then launch) with the shipped kernels
  compiled for the CPU (tests/ascend/cpu_sim, needs g++).

Nothing here is used by the backend itself.
"""

from __future__ import annotations

import sys
import types

import torch

from rope_ops_backends.ascend_backend import AscendBackend
from rope_ops_backends.ascend_backend import _kernel_call as kc
from rope_ops_backends.ascend_backend import tiling as tl

from .cpu_sim import rope_sim

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Refused(RuntimeError):
    """What the fake npu_rotary_mul raises where the real one fails with 561002."""


def fake_npu_rotary_mul(calls: list):
    def npu_rotary_mul(x, r1, r2, rotary_mode="half", rotate=None):
        calls.append({"x": tuple(x.shape), "x_dtype": x.dtype, "cos": tuple(r1.shape), "mode": rotary_mode,
                      "r1": r1.clone(), "r2": r2.clone(), "rotate": rotate})
        if x.dim() not in (3, 4) or x.dtype not in DTYPES:
            raise Refused("161002 bad input")
        d = x.shape[-1]
        if d % 2 or d >= 896:
            raise Refused("561002 D")
        lead = [n for n in r1.shape[:-1] if n != 1]
        if rotary_mode == "interleave":
            if len(lead) > 1:
                raise Refused("561002 interleave: cos must be S-only")
            b, n = (x.shape[0], x.shape[2]) if r1.shape[1] != 1 else (x.shape[0], x.shape[1])
            if b * n >= 1000:
                raise Refused("561002 interleave B*N")
            rot = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        elif rotary_mode == "half":
            if x.shape[0] >= 1000 or x.shape[2] >= 1000 or x.shape[1] >= 1000 and r1.shape[1] == 1:
                raise Refused("561002 half B,N")
            x1, x2 = x.chunk(2, dim=-1)
            rot = torch.cat((-x2, x1), dim=-1)
        else:
            raise Refused("bad mode")
        torch.broadcast_shapes(r1.shape, x.shape)
        r1, r2 = r1.to(x.dtype), r2.to(x.dtype)
        return x * r1 + rot * r2

    return npu_rotary_mul


class FakeNpuDevice:
    """The bits of ``torch.npu`` the backend uses."""

    def __init__(self, count=1, name="Ascend910B2", cores=40):
        self.count, self.name, self.cores = count, name, cores

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def current_device(self):
        return 0

    def get_device_name(self, i=0):
        return self.name

    def get_device_properties(self, i=0):
        return types.SimpleNamespace(vector_core_num=self.cores, name=self.name)


def install_fake_torch_npu(monkeypatch, calls: list | None = None) -> FakeNpuDevice:
    calls = [] if calls is None else calls
    mod = types.ModuleType("torch_npu")
    mod.npu_rotary_mul = fake_npu_rotary_mul(calls)
    mod.calls = calls
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    dev = FakeNpuDevice()
    monkeypatch.setattr(torch, "npu", dev, raising=False)
    return dev


class CpuRoutedAscendBackend(AscendBackend):
    device_types = frozenset({"cpu"})


_SIM: list = []  # the one simulation library of this process, built on first use


def load_sim() -> rope_sim.Sim:
    """The CPU simulation of the shipped kernels (cpu_sim), built if needed."""
    if not _SIM:
        _SIM.append(rope_sim.Sim(rope_sim.build_cached()))
    return _SIM[0]


def sim_kernel_ops(sim=None, launched: list | None = None):
    """(forward op, grad op) with the signature of torch.ops.rope_ops_ascend.rotary_embedding[_grad]."""
    sim = load_sim() if sim is None else sim
    launched = [] if launched is None else launched

    def make_op(inverse):
        def op(q, k, q_out, k_out, pos, pos_offset, cos, sin, freq, attn, rotary_dim, interleaved, inplace,
               ub_size, core_num):
            v = kc.KernelViews(q, k, q_out, k_out, pos, pos_offset, cos, sin, freq, attn, rotary_dim,
                               interleaved, inplace)
            status, t = sim.c_tiling(kc.tiling_params(v, inverse), tl.FIELDS, ub_size, core_num)
            if status != 0:
                raise RuntimeError(f"rope_ops_ascend: no tiling for this call (status {status})")
            launched.append((inverse, t))
            if t["blockDim"]:
                sim.launch(v, t, tl.pack(t), inverse)
        return op

    return make_op(False), make_op(True)


def use_sim_kernels(backend: AscendBackend, sim=None, launched: list | None = None) -> None:
    """Make ``backend``'s kernel tier run the CPU simulation."""
    env = backend._probe()
    env.kernel_ops = sim_kernel_ops(sim, launched)
    env.kernel_status = "loaded (CPU simulation of the shipped kernels)"
