"""The fused attention prologue: QKV split + per-head RMSNorm + RoPE (+ KV-cache write).

What a model runs between its QKV projection and attention, as one call (one pass over the bytes
where a backend fuses it): split the packed projection output per head, RMSNorm q and k heads
with their own weights (Qwen3, Gemma 3, OLMo-style QK-norm; statistics and math in float32),
rotate q and k, and for inference write the rotated k and v into a caller's KV cache at given
slots. Rounded once, at the end, to the output dtype (Hugging Face's modules round between norm
and rotation as well; the difference is within the stated accuracy, tests/test_prologue_hf.py).

Each part can be switched off: no weights, no norm; ``rotate=False``, no rotation; no
``kv_cache``, no cache write. Forward and backward (autograd, the norm weights' gradients
included) on every backend that declares ``supports_prologue``; the cache write is inference
only (a call that needs a gradient and writes a cache is refused).
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from . import _select
from ._api import resolve_angles
from ._errors import RopeError
from ._ops import q_out_dtype, run_prologue_backend, run_prologue_backward_backend
from .backend import PrologueArgs, RopeCall

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_CACHE_FP8 = tuple(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None)
_is_compiling = torch.compiler.is_compiling


def qkv_prologue(qkv: torch.Tensor, pos, *, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 eps: float = 1e-6, norm_offset: float = 0.0, rotate: bool = True,
                 rotary_dim: int | None = None, style: str | None = None, base: float | None = None,
                 scaling: dict | None = None, rope=None, cos_sin=None, max_position: int | None = None,
                 seq_len: int | None = None, mrope_section=None, mrope_interleaved: bool = False,
                 inplace: bool = False, kv_cache=None, slots: torch.Tensor | None = None,
                 cache_scales=None, q_scale: float | None = None, backend: str | None = None):
    """Split, normalise and rotate a QKV projection's output. Returns ``(q, k, v)``.

    Args:
        qkv: [T, (Hq + 2 Hk) * D] (tokens packed, thd) or [B, S, (Hq + 2 Hk) * D] (bshd); any
            token strides, stride 1 along the last dim; float32/float16/bfloat16.
        pos: positions as for ``rope_ops.apply`` ([T] / [B, S] / [S] / an int offset; None with
            per-token ``cos_sin``; [3, ...] with ``mrope_section``); None when ``rotate=False``.
        num_q_heads, num_kv_heads, head_dim: the split (GQA/MQA: fewer kv heads).
        q_norm, k_norm: RMSNorm weights [D] of q's and k's heads (None: that norm is off).
        eps, norm_offset: x / sqrt(mean(x^2) + eps) * (norm_offset + weight); norm_offset=1.0 is
            Gemma's convention (weights stored as an offset from 1).
        rotate: rotate q and k (False: norm only).
        rotary_dim, style, base, scaling, rope, cos_sin, max_position, seq_len, mrope_*: the
            rotation, exactly as ``rope_ops.apply`` takes them.
        inplace: write the normalised, rotated q and k into ``qkv`` and return views of it
            (inference only); otherwise q, k, v are new contiguous tensors ([T, H, D] or
            [B, S, H, D]).
        kv_cache: (k_cache, v_cache), each [num_slots, Hk, D] (a paged [blocks, block_size, Hk, D]
            cache is taken as its flat [blocks * block_size, Hk, D] view), of qkv's dtype or
            float8_e4m3fn; ``slots`` [T] ([B, S]) gives each token's slot, -1 to skip. Slot values
            outside [-1, num_slots) raise RopeError where the slots are on the CPU; on a device
            they are skipped like -1 (nothing is written out of bounds, and there is no host sync
            to find out). Inference only.
        cache_scales: (k_scale, v_scale) for a float8 cache: the cache holds value / scale.
        q_scale: return q as float8_e4m3fn holding q / q_scale (rounded once, saturating at
            +-448 as the float8 cache; for FP8 attention). Out of place, inference only.
        backend: as for ``rope_ops.apply``.
    """
    if type(qkv) is not torch.Tensor:
        from . import distributed

        if distributed.is_dtensor(qkv):  # each rank runs its shard of tokens
            return distributed.qkv_prologue(
                qkv, pos, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                q_norm=q_norm, k_norm=k_norm, eps=eps, norm_offset=norm_offset, rotate=rotate,
                rotary_dim=rotary_dim, style=style, base=base, scaling=scaling, rope=rope,
                cos_sin=cos_sin, max_position=max_position, seq_len=seq_len,
                mrope_section=mrope_section, mrope_interleaved=mrope_interleaved, inplace=inplace,
                kv_cache=kv_cache, slots=slots, cache_scales=cache_scales, q_scale=q_scale,
                backend=backend)
    kw = {"rotary_dim": rotary_dim, "style": style, "base": base, "scaling": scaling, "rope": rope,
          "cos_sin": cos_sin, "max_position": max_position, "seq_len": seq_len,
          "mrope_section": mrope_section, "mrope_interleaved": mrope_interleaved}
    call, args, spec = _prepare(qkv, pos, num_q_heads, num_kv_heads, head_dim, q_norm, k_norm, eps,
                                norm_offset, rotate, inplace, kv_cache, slots, cache_scales, q_scale,
                                backend, kw)
    weights = (args.q_weight, args.k_weight)
    if call.needs_grad:
        return PrologueFunction.apply(qkv, args.q_weight, args.k_weight, args.pos, args.cos, args.sin,
                                      args.freq_turns, spec)
    return _forward(spec, qkv, *weights, args.pos, args.cos, args.sin, args.freq_turns)


class _Spec(NamedTuple):
    """Everything of a prologue call but its tensors (carried through autograd and the ops)."""

    layout: str
    pos_offset: int
    attention_factor: float
    angles: str
    mrope_section: tuple
    mrope_interleaved: bool
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    interleaved: bool
    rotate: bool
    eps: float
    weight_offset: float
    inplace: bool
    k_scale: float
    v_scale: float
    request: str
    backend: object  # the selected Backend (eager); None when traced
    call: RopeCall | None
    caches: tuple  # (k_cache, v_cache, slots) or (None, None, None)
    freqs: str = ""  # traced calls without tables: the frequency parameters as text
    seq_len: int = -1
    q_scale: float = 0.0  # > 0: q out as float8 of q / q_scale


def _check_int(name, value, minimum=1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise RopeError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def _check_float(name, value, *, positive=False) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) \
            or (positive and value <= 0) or (not positive and name == "eps" and value < 0):
        raise RopeError(f"{name}: expected a finite number{' > 0' if positive else ''}, got {value!r}")
    return float(value)


def _prepare(qkv, pos, hq, hk, head_dim, q_norm, k_norm, eps, norm_offset, rotate, inplace,
             kv_cache, slots, cache_scales, q_scale, backend, kw):
    if not isinstance(qkv, torch.Tensor):
        raise RopeError(f"qkv: expected a torch.Tensor, got {type(qkv).__name__}")
    hq, hk, head_dim = (_check_int("num_q_heads", hq), _check_int("num_kv_heads", hk),
                        _check_int("head_dim", head_dim))
    if qkv.dtype not in _DTYPES:
        raise RopeError(f"qkv: expected dtype float32, float16, bfloat16 or float64, got {qkv.dtype}")
    if qkv.dim() not in (2, 3):
        raise RopeError(f"qkv: expected [T, W] or [B, S, W], got {qkv.dim()}-D shape {tuple(qkv.shape)}")
    width = (hq + 2 * hk) * head_dim
    if qkv.shape[-1] != width:
        raise RopeError(f"qkv: last dim {qkv.shape[-1]} is not (num_q_heads + 2 * num_kv_heads) * "
                        f"head_dim = ({hq} + 2 * {hk}) * {head_dim} = {width}")
    if qkv.stride(-1) != 1 and qkv.shape[-1] > 1:
        raise RopeError("qkv: needs stride 1 along its last dim (heads x head_dim); any token strides")
    layout = "thd" if qkv.dim() == 2 else "bshd"
    leading = tuple(qkv.shape[:-1])
    eps = _check_float("eps", eps)
    norm_offset = _check_float("norm_offset", norm_offset)
    for name, value in (("rotate", rotate), ("inplace", inplace)):
        if not isinstance(value, bool):
            raise RopeError(f"{name}: expected a bool, got {value!r}")
    weights = []
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None:
            if not isinstance(w, torch.Tensor) or not w.dtype.is_floating_point:
                raise RopeError(f"{name}: expected a floating-point weight tensor [head_dim], got {w!r:.60}")
            if tuple(w.shape) != (head_dim,):
                raise RopeError(f"{name}: expected shape [{head_dim}] (head_dim), got {list(w.shape)}")
            if w.device != qkv.device:
                raise RopeError(f"{name}: on {w.device}, qkv on {qkv.device}")
        weights.append(w)
    q_view = qkv[..., : hq * head_dim].unflatten(-1, (hq, head_dim))
    if rotate:
        angles = resolve_angles(q_view, pos, kw, layout, head_dim, leading)
    else:
        given = [name for name, value in kw.items() if value not in (None, False)]
        if pos is not None or given:
            raise RopeError(f"rotate: False switches the rotation off, but rotation arguments were given "
                            f"({['pos'] if pos is not None else []} {given}); drop them")
        angles = None
    grad_enabled = torch.is_grad_enabled()
    needs_grad = grad_enabled and (qkv.requires_grad or any(w is not None and w.requires_grad for w in weights))
    if inplace and needs_grad:
        raise RopeError("inplace: the in-place prologue is for inference; in training use "
                        "inplace=False (new q, k, v) so the input stays available to the backward")
    k_cache = v_cache = None
    k_scale = v_scale = 1.0
    if kv_cache is not None:
        if needs_grad:
            raise RopeError("kv_cache: the cache write is inference only; call under torch.no_grad() "
                            "or torch.inference_mode(), or without kv_cache")
        k_cache, v_cache, slots, k_scale, v_scale = _check_cache(kv_cache, slots, cache_scales, qkv,
                                                                 hk, head_dim, leading)
    elif slots is not None or cache_scales is not None:
        raise RopeError("slots/cache_scales: given without kv_cache")
    q_scale = _check_q_scale(q_scale, inplace, needs_grad)
    if inplace:
        from ._memory import check_inplace_autograd, has_internal_overlap

        check_inplace_autograd("qkv", qkv, False)
        if has_internal_overlap(qkv):
            raise RopeError("qkv: in place on a tensor whose elements overlap (e.g. expanded)")
    request = _select.current_request(backend)
    rotary_dim = angles.rotary_dim if angles else head_dim
    interleaved = bool(angles and angles.style == "gptj")
    kind = angles.kind if angles else "table"
    pos_tensor = angles.pos if angles else None
    cos = angles.cos if angles else _EMPTY.get(qkv.device)
    traced_spec = bool(angles and angles.spec)
    call = RopeCall(qkv.device.type, qkv.dtype, layout, "gptj" if interleaved else "neox", head_dim,
                    rotary_dim, hq, hk, inplace, None if pos_tensor is None else pos_tensor.dtype,
                    angles is not None and angles.freq_turns is None and not traced_spec, needs_grad,
                    True, kind, torch.float32 if cos is None else cos.dtype,
                    "prologue", None if k_cache is None else k_cache.dtype,
                    q_out_dtype=q_out_dtype(q_scale))
    selected = None if _is_compiling() else _select.select(call, request)
    spec = _Spec(layout, angles.pos_offset if angles else 0, angles.attention_factor if angles else 1.0,
                 kind, tuple(angles.mrope_section or ()) if angles else (),
                 bool(angles and angles.mrope_interleaved), hq, hk, head_dim, rotary_dim, interleaved,
                 rotate, eps, norm_offset, inplace, k_scale, v_scale, request, selected, call,
                 (k_cache, v_cache, slots), angles.spec if angles else "",
                 -1 if not angles or angles.seq_len is None else angles.seq_len, q_scale)
    args = PrologueArgs(qkv, None, None, None, pos_tensor, spec.pos_offset, cos,
                        angles.sin if angles else cos, angles.freq_turns if angles else None,
                        spec.attention_factor, layout, hq, hk, head_dim, rotary_dim, interleaved,
                        rotate, weights[0], weights[1], eps, norm_offset, inplace, k_cache, v_cache,
                        slots, k_scale, v_scale, kind, angles.mrope_section if angles else None,
                        spec.mrope_interleaved, q_scale)
    return call, args, spec


def _check_scale(name, value) -> float:
    """A float8 scale: a positive finite number, or a one-element tensor holding one."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise RopeError(f"{name}: expected one number, got a tensor of shape {list(value.shape)}")
        value = float(value)
    return _check_float(name, value, positive=True)


def _check_q_scale(q_scale, inplace, needs_grad) -> float:
    """0.0 (q in qkv's dtype) or the positive scale of a float8 q."""
    if q_scale is None:
        return 0.0
    if not _CACHE_FP8:
        raise RopeError("q_scale: this torch has no float8_e4m3fn")
    q_scale = _check_scale("q_scale", q_scale)
    if not torch.finfo(torch.float32).tiny <= q_scale <= torch.finfo(torch.float32).max:
        raise RopeError(f"q_scale: {q_scale!r} is not a normal float32 (kernels divide in float32)")
    if inplace:
        raise RopeError("q_scale: a float8 q is a new tensor; it cannot be written into qkv (inplace=False)")
    if needs_grad:
        raise RopeError("q_scale: a float8 q is for inference; call under torch.no_grad() or "
                        "torch.inference_mode(), or without q_scale")
    return q_scale


class _EmptyTables(dict):
    """A 0-row float32 table per device, for calls that do not rotate."""

    def get(self, device):
        found = super().get(device)
        if found is None:
            with torch.inference_mode(False):  # kept and saved for backward: never an inference tensor
                found = self[device] = torch.empty(0, 1, device=device)
        return found


_EMPTY = _EmptyTables()


def _check_cache(kv_cache, slots, cache_scales, qkv, hk, head_dim, leading):
    if not (isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2
            and all(isinstance(t, torch.Tensor) for t in kv_cache)):
        raise RopeError("kv_cache: expected a pair (k_cache, v_cache) of tensors")
    caches = []
    for name, cache in zip(("k_cache", "v_cache"), kv_cache):
        if cache.dim() == 4:  # paged [blocks, block_size, Hk, D]: its flat view
            try:
                cache = cache.view(-1, *cache.shape[2:])
            except RuntimeError:
                raise RopeError(f"kv_cache: {name} [blocks, block_size, Hk, D] must be viewable as "
                                "[blocks * block_size, Hk, D]") from None
        if cache.dim() != 3 or tuple(cache.shape[1:]) != (hk, head_dim):
            raise RopeError(f"kv_cache: {name} must be [num_slots, {hk}, {head_dim}] (or paged "
                            f"[blocks, block_size, {hk}, {head_dim}]), got {list(cache.shape)}")
        if cache.device != qkv.device:
            raise RopeError(f"kv_cache: {name} on {cache.device}, qkv on {qkv.device}")
        if cache.dtype != qkv.dtype and cache.dtype not in _CACHE_FP8:
            raise RopeError(f"kv_cache: {name} must be {qkv.dtype} (qkv's dtype) or float8_e4m3fn, "
                            f"got {cache.dtype}")
        if cache.stride(-1) != 1:
            raise RopeError(f"kv_cache: {name} needs stride 1 along head_dim")
        caches.append(cache)
    k_cache, v_cache = caches
    if k_cache.shape[0] != v_cache.shape[0] or k_cache.dtype != v_cache.dtype:
        raise RopeError("kv_cache: k_cache and v_cache differ in slots or dtype")
    fp8 = k_cache.dtype in _CACHE_FP8
    if cache_scales is None:
        if fp8:
            raise RopeError("cache_scales: a float8 cache needs (k_scale, v_scale)")
        k_scale = v_scale = 1.0
    else:
        if not fp8:
            raise RopeError(f"cache_scales: only for a float8 cache; this cache is {k_cache.dtype}")
        if not (isinstance(cache_scales, (tuple, list)) and len(cache_scales) == 2):
            raise RopeError("cache_scales: expected (k_scale, v_scale)")
        k_scale, v_scale = (_check_scale("cache_scales", scale) for scale in cache_scales)
    if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64):
        raise RopeError("slots: kv_cache needs slots, an int32/int64 tensor of one slot per token")
    if tuple(slots.shape) != leading:
        raise RopeError(f"slots: expected shape {list(leading)} (one slot per token), got {list(slots.shape)}")
    if slots.device != qkv.device:
        raise RopeError(f"slots: on {slots.device}, qkv on {qkv.device}")
    if slots.device.type == "cpu" and slots.numel():
        low, high = int(slots.min()), int(slots.max())
        if low < -1 or high >= k_cache.shape[0]:
            raise RopeError(f"slots: values must be in [-1, {k_cache.shape[0]}) (-1: skip), got "
                            f"[{low}, {high}]")
    from ._memory import may_overlap

    for cache in (k_cache, v_cache):
        if may_overlap(cache, qkv):
            raise RopeError("kv_cache: a cache overlaps qkv")
    if may_overlap(k_cache, v_cache):
        raise RopeError("kv_cache: k_cache and v_cache overlap")
    return k_cache, v_cache, slots, k_scale, v_scale


def _args(spec: _Spec, qkv, q_weight, k_weight, pos, cos, sin, freq_turns) -> PrologueArgs:
    k_cache, v_cache, slots = spec.caches
    return PrologueArgs(qkv, None, None, None, pos, spec.pos_offset, cos, sin, freq_turns,
                        spec.attention_factor, spec.layout, spec.num_q_heads, spec.num_kv_heads,
                        spec.head_dim, spec.rotary_dim, spec.interleaved, spec.rotate, q_weight,
                        k_weight, spec.eps, spec.weight_offset, spec.inplace, k_cache, v_cache, slots,
                        spec.k_scale, spec.v_scale, spec.angles, spec.mrope_section or None,
                        spec.mrope_interleaved, spec.q_scale)


def _forward(spec: _Spec, qkv, q_weight, k_weight, pos, cos, sin, freq_turns):
    if not _is_compiling():
        return run_prologue_backend(spec.backend, _args(spec, qkv, q_weight, k_weight, pos, cos, sin,
                                                        freq_turns), spec.call)
    k_cache, v_cache, slots = spec.caches
    common = (pos, spec.pos_offset, cos, sin, freq_turns, spec.attention_factor, spec.freqs,
              spec.seq_len, spec.angles, list(spec.mrope_section), spec.mrope_interleaved,
              spec.layout, spec.num_q_heads,
              spec.num_kv_heads, spec.head_dim, spec.rotary_dim, spec.interleaved, spec.rotate,
              q_weight, k_weight, spec.eps, spec.weight_offset, k_cache, v_cache, slots,
              spec.k_scale, spec.v_scale, spec.q_scale, spec.call.needs_grad, spec.request)
    if spec.inplace:
        torch.ops.rope_ops.qkv_prologue_(qkv, *common)
        return _inplace_views(qkv, spec)
    return torch.ops.rope_ops.qkv_prologue(qkv, *common)


def _inplace_views(qkv, spec: _Spec):
    hq, hk, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    heads = qkv.unflatten(-1, (hq + 2 * hk, d))
    return heads.narrow(-2, 0, hq), heads.narrow(-2, hq, hk), heads.narrow(-2, hq + hk, hk)


class PrologueFunction(torch.autograd.Function):
    """The prologue under autograd: gradients for qkv and both norm weights."""

    @staticmethod
    def forward(ctx, qkv, q_weight, k_weight, pos, cos, sin, freq_turns, spec):
        q, k, v = _forward(spec, qkv, q_weight, k_weight, pos, cos, sin, freq_turns)
        ctx.save_for_backward(qkv, q_weight, k_weight, pos, cos, sin, freq_turns)
        ctx.spec = spec
        return q, k, v

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_q, grad_k, grad_v):
        qkv, q_weight, k_weight, pos, cos, sin, freq_turns = ctx.saved_tensors
        spec = ctx.spec
        if not _is_compiling():
            args = _args(spec, qkv, q_weight, k_weight, pos, cos, sin, freq_turns)
            grads = run_prologue_backward_backend(spec.backend, args, grad_q, grad_k, grad_v, spec.call)
        else:
            grads = torch.ops.rope_ops.qkv_prologue_backward(
                qkv, grad_q, grad_k, grad_v, pos, spec.pos_offset, cos, sin, freq_turns,
                spec.attention_factor, spec.freqs, spec.seq_len, spec.angles,
                list(spec.mrope_section), spec.mrope_interleaved,
                spec.layout, spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.rotary_dim,
                spec.interleaved, spec.rotate, q_weight, k_weight, spec.eps, spec.weight_offset,
                spec.request)
        grad_qkv, grad_qw, grad_kw = grads
        return (grad_qkv, grad_qw if q_weight is not None else None,
                grad_kw if k_weight is not None else None, None, None, None, None, None)


