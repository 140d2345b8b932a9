"""The CPU backend: C++ kernels in cpu_kernels/, one pass over q and k.

The kernels run threads over tokens (at::parallel_for), rotate in float32 and round to the
storage type once. The fused prologue (rope_ops.qkv_prologue: QKV split, per-head RMSNorm,
rotation, KV-cache write in the data dtype or float8 e4m3, q optionally as float8 e4m3) is one
pass per token over its QKV row too, forward and backward; its norm weights' gradients are summed per chunk of tokens of a
size the shape sets, then over the chunks in order, so they do not depend on the thread count. Each instruction set has its kernel: on x86-64 AVX-512 (with or without
AVX512_BF16) and AVX2, chosen at run time from CPUID; everywhere else a portable one, plain loops
the compiler vectorises. All are in one extension built for the baseline target, so one build
serves every CPU of an architecture.

Importing this module builds nothing. The extension is compiled on first use (the first
``availability()``, which automatic selection asks on the first CPU call) by
``rope_ops_backends._build`` into its private cache, or ahead of time with::

    python -m rope_ops_backends.cpu_backend build

Without a C++ compiler or ninja, or when the build fails, the backend is unavailable with the
reason and the torch backend serves CPU calls. ``ROPE_OPS_CPU_ISA`` (generic, avx2, avx512,
avx512_bf16) forces one instruction set, for tests and benchmarks; ``use_isa`` does the same in
a block.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch

from .._build import memoized_reasons, tail
from rope_ops.backend import Backend, KernelArgs, PrologueArgs, RopeCall, prologue_forward_torch

EXT_NAME = "rope_ops_cpu_ext"
SOURCES = ("rope_cpu_binding.cpp", "rope_cpu_generic.cpp", "rope_cpu_avx2.cpp",
           "rope_cpu_avx512.cpp", "rope_cpu_avx512bf16.cpp")
HEADERS = ("rope_cpu.h", "rope_cpu_kernel.h", "rope_cpu_prologue.h", "rope_cpu_avx512_simd.h",
           "rope_cpu_x86_scalar.h")
ISA_ENV = "ROPE_OPS_CPU_ISA"
PREBUILD_COMMAND = "python -m rope_ops_backends.cpu_backend build"
# The kernels keep rows computed on the fly on the stack: rotary_dim up to this (kMaxHalf in
# rope_cpu_binding.cpp, twice).
MAX_ROTARY_DIM = 8192

_LAYOUT_CODES = {"bshd": 0, "sbhd": 1, "bhsd": 2, "thd": 3}
_ANGLE_CODES = {"table": 0, "token": 1, "mrope": 2}  # RopeCpuAngles in cpu_kernels/rope_cpu.h

_lock = threading.Lock()
_state: dict = {"module": None, "reasons": None}  # one per process


def source_files() -> tuple[list[Path], list[Path]]:
    from .._paths import source_dir

    d = source_dir("cpu_kernels")
    return [d / name for name in SOURCES], [d / name for name in HEADERS]


def _uses_openmp() -> bool:
    """Whether torch's threads are OpenMP's: then at::parallel_for is OpenMP code inlined into
    the extension, which must be compiled with -fopenmp to run in parallel."""
    return sys.platform.startswith("linux") and "parallel backend: OpenMP" in torch.__config__.parallel_info()


def compile_flags() -> tuple[list[str], list[str]]:
    """(compiler flags, linker flags). No -march: the extension is built for the baseline target
    and picks its instruction set at run time. No implicit FMA contraction: where the kernels fuse
    a multiply-add they say so."""
    cflags = ["-O3", "-ffp-contract=off"]
    ldflags = []
    if _uses_openmp():
        cflags.append("-fopenmp")
        ldflags.append("-fopenmp")
    return cflags, ldflags


def toolchain_reasons() -> list[str]:
    """Why the extension cannot be compiled here (no compiler, no ninja)."""
    try:
        from torch.utils import cpp_extension
    except Exception as e:  # a broken torch install
        return [f"torch.utils.cpp_extension unusable: {type(e).__name__}: {e}"]
    reasons = []
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        reasons.append(f"no C++ compiler ({compiler!r} not found; set CXX); cannot build the CPU "
                       "extension")
    if not cpp_extension.is_ninja_available():
        reasons.append("ninja not found (pip install ninja); cannot build the CPU extension")
    return reasons


def build(*, verbose: bool = False) -> list[str]:
    """Build (or load from the cache) the extension into this process. Returns the reasons it
    failed, [] on success."""
    if _state["module"] is not None:
        return []
    from .._build import build_extension

    sources, headers = source_files()
    cflags, ldflags = compile_flags()
    try:  # a cached build loads without a compiler
        module = build_extension(
            EXT_NAME, sources, headers=headers, extra_cflags=cflags, extra_ldflags=ldflags,
            key_extra=[platform.machine()], verbose=verbose,
            message=f"rope_ops: compiling the CPU extension (first use, about a minute; "
                    f"prebuild with `{PREBUILD_COMMAND}`)...")
    except Exception as e:  # no toolchain, compiler errors, cache problems: unavailable
        return toolchain_reasons() or [
            f"building the CPU extension failed: {type(e).__name__}: {tail(str(e))}"]
    requested = os.environ.get(ISA_ENV)
    if requested:
        try:
            module.set_isa(requested)
        except RuntimeError as e:
            return [f"{ISA_ENV}={requested!r}: {e}"]
    _state["module"] = module
    return []


def _module():
    from .._build import loaded_module

    return loaded_module(_state, CpuBackend(), "cpu")


def isa() -> str:
    """The instruction set the kernels run with: 'generic', 'avx2', 'avx512' or 'avx512_bf16'."""
    return _module().isa()


def available_isas() -> list[str]:
    """The instruction sets this CPU can run, best last."""
    return list(_module().available_isas())


@contextlib.contextmanager
def use_isa(name: str):
    """Run the kernels with instruction set ``name`` within the block (tests, benchmarks);
    RuntimeError if this CPU lacks it. Process-wide, not per thread."""
    module = _module()
    previous = module.set_isa(name)
    try:
        yield
    finally:
        module.set_isa(previous)


_is_compiling = torch.compiler.is_compiling


@functools.lru_cache(maxsize=64)
def _mrope_axes(section: tuple, interleaved: bool) -> torch.Tensor:
    """Each frequency's position axis (0 t, 1 h, 2 w) as a contiguous int64 CPU tensor."""
    from rope_ops._mrope import mrope_axes

    return mrope_axes(section, interleaved).contiguous()


def _prologue_axes(args: PrologueArgs):
    if args.rotate and args.angles == "mrope":
        return _mrope_axes(tuple(args.mrope_section), bool(args.mrope_interleaved))
    return None


def _rows_of(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An output gradient as the kernels read it: the data dtype, stride 1 along head_dim (any
    other strides, broadcast ones included)."""
    if grad.dtype != dtype:
        grad = grad.to(dtype)
    if grad.stride(-1) != 1 and grad.shape[-1] > 1:
        grad = grad.contiguous()
    return grad


class CpuBackend(Backend):
    name = "cpu"
    priority = 10  # above the torch fallback
    allocates_outputs = True  # out of place, run() allocates q_out / k_out in C++ when given None
    device_types = frozenset({"cpu"})
    dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    angle_kinds = frozenset(_ANGLE_CODES)
    table_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    supports_prologue = True
    prologue_cache_dtypes = frozenset(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None)
    prologue_q_dtypes = prologue_cache_dtypes  # float8 q (q_scale), rounded as the cache is

    def availability(self) -> list[str]:
        return memoized_reasons(_state, _lock, build, "building the CPU extension failed")

    def supports(self, call: RopeCall) -> list[str]:
        reasons = super().supports(call)
        if call.rotary_dim > MAX_ROTARY_DIM:
            reasons.append(f"rotary_dim {call.rotary_dim} above {MAX_ROTARY_DIM}")
        return reasons

    def run(self, args: KernelArgs):
        """Rotate args.q / args.k into args.q_out / args.k_out and return None; or, out of place
        with args.q_out None, allocate the outputs and return (q_out, k_out)."""
        module = _state["module"] or _module()
        axes = None
        if args.angles == "mrope":
            axes = _mrope_axes(tuple(args.mrope_section), bool(args.mrope_interleaved))
        return module.rope(args.q, args.k, args.q_out, args.k_out, args.pos, args.pos_offset,
                           args.cos, args.sin, args.freq_turns, args.attention_factor,
                           _LAYOUT_CODES[args.layout], args.rotary_dim, args.interleaved,
                           args.inverse, args.inplace, _ANGLE_CODES[args.angles], axes)

    def run_prologue(self, args: PrologueArgs) -> None:
        """The fused prologue's forward: q, k, v into args.q_out/k_out/v_out (or q and k into
        args.qkv in place), and the rotated k and v into the cache at args.slots."""
        if not args.inplace and any(t.stride(-1) != 1 and t.shape[-1] > 1
                                    for t in (args.q_out, args.k_out, args.v_out)):
            prologue_forward_torch(args)  # outputs rope_ops never allocates: the torch ops
            return
        module = _state["module"] or _module()
        module.prologue(args, _prologue_axes(args))

    def run_prologue_backward(self, args: PrologueArgs, grad_q, grad_k, grad_v):
        """(grad_qkv, grad of q_weight, grad of k_weight); weight gradients float32 [D] or None."""
        module = _state["module"] or _module()
        grads = [None if g is None else _rows_of(g, args.qkv.dtype) for g in (grad_q, grad_k, grad_v)]
        return module.prologue_backward(args, *grads, _prologue_axes(args))

    def bind(self, cos, sin, freq_turns, attention_factor, layout, rotary_dim, interleaved, inverse):
        """The C++ BoundRope (with a C++ guard): rope_ops.apply's cached plans call it with
        (q, k, pos, pos_offset)."""
        module = _state["module"]
        if module is None or _is_compiling():
            return None
        return module.BoundRope(cos, sin, freq_turns, float(attention_factor),
                                _LAYOUT_CODES[layout], int(rotary_dim), bool(interleaved),
                                bool(inverse))
