"""How AscendBackend hands a call to its own Ascend C kernels (tier 1).

``kernel_views`` turns validated KernelArgs into the tensors and scalars of the
``rope_ops_ascend::rotary_embedding[_grad]`` op: q, k and outputs as strided [B, S, H, D] views,
positions as a strided [B, S] view in their own integer dtype (no copy, no host sync).
``tiling_params`` reads those views exactly as the C++ host glue does (rope_host.cpp,
``fill_tiling_inputs``), so that ``tiling.compute_tiling`` predicts the host's tiling; the CPU
simulation (tests/ascend/cpu_sim, test-only) launches the kernels with the same values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rope_ops.backend import KernelArgs, bshd_view

from . import tiling as _tiling

ELEM_SIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


class KernelViews(NamedTuple):
    q: torch.Tensor  # [B, S, Hq, D]
    k: torch.Tensor | None  # [B, S, Hk, D]
    q_out: torch.Tensor
    k_out: torch.Tensor | None
    pos: torch.Tensor | None  # int32/int64 [B, S] strided view; None: pos_offset + s
    pos_offset: int
    cos: torch.Tensor  # float32 [P, r/2] contiguous
    sin: torch.Tensor
    freq_turns: torch.Tensor | None  # int64 [r/2]
    attention_factor: float
    rotary_dim: int
    interleaved: bool
    inplace: bool


def kernel_views(args: KernelArgs) -> KernelViews:
    q = bshd_view(args.q, args.layout)
    batch, seq = q.shape[0], q.shape[1]
    pos = args.pos
    if pos is not None:
        if args.layout == "thd":
            pos = pos.reshape(1, seq) if pos.dim() == 1 else pos
        elif pos.dim() == 1:
            pos = pos.unsqueeze(0).expand(batch, seq)
    k = None if args.k is None else bshd_view(args.k, args.layout)
    k_out = None if args.k_out is None else bshd_view(args.k_out, args.layout)
    return KernelViews(
        q=q, k=k, q_out=bshd_view(args.q_out, args.layout), k_out=k_out, pos=pos,
        pos_offset=int(args.pos_offset), cos=args.cos, sin=args.sin, freq_turns=args.freq_turns,
        attention_factor=float(args.attention_factor), rotary_dim=int(args.rotary_dim),
        interleaved=bool(args.interleaved), inplace=bool(args.inplace),
    )


def tiling_params(v: KernelViews, inverse: bool) -> dict:
    """The tiling's input fields, as rope_host.cpp fills them."""
    b, s, hq, d = v.q.shape
    p = {
        "batch": b, "seq": s, "qHeads": hq, "kHeads": 0 if v.k is None else v.k.shape[2],
        "headDim": d, "rotaryDim": v.rotary_dim, "elemSize": ELEM_SIZE.get(v.q.dtype, 0),
        "interleaved": int(v.interleaved), "inverse": int(inverse), "inplace": int(v.inplace),
    }
    for name, t in (("q", v.q), ("k", v.k), ("qo", v.q_out), ("ko", v.k_out)):
        st = (0, 0, 0) if t is None else t.stride()[:3]
        p[name + "StrideB"], p[name + "StrideS"], p[name + "StrideH"] = st
    if v.pos is None:
        p.update(posMode=_tiling.POS_OFFSET, posStrideB=0, posStrideS=0, posOffset=v.pos_offset)
    else:
        p.update(posMode=_tiling.POS_INT64 if v.pos.dtype == torch.int64 else _tiling.POS_INT32,
                 posStrideB=v.pos.stride(0), posStrideS=v.pos.stride(1), posOffset=0)
    p.update(tableRows=v.cos.shape[0], hasFreq=int(v.freq_turns is not None),
             attnFactorBits=_tiling.float_bits(v.attention_factor))
    return p


KERNEL_ANGLES = ("table",)  # the kernels' cos/sin source: positions -> table rows (or on the fly)


def call_reasons(angles: str, table_dtype: torch.dtype) -> list[str]:
    """Why the kernels cannot take calls of this angle source or table dtype (metadata only)."""
    reasons = []
    if angles not in KERNEL_ANGLES:
        reasons.append(f"kernels: angles {angles!r} (the kernels read position-indexed tables)")
    if table_dtype != torch.float32:
        reasons.append(f"kernels: cos/sin tables of dtype {table_dtype} (float32 only)")
    return reasons


def kernel_reasons(v: KernelViews, inverse: bool, ub_size: int, core_num: int) -> list[str]:
    """Why the kernels cannot take this call (metadata only); empty: they can."""
    reasons = []
    if v.q.dtype not in ELEM_SIZE:
        reasons.append(f"kernels: dtype {v.q.dtype} not in fp32/fp16/bf16")
    for name, t in (("q", v.q), ("k", v.k), ("q_out", v.q_out), ("k_out", v.k_out)):
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            reasons.append(f"kernels: {name} needs stride 1 on head_dim")
    if v.pos is not None and v.pos.dtype not in (torch.int32, torch.int64):
        reasons.append(f"kernels: positions dtype {v.pos.dtype}")
    if not v.cos.is_contiguous() or not v.sin.is_contiguous():
        reasons.append("kernels: cos/sin tables must be contiguous")
    if v.freq_turns is not None and (v.freq_turns.dtype != torch.int64 or not v.freq_turns.is_contiguous()):
        reasons.append("kernels: freq_turns must be contiguous int64")
    if reasons:
        return reasons
    try:
        _tiling.compute_tiling(tiling_params(v, inverse), ub_size, core_num)
    except _tiling.TilingError as e:
        reasons.append(f"kernels: tiling: {e}")
    return reasons
