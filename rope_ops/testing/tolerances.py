"""SPEC "Accuracy" as code: the allowed error of each output element."""

from __future__ import annotations

import torch

# float32 rounding and cancellation allowance: FP32_ALLOWANCE * max(1, |x| + |y|).
FP32_ALLOWANCE = 2e-6
# (exponent of the smallest normal, mantissa bits) of the low-precision output dtypes.
_LOW_PRECISION = {torch.bfloat16: (-126, 7), torch.float16: (-14, 10)}


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at each of ``values`` (float64), zero for
    float32/float64 outputs (their allowance is FP32_ALLOWANCE alone)."""
    if dtype not in _LOW_PRECISION:
        return torch.zeros_like(values)
    min_exp, mantissa_bits = _LOW_PRECISION[dtype]
    exponent = torch.floor(torch.log2(values.abs().clamp_min(torch.finfo(torch.float64).tiny)))
    exponent = exponent.clamp_min(min_exp)
    return torch.pow(2.0, exponent - mantissa_bits)


def pair_indices(rotary_dim: int, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    half = torch.arange(rotary_dim // 2)
    if style == "gptj":
        return 2 * half, 2 * half + 1
    return half, half + rotary_dim // 2


def allowed_error(x: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype, rotary_dim: int,
                  style: str) -> torch.Tensor:
    """Per-element bound for the rotary dims (float64, x's shape); pass-through dims get 0.

    ``x`` is the input (the output gradient for a backward) whose pairs (x, y) set the float32
    allowance; ``reference`` the float64 reference output, at which the ulp is taken.
    """
    x = x.detach().to("cpu", torch.float64)
    first, second = pair_indices(rotary_dim, style)
    pair_sum = x[..., first].abs() + x[..., second].abs()
    fp32_part = FP32_ALLOWANCE * pair_sum.clamp_min(1.0)
    bound = torch.zeros_like(x)
    bound[..., first] = fp32_part
    bound[..., second] = fp32_part
    bound[..., :rotary_dim] += ulp(reference[..., :rotary_dim], dtype)
    return bound
