"""The public entry points: apply (RotaryEmbedding) and apply_grad (RotaryEmbeddingGrad).

Every check of SPEC "Bad input" happens here, from metadata only, before any kernel runs; then
the backend is selected (cached per kind of call) and run, through autograd when a gradient is
needed.
"""

from __future__ import annotations

import torch

from . import _select
from ._errors import RopeError
from ._memory import check_inplace_memory
from ._ops import BoundRopeFunction, RopeFunction, bind, rope_call, run_backend
from .backend import LAYOUTS
from .embedding import RotaryEmbedding, cached_rope, cached_rope_key, check_rotary_dim

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_POS_DTYPES = (torch.int32, torch.int64)
_DEFAULT_LAYOUT = {4: "bshd", 3: "thd"}
_RANK = {"bshd": 4, "sbhd": 4, "bhsd": 4, "thd": 3}
# Which dims of q are (batch, seq) -- must match k -- per layout; thd has tokens only.
_LEADING = {"bshd": (0, 1), "sbhd": (1, 0), "bhsd": (0, 2), "thd": (0,)}
_HEADS_DIM = {"bshd": 2, "sbhd": 2, "bhsd": 1, "thd": 1}


def apply(q: torch.Tensor, k: torch.Tensor | None, pos, *, rotary_dim: int | None = None,
          style: str | None = None, layout: str | None = None, base: float | None = None,
          scaling: dict | None = None, rope: RotaryEmbedding | None = None,
          cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None, inplace: bool = False,
          backend: str | None = None, max_position: int | None = None, seq_len: int | None = None):
    """Rotate q and k by their tokens' positions (RotaryEmbedding). Returns ``(q_out, k_out)``.

    Args:
        q: [B,S,H,D] (bshd, default for 4-D), [S,B,H,D] (sbhd), [B,H,S,D] (bhsd) or [T,H,D]
            (thd, default for 3-D); float32/float16/bfloat16 (float64 on the torch backend);
            any strides (views into a packed QKV tensor are fine, nothing is copied).
        k: like q, same dtype/device/layout/head_dim/leading dims, any head count; or None.
        pos: int tensor (int32/int64) of positions, [B,S] or [S] ([T] for thd); or a Python int
            ``o`` meaning ``o + arange(seq_len)``.
        rotary_dim: leading dims that rotate (even, <= head_dim; default head_dim).
        style: "neox" (pairs i, i+r/2; default) or "gptj" (pairs 2i, 2i+1).
        base, scaling, max_position, seq_len: frequencies (see RotaryEmbedding); the
            RotaryEmbedding for them is built once and cached.
        rope: a RotaryEmbedding to use instead of base/scaling/rotary_dim/style.
        cos_sin: caller-supplied float32 tables (cos, sin), each [max_pos, r/2], holding m*cos and
            m*sin of any frequency scheme; positions outside them give NaN (RopeError where known
            without a device sync).
        inplace: write into q and k (only the rotary dims are touched) and return them.
        backend: force a backend (a name or a comma list); overrides ROPE_OPS_BACKEND.
    """
    if cos_sin is None and scaling is None and not inplace and not torch.compiler.is_compiling():
        # Fast path for repeated calls (decode steps, training steps): everything _apply derives
        # from metadata is cached under the metadata it read; a plan is the backend's launcher
        # bound to this call kind's constants (through autograd when a gradient is needed).
        options = (rotary_dim, style, layout, base, rope, max_position, seq_len,
                   _select.current_request(backend))
        try:
            guard = _select.guards.get(options)
        except TypeError:  # an unhashable argument: the full path will say what is wrong
            guard = None
        if guard is not None:
            # A repeat of the last call kind with these options: the backend's guard checks the
            # tensors' metadata itself (cheaper than building and hashing the key) and returns
            # None on a change.
            out = guard(q, k, pos)
            if out is not None:
                return out
        key = _plan_key(q, k, pos, options)
        try:
            entry = None if key is None else _select.plans.get(key)
        except TypeError:  # an unhashable argument: the full path will say what is wrong
            key = entry = None
        if key is not None:
            if entry is None:
                plan = _plan(q, k, pos, rotary_dim, style, layout, base, rope, backend, max_position, seq_len)
                if plan is not None:
                    guarded = getattr(plan, "guarded", None)
                    guard = guarded(q, k, pos) if guarded is not None and not key[-1] else None
                    entry = (plan, guard)
                    _select.remember_plan(key, entry)
            if entry is not None:
                plan, guard = entry
                if guard is not None:
                    _select.remember_guard(options, guard)
                if key[4] is int:  # the backend's forward, bound to this call kind's constants
                    return plan(q, k, None, pos)
                return plan(q, k, pos, 0)
    return _apply(q, k, pos, rotary_dim, style, layout, base, scaling, rope, cos_sin, inplace,
                  backend, max_position, seq_len, inverse=False)


def _plan_key(q, k, pos, options):
    """The metadata a call's validation and selection read (whether it needs a gradient
    included, last), or None (no fast path). ``options``: apply's keyword arguments that matter
    and the backend request."""
    if type(q) is not torch.Tensor or (k is not None and type(k) is not torch.Tensor):
        return None
    needs_grad = (q.requires_grad or (k is not None and k.requires_grad)) and torch.is_grad_enabled()
    rope = options[4]
    if rope is not None and type(rope) is not RotaryEmbedding:
        return None
    if type(pos) is int and -(2**62) < pos < 2**62:
        pos_key = int
    elif type(pos) is torch.Tensor:
        pos_key = (pos.shape, pos.dtype, pos.device)
    else:
        return None
    k_key = None if k is None else (k.shape, k.stride(), k.dtype, k.device)
    return (q.shape, q.stride(), q.dtype, q.device, pos_key, k_key, options, needs_grad)


def _plan(q, k, pos, rotary_dim, style, layout, base, rope, backend, max_position, seq_len):
    """Validate and select once, the full way; return what a repeat of this call needs."""
    return _apply(q, k, pos, rotary_dim, style, layout, base, None, rope, None, False, backend,
                  max_position, seq_len, inverse=False, select_only="plan")


def apply_grad(grad_q: torch.Tensor, grad_k: torch.Tensor | None, pos, **kwargs):
    """RotaryEmbeddingGrad: gradients w.r.t. q and k from the gradients of apply's outputs.

    Takes the same keyword arguments as ``apply`` (same frequencies, layout, style) and rotates
    by minus the angle; pass-through dims get the gradient unchanged. For callers that run their
    own backward; ``apply`` already has it wired into autograd.
    """
    names = ("rotary_dim", "style", "layout", "base", "scaling", "rope", "cos_sin", "inplace",
             "backend", "max_position", "seq_len")
    unknown = set(kwargs) - set(names)
    if unknown:
        raise TypeError(f"apply_grad() got unexpected keyword arguments {sorted(unknown)}")
    values = [kwargs.get(n, False if n == "inplace" else None) for n in names]
    return _apply(grad_q, grad_k, pos, *values, inverse=True)


def which_backend(q, k, pos, *, rotary_dim=None, style=None, layout=None, base=None, scaling=None,
                  rope=None, cos_sin=None, inplace=False, backend=None, max_position=None, seq_len=None):
    """The name of the backend ``apply`` would run for these arguments (nothing is computed)."""
    return _apply(q, k, pos, rotary_dim, style, layout, base, scaling, rope, cos_sin, inplace,
                  backend, max_position, seq_len, inverse=False, select_only=True)


def _apply(q, k, pos, rotary_dim, style, layout, base, scaling, rope, cos_sin, inplace, backend,
           max_position, seq_len, inverse, select_only=False):
    layout, head_dim, leading = _check_tensors(q, k, layout)
    if rope is not None:
        if rotary_dim is not None or base is not None or scaling is not None or cos_sin is not None:
            raise RopeError("rope: pass either rope= or rotary_dim/base/scaling/cos_sin, not both")
        if not isinstance(rope, RotaryEmbedding):
            raise RopeError(f"rope: expected a rope_ops.RotaryEmbedding, got {type(rope).__name__}")
        if rope.head_dim != head_dim:
            raise RopeError(f"rope: built for head_dim {rope.head_dim}, q has head_dim {head_dim}")
        if style is not None and style != rope.style:
            raise RopeError(f"style: {style!r} differs from rope.style {rope.style!r}")
        rotary_dim, style = rope.rotary_dim, rope.style
    else:
        style = "neox" if style is None else style
        if style not in ("neox", "gptj"):
            raise RopeError(f"style: expected 'neox' or 'gptj', got {style!r}")
        if rotary_dim is None:
            rotary_dim = head_dim if cos_sin is None or not _is_pair(cos_sin) else _table_rotary_dim(cos_sin)
        check_rotary_dim(rotary_dim, head_dim)
    if not isinstance(inplace, bool):
        raise RopeError(f"inplace: expected a bool, got {inplace!r}")
    device = q.device
    pos_offset, pos_tensor = _check_pos(pos, q, layout, leading)

    compiling = torch.compiler.is_compiling()
    if cos_sin is not None:
        if base is not None or scaling is not None:
            raise RopeError("cos_sin: caller tables replace base/scaling; pass one or the other")
        cos, sin = _check_tables(cos_sin, rotary_dim, device)
        freq_turns, attention_factor, rope_key = None, 1.0, ""
        if pos_tensor is None:
            _check_positions_inside(pos_offset, pos_offset + _n_tokens(q, layout), cos.shape[0])
        elif pos_tensor.device.type == "cpu" and pos_tensor.numel() and not compiling:
            _check_positions_inside(int(pos_tensor.min()), int(pos_tensor.max()) + 1, cos.shape[0])
    elif compiling:
        # Traced: refer to the frequencies by key; the op fetches the tables when it runs.
        if rope is None:
            rope_key = cached_rope_key(head_dim, rotary_dim, base, scaling, max_position, style, seq_len)
        else:
            rope_key = rope.key
        cos = sin = freq_turns = None
        attention_factor = 1.0
    else:
        if rope is None:
            rope = cached_rope(head_dim, rotary_dim, base, scaling, max_position, style, seq_len)
        cos, sin, freq_turns = rope.tables(device)
        attention_factor, rope_key = rope.attention_factor, rope.key

    grad_enabled = torch.is_grad_enabled()
    if inplace:
        for name, t in (("q", q), ("k", k)):
            if t is not None and t.requires_grad and t.is_leaf and grad_enabled:
                raise RopeError(f"{name}: in-place on a leaf tensor that requires grad")
        if not compiling:  # traced: the in-place op checks memory when it runs
            check_inplace_memory(q, k)
    needs_grad = grad_enabled and (q.requires_grad or (k is not None and k.requires_grad))
    k_heads = 0 if k is None else k.shape[_HEADS_DIM[layout]]
    call = (device.type, q.dtype, layout, style, head_dim, rotary_dim,
            q.shape[_HEADS_DIM[layout]], k_heads, inplace,
            None if pos_tensor is None else pos_tensor.dtype, freq_turns is None, needs_grad,
            q.stride(-1) == 1 and (k is None or k.stride(-1) == 1))
    interleaved = style == "gptj"
    if compiling:
        chosen = _select.select_name_constant(call, backend)
    else:
        selected = _select.select(call, backend)
        chosen = selected.name
        if select_only == "plan":
            forward = bind(selected, cos, sin, freq_turns, attention_factor, layout, rotary_dim,
                           interleaved, False)
            if not needs_grad:
                return forward
            bound = (forward, bind(selected, cos, sin, freq_turns, attention_factor, layout,
                                   rotary_dim, interleaved, True))

            def autograd_plan(q, k, pos_tensor, pos_offset):
                return BoundRopeFunction.apply(q, k, pos_tensor, pos_offset, bound)

            return autograd_plan
        if select_only:
            return chosen
        if not needs_grad or inverse:  # the hot inference path: straight to the backend
            return run_backend(selected, q, k, pos_tensor, pos_offset, cos, sin, freq_turns,
                               attention_factor, layout, rotary_dim, interleaved, inverse, inplace)
    if needs_grad and not inverse:
        return RopeFunction.apply(q, k, pos_tensor, pos_offset, cos, sin, freq_turns, attention_factor,
                                  rope_key, layout, rotary_dim, interleaved, inplace, chosen)
    return rope_call(chosen, q, k, pos_tensor, pos_offset, cos, sin, freq_turns, attention_factor,
                     rope_key, layout, rotary_dim, interleaved, inverse, inplace)


def _check_tensors(q, k, layout):
    if not isinstance(q, torch.Tensor):
        raise RopeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in _DTYPES:
        raise RopeError(f"q: expected dtype float32, float16, bfloat16 or float64, got {q.dtype}")
    shape = q.shape
    rank = len(shape)
    if layout is None:
        layout = _DEFAULT_LAYOUT.get(rank)
        if layout is None:
            raise RopeError(f"q: expected a 4-D [B,S,H,D] or 3-D [T,H,D] tensor, got {rank}-D "
                            f"shape {tuple(shape)}")
    elif layout not in _RANK:
        raise RopeError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    elif rank != _RANK[layout]:
        raise RopeError(f"q: layout {layout!r} needs a {_RANK[layout]}-D tensor, got {rank}-D "
                        f"shape {tuple(shape)}")
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
    """(offset, tensor-or-None)."""
    if isinstance(pos, bool) or not isinstance(pos, (int, torch.Tensor)):
        raise RopeError(f"pos: expected an int tensor or a Python int, got {type(pos).__name__}")
    if isinstance(pos, int):
        if abs(pos) >= 2**62:
            raise RopeError(f"pos: offset {pos} out of range")
        return pos, None
    if pos.dtype not in _POS_DTYPES:
        raise RopeError(f"pos: expected dtype int32 or int64, got {pos.dtype}")
    if pos.device != q.device:
        raise RopeError(f"pos: device {pos.device} differs from q's {q.device}")
    if layout == "thd":
        if tuple(pos.shape) != leading:
            raise RopeError(f"pos: layout 'thd' needs shape [T] = {list(leading)}, got {list(pos.shape)}")
    elif tuple(pos.shape) not in (leading, leading[1:]):
        raise RopeError(f"pos: layout {layout!r} needs shape [B,S] = {list(leading)} or [S] = "
                        f"{list(leading[1:])}, got {list(pos.shape)}")
    return 0, pos


def _is_pair(value) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(t, torch.Tensor) for t in value)


def _table_rotary_dim(cos_sin) -> int:
    cos = cos_sin[0]
    return 2 * cos.shape[-1] if cos.dim() == 2 else -1


def _check_tables(cos_sin, rotary_dim, device):
    if not _is_pair(cos_sin):
        raise RopeError("cos_sin: expected a pair (cos, sin) of float32 tensors [max_pos, rotary_dim/2]")
    cos, sin = cos_sin
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32:
            raise RopeError(f"cos_sin: {name} must be float32, got {t.dtype}")
        if t.dim() != 2 or t.shape[1] != rotary_dim // 2:
            raise RopeError(f"cos_sin: {name} must have shape [max_pos, {rotary_dim // 2}], got {list(t.shape)}")
        if t.device != device:
            raise RopeError(f"cos_sin: {name} on {t.device}, q on {device}")
        if t.requires_grad:
            raise RopeError(f"cos_sin: {name} requires grad; gradients w.r.t. tables are not supported")
    if cos.shape != sin.shape:
        raise RopeError(f"cos_sin: cos {list(cos.shape)} and sin {list(sin.shape)} differ")
    return cos.contiguous(), sin.contiguous()


def _check_positions_inside(low: int, high: int, n_rows: int) -> None:
    if low < 0 or high > n_rows:
        raise RopeError(f"pos: positions [{low}, {high}) fall outside the caller's cos/sin table "
                        f"of {n_rows} rows")


def _n_tokens(q, layout) -> int:
    return q.shape[{"bshd": 1, "sbhd": 0, "bhsd": 2, "thd": 0}[layout]]


def positions_from_seqlens(seqlens=None, *, cu_seqlens=None, start=None, device=None,
                           dtype=torch.int64) -> torch.Tensor:
    """Per-token positions [T] for a packed (thd) batch.

    Give per-sequence lengths ``seqlens`` [N] or cumulative ``cu_seqlens`` [N+1] (FlashAttention
    style), and optionally per-sequence start offsets ``start`` [N] (e.g. tokens already in the KV
    cache). Token j of sequence n gets position ``start[n] + j``. Stays on the device: no host sync
    unless ``seqlens`` is a Python list.
    """
    if (seqlens is None) == (cu_seqlens is None):
        raise RopeError("positions_from_seqlens: give exactly one of seqlens and cu_seqlens")
    if seqlens is not None:
        lengths = torch.as_tensor(seqlens, device=device, dtype=torch.int64)
        if lengths.dim() != 1:
            raise RopeError(f"seqlens: expected a 1-D sequence of lengths, got shape {list(lengths.shape)}")
        cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    else:
        cu = torch.as_tensor(cu_seqlens, device=device, dtype=torch.int64)
        if cu.dim() != 1 or cu.numel() < 1:
            raise RopeError(f"cu_seqlens: expected a 1-D tensor [N+1], got shape {list(cu.shape)}")
        lengths = cu[1:] - cu[:-1]
    device = cu.device
    n_tokens = int(cu[-1]) if seqlens is not None and not isinstance(seqlens, torch.Tensor) else None
    seq_of_token = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths,
                                           output_size=n_tokens)
    token = torch.arange(seq_of_token.numel(), device=device)
    positions = token - cu[:-1][seq_of_token]
    if start is not None:
        start = torch.as_tensor(start, device=device, dtype=torch.int64)
        if start.shape != lengths.shape:
            raise RopeError(f"start: expected one offset per sequence {list(lengths.shape)}, got {list(start.shape)}")
        positions = positions + start[seq_of_token]
    return positions.to(dtype)


def seq_len_of(pos) -> int:
    """max(pos) + 1 as a Python int: the sequence length for dynamic NTK / LongRoPE.

    This is a host sync when pos is on a device; rope_ops never does it on its own.
    """
    if isinstance(pos, int):
        raise RopeError("seq_len_of: an int offset has no length; pass the positions tensor")
    return int(pos.max()) + 1
