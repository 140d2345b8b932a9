"""Shared by the CUDA backend's tests: this machine's nvcc, the repo's tools/ scripts as modules,
and the host emulation (tests/csrc/), built once per test process:

- ``emulation_library()``: tests/csrc/rope_emulation.cu, the kernels' C API (csrc/rope.h) with
  every launch run on the CPU (nvcc, host code only);
- ``emulated_extension()``: the CUDA backend's extension module (csrc/rope_torch.h) built for CPU
  tensors over that library (tests/csrc/emulated_binding.cpp): run, candidates, run_with,
  BoundRope and its guard and autograd, exactly as on a GPU.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
CSRC = ROOT / "csrc"
TEST_CSRC = Path(__file__).resolve().parent / "csrc"


def load_tool(name: str):
    """tools/<name>.py as a module (registered in sys.modules: dataclasses look themselves up
    there)."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def find_nvcc() -> str | None:
    """$NVCC, nvcc on PATH, or $CUDA_HOME / /usr/local/cuda's; None when there is none."""
    if os.environ.get("NVCC"):
        return os.environ["NVCC"]
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return None


def cuda_home(nvcc: str) -> Path:
    """The toolkit nvcc belongs to (its include/ and lib64/), as nvcc itself reports it."""
    out = subprocess.run([nvcc, "-dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    for line in out.splitlines():
        if line.startswith("#$ TOP="):
            return Path(line.split("=", 1)[1].strip()).resolve()
    return Path(os.path.realpath(nvcc)).parents[1]


@functools.cache
def _build_dir() -> Path:
    """A private directory for this process's builds, removed when it exits."""
    path = Path(tempfile.mkdtemp(prefix="rope_cuda_emulation_"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def emulation_library() -> Path | None:
    """librope_emulation.so (built here once per process), or None without nvcc."""
    nvcc = find_nvcc()
    if nvcc is None:
        return None
    out = _build_dir() / "librope_emulation.so"
    proc = subprocess.run(
        [nvcc, "-O2", "-std=c++17", "-Xcompiler", "-fPIC", "-shared", "-cudart", "shared",
         "-gencode=arch=compute_90,code=sm_90", f"-I{CSRC}", str(TEST_CSRC / "rope_emulation.cu"),
         "-o", str(out)],
        capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"building the host emulation failed:\n{proc.stderr[-4000:]}")
    return out


@functools.cache
def emulation_c_api() -> ctypes.CDLL | None:
    """The library's C API, for what the tests ask of it directly (the same loaded copy the
    extension uses)."""
    path = emulation_library()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    lib.rope_emulated_kernels.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.rope_emulated_kernels.restype = ctypes.c_int
    lib.rope_emulated_reset.restype = None
    lib.rope_fast_div.argtypes = [ctypes.c_uint32, ctypes.c_uint32]
    lib.rope_fast_div.restype = ctypes.c_uint32
    return lib


def kernels_run(lib) -> set[str]:
    """The kernel instantiations the emulation ran since its last reset."""
    n = lib.rope_emulated_kernels(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    lib.rope_emulated_kernels(buf, n + 1)
    return set(buf.value.decode().split())


@functools.cache
def emulated_extension():
    """The CUDA backend's extension module on CPU tensors (see the module docstring), or None
    without nvcc."""
    library = emulation_library()
    if library is None:
        return None
    from torch.utils import cpp_extension

    home = cuda_home(find_nvcc())
    lib64 = home / "lib64" if (home / "lib64").is_dir() else home / "lib"
    build = _build_dir() / "extension"
    build.mkdir(exist_ok=True)
    return cpp_extension.load(
        name="rope_ops_cuda_emulated", sources=[str(TEST_CSRC / "emulated_binding.cpp")],
        extra_cflags=["-O2", f"-I{CSRC}", f"-I{home / 'include'}"],
        extra_ldflags=[f"-L{library.parent}", "-lrope_emulation", f"-Wl,-rpath,{library.parent}",
                       f"-L{lib64}", "-lcudart", f"-Wl,-rpath,{lib64}"],
        build_directory=str(build), verbose=False)


@pytest.fixture(scope="module")
def ext():
    """The CUDA extension module over the host emulation; skipped without nvcc."""
    module = emulated_extension()
    if module is None:
        pytest.skip("nvcc not found (no CUDA toolkit on this machine)")
    return module
