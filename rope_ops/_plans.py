"""The fast path's caches of rope_ops.apply: plans, and guards of the last call kinds.

A plan is what a repeat of one kind of call needs (the backend's launcher bound to the call's
tables and constants, through autograd when a gradient is needed), keyed by the metadata the
full path read to make it. A guard is a backend's metadata-checking form of a plan (for example
the CUDA backend's C++ GuardedRope), kept per set of keyword arguments for the last inference
call made with them, so that a decode loop's repeats skip even building the key.

Plans of calls with per-token tables (``pos=None``) hold no tensors, only what the full path
derived from the tensors' metadata (how the tables are narrowed and broadcast, the selected
backend): ``TOKEN_PLANS``, keyed by that metadata, the request, grad mode and the generation.

Plans of calls with a ``RotaryEmbedding`` live in that module (``rope._plans``): they die with
it and are dropped when it moves. Plans of functional calls (``base=``, no module) live here and
hold tables of the byte-bounded table cache; whenever that cache drops a table, they are all
forgotten, so no plan keeps a dropped table alive. Both are bounded in entries.
"""

from __future__ import annotations

from ._tables import CACHE

MAX_PLANS = 1024
MAX_GUARDS = 64
# Part of every plan and guard key: bumped whenever what plans were made from may have changed
# (backends reloaded or overridden, selection reset), so modules' plans go stale at once too.
generation = 0


class Holder:
    """Plans and guards of functional calls."""

    def __init__(self):
        self._plans: dict = {}
        self._guards: dict = {}


FUNCTIONAL = Holder()
TOKEN_PLANS: dict = {}


def remember_plan(holder, key, entry) -> None:
    plans = holder._plans
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = entry


def remember_guard(holder, options, guard) -> None:
    guards = holder._guards
    if len(guards) >= MAX_GUARDS and options not in guards:
        guards.clear()
    guards[options] = guard


def forget_functional() -> None:
    """Forget the plans of functional calls (they hold tables of the table cache)."""
    FUNCTIONAL._plans.clear()
    FUNCTIONAL._guards.clear()


def clear() -> None:
    """Forget every plan: functional ones now, modules' ones by the generation in their keys."""
    global generation
    generation += 1
    forget_functional()
    TOKEN_PLANS.clear()


CACHE.on_evict.append(forget_functional)
