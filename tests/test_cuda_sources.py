"""CUDA backend checks that need no GPU: the kernels compile, availability explains itself,
and importing the backend module has no side effects."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from _cuda_tools import find_nvcc, load_tool

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "csrc" / "check_compile.sh"

# Makes `rope_ops_backends` importable from a checkout that was not pip-installed (the package is
# the directory backends/, see pyproject.toml).
_ALIAS = textwrap.dedent(f"""
    import importlib.util, sys
    try:
        import rope_ops_backends
    except ModuleNotFoundError:
        spec = importlib.util.spec_from_file_location(
            "rope_ops_backends", {str(ROOT / "backends" / "__init__.py")!r},
            submodule_search_locations=[{str(ROOT / "backends")!r}])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["rope_ops_backends"] = mod
        spec.loader.exec_module(mod)
""")


_nvcc = find_nvcc


def _run_python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else []))
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", _ALIAS + textwrap.dedent(code)],
                          capture_output=True, text=True, env=full_env, timeout=300)


def test_check_compile_script():
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (no CUDA toolkit on this machine)")
    env = dict(os.environ, NVCC=nvcc, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(CHECK)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "check_compile: OK" in proc.stdout
    assert "registers" in proc.stdout  # the ptxas report is printed


@pytest.mark.parametrize("source,count,second", [("flat_steps.cu", 19, "flat"),
                                                  ("strided_inplace.cu", 28, "walk")])
def test_kernel_probe_builds_against_the_library(source, count, second):
    """The probe sources in tools/probes include csrc/rope_kernels.cu: they must keep compiling as
    the kernels change, and expose the probe interface tools/kernel_probe.py calls (no GPU
    needed to load one and list its probes)."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (no CUDA toolkit on this machine)")
    lib = load_tool("kernel_probe").build(ROOT / "tools" / "probes" / source, nvcc=nvcc)
    names = [lib.probe_name(i).decode() for i in range(lib.probe_count())]
    assert len(names) == count and names[0].startswith("library default") and second in names[1], names
    assert lib.probe_name(lib.probe_count()) == b""


def test_import_has_no_side_effects(tmp_path):
    proc = _run_python("""
        import sys, os, torch
        before = set(sys.modules)
        import rope_ops_backends.cuda_backend as cb
        assert not torch.cuda.is_initialized(), "import initialized CUDA"
        assert not hasattr(torch.ops, "rope_ops_cuda") or not torch.ops.rope_ops_cuda._dir, "op loaded"
        assert "torch.utils.cpp_extension" not in set(sys.modules) - before, "imported cpp_extension"
        assert not os.path.exists(os.environ["ROPE_OPS_CACHE"]), "created the cache dir"
        b = cb.CudaBackend()
        assert b.name == "cuda" and b.priority == 20 and b.device_types == {"cuda"}
        assert not torch.cuda.is_initialized()
        print("OK")
    """, env={"ROPE_OPS_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_availability_reason_without_cuda(tmp_path):
    proc = _run_python("""
        import os
        import rope_ops_backends.cuda_backend as cb
        reasons = cb.CudaBackend().availability()
        print("REASONS", reasons)
        assert reasons and all(isinstance(r, str) and r for r in reasons)
        # the same answer again, from the cache, still without raising
        assert cb.CudaBackend().availability() == reasons
        assert not os.path.exists(os.environ["ROPE_OPS_CACHE"]), "built or cached something"
        print("OK")
    """, env={"ROPE_OPS_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("REASONS"))
    if torch.version.cuda is None:
        assert "CPU-only" in line and "torch.version.cuda is None" in line
    else:
        assert "device" in line or "CUDA" in line


def test_availability_reasons_for_other_builds(monkeypatch):
    """ROCm builds and version-mismatched extensions are refused with the versions named."""
    sys.path.insert(0, str(ROOT))
    try:
        exec(compile(_ALIAS, "<alias>", "exec"), {})
        import rope_ops_backends.cuda_backend as cb
    finally:
        sys.path.remove(str(ROOT))
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    reasons = cb.environment_reasons()
    assert reasons and "ROCm" in reasons[0]
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    msg = cb._mismatch({"torch": "0.0.1", "cuda": "11.0", "dir": "/x"})
    assert msg and "0.0.1" in msg and torch.__version__ in msg and "build --force" in msg
    assert cb._mismatch({"torch": torch.__version__, "cuda": torch.version.cuda}) is None
    assert cb.arch_flags(["90"]) == ["-gencode=arch=compute_90,code=sm_90",
                                     "-gencode=arch=compute_90,code=compute_90"]


@pytest.mark.skipif(torch.version.cuda is not None, reason="torch has CUDA")
def test_prebuild_command_without_cuda_torch(tmp_path):
    """`build` refuses with the reason (and builds nothing); `info` lists the reasons."""
    cache = tmp_path / "cache"
    proc = _run_python("""
        import contextlib, io
        from rope_ops_backends.cuda_backend.__main__ import main
        for argv, want in ((["build", "--arch", "90"], 1), (["build"], 1), (["info"], 0), ([], 2)):
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                try:
                    rc = main(argv)
                except SystemExit as e:  # argparse
                    rc = e.code
            text = out.getvalue()
            assert rc == want, (argv, rc, text)
            assert argv == [] or "torch.version.cuda is None" in text, (argv, text)
        print("OK")
    """, env={"ROPE_OPS_CACHE": str(cache)})
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    assert not cache.exists()
