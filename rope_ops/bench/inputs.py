"""Input sets of a case, and the check of a provider's outputs against the float64 reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rope_ops._reference import rope_reference
from rope_ops.testing.checks import assert_rope_close

from .cases import DECODE_POSITIONS, Case

PAST_TABLE_OFFSET = 200_000  # positions="offset": every row is past the table (computed on the fly)
CHECK_TOKENS = 32  # tokens checked at each end of a case


def layout_shape(layout: str, batch: int, seq: int, heads: int, dim: int) -> tuple[int, ...]:
    return {"bshd": (batch, seq, heads, dim), "sbhd": (seq, batch, heads, dim),
            "bhsd": (batch, heads, seq, dim), "thd": (batch * seq, heads, dim)}[layout]


_HEAD_AXIS = {"bshd": 2, "sbhd": 2, "bhsd": 1, "thd": 1}


@dataclass
class InputSet:
    q: torch.Tensor  # in the case's layout; views into ``qkv`` when packed
    k: torch.Tensor
    pos: torch.Tensor  # int64: [S] (arange, shared by the batch), [B, S] (random), [T] (thd)
    positions: torch.Tensor  # int64 [B, S] ([1, T] for thd): the position of every token
    grad_q: torch.Tensor | None  # output gradients (train)
    grad_k: torch.Tensor | None
    qkv: torch.Tensor | None = None  # the packed tensor q and k are views of

    def fresh(self) -> "InputSet":
        """A copy with new storage and the same strides (for checks of providers that write
        their inputs)."""
        if self.qkv is not None:
            qkv = self.qkv.clone()
            q = qkv.as_strided(self.q.shape, self.q.stride(), self.q.storage_offset())
            k = qkv.as_strided(self.k.shape, self.k.stride(), self.k.storage_offset())
        else:
            qkv, q, k = None, self.q.clone(), self.k.clone()
        return InputSet(q, k, self.pos, self.positions, self.grad_q, self.grad_k, qkv)


def _lengths(n_seqs: int, total: int, gen: torch.Generator) -> list[int]:
    """n_seqs lengths >= 1 summing to total, varied (between about 1/4 and 7/4 of the mean)."""
    weights = torch.rand(n_seqs, generator=gen) * 1.5 + 0.25
    lengths = (weights / weights.sum() * total).floor().clamp_min(1).long()
    lengths[-1] += total - int(lengths.sum())
    while int(lengths[-1]) < 1:  # rounding took too much from the last one
        i = int(lengths.argmax())
        lengths[i] -= 1
        lengths[-1] += 1
    return lengths.tolist()


def make_positions(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(pos as passed to the op, positions of every token as [B, S] or [1, T] for thd)."""
    b, s = case.batch, case.seq
    if case.positions == "random":
        every = torch.randint(0, DECODE_POSITIONS if s == 1 else 131072, (b, s), generator=gen)
        pos = every.reshape(-1) if case.layout == "thd" else every
    elif case.positions == "varlen":
        if case.layout != "thd":
            raise ValueError(f"{case.name}: varlen positions need the thd layout")
        pos = torch.cat([torch.arange(n) for n in _lengths(b, b * s, gen)])
        every = pos.reshape(b, s)
    else:
        start = PAST_TABLE_OFFSET if case.positions == "offset" else 0
        row = torch.arange(start, start + s)
        every = row.expand(b, s)
        pos = row.repeat(b) if case.layout == "thd" else row
    if case.layout == "thd":
        every = every.reshape(1, -1)
    return pos, every


def make_inputs(case: Case, device: torch.device, n_sets: int, seed: int = 0) -> list[InputSet]:
    """``n_sets`` sets of random inputs, drawn on the device (large cases would take seconds on
    the host); positions drawn on the host from the same seed whatever the device."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    data_gen = gen if device.type == "cpu" else torch.Generator(device=device).manual_seed(seed)
    dtype = case.torch_dtype

    def randn(shape):
        return torch.randn(shape, generator=data_gen, device=device, dtype=dtype)

    sets = []
    for _ in range(n_sets):
        hq, hk, d = case.q_heads, case.k_heads, case.head_dim
        qkv = None
        if case.packed:
            if case.layout not in ("thd", "bshd"):
                raise ValueError(f"{case.name}: packed QKV views need the thd or bshd layout")
            qkv = randn(layout_shape(case.layout, case.batch, case.seq, hq + 2 * hk, d))
            q = qkv.narrow(_HEAD_AXIS[case.layout], 0, hq)
            k = qkv.narrow(_HEAD_AXIS[case.layout], hq, hk)
        else:
            q = randn(layout_shape(case.layout, case.batch, case.seq, hq, d))
            k = randn(layout_shape(case.layout, case.batch, case.seq, hk, d))
        pos, every = make_positions(case, gen)
        gq = gk = None
        if case.train:
            gq, gk = randn(q.shape), randn(k.shape)
        sets.append(InputSet(q, k, pos.to(device), every.to(device), gq, gk, qkv))
    return sets


def peer_cos_sin(case: Case, inv_freq: torch.Tensor, attention_factor: float, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width cos/sin [B, S, r] ([1, T, r] for thd) in ``dtype`` for the peers that take
    them precomputed (Hugging Face's form, Liger): angles in float64, rounded once; NeoX
    repeats the half row, GPT-J interleaves it."""
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(positions.device, torch.float64)
    cos, sin = torch.cos(angles) * attention_factor, torch.sin(angles) * attention_factor
    if case.style == "neox":
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    else:
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    return cos.to(dtype), sin.to(dtype)


# ---------------------------------------------------------------------------------------------
# Checks: a provider's outputs on the first and last tokens against the float64 reference.


def _token_slice(t: torch.Tensor, layout: str, batch_index: int, start: int, stop: int) -> torch.Tensor:
    if layout == "bshd":
        return t[batch_index:batch_index + 1, start:stop]
    if layout == "sbhd":
        return t[start:stop, batch_index:batch_index + 1]
    if layout == "bhsd":
        return t[batch_index:batch_index + 1, :, start:stop]
    return t[start:stop]


def _pos_slice(pos: torch.Tensor, layout: str, batch_index: int, start: int, stop: int) -> torch.Tensor:
    if layout == "thd" or pos.dim() == 1:
        return pos[start:stop]
    return pos[batch_index:batch_index + 1, start:stop]


def _half_width(table: torch.Tensor, style: str) -> torch.Tensor:
    """The r/2 distinct values of a Hugging Face-form row [..., r]."""
    return table[..., :table.shape[-1] // 2] if style == "neox" else table[..., ::2]


def _table_slice(table: torch.Tensor, layout: str, batch_index: int, start: int, stop: int) -> torch.Tensor:
    """Rows of a per-token table [B or 1, S, w] ([1, T, w] for thd) for _token_slice's tokens."""
    if layout == "thd":
        return table[0, start:stop]
    b = min(batch_index, table.shape[0] - 1)
    return table[b:b + 1, start:stop]


def check_outputs(case: Case, s: InputSet, outputs, inv_freq: torch.Tensor, attention_factor: float,
                  token_tables=None) -> str:
    """"ok", or "MISMATCH: ..." (first failure). ``s`` holds the inputs as they were before the
    call; ``outputs`` are (q_out, k_out) in the case's layout, or (dq, dk) for train cases.
    ``token_tables``: the per-token (cos, sin) [B or 1, S, r] the call was given (token cases:
    the reference rotates by those values, as rounded)."""
    if case.train:
        xs, inverse = (s.grad_q, s.grad_k), True
    else:
        xs, inverse = (s.q, s.k), False
    seq = case.tokens if case.layout == "thd" else case.seq
    n = min(CHECK_TOKENS, seq)
    ends = [(0, 0, n), (0 if case.layout == "thd" else case.batch - 1, seq - n, seq)]
    try:
        for name, x, out in zip("qk", xs, outputs):
            if out is None or tuple(out.shape) != tuple(x.shape):
                return f"MISMATCH: {name} output of shape {None if out is None else tuple(out.shape)}"
            for b, start, stop in ends:
                xs_ = _token_slice(x, case.layout, b, start, stop)
                angles = dict(inv_freq=inv_freq, attention_factor=attention_factor)
                if token_tables is not None:
                    angles = dict(token_cos_sin=tuple(
                        _half_width(_table_slice(t, case.layout, b, start, stop), case.style)
                        for t in token_tables))
                ref = rope_reference(xs_, _pos_slice(s.pos, case.layout, b, start, stop), layout=case.layout,
                                     rotary_dim=case.rot, style=case.style, inverse=inverse, **angles)
                got = _token_slice(out, case.layout, b, start, stop)
                assert_rope_close(got, ref, xs_, rotary_dim=case.rot, style=case.style, what=name)
        return "ok"
    except AssertionError as error:
        return f"MISMATCH: {str(error)[:160]}"
