"""Assertions of the conformance suite, with reports that say where and by how much."""

from __future__ import annotations

import torch

from .tolerances import FP32_ALLOWANCE, allowed_error, ulp


def assert_rope_close(out: torch.Tensor, reference: torch.Tensor, x: torch.Tensor, *, rotary_dim: int,
                      style: str, what: str = "output", dtype: torch.dtype | None = None,
                      passthrough_exact: bool = True) -> None:
    """``out`` matches the float64 ``reference`` within SPEC's per-element bound.

    Rotary dims: |out - ref| <= bound, NaN exactly where the reference is NaN. Pass-through dims
    ``[rotary_dim, D)`` must equal the reference (the input, copied) bit for bit, or, when they
    were computed (``passthrough_exact=False``: normalised by the prologue), be within the float32
    allowance plus one ulp. ``dtype``: the dtype ``out`` was rounded to (default out.dtype).
    """
    dtype = out.dtype if dtype is None else dtype
    assert out.shape == reference.shape, f"{what}: shape {tuple(out.shape)} != {tuple(reference.shape)}"
    got = out.detach().to("cpu", torch.float64)
    ref = reference.to(torch.float64)
    rot_got, rot_ref = got[..., :rotary_dim], ref[..., :rotary_dim]
    nan_ref, nan_got = torch.isnan(rot_ref), torch.isnan(rot_got)
    if not torch.equal(nan_ref, nan_got):
        missing = (nan_ref & ~nan_got).sum().item()
        extra = (nan_got & ~nan_ref).sum().item()
        raise AssertionError(f"{what}: {extra} unexpected NaN, {missing} expected NaN missing "
                             f"(of {rot_ref.numel()} rotary elements)")
    bound = allowed_error(x, ref.nan_to_num(), dtype, rotary_dim, style)[..., :rotary_dim]
    err = (rot_got - rot_ref).abs().nan_to_num(0.0)
    bad = err > bound
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        excess = (err / bound.clamp_min(1e-300)).max().item()
        raise AssertionError(
            f"{what}: {bad.sum().item()} of {bad.numel()} rotary elements out of bounds; first at "
            f"{idx}: got {rot_got[tuple(idx)].item()!r}, reference {rot_ref[tuple(idx)].item()!r}, "
            f"allowed {bound[tuple(idx)].item():.3g}; worst error/allowed = {excess:.3g}")
    if rotary_dim < got.shape[-1] and not passthrough_exact:
        tail_got, tail_ref = got[..., rotary_dim:], ref[..., rotary_dim:]
        tail_bound = FP32_ALLOWANCE * tail_ref.abs().clamp_min(1.0) + ulp(tail_ref, dtype)
        if ((tail_got - tail_ref).abs() > tail_bound).any():
            raise AssertionError(f"{what}: computed pass-through dims out of bounds")
    elif rotary_dim < got.shape[-1]:
        tail_got, tail_ref = got[..., rotary_dim:], ref[..., rotary_dim:]
        same = (tail_got == tail_ref) | (torch.isnan(tail_got) & torch.isnan(tail_ref))
        if not same.all():
            idx = (~same).nonzero()[0].tolist()
            raise AssertionError(f"{what}: pass-through dims changed, first at {idx}")


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Exactly the same bits (NaN-aware): inputs left untouched, determinism."""
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}")
    same = (a == b) | (torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else a == b
    if not bool(same.all()):
        raise AssertionError(f"{what}: {int((~same).sum())} of {a.numel()} elements differ")


def run_or_skip_refusal(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``; a backend's refusal (a BackendError with reasons) skips the test,
    a backend's failure (a BackendError without them) fails it."""
    import pytest

    from .._errors import BackendError

    try:
        return fn(*args, **kwargs)
    except BackendError as error:
        if error.refusals is None:
            raise
        pytest.skip(f"refused by the backend: {error}")
