"""Memory-overlap checks for in-place calls."""

from __future__ import annotations

import torch

from ._errors import RopeError


def check_inplace_memory(q, k) -> None:
    """RopeError if writing q and k in place could write an element twice or read a written one."""
    for name, t in (("q", q), ("k", k)):
        if t is not None and _has_internal_overlap(t):
            raise RopeError(f"{name}: in-place on a tensor whose elements overlap (e.g. expanded)")
    if k is not None and _may_overlap(q, k):
        raise RopeError("inplace: q and k overlap in memory; in-place needs disjoint q and k")


def _may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two strided tensors share an element. Exact for the usual cases (separate
    storages, disjoint ranges, slices of one packed QKV tensor); conservative otherwise."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    size = a.element_size()
    a0, a1 = _extent(a)
    b0, b1 = _extent(b)
    a0, a1 = a.data_ptr() + a0 * size, a.data_ptr() + a1 * size
    b0, b1 = b.data_ptr() + b0 * size, b.data_ptr() + b1 * size
    if a1 <= b0 or b1 <= a0:
        return False
    # Same outer (token) strides, each tensor's rows inside one token's slot: compare the rows'
    # positions within the slot (packed QKV: q heads, then k heads, then v heads per token).
    if a.dim() == b.dim() and a.stride()[:-2] == b.stride()[:-2] and a.dim() >= 3:
        slot = min(s for s, n in zip(a.stride()[:-2], a.shape[:-2]) if n > 1) * size if any(
            n > 1 for n in a.shape[:-2]) else None
        outer = [s * size for s, n in zip(a.stride()[:-2], a.shape[:-2]) if n > 1]
        if slot and all(s % slot == 0 for s in outer):
            span_a = _inner_span(a) * size
            span_b = _inner_span(b) * size
            if span_a <= slot and span_b <= slot:
                start_a = a.data_ptr() % slot
                start_b = b.data_ptr() % slot
                return _ring_intersect(start_a, span_a, start_b, span_b, slot)
    return True


def _extent(t):
    low = sum(min(0, (n - 1) * s) for n, s in zip(t.shape, t.stride()))
    high = sum(max(0, (n - 1) * s) for n, s in zip(t.shape, t.stride())) + 1
    return low, high


def _inner_span(t) -> int:
    """Elements spanned by one token's heads x head_dim (the last two dims)."""
    return sum((n - 1) * abs(s) for n, s in zip(t.shape[-2:], t.stride()[-2:])) + 1


def _ring_intersect(a: int, la: int, b: int, lb: int, ring: int) -> bool:
    d = (b - a) % ring
    return d < la or (ring - d) < lb


def _has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether two indices of t address one element (conservative: True when unsure)."""
    status = torch._debug_has_internal_overlap(t)  # 0 no, 1 yes, 2 too hard for torch
    if status != 2:
        return status == 1
    # Sorted by stride, each dim must step past everything the smaller dims span.
    span = 0
    for stride, size in sorted((abs(s), n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False
