"""Backend discovery through stevedore over the entry-point group ``rope_ops.backends``.

Every backend, in-tree ones included, is an entry point naming a ``Backend`` subclass, loaded and
instantiated on first use, one name at a time. A plugin is contained: whatever goes wrong with it
(an import error, even an ``assert``; an import that hangs; ``availability()`` raising; a wrong
class or name) is recorded as that backend's reason and breaks nothing else:

- each name loads under its own lock, so a slow or hanging plugin holds up only callers of that
  name, and a load that takes longer than ``ROPE_OPS_PLUGIN_TIMEOUT`` seconds (default 120) is
  given up (recorded as failed; the import may finish in the background, unused);
- the names of rope_ops' own backends are reserved: an entry point of another distribution with
  one of them is ignored and reported, never silently put in place of the built-in;
- ``reasons(backend, call)`` turns an exception from a backend's ``availability()`` or
  ``supports()`` into a reason.

stevedore keeps an on-disk cache of entry points that can stay stale for ~2 minutes after a
reinstall; we seed its in-process cache for our group from ``importlib.metadata`` each process, so
what is installed is what we see, whatever that file says.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
import traceback
from contextlib import contextmanager

from stevedore import ExtensionManager, NamedExtensionManager

from ._errors import BackendError
from .backend import Backend

NAMESPACE = "rope_ops.backends"
DISTRIBUTION = "rope_ops"  # the distribution whose entry points are the built-in backends
BUILTINS = frozenset({"torch", "triton", "cuda", "ascend", "cpu"})

_lock = threading.Lock()  # guards the tables below, never held while a plugin loads
_name_locks: dict[str, threading.Lock] = {}
_names: list[str] | None = None
_entry_points: dict[str, importlib.metadata.EntryPoint] = {}
_builtin_names: set[str] = set()
_shadowed: dict[str, str] = {}  # name -> why an entry point of that name was ignored
_loaded: dict[str, Backend] = {}
_failures: dict[str, str] = {}
# Set by ``override`` (tests): backends given as objects, no entry points involved.
_override: dict[str, Backend] | None = None


def _dist_name(ep) -> str | None:
    dist = getattr(ep, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    return None if name is None else name.replace("-", "_").lower()


def _discover() -> None:
    global _names
    chosen: dict[str, importlib.metadata.EntryPoint] = {}
    shadowed: dict[str, str] = {}
    builtin: set[str] = set()
    for ep in importlib.metadata.entry_points(group=NAMESPACE):
        owner = _dist_name(ep)
        ours = owner == DISTRIBUTION
        if ep.name in BUILTINS and not ours:
            shadowed[ep.name] = (f"entry point {ep.name!r} = {ep.value!r} of distribution "
                                 f"{owner!r} ignored: {ep.name!r} is a built-in rope_ops backend")
            continue
        previous = chosen.get(ep.name)
        if previous is not None and previous.value != ep.value:
            shadowed[ep.name] = (f"entry point {ep.name!r} is registered twice ({previous.value!r} "
                                 f"and {ep.value!r}); using the first")
            continue
        chosen.setdefault(ep.name, ep)
        if ours:
            builtin.add(ep.name)
    ExtensionManager.ENTRY_POINT_CACHE[NAMESPACE] = list(chosen.values())
    _entry_points.clear()
    _entry_points.update(chosen)
    _builtin_names.clear()
    _builtin_names.update(builtin)
    _shadowed.clear()
    _shadowed.update(shadowed)
    _names = sorted(chosen)


def names() -> list[str]:
    """Names of all registered backends, importing none of them."""
    if _override is not None:
        return list(_override)
    if _names is None:
        with _lock:
            if _names is None:
                _discover()
    return _names


def is_builtin(name: str) -> bool:
    """Whether ``name`` is one of rope_ops' own backends (shipped in its distribution)."""
    if _override is not None:
        return name in BUILTINS
    names()
    return name in _builtin_names


def shadowed() -> dict[str, str]:
    """Entry points that were ignored (a built-in name taken by another distribution, a name
    registered twice), with why."""
    names()
    return dict(_shadowed)


def get(name: str) -> Backend:
    """The backend object called ``name``; BackendError if unknown or if it failed to load."""
    if _override is not None:
        if name in _override:
            return _override[name]
        raise BackendError(f"unknown backend {name!r}; registered: {names()}")
    found = _loaded.get(name)
    if found is not None:
        return found
    if not isinstance(name, str) or name not in names():
        raise BackendError(f"unknown backend {name!r}; registered: {names()}")
    if name not in _failures:
        _load_with_timeout(name)
    if name in _failures:
        raise BackendError(f"backend {name!r} failed to load: {_failures[name]}")
    return _loaded[name]


def _timeout() -> float:
    try:
        return max(0.0, float(os.environ.get("ROPE_OPS_PLUGIN_TIMEOUT", "120")))
    except ValueError:
        return 120.0


def _load_with_timeout(name: str) -> None:
    with _lock:
        lock = _name_locks.setdefault(name, threading.Lock())
    timeout = _timeout()
    if not lock.acquire(timeout=timeout):
        _failures.setdefault(name, f"loading did not finish within {timeout:g} s "
                                   "(ROPE_OPS_PLUGIN_TIMEOUT); is its import hanging?")
        return
    try:
        if name in _loaded or name in _failures:
            return
        outcome: dict = {}
        worker = threading.Thread(target=_load, args=(name, outcome), daemon=True,
                                  name=f"rope_ops-load-{name}")
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            _failures[name] = (f"loading did not finish within {timeout:g} s "
                               "(ROPE_OPS_PLUGIN_TIMEOUT); is its import hanging?")
        elif "backend" in outcome:
            _loaded[name] = outcome["backend"]
        else:
            _failures[name] = outcome.get("failure", "entry point did not load")
    finally:
        lock.release()


def _load(name: str, outcome: dict) -> None:
    failures: dict[str, str] = {}

    def on_failure(_manager, entry_point, error):
        failures[entry_point.name] = describe_error(error)

    try:
        manager = NamedExtensionManager(
            NAMESPACE, names=[name], invoke_on_load=True, on_load_failure_callback=on_failure,
            on_missing_entrypoints_callback=None)
        extensions = [ext for ext in manager.extensions if ext.name == name]
    except BaseException as error:  # stevedore re-raises AssertionError from plugin imports
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        outcome["failure"] = describe_error(error)
        return
    if name in failures:
        outcome["failure"] = failures[name]
        return
    if not extensions:
        outcome["failure"] = "entry point did not load"
        return
    obj = extensions[0].obj
    if not isinstance(obj, Backend):
        outcome["failure"] = f"entry point gave {type(obj).__name__}, not a rope_ops.backend.Backend"
    elif obj.name != name:
        outcome["failure"] = f"entry point name {name!r} differs from the backend's name {obj.name!r}"
    else:
        outcome["backend"] = obj


def describe_error(error: BaseException) -> str:
    last = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(error).__name__}: {error}{where}"


def availability(backend: Backend) -> list[str]:
    """backend.availability(), with an exception (or a malformed answer) turned into a reason."""
    try:
        found = backend.availability()
        return [str(r) for r in found]
    except Exception as error:
        return [f"availability() raised {describe_error(error)}"]


def reasons(backend: Backend, call) -> list[str]:
    """Why ``backend`` cannot take ``call`` (availability first); never raises."""
    why = availability(backend)
    if why:
        return why
    try:
        return [str(r) for r in backend.supports(call)]
    except Exception as error:
        return [f"supports() raised {describe_error(error)}"]


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
        _name_locks.clear()
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
