"""Test cases of the conformance suite: shapes, layouts, positions, views; and their inputs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

import rope_ops
from rope_ops._reference import rope_reference


@dataclass(frozen=True)
class Case:
    name: str
    layout: str = "bshd"
    batch: int = 2
    seq: int = 7
    q_heads: int = 4
    k_heads: int | None = 2  # None: k is None
    head_dim: int = 64
    rotary_dim: int | None = None
    style: str = "neox"
    # Positions: "int" (an offset), "s" ([S] shared by the batch), "bs" ([B,S]), "t" ([T], thd).
    pos_kind: str = "bs"
    pos_dtype: torch.dtype = torch.int64
    pos_low: int = 0  # positions are random in [pos_low, pos_high) (an offset pos_low for "int")
    pos_high: int = 48
    table_positions: int = 64  # rows of the cos/sin table
    packed_qkv: bool = False  # q, k as views into one [.., q_heads + 2*k_heads, D] tensor
    transposed: bool = False  # non-contiguous q, k made by transposing a contiguous buffer
    inplace: bool = False
    caller_tables: bool = False
    base: float = 10000.0
    scaling: dict | None = field(default=None, hash=False)

    def replace(self, **kw) -> Case:
        return dataclasses.replace(self, **kw)


def standard_cases() -> list[Case]:
    """The fixed grid: every layout, style, position form, view and edge that SPEC names."""
    c = Case("base")
    cases = [
        c,
        c.replace(name="gptj", style="gptj"),
        c.replace(name="sbhd", layout="sbhd"),
        c.replace(name="bhsd", layout="bhsd"),
        c.replace(name="thd", layout="thd", batch=1, seq=13, pos_kind="t"),
        c.replace(name="thd_gptj_partial", layout="thd", batch=1, seq=9, pos_kind="t", style="gptj",
                  head_dim=96, rotary_dim=32),
        c.replace(name="mha", q_heads=3, k_heads=3),
        c.replace(name="mqa", q_heads=5, k_heads=1),
        c.replace(name="k_none", k_heads=None),
        c.replace(name="partial_neox", head_dim=80, rotary_dim=32),
        c.replace(name="partial_gptj", style="gptj", head_dim=256, rotary_dim=64, q_heads=2, k_heads=1),
        c.replace(name="hd80", head_dim=80),
        c.replace(name="hd96", head_dim=96),
        c.replace(name="hd128", head_dim=128),
        c.replace(name="hd256", head_dim=256, q_heads=2, k_heads=1),
        c.replace(name="odd_sizes", batch=3, seq=11, q_heads=7, k_heads=3, head_dim=46, rotary_dim=46),
        c.replace(name="tiny_head", head_dim=2, q_heads=1, k_heads=1),
        c.replace(name="one_token", batch=1, seq=1, pos_kind="s"),
        c.replace(name="thousands", layout="thd", batch=1, seq=2048, q_heads=2, k_heads=1,
                  pos_kind="t", pos_high=4096, table_positions=1024),
        c.replace(name="pos_int", pos_kind="int", pos_low=5),
        c.replace(name="pos_int_beyond", pos_kind="int", pos_low=1000),
        c.replace(name="pos_s", pos_kind="s"),
        c.replace(name="pos_int32", pos_dtype=torch.int32),
        c.replace(name="pos_beyond_table", pos_low=0, pos_high=10_000),
        c.replace(name="pos_near_2p20", pos_low=(1 << 20) - 5000, pos_high=1 << 20),
        c.replace(name="pos_negative", pos_low=-300, pos_high=300),
        c.replace(name="packed_qkv", packed_qkv=True),
        c.replace(name="packed_qkv_thd", packed_qkv=True, layout="thd", batch=1, seq=10, pos_kind="t"),
        c.replace(name="transposed", transposed=True),
        c.replace(name="inplace", inplace=True),
        c.replace(name="inplace_partial_gptj", inplace=True, style="gptj", head_dim=80, rotary_dim=48),
        c.replace(name="inplace_packed_qkv", inplace=True, packed_qkv=True),
        c.replace(name="inplace_sbhd_k_none", inplace=True, layout="sbhd", k_heads=None),
        c.replace(name="caller_tables", caller_tables=True, pos_high=64),
        c.replace(name="caller_tables_out_of_range", caller_tables=True, pos_low=-8, pos_high=80),
        c.replace(name="yarn", scaling={"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 32}, pos_high=200),
        c.replace(name="llama3_long", base=500000.0, pos_high=20000, scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}),
    ]
    return cases


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor | None
    pos: object  # int or tensor
    kwargs: dict
    rope: rope_ops.RotaryEmbedding | None
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None
    base_tensor: torch.Tensor | None  # the packed buffer q, k are views of (to check v is untouched)
    rotary_dim: int

    def reference(self, x: torch.Tensor, case: Case, *, inverse: bool = False) -> torch.Tensor:
        """float64 CPU reference of x (q-shaped or k-shaped) for this case."""
        inv_freq = None if self.rope is None else self.rope.inv_freq
        factor = 1.0 if self.rope is None else self.rope.attention_factor
        return rope_reference(x, self.pos, layout=case.layout, rotary_dim=self.rotary_dim,
                              style=case.style, inv_freq=inv_freq, attention_factor=factor,
                              cos_sin=self.cos_sin, inverse=inverse)


def _shape(case: Case, heads: int) -> tuple[int, ...]:
    b, s, d = case.batch, case.seq, case.head_dim
    return {"bshd": (b, s, heads, d), "sbhd": (s, b, heads, d), "bhsd": (b, heads, s, d),
            "thd": (s, heads, d)}[case.layout]


def _heads_axis(layout: str) -> int:
    return {"bshd": 2, "sbhd": 2, "bhsd": 1, "thd": 1}[layout]


def make_inputs(case: Case, dtype: torch.dtype, device, seed: int = 0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)

    q_shape = _shape(case, case.q_heads)
    k_shape = None if case.k_heads is None else _shape(case, case.k_heads)
    base_tensor = None
    if case.packed_qkv:
        total = case.q_heads + 2 * (case.k_heads or 0)
        packed = randn(_shape(case, total))
        axis = _heads_axis(case.layout)
        q = packed.narrow(axis, 0, case.q_heads)
        k = None if k_shape is None else packed.narrow(axis, case.q_heads, case.k_heads)
        base_tensor = packed
    elif case.transposed:
        # Contiguous in another order, then viewed in the case's layout: non-trivial strides.
        def strided(shape):
            t = randn(tuple(reversed(shape[:-1])) + shape[-1:])
            return t.permute(*reversed(range(len(shape) - 1)), len(shape) - 1)

        q = strided(q_shape)
        k = None if k_shape is None else strided(k_shape)
    else:
        q = randn(q_shape)
        k = None if k_shape is None else randn(k_shape)

    n_tokens = case.seq
    if case.pos_kind == "int":
        pos = case.pos_low
    else:
        shape = {"s": (n_tokens,), "t": (n_tokens,), "bs": (case.batch, n_tokens)}[case.pos_kind]
        pos = torch.randint(case.pos_low, case.pos_high, shape, generator=gen).to(case.pos_dtype).to(device)

    head_dim = case.head_dim
    rotary_dim = case.rotary_dim or head_dim
    rope, cos_sin = None, None
    kwargs = {"layout": case.layout, "inplace": case.inplace}
    if case.caller_tables:
        # A frequency scheme rope_ops does not ship: arbitrary angles and magnitudes.
        angles = torch.rand(case.table_positions, rotary_dim // 2, generator=gen, dtype=torch.float64) * 6.3
        mag = 0.5 + torch.rand(case.table_positions, rotary_dim // 2, generator=gen, dtype=torch.float64)
        cos_sin = ((mag * angles.cos()).float().to(device), (mag * angles.sin()).float().to(device))
        kwargs.update(cos_sin=cos_sin, rotary_dim=rotary_dim, style=case.style)
    else:
        rope = rope_ops.RotaryEmbedding(head_dim, rotary_dim=rotary_dim, base=case.base,
                                        scaling=case.scaling, max_position=case.table_positions,
                                        style=case.style)
        kwargs["rope"] = rope
    return Inputs(q, k, pos, kwargs, rope, cos_sin, base_tensor, rotary_dim)
