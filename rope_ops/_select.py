"""Backend selection: which backend runs a kind of call, decided from metadata and cached.

Request, in order of precedence: the per-call ``backend=`` argument, then ``use_backend(...)``,
then the ``ROPE_OPS_BACKEND`` environment variable, then ``auto``.

- ``auto``: the available backend of highest priority that accepts the call among those that
  may be auto-selected on the call's device; the pure-torch backend is the last resort.
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
from ._errors import BackendError
from .backend import Backend, RopeCall

ENV_VAR = "ROPE_OPS_BACKEND"
FALLBACK = "torch"

_context_request: contextvars.ContextVar[str | None] = contextvars.ContextVar("rope_ops_backend", default=None)
# (request string, call tuple) -> Backend. A call tuple equals its RopeCall (a NamedTuple).
_cache: dict[tuple, Backend] = {}


# Fast-path plans of rope_ops.apply, keyed by the metadata they were derived from (see _api):
# (plan, guard), guard being the plan's metadata-checking form where the backend has one.
plans: dict[tuple, tuple] = {}
_MAX_PLANS = 4096
# The guard of the last fast-path call made with each set of apply's options (keyword arguments
# and backend request) whose plan has one: a repeat skips the key (see _api.apply). Keyed by the
# options, so layers that alternate frequencies (local and global RoPE) each keep theirs.
guards: dict[tuple, object] = {}
_MAX_GUARDS = 64


def remember_plan(key: tuple, entry: tuple) -> None:
    if len(plans) >= _MAX_PLANS:  # bounded: keys hold shapes and RotaryEmbedding objects
        plans.clear()
    plans[key] = entry


def remember_guard(options: tuple, guard) -> None:
    if len(guards) >= _MAX_GUARDS and options not in guards:
        guards.clear()
    guards[options] = guard


def clear_cache() -> None:
    _cache.clear()
    plans.clear()
    guards.clear()


@contextmanager
def use_backend(name: str | None):
    """Within the block, calls without ``backend=`` use ``name`` (same syntax as the variable)."""
    token = _context_request.set(name)
    try:
        yield
    finally:
        _context_request.reset(token)


def _env_getter():
    # os.environ.get costs ~1 us (key encoding, Mapping machinery); its backing dict is read
    # directly where CPython has one (it is kept in sync by os.environ's own setters).
    data = getattr(os.environ, "_data", None)
    encoded = os.fsencode(ENV_VAR) if data is not None and any(isinstance(k, bytes) for k in list(data)[:1]) else ENV_VAR
    if data is None:
        return lambda: os.environ.get(ENV_VAR)

    def get():
        value = data.get(encoded)
        return value.decode() if isinstance(value, bytes) else value

    return get


_env_request = _env_getter()


def current_request(backend: str | None = None) -> str:
    return backend or _context_request.get() or _env_request() or "auto"


def select(call: tuple, backend: str | None = None) -> Backend:
    request = current_request(backend)
    key = (request, call)
    found = _cache.get(key)
    if found is None:
        found = _decide(request, RopeCall._make(call))
        _cache[key] = found
    return found


@torch._dynamo.assume_constant_result
def select_name_constant(call: tuple, backend: str | None = None) -> str:
    """select(...).name, evaluated once outside tracing under torch.compile (metadata only)."""
    return select(call, backend).name


def reasons(backend: Backend, call: RopeCall) -> list[str]:
    return list(backend.availability()) + list(backend.supports(call))


def _decide(request: str, call: RopeCall) -> Backend:
    request = request.strip()
    if request == "auto":
        return _auto(call)
    wanted = [n.strip() for n in request.split(",") if n.strip()]
    if not wanted:
        raise BackendError(f"{ENV_VAR}={request!r}: expected 'auto', a backend name or a comma list")
    unknown = [n for n in wanted if n != "auto" and n not in registry.names()]
    if unknown:
        raise BackendError(f"unknown backend(s) {unknown} in {request!r}; registered: {registry.names()}")
    refusals = {}
    for name in wanted:
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
        why = reasons(candidate, call)
        if not why:
            return candidate
        refusals[name] = why
    raise BackendError(_no_backend_message(request, call, refusals))


def _auto(call: RopeCall) -> Backend:
    loaded, failures = registry.load_all()
    refusals = {name: [f"failed to load: {why}"] for name, why in failures.items()}
    ranked = sorted(loaded.values(), key=lambda b: (b.name == FALLBACK, -b.priority, b.name))
    for candidate in ranked:
        auto_devices = candidate.auto_devices()
        if call.device_type not in auto_devices and "*" not in auto_devices and candidate.name != FALLBACK:
            refusals[candidate.name] = [f"not auto-selected on {call.device_type!r} (name it to use it)"]
            continue
        why = reasons(candidate, call)
        if not why:
            return candidate
        refusals[candidate.name] = why
    raise BackendError(_no_backend_message("auto", call, refusals))


def _no_backend_message(request: str, call: RopeCall, refusals: dict[str, list[str]]) -> str:
    lines = [f"no rope_ops backend can run this call (request {request!r}):", f"  call: {_describe(call)}"]
    for name, why in refusals.items():
        lines.append(f"  {name}: " + "; ".join(why))
    return "\n".join(lines)


def _describe(call: RopeCall) -> str:
    return ", ".join(f"{k}={v}" for k, v in call._asdict().items())
