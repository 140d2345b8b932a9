"""How AscendBackend hands a call to its own Ascend C kernels (tier 1).

``kernel_views`` / ``prologue_views`` turn validated KernelArgs / PrologueArgs into the tensors
and scalars of the ``rope_ops_ascend`` ops (rope_host.cpp): tensors as strided [B, S, H, D] views,
positions as strided [B, S] ([3, B, S] for mRoPE) views in their own integer dtype, cos/sin as
given (row-strided tables, per-token rows, float32/float16/bfloat16): no copy, no host sync.
``tiling_params`` / ``prologue_tiling_params`` read those views exactly as the C++ host glue does
(``fill_tiling_inputs``), so that ``tiling.compute_tiling`` predicts the host's tiling; the CPU
simulation (tests/ascend/cpu_sim, test-only) launches the kernels with the same values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rope_ops.backend import KernelArgs, PrologueArgs, bshd_view

from . import tiling as _tiling

ELEM_SIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
TABLE_DTYPES = {torch.float32: _tiling.TABLE_FP32, torch.float16: _tiling.TABLE_FP16,
                torch.bfloat16: _tiling.TABLE_BF16}


class AngleViews(NamedTuple):
    """The cos/sin stage's inputs, as the ops take them."""

    pos: torch.Tensor | None  # int32/int64 [B, S] ([3, B, S] mRoPE) strided view; None: offset + s
    pos_offset: int
    cos: torch.Tensor  # [P, r/2] (rows any stride) or per token [B, S, r/2]; stride 1 along r/2
    sin: torch.Tensor
    freq_turns: torch.Tensor | None  # int64 [r/2]
    attention_factor: float
    angles: str  # "table", "token" or "mrope"
    mrope_section: tuple[int, int, int]  # (0, 0, 0) unless mRoPE
    mrope_interleaved: bool

    def op_args(self) -> tuple:
        """In the ops' argument order (rope_host.cpp ROPE_ANGLE_ARGS)."""
        return (self.pos, self.pos_offset, self.cos, self.sin, self.freq_turns, self.attention_factor,
                self.angles, list(self.mrope_section), self.mrope_interleaved)


class KernelViews(NamedTuple):
    q: torch.Tensor  # [B, S, Hq, D]
    k: torch.Tensor | None  # [B, S, Hk, D]
    q_out: torch.Tensor
    k_out: torch.Tensor | None
    angles: AngleViews
    rotary_dim: int
    interleaved: bool
    inplace: bool


class PrologueViews(NamedTuple):
    """The prologue's forward or backward as its op takes it. Forward: q, k, v are the heads of
    qkv, q_out/k_out/v_out the outputs (v_out None in place). Backward: q, k, v are the output
    gradients (None: zero), q_out/k_out/v_out the heads of grad_qkv, xq/xk the forward's input."""

    q: torch.Tensor | None  # [B, S, Hq, D]
    k: torch.Tensor | None  # [B, S, Hk, D]
    v: torch.Tensor | None
    q_out: torch.Tensor
    k_out: torch.Tensor
    v_out: torch.Tensor | None
    xq: torch.Tensor | None
    xk: torch.Tensor | None
    angles: AngleViews
    rotary_dim: int
    interleaved: bool
    rotate: bool
    q_weight: torch.Tensor | None  # float32 [D] contiguous
    k_weight: torch.Tensor | None
    eps: float
    weight_offset: float
    inplace: bool
    k_cache: torch.Tensor | None  # [num_slots, Hk, D]
    v_cache: torch.Tensor | None
    slots: torch.Tensor | None  # int32/int64 [B, S] view


def _batch_seq_view(t: torch.Tensor, layout: str, batch: int, seq: int) -> torch.Tensor:
    """A per-token [B, S] ([T] for thd, [S] shared by the batch) tensor as a [B, S] view."""
    if layout == "thd":
        return t.reshape(1, seq) if t.dim() == 1 else t
    if t.dim() == 1:
        return t.unsqueeze(0).expand(batch, seq)
    return t


def angle_views(args, batch: int, seq: int) -> AngleViews:
    """The angle fields of KernelArgs or PrologueArgs for a call of ``batch`` x ``seq`` tokens."""
    pos = args.pos
    if pos is not None:
        if args.angles == "mrope":
            if pos.dim() == 2:  # [3, S] shared by the batch, or [3, T]
                pos = pos.unsqueeze(1)
            pos = pos.expand(3, batch, seq)
        else:
            pos = _batch_seq_view(pos, args.layout, batch, seq)
    section = tuple(args.mrope_section) if args.angles == "mrope" else (0, 0, 0)
    return AngleViews(pos, int(args.pos_offset), args.cos, args.sin, args.freq_turns,
                      float(args.attention_factor), args.angles, section, bool(args.mrope_interleaved))


def kernel_views(args: KernelArgs) -> KernelViews:
    q = bshd_view(args.q, args.layout)
    k = None if args.k is None else bshd_view(args.k, args.layout)
    k_out = None if args.k_out is None else bshd_view(args.k_out, args.layout)
    return KernelViews(q=q, k=k, q_out=bshd_view(args.q_out, args.layout), k_out=k_out,
                       angles=angle_views(args, q.shape[0], q.shape[1]), rotary_dim=int(args.rotary_dim),
                       interleaved=bool(args.interleaved), inplace=bool(args.inplace))


def _float_weight(w: torch.Tensor | None) -> torch.Tensor | None:
    return None if w is None else w.detach().to(torch.float32).contiguous()


def _heads(x: torch.Tensor, args: PrologueArgs):
    """The q, k, v heads of a [T, W] / [B, S, W] tensor as [B, S, H, D] views."""
    heads = x.unflatten(-1, (args.num_q_heads + 2 * args.num_kv_heads, args.head_dim))
    if args.layout == "thd":
        heads = heads.unsqueeze(0)
    hq, hk = args.num_q_heads, args.num_kv_heads
    return heads[:, :, :hq], heads[:, :, hq:hq + hk], heads[:, :, hq + hk:]


def _out_view(t: torch.Tensor | None, layout: str) -> torch.Tensor | None:
    return None if t is None else bshd_view(t, layout)


def prologue_views(args: PrologueArgs) -> PrologueViews:
    """The forward: heads of qkv in, q_out/k_out/v_out (or qkv's heads in place) out."""
    q, k, v = _heads(args.qkv, args)
    if args.inplace:
        q_out, k_out, v_out = q, k, None
    else:
        q_out, k_out, v_out = (_out_view(t, args.layout) for t in (args.q_out, args.k_out, args.v_out))
    slots = None if args.slots is None else _batch_seq_view(args.slots, args.layout, q.shape[0], q.shape[1])
    return PrologueViews(q, k, v, q_out, k_out, v_out, None, None, angle_views(args, q.shape[0], q.shape[1]),
                         int(args.rotary_dim), bool(args.interleaved), bool(args.rotate),
                         _float_weight(args.q_weight), _float_weight(args.k_weight), float(args.eps),
                         float(args.weight_offset), bool(args.inplace), args.k_cache, args.v_cache, slots)


def prologue_grad_views(args: PrologueArgs, grad_qkv: torch.Tensor, grad_q, grad_k, grad_v) -> PrologueViews:
    """The backward: output gradients in (None: zero), the heads of grad_qkv out."""
    xq, xk, _ = _heads(args.qkv, args)
    dq, dk, dv = _heads(grad_qkv, args)
    grads = [_out_view(g, args.layout) for g in (grad_q, grad_k, grad_v)]
    with_weight = args.q_weight is not None or args.k_weight is not None
    return PrologueViews(*grads, dq, dk, dv, xq if with_weight else None, xk if with_weight else None,
                         angle_views(args, xq.shape[0], xq.shape[1]), int(args.rotary_dim),
                         bool(args.interleaved), bool(args.rotate), _float_weight(args.q_weight),
                         _float_weight(args.k_weight), float(args.eps), float(args.weight_offset), False,
                         None, None, None)


# ---------------------------------------------------------------------------------------------
# Tiling inputs, exactly as rope_host.cpp's fill_tiling_inputs.


def _strides3(t: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if t is None else tuple(t.stride()[:3])


def angle_params(a: AngleViews) -> dict:
    p = {"angleKind": _tiling.ANGLE_KINDS[a.angles], "tableDtype": TABLE_DTYPES.get(a.cos.dtype, -1),
         "hasFreq": int(a.freq_turns is not None), "attnFactorBits": _tiling.float_bits(a.attention_factor),
         "mropeT": a.mrope_section[0], "mropeH": a.mrope_section[1], "mropeW": a.mrope_section[2],
         "mropeInterleaved": int(a.mrope_interleaved)}
    if a.pos is None:
        p.update(posMode=_tiling.POS_OFFSET, posStrideA=0, posStrideB=0, posStrideS=0, posOffset=a.pos_offset)
    else:
        strides = a.pos.stride() if a.pos.dim() == 3 else (0,) + a.pos.stride()
        p.update(posMode=_tiling.POS_INT64 if a.pos.dtype == torch.int64 else _tiling.POS_INT32,
                 posStrideA=strides[0], posStrideB=strides[1], posStrideS=strides[2], posOffset=0)
    if a.angles == "token":  # [B, S, r/2]: rows by (b, s)
        p.update(tableRows=0, cosStrideB=a.cos.stride(0), cosStrideR=a.cos.stride(1),
                 sinStrideB=a.sin.stride(0), sinStrideR=a.sin.stride(1))
    else:  # [P, r/2]: rows by position
        p.update(tableRows=a.cos.shape[0], cosStrideB=0, cosStrideR=a.cos.stride(0), sinStrideB=0,
                 sinStrideR=a.sin.stride(0))
    return p


def _op_params(op: int, q_like: torch.Tensor, k_heads: int, rotary_dim: int, interleaved: bool, inverse: bool,
               inplace: bool, rotate: bool) -> dict:
    """The fields every op fills (rope_host.cpp's new_tiling): the op, the grid of q's [B, S, Hq, D]
    heads, k's head count and the rotation."""
    b, s, hq, d = q_like.shape
    return {"op": op, "batch": b, "seq": s, "qHeads": hq, "kHeads": k_heads, "headDim": d, "rotaryDim": rotary_dim,
            "elemSize": ELEM_SIZE.get(q_like.dtype, 0), "interleaved": int(interleaved), "inverse": int(inverse),
            "inplace": int(inplace), "rotate": int(rotate)}


def tiling_params(v: KernelViews, inverse: bool) -> dict:
    """The tiling's input fields of a rotation, as rope_host.cpp fills them."""
    p = _op_params(_tiling.OP_ROTATE, v.q, 0 if v.k is None else v.k.shape[2], v.rotary_dim, v.interleaved, inverse,
                   v.inplace, True)
    for name, t in (("q", v.q), ("k", v.k), ("qo", v.q_out), ("ko", v.k_out)):
        p[name + "StrideB"], p[name + "StrideS"], p[name + "StrideH"] = _strides3(t)
    p.update(angle_params(v.angles))
    return p


def prologue_tiling_params(v: PrologueViews, grad: bool) -> dict:
    """The tiling's input fields of the prologue's forward (grad False) or backward."""
    p = _op_params(_tiling.OP_PROLOGUE_GRAD if grad else _tiling.OP_PROLOGUE, v.q_out, v.k_out.shape[2],
                   v.rotary_dim, v.interleaved, grad, v.inplace, v.rotate)
    p.update(hasQWeight=int(v.q_weight is not None), hasKWeight=int(v.k_weight is not None),
             epsBits=_tiling.float_bits(v.eps), weightOffsetBits=_tiling.float_bits(v.weight_offset),
             hasGradQ=int(grad and v.q is not None), hasGradK=int(grad and v.k is not None),
             hasGradV=int(grad and v.v is not None), hasCache=int(v.k_cache is not None))
    for name, t in (("q", v.q), ("k", v.k), ("v", v.v), ("qo", v.q_out), ("ko", v.k_out), ("vo", v.v_out),
                    ("xq", v.xq), ("xk", v.xk)):
        p[name + "StrideB"], p[name + "StrideS"], p[name + "StrideH"] = _strides3(t)
    if v.k_cache is not None:
        p.update(numSlots=v.k_cache.shape[0], kcStrideS=v.k_cache.stride(0), kcStrideH=v.k_cache.stride(1),
                 vcStrideS=v.v_cache.stride(0), vcStrideH=v.v_cache.stride(1),
                 slotMode=_tiling.POS_INT64 if v.slots.dtype == torch.int64 else _tiling.POS_INT32,
                 slotStrideB=v.slots.stride(0), slotStrideS=v.slots.stride(1))
    p.update(angle_params(v.angles))
    return p


# ---------------------------------------------------------------------------------------------
# What the kernels take.

KERNEL_ANGLES = ("table", "token", "mrope")  # the kernels' cos/sin sources (rope_kernel.h)


def call_reasons(angles: str, table_dtype: torch.dtype) -> list[str]:
    """Why the kernels cannot take calls of this angle source or table dtype (metadata only)."""
    reasons = []
    if angles not in KERNEL_ANGLES:
        reasons.append(f"kernels: angles {angles!r} (sources: {', '.join(KERNEL_ANGLES)})")
    if table_dtype not in TABLE_DTYPES:
        reasons.append(f"kernels: cos/sin tables of dtype {table_dtype} (float32, float16, bfloat16)")
    return reasons


def _angle_reasons(a: AngleViews, rotary_dim: int) -> list[str]:
    reasons = call_reasons(a.angles, a.cos.dtype)
    if a.pos is not None and a.pos.dtype not in (torch.int32, torch.int64):
        reasons.append(f"kernels: positions dtype {a.pos.dtype}")
    if a.cos.dtype != a.sin.dtype:
        reasons.append("kernels: cos and sin differ in dtype")
    dims = 3 if a.angles == "token" else 2
    for name, t in (("cos", a.cos), ("sin", a.sin)):
        if t.dim() != dims or t.shape[-1] != rotary_dim // 2 or (t.shape[-1] > 1 and t.stride(-1) != 1):
            reasons.append(f"kernels: {name} must be {dims}-D with r/2 = {rotary_dim // 2} frequencies, stride 1")
    if a.freq_turns is not None and (a.freq_turns.dtype != torch.int64 or not a.freq_turns.is_contiguous()):
        reasons.append("kernels: freq_turns must be contiguous int64")
    return reasons


def _stride_reasons(named) -> list[str]:
    return [f"kernels: {name} needs stride 1 on head_dim" for name, t in named
            if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1]


def _dtype_reasons(dtype: torch.dtype) -> list[str]:
    return [] if dtype in ELEM_SIZE else [f"kernels: dtype {dtype} not in fp32/fp16/bf16"]


def _tiling_reasons(params: dict, ub_size: int, core_num: int) -> list[str]:
    """Why no tiling fits the call whose tiling inputs are ``params``."""
    try:
        _tiling.compute_tiling(params, ub_size, core_num)
    except _tiling.TilingError as e:
        return [f"kernels: tiling: {e}"]
    return []


def kernel_reasons(v: KernelViews, inverse: bool, ub_size: int, core_num: int) -> list[str]:
    """Why the kernels cannot take this call (metadata only); empty: they can."""
    reasons = _dtype_reasons(v.q.dtype)
    reasons += _stride_reasons((("q", v.q), ("k", v.k), ("q_out", v.q_out), ("k_out", v.k_out)))
    reasons += _angle_reasons(v.angles, v.rotary_dim)
    if reasons:
        return reasons
    return _tiling_reasons(tiling_params(v, inverse), ub_size, core_num)


def prologue_reasons(v: PrologueViews, grad: bool, ub_size: int, core_num: int) -> list[str]:
    """Why the prologue kernels cannot take this call (metadata only); empty: they can."""
    dtype = v.k_out.dtype  # qkv's: k heads of the output (forward) or of grad_qkv (backward)
    reasons = _dtype_reasons(dtype)
    if v.q_out.dtype != dtype:
        reasons.append(f"kernels: q output of dtype {v.q_out.dtype} (the kernels write q in qkv's dtype {dtype})")
    if v.k_cache is not None and (v.k_cache.dtype != dtype or v.v_cache.dtype != dtype):
        reasons.append(f"kernels: KV cache of dtype {v.k_cache.dtype} (the kernels write {dtype} caches)")
    for name, t in (("grad_q", v.q), ("grad_k", v.k), ("grad_v", v.v)):
        if grad and t is not None and t.dtype != dtype:
            reasons.append(f"kernels: {name} of dtype {t.dtype}, qkv {dtype}")
    reasons += _stride_reasons((("q", v.q), ("k", v.k), ("v", v.v), ("q_out", v.q_out), ("k_out", v.k_out),
                                ("v_out", v.v_out), ("k_cache", v.k_cache), ("v_cache", v.v_cache)))
    if v.rotate:
        reasons += _angle_reasons(v.angles, v.rotary_dim)
    if reasons:
        return reasons
    return _tiling_reasons(prologue_tiling_params(v, grad), ub_size, core_num)
