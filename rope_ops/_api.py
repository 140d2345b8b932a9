"""The public entry points: apply (RotaryEmbedding) and apply_grad (RotaryEmbeddingGrad).

Every check of SPEC "Bad input" happens here, from metadata only, before any kernel runs; then
the backend is selected (cached per kind of call) and run, through autograd when a gradient is
needed. Repeats of a kind of call take a cached plan (``_plans``).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from . import _plans, _select
from ._errors import RopeError
from ._memory import check_inplace_autograd, check_inplace_memory, check_outputs
from ._mrope import check_section
from ._ops import BoundRopeFunction, Spec, bind, needs_check, rotate, rotate_with_grad
from ._tables import CACHE, freqs_spec
from .backend import LAYOUTS, RopeCall
from .embedding import (RotaryEmbedding, check_base, check_max_position, check_rotary_dim,
                        check_style, default_table_rows, resolve_base, rows_for)
from .frequencies import SEQ_LEN_TYPES, check_seq_len, frequencies, rope_type_of

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_POS_DTYPES = (torch.int32, torch.int64)
_DEFAULT_LAYOUT = {4: "bshd", 3: "thd"}
_RANK = {"bshd": 4, "sbhd": 4, "bhsd": 4, "thd": 3}
# Which dims of q are (batch, seq) -- must match k -- per layout; thd has tokens only.
_LEADING = {"bshd": (0, 1), "sbhd": (1, 0), "bhsd": (0, 2), "thd": (0,)}
_HEADS_DIM = {"bshd": 2, "sbhd": 2, "bhsd": 1, "thd": 1}
_SEQ_DIM = {"bshd": 1, "sbhd": 0, "bhsd": 2, "thd": 0}
_ENV_VAR = _select.ENV_VAR
_request_var = _select._context_request
_is_compiling = torch.compiler.is_compiling


def apply(q: torch.Tensor, k: torch.Tensor | None, pos, *, rotary_dim: int | None = None,
          style: str | None = None, layout: str | None = None, base: float | None = None,
          scaling: dict | None = None, rope: RotaryEmbedding | None = None,
          cos_sin: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None = None,
          angles: torch.Tensor | None = None, inplace: bool = False, backend: str | None = None,
          max_position: int | None = None, seq_len: int | None = None, head_dim: int | None = None,
          mrope_section=None, mrope_interleaved: bool = False, out=None):
    """Rotate q and k by their tokens' positions (RotaryEmbedding). Returns ``(q_out, k_out)``.

    Args:
        q: [B,S,H,D] (bshd, default for 4-D), [S,B,H,D] (sbhd), [B,H,S,D] (bhsd) or [T,H,D]
            (thd, default for 3-D); float32/float16/bfloat16 (float64 on the torch backend);
            any strides (views into a packed QKV tensor are fine, nothing is copied). With
            ``head_dim``, also [T, H*D] (thd with the heads flattened, as vLLM passes them).
        k: like q, same dtype/device/layout/head_dim/leading dims, any head count; or None.
        pos: int tensor (int32/int64) of positions, [B,S], [1,S] or [S] ([T] for thd); or a
            Python int ``o`` meaning ``o + arange(seq_len)``. Any int64 value is valid: positions
            outside the table are computed on the fly. None: ``cos_sin`` holds one row per token.
            With ``mrope_section``: [3, B, S] or [3, S] ([3, T] for thd), the t, h, w positions.
        rotary_dim: leading dims that rotate (even, <= head_dim; default head_dim, or twice the
            width of ``cos_sin`` tables).
        style: "neox" (pairs i, i+r/2; default) or "gptj" (pairs 2i, 2i+1).
        base, scaling, max_position: frequencies (see RotaryEmbedding); their tables are built
            once and cached (bounded in bytes).
        seq_len: the sequence length dynamic NTK / LongRoPE scale for (with ``rope=`` too).
        rope: a RotaryEmbedding to use instead of base/scaling/rotary_dim/style.
        cos_sin: caller-supplied tables of any frequency scheme, float32/float16/bfloat16,
            holding m*cos and m*sin: with positions, (cos, sin) each [P, r/2] (or [P, r] in Hugging
            Face's duplicated form), or one [P, r] cos|sin cache (vLLM/FlashInfer); positions
            outside them give NaN (RopeError where known without a device sync). With pos None,
            per token: [B, S, w], [1, S, w] or [S, w] ([T, w] for thd), w = r/2 or r (Hugging
            Face's cos/sin as its rotary module returns them). Pass rotary_dim for partial rotary
            with duplicated tables (a width w <= head_dim/2 is read as r/2).
        angles: the rotation angles in radians instead of tables (TransformerEngine's ``freqs``):
            the shapes ``cos_sin``'s tables take (per position, or per token with pos None), or
            TransformerEngine's [P, 1, 1, w]; w = r/2, or r with duplicated halves (neox) or
            duplicated neighbours (gptj). cos and sin are computed from them once per call, in
            float64 where the device has it, rounded to float32; then as ``cos_sin``.
        inplace: write into q and k (only the rotary dims are touched) and return them. Works in
            training on views of a tensor that requires grad (packed QKV).
        backend: force a backend (a name or a comma list); overrides ROPE_OPS_BACKEND.
        head_dim: the head size when q and k come as [T, H*D] (2-D); outputs are 2-D too.
        mrope_section: mRoPE (Qwen2-VL, Qwen3-VL): frequencies per position axis (t, h, w),
            summing to r/2; ``mrope_interleaved`` assigns them round-robin (Qwen3-VL) instead of
            in consecutive chunks.
        out: (q_out, k_out) to write into (out of place, no autograd); any strides.
    """
    if angles is not None:
        cos_sin = _tables_of_angles(angles, cos_sin)
    if pos is None and type(cos_sin) is tuple and rope is None and base is None and scaling is None \
            and max_position is None and seq_len is None and inplace is False and head_dim is None \
            and mrope_section is None and out is None and not _is_compiling():
        # Fast path for per-token tables (a patched Hugging Face model's call, once per layer and
        # step): what the full path derives from the tensors' metadata is cached under it.
        done = _token_fast_path(q, k, cos_sin, rotary_dim, style, layout, backend)
        if done is not None:
            return done
    if cos_sin is None and scaling is None and inplace is False and head_dim is None \
            and mrope_section is None and out is None and not _is_compiling():
        # Fast path for repeated calls (decode steps, training steps): everything _apply derives
        # from metadata is cached under the metadata it read (_plans).
        try:
            holder = _plans.FUNCTIONAL if rope is None else rope
            options = (rotary_dim, style, layout, base, max_position, seq_len,
                       backend if backend is not None else (_request_var.get() or os.environ.get(_ENV_VAR)),
                       _plans.generation)
            guards, plans = holder._guards, holder._plans
            guard = guards.get(options)
        except (TypeError, AttributeError):  # unhashable or odd arguments: the full path says what
            guard = plans = None
        if guard is not None:
            out = guard(q, k, pos)  # None when the tensors' metadata differ from the guarded call's
            if out is not None:
                return out
        key = None if plans is None else _plan_key(q, k, pos, options)
        if key is not None:
            entry = plans.get(key)
            if entry is None:
                kwargs = _kwargs(rotary_dim, style, layout, base, None, rope, None, False, backend,
                                 max_position, seq_len, None, None, False, None)
                plan = _apply(q, k, pos, kwargs, mode="plan")
                if plan is None:  # a kind not yet checked on a third-party backend: full path
                    return _apply(q, k, pos, kwargs)
                guarded = getattr(plan, "guarded", None)
                guard = guarded(q, k, pos) if guarded is not None and not key[-1] else None
                entry = (plan, guard)
                _plans.remember_plan(holder, key, entry)
            plan, guard = entry
            if guard is not None:
                _plans.remember_guard(holder, options, guard)
            if key[4] is int:
                return plan(q, k, None, pos)
            return plan(q, k, pos, 0)
    return _apply(q, k, pos, _kwargs(rotary_dim, style, layout, base, scaling, rope, cos_sin,
                                     inplace, backend, max_position, seq_len, head_dim,
                                     mrope_section, mrope_interleaved, out))


class _TokenPlan(NamedTuple):
    """What the full path derived for a per-token call kind from its tensors' metadata: q's
    head_dim and leading (batch, seq) dims, and the call's Spec (layout, style, selected backend)
    and RopeCall."""

    head_dim: int
    leading: tuple
    spec: Spec
    call: RopeCall
    needs_grad: bool


def _meta(t) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def _token_fast_path(q, k, cos_sin, rotary_dim, style, layout, backend):
    """apply's result for a repeat of a per-token call kind, or None (the full path runs, and
    records the kind). Only metadata keys the plan: the tensors are validated by the full path
    the first time their metadata is seen."""
    if len(cos_sin) != 2 or type(q) is not torch.Tensor or (k is not None and type(k) is not torch.Tensor):
        return None
    cos, sin = cos_sin
    if type(cos) is not torch.Tensor or type(sin) is not torch.Tensor:
        return None
    grad_enabled = torch.is_grad_enabled()
    request = backend if backend is not None else (_request_var.get() or os.environ.get(_ENV_VAR))
    try:
        key = (_meta(q), _meta(k), _meta(cos), _meta(sin), rotary_dim, style, layout, request,
               grad_enabled, _plans.generation)
        plan = _plans.TOKEN_PLANS.get(key)
    except TypeError:  # unhashable arguments: the full path says what is wrong
        return None
    if plan is None:
        kwargs = _kwargs(rotary_dim, style, layout, None, None, None, cos_sin, False, backend, None,
                         None, None, None, False, None)
        plan = _apply(q, k, None, kwargs, mode="token_plan")
        if len(_plans.TOKEN_PLANS) >= _plans.MAX_PLANS:
            _plans.TOKEN_PLANS.clear()
        _plans.TOKEN_PLANS[key] = plan
    # the tables of this call, as the full path takes them (resolve_angles)
    style = "gptj" if plan.spec.interleaved else "neox"
    cos_sin, _ = _caller_tables(cos_sin, rotary_dim, plan.head_dim, style, True)
    cos, sin = _token_tables(*_check_tables(cos_sin, q.device), plan.spec.layout, plan.leading)
    if plan.needs_grad:
        return rotate_with_grad(plan.spec, q, k, None, 0, cos, sin, None, 1.0, False, False)
    return rotate(plan.spec, q, k, None, 0, cos, sin, None, 1.0, False, call=plan.call)


def _kwargs(rotary_dim, style, layout, base, scaling, rope, cos_sin, inplace, backend,
            max_position, seq_len, head_dim, mrope_section, mrope_interleaved, out) -> dict:
    return {"rotary_dim": rotary_dim, "style": style, "layout": layout, "base": base,
            "scaling": scaling, "rope": rope, "cos_sin": cos_sin, "inplace": inplace,
            "backend": backend, "max_position": max_position, "seq_len": seq_len,
            "head_dim": head_dim, "mrope_section": mrope_section,
            "mrope_interleaved": mrope_interleaved, "out": out}


_KWARG_NAMES = tuple(_kwargs(*([None] * 15)))
_KWARG_DEFAULTS = {"inplace": False, "mrope_interleaved": False}


def _plan_key(q, k, pos, options):
    """The metadata a call's validation and selection read (whether it needs a gradient last),
    or None (no fast path for it)."""
    if type(q) is not torch.Tensor or (k is not None and type(k) is not torch.Tensor):
        return None
    needs_grad = (q.requires_grad or (k is not None and k.requires_grad)) and torch.is_grad_enabled()
    if type(pos) is int and -(2**62) < pos < 2**62:
        pos_key = int
    elif type(pos) is torch.Tensor:
        pos_key = (pos.shape, pos.stride(), pos.dtype, pos.device)
    else:
        return None
    k_key = None if k is None else (k.shape, k.stride(), k.dtype, k.device)
    return (q.shape, q.stride(), q.dtype, q.device, pos_key, k_key, options, needs_grad)


def full_options(kwargs: dict, what: str) -> dict:
    """apply's keyword arguments as _apply's options (defaults filled in, angles as cos_sin
    tables), for the entry points that take them as **kwargs."""
    unknown = set(kwargs) - set(_KWARG_NAMES) - {"angles"}
    if unknown:
        raise TypeError(f"{what}() got unexpected keyword arguments {sorted(unknown)}")
    options = {name: kwargs.get(name, _KWARG_DEFAULTS.get(name)) for name in _KWARG_NAMES}
    if kwargs.get("angles") is not None:
        options["cos_sin"] = _tables_of_angles(kwargs["angles"], options["cos_sin"])
    return options


def apply_grad(grad_q: torch.Tensor, grad_k: torch.Tensor | None, pos, **kwargs):
    """RotaryEmbeddingGrad: gradients w.r.t. q and k from the gradients of apply's outputs.

    Takes the same keyword arguments as ``apply`` (same frequencies, layout, style) and rotates
    by minus the angle; pass-through dims get the gradient unchanged. For callers that run their
    own backward; ``apply`` already has it wired into autograd. Differentiable itself.
    """
    return _apply(grad_q, grad_k, pos, full_options(kwargs, "apply_grad"), inverse=True)


def which_backend(q, k, pos, **kwargs) -> str:
    """The name of the backend ``apply`` would run for these arguments (nothing is computed)."""
    return _apply(q, k, pos, full_options(kwargs, "which_backend"), mode="select")


# ---------------------------------------------------------------------------------------------
# The full path.


class Angles(NamedTuple):
    """Where a call's angles come from, resolved and validated (the non-tensor parts in
    ``kind``, ``rotary_dim``, ``style``, ``mrope_*``)."""

    kind: str  # "table", "token" or "mrope" (KernelArgs.angles)
    pos: torch.Tensor | None
    pos_offset: int
    cos: torch.Tensor
    sin: torch.Tensor
    freq_turns: torch.Tensor | None
    attention_factor: float
    rotary_dim: int
    style: str
    mrope_section: tuple | None
    mrope_interleaved: bool
    # traced calls whose tables are not at hand (cos, sin, freq_turns None): the frequency
    # parameters as text, turned into tables when the op runs (_tables.tables_from_spec)
    spec: str = ""
    seq_len: int | None = None


def resolve_angles(q, pos, kw: dict, layout: str, head_dim: int, leading: tuple) -> Angles:
    """Validate the frequency and position arguments of a call whose q (in ``layout``) has
    ``head_dim`` and ``leading`` (batch, seq) dims, and find its tables. Metadata only."""
    rope, cos_sin = kw["rope"], kw["cos_sin"]
    style, rotary_dim = kw["style"], kw["rotary_dim"]
    base, scaling = kw["base"], kw["scaling"]
    max_position, seq_len = check_max_position(kw["max_position"]), check_seq_len(kw["seq_len"])
    mrope_section, mrope_interleaved = kw["mrope_section"], kw["mrope_interleaved"]
    if not isinstance(mrope_interleaved, bool):
        raise RopeError(f"mrope_interleaved: expected a bool, got {mrope_interleaved!r}")
    per_token = pos is None
    if per_token and cos_sin is None:
        raise RopeError("pos: None means per-token cos/sin tables, but cos_sin was not given")
    if rope is not None:
        if rotary_dim is not None or base is not None or scaling is not None or cos_sin is not None \
                or max_position is not None:
            raise RopeError("rope: pass either rope= or rotary_dim/base/scaling/max_position/cos_sin, "
                            "not both")
        if not isinstance(rope, RotaryEmbedding):
            raise RopeError(f"rope: expected a rope_ops.RotaryEmbedding, got {type(rope).__name__}")
        if rope.head_dim != head_dim:
            raise RopeError(f"rope: built for head_dim {rope.head_dim}, q has head_dim {head_dim}")
        if style is not None and style != rope.style:
            raise RopeError(f"style: {style!r} differs from rope.style {rope.style!r}")
        rotary_dim, style = rope.rotary_dim, rope.style
    else:
        style = "neox" if style is None else check_style(style)
        if cos_sin is not None:
            if base is not None or scaling is not None or max_position is not None:
                raise RopeError("cos_sin: caller tables replace base/scaling/max_position; pass one or "
                                "the other")
            if seq_len is not None:
                raise RopeError("seq_len: caller tables (cos_sin) already fix the frequencies; "
                                "seq_len has nothing to scale")
            cos_sin, rotary_dim = _caller_tables(cos_sin, rotary_dim, head_dim, style, per_token)
        elif rotary_dim is None:
            rotary_dim = head_dim
        check_rotary_dim(rotary_dim, head_dim)
        check_base(base)
        rope_type_of(scaling)
    device = q.device
    if mrope_section is not None:
        if per_token:
            raise RopeError("mrope_section: mRoPE takes positions [3, ...]; per-token tables (pos "
                            "None) already combine the axes")
        mrope_section = check_section(mrope_section, rotary_dim)
        pos_offset, pos_tensor = 0, _check_mrope_pos(pos, q, layout, leading)
        kind = "mrope"
    elif per_token:
        pos_offset, pos_tensor, kind = 0, None, "token"
    else:
        pos_offset, pos_tensor = _check_pos(pos, q, layout, leading)
        kind = "table"
    compiling = _is_compiling()
    if cos_sin is not None:
        cos, sin = _check_tables(cos_sin, device)
        freq_turns, attention_factor = None, 1.0
        if per_token:
            cos, sin = _token_tables(cos, sin, layout, leading)
        elif pos_tensor is None:
            _check_positions_inside(pos_offset, pos_offset + leading[-1], cos.shape[0])
        elif pos_tensor.device.type == "cpu" and pos_tensor.numel() and not compiling:
            _check_positions_inside(int(pos_tensor.min()), int(pos_tensor.max()) + 1, cos.shape[0])
    elif rope is not None:
        if not compiling:
            cos, sin, freq_turns, attention_factor = rope.tables(device, seq_len)
        elif (seq_len is None or rope.rope_type not in SEQ_LEN_TYPES) and rope.cos_table.device == device:
            cos, sin, freq_turns = rope.cos_table, rope.sin_table, rope.freq_turns
            attention_factor = rope.attention_factor
        else:
            return Angles(kind, pos_tensor, pos_offset, None, None, None, 1.0, rotary_dim, style,
                          mrope_section, mrope_interleaved, rope.freqs_spec, seq_len)
    else:
        base = resolve_base(base, scaling)
        rows = default_table_rows(max_position)
        if compiling:
            return Angles(kind, pos_tensor, pos_offset, None, None, None, 1.0, rotary_dim, style,
                          mrope_section, mrope_interleaved, _traced_spec(base, scaling, max_position, rows),
                          seq_len)
        freqs = frequencies(rotary_dim, base, scaling, max_position, seq_len)
        cos, sin, freq_turns, attention_factor = CACHE.get(freqs, rows_for(freqs, rows), device)
    return Angles(kind, pos_tensor, pos_offset, cos, sin, freq_turns, attention_factor, rotary_dim,
                  style, mrope_section, mrope_interleaved)


def _apply(q, k, pos, kw: dict, inverse: bool = False, mode: str = "run"):
    """Validate, resolve the tables, select, and run (mode "run"), or return the backend's name
    ("select") or a plan for repeats of this call kind ("plan")."""
    if type(q) is not torch.Tensor or (k is not None and type(k) is not torch.Tensor):
        from . import distributed

        if distributed.is_dtensor(q) or distributed.is_dtensor(k):  # each rank rotates its shard
            return distributed.apply_dtensor(q, k, pos, kw, inverse, mode)
    out = kw["out"]
    flat = kw["head_dim"] is not None
    if flat:
        q, k, layout_arg = _unflatten_heads(q, k, kw["head_dim"], kw["layout"])
        if out is not None:
            out = _unflatten_heads(*_out_pair(out), kw["head_dim"], None)[:2]
    else:
        layout_arg = kw["layout"]
    layout, head_dim, leading = _check_tensors(q, k, layout_arg)
    if not isinstance(inplace := kw["inplace"], bool):
        raise RopeError(f"inplace: expected a bool, got {inplace!r}")
    a = resolve_angles(q, pos, kw, layout, head_dim, leading)
    angles, pos_tensor, pos_offset = a.kind, a.pos, a.pos_offset
    cos, sin, freq_turns, attention_factor = a.cos, a.sin, a.freq_turns, a.attention_factor
    rotary_dim, style = a.rotary_dim, a.style
    mrope_section, mrope_interleaved = a.mrope_section, a.mrope_interleaved
    request = _select.current_request(kw["backend"])
    compiling = _is_compiling()
    device = q.device

    grad_enabled = torch.is_grad_enabled()
    needs_grad = grad_enabled and (q.requires_grad or (k is not None and k.requires_grad))
    q_out = k_out = None
    if out is not None:
        if inplace:
            raise RopeError("out: in place writes into q and k; out= is for out of place")
        if needs_grad:
            raise RopeError("out: out= does not record a backward; q or k requires grad "
                            "(call without out= to get gradients)")
        q_out, k_out = _out_pair(out)
        if not compiling:
            check_outputs(q, k, q_out, k_out)
    split = False
    if inplace:
        if not compiling:  # traced: the in-place op checks memory when it runs
            check_inplace_autograd("q", q, needs_grad)
            if k is not None:
                check_inplace_autograd("k", k, needs_grad)
            check_inplace_memory(q, k)
        # autograd lets a Function that writes a view in place return that one tensor only
        split = needs_grad and k is not None and (q._is_view() or k._is_view())
    interleaved = style == "gptj"
    call = RopeCall(device.type, q.dtype, layout, style, head_dim, rotary_dim,
                    q.shape[_HEADS_DIM[layout]], 0 if k is None else k.shape[_HEADS_DIM[layout]],
                    inplace, None if pos_tensor is None else pos_tensor.dtype,
                    freq_turns is None and not a.spec, needs_grad,
                    q.stride(-1) == 1 and (k is None or k.stride(-1) == 1), angles,
                    torch.float32 if cos is None else cos.dtype,
                    mrope_interleaved=angles == "mrope" and mrope_interleaved)
    selected = None if compiling else _select.select(call, request)
    if mode == "select":
        return selected.name if selected is not None else request
    if mode == "plan":
        if needs_check(selected, call):
            return None
        plan = _make_plan(selected, call, cos, sin, freq_turns, attention_factor, layout,
                          rotary_dim, interleaved, needs_grad)
        if pos_tensor is not None and pos_tensor.shape != pos.shape:
            return _broadcasting(plan, tuple(pos_tensor.shape))
        return plan
    spec = Spec(layout, rotary_dim, interleaved, inplace, request, selected, angles,
                mrope_section, mrope_interleaved, a.spec, -1 if a.seq_len is None else a.seq_len)
    if mode == "token_plan":  # _token_fast_path's record of this call kind (then it runs it)
        return _TokenPlan(head_dim, leading, spec, call, needs_grad)
    if needs_grad:
        q_out, k_out = rotate_with_grad(spec, q, k, pos_tensor, pos_offset, cos, sin, freq_turns,
                                        attention_factor, inverse, split)
    else:
        q_out, k_out = rotate(spec, q, k, pos_tensor, pos_offset, cos, sin, freq_turns,
                              attention_factor, inverse, call=call, q_out=q_out, k_out=k_out)
    if flat:
        q_out = q_out.flatten(-2)
        k_out = None if k_out is None else k_out.flatten(-2)
    return q_out, k_out


def _broadcasting(plan, shape):
    """A plan whose positions arrive as [1, S] for a batch of B: it expands them, as the full
    path does (no guard: guards hand positions over as they come)."""
    def expand_positions(q, k, pos_tensor, pos_offset):
        return plan(q, k, pos_tensor.expand(shape), pos_offset)

    return expand_positions


def _make_plan(backend, call, cos, sin, freq_turns, attention_factor, layout, rotary_dim,
               interleaved, needs_grad):
    """What a repeat of this call kind needs: the backend's forward bound to the call's tables
    and constants, through autograd when a gradient is needed."""
    forward = bind(backend, cos, sin, freq_turns, attention_factor, layout, rotary_dim,
                   interleaved, False, call)
    if not needs_grad:
        return forward
    with_grad = getattr(forward, "with_grad", None)
    if with_grad is not None:  # the backend records autograd itself (the CUDA backend: in C++)
        return with_grad
    bound = (forward, bind(backend, cos, sin, freq_turns, attention_factor, layout, rotary_dim,
                           interleaved, True, call))

    def autograd_plan(q, k, pos_tensor, pos_offset):
        return BoundRopeFunction.apply(q, k, pos_tensor, pos_offset, bound)

    return autograd_plan


# ---------------------------------------------------------------------------------------------
# Tables.


@torch._dynamo.assume_constant_result
def _traced_spec(base: float, scaling, max_position, rows: int) -> str:
    """freqs_spec of call arguments, evaluated at trace time (they are Python constants)."""
    return freqs_spec(base, scaling, max_position, rows)


# ---------------------------------------------------------------------------------------------
# Validation (metadata only).


def _unflatten_heads(q, k, head_dim, layout):
    if layout not in (None, "thd"):
        raise RopeError(f"head_dim: 2-D q and k ([T, H*head_dim]) are thd; got layout {layout!r}")
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        raise RopeError(f"head_dim: expected an int > 0, got {head_dim!r}")
    out = []
    for name, t in (("q", q), ("k", k)):
        if t is None and name == "k":
            out.append(None)
            continue
        if not isinstance(t, torch.Tensor):
            raise RopeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise RopeError(f"{name}: with head_dim, expected a 2-D [T, H*head_dim] tensor, got "
                            f"{t.dim()}-D shape {tuple(t.shape)}")
        if t.shape[1] % head_dim:
            raise RopeError(f"{name}: last dim {t.shape[1]} is not a multiple of head_dim {head_dim}")
        out.append(t.unflatten(-1, (t.shape[1] // head_dim, head_dim)))
    return out[0], out[1], "thd"


def layout_of(shape, layout) -> str:
    """The layout of q (of ``shape``): the one given, checked against q's rank, or the default
    for its rank."""
    rank = len(shape)
    if layout is None:
        layout = _DEFAULT_LAYOUT.get(rank)
        if layout is None:
            raise RopeError(f"q: expected a 4-D [B,S,H,D] or 3-D [T,H,D] tensor (or 2-D [T, H*D] "
                            f"with head_dim=), got {rank}-D shape {tuple(shape)}")
    elif not isinstance(layout, str) or layout not in _RANK:
        raise RopeError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    elif rank != _RANK[layout]:
        raise RopeError(f"q: layout {layout!r} needs a {_RANK[layout]}-D tensor, got {rank}-D "
                        f"shape {tuple(shape)}")
    return layout


def _check_tensors(q, k, layout):
    if not isinstance(q, torch.Tensor):
        raise RopeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in _DTYPES:
        raise RopeError(f"q: expected dtype float32, float16, bfloat16 or float64, got {q.dtype}")
    shape = q.shape
    layout = layout_of(shape, layout)
    rank = len(shape)
    head_dim = shape[-1]
    dims = _LEADING[layout]
    leading = (shape[dims[0]],) if rank == 3 else (shape[dims[0]], shape[dims[1]])
    if k is not None:
        if not isinstance(k, torch.Tensor):
            raise RopeError(f"k: expected a torch.Tensor or None, got {type(k).__name__}")
        if k.dtype != q.dtype:
            raise RopeError(f"k: dtype {k.dtype} differs from q's {q.dtype}")
        if k.device != q.device:
            raise RopeError(f"k: device {k.device} differs from q's {q.device}")
        k_shape = k.shape
        if len(k_shape) != rank:
            raise RopeError(f"k: expected {rank}-D like q (layout {layout!r}), got {len(k_shape)}-D")
        if k_shape[-1] != head_dim:
            raise RopeError(f"k: head_dim {k_shape[-1]} differs from q's {head_dim}")
        k_leading = (k_shape[dims[0]],) if rank == 3 else (k_shape[dims[0]], k_shape[dims[1]])
        if k_leading != leading:
            raise RopeError(f"k: leading dims {k_leading} differ from q's {leading} (layout {layout!r})")
    return layout, head_dim, leading


def _check_pos(pos, q, layout, leading):
    """(offset, tensor-or-None); a [1, S] tensor for a batch of B is broadcast (a view)."""
    if isinstance(pos, bool) or not isinstance(pos, (int, torch.Tensor)):
        raise RopeError(f"pos: expected an int tensor or a Python int, got {type(pos).__name__}")
    if isinstance(pos, int):
        if abs(pos) >= 2**62:
            raise RopeError(f"pos: offset {pos} out of range (|offset| < 2**62)")
        return pos, None
    if pos.dtype not in _POS_DTYPES:
        raise RopeError(f"pos: expected dtype int32 or int64, got {pos.dtype}")
    if pos.device != q.device:
        raise RopeError(f"pos: device {pos.device} differs from q's {q.device}")
    shape = tuple(pos.shape)
    if layout == "thd":
        if shape != leading:
            raise RopeError(f"pos: layout 'thd' needs shape [T] = {list(leading)}, got {list(shape)}")
    elif shape == (1, leading[1]) and leading[0] != 1:
        pos = pos.expand(leading[0], leading[1])
    elif shape not in (leading, leading[1:]):
        raise RopeError(f"pos: layout {layout!r} needs shape [B,S] = {list(leading)}, [1,S] or [S] = "
                        f"{list(leading[1:])}, got {list(shape)}")
    return 0, pos


_TABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _caller_tables(cos_sin, rotary_dim, head_dim, style, per_token):
    """(cos, sin) views of width rotary_dim/2 from the forms callers bring, and rotary_dim.

    A pair (cos, sin) in the half form (width r/2: one value per frequency) or in Hugging Face's
    duplicated form (width r: cat(c, c) for neox, each value twice for gptj); or, indexed by
    position only, one [P, r] cos|sin cache (vLLM, FlashInfer). The width says r: with
    rotary_dim given it must be r/2 or r; without, a width w is the half form when 2w <= head_dim
    (a narrower table than the head: partial rotary) and the duplicated form otherwise.
    """
    if isinstance(cos_sin, torch.Tensor):
        if per_token:
            raise RopeError("cos_sin: one [P, r] cos|sin cache is indexed by position; give pos")
        if cos_sin.dim() != 2 or cos_sin.shape[-1] % 2:
            raise RopeError(f"cos_sin: a single table must be a [P, rotary_dim] cos|sin cache, got "
                            f"shape {list(cos_sin.shape)}")
        width = cos_sin.shape[-1]
        if rotary_dim is not None and rotary_dim != width:
            raise RopeError(f"cos_sin: a cos|sin cache of width {width} rotates {width} dims, but "
                            f"rotary_dim is {rotary_dim}")
        return (cos_sin[:, : width // 2], cos_sin[:, width // 2:]), width
    if not (isinstance(cos_sin, (tuple, list)) and len(cos_sin) == 2
            and all(isinstance(t, torch.Tensor) for t in cos_sin)):
        raise RopeError("cos_sin: expected a pair (cos, sin) of tensors (or one [P, r] cos|sin cache)")
    cos, sin = cos_sin
    if cos.shape != sin.shape:
        raise RopeError(f"cos_sin: cos {list(cos.shape)} and sin {list(sin.shape)} differ")
    if cos.dim() == 0:
        raise RopeError("cos_sin: tables must have a frequency axis")
    width = cos.shape[-1]
    if rotary_dim is None:
        if 2 * width <= head_dim:
            return (cos, sin), 2 * width
        rotary_dim = width
    if rotary_dim == 2 * width:
        return (cos, sin), rotary_dim
    if rotary_dim == width and width % 2 == 0:
        half = width // 2
        if style == "gptj":  # (c0, c0, c1, c1, ...): every other value
            return (cos[..., ::2], sin[..., ::2]), rotary_dim
        return (cos[..., :half], sin[..., :half]), rotary_dim
    raise RopeError(f"cos_sin: tables of width {width} fit rotary_dim {2 * width} (one value per "
                    f"frequency) or {width} (duplicated halves), but rotary_dim is {rotary_dim}")


def _tables_of_angles(angles, cos_sin):
    """(cos, sin) float32 tables of the same shape as angles (TransformerEngine's [P, 1, 1, w]
    as [P, w]), for the cos_sin path."""
    if cos_sin is not None:
        raise RopeError("angles: give either angles or cos_sin, not both")
    if not isinstance(angles, torch.Tensor):
        raise RopeError(f"angles: expected a tensor of angles in radians, got {type(angles).__name__}")
    if not angles.dtype.is_floating_point or angles.dtype.itemsize < 2 or angles.is_complex():
        raise RopeError(f"angles: expected a floating-point tensor, got {angles.dtype}")
    if angles.requires_grad and torch.is_grad_enabled():
        raise RopeError("angles: requires grad; gradients w.r.t. the angles are not supported")
    if angles.dim() == 4:
        if angles.shape[1] != 1 or angles.shape[2] != 1:
            raise RopeError(f"angles: a 4-D tensor must be TransformerEngine's [P, 1, 1, w], got shape "
                            f"{list(angles.shape)}")
        angles = angles[:, 0, 0]
    if angles.dim() == 0:
        raise RopeError("angles: must have a frequency axis")
    # float64 where the device has it: the tables are then cos/sin of the given angles rounded
    # once to float32, as rope_ops' own tables are
    wide = torch.float64 if angles.device.type in ("cpu", "cuda") else torch.float32
    wide_angles = angles.detach().to(wide)
    return torch.cos(wide_angles).to(torch.float32), torch.sin(wide_angles).to(torch.float32)


def _check_tables(cos_sin, device):
    cos, sin = cos_sin
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype not in _TABLE_DTYPES:
            raise RopeError(f"cos_sin: {name} must be float32, float16, bfloat16 or float64, got {t.dtype}")
        if t.device != device:
            raise RopeError(f"cos_sin: {name} on {t.device}, q on {device}")
        if t.requires_grad and torch.is_grad_enabled():
            raise RopeError(f"cos_sin: {name} requires grad; gradients w.r.t. tables are not supported")
    if cos.dtype != sin.dtype:
        raise RopeError(f"cos_sin: cos is {cos.dtype}, sin is {sin.dtype}; give one dtype")
    if cos.stride(-1) != 1:  # kernels read frequencies contiguously: a small copy
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    return cos.detach(), sin.detach()


def _token_tables(cos, sin, layout, leading):
    """Per-token tables as [B, S, r/2] views in (batch, token) order ([1, T, r/2] for thd):
    from [B, S, w], [1, S, w] or [S, w] ([T, w] for thd)."""
    batch, seq = (1, leading[0]) if layout == "thd" else leading
    shape = tuple(cos.shape[:-1])
    if layout == "thd":
        ok = shape in ((seq,), (1, seq))
    else:
        ok = shape in ((batch, seq), (1, seq), (seq,))
    if not ok:
        want = "[T, w]" if layout == "thd" else "[B, S, w], [1, S, w] or [S, w]"
        raise RopeError(f"cos_sin: per-token tables (pos None) must be {want} with (B, S) = "
                        f"{(batch, seq)}, got {list(cos.shape)}")
    half = cos.shape[-1]
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    return cos.expand(batch, seq, half), sin.expand(batch, seq, half)


def _out_pair(out):
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise RopeError("out: expected a pair (q_out, k_out) (k_out None when k is None)")
    return out[0], out[1]


def _check_mrope_pos(pos, q, layout, leading):
    """mRoPE positions as an int tensor [3, B, S] / [3, S] ([3, T] for thd)."""
    if not isinstance(pos, torch.Tensor) or pos.dtype not in _POS_DTYPES:
        raise RopeError(f"pos: mRoPE needs an int32/int64 tensor of positions [3, ...], got "
                        f"{type(pos).__name__ if not isinstance(pos, torch.Tensor) else pos.dtype}")
    if pos.device != q.device:
        raise RopeError(f"pos: device {pos.device} differs from q's {q.device}")
    shape = tuple(pos.shape)
    if layout == "thd":
        ok = shape == (3, leading[0])
    else:
        ok = shape in ((3,) + leading, (3, leading[1]), (3, 1, leading[1]))
        if shape == (3, 1, leading[1]) and leading[0] != 1:
            pos = pos.expand(3, *leading)
    if not ok:
        want = "[3, T]" if layout == "thd" else f"[3, B, S] = {[3, *leading]} or [3, S]"
        raise RopeError(f"pos: mRoPE positions must be {want} (one row per axis t, h, w), got {list(shape)}")
    return pos


def _check_positions_inside(low: int, high: int, n_rows: int) -> None:
    if low < 0 or high > n_rows:
        raise RopeError(f"pos: positions [{low}, {high}) fall outside the caller's cos/sin table "
                        f"of {n_rows} rows")


# ---------------------------------------------------------------------------------------------
# Positions helpers.


def positions_from_seqlens(seqlens=None, *, cu_seqlens=None, start=None, device=None,
                           dtype=torch.int64) -> torch.Tensor:
    """Per-token positions [T] for a packed (thd) batch.

    Give per-sequence lengths ``seqlens`` [N] or cumulative ``cu_seqlens`` [N+1] (FlashAttention
    style), and optionally per-sequence start offsets ``start`` [N] (e.g. tokens already in the KV
    cache). Token j of sequence n gets position ``start[n] + j``. Lengths are checked (>= 0,
    cu_seqlens starting at 0 and non-decreasing), which reads them: a host sync when they are on
    a device (computing [T] from them needs its size anyway).
    """
    if (seqlens is None) == (cu_seqlens is None):
        raise RopeError("positions_from_seqlens: give exactly one of seqlens and cu_seqlens")
    if dtype not in _POS_DTYPES:
        raise RopeError(f"dtype: expected torch.int32 or torch.int64, got {dtype}")
    name = "seqlens" if seqlens is not None else "cu_seqlens"
    try:
        given = torch.as_tensor(seqlens if seqlens is not None else cu_seqlens, device=device)
    except (TypeError, ValueError, RuntimeError) as error:
        raise RopeError(f"{name}: expected a 1-D sequence of ints: {error}") from None
    if given.dtype.is_floating_point or given.dtype.is_complex or given.dtype == torch.bool:
        raise RopeError(f"{name}: expected integers, got dtype {given.dtype}")
    given = given.to(torch.int64)
    if given.dim() != 1:
        raise RopeError(f"{name}: expected a 1-D sequence, got shape {list(given.shape)}")
    if seqlens is not None:
        lengths = given
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    else:
        if given.numel() < 1:
            raise RopeError("cu_seqlens: expected [N+1] cumulative lengths starting at 0, got an empty one")
        cu = given
        lengths = cu[1:] - cu[:-1]
        if int(cu[0]) != 0:
            raise RopeError(f"cu_seqlens: must start at 0, starts at {int(cu[0])}")
    if lengths.numel() and bool((lengths < 0).any()):
        raise RopeError(f"{name}: lengths must be >= 0 ({'non-decreasing' if cu_seqlens is not None else 'no negative'}"
                        f" values), got {given.tolist() if given.numel() <= 16 else 'a negative one'}")
    device = cu.device
    n_tokens = int(cu[-1])
    seq_of_token = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths,
                                           output_size=n_tokens)
    token = torch.arange(n_tokens, device=device)
    positions = token - cu[:-1][seq_of_token]
    if start is not None:
        start = torch.as_tensor(start, device=device)
        if start.dtype.is_floating_point or start.dtype == torch.bool:
            raise RopeError(f"start: expected integers, got dtype {start.dtype}")
        if start.shape != lengths.shape:
            raise RopeError(f"start: expected one offset per sequence {list(lengths.shape)}, got "
                            f"{list(start.shape)}")
        positions = positions + start.to(torch.int64)[seq_of_token]
    return positions.to(dtype)


def seq_len_of(pos) -> int:
    """max(pos) + 1 as a Python int: the sequence length for dynamic NTK / LongRoPE.

    This is a host sync when pos is on a device; rope_ops never does it on its own.
    """
    if isinstance(pos, int):
        raise RopeError("seq_len_of: an int offset has no length; pass the positions tensor")
    if not isinstance(pos, torch.Tensor) or pos.dtype not in _POS_DTYPES:
        raise RopeError(f"pos: expected an int32/int64 tensor, got {pos!r:.60}")
    if pos.numel() == 0:
        raise RopeError("pos: no positions, no length")
    return int(pos.max()) + 1
