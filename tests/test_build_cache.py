"""The extension cache (backends/_build.py): private, serialized by a lock that dies with its
holder, and loading only what its own build produced and hashed."""

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from rope_ops_backends import _build


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.delenv("ROPE_OPS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "rope_ops"


def test_default_root_is_created_private_and_tightened(cache):
    old = os.umask(0o022)
    try:
        root = _build.private_dir(_build.cache_root())
    finally:
        os.umask(old)
    assert root == cache and stat.S_IMODE(root.stat().st_mode) == 0o700
    os.chmod(root, 0o777)
    _build.private_dir(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_a_library_nobody_vouched_for_is_never_loaded(cache, tmp_path):
    """A .so dropped into the cache (no build_info, or one that does not match) is refused; a
    stale or corrupt build is reported as such so the next build replaces it."""
    d = cache / "ext" / "key"
    d.mkdir(parents=True)
    planted = d / "ext_key.so"
    planted.write_bytes(b"\x7fELF not really")
    assert _build.load_verified("ext_key", d) is None  # no info: nothing is loaded
    info = d / _build.INFO
    info.write_text(json.dumps({"library": planted.name, "sha256": "0" * 64}))
    os.chmod(info, 0o600)
    os.chmod(planted, 0o700)
    with pytest.raises(_build.StaleBuild, match="SHA-256"):
        _build.load_verified("ext_key", d)
    info.write_text(json.dumps({"library": "../elsewhere.so", "sha256": "0" * 64}))
    with pytest.raises(_build.BuildError, match="library path"):
        _build.load_verified("ext_key", d)
    info.write_text(json.dumps({"library": planted.name, "sha256": _build.sha256_of(planted)}))
    os.chmod(planted, 0o722)  # writable by others: whoever could write it is not vouched for
    with pytest.raises(_build.BuildError, match="writable by group or others"):
        _build.load_verified("ext_key", d)
    os.chmod(info, 0o666)
    with pytest.raises(_build.BuildError, match="writable by group or others"):
        _build.load_verified("ext_key", d)


def test_build_lock_recovers_from_a_dead_holder(tmp_path):
    """A process that dies holding the lock (killed mid-build) releases it with its death."""
    lock = tmp_path / ".lock"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(_build.BuildError, match="over 0.5 s"):
        with _build._build_lock(lock, timeout=0.5):
            pass
    holder.send_signal(signal.SIGKILL)
    holder.wait(30)
    start = time.monotonic()
    with _build._build_lock(lock, timeout=5):
        pass
    assert time.monotonic() - start < 2


def test_build_key_changes_with_sources_and_flags(tmp_path):
    src = tmp_path / "a.cpp"
    src.write_text("int f() { return 1; }")
    first = _build.build_key("x", [src], [], ["-O3"])
    assert _build.build_key("x", [src], [], ["-O2"]) != first
    src.write_text("int f() { return 2; }")
    assert _build.build_key("x", [src], [], ["-O3"]) != first
