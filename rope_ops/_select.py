"""Backend selection: which backend runs a kind of call, decided from metadata and cached.

Request, in order of precedence: the per-call ``backend=`` argument, then ``use_backend(...)``,
then the ``ROPE_OPS_BACKEND`` environment variable, then ``auto``.

- ``auto``: among the backends that join automatic selection on the call's device (rope_ops' own,
  and third-party ones that declare ``joins_auto``), the available one of highest priority for the
  call (``Backend.priority_for``) that accepts it, built-ins winning ties; the pure-torch backend is
  the last resort.
- one name: that backend or a BackendError with its reasons (strict).
- a comma list: the first listed backend that accepts the call; BackendError with everyone's
  reasons when none does.
"""

from __future__ import annotations

import contextvars
import os
from contextlib import contextmanager

import torch

from . import registry
from ._errors import BackendError, RopeError
from .backend import Backend, RopeCall

ENV_VAR = "ROPE_OPS_BACKEND"
FALLBACK = "torch"

_context_request: contextvars.ContextVar[str | None] = contextvars.ContextVar("rope_ops_backend", default=None)
# (request string, call tuple) -> Backend. A call tuple equals its RopeCall (a NamedTuple).
_cache: dict[tuple, Backend] = {}
_MAX_DECISIONS = 4096


def clear_cache() -> None:
    _cache.clear()
    from . import _plans

    _plans.clear()


@contextmanager
def use_backend(name: str | None):
    """Within the block, calls without ``backend=`` use ``name`` (same syntax as the variable)."""
    if name is not None and not isinstance(name, str):
        raise RopeError(f"use_backend: expected a backend name or comma list (str), got {name!r}")
    token = _context_request.set(name)
    try:
        yield
    finally:
        _context_request.reset(token)


def current_request(backend: str | None = None) -> str:
    """The request in force for a call: ``backend=``, use_backend, the variable, or auto.
    Traced by torch.compile, it is read once when the graph is made."""
    if backend is not None:
        if not isinstance(backend, str):
            raise RopeError(f"backend: expected a backend name or comma list (str), got {backend!r}")
        return backend
    if torch.compiler.is_compiling():
        return _request_when_traced()
    return _context_request.get() or os.environ.get(ENV_VAR) or "auto"


@torch._dynamo.assume_constant_result
def _request_when_traced() -> str:
    # Dynamo cannot trace ContextVar.get; a constant result is read at trace time.
    return _context_request.get() or os.environ.get(ENV_VAR) or "auto"


def select(call: tuple, backend: str | None = None) -> Backend:
    request = current_request(backend)
    key = (request, call)
    found = _cache.get(key)
    if found is None:
        found = decide(request, RopeCall._make(call))
        if len(_cache) >= _MAX_DECISIONS:
            _cache.clear()
        _cache[key] = found
    return found


def parse_request(request: str) -> list[str]:
    """The names of a request ('auto', a name or a comma list); BackendError if malformed."""
    wanted = [n.strip() for n in request.split(",") if n.strip()]
    if not wanted:
        raise BackendError(f"{ENV_VAR}={request!r}: expected 'auto', a backend name or a comma list")
    unknown = [n for n in wanted if n != "auto" and n not in registry.names()]
    if unknown:
        raise BackendError(f"unknown backend(s) {unknown} in {request!r}; registered: {registry.names()}")
    return wanted


def decide(request: str, call: RopeCall) -> Backend:
    refusals: dict[str, list[str]] = {}
    for name in parse_request(request):
        if name == "auto":
            try:
                return _auto(call)
            except BackendError as error:
                refusals[name] = [str(error)]
                continue
        try:
            candidate = registry.get(name)
        except BackendError as error:
            refusals[name] = [str(error)]
            continue
        why = registry.reasons(candidate, call)
        if not why:
            return candidate
        refusals[name] = why
    raise BackendError(_no_backend_message(request, call, refusals), refusals)


def joins_auto(backend: Backend) -> bool:
    return registry.is_builtin(backend.name) or bool(getattr(backend, "joins_auto", False))


def auto_ranking(loaded: dict[str, Backend], call: RopeCall | None = None) -> list[Backend]:
    """Backends in the order automatic selection tries them for ``call`` (the fallback last)."""
    def rank(b: Backend):
        return (b.name == FALLBACK, -_priority(b, call), not registry.is_builtin(b.name), b.name)

    return sorted(loaded.values(), key=rank)


def _priority(backend: Backend, call: RopeCall | None) -> int:
    """backend.priority_for(call) (its priority without a call); a plugin whose method raises
    or returns a non-integer keeps its declared priority."""
    declared = getattr(backend, "priority", 0)
    if call is None or not hasattr(backend, "priority_for"):
        return int(declared)
    try:
        value = backend.priority_for(call)
    except Exception:
        return int(declared)
    return value if isinstance(value, int) else int(declared)


def _auto(call: RopeCall) -> Backend:
    loaded, failures = registry.load_all()
    refusals = {name: [f"failed to load: {why}"] for name, why in failures.items()}
    for candidate in auto_ranking(loaded, call):
        if candidate.name != FALLBACK:
            if not joins_auto(candidate):
                refusals[candidate.name] = ["third-party backend that does not join automatic "
                                            "selection (name it to use it)"]
                continue
            try:
                auto_devices = candidate.auto_devices()
            except Exception as error:
                refusals[candidate.name] = [f"auto_devices() raised {registry.describe_error(error)}"]
                continue
            if call.device_type not in auto_devices and "*" not in auto_devices:
                refusals[candidate.name] = [f"not auto-selected on {call.device_type!r} (name it to use it)"]
                continue
        why = registry.reasons(candidate, call)
        if not why:
            return candidate
        refusals[candidate.name] = why
    raise BackendError(_no_backend_message("auto", call, refusals), refusals)


def _no_backend_message(request: str, call: RopeCall, refusals: dict[str, list[str]]) -> str:
    lines = [f"no rope_ops backend can run this call (request {request!r}):", f"  call: {describe(call)}"]
    for name, why in refusals.items():
        lines.append(f"  {name}: " + "; ".join(why))
    return "\n".join(lines)


def describe(call: RopeCall) -> str:
    return ", ".join(f"{k}={v}" for k, v in call._asdict().items())
