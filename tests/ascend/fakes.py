"""Test doubles for running AscendBackend without an NPU (used by tests/test_ascend_*.py; never shipped).

* ``install_fake_torch_npu(monkeypatch)``: a ``torch_npu`` module whose ``npu_rotary_mul`` follows
  the documented semantics (out = x*r1 + rotate(x)*r2, r1/r2 cast to x's dtype) and refuses, like
  CANN's error 561002, what the documentation says the op cannot take; plus a ``torch.npu``
  stand-in (one device, a SoC name, a vector core count).
* ``CpuRoutedAscendBackend``: AscendBackend accepting CPU tensors, so rope_ops' selection,
  validation and autograd route CPU tensors to it.
* ``sim_kernel_ops()``: replacements for the ``torch.ops.rope_ops_ascend`` ops (rotary_embedding[_grad],
  qkv_prologue[_grad]) that do what rope_host.cpp does (tiling from the tensors, then launch) with
  the shipped kernels compiled for the CPU (tests/ascend/cpu_sim, needs g++).

Nothing here is used by the backend itself.
"""

from __future__ import annotations

import sys
import types
from typing import NamedTuple

import torch

from rope_ops_backends.ascend_backend import AscendBackend, KernelOps
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


class Launch(NamedTuple):
    """One kernel launch as rope_host.cpp makes it from an op's arguments."""

    kernel: int  # rope_sim.ROPE / ROPE_GRAD / PROLOGUE / PROLOGUE_GRAD
    dtype: torch.dtype
    tensors: list  # the entry's GM arguments in order (None where absent), without the tiling
    params: dict  # the tiling's input fields
    ub_size: int
    core_num: int


def _angles(pos, pos_offset, cos, sin, freq, attn, angles, section, mrope_interleaved) -> kc.AngleViews:
    """The ops' angle arguments (ROPE_ANGLE_ARGS) as the views they stand for."""
    return kc.AngleViews(pos, pos_offset, cos, sin, freq, attn, angles, tuple(section), mrope_interleaved)


def rope_launch(inverse: bool, q, k, q_out, k_out, pos, pos_offset, cos, sin, freq, attn, angles, section,
                mrope_interleaved, rotary_dim, interleaved, inplace, ub_size, core_num) -> Launch:
    """The launch of rotary_embedding[_grad] for these op arguments."""
    a = _angles(pos, pos_offset, cos, sin, freq, attn, angles, section, mrope_interleaved)
    v = kc.KernelViews(q, k, q_out, k_out, a, rotary_dim, interleaved, inplace)
    return Launch(rope_sim.ROPE_GRAD if inverse else rope_sim.ROPE, q.dtype,
                  [q, k, q_out, k_out, pos, cos, sin, freq], kc.tiling_params(v, inverse), ub_size, core_num)


def _prologue_launch(grad: bool, views: kc.PrologueViews, tensors: list, ub_size: int, core_num: int) -> Launch:
    return Launch(rope_sim.PROLOGUE_GRAD if grad else rope_sim.PROLOGUE, views.q_out.dtype, tensors,
                  kc.prologue_tiling_params(views, grad), ub_size, core_num)


def prologue_launch(q, k, v, q_out, k_out, v_out, pos, pos_offset, cos, sin, freq, attn, angles, section,
                    mrope_interleaved, rotary_dim, interleaved, rotate, q_weight, k_weight, eps, weight_offset,
                    inplace, k_cache, v_cache, slots, ub_size, core_num) -> Launch:
    """The launch of qkv_prologue for these op arguments."""
    a = _angles(pos, pos_offset, cos, sin, freq, attn, angles, section, mrope_interleaved)
    views = kc.PrologueViews(q, k, v, q_out, k_out, v_out, None, None, a, rotary_dim, interleaved, rotate,
                             q_weight, k_weight, eps, weight_offset, inplace, k_cache, v_cache, slots)
    return _prologue_launch(False, views, [q, k, v, q_out, k_out, v_out, pos, cos, sin, freq, q_weight, k_weight,
                                           k_cache, v_cache, slots], ub_size, core_num)


def prologue_grad_launch(grad_q, grad_k, grad_v, xq, xk, dq, dk, dv, pos, pos_offset, cos, sin, freq, attn,
                         angles, section, mrope_interleaved, rotary_dim, interleaved, rotate, q_weight, k_weight,
                         eps, weight_offset, q_weight_sums, k_weight_sums, ub_size, core_num) -> Launch:
    """The launch of qkv_prologue_grad for these op arguments."""
    a = _angles(pos, pos_offset, cos, sin, freq, attn, angles, section, mrope_interleaved)
    views = kc.PrologueViews(grad_q, grad_k, grad_v, dq, dk, dv, xq, xk, a, rotary_dim, interleaved, rotate,
                             q_weight, k_weight, eps, weight_offset, False, None, None, None)
    return _prologue_launch(True, views, [grad_q, grad_k, grad_v, xq, xk, dq, dk, dv, pos, cos, sin, freq, q_weight,
                                          k_weight, q_weight_sums, k_weight_sums], ub_size, core_num)


def sim_kernel_ops(sim=None, launched: list | None = None) -> KernelOps:
    """Stand-ins for torch.ops.rope_ops_ascend.* with their signatures, doing in Python what
    rope_host.cpp does: the tiling from the tensors (the C header's compute_rope_tiling), then the
    launch of the shipped kernels in the CPU simulation. ``launched`` collects (kernel, tiling).
    (tests/ascend/host_glue runs rope_host.cpp itself instead.)"""
    sim = load_sim() if sim is None else sim
    launched = [] if launched is None else launched

    def run(plan: Launch, tag):
        status, t = sim.c_tiling(plan.params, tl.FIELDS, plan.ub_size, plan.core_num)
        if status != 0:
            raise RuntimeError(f"rope_ops_ascend: no tiling for this call (status {status})")
        launched.append((tag, t))
        if t["blockDim"]:
            sim.run(plan.kernel, plan.dtype, plan.tensors, t, tl.pack(t))

    return KernelOps(lambda *a: run(rope_launch(False, *a), False), lambda *a: run(rope_launch(True, *a), True),
                     lambda *a: run(prologue_launch(*a), "prologue"),
                     lambda *a: run(prologue_grad_launch(*a), "prologue_grad"))


def use_sim_kernels(backend: AscendBackend, sim=None, launched: list | None = None) -> None:
    """Make ``backend``'s kernel tier run the CPU simulation."""
    env = backend._probe()
    env.kernel_ops = sim_kernel_ops(sim, launched)
    env.kernel_status = "loaded (CPU simulation of the shipped kernels)"
