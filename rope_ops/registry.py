"""Backend discovery through stevedore over the entry-point group ``rope_ops.backends``.

Every backend, in-tree ones included, is an entry point naming a ``Backend`` subclass, loaded and
instantiated on first use, one name at a time: a plugin that fails to import (no torch_npu, no
triton, a bug, even an ``assert``) is recorded with its reason and breaks nothing else.

stevedore keeps an on-disk cache of entry points that can stay stale for ~2 minutes after a
reinstall; we seed its in-process cache for our group from ``importlib.metadata`` each process, so
what is installed is what we see, whatever that file says.
"""

from __future__ import annotations

import importlib.metadata
import threading
import traceback
from contextlib import contextmanager

from stevedore import ExtensionManager, NamedExtensionManager

from ._errors import BackendError
from .backend import Backend

NAMESPACE = "rope_ops.backends"

_lock = threading.RLock()
_names: list[str] | None = None
_loaded: dict[str, Backend] = {}
_failures: dict[str, str] = {}
# Set by ``override`` (tests): backends given as objects, no entry points involved.
_override: dict[str, Backend] | None = None


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    seen, result = set(), []
    for ep in importlib.metadata.entry_points(group=NAMESPACE):
        if (ep.name, ep.value) not in seen:  # the same dist on sys.path twice
            seen.add((ep.name, ep.value))
            result.append(ep)
    return result


def names() -> list[str]:
    """Names of all registered backends, importing none of them."""
    global _names
    if _override is not None:
        return list(_override)
    if _names is None:
        with _lock:
            if _names is None:
                eps = _entry_points()
                ExtensionManager.ENTRY_POINT_CACHE[NAMESPACE] = eps
                _names = sorted({ep.name for ep in eps})
    return _names


def get(name: str) -> Backend:
    """The backend object called ``name``; BackendError if unknown or if it failed to load."""
    if _override is not None:
        if name in _override:
            return _override[name]
        raise BackendError(f"unknown backend {name!r}; registered: {names()}")
    found = _loaded.get(name)
    if found is not None:
        return found
    if name not in names():
        raise BackendError(f"unknown backend {name!r}; registered: {names()}")
    with _lock:
        if name not in _loaded and name not in _failures:
            _load(name)
    if name in _failures:
        raise BackendError(f"backend {name!r} failed to load: {_failures[name]}")
    return _loaded[name]


def _load(name: str) -> None:
    def on_failure(_manager, entry_point, error):
        _failures[entry_point.name] = _describe(error)

    try:
        manager = NamedExtensionManager(
            NAMESPACE, names=[name], invoke_on_load=True, on_load_failure_callback=on_failure,
            on_missing_entrypoints_callback=None)
        extensions = [ext for ext in manager.extensions if ext.name == name]
    except BaseException as error:  # stevedore re-raises AssertionError from plugin imports
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        _failures[name] = _describe(error)
        return
    if name in _failures:
        return
    if not extensions:
        _failures[name] = "entry point did not load"
        return
    obj = extensions[0].obj
    if not isinstance(obj, Backend):
        _failures[name] = f"entry point gave {type(obj).__name__}, not a rope_ops.backend.Backend"
    elif obj.name != name:
        _failures[name] = f"entry point name {name!r} differs from the backend's name {obj.name!r}"
    else:
        _loaded[name] = obj


def _describe(error: BaseException) -> str:
    last = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(error).__name__}: {error}{where}"


def load_all() -> tuple[dict[str, Backend], dict[str, str]]:
    """(loaded backends by name, load failure reason by name) for every registered name."""
    loaded, failures = {}, {}
    for name in names():
        try:
            loaded[name] = get(name)
        except BackendError:
            failures[name] = _failures.get(name, "unknown")
    return loaded, failures


def reset() -> None:
    """Forget discovered and loaded backends (tests; after installing a plugin in-process)."""
    global _names
    with _lock:
        _names = None
        _loaded.clear()
        _failures.clear()
        ExtensionManager.ENTRY_POINT_CACHE.pop(NAMESPACE, None)
    from . import _select

    _select.clear_cache()


@contextmanager
def override(backends: dict[str, Backend]):
    """Use exactly these backend objects instead of the entry points (for tests)."""
    global _override
    previous = _override
    _override = dict(backends)
    from . import _select

    _select.clear_cache()
    try:
        yield
    finally:
        _override = previous
        _select.clear_cache()
