"""The float64 reference: SPEC.md "Math" as plain code. The executable spec.

Written independently of every backend's code path (no tables, no fixed-point angles, no layout
views): it moves the tensor to float64 on the CPU, builds angles as float64 products and rotates
pairs with index arithmetic. Tests and benchmarks compare backends against it.
"""

from __future__ import annotations

import torch


def reference_positions(pos, layout: str, shape: tuple[int, ...]) -> torch.Tensor:
    """int64 positions with one entry per (batch, token) of a tensor of ``shape`` in ``layout``.

    Returns [T] for thd, [B, S] otherwise.
    """
    if layout == "thd":
        n_tokens = shape[0]
        if isinstance(pos, int):
            return pos + torch.arange(n_tokens, dtype=torch.int64)
        return pos.detach().to("cpu", torch.int64).reshape(n_tokens)
    batch, seq = {"bshd": (shape[0], shape[1]), "sbhd": (shape[1], shape[0]),
                  "bhsd": (shape[0], shape[2])}[layout]
    if isinstance(pos, int):
        return (pos + torch.arange(seq, dtype=torch.int64)).expand(batch, seq)
    p = pos.detach().to("cpu", torch.int64)
    return p.expand(batch, seq) if p.dim() == 1 else p


def reference_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float,
                      cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None):
    """float64 (c, s) for each position: positions.shape + [r/2].

    With caller tables, rows are read from the tables and positions outside them give NaN.
    """
    if cos_sin is not None:
        cos_t, sin_t = (t.detach().to("cpu", torch.float64) for t in cos_sin)
        n_rows = cos_t.shape[0]
        inside = (positions >= 0) & (positions < n_rows)
        idx = positions.clamp(0, max(n_rows - 1, 0))
        nan = torch.tensor(float("nan"), dtype=torch.float64)
        if n_rows == 0:
            shape = (*positions.shape, cos_t.shape[1])
            return torch.full(shape, float("nan"), dtype=torch.float64), torch.full(
                shape, float("nan"), dtype=torch.float64)
        c = torch.where(inside.unsqueeze(-1), cos_t[idx], nan)
        s = torch.where(inside.unsqueeze(-1), sin_t[idx], nan)
        return c, s
    theta = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to("cpu", torch.float64)
    return attention_factor * torch.cos(theta), attention_factor * torch.sin(theta)


def rope_reference(x: torch.Tensor, pos, *, layout: str, rotary_dim: int, style: str,
                   inv_freq: torch.Tensor | None = None, attention_factor: float = 1.0,
                   cos_sin=None, inverse: bool = False) -> torch.Tensor:
    """The rotated x (or, with inverse=True, the gradient for output gradient x), float64, CPU.

    x is in ``layout``; the result has x's shape.
    """
    x64 = x.detach().to("cpu", torch.float64)
    positions = reference_positions(pos, layout, tuple(x.shape))
    c, s = reference_cos_sin(positions, inv_freq, attention_factor, cos_sin)
    if inverse:
        s = -s
    # Bring c, s to broadcast against x: insert the head axis at its place in the layout.
    head_axis = {"bshd": 2, "sbhd": 2, "bhsd": 1, "thd": 1}[layout]
    if layout == "sbhd":
        c, s = c.transpose(0, 1), s.transpose(0, 1)  # [S, B, r/2]
    c, s = c.unsqueeze(head_axis), s.unsqueeze(head_axis)
    half = rotary_dim // 2
    idx = torch.arange(half)
    if style == "neox":
        first, second = idx, idx + half
    elif style == "gptj":
        first, second = 2 * idx, 2 * idx + 1
    else:
        raise ValueError(style)
    out = x64.clone()
    a, b = x64[..., first], x64[..., second]
    out[..., first] = a * c - b * s
    out[..., second] = b * c + a * s
    return out
