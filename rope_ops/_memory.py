"""Checks made before anything is written in place: memory overlap by address ranges, and what
autograd would refuse.

Overlap is judged on addresses, not on storage identity: two tensors over different storages
(numpy views, DLPack imports) can still share bytes.
"""

from __future__ import annotations

import torch

from ._errors import RopeError


def check_inplace_memory(q, k) -> None:
    """RopeError if writing q and k in place could write an element twice or read a written one."""
    for name, t in (("q", q), ("k", k)):
        if t is not None and has_internal_overlap(t):
            raise RopeError(f"{name}: in-place on a tensor whose elements overlap (e.g. expanded)")
    if k is not None and may_overlap(q, k):
        raise RopeError("inplace: q and k overlap in memory; in-place needs disjoint q and k")


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses an element of t may occupy (empty tensors: (0, 0))."""
    if t.numel() == 0:
        return 0, 0
    size = t.element_size()
    low = sum(min(0, (n - 1) * s) for n, s in zip(t.shape, t.stride()))
    high = sum(max(0, (n - 1) * s) for n, s in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start + low * size, start + (high + 1) * size


def may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two strided tensors may share a byte. Exact for the usual cases (disjoint address
    ranges; slices of one packed QKV tensor along its heads axis, in any layout); conservative
    (True) otherwise."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, a1 = byte_range(a)
    b0, b1 = byte_range(b)
    if a1 <= b0 or b1 <= a0:
        return False
    disjoint = _disjoint_slices(a, b)
    return True if disjoint is None else not disjoint


def _disjoint_slices(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """For two views with the same strides that differ only along one axis (as narrow() gives
    from one tensor): whether they are disjoint (True), share elements (False), or None when
    they are not of that form. They are disjoint when their ranges along that axis do not meet
    and the view covering both (the same strides, that axis extended) has no two indices at
    one address."""
    size = a.element_size()
    if a.dim() != b.dim() or a.stride() != b.stride() or size != b.element_size():
        return None
    delta = b.data_ptr() - a.data_ptr()
    if delta % size:
        return None
    delta //= size
    for axis in range(a.dim()):
        stride = a.stride(axis)
        if stride <= 0 or delta % stride:
            continue
        if any(a.shape[d] != b.shape[d] for d in range(a.dim()) if d != axis):
            continue
        start = delta // stride
        if start < a.shape[axis] and start + b.shape[axis] > 0:
            return False  # the same other indices meet along this axis: a shared element
        combined = list(a.shape)
        combined[axis] = max(a.shape[axis], start + b.shape[axis]) - min(0, start)
        if not strides_overlap(combined, a.stride()):
            return True
    return None


def strides_overlap(shape, strides) -> bool:
    """Whether a view of this shape and these strides may give two indices one address
    (conservative): sorted by stride, each dim must step past everything the smaller ones span."""
    span = 0
    for stride, size in sorted((abs(s), n) for n, s in zip(shape, strides) if n > 1):
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether two indices of t address one element (conservative: True when unsure)."""
    status = torch._debug_has_internal_overlap(t)  # 0 no, 1 yes, 2 too hard for torch
    if status != 2:
        return status == 1
    return strides_overlap(t.shape, t.stride())


def check_outputs(q, k, q_out, k_out) -> None:
    """Caller-given outputs (``out=``): right shape, dtype and device, no overlap with each other
    or with any input, no internal overlap."""
    for name, x, out in (("q", q, q_out), ("k", k, k_out)):
        if x is None:
            if out is not None:
                raise RopeError("out: an output for k was given, but k is None")
            continue
        if out is None:
            raise RopeError(f"out: missing the output for {name}")
        if not isinstance(out, torch.Tensor):
            raise RopeError(f"out: expected tensors, got {type(out).__name__} for {name}")
        if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
            raise RopeError(f"out: the output for {name} must have {name}'s shape {list(x.shape)}, "
                            f"dtype {x.dtype} and device {x.device}; got {list(out.shape)}, "
                            f"{out.dtype}, {out.device}")
        if has_internal_overlap(out):
            raise RopeError(f"out: the output for {name} has elements that overlap (e.g. expanded)")
        if out.requires_grad and torch.is_grad_enabled():
            raise RopeError(f"out: the output for {name} requires grad; out= does not record a backward")
    outs = [t for t in (q_out, k_out) if t is not None]
    ins = [t for t in (q, k) if t is not None]
    for i, o in enumerate(outs):
        for other in outs[i + 1:] + ins:
            if may_overlap(o, other):
                raise RopeError("out: outputs overlap each other or an input; give separate memory "
                                "(or use inplace=True)")


_creation_meta = getattr(getattr(torch._C, "_autograd", None), "_get_creation_meta", None)


def check_inplace_autograd(name: str, t: torch.Tensor, records_grad: bool) -> None:
    """RopeError for what autograd would refuse once t is written in place, before anything is:
    an inference tensor outside inference mode; when a backward is recorded (``records_grad``),
    a leaf that requires grad, a view of one, and a view autograd cannot rebase (made in no-grad
    mode, or one of several outputs of split/chunk/unbind)."""
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise RopeError(f"{name}: in-place on an inference tensor outside torch.inference_mode(); "
                        "use inplace=False, or clone it first")
    if not records_grad or not t.requires_grad:
        return
    if t.is_leaf:
        raise RopeError(f"{name}: in-place on a leaf tensor that requires grad; use inplace=False")
    if not t._is_view():
        return
    base = t._base
    if base is not None and base.is_leaf and base.requires_grad:
        raise RopeError(f"{name}: in-place on a view of a leaf tensor that requires grad; "
                        "use inplace=False")
    if _creation_meta is not None:
        meta = str(_creation_meta(t)).rsplit(".", 1)[-1]
        why = {
            "MULTI_OUTPUT_NODE": "is one of several views returned by one op (split, chunk, "
                                 "unbind); autograd cannot rotate such a view in place. Take q "
                                 "and k by slicing (qkv[..., :Hq, :]) or use inplace=False",
            "NO_GRAD_MODE": "was made under torch.no_grad(); autograd cannot record an in-place "
                            "write to it. Make the view with grad enabled or use inplace=False",
            "INFERENCE_MODE": "was made in inference mode; use inplace=False",
            "IN_CUSTOM_FUNCTION": "was made inside a custom autograd.Function; use inplace=False",
        }.get(meta)
        if why is not None:
            raise RopeError(f"{name}: in-place on a view that {why}")
