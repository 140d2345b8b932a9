"""The backend contract: what a rope_ops backend declares and what it must compute.

A backend is a class registered under the entry-point group ``rope_ops.backends``; rope_ops
instantiates it once per process (stevedore ``invoke_on_load``). It declares its capabilities as
class attributes, says why it cannot run (``availability()`` for the environment, ``supports(call)``
for one kind of call; both return lists of reasons, empty meaning yes), and computes with
``run(args)``, which writes the rotated result into ``args.q_out`` / ``args.k_out``.

The forward (RotaryEmbedding) and the backward (RotaryEmbeddingGrad) are the same ``run``: the
backward passes ``inverse=True`` (rotation by minus the angle) with the output gradients as inputs.

``run`` receives validated arguments only (rope_ops checks everything in SPEC "Bad input" first);
it must not read data in ``supports``, must not assert, and must never read outside ``cos``/``sin``.
Positions may lie anywhere in int64, outside the table included: rows outside ``[0, P)`` are
computed from ``freq_turns`` (``cos_sin_on_the_fly`` below shows how) or, with caller tables
(``freq_turns`` None), are NaN.

What rope_ops does around ``run`` (so a backend need not): allocating outputs (unless
``allocates_outputs``), empty calls, autograd (the backward is ``run`` with ``inverse=True``),
moving the version counter of tensors written in place, torch.compile registration, and checking
a third-party backend's outputs (shape, dtype, device, every rotary element written) on the
first call of each kind.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch

# Layouts as the dims (batch, seq, head, dim) of the tensor; thd has no batch dim.
LAYOUT_DIMS: dict[str, tuple[int | None, int, int, int]] = {
    "bshd": (0, 1, 2, 3),
    "sbhd": (1, 0, 2, 3),
    "bhsd": (0, 2, 1, 3),
    "thd": (None, 0, 1, 2),
}
LAYOUTS = tuple(LAYOUT_DIMS)
STYLES = ("neox", "gptj")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# float8 e4m3 (the KV cache): its largest finite value; caches saturate there (SPEC 9.4)
_FLOAT8_MAX = 448.0


class RopeCall(NamedTuple):
    """Metadata of one kind of call: all a backend may look at to accept or refuse it.

    It is also the key of the selection cache, so it holds no sizes that change from call to
    call (token counts), only what decides whether a backend can take the call.
    """

    device_type: str
    dtype: torch.dtype
    layout: str
    style: str
    head_dim: int
    rotary_dim: int
    q_heads: int
    k_heads: int  # 0 when k is None
    inplace: bool
    pos_dtype: torch.dtype | None  # None: positions given as a Python int offset
    caller_tables: bool  # cos/sin supplied by the caller (no inv_freq to fall back on)
    needs_grad: bool  # the call records a backward
    last_dim_contiguous: bool  # q and k have stride 1 on the head_dim axis
    angles: str = "table"  # where angles come from: see KernelArgs.angles
    table_dtype: torch.dtype = torch.float32  # dtype of cos/sin (caller tables may be fp16/bf16)
    op: str = "rope"  # "rope" (apply) or "prologue" (qkv_prologue: PrologueArgs)
    cache_dtype: torch.dtype | None = None  # prologue: the KV cache's dtype, None without a cache
    mrope_interleaved: bool = False  # angles "mrope": frequencies assigned round-robin (Qwen3-VL)
    q_out_dtype: torch.dtype | None = None  # prologue: q's output dtype when not qkv's (float8)


class KernelArgs(NamedTuple):
    """One call, end to end: everything ``run`` needs, validated.

    Tensors are in the caller's layout (see ``LAYOUT_DIMS``); ``bshd_view`` turns any of them into
    a strided ``[B, S, H, D]`` view without copying. Out of place, ``q_out``/``k_out`` have q's/k's
    shapes (any strides) and never overlap the inputs; in place they are q and k themselves.
    """

    q: torch.Tensor  # input, any strides
    k: torch.Tensor | None
    q_out: torch.Tensor | None  # where to write; ``q`` itself when in place; None: see allocates_outputs
    k_out: torch.Tensor | None
    # int32/int64 [B,S], [S] (shared by the batch) or [T] (thd); None: offset (or no positions,
    # angles "token"). mRoPE: [3, B, S], [3, S] or [3, T], one row per axis (t, h, w).
    pos: torch.Tensor | None
    pos_offset: int  # when pos is None, token s has position pos_offset + s
    # Tables: [P, rotary_dim/2] with stride 1 along frequencies (rows may be strided: cos and sin
    # can be the two halves of one [P, rotary_dim] cache), holding m*cos(theta(p, i)) and
    # m*sin(theta(p, i)) for p < P; float32, or float16/bfloat16 for caller tables. With angles
    # "token": [B, S, rotary_dim/2] (thd: B = 1), one row per token, any strides (0 to broadcast),
    # stride 1 along frequencies.
    cos: torch.Tensor
    sin: torch.Tensor
    # Frequencies as fixed-point turns: frac(inv_freq[i] / 2pi) * 2^64 stored as a wrapped int64,
    # so p * freq_turns[i] (wrapping int64 product) is the angle of any integer position p as a
    # 64-bit fraction of a turn, exactly. None for caller tables: then rows outside [0, P) are NaN.
    freq_turns: torch.Tensor | None
    attention_factor: float  # m, applied to positions computed on the fly
    layout: str
    rotary_dim: int
    interleaved: bool  # gptj pairs (2i, 2i+1); neox pairs (i, i + r/2)
    inverse: bool  # rotate by minus the angle (the backward)
    inplace: bool  # q_out is q: write only the rotary dims
    # Where the angles come from (the variant seam):
    # "table": row pos(b, s) of cos/sin (rows outside: freq_turns, or NaN for caller tables);
    # "token": row (b, s) of the per-token cos/sin, no positions;
    # "mrope": frequency i of token (b, s) takes row pos[axis_i, b, s], axis_i from
    #          rope_ops._mrope.mrope_axes(mrope_section, mrope_interleaved).
    angles: str = "table"
    mrope_section: tuple[int, int, int] | None = None
    mrope_interleaved: bool = False


class PrologueArgs(NamedTuple):
    """One fused prologue call (rope_ops.qkv_prologue), validated.

    The input is the QKV projection's output; its heads are q (num_q_heads), then k and v
    (num_kv_heads each), each of head_dim. Per head of q and k: RMSNorm with float32 statistics,
    ``x * rsqrt(mean(x^2) + eps) * (weight_offset + weight)`` where a weight is given; then, with
    ``rotate``, the rotation of KernelArgs (same angle fields); everything in float32, rounded once
    to the output dtype (and, for a float8 cache, once to float8 of value / scale).
    """

    qkv: torch.Tensor  # [T, W] (layout "thd") or [B, S, W] ("bshd"); stride 1 along W
    q_out: torch.Tensor | None  # [T, Hq, D] / [B, S, Hq, D] (any strides); None in place
    k_out: torch.Tensor | None
    v_out: torch.Tensor | None
    pos: torch.Tensor | None  # as KernelArgs.pos for the layout
    pos_offset: int
    cos: torch.Tensor  # as KernelArgs.cos (0 rows when not rotating)
    sin: torch.Tensor
    freq_turns: torch.Tensor | None
    attention_factor: float
    layout: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    interleaved: bool
    rotate: bool
    q_weight: torch.Tensor | None  # [D], any float dtype
    k_weight: torch.Tensor | None
    eps: float
    weight_offset: float
    inplace: bool  # write q and k heads into qkv (v untouched)
    k_cache: torch.Tensor | None  # [num_slots, Hk, D]; qkv's dtype or float8_e4m3fn
    v_cache: torch.Tensor | None
    slots: torch.Tensor | None  # [T] / [B, S] int: each token's slot; outside [0, num_slots): skip
    k_scale: float  # float8 cache: it holds value / scale
    v_scale: float
    angles: str = "table"
    mrope_section: tuple[int, int, int] | None = None
    mrope_interleaved: bool = False
    # > 0: q_out is float8_e4m3fn holding q / q_scale, rounded once (saturating, as the float8
    # cache); out of place and inference only
    q_scale: float = 0.0

    def rotation(self, x: torch.Tensor) -> KernelArgs:
        """The KernelArgs of rotating ``x`` (a [B, S, H, D] or [T, H, D] view) like this call."""
        return KernelArgs(x, None, None, None, self.pos, self.pos_offset, self.cos, self.sin,
                          self.freq_turns, self.attention_factor, self.layout, self.rotary_dim,
                          self.interleaved, False, False, self.angles, self.mrope_section,
                          self.mrope_interleaved)


class Backend:
    """Base class with declarative capabilities; subclasses override what differs."""

    name: ClassVar[str] = ""
    # Higher wins in automatic selection (built-in backends win ties); the torch fallback has 0.
    priority: ClassVar[int] = 0
    # Whether automatic selection may pick this backend. rope_ops' own backends do; a
    # third-party backend joins automatic selection only when it sets this True (otherwise it
    # runs when named: ROPE_OPS_BACKEND, backend=, use_backend). ``info`` says which do.
    joins_auto: ClassVar[bool] = False
    device_types: ClassVar[frozenset[str]] = frozenset()  # "*": any device
    # Devices on which automatic selection may pick this backend (a subset of device_types);
    # others need the backend named explicitly.
    auto_device_types: ClassVar[frozenset[str] | None] = None
    dtypes: ClassVar[frozenset[torch.dtype]] = frozenset(FLOAT_DTYPES[:3])
    layouts: ClassVar[frozenset[str]] = frozenset(LAYOUTS)
    styles: ClassVar[frozenset[str]] = frozenset(STYLES)
    min_head_dim: ClassVar[int] = 2
    max_head_dim: ClassVar[int] = 1 << 30
    supports_backward: ClassVar[bool] = True
    supports_inplace: ClassVar[bool] = True
    supports_caller_tables: ClassVar[bool] = True
    requires_last_dim_contiguous: ClassVar[bool] = False
    # Angle sources it implements (KernelArgs.angles) and table dtypes it reads.
    angle_kinds: ClassVar[frozenset[str]] = frozenset({"table"})
    table_dtypes: ClassVar[frozenset[torch.dtype]] = frozenset({torch.float32})
    # The fused prologue (rope_ops.qkv_prologue): run_prologue / run_prologue_backward, and the
    # KV-cache dtypes it writes (besides the input's own dtype).
    supports_prologue: ClassVar[bool] = False
    prologue_cache_dtypes: ClassVar[frozenset[torch.dtype]] = frozenset()
    # dtypes it writes q in besides the input's (float8 with PrologueArgs.q_scale)
    prologue_q_dtypes: ClassVar[frozenset[torch.dtype]] = frozenset()
    # Out of place, a backend that allocates its own outputs (saving the Python-side allocation,
    # ~1 us each) gets q_out = k_out = None and returns (q_out, k_out) from run().
    allocates_outputs: ClassVar[bool] = False

    def availability(self) -> list[str]:
        """Why this backend cannot run in this process at all (missing SDK, no device...)."""
        return []

    def supports(self, call: RopeCall) -> list[str]:
        """Why this backend cannot take this kind of call. Metadata only, never data."""
        reasons = []
        if call.device_type not in self.device_types and "*" not in self.device_types:
            reasons.append(f"device {call.device_type!r} not in {sorted(self.device_types)}")
        if call.dtype not in self.dtypes:
            reasons.append(f"dtype {call.dtype} not in {sorted(str(d) for d in self.dtypes)}")
        if call.layout not in self.layouts:
            reasons.append(f"layout {call.layout!r} not in {sorted(self.layouts)}")
        if call.style not in self.styles:
            reasons.append(f"style {call.style!r} not in {sorted(self.styles)}")
        if not self.min_head_dim <= call.head_dim <= self.max_head_dim:
            reasons.append(
                f"head_dim {call.head_dim} outside [{self.min_head_dim}, {self.max_head_dim}]"
            )
        if call.needs_grad and not self.supports_backward:
            reasons.append("no backward")
        if call.inplace and not self.supports_inplace:
            reasons.append("no in-place")
        if call.caller_tables and not self.supports_caller_tables:
            reasons.append("no caller-supplied cos/sin tables")
        if self.requires_last_dim_contiguous and not call.last_dim_contiguous:
            reasons.append("needs stride 1 on head_dim")
        if call.angles not in self.angle_kinds:
            reasons.append(f"angles {call.angles!r} not in {sorted(self.angle_kinds)}")
        if call.table_dtype not in self.table_dtypes:
            reasons.append(f"cos/sin tables of dtype {call.table_dtype} not in "
                           f"{sorted(str(d) for d in self.table_dtypes)}")
        if call.op == "prologue":
            if not self.supports_prologue:
                reasons.append("no fused prologue (qkv_prologue)")
            elif call.cache_dtype not in (None, call.dtype) and call.cache_dtype not in self.prologue_cache_dtypes:
                reasons.append(f"no KV-cache write in {call.cache_dtype}")
            if call.q_out_dtype is not None and call.q_out_dtype not in self.prologue_q_dtypes:
                reasons.append(f"no q output in {call.q_out_dtype}")
        return reasons

    def run(self, args: KernelArgs):
        """Write the rotation of args.q (args.k) into args.q_out (args.k_out) and return None;
        or, when ``allocates_outputs`` and args.q_out is None, return new (q_out, k_out)."""
        raise NotImplementedError

    def run_prologue(self, args: PrologueArgs):
        """The fused prologue's forward: write q, k, v into args.q_out/k_out/v_out (out of place)
        or the normalised, rotated q and k heads into args.qkv (in place), and, with a cache,
        the rotated k and v into args.k_cache/v_cache at args.slots. See PrologueArgs."""
        raise NotImplementedError

    def run_prologue_backward(self, args: PrologueArgs, grad_q, grad_k, grad_v):
        """Gradients of the prologue: (grad_qkv like args.qkv, grad of args.q_weight, grad of
        args.k_weight), the weight gradients float32 [D] (None where that weight is None).
        args.qkv is the forward's input; grads may be None (zero)."""
        raise NotImplementedError

    def bind(self, cos, sin, freq_turns, attention_factor, layout, rotary_dim, interleaved, inverse):
        """Optional: a callable ``(q, k, pos, pos_offset) -> (q_out, k_out)`` doing what run()
        does for an eager out-of-place call with these constants (``inverse``: the backward), or
        None. rope_ops.apply caches it per call kind (inference calls, and both directions of
        autograd calls), so a backend can skip per-call argument handling (decode, training).

        The callable may also have ``guarded(q, k, pos)``, returning a callable ``(q, k, pos) ->
        (q_out, k_out) or None`` that runs only calls with the metadata of that call (exact
        torch.Tensor types; q's and k's sizes, strides, dtype and device; pos's sizes, dtype and
        device, or an int offset in (-2**62, 2**62)) that need no gradient, and returns None for
        any other. apply keeps the guard of its last inference call per set of keyword arguments
        and runs repeats through it without building its metadata key; it must be cheaper than
        that key (the CUDA backend's is C++).

        It may also have ``with_grad(q, k, pos, pos_offset) -> (q_out, k_out)``: the same call
        recorded by autograd, used for cached calls that need a gradient instead of rope_ops'
        own autograd.Function. Its backward must be the rotation by minus the angle (differentiable
        again under create_graph), save the positions with a version check, and leave an unused
        output's gradient None."""
        return None

    def describe(self) -> dict:
        """Capabilities, for ``python -m rope_ops info``."""
        return {
            "priority": self.priority,
            "devices": sorted(self.device_types),
            "auto_devices": sorted(self.auto_devices()),
            "dtypes": [str(d).replace("torch.", "") for d in sorted(self.dtypes, key=str)],
            "layouts": sorted(self.layouts),
            "styles": sorted(self.styles),
            "head_dim": [self.min_head_dim, self.max_head_dim],
            "backward": self.supports_backward,
            "inplace": self.supports_inplace,
            "caller_tables": self.supports_caller_tables,
            "angles": sorted(self.angle_kinds),
            "prologue": self.supports_prologue,
        }

    def priority_for(self, call: RopeCall) -> int:
        """Its rank in automatic selection for this kind of call (higher first): ``priority``
        unless a backend knows another backend's kernels are faster for some calls."""
        return self.priority

    def auto_devices(self) -> frozenset[str]:
        return self.device_types if self.auto_device_types is None else self.auto_device_types


# ---------------------------------------------------------------------------------------------
# Helpers shared by backends written in Python.


def bshd_view(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A strided [B, S, H, D] view of a tensor in ``layout`` (thd becomes B = 1). No copy."""
    if layout == "bshd":
        return t
    if layout == "thd":
        return t.unsqueeze(0)
    if layout == "sbhd":
        return t.transpose(0, 1)
    return t.transpose(1, 2)  # bhsd


def positions_bs(args: KernelArgs, batch: int, seq: int) -> torch.Tensor:
    """Positions as an int64 [B, S] tensor (a broadcast view where the input was shared);
    [3, B, S] for mRoPE; zeros for per-token angles (no positions)."""
    if args.angles == "token":
        return torch.zeros((), dtype=torch.int64, device=args.q.device).expand(batch, seq)
    if args.pos is None:
        p = torch.arange(seq, device=args.q.device, dtype=torch.int64) + args.pos_offset
        return p.expand(batch, seq)
    p = args.pos.to(torch.int64)
    if args.angles == "mrope":
        if p.dim() == 2:  # [3, S] shared by the batch, or [3, T]
            p = p.unsqueeze(1)
        return p.expand(3, batch, seq)
    if p.dim() == 1:
        return p.expand(batch, seq)
    return p


def cos_sin_rows(args: KernelArgs, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (c, s) of shape [B, S, rotary_dim/2] (positions from ``positions_bs``), honouring
    the spec for any position and every angle source.

    Rows inside the table are gathered from it; other positions are computed on the fly from
    ``freq_turns`` (exact fixed-point angle), or are NaN with caller tables. No host sync.
    """
    half = args.rotary_dim // 2
    if args.angles == "token":
        batch, seq = positions.shape
        return (args.cos.to(torch.float32).expand(batch, seq, half),
                args.sin.to(torch.float32).expand(batch, seq, half))
    if args.angles == "mrope":
        from ._mrope import mrope_axes

        axes = mrope_axes(args.mrope_section, args.mrope_interleaved).to(positions.device)
        positions = positions[axes].permute(1, 2, 0)  # [B, S, r/2]: frequency i's position
        column = torch.arange(half, device=positions.device).expand_as(positions)
    else:
        positions = positions.unsqueeze(-1)  # [B, S, 1]
        column = None
    n_rows = args.cos.shape[0]
    in_table = (positions >= 0) & (positions < n_rows)
    index = torch.where(in_table, positions, torch.zeros_like(positions))
    if n_rows == 0:
        c = torch.zeros(*positions.shape[:-1], half, device=positions.device)
        s = c
    elif column is None:
        c = args.cos[index.squeeze(-1)].to(torch.float32)
        s = args.sin[index.squeeze(-1)].to(torch.float32)
    else:
        c = args.cos[index, column].to(torch.float32)
        s = args.sin[index, column].to(torch.float32)
    if args.freq_turns is None:
        fill_c = fill_s = torch.full((), float("nan"), device=positions.device)
    else:
        fill_c, fill_s = cos_sin_on_the_fly(positions, args.freq_turns, args.attention_factor)
    return torch.where(in_table, c, fill_c), torch.where(in_table, s, fill_s)


def cos_sin_on_the_fly(
    positions: torch.Tensor, freq_turns: torch.Tensor, attention_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """m*cos and m*sin of p * inv_freq from fixed-point turns, float32, accurate to ~3e-7 rad.

    ``positions``: [..., 1] (one per token) or [..., r/2] (one per frequency, mRoPE). The wrapping
    int64 product p * freq_turns is the angle as a signed 64-bit fraction of a turn; its top 32
    bits, as a signed int32, give turns in [-1/2, 1/2) with 2^-32 resolution.
    """
    turns64 = positions.to(torch.int64) * freq_turns
    top = torch.bitwise_right_shift(turns64, 32)  # arithmetic shift: signed turns * 2^32
    angle = top.to(torch.float32) * (2.0 * torch.pi / 2.0**32)
    return torch.cos(angle) * attention_factor, torch.sin(angle) * attention_factor


# ---------------------------------------------------------------------------------------------
# The fused prologue in plain torch ops (float32 math): the torch backend's implementation, and
# a correct path any backend may run for what its kernels do not cover.


def _split_heads(args: PrologueArgs, x: torch.Tensor):
    heads = x.unflatten(-1, (args.num_q_heads + 2 * args.num_kv_heads, args.head_dim))
    return heads.split([args.num_q_heads, args.num_kv_heads, args.num_kv_heads], dim=-2)


def _rotate_float(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, args: PrologueArgs) -> torch.Tensor:
    """x (float, [.., H, D]) rotated by (c, s) [.., 1, r/2]; pass-through dims unchanged."""
    r = args.rotary_dim
    if args.interleaved:
        a, b = x[..., 0:r:2], x[..., 1:r:2]
    else:
        a, b = x[..., : r // 2], x[..., r // 2: r]
    ra, rb = a * c - b * s, b * c + a * s
    rotated = torch.stack([ra, rb], dim=-1).flatten(-2) if args.interleaved else torch.cat([ra, rb], dim=-1)
    return torch.cat([rotated, x[..., r:]], dim=-1)


def _prologue_angles(args: PrologueArgs, like: torch.Tensor):
    """float32 (c, s) broadcastable over heads: [B, S, 1, r/2] ([T, 1, r/2] for thd)."""
    view = like.unsqueeze(0) if args.layout == "thd" else like  # [B, S, H, D]
    rot = args.rotation(like)
    c, s = cos_sin_rows(rot, positions_bs(rot, view.shape[0], view.shape[1]))
    if args.layout == "thd":
        c, s = c[0], s[0]
    return c.unsqueeze(-2), s.unsqueeze(-2)


def _norm(x: torch.Tensor, weight, args: PrologueArgs):
    """(normalised x, rstd) in float32, or (x, None) without a weight."""
    if weight is None:
        return x, None
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + args.eps)
    return x * rstd * (args.weight_offset + weight.to(x.dtype)), rstd


def prologue_forward_torch(args: PrologueArgs) -> None:
    """PrologueArgs' forward in torch ops; writes the outputs (and the cache)."""
    compute = torch.float64 if args.qkv.dtype == torch.float64 else torch.float32
    q, k, v = _split_heads(args, args.qkv)
    c = s = None
    if args.rotate:
        c, s = _prologue_angles(args, q)
        c, s = c.to(compute), s.to(compute)
    done = []
    for x, weight in ((q, args.q_weight), (k, args.k_weight)):
        y, _ = _norm(x.to(compute), weight, args)
        if args.rotate:
            y = _rotate_float(y, c, s, args)
        done.append(y)
    if args.inplace:
        q.copy_(done[0])
        k.copy_(done[1])
    else:
        args.q_out.copy_(_float8_of(done[0], args.q_scale) if args.q_scale > 0 else done[0])
        args.k_out.copy_(done[1])
        args.v_out.copy_(v)
    if args.k_cache is not None:
        slots = args.slots.reshape(-1).to(torch.int64)
        keep = (slots >= 0) & (slots < args.k_cache.shape[0])
        index = slots[keep]
        for cache, values, scale in ((args.k_cache, done[1], args.k_scale),
                                     (args.v_cache, v.to(compute), args.v_scale)):
            flat = values.reshape(-1, *values.shape[-2:])[keep]
            if cache.element_size() == 1:  # float8: index_copy_ has no float8 kernel; move bytes
                cache.view(torch.uint8).index_copy_(0, index, _float8_of(flat, scale).view(torch.uint8))
            else:
                cache.index_copy_(0, index, (flat / scale if scale != 1.0 else flat).to(cache.dtype))


def _float8_of(values: torch.Tensor, scale: float) -> torch.Tensor:
    """float8 e4m3 of values / scale, saturating at +-448 (SPEC; torch before 2.13 converts
    values past 448 to NaN); NaN stays NaN."""
    stored = values / scale if scale != 1.0 else values
    return stored.clamp(-_FLOAT8_MAX, _FLOAT8_MAX).to(torch.float8_e4m3fn)


def prologue_backward_torch(args: PrologueArgs, grad_q, grad_k, grad_v):
    """PrologueArgs' backward in torch ops: (grad_qkv, grad_q_weight, grad_k_weight)."""
    compute = torch.float64 if args.qkv.dtype == torch.float64 else torch.float32
    q, k, _ = _split_heads(args, args.qkv)
    c = s = None
    if args.rotate:
        c, s = _prologue_angles(args, q)
        c, s = c.to(compute), s.to(compute)
    grads, weight_grads = [], []
    for x, weight, g in ((q, args.q_weight, grad_q), (k, args.k_weight, grad_k)):
        if g is None:
            grads.append(torch.zeros(x.shape, dtype=compute, device=x.device))
            weight_grads.append(None if weight is None else torch.zeros(args.head_dim, device=x.device))
            continue
        g = g.to(compute)
        if args.rotate:
            g = _rotate_float(g, c, -s, args)  # the rotation's transpose: by minus the angle
        if weight is None:
            grads.append(g)
            weight_grads.append(None)
            continue
        xf = x.to(compute)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + args.eps)
        n = xf * rstd
        reduce_dims = tuple(range(g.dim() - 1))
        weight_grads.append((g * n).sum(dim=reduce_dims).to(torch.float32))
        gn = g * (args.weight_offset + weight.to(compute))
        grads.append(rstd * (gn - n * (gn * n).mean(-1, keepdim=True)))
    v_shape = q.shape[:-2] + (args.num_kv_heads, args.head_dim)
    gv = torch.zeros(v_shape, dtype=compute, device=q.device) if grad_v is None else grad_v.to(compute)
    grad_qkv = torch.cat([grads[0], grads[1], gv], dim=-2).flatten(-2).to(args.qkv.dtype)
    return grad_qkv, weight_grads[0], weight_grads[1]
