"""rope_ops beyond one device: DTensor sharding rules for rope_ops' ops, ``apply`` on DTensors,
and each rank's positions for context parallelism.

A token's rotation reads only its own head_dim values and its own position. So q and k sharded
along batch, sequence (tokens) or heads rotate on each rank with no communication, as long as each
rank rotates its tokens by their global positions: the positions follow q's batch and sequence
sharding, the cos/sin tables are replicated. Sharding head_dim would split rotation pairs across
ranks; it is refused (RopeError): redistribute q and k first. The rotation is linear, so q or k
Partial (sum, avg) stays Partial.

Three entry points:

- ``apply`` / ``apply_grad``: ``rope_ops.apply`` for DTensor q and k (plain tensors pass through to
  ``rope_ops.apply``). Each rank rotates its local shard with ``rope_ops.apply``, so every argument,
  backend, autograd and torch.compile work as on one device. Positions may be a DTensor sharded or
  replicated to match q, a plain tensor holding every position (the same on every rank; each rank
  takes its slice, no communication) or an int offset. ``apply_dtensor`` is the same for
  ``rope_ops.apply`` itself to call when it is given DTensors. ``qkv_prologue`` does the same for
  the fused prologue on a qkv sharded along batch or sequence.
- Sharding rules for ``torch.ops.rope_ops.rope``, ``rope_`` and the fused prologue's
  ``qkv_prologue``, ``qkv_prologue_``, ``qkv_prologue_backward``, registered with DTensor on import
  of this module, for code that calls the ops on DTensors directly (eager or compiled).
- Context parallelism on plain tensors: ``cp_token_indices``, ``cp_positions`` and ``cp_shard``
  give a rank's tokens and their global positions for the contiguous split and for the
  load-balanced head-tail ("zigzag") split of torch's ``context_parallel`` and TransformerEngine,
  varlen packs (``cu_seqlens``) included; ``rope_ops.apply`` takes those positions as they are.
"""

from __future__ import annotations

import sys

import torch

from ._errors import RopeError
from .backend import LAYOUT_DIMS

__all__ = ["SPLITS", "cp_token_indices", "cp_positions", "cp_shard", "apply", "apply_grad",
           "qkv_prologue", "apply_dtensor", "is_dtensor", "register_sharding_rules"]

SPLITS = ("contiguous", "zigzag")


# ---------------------------------------------------------------------------------------------
# Context parallelism: which tokens a rank holds and their positions.


def _check_int(name: str, value, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise RopeError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def _check_cp(cp_size, cp_rank, split) -> None:
    _check_int("cp_size", cp_size, 1)
    _check_int("cp_rank", cp_rank, 0)
    if cp_rank >= cp_size:
        raise RopeError(f"cp_rank: expected 0 <= cp_rank < cp_size = {cp_size}, got {cp_rank}")
    if split not in SPLITS:
        raise RopeError(f"split: expected one of {SPLITS}, got {split!r}")


def _cu_list(cu_seqlens) -> list[int]:
    """cu_seqlens as Python ints, checked: [N+1], starting at 0, non-decreasing. Reading them
    is a host sync when they are on a device (the shard's size depends on them)."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex \
                or cu_seqlens.dtype == torch.bool or cu_seqlens.dim() != 1:
            raise RopeError(f"cu_seqlens: expected a 1-D integer tensor [N+1], got "
                            f"{cu_seqlens.dtype} of shape {list(cu_seqlens.shape)}")
        values = cu_seqlens.tolist()
    elif isinstance(cu_seqlens, (list, tuple)):
        values = list(cu_seqlens)
    else:
        raise RopeError(f"cu_seqlens: expected a 1-D integer tensor or a list, got "
                        f"{type(cu_seqlens).__name__}")
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise RopeError(f"cu_seqlens: expected [N+1] cumulative lengths (ints) starting at 0, got "
                        f"{values if len(values) <= 16 else 'a list of ' + str(len(values))}")
    if values[0] != 0:
        raise RopeError(f"cu_seqlens: must start at 0, starts at {values[0]}")
    for n, (a, b) in enumerate(zip(values, values[1:])):
        if b < a:
            raise RopeError(f"cu_seqlens: must be non-decreasing; sequence {n} has length {b - a}")
    return values


def _chunk_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """Piece ``index`` of ``length`` items cut into ``parts`` pieces the way torch.chunk and
    DTensor's Shard cut them: ceil(length / parts) each, the last ones shorter or empty."""
    size = -(-length // parts)
    start = min(index * size, length)
    return start, min(start + size, length)


def _zigzag_pieces(start: int, length: int, cp_size: int, cp_rank: int, what: str):
    """The two (start, end) ranges rank ``cp_rank`` holds of a sequence cut into 2 * cp_size
    chunks: chunk cp_rank and chunk 2 * cp_size - 1 - cp_rank."""
    if length % (2 * cp_size):
        raise RopeError(f"{what}: the zigzag split cuts each sequence into 2 * cp_size = "
                        f"{2 * cp_size} equal chunks; length {length} is not a multiple of "
                        f"{2 * cp_size} (pad it, or use split='contiguous')")
    chunk = length // (2 * cp_size)
    head = start + cp_rank * chunk
    tail = start + (2 * cp_size - 1 - cp_rank) * chunk
    return (head, head + chunk), (tail, tail + chunk)


def _ranges(seq_len, cu_seqlens, cp_size, cp_rank, split):
    """(ranges of global token indices this rank holds, in order; cu list or None)."""
    _check_cp(cp_size, cp_rank, split)
    if (seq_len is None) == (cu_seqlens is None):
        raise RopeError("cp: give exactly one of seq_len (one sequence) and cu_seqlens (a varlen pack)")
    if cu_seqlens is None:
        seq_len = _check_int("seq_len", seq_len, 0)
        if split == "contiguous":
            return [_chunk_bounds(seq_len, cp_size, cp_rank)], None
        return list(_zigzag_pieces(0, seq_len, cp_size, cp_rank, "seq_len")), None
    cu = _cu_list(cu_seqlens)
    if split == "contiguous":  # the packed tokens cut as one sequence; documents may span ranks
        return [_chunk_bounds(cu[-1], cp_size, cp_rank)], cu
    ranges = []
    for n, (a, b) in enumerate(zip(cu, cu[1:])):
        ranges.extend(_zigzag_pieces(a, b - a, cp_size, cp_rank, f"cu_seqlens (sequence {n})"))
    return ranges, cu


def _indices(ranges, device) -> torch.Tensor:
    """The concatenated ranges as an int64 tensor on ``device`` (made there: no copy for one
    sequence's one or two ranges; a pack's many ranges are expanded on the host first)."""
    if len(ranges) <= 2:
        pieces = [torch.arange(a, b, dtype=torch.int64, device=device) for a, b in ranges]
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=device)
    starts = torch.tensor([a for a, _ in ranges], dtype=torch.int64)
    lengths = torch.tensor([b - a for a, b in ranges], dtype=torch.int64)
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    # token j of the concatenation: starts[range of j] + (j - first index of that range)
    offsets = torch.nn.functional.pad(lengths.cumsum(0)[:-1], (1, 0))
    which = torch.repeat_interleave(torch.arange(len(ranges)), lengths, output_size=total)
    index = torch.arange(total) - offsets[which] + starts[which]
    return index.to(device)


def cp_token_indices(seq_len: int | None = None, *, cp_size: int, cp_rank: int,
                     split: str = "zigzag", cu_seqlens=None, device=None) -> torch.Tensor:
    """The global token indices (int64 [n]) context-parallel rank ``cp_rank`` of ``cp_size``
    holds, in the order it holds them.

    One sequence of ``seq_len`` tokens, or a varlen pack given by ``cu_seqlens`` [N+1]:

    - ``split="contiguous"``: piece ``cp_rank`` of the sequence (of the whole pack for varlen)
      cut into ``cp_size`` pieces as torch.chunk and DTensor's ``Shard`` cut them
      (ceil(n / cp_size) tokens each, the last ones shorter).
    - ``split="zigzag"`` (load-balanced head-tail, for causal attention): the sequence cut into
      2 * cp_size equal chunks; the rank holds chunk ``cp_rank`` then chunk
      ``2 * cp_size - 1 - cp_rank``, as torch's ``context_parallel`` (head-tail load balancer)
      and TransformerEngine do. Varlen: every sequence of the pack is cut that way and the rank
      holds its two chunks of each, sequence after sequence (TransformerEngine's thd
      convention). Lengths must be multiples of 2 * cp_size.
    """
    ranges, _ = _ranges(seq_len, cu_seqlens, cp_size, cp_rank, split)
    return _indices(ranges, device)


def cp_positions(seq_len: int | None = None, *, cp_size: int, cp_rank: int, split: str = "zigzag",
                 cu_seqlens=None, start=0, device=None, dtype=torch.int64) -> torch.Tensor:
    """The positions of the tokens rank ``cp_rank`` holds (see ``cp_token_indices``), to pass
    to ``rope_ops.apply`` with the rank's shard of q and k: [n] for a shard [B, n, H, D] (shared
    by the batch) or a packed shard [n, H, D].

    One sequence: token i is at ``start + i``. Varlen: token j of sequence m is at
    ``start[m] + j`` (``start`` an int or one offset per sequence, e.g. tokens already cached).
    """
    if dtype not in (torch.int32, torch.int64):
        raise RopeError(f"dtype: expected torch.int32 or torch.int64, got {dtype}")
    ranges, cu = _ranges(seq_len, cu_seqlens, cp_size, cp_rank, split)
    if cu is None:
        if isinstance(start, bool) or not isinstance(start, int):
            raise RopeError(f"start: one sequence takes an int offset, got {type(start).__name__}")
        spans = [(a, b) for a, b in ranges if b > a]
        if spans:
            _check_fits(start + spans[0][0], start + max(b for _, b in spans) - 1, dtype)
        return (_indices(ranges, device) + start).to(dtype)
    index = _indices(ranges, "cpu")
    bounds = torch.tensor(cu, dtype=torch.int64)
    sequence = torch.searchsorted(bounds[1:], index, right=True)
    positions = index - bounds[sequence]
    if isinstance(start, int) and not isinstance(start, bool):
        positions = positions + start
    else:
        offsets = torch.as_tensor(start)
        if offsets.dtype.is_floating_point or offsets.dtype == torch.bool \
                or tuple(offsets.shape) != (len(cu) - 1,):
            raise RopeError(f"start: expected an int or one int offset per sequence [{len(cu) - 1}], "
                            f"got {offsets.dtype} of shape {list(offsets.shape)}")
        positions = positions + offsets.to("cpu", torch.int64)[sequence]
    if positions.numel():
        _check_fits(int(positions.min()), int(positions.max()), dtype)
    return positions.to(device=device, dtype=dtype)


def _check_fits(low: int, high: int, dtype) -> None:
    info = torch.iinfo(dtype)
    if low < info.min or high > info.max:
        raise RopeError(f"dtype: positions [{low}, {high}] do not fit {dtype}; use torch.int64")


def cp_shard(x: torch.Tensor, dim: int, *, cp_size: int, cp_rank: int, split: str = "zigzag",
             cu_seqlens=None) -> torch.Tensor:
    """Rank ``cp_rank``'s shard of ``x`` along its sequence (or packed tokens) dim ``dim``, the
    tokens of ``cp_token_indices`` in that order: a view for a contiguous split, a copy for
    zigzag."""
    if not isinstance(x, torch.Tensor):
        raise RopeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise RopeError(f"dim: expected a dim of a {x.dim()}-D tensor, got {dim!r}")
    length = x.shape[dim]
    if cu_seqlens is None:
        ranges, _ = _ranges(length, None, cp_size, cp_rank, split)
    else:
        ranges, cu = _ranges(None, cu_seqlens, cp_size, cp_rank, split)
        if cu[-1] != length:
            raise RopeError(f"cu_seqlens: the pack holds {cu[-1]} tokens, x has {length} along dim {dim}")
    pieces = [x.narrow(dim, a, b - a) for a, b in ranges]
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces, dim) if pieces else x.narrow(dim, 0, 0)


# ---------------------------------------------------------------------------------------------
# DTensor: which dims a placement shards, and what the positions must be.


def _dtensor_module():
    """torch.distributed.tensor once something imported it (no DTensor exists before)."""
    return sys.modules.get("torch.distributed.tensor")


def is_dtensor(t) -> bool:
    module = _dtensor_module()
    return module is not None and isinstance(t, module.DTensor)


def _placement_types():
    from torch.distributed.tensor import Partial, Replicate, Shard

    return Partial, Replicate, Shard


def _sharded_as(name: str, placement, ndim: int, batch_dim, seq_dim, head_dim_dim,
                heads_ok: bool = True, linear: bool = True):
    """What one mesh dim's placement of q or k (or qkv) splits: "batch", "seq" or None (heads,
    replicated, partial). RopeError for head_dim and what the rotation cannot take."""
    Partial, Replicate, Shard = _placement_types()
    if isinstance(placement, Replicate):
        return None
    if isinstance(placement, Partial):
        if linear and placement.reduce_op in ("sum", "avg"):
            return None  # the rotation is linear: partial sums rotate to partial sums
        why = "only Partial sum or avg" if linear else "the prologue's norm is not linear"
        raise RopeError(f"{name}: placement {placement} is not supported ({why}); redistribute it "
                        "first")
    if isinstance(placement, Shard):
        dim = placement.dim % ndim
        if dim == head_dim_dim:
            raise RopeError(f"{name}: sharded along head_dim ({placement}); a rotation pair would "
                            "span ranks. Redistribute to shard batch, sequence or heads instead "
                            "(x.redistribute(mesh, [Shard(heads_dim)]) or Replicate())")
        if dim == batch_dim:
            return "batch"
        if dim == seq_dim:
            return "seq"
        if heads_ok:
            return None
    raise RopeError(f"{name}: placement {placement} is not supported here; redistribute it first")


def _like(placement, dim: int):
    """``placement``'s kind of Shard (plain or strided) on ``dim``."""
    _, _, Shard = _placement_types()
    if type(placement) is Shard:
        return Shard(dim)
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(placement, _StridedShard):
        return _StridedShard(dim, split_factor=placement.split_factor)
    raise RopeError(f"placement {placement}: not supported for positions")


def _follow(kind, q_placement, batch_dim, seq_dim):
    """The placement a token-indexed tensor (positions, per-token tables) with batch dim
    ``batch_dim`` (None: shared by the batch) and sequence dim ``seq_dim`` needs on a mesh dim
    where q is sharded as ``kind``."""
    _, Replicate, _ = _placement_types()
    if kind == "batch" and batch_dim is not None:
        return _like(q_placement, batch_dim)
    if kind == "seq":
        return _like(q_placement, seq_dim)
    return Replicate()


def _token_dims(name: str, shape: tuple, layout: str, leading: tuple, axes: bool = False,
                width: bool = False):
    """(batch dim or None, sequence dim) of a token-indexed tensor of ``shape``: positions
    [B, S] / [1, S] / [S] ([T] for thd); with ``axes`` mRoPE positions [3, ...]; with
    ``width`` per-token tables [..., w]. RopeError for other shapes."""
    lead = 1 if axes else 0
    body = shape[lead:len(shape) - (1 if width else 0)]
    if axes and (len(shape) < 1 or shape[0] != 3):
        raise RopeError(f"{name}: mRoPE positions must be [3, ...] (one row per axis t, h, w), got "
                        f"{list(shape)}")
    if layout == "thd":
        if body == leading:
            return None, lead
        if width and body == (1,) + leading:
            return None, lead + 1
        raise RopeError(f"{name}: layout 'thd' needs [T] = {list(leading)} token entries, got shape "
                        f"{list(shape)}")
    batch, seq = leading
    if body == (batch, seq):
        return lead, lead + 1
    if body == (1, seq):
        return None, lead + 1
    if body == (seq,):
        return None, lead
    raise RopeError(f"{name}: layout {layout!r} needs [B, S] = {[batch, seq]}, [1, S] or [S] = "
                    f"{[seq]} token entries, got shape {list(shape)}")


class _Sharding:
    """How q and k are split over each mesh dim, checked: ``kinds[i]`` is "batch", "seq" or None
    for mesh dim i, ``q_placements[i]`` the placement to copy for token-indexed tensors."""

    def __init__(self, layout, q_placements, q_ndim, k_placements=None, k_ndim=None,
                 flat_heads=None, q_name="q", k_name="k", heads_ok=True, linear=True,
                 batch_seq=None):
        batch_dim, seq_dim, _, _ = LAYOUT_DIMS[layout]
        if batch_seq is not None:
            batch_dim, seq_dim = batch_seq
        self.q_placements = list(q_placements)
        self.kinds = []
        for i, qp in enumerate(q_placements):
            kind = self._kind(q_name, qp, q_ndim, batch_dim, seq_dim, flat_heads, heads_ok, linear)
            if k_placements is not None:
                k_kind = self._kind(k_name, k_placements[i], k_ndim, batch_dim, seq_dim, flat_heads,
                                    heads_ok, linear)
                if k_kind != kind:
                    raise RopeError(f"{k_name}: placement {k_placements[i]} on mesh dim {i} splits "
                                    f"{k_kind or 'no tokens'}, {q_name}'s {qp} splits "
                                    f"{kind or 'no tokens'}; q and k must split batch and sequence "
                                    "the same way (heads may differ)")
            self.kinds.append(kind)

    @staticmethod
    def _kind(name, placement, ndim, batch_dim, seq_dim, flat_heads, heads_ok, linear):
        if flat_heads is not None:  # [T, H*D]: the last dim holds whole heads when evenly cut
            _, _, Shard = _placement_types()
            if isinstance(placement, Shard) and placement.dim % ndim == ndim - 1:
                if flat_heads:
                    return None
                raise RopeError(f"{name}: sharded along its last dim (H*head_dim) into pieces that "
                                "are not whole heads; shard a number of heads divisible by the mesh")
        return _sharded_as(name, placement, ndim, batch_dim, seq_dim, ndim - 1, heads_ok, linear)

    @property
    def splits_seq(self) -> bool:
        return "seq" in self.kinds

    def target(self, batch_dim, seq_dim) -> list:
        """Placements of a token-indexed tensor with these dims, following q."""
        return [_follow(kind, qp, batch_dim, seq_dim) for kind, qp in zip(self.kinds, self.q_placements)]


def _check_follows(name: str, have, want) -> None:
    """A token-indexed input may be replicated where q is sharded (each rank takes its slice)
    but may not be sharded where q is not, or otherwise than q: that would need communication."""
    _, Replicate, _ = _placement_types()
    for i, (h, w) in enumerate(zip(have, want)):
        if h != w and not isinstance(h, Replicate):
            raise RopeError(f"{name}: placement {h} on mesh dim {i}, but q's sharding needs {w} "
                            "there (or Replicate); matching it would need communication. "
                            f"Redistribute it to {list(want)} first")


def _localize(name: str, t, mesh, target, device):
    """The local part of a token-indexed tensor ``t`` for placements ``target``: of a DTensor
    (replicated where q is sharded: each rank takes its slice), or of a plain tensor holding
    every entry (the same on every rank). Never communicates."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(t, DTensor):
        if t.device_mesh != mesh:
            raise RopeError(f"{name}: on another device mesh than q")
        _check_follows(name, t.placements, target)
        if tuple(t.placements) != tuple(target):
            t = t.redistribute(mesh, target)  # Replicate -> Shard: a local slice
        return t.to_local()
    if t.device != device:
        raise RopeError(f"{name}: device {t.device} differs from q's {device}")
    if all(isinstance(p, Replicate) for p in target):
        return t
    whole = DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, target).to_local()


def _replicated_local(name: str, t, mesh):
    """The local tensor of something every rank needs whole (tables, norm weights)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(t, DTensor):
        if t.device_mesh != mesh:
            raise RopeError(f"{name}: on another device mesh than q")
        if not all(isinstance(p, Replicate) for p in t.placements):
            raise RopeError(f"{name}: must be replicated (every rank needs all of it), got "
                            f"{list(t.placements)}; redistribute it to Replicate() first")
        return t.to_local()
    return t


def _global_stride(local: torch.Tensor, shape) -> tuple:
    """Dense strides of a tensor of ``shape`` whose dims are ordered in memory as local's."""
    order = sorted(range(local.dim()), key=lambda d: local.stride(d), reverse=True)
    stride, step = [0] * local.dim(), 1
    for d in reversed(order):
        stride[d] = step
        step *= max(int(shape[d]), 1)
    return tuple(stride)


def _wrap(local: torch.Tensor, like):
    """``local`` as a DTensor with ``like``'s mesh, placements and global shape (see
    ``_from_local``)."""
    return _from_local(local, like.device_mesh, like.placements, like.shape,
                       _global_stride(local, like.shape))


def _from_local(local: torch.Tensor, mesh, placements, shape, stride):
    """``local`` as a DTensor placed ``placements``. Its gradient's local tensor passes back
    as it is when the gradient is placed the same way, Partial included: the rotation is linear,
    so the gradient of partial sums is the partial sums of the gradients. (torch's from_local
    before its grad_placements argument reduced a Partial gradient, one all-reduce.)"""
    if not torch.is_grad_enabled() or not local.requires_grad:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    return _FromLocal.apply(local, mesh, tuple(placements), torch.Size(shape), tuple(stride))


def _to_local(t, grad_placements=None):
    """The local tensor of DTensor ``t``. Its gradient goes back as a DTensor with ``t``'s own
    shape and strides, placed ``grad_placements`` (default: as ``t``). torch's to_local derives
    the gradient's global strides from the local tensor, which is wrong for uneven shards of a
    dim other than the first; autograd then finds the gradient's layout unlike ``t``'s, copies
    it into a replicated tensor, and that copy all-gathers."""
    if not torch.is_grad_enabled() or not t.requires_grad:
        return t.to_local()
    placements = tuple(t.placements if grad_placements is None else grad_placements)
    return _ToLocal.apply(t, placements)


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, mesh, placements, shape, stride):
        from torch.distributed.tensor import DTensor

        ctx.mesh, ctx.placements = mesh, placements
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    @staticmethod
    def backward(ctx, grad):
        if tuple(grad.placements) != ctx.placements:
            grad = grad.redistribute(ctx.mesh, ctx.placements)
        return grad.to_local(), None, None, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, placements):
        ctx.mesh, ctx.placements, ctx.shape, ctx.stride = t.device_mesh, placements, t.shape, t.stride()
        return t.to_local()

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(grad, ctx.mesh, ctx.placements, run_check=False, shape=ctx.shape,
                                  stride=ctx.stride), None


# ---------------------------------------------------------------------------------------------
# rope_ops.apply on DTensors.


def _api_options(kwargs: dict, what: str) -> dict:
    from . import _api

    return _api.full_options(kwargs, what)


def apply(q, k, pos, **kwargs):
    """``rope_ops.apply`` for DTensor q and k (and for plain tensors, which it passes to
    ``rope_ops.apply``). Returns DTensors placed like q and k; see ``apply_dtensor``."""
    if not any(is_dtensor(t) for t in (q, k)):
        from . import _api

        return _api.apply(q, k, pos, **kwargs)
    return apply_dtensor(q, k, pos, _api_options(kwargs, "apply"))


def apply_grad(grad_q, grad_k, pos, **kwargs):
    """``rope_ops.apply_grad`` (RotaryEmbeddingGrad) for DTensors, as ``apply``."""
    if not any(is_dtensor(t) for t in (grad_q, grad_k)):
        from . import _api

        return _api.apply_grad(grad_q, grad_k, pos, **kwargs)
    return apply_dtensor(grad_q, grad_k, pos, _api_options(kwargs, "apply_grad"), inverse=True)


def apply_dtensor(q, k, pos, kw: dict, inverse: bool = False, mode: str = "run"):
    """``rope_ops._api._apply`` for DTensor q and k (``kw``: all of apply's keyword arguments):
    each rank rotates its local shard, by its tokens' global positions, with no communication.

    q and k are DTensors on one mesh. On every mesh dim they may be replicated, sharded along
    batch, sequence (tokens) or heads, or Partial (sum, avg); q and k split batch and sequence
    the same way, heads as they like (GQA). head_dim sharding is a RopeError. ``pos`` is a
    DTensor placed to follow q (or replicated where q is sharded), a plain tensor of every
    position (the same on every rank), or an int offset. Caller ``cos_sin`` tables are
    replicated (plain or Replicate DTensors); per-token tables (pos None) follow q like
    positions. ``out=`` takes DTensors placed like q and k. Outputs are DTensors placed like q
    and k.
    """
    from . import _api
    from ._memory import check_inplace_autograd, check_inplace_memory

    module = _dtensor_module()
    DTensor = module.DTensor
    if not isinstance(q, DTensor):
        raise RopeError(f"q: k is a DTensor, q is a {type(q).__name__}; give both as DTensors on one "
                        "mesh (or both as plain tensors)")
    if k is not None and not isinstance(k, DTensor):
        raise RopeError(f"k: q is a DTensor, k is a {type(k).__name__}; give both as DTensors on one "
                        "mesh (or both as plain tensors)")
    mesh = q.device_mesh
    if k is not None and k.device_mesh != mesh:
        raise RopeError("k: on another device mesh than q")
    layout, leading, flat_heads = _layout_of(q, k, kw)
    sharding = _Sharding(layout, q.placements, q.dim(), None if k is None else k.placements,
                         None if k is None else k.dim(), flat_heads)
    device = q.device
    if kw["inplace"] is True and mode == "run":
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))
        for name, t in (("q", q), ("k", k)):
            if t is not None:
                check_inplace_autograd(name, t, needs_grad)
        if needs_grad:
            # Autograd sees the DTensors, not their local tensors: rotate out of place (recorded),
            # then copy into q and k (recorded too; elementwise, no communication).
            with torch.no_grad():
                check_inplace_memory(q.to_local(), None if k is None else k.to_local())
            q_rot, k_rot = apply_dtensor(q, k, pos, {**kw, "inplace": False}, inverse)
            q.copy_(q_rot)
            if k is not None:
                k.copy_(k_rot)
            return q, k
    kw = dict(kw)
    pos_local, kw["cos_sin"] = _local_positions(pos, kw["cos_sin"], kw["mrope_section"] is not None,
                                                sharding, mesh, layout, leading, device)

    out = kw["out"]
    if out is not None:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise RopeError("out: expected a pair (q_out, k_out) (k_out None when k is None)")
        local_out = []
        for name, given, like in (("q", out[0], q), ("k", out[1], k)):
            if given is None or like is None:
                local_out.append(given)
                continue
            if not isinstance(given, DTensor) or given.device_mesh != mesh \
                    or tuple(given.placements) != tuple(like.placements):
                raise RopeError(f"out: the output for {name} must be a DTensor placed like {name} "
                                f"({list(like.placements)})")
            local_out.append(given.to_local())
        kw["out"] = tuple(local_out)

    q_local, k_local = _to_local(q), None if k is None else _to_local(k)
    result = _api._apply(q_local, k_local, pos_local, kw, inverse, mode)
    if mode != "run":
        return result
    if kw["inplace"] is True:
        for t in (q, k):
            if t is not None and not t.is_inference():
                torch.autograd.graph.increment_version(t)
        return q, k
    if out is not None:
        return out[0], out[1]
    q_out, k_out = result
    return _wrap(q_out, q), None if k_out is None else _wrap(k_out, k)


def _local_positions(pos, cos_sin, mrope, sharding, mesh, layout, leading, device):
    """(local pos, local cos_sin) for a call on q sharded as ``sharding``: positions and
    per-token tables sliced like q's tokens, position tables replicated; an int offset becomes
    the positions it stands for when the sequence is sharded (each shard starts elsewhere)."""
    if pos is None:
        if isinstance(cos_sin, (tuple, list)) and len(cos_sin) == 2 \
                and all(isinstance(t, torch.Tensor) for t in cos_sin):
            local = []
            for name, t in zip(("cos_sin (cos)", "cos_sin (sin)"), cos_sin):
                dims = _token_dims(name, tuple(t.shape), layout, leading, width=True)
                local.append(_localize(name, t, mesh, sharding.target(*dims), device))
            cos_sin = tuple(local)
        return None, cos_sin
    if isinstance(pos, int) and not isinstance(pos, bool):
        if sharding.splits_seq:
            whole = torch.arange(leading[-1], dtype=torch.int64, device=device) + pos
            pos = _localize("pos", whole, mesh, sharding.target(None, 0), device)
    elif isinstance(pos, torch.Tensor):
        dims = _token_dims("pos", tuple(pos.shape), layout, leading, axes=mrope)
        pos = _localize("pos", pos, mesh, sharding.target(*dims), device)
    if isinstance(cos_sin, torch.Tensor):
        cos_sin = _replicated_local("cos_sin", cos_sin, mesh)
    elif isinstance(cos_sin, (tuple, list)):
        cos_sin = tuple(_replicated_local("cos_sin", t, mesh) for t in cos_sin)
    return pos, cos_sin


def qkv_prologue(qkv, pos, **kwargs):
    """``rope_ops.qkv_prologue`` for a DTensor ``qkv`` (plain tensors pass through to it).

    qkv may be replicated or sharded along batch or sequence (tokens), not along its last dim
    (it packs q, k and v heads): each rank splits, normalises and rotates its tokens with no
    communication, and q, k, v come back as DTensors sharded like qkv. Positions and tables as
    for ``apply``. Norm weights are replicated (Replicate DTensors, or plain tensors that need no
    gradient): their gradients come back Partial (each rank's sum over its own tokens), reduced
    where they are used. The KV-cache write takes qkv replicated only.
    """
    from . import prologue as _prologue

    if not is_dtensor(qkv):
        return _prologue.qkv_prologue(qkv, pos, **kwargs)
    if qkv.dim() not in (2, 3):
        return _prologue.qkv_prologue(qkv.to_local(), pos, **kwargs)  # its RopeError
    from torch.distributed.tensor import Partial, Replicate

    mesh, device = qkv.device_mesh, qkv.device
    layout = "thd" if qkv.dim() == 2 else "bshd"
    sharding = _prologue_sharding(qkv, layout)
    kw = dict(kwargs)
    token_split = any(sharding.kinds)
    pos, cos_sin = _local_positions(pos, kw.get("cos_sin"), kw.get("mrope_section") is not None,
                                    sharding, mesh, layout, tuple(qkv.shape[:-1]), device)
    if "cos_sin" in kw:
        kw["cos_sin"] = cos_sin
    grad_placements = [Partial("sum") if kind else Replicate() for kind in sharding.kinds]
    for name in ("q_norm", "k_norm"):
        w = kw.get(name)
        if is_dtensor(w):
            _replicated_local(name, w, mesh)  # checks
            kw[name] = _to_local(w, grad_placements)
        elif isinstance(w, torch.Tensor) and w.requires_grad and token_split \
                and torch.is_grad_enabled():
            raise RopeError(f"{name}: a plain tensor that requires grad, with qkv sharded along tokens, "
                            "would get only this rank's part of its gradient; give it as a "
                            "replicated DTensor")
    if kw.get("kv_cache") is not None:
        if token_split:
            raise RopeError("kv_cache: the cache write takes qkv replicated; with tokens sharded, "
                            "call the prologue on each rank's local qkv and cache")
        kw["kv_cache"] = tuple(_replicated_local("kv_cache", t, mesh) for t in kw["kv_cache"])
        if kw.get("slots") is not None:
            kw["slots"] = _replicated_local("slots", kw["slots"], mesh)
    outs = _prologue.qkv_prologue(_to_local(qkv), pos, **kw)
    if kw.get("inplace") is True and not qkv.is_inference():
        torch.autograd.graph.increment_version(qkv)
    lead = tuple(qkv.shape[:-1])
    wrapped = []
    for t in outs:
        shape = torch.Size(lead + tuple(t.shape[-2:]))
        wrapped.append(_from_local(t, mesh, qkv.placements, shape, _global_stride(t, shape)))
    return tuple(wrapped)

def _layout_of(q, k, kw):
    """(layout, leading (batch, seq) sizes or (tokens,), flat_heads) of DTensor q from its
    global shape; flat_heads is None unless q is [T, H*D] (head_dim=), then whether every
    sharding of its last dim leaves whole heads."""
    from ._api import layout_of

    shape, ndim = tuple(q.shape), q.dim()
    head_dim = kw["head_dim"]
    if head_dim is not None:
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
            raise RopeError(f"head_dim: expected an int > 0, got {head_dim!r}")
        if ndim != 2:
            raise RopeError(f"q: with head_dim, expected a 2-D [T, H*head_dim] tensor, got {ndim}-D "
                            f"shape {shape}")
        if kw["layout"] not in (None, "thd"):
            raise RopeError(f"head_dim: 2-D q and k ([T, H*head_dim]) are thd; got layout {kw['layout']!r}")
        whole_heads = True
        for t in (q, k):
            if t is None:
                continue
            pieces = 1
            for size, p in zip(t.device_mesh.shape, t.placements):
                if p.is_shard() and p.dim % 2 == 1:
                    pieces *= size
            if t.shape[-1] % (head_dim * pieces):
                whole_heads = False
        return "thd", shape[:1], whole_heads
    layout = layout_of(shape, kw["layout"])
    batch_dim, seq_dim, _, _ = LAYOUT_DIMS[layout]
    leading = (shape[seq_dim],) if batch_dim is None else (shape[batch_dim], shape[seq_dim])
    return layout, leading, None


# ---------------------------------------------------------------------------------------------
# Sharding rules for the ops (torch.ops.rope_ops.*) on DTensors.
#
# Each rule reads the inputs' actual placements and offers, per mesh dim, the one strategy that
# keeps them: q, k (qkv) and the outputs stay as they are, positions and per-token tables follow
# q (a replicated one is sliced locally), tables and norm weights are replicated. DTensor picks
# the combination over mesh dims that moves nothing; what would need communication, or cannot
# be computed locally, is a RopeError.


class ShardingRefused(RopeError, NotImplementedError):
    """A RopeError raised by a sharding rule. DTensor passes a NotImplementedError from a rule
    through unchanged (anything else it wraps in a RuntimeError), so callers of the ops on
    DTensors get the RopeError itself."""


def _refusing(rule):
    def checked(*args, **kwargs):
        try:
            return rule(*args, **kwargs)
        except ShardingRefused:
            raise
        except RopeError as error:
            raise ShardingRefused(str(error)) from None

    return checked


def _rope_rule(has_outputs: bool):
    def rule(q, k, pos, pos_offset, cos, sin, freq_turns, attention_factor, freqs, seq_len, layout,
             rotary_dim, interleaved, inverse, angles, mrope_section, mrope_interleaved, needs_grad,
             backend):
        _, Replicate, _ = _placement_types()
        n = len(q.placements)
        batch_dim, seq_dim, _, _ = LAYOUT_DIMS[layout]
        leading = ((q.shape[seq_dim],) if batch_dim is None
                   else (q.shape[batch_dim], q.shape[seq_dim]))
        sharding = _Sharding(layout, q.placements, q.ndim, None if k is None else k.placements,
                             None if k is None else k.ndim)
        if angles == "token":  # per-token tables [B, S, w] ([1, T, w] for thd) follow q
            table = sharding.target(*_token_dims("cos", tuple(cos.shape), layout, leading, width=True))
        else:
            table = [Replicate()] * n
        for name, t in (("cos", cos), ("sin", sin), ("freq_turns", freq_turns)):
            if t is not None:
                _check_follows(name, t.placements, table if name != "freq_turns" else [Replicate()] * n)
        if pos is not None:
            dims = _token_dims("pos", tuple(pos.shape), layout, leading, axes=angles == "mrope")
            pos_target = sharding.target(*dims)
            _check_follows("pos", pos.placements, pos_target)
        elif angles != "token" and sharding.splits_seq:
            raise RopeError("pos: q is sharded along the sequence, but positions come as an offset "
                            "(pos_offset): each shard would restart at it. Pass a positions tensor")
        strategies = []
        for i in range(n):
            outputs = [q.placements[i], Replicate() if k is None else k.placements[i]]
            inputs = [q.placements[i], None if k is None else k.placements[i],
                      None if pos is None else pos_target[i], None,
                      None if cos is None else table[i], None if sin is None else table[i],
                      None if freq_turns is None else Replicate()] + [None] * 12
            strategies.append((outputs if has_outputs else [], inputs))
        return strategies

    return rule


_PROLOGUE_TOKENS = {"thd": (None, 0), "bshd": (0, 1)}  # qkv [T, W] / [B, S, W]


def _prologue_sharding(qkv, layout):
    _, _, Shard = _placement_types()
    for i, p in enumerate(qkv.placements):
        if isinstance(p, Shard) and p.dim % qkv.ndim == qkv.ndim - 1:
            raise RopeError(f"qkv: sharded along its last dim ({p} on mesh dim {i}), which packs q, k "
                            "and v heads; the prologue takes qkv sharded along batch or sequence "
                            "only (split heads before it, or call it on each rank's local qkv)")
    return _Sharding(layout, qkv.placements, qkv.ndim, q_name="qkv", heads_ok=False, linear=False,
                     batch_seq=_PROLOGUE_TOKENS[layout])


def _prologue_angles(sharding, qkv, pos, cos, sin, freq_turns, angles, layout, rotate):
    """Per mesh dim: (pos placement or None, table placement, freq_turns placement or None)."""
    _, Replicate, _ = _placement_types()
    n = len(qkv.placements)
    leading = tuple(qkv.shape[:-1])
    if rotate and angles == "token":
        table = sharding.target(*_token_dims("cos", tuple(cos.shape), layout, leading, width=True))
    else:
        table = [Replicate()] * n
    for name, t in (("cos", cos), ("sin", sin)):
        if t is not None:
            _check_follows(name, t.placements, table)
    if freq_turns is not None:
        _check_follows("freq_turns", freq_turns.placements, [Replicate()] * n)
    if pos is not None:
        pos_target = sharding.target(*_token_dims("pos", tuple(pos.shape), layout, leading,
                                                  axes=angles == "mrope"))
        _check_follows("pos", pos.placements, pos_target)
    else:
        if rotate and angles != "token" and sharding.splits_seq:
            raise RopeError("pos: qkv is sharded along the sequence, but positions come as an offset "
                            "(pos_offset): each shard would restart at it. Pass a positions tensor")
        pos_target = [None] * n
    return pos_target, table, [None if freq_turns is None else Replicate()] * n


def _prologue_rule(has_outputs: bool):
    def rule(qkv, pos, pos_offset, cos, sin, freq_turns, attention_factor, freqs, seq_len, angles,
             mrope_section, mrope_interleaved, layout, num_q_heads, num_kv_heads, head_dim, rotary_dim,
             interleaved, rotate, q_weight, k_weight, eps, weight_offset, k_cache, v_cache, slots,
             k_scale, v_scale, q_scale, needs_grad, backend):
        _, Replicate, _ = _placement_types()
        sharding = _prologue_sharding(qkv, layout)
        pos_t, table, turns = _prologue_angles(sharding, qkv, pos, cos, sin, freq_turns, angles, layout,
                                               rotate)
        caches = (k_cache, v_cache, slots)
        if any(t is not None for t in caches) and any(sharding.kinds):
            raise RopeError("kv_cache: the cache write takes qkv replicated; with tokens sharded, "
                            "call the prologue on each rank's local qkv and cache")
        for name, t in (("q_weight", q_weight), ("k_weight", k_weight), ("k_cache", k_cache),
                        ("v_cache", v_cache), ("slots", slots)):
            if t is not None:
                _check_follows(name, t.placements, [Replicate()] * len(qkv.placements))
        strategies = []
        for i, p in enumerate(qkv.placements):
            def rep(t):
                return None if t is None else Replicate()

            inputs = ([p, pos_t[i], None, None if cos is None else table[i],
                       None if sin is None else table[i], turns[i]] + [None] * 13
                      + [rep(q_weight), rep(k_weight), None, None, rep(k_cache), rep(v_cache),
                         rep(slots)] + [None] * 5)
            strategies.append(([p, p, p] if has_outputs else [], inputs))
        return strategies

    return rule


def _prologue_backward_rule(qkv, grad_q, grad_k, grad_v, pos, pos_offset, cos, sin, freq_turns,
                            attention_factor, freqs, seq_len, angles, mrope_section,
                            mrope_interleaved, layout, num_q_heads, num_kv_heads, head_dim,
                            rotary_dim, interleaved, rotate, q_weight, k_weight, eps, weight_offset,
                            backend):
    Partial, Replicate, _ = _placement_types()
    sharding = _prologue_sharding(qkv, layout)
    pos_t, table, turns = _prologue_angles(sharding, qkv, pos, cos, sin, freq_turns, angles, layout,
                                           rotate)
    for name, t in (("q_weight", q_weight), ("k_weight", k_weight)):
        if t is not None:
            _check_follows(name, t.placements, [Replicate()] * len(qkv.placements))
    strategies = []
    for i, (p, kind) in enumerate(zip(qkv.placements, sharding.kinds)):
        def weight_grad(w):  # a sum over tokens: each rank holds the sum over its own
            return Partial("sum") if w is not None and kind is not None else Replicate()

        def grad(t):
            return None if t is None else p

        def rep(t):
            return None if t is None else Replicate()

        outputs = [p, weight_grad(q_weight), weight_grad(k_weight)]
        inputs = ([p, grad(grad_q), grad(grad_k), grad(grad_v), pos_t[i], None,
                   None if cos is None else table[i], None if sin is None else table[i],
                   turns[i]] + [None] * 13 + [rep(q_weight), rep(k_weight), None, None, None])
        strategies.append((outputs, inputs))
    return strategies


_registered = False


def register_sharding_rules() -> None:
    """Register the ops' sharding rules with DTensor (done on import of this module; again is a
    no-op)."""
    global _registered
    if _registered:
        return
    try:
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:  # torch < 2.5: no DTensor sharding rules for custom ops
        return

    from . import _ops  # noqa: F401  (defines the ops)

    ops = torch.ops.rope_ops
    register_sharding(ops.rope.default)(_refusing(_rope_rule(True)))
    register_sharding(ops.rope_.default)(_refusing(_rope_rule(False)))
    register_sharding(ops.qkv_prologue.default)(_refusing(_prologue_rule(True)))
    register_sharding(ops.qkv_prologue_.default)(_refusing(_prologue_rule(False)))
    register_sharding(ops.qkv_prologue_backward.default)(_refusing(_prologue_backward_rule))
    _registered = True


if torch.distributed.is_available():
    register_sharding_rules()
