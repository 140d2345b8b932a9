"""``--candidates``: every kernel configuration a backend can run a case with, timed, next to the
one its policy picks, so the policy's rules can be derived from measurements.

A backend module that supports it (``rope_ops_backends.cuda_backend``,
``rope_ops_backends.triton_backend``) exposes ``kernel_candidates(args) -> list[str]`` (readable
labels, the policy's own choice first) and ``run_with(args, label)``, where ``args`` is a
``rope_ops.backend.KernelArgs`` with its outputs set.
"""

from __future__ import annotations

import dataclasses
import importlib

import torch

from rope_ops.backend import KernelArgs

from .cases import Case
from .inputs import InputSet, check_outputs
from .timing import gpu_time_per_call

CANDIDATE_BACKENDS = ("cuda", "triton")


def backend_module(name: str):
    """(module, None) when the backend exposes the two functions, else (None, why not)."""
    try:
        module = importlib.import_module(f"rope_ops_backends.{name}_backend")
    except Exception as error:
        return None, f"cannot import rope_ops_backends.{name}_backend: {type(error).__name__}: {error}"
    missing = [f for f in ("kernel_candidates", "run_with") if not callable(getattr(module, f, None))]
    if missing:
        return None, f"rope_ops_backends.{name}_backend has no {' / '.join(missing)}"
    return module, None


def kernel_args(case: Case, s: InputSet, tables, inverse: bool) -> KernelArgs:
    """The call's KernelArgs with outputs allocated (in place: q and k themselves); inverse
    takes the output gradients as inputs (the backward)."""
    q, k = (s.grad_q, s.grad_k) if inverse else (s.q, s.k)
    if case.inplace:
        q_out, k_out = q, k
    else:
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    return KernelArgs(q, k, q_out, k_out, s.pos, 0, tables.cos, tables.sin, tables.freq_turns,
                      tables.attention_factor, case.layout, case.rot, case.style == "gptj", inverse,
                      case.inplace)


def time_candidates(case: Case, sets: list[InputSet], rope, module, graph_seconds: float) -> list[dict]:
    """One entry per direction (forward; and backward for train cases): the policy's label, each
    candidate's time (or error, or failed check) and the best checked candidate."""
    if case.angles != "positions":
        return [{"case": case.name, "direction": "forward",
                 "error": "candidates are timed on positions-indexed tables only", "candidates": []}]
    tables = rope.tables(sets[0].q.device)
    entries = []
    for inverse in ((False, True) if case.train else (False,)):
        entry = {"case": case.name, "direction": "backward" if inverse else "forward", "candidates": []}
        try:
            labels = list(module.kernel_candidates(kernel_args(case, sets[0], tables, inverse)))
        except Exception as error:
            entry["error"] = f"kernel_candidates raised {type(error).__name__}: {error}"
            entries.append(entry)
            continue
        entry["policy"] = labels[0] if labels else None
        for label in labels:
            result = {"label": str(label)}
            try:
                fresh = sets[0].fresh()
                before = fresh.fresh()
                args = kernel_args(case, fresh, tables, inverse)
                module.run_with(args, label)
                # check_outputs takes a train case's outputs for gradients (the backward)
                checked_as = case if inverse else dataclasses.replace(case, mode="forward" if case.train else case.mode)
                result["check"] = check_outputs(checked_as, before, (args.q_out, args.k_out), rope.inv_freq,
                                                rope.attention_factor)
                calls = [kernel_args(case, s, tables, inverse) for s in sets]
                seconds = gpu_time_per_call([lambda a=a: module.run_with(a, label) for a in calls],
                                            graph_seconds=graph_seconds, repeats=3)
                result["time_us"] = seconds * 1e6
            except Exception as error:
                result["error"] = f"{type(error).__name__}: {str(error)[:200]}"
            entry["candidates"].append(result)
        summarize(entry)
        entries.append(entry)
    return entries


def summarize(entry: dict) -> None:
    """The best candidate whose outputs passed the check, and how far the policy's is from it."""
    timed = [c for c in entry["candidates"] if "time_us" in c and c.get("check") == "ok"]
    if not timed:
        return
    best = min(timed, key=lambda c: c["time_us"])
    entry["best"], entry["best_us"] = best["label"], best["time_us"]
    policy = next((c for c in entry["candidates"] if c["label"] == entry.get("policy")), None)
    if policy is not None and "time_us" in policy:
        entry["policy_us"] = policy["time_us"]
        entry["gap_pct"] = 100 * (policy["time_us"] / best["time_us"] - 1)
