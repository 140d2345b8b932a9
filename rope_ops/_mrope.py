"""Multimodal RoPE (mRoPE): which position axis each frequency follows.

Vision-language models give every token three positions (t, h, w: time, height, width) and split
the rotary frequencies among them by ``mrope_section`` (three counts summing to r/2). This map
is the whole of the variant: a kernel loads the three positions of a token and gives frequency i
the position of axis ``mrope_axes(section, interleaved)[i]``. It is checked against Hugging Face
transformers' own mRoPE functions (tests/test_mrope.py).
"""

from __future__ import annotations

import torch

from ._errors import RopeError


def check_section(section, rotary_dim: int) -> tuple[int, int, int]:
    """mrope_section as three ints >= 0 summing to rotary_dim / 2, or RopeError."""
    try:
        values = tuple(section)
    except TypeError:
        raise RopeError(f"mrope_section: expected three ints (t, h, w), got {section!r}") from None
    if len(values) != 3 or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in values):
        raise RopeError(f"mrope_section: expected three ints >= 0 (t, h, w), got {section!r}")
    if sum(values) != rotary_dim // 2:
        raise RopeError(f"mrope_section: {list(values)} sums to {sum(values)}, but rotary_dim "
                        f"{rotary_dim} has {rotary_dim // 2} frequencies")
    return values


def mrope_axes(section, interleaved: bool) -> torch.Tensor:
    """The position axis (0 = t, 1 = h, 2 = w) of each of the r/2 frequencies, int64 [r/2].

    Chunked (Qwen2-VL, Qwen2.5-VL): the first section[0] frequencies follow t, the next
    section[1] h, the last section[2] w. Interleaved (Qwen3-VL): frequency i follows h when
    i % 3 == 1 and i < 3 * section[1], w when i % 3 == 2 and i < 3 * section[2], else t.
    """
    half = sum(section)
    if not interleaved:
        return torch.cat([torch.full((n,), axis, dtype=torch.int64) for axis, n in enumerate(section)])
    axes = torch.zeros(half, dtype=torch.int64)
    for axis in (1, 2):
        idx = torch.arange(axis, max(axis, 3 * section[axis]), 3)  # empty for a count of 0
        axes[idx[idx < half]] = axis
    return axes
