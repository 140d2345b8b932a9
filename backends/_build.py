"""Building a C++/CUDA extension on first use into a private, verified cache, and loading it.

What it guarantees:

- The cache root is ``$ROPE_OPS_CACHE`` if set (the user's choice, used as it is), else
  ``$XDG_CACHE_HOME/rope_ops`` or ``~/.cache/rope_ops``, which must be private: created with
  mode 0700, a root owned by this user with group/other permissions is tightened to 0700, and
  one owned by another user is refused.
- Only artifacts this process's build produced are loaded: a build writes ``build_info.json``
  with the SHA-256 of the library; a later load recomputes that hash and refuses a library
  (or info file) that differs, is not owned by this user, or is writable by group or others.
  A library dropped into the cache by anyone else is therefore never imported.
- One build at a time per extension, by ``flock`` on a lock file: the kernel releases it when
  its holder dies, so a crashed build never blocks later ones. Each build runs in a fresh
  private temporary directory and is moved into place only once complete and hashed.
- The key of a build is the hash of its sources, flags, torch version and Python: editing a
  source or upgrading torch builds anew in a new directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path

import torch

INFO = "build_info.json"


class BuildError(RuntimeError):
    """Building or loading an extension failed; the message says why and what to do."""


class StaleBuild(BuildError):
    """A cached build whose files do not match what its build recorded (corrupt or replaced):
    it is never loaded; the next build replaces it."""


def cache_root() -> Path:
    """Where built extensions live (see the module docstring)."""
    env = os.environ.get("ROPE_OPS_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "rope_ops"


def _user_chose_root() -> bool:
    return bool(os.environ.get("ROPE_OPS_CACHE"))


def private_dir(path: Path, *, enforce: bool = True) -> Path:
    """Create ``path`` (mode 0700) if missing; with ``enforce``, check that it is this user's and
    tighten group/other permissions away. BuildError when it belongs to someone else."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not enforce or not hasattr(os, "getuid"):
        return path
    info = path.stat()
    if info.st_uid != os.getuid():
        raise BuildError(f"the rope_ops cache directory {path} belongs to uid {info.st_uid}, not to "
                         f"this user ({os.getuid()}); refusing to build or load extensions there. "
                         "Remove it or set ROPE_OPS_CACHE to a directory of your own.")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def _trusted_file(path: Path) -> str | None:
    """None if ``path`` is a regular file of this user that group/others cannot write, else why not."""
    try:
        info = path.lstat()
    except OSError as error:
        return f"{path}: {error}"
    if not stat.S_ISREG(info.st_mode):
        return f"{path} is not a regular file"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"{path} belongs to uid {info.st_uid}, not to this user"
    if stat.S_IMODE(info.st_mode) & 0o022:
        return f"{path} is writable by group or others"
    return None


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_key(name: str, sources: list[Path], headers: list[Path], flags: list[str]) -> str:
    h = hashlib.sha256()
    for item in (name, torch.__version__, str(torch.version.cuda), sys.version, *flags):
        h.update(item.encode())
        h.update(b"\0")
    for path in [*sources, *headers]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def import_from(name: str, library: Path):
    """Import the extension module ``name`` from the shared library at ``library``."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, str(library), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load_verified(name: str, directory: Path):
    """The module built in ``directory`` if its build_info.json vouches for its library, else
    None (no build there yet); BuildError if something there is not what our build wrote."""
    info_path = directory / INFO
    if not info_path.exists():
        return None
    bad = _trusted_file(info_path)
    if bad:
        raise BuildError(f"refusing the cached build in {directory}: {bad}")
    try:
        info = json.loads(info_path.read_text())
        library = directory / info["library"]
        expected = info["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise StaleBuild(f"refusing the cached build in {directory}: unreadable {INFO} ({error})") from None
    if Path(info["library"]).name != info["library"]:
        raise BuildError(f"refusing the cached build in {directory}: library path {info['library']!r}")
    bad = _trusted_file(library)
    if bad:
        raise BuildError(f"refusing the cached build in {directory}: {bad}")
    if sha256_of(library) != expected:
        raise StaleBuild(f"refusing the cached build in {directory}: {library.name} is not the "
                         f"library that build produced (SHA-256 differs); delete {directory}")
    return import_from(name, library)


@contextlib.contextmanager
def _build_lock(path: Path, timeout: float):
    """An exclusive flock on ``path``, released by the kernel if this process dies."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): builds are still atomic, just not serialized
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BuildError(f"another process has been building into {path.parent} for "
                                     f"over {timeout:g} s (ROPE_OPS_BUILD_TIMEOUT)") from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # releases the lock


def _sweep_stale(parent: Path, prefix: str, older_than: float = 24 * 3600) -> None:
    """Remove temporary build directories of builds that died (left over a day ago)."""
    now = time.time()
    for entry in parent.glob(prefix + "*"):
        with contextlib.suppress(OSError):
            if entry.is_dir() and now - entry.stat().st_mtime > older_than:
                shutil.rmtree(entry, ignore_errors=True)


def build_extension(name: str, sources: list[Path], *, headers: list[Path] = (),
                    extra_cflags: list[str] = (), extra_cuda_cflags: list[str] = (),
                    extra_ldflags: list[str] = (), key_extra: list[str] = (),
                    message: str | None = None, verbose: bool = False):
    """Load extension ``name`` from the cache, building it first if needed; returns the module.

    ``key_extra``: anything else the build depends on (target architectures, ISA). ``message``:
    printed to stderr before a build starts (builds take a while).
    """
    sources, headers = [Path(p) for p in sources], [Path(p) for p in headers]
    flags = [*extra_cflags, "|", *extra_cuda_cflags, "|", *extra_ldflags, "|", *key_extra]
    key = build_key(name, sources, headers, flags)
    root = cache_root()
    enforce = not _user_chose_root()
    private_dir(root, enforce=enforce)
    parent = private_dir(root / name, enforce=enforce)
    final = parent / key
    module_name = f"{name}_{key}"
    try:
        module = load_verified(module_name, final)
    except StaleBuild as error:
        print(f"rope_ops: {error}; rebuilding", file=sys.stderr, flush=True)
        module = None
    if module is not None:
        return module
    try:
        timeout = float(os.environ.get("ROPE_OPS_BUILD_TIMEOUT", "900"))
    except ValueError:
        timeout = 900.0
    with _build_lock(parent / ".lock", timeout):
        try:
            module = load_verified(module_name, final)  # built by another process meanwhile
        except StaleBuild:
            module = None
        if module is not None:
            return module
        _sweep_stale(parent, ".build-")
        if message:
            print(message, file=sys.stderr, flush=True)
        from torch.utils import cpp_extension

        work = Path(tempfile.mkdtemp(prefix=".build-", dir=parent))
        try:
            module = cpp_extension.load(
                name=module_name, sources=[str(p) for p in sources],
                extra_cflags=list(extra_cflags), extra_cuda_cflags=list(extra_cuda_cflags),
                extra_ldflags=list(extra_ldflags), build_directory=str(work),
                is_python_module=True, verbose=verbose)
            library = Path(module.__file__)
            for path in (library, work):
                os.chmod(path, stat.S_IMODE(path.stat().st_mode) & ~0o022)
            (work / INFO).write_text(json.dumps({
                "library": library.name, "sha256": sha256_of(library), "torch": torch.__version__,
                "cuda": torch.version.cuda, "python": sys.version.split()[0], "key_extra": list(key_extra),
            }, indent=1))
            os.chmod(work / INFO, 0o600)
            if final.exists():
                shutil.rmtree(final, ignore_errors=True)
            os.replace(work, final)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return module


def tail(text: str, n: int = 1500) -> str:
    """The last n characters of a (compiler's) message."""
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def memoized_reasons(state: dict, lock, compute, failure: str) -> list[str]:
    """``state["reasons"]``, computed once per process under ``lock`` by ``compute()`` (which
    builds or loads the extension); never raises: an exception becomes a reason starting with
    ``failure``."""
    reasons = state["reasons"]
    if reasons is None:
        with lock:
            reasons = state["reasons"]
            if reasons is None:
                try:
                    reasons = compute()
                except Exception as e:  # never raise from availability
                    reasons = [f"{failure}: {type(e).__name__}: {tail(str(e))}"]
                state["reasons"] = reasons
    return list(reasons)


def loaded_module(state: dict, backend, name: str):
    """The backend's extension module (``state["module"]``), built or loaded by its
    ``availability()`` on first use; RuntimeError with its reasons when it cannot be."""
    module = state["module"]
    if module is None:
        reasons = backend.availability()
        module = state["module"]
        if module is None:
            raise RuntimeError(f"rope_ops {name} backend unavailable: " + "; ".join(reasons))
    return module
