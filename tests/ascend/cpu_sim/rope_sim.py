"""Run the shipped Ascend C kernels on the CPU: build sim_main.cpp with g++ and launch through ctypes.

The kernel source (ascend_kernels/kernels/*.cpp, rope_kernel.h) is compiled unchanged against the
emulated ``kernel_operator.h`` of this directory. ``launch`` takes the same views and tiling the
host glue (rope_host.cpp) would pass on an NPU and runs every AI core's block one after another.
Test-only (never shipped); needs g++ and torch (CPU).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import torch

from rope_ops_backends._paths import source_dir

HERE = Path(__file__).resolve().parent
KERNELS = source_dir("ascend_kernels")  # the shipped kernel sources, checkout or installed
SOURCES = [HERE / "sim_main.cpp", HERE / "kernel_operator.h", *sorted(KERNELS.glob("*.h")),
           *sorted((KERNELS / "kernels").glob("*.cpp"))]
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ROPE, ROPE_GRAD, PROLOGUE, PROLOGUE_GRAD = range(4)  # the kernels of sim_main.cpp's rope_sim_launch


class SimError(RuntimeError):
    pass


def build(out_dir: str | os.PathLike) -> Path:
    """Compile the simulation library into out_dir; returns its path."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise FileNotFoundError("no C++ compiler (g++) found")
    out = Path(out_dir) / "librope_sim.so"
    cmd = [cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared",
           "-Wall", "-Wextra", "-Werror", f"-I{HERE}", f"-I{KERNELS}", str(HERE / "sim_main.cpp"),
           "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def build_cached() -> Path:
    """build() into a temp directory keyed by the sources' hash (shared by test files and runs)."""
    import hashlib
    import tempfile

    h = hashlib.sha256()
    for src in SOURCES:
        h.update(src.name.encode())
        h.update(src.read_bytes())
    out_dir = Path(tempfile.gettempdir()) / f"rope_ops_ascend_sim_{h.hexdigest()[:16]}"
    lib = out_dir / "librope_sim.so"
    if not lib.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out_dir))
        built = build(tmp)
        os.replace(built, lib)  # atomic: concurrent test processes may race
    return lib


class Sim:
    error_type = SimError

    def __init__(self, lib_path: str | os.PathLike):
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.rope_sim_tiling.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        self.lib.rope_sim_launch.argtypes = [
            ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int64, ctypes.c_int64,
            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64), ctypes.c_int,
            ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64), ctypes.c_char_p, ctypes.c_int]
        self.lib.rope_sim_sincos.argtypes = [ctypes.c_int32, ctypes.c_float, ctypes.POINTER(ctypes.c_float),
                                             ctypes.POINTER(ctypes.c_float)]
        self.n_fields = self.lib.rope_sim_fields()

    def c_tiling(self, params: dict, fields: tuple[str, ...], ub_size: int, core_num: int) -> tuple[int, dict]:
        """The C header's compute_rope_tiling on ``params``: (status, struct as a dict)."""
        assert len(fields) == self.n_fields, (len(fields), self.n_fields)
        buf = (ctypes.c_int64 * self.n_fields)()
        for i, name in enumerate(fields):
            buf[i] = int(params.get(name, 0))
        status = self.lib.rope_sim_tiling(ctypes.addressof(buf), ub_size, core_num)
        return status, {name: buf[i] for i, name in enumerate(fields)}

    def sincos(self, top: int, m: float) -> tuple[float, float]:
        c, s = ctypes.c_float(), ctypes.c_float()
        self.lib.rope_sim_sincos(top, m, ctypes.byref(c), ctypes.byref(s))
        return c.value, s.value

    def launch(self, views, tiling: dict, packed: bytes, inverse: bool) -> dict:
        """Run RotaryEmbedding(Grad) for ``views`` (a _kernel_call.KernelViews of CPU tensors) with
        the tiling dict/bytes. Returns statistics; raises SimError on any emulator check."""
        a = views.angles
        tensors = [views.q, views.k, views.q_out, views.k_out, a.pos, a.cos, a.sin, a.freq_turns]
        stats = self.run(ROPE_GRAD if inverse else ROPE, views.q.dtype, tensors, tiling, packed)
        stats.update(q_io=stats["io"](views.q), q_out_io=stats["io"](views.q_out))
        return stats

    def run(self, kernel: int, dtype: torch.dtype, tensors: list, tiling: dict, packed: bytes) -> dict:
        """Launch ``kernel`` on every core in turn with the entry's GM arguments ``tensors`` (CPU
        tensors or None, in the entry's order; the tiling is appended). Statistics: peak UB,
        instruction counters, cos/sin bytes read and written, and ``io(tensor)``: (read, written)
        bytes of that tensor's storage."""
        tiling_buf = ctypes.create_string_buffer(packed, len(packed))
        ptrs = [0 if t is None else t.data_ptr() for t in tensors] + [ctypes.addressof(tiling_buf)]
        args = (ctypes.c_void_p * len(ptrs))(*[p or None for p in ptrs])
        # The memory the kernel may touch: each tensor's whole storage, and the tiling.
        regions, seen = [], set()
        for t in tensors:
            if t is None:
                continue
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                regions.append((st.data_ptr(), st.nbytes()))
        regions.append((ctypes.addressof(tiling_buf), len(packed)))
        reg_ptrs = (ctypes.c_void_p * len(regions))(*[r[0] for r in regions])
        reg_bytes = (ctypes.c_int64 * len(regions))(*[r[1] for r in regions])
        stats = (ctypes.c_int64 * 8)()
        reg_stats = (ctypes.c_int64 * (2 * len(regions)))()
        err = ctypes.create_string_buffer(512)
        rc = self.lib.rope_sim_launch(kernel, DTYPE_CODE[dtype], args, tiling["blockDim"], tiling["ubSize"],
                                      reg_ptrs, reg_bytes, len(regions), stats, reg_stats, err, 512)
        if rc != 0:
            raise SimError(err.value.decode())
        by_ptr = {r[0]: (reg_stats[2 * i], reg_stats[2 * i + 1]) for i, r in enumerate(regions)}

        def io(t):
            return (0, 0) if t is None or not t.untyped_storage().nbytes() else by_ptr[t.untyped_storage().data_ptr()]

        cos, sin = (tensors[5], tensors[6]) if kernel in (ROPE, ROPE_GRAD) else (
            (tensors[7], tensors[8]) if kernel == PROLOGUE else (tensors[9], tensors[10]))
        return {"ub_peak": stats[0], "datacopypad_calls": stats[1], "vector_calls": stats[2],
                "scalar_ub_writes": stats[3], "datacopy_calls": stats[4], "cos_io": io(cos), "sin_io": io(sin),
                "io": io}
