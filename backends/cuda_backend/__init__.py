"""The CUDA backend: hand-written kernels in csrc/ (rope_kernels.cu) behind a torch op.

Importing this module touches no device and builds nothing. The extension (csrc/rope_kernels.cu
+ csrc/rope_binding.cpp) is compiled lazily, the first time ``availability()`` runs in a process
with a CUDA device, by ``torch.utils.cpp_extension.load`` into a cache directory:
``$ROPE_OPS_CACHE/cuda`` (default ``~/.cache/rope_ops/cuda``), for the architectures of the visible
GPUs (real SASS, e.g. sm_90 on H200, plus PTX of the newest one). Prebuild it with::

    python -m rope_ops_backends.cuda_backend build [--force] [--arch 90]

The extension registers the op ``torch.ops.rope_ops_cuda.rope`` (see csrc/rope_binding.cpp), used
when traced (torch.compile), and is also a Python module whose ``rope`` function is the same
launch without the dispatcher (about 10 us less host time per call), used by ``run`` in eager
mode; out of place with ``q_out is None`` it allocates and returns the outputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import threading
from pathlib import Path

import torch

from rope_ops.backend import Backend, KernelArgs

EXT_NAME = "rope_ops_cuda_ext"
SOURCES = ("rope_kernels.cu", "rope_binding.cpp")
HEADERS = ("rope_kernels.h",)
BUILD_INFO = "build_info.json"
PREBUILD_COMMAND = "python -m rope_ops_backends.cuda_backend build --force"

_LAYOUT_CODES = {"bshd": 0, "sbhd": 1, "bhsd": 2, "thd": 3}

_lock = threading.Lock()
_state: dict = {"op": None, "eager": None, "module": None, "reasons": None,
                "pdl_default": 1}  # one per process


def cache_root() -> Path:
    """Where built extensions live: $ROPE_OPS_CACHE, else $XDG_CACHE_HOME/rope_ops or ~/.cache."""
    env = os.environ.get("ROPE_OPS_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "rope_ops"


def source_files() -> list[Path]:
    from .._paths import source_dir

    d = source_dir("csrc")
    return [d / name for name in SOURCES]


def _sources_digest() -> str:
    from .._paths import source_dir

    d = source_dir("csrc")
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((d / name).read_bytes())
    return h.hexdigest()[:16]


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


def build_dir(archs: list[str]) -> Path:
    return cache_root() / "cuda" / f"{EXT_NAME}-sm{'_'.join(archs)}"


def _tail(text: str, n: int = 1500) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


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
        return [f"CUDA is not usable: {type(e).__name__}: {_tail(str(e), 300)}"]
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


def _read_info(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _mismatch(info: dict) -> str | None:
    want = {"torch": torch.__version__, "cuda": torch.version.cuda}
    have = {"torch": info.get("torch"), "cuda": info.get("cuda")}
    if have == want:
        return None
    return (f"the CUDA extension in {info.get('dir')} was built for torch {have['torch']} with "
            f"CUDA {have['cuda']}, but this process runs torch {want['torch']} with CUDA "
            f"{want['cuda']}; rebuild it with `{PREBUILD_COMMAND}`")


def build(archs: list[str] | None = None, *, force: bool = False, verbose: bool = False) -> list[str]:
    """Build (or load) the extension into this process. Returns reasons it failed, [] on success."""
    if _state["op"] is not None:
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
    from torch.utils import cpp_extension

    out = build_dir(archs)
    info_path = out / BUILD_INFO
    if force and out.exists():
        shutil.rmtree(out, ignore_errors=True)
    info = _read_info(info_path)
    if info is not None:
        bad = _mismatch(info)
        if bad:
            return [bad]
    digest = _sources_digest()
    if info is None or info.get("sources") != digest:
        print(f"rope_ops: compiling the CUDA extension for sm_{','.join(archs)} into {out} "
              "(first use; about a minute)...", file=sys.stderr, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    try:
        module = cpp_extension.load(
            name=f"{EXT_NAME}_sm{'_'.join(archs)}",
            sources=[str(p) for p in source_files()],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3", "-lineinfo", *arch_flags(archs)],
            build_directory=str(out),
            is_python_module=True,
            verbose=verbose,
        )
    except Exception as e:
        return [f"building the CUDA extension in {out} failed: {type(e).__name__}: {_tail(str(e))}"]
    try:
        op = torch.ops.rope_ops_cuda.rope.default
    except Exception as e:
        return [f"the CUDA extension loaded but has no op rope_ops_cuda::rope: {e}"]
    info_path.write_text(json.dumps({
        "torch": torch.__version__, "cuda": torch.version.cuda, "archs": archs,
        "sources": digest, "dir": str(out),
    }, indent=1))
    _state["module"] = module
    # Programmatic dependent launch needs kernels built for sm_90+ (below, the wait before the
    # first load is compiled out: a PTX-JIT build for an older arch must not use it).
    _state["pdl_default"] = int(os.environ.get("ROPE_OPS_CUDA_PDL", "1") != "0"
                                and max(int(re.match(r"\d+", a).group()) for a in archs) >= 90)
    set_launch()
    _state["eager"] = module.rope
    _state["op"] = op
    return []


_is_compiling = torch.compiler.is_compiling


class CudaBackend(Backend):
    name = "cuda"
    priority = 20
    allocates_outputs = True  # run() allocates q_out / k_out in C++ when given None
    device_types = frozenset({"cuda"})
    dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})

    def availability(self) -> list[str]:
        reasons = _state["reasons"]
        if reasons is None:
            with _lock:
                reasons = _state["reasons"]
                if reasons is None:
                    reasons = environment_reasons()
                    if not reasons:
                        try:
                            reasons = build()
                        except Exception as e:  # never raise from availability
                            reasons = [f"building the CUDA extension failed: "
                                       f"{type(e).__name__}: {_tail(str(e))}"]
                    _state["reasons"] = reasons
        return list(reasons)

    def run(self, args: KernelArgs):
        """Rotate args.q / args.k into args.q_out / args.k_out and return None; or, out of place
        with args.q_out None, allocate the outputs and return (q_out, k_out)."""
        eager = _state["eager"]
        if eager is None:
            reasons = self.availability()
            eager = _state["eager"]
            if eager is None:
                raise RuntimeError("rope_ops cuda backend unavailable: " + "; ".join(reasons))
        pos = args.pos
        if pos is not None and not pos.is_cuda:  # positions handed over on the host
            pos = pos.to(args.q.device, non_blocking=True)
        if not _is_compiling():
            # pybind11 entry: no dispatcher, outputs allocated in C++ when q_out is None.
            return eager(args.q, args.k, args.q_out, args.k_out, pos, args.pos_offset, args.cos,
                         args.sin, args.freq_turns, args.attention_factor,
                         _LAYOUT_CODES[args.layout], args.rotary_dim, args.interleaved,
                         args.inverse, args.inplace)
        q_out, k_out = args.q_out, args.k_out
        made = q_out is None
        if made:
            q_out = torch.empty_like(args.q)
            k_out = None if args.k is None else torch.empty_like(args.k)
        _state["op"](args.q, args.k, q_out, k_out, pos, args.pos_offset, args.cos, args.sin,
                     args.freq_turns, args.attention_factor, _LAYOUT_CODES[args.layout],
                     args.rotary_dim, args.interleaved, args.inverse, args.inplace)
        return (q_out, k_out) if made else None

    def bind(self, cos, sin, freq_turns, attention_factor, layout, rotary_dim, interleaved, inverse):
        """The C++ BoundRope: rope_ops.apply's cached plans call it with (q, k, pos, pos_offset)."""
        if _state["module"] is None or _is_compiling():
            return None
        return _state["module"].BoundRope(cos, sin, freq_turns, float(attention_factor),
                                          _LAYOUT_CODES[layout], int(rotary_dim), bool(interleaved),
                                          bool(inverse))


def set_tuning(max_heads_per_thread: int = 0, min_threads_per_sm: int = 0) -> None:
    """Grid tuning of the fast kernel, process-wide (benchmarks); 0 leaves a knob unchanged."""
    torch.ops.rope_ops_cuda.set_tuning(max_heads_per_thread, min_threads_per_sm)


def set_config(variant: int = -1, max_heads_per_thread: int = -1, min_threads_per_sm: int = -1) -> None:
    """Force a fast-kernel variant and grid knobs for every call (benchmarks); -1 restores the
    per-class defaults (kDefaultConfig in csrc/rope_kernels.cu)."""
    torch.ops.rope_ops_cuda.set_config(variant, max_heads_per_thread, min_threads_per_sm)


def set_launch(block_threads: int = -1, rows_on_the_fly: int = -1, pdl: int = -1) -> None:
    """Launch knobs for every call (benchmarks): every call sets all three, -1 restoring a knob's
    default.

    block_threads: threads per block (32..256; default per call class). rows_on_the_fly: 1 computes
    every cos/sin row from the fixed-point frequencies instead of reading the table (tables built
    by rope_ops only; default per call class). pdl: 0 turns programmatic dependent launch off
    (on by default when built for sm_90+; also ROPE_OPS_CUDA_PDL=0): with it a kernel is scheduled while the
    previous kernel in the stream drains and waits for it before touching memory.
    """
    if pdl == -1:
        pdl = _state.get("pdl_default", 1)  # from ROPE_OPS_CUDA_PDL and the build architectures
    torch.ops.rope_ops_cuda.set_launch(block_threads, rows_on_the_fly, pdl)


def set_flat_lean(lean: int = -1) -> None:
    """The flat path's lean kernel (benchmarks, checks): 0 never, 1 wherever it can take the call
    (decode-sized calls included), -1 the default (where it can take the call and the call is
    not decode-sized); see rope_set_flat_lean in csrc/rope_kernels.h."""
    torch.ops.rope_ops_cuda.set_flat_lean(lean)


def num_variants() -> int:
    return int(torch.ops.rope_ops_cuda.num_variants())


def last_variant() -> int:
    """Variant of the last fast-path launch (-1: one head per thread)."""
    return int(torch.ops.rope_ops_cuda.last_variant())


def variant_name(variant: int) -> str:
    return _state["module"].variant_name(variant)
