"""The float64 reference: the specification (docs/spec.md) as plain code. The executable spec.

Written independently of every backend's code path (no tables of ours, no fixed-point angles, no
layout views): it moves the tensor to float64 on the CPU, builds angles as float64 products and
rotates pairs with index arithmetic. Tests and benchmarks compare backends against it.

Where the angles come from (the variants):
- positions and frequencies: theta = p * inv_freq[i] (``inv_freq``, attention factor ``m``);
- caller tables indexed by position: ``cos_sin`` = (cos, sin) [P, r/2]; rows outside give NaN;
- caller tables per token: ``token_cos_sin`` = (cos, sin) broadcastable to [B, S, r/2] ([T, r/2]
  for thd), no positions;
- mRoPE: positions [3, B, S] (or [3, S], [3, T]): frequency i takes the position of the axis
  ``mrope_axes(section, interleaved)[i]`` assigns it.
"""

from __future__ import annotations

import torch

from ._mrope import mrope_axes


def reference_positions(pos, layout: str, shape: tuple[int, ...], multi_axis: bool = False) -> torch.Tensor:
    """int64 positions with one entry per (batch, token) of a tensor of ``shape`` in ``layout``:
    [B, S] ([1, T] for thd); with ``multi_axis`` (mRoPE) [3, B, S] from [3, B, S], [3, S] or
    [3, T]."""
    if layout == "thd":
        batch, seq = 1, shape[0]
    else:
        batch, seq = {"bshd": (shape[0], shape[1]), "sbhd": (shape[1], shape[0]),
                      "bhsd": (shape[0], shape[2])}[layout]
    if isinstance(pos, int):
        return (pos + torch.arange(seq, dtype=torch.int64)).expand(batch, seq)
    p = pos.detach().to("cpu", torch.int64)
    if multi_axis:
        if p.dim() == 2:  # [3, S] shared by the batch, or [3, T]
            p = p.unsqueeze(1)
        return p.expand(3, batch, seq)
    return p.expand(batch, seq)


def reference_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor | None, attention_factor: float,
                      cos_sin=None, token_cos_sin=None, mrope_section=None, mrope_interleaved=False):
    """float64 (c, s) [B, S, r/2] for each (batch, token)."""
    if token_cos_sin is not None:
        batch, seq = positions.shape[-2:]
        c, s = (t.detach().to("cpu", torch.float64) for t in token_cos_sin)
        half = c.shape[-1]
        return c.expand(batch, seq, half), s.expand(batch, seq, half)
    if mrope_section is not None:
        axes = mrope_axes(mrope_section, mrope_interleaved)
        per_freq = positions[axes]  # [r/2, B, S]: frequency i's position
        positions = per_freq.permute(1, 2, 0)  # [B, S, r/2]
    else:
        positions = positions.unsqueeze(-1)  # [B, S, 1]
    if cos_sin is not None:
        cos_t, sin_t = (t.detach().to("cpu", torch.float64) for t in cos_sin)
        n_rows, half = cos_t.shape
        positions = positions.expand(*positions.shape[:-1], half)
        inside = (positions >= 0) & (positions < n_rows)
        row = positions.clamp(0, max(n_rows - 1, 0))
        col = torch.arange(half).expand_as(row)
        nan = torch.tensor(float("nan"), dtype=torch.float64)
        if n_rows == 0:
            full = torch.full(positions.shape, float("nan"), dtype=torch.float64)
            return full, full.clone()
        return (torch.where(inside, cos_t[row, col], nan), torch.where(inside, sin_t[row, col], nan))
    theta = positions.to(torch.float64) * inv_freq.to("cpu", torch.float64)
    return attention_factor * torch.cos(theta), attention_factor * torch.sin(theta)


def rope_reference(x: torch.Tensor, pos, *, layout: str, rotary_dim: int, style: str,
                   inv_freq: torch.Tensor | None = None, attention_factor: float = 1.0,
                   cos_sin=None, token_cos_sin=None, mrope_section=None, mrope_interleaved=False,
                   inverse: bool = False) -> torch.Tensor:
    """The rotated x (or, with inverse=True, the gradient for output gradient x), float64, CPU.

    x is in ``layout``; the result has x's shape. ``pos`` is ignored with ``token_cos_sin``.
    """
    x64 = x.detach().to("cpu", torch.float64)
    positions = reference_positions(0 if token_cos_sin is not None else pos, layout, tuple(x.shape),
                                    multi_axis=mrope_section is not None)
    c, s = reference_cos_sin(positions, inv_freq, attention_factor, cos_sin, token_cos_sin,
                             mrope_section, mrope_interleaved)  # [B, S, r/2]
    if inverse:
        s = -s
    # Bring c, s to broadcast against x: insert the head axis at its place in the layout.
    if layout == "thd":
        c, s = c[0], s[0]  # [T, r/2]
    elif layout == "sbhd":
        c, s = c.transpose(0, 1), s.transpose(0, 1)  # [S, B, r/2]
    head_axis = {"bshd": 2, "sbhd": 2, "bhsd": 1, "thd": 1}[layout]
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


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       weight_offset: float) -> torch.Tensor:
    """Per-head RMSNorm over the last dim, float64: x / sqrt(mean(x^2) + eps) * (offset + w)."""
    if weight is None:
        return x
    w = weight.detach().to("cpu", torch.float64) if not weight.requires_grad else weight.to(torch.float64)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (weight_offset + w)


def prologue_reference(qkv: torch.Tensor, pos, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                       q_weight=None, k_weight=None, eps: float = 1e-6, weight_offset: float = 0.0,
                       rotate: bool = True, rotary_dim: int, style: str, inv_freq=None,
                       attention_factor: float = 1.0, cos_sin=None, token_cos_sin=None,
                       mrope_section=None, mrope_interleaved=False):
    """(q, k, v) in float64 on the CPU from the packed QKV projection output ``qkv``
    ([T, (Hq + 2 Hk) * D] or [B, S, (Hq + 2 Hk) * D]): split per head, RMSNorm of q and k heads
    with their weights (when given), rotation of q and k (when ``rotate``), v unchanged.

    Differentiable (float64 autograd) in ``qkv`` and the weights when they require grad: the
    conformance suite takes the backward's reference from it.
    """
    x = qkv.to("cpu", torch.float64) if qkv.requires_grad else qkv.detach().to("cpu", torch.float64)
    heads = x.unflatten(-1, (num_q_heads + 2 * num_kv_heads, head_dim))
    q, k, v = heads.split([num_q_heads, num_kv_heads, num_kv_heads], dim=-2)
    q = rms_norm_reference(q, q_weight, eps, weight_offset)
    k = rms_norm_reference(k, k_weight, eps, weight_offset)
    if rotate:
        layout = "thd" if qkv.dim() == 2 else "bshd"
        kw = dict(layout=layout, rotary_dim=rotary_dim, style=style, inv_freq=inv_freq,
                  attention_factor=attention_factor, cos_sin=cos_sin, token_cos_sin=token_cos_sin,
                  mrope_section=mrope_section, mrope_interleaved=mrope_interleaved)
        q, k = _rotate_differentiable(q, pos, **kw), _rotate_differentiable(k, pos, **kw)
    return q, k, v


def _rotate_differentiable(x, pos, *, layout, rotary_dim, style, **angles):
    """rope_reference's rotation on a float64 tensor that may carry autograd history."""
    positions = reference_positions(0 if angles.get("token_cos_sin") is not None else pos, layout,
                                    tuple(x.shape), multi_axis=angles.get("mrope_section") is not None)
    c, s = reference_cos_sin(positions, angles["inv_freq"], angles["attention_factor"],
                             angles["cos_sin"], angles["token_cos_sin"], angles["mrope_section"],
                             angles["mrope_interleaved"])
    if layout == "thd":
        c, s = c[0], s[0]
    c, s = c.unsqueeze(-2), s.unsqueeze(-2)  # over heads
    half = rotary_dim // 2
    idx = torch.arange(half)
    first, second = (idx, idx + half) if style == "neox" else (2 * idx, 2 * idx + 1)
    a, b = x[..., first], x[..., second]
    rotated = torch.empty_like(x[..., :rotary_dim])
    rotated = rotated.index_copy(-1, first, a * c - b * s).index_copy(-1, second, b * c + a * s)
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
