"""The CUDA backend: hand-written kernels in csrc/ behind a small extension module.

Importing this module touches no device and builds nothing. The extension (csrc/rope_launch.cu +
csrc/rope_binding.cpp) is built the first time ``availability()`` runs in a process with a CUDA
device, through ``rope_ops_backends._build`` into the private cache (``$ROPE_OPS_CACHE``, default
``~/.cache/rope_ops``), for the architectures of the visible GPUs (real SASS, plus PTX of the
newest one; ``$ROPE_OPS_CUDA_ARCH`` overrides, e.g. ``90`` or ``80;90``). Prebuild it with::

    python -m rope_ops_backends.cuda_backend build [--force] [--arch 90]

``run`` hands the whole ``KernelArgs`` to the extension, which reads its fields in C++. Which
kernel runs is decided in C++ from the call and the device alone (csrc/policy.h).

Rotations take three angle sources: position tables, the caller's cos/sin per token and mRoPE.
Interleaved mRoPE ranks below the Triton backend, whose kernels measured faster on it
(``priority_for``).

The fused prologue (rope_ops.qkv_prologue) runs csrc/kernel_prologue.cuh, forward and backward,
for position tables (mRoPE and per-token caller tables are refused: selection sends them to
another backend), with caches of qkv's dtype or float8 e4m3, and q optionally as float8 e4m3
(q_scale). Calls its kernels cannot take (head rows of more than 128 vectors or elements, outputs
without stride 1 on head_dim) run rope_ops' torch ops.

For benchmark tooling only (not API): ``kernel_candidates(args)`` lists every kernel
configuration that can take a call, the policy's choice first, and ``run_with(args, candidate)``
runs the call with one of them.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import torch

from .._build import memoized_reasons, tail
from rope_ops.backend import (Backend, KernelArgs, PrologueArgs, RopeCall, prologue_backward_torch,
                              prologue_forward_torch)

EXT_NAME = "rope_ops_cuda_ext"
SOURCES = ("rope_launch.cu", "rope_binding.cpp")
PREBUILD_COMMAND = "python -m rope_ops_backends.cuda_backend build"

_lock = threading.Lock()
_state: dict = {"module": None, "reasons": None}  # one per process


def source_files() -> tuple[list[Path], list[Path]]:
    """(sources compiled, headers they include) in csrc/."""
    from .._paths import source_dir

    d = source_dir("csrc")
    headers = sorted(p for p in d.iterdir() if p.suffix in (".h", ".cuh"))
    return [d / name for name in SOURCES], headers


def visible_archs() -> list[str]:
    """Compute capabilities to build for, as "90"-style strings.

    $ROPE_OPS_CUDA_ARCH ("90" or "80;90") overrides; otherwise those of the visible devices.
    """
    env = os.environ.get("ROPE_OPS_CUDA_ARCH")
    if env:
        return sorted({a.strip().replace(".", "") for a in env.replace(",", ";").split(";") if a.strip()})
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return sorted(f"{major}{minor}" for major, minor in caps)


def arch_flags(archs: list[str]) -> list[str]:
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    if archs:  # PTX of the newest architecture too, for newer GPUs
        flags.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    return flags


def environment_reasons() -> list[str]:
    """Why no CUDA extension can run in this process, without building anything."""
    if getattr(torch.version, "hip", None):
        return [f"torch {torch.__version__} is a ROCm (HIP {torch.version.hip}) build; "
                "the CUDA backend needs a CUDA build of torch"]
    if torch.version.cuda is None:
        return [f"torch {torch.__version__} has no CUDA (torch.version.cuda is None: CPU-only build)"]
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as e:  # broken driver and the like
        return [f"CUDA is not usable: {type(e).__name__}: {tail(str(e), 300)}"]
    if count == 0:
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        extra = f" (CUDA_VISIBLE_DEVICES={vis!r})" if vis is not None else ""
        return [f"no CUDA device visible{extra}"]
    return []


def toolchain_reasons() -> list[str]:
    """Why the extension cannot be compiled here (no nvcc, no ninja)."""
    try:
        from torch.utils import cpp_extension
    except Exception as e:
        return [f"torch.utils.cpp_extension unusable: {type(e).__name__}: {e}"]
    reasons = []
    home = cpp_extension.CUDA_HOME
    nvcc = Path(home) / "bin" / "nvcc" if home else None
    if nvcc is None or not nvcc.exists():
        reasons.append(f"nvcc not found (CUDA_HOME={home!r}; set CUDA_HOME to a CUDA toolkit "
                       f"matching torch's CUDA {torch.version.cuda}); cannot build the CUDA "
                       "extension")
    if not cpp_extension.is_ninja_available():
        reasons.append("ninja not found (pip install ninja); cannot build the CUDA extension")
    return reasons


def kernel_args_reasons(module) -> list[str]:
    """The extension reads KernelArgs' fields by position: refuse a rope_ops whose fields differ
    from those it reads (later fields, of variants this backend does not declare, are not read)."""
    built_for = list(module.kernel_args_fields)
    if built_for != list(KernelArgs._fields[:len(built_for)]):
        return [f"rope_ops.backend.KernelArgs has fields {list(KernelArgs._fields)}; the CUDA "
                f"extension reads {built_for}: rope_ops and its CUDA backend do not match"]
    return []


def cache_dir() -> Path:
    from .._build import cache_root

    return cache_root() / EXT_NAME


def build(archs: list[str] | None = None, *, force: bool = False, verbose: bool = False) -> list[str]:
    """Build (or load) the extension into this process. Returns why it failed, [] on success."""
    if _state["module"] is not None and not force:
        return []
    if getattr(torch.version, "hip", None) or torch.version.cuda is None:
        return environment_reasons()
    if archs is None:
        archs = visible_archs()
    if not archs:
        return ["no CUDA architecture to build for (no visible device; set ROPE_OPS_CUDA_ARCH)"]
    reasons = toolchain_reasons()
    if reasons:
        return reasons
    from .._build import BuildError, build_extension

    if force:
        shutil.rmtree(cache_dir(), ignore_errors=True)
    sources, headers = source_files()
    try:
        module = build_extension(
            EXT_NAME, sources, headers=headers, extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-lineinfo", *arch_flags(archs)], key_extra=archs,
            message=f"rope_ops: compiling the CUDA extension for sm_{','.join(archs)} (first use; "
                    f"about a minute; `{PREBUILD_COMMAND}` does it ahead of time)...",
            verbose=verbose)
    except BuildError as e:
        return [f"the CUDA extension: {e}"]
    except Exception as e:  # the compiler's own errors
        return [f"building the CUDA extension failed: {type(e).__name__}: {tail(str(e))}"]
    reasons = kernel_args_reasons(module)
    if not reasons:
        _state["module"] = module
    return reasons


_is_compiling = torch.compiler.is_compiling


class CudaBackend(Backend):
    name = "cuda"
    priority = 20
    allocates_outputs = True  # run() allocates q_out / k_out in C++ when given None
    device_types = frozenset({"cuda"})
    dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    # Angle sources (csrc/angle_sources.cuh): position tables; the caller's cos/sin per token,
    # float32 or half precision; mRoPE. Position tables (table, mrope) are read as float32.
    angle_kinds = frozenset({"table", "token", "mrope"})
    table_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    supports_prologue = True
    prologue_cache_dtypes = frozenset(
        {d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None})
    # float8 q (PrologueArgs.q_scale), converted as the cache is. __nv_cvt_float_to_fp8 has a
    # software path below compute capability 8.9, so neither is refused on older GPUs.
    prologue_q_dtypes = prologue_cache_dtypes

    def availability(self) -> list[str]:
        """Why this process cannot run the CUDA kernels; builds the extension on first call.
        Never raises; waits for another process's build of the same sources at most
        ROPE_OPS_BUILD_TIMEOUT seconds (the build lock dies with its holder)."""
        return memoized_reasons(_state, _lock, lambda: environment_reasons() or build(),
                                "the CUDA extension could not be loaded")

    def run(self, args: KernelArgs):
        """Rotate args.q / args.k into args.q_out / args.k_out (or in place) and return None; or,
        out of place with args.q_out None, allocate the outputs and return (q_out, k_out)."""
        return _module().run(args)

    # Between the torch fallback and the Triton backend (priority 10).
    BELOW_TRITON = 5

    def priority_for(self, call: RopeCall) -> int:
        # Fused prologue calls rank below Triton, whose prologue measured faster in every case on
        # the H200 (csrc/NOTES.md's tables: 106.9 us against 120.2 on a Qwen3-8B-like prefill,
        # 148.4 against 173.2 on the bf16 training step, 4.54 against 4.93 on a 256-token decode
        # with a cache write); on the H100 they tied on the prefill (143.6 against 143.7) and
        # the training step (194.7 against 192.3), Triton faster on the decode (5.08 against 5.51).
        if call.op == "prologue":
            return self.BELOW_TRITON
        # Interleaved mRoPE (Qwen3-VL) ranks below Triton: on the H200 these kernels took 50.2 us
        # against Triton's 46.7 (bshd) and 46.3 (thd) on Qwen3-VL-8B prefills, while chunked
        # mRoPE took 38.6 against 46.7 and 45.2 and per-token tables tied (45.3 / 45.0 us) at a
        # sixth of Triton's host time per call (benchmarks/results-h200.md).
        if call.angles == "mrope" and call.mrope_interleaved:
            return self.BELOW_TRITON
        # Named (ROPE_OPS_BACKEND=cuda), or without Triton, the kernels run every call.
        return self.priority

    def supports(self, call: RopeCall) -> list[str]:
        reasons = super().supports(call)
        if call.op == "prologue" and call.angles != "table":
            reasons.append(f"the prologue kernels read position tables only (angles 'table'), "
                           f"not {call.angles!r}")
        if call.angles != "token" and call.table_dtype != torch.float32:
            reasons.append(f"position tables (angles {call.angles!r}) are read as float32, "
                           f"not {call.table_dtype}")
        return reasons

    def run_prologue(self, args: PrologueArgs) -> None:
        run_prologue(_module(), args)

    def run_prologue_backward(self, args: PrologueArgs, grad_q, grad_k, grad_v):
        return run_prologue_backward(_module(), args, grad_q, grad_k, grad_v)

    def bind(self, cos, sin, freq_turns, attention_factor, layout, rotary_dim, interleaved, inverse):
        """The C++ BoundRope: called with (q, k, pos, pos_offset); ``.guarded(q, k, pos)`` for
        repeats of inference calls, ``.with_grad(q, k, pos, pos_offset)`` for calls that need a
        gradient (autograd in C++; its backward is the bound rotation the other way)."""
        module = _state["module"]
        if module is None or _is_compiling():
            return None
        return module.BoundRope(cos, sin, freq_turns, float(attention_factor), layout,
                                int(rotary_dim), bool(interleaved), bool(inverse))


def _module():
    from .._build import loaded_module

    return loaded_module(_state, CudaBackend(), "cuda")


def run_prologue(module, args: PrologueArgs) -> None:
    """The prologue's forward through ``module`` (the extension); rope_ops' torch ops where its
    kernels cannot take the call."""
    if not module.prologue(args):
        prologue_forward_torch(args)


def run_prologue_backward(module, args: PrologueArgs, grad_q, grad_k, grad_v):
    """(grad_qkv, grad of q_weight, grad of k_weight) through ``module``; the weight gradients are
    the kernel's per-block partial sums added in a fixed order (deterministic)."""
    out = module.prologue_backward(args, grad_q, grad_k, grad_v)
    if out is None:
        return prologue_backward_torch(args, grad_q, grad_k, grad_v)
    return tuple(out)


def kernel_candidates(args: KernelArgs) -> list[str]:
    """Benchmark tooling, not API: labels of every kernel configuration that can take this call,
    the policy's own choice first (out of place without outputs: as run() would allocate them).
    Labels: csrc/candidates.h."""
    return list(_module().candidates(args))


def run_with(args: KernelArgs, candidate: str) -> None:
    """Benchmark tooling, not API: run the call with configuration ``candidate`` (one of
    kernel_candidates(args)); the outputs must be given in args (or in place)."""
    _module().run_with(args, candidate)
