"""CUDA backend checks that need no GPU: the kernels compile, availability explains itself,
and importing the backend module has no side effects."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from _cuda_tools import find_nvcc

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


def test_import_has_no_side_effects(tmp_path):
    proc = _run_python("""
        import sys, os, torch
        before = set(sys.modules)
        import rope_ops_backends.cuda_backend as cb
        assert not torch.cuda.is_initialized(), "import initialized CUDA"
        assert not any(m.startswith("rope_ops_cuda_ext") for m in sys.modules), "extension loaded"
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


def _backend_module():
    sys.path.insert(0, str(ROOT))
    try:
        exec(compile(_ALIAS, "<alias>", "exec"), {})
        import rope_ops_backends.cuda_backend as cb
    finally:
        sys.path.remove(str(ROOT))
    return cb


def test_availability_reasons_for_other_builds(monkeypatch):
    """ROCm builds are refused with the version named; the build flags name the architectures."""
    cb = _backend_module()
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    reasons = cb.environment_reasons()
    assert reasons and "ROCm" in reasons[0]
    assert cb.arch_flags(["80", "90"]) == ["-gencode=arch=compute_80,code=sm_80",
                                           "-gencode=arch=compute_90,code=sm_90",
                                           "-gencode=arch=compute_90,code=compute_90"]


def test_availability_never_raises(monkeypatch):
    """Whatever goes wrong while looking for CUDA or building becomes a reason."""
    cb = _backend_module()
    monkeypatch.setitem(cb._state, "reasons", None)

    def broken():
        raise OSError("driver exploded")

    monkeypatch.setattr(cb, "environment_reasons", broken)
    (reason,) = cb.CudaBackend().availability()
    assert "driver exploded" in reason
    assert cb.CudaBackend().availability() == [reason]  # decided once per process


def test_a_build_waits_for_another_only_so_long(monkeypatch, tmp_path):
    """While another process holds the build lock of this extension, build() waits at most
    ROPE_OPS_BUILD_TIMEOUT seconds and then returns why, holding nothing."""
    import fcntl
    import time

    cb = _backend_module()
    monkeypatch.setenv("ROPE_OPS_CACHE", str(tmp_path))
    monkeypatch.setenv("ROPE_OPS_BUILD_TIMEOUT", "0.5")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(cb, "toolchain_reasons", lambda: [])
    lock = tmp_path / cb.EXT_NAME / ".lock"
    lock.parent.mkdir(parents=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another build in progress
        start = time.monotonic()
        (reason,) = cb.build(["90"])
        assert time.monotonic() - start < 10
    assert "another process" in reason and "ROPE_OPS_BUILD_TIMEOUT" in reason


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
