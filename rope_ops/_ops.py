"""Running a backend: the torch.library ops (for torch.compile), autograd, and the checks rope_ops
makes around every backend's ``run``.

The op schemas are defined once here, backend-agnostic, and carry every argument of a call: the
tables are tensor arguments (a compiled graph holds or receives them; nothing is looked up by
key when it runs), the backend request is a string resolved when the op runs. Their one kernel
(CompositeExplicitAutograd, every device) runs the selected backend; fake kernels give
torch.compile the output metadata. Autograd lives in ``autograd.Function``s outside the ops,
whose backward is the same rotation with ``inverse`` flipped (RotaryEmbeddingGrad); when a graph
of the backward is asked for (``create_graph=True``) the backward is itself a Function, so
second derivatives are right on every backend.

Host cost: the dispatcher costs several microseconds per call, a large share of a decode step,
so eager calls run the backend directly and only traced code goes through ``torch.ops.rope_ops``.
Both paths run ``run_backend``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _select, registry
from ._errors import BackendError
from .backend import Backend, KernelArgs, RopeCall

_LIB = torch.library.Library("rope_ops", "DEF")  # kept alive for the life of the process
# cos/sin/freq_turns None: ``freqs`` (the frequency parameters as text, _tables.freqs_spec) and
# seq_len (-1: none) give the tables when the op runs.
_ARGS = ("Tensor? pos, SymInt pos_offset, Tensor? cos, Tensor? sin, Tensor? freq_turns, "
         "float attention_factor, str freqs, SymInt seq_len, str layout, SymInt rotary_dim, "
         "bool interleaved, bool inverse, str angles, int[] mrope_section, bool mrope_interleaved, "
         "bool needs_grad, str backend")
_LIB.define(f"rope(Tensor q, Tensor? k, {_ARGS}) -> (Tensor, Tensor)")
_LIB.define(f"rope_(Tensor(a!) q, Tensor(b!)? k, {_ARGS}) -> ()")


class Spec(NamedTuple):
    """The non-tensor part of a call that autograd carries from forward to backward."""

    layout: str
    rotary_dim: int
    interleaved: bool
    inplace: bool
    request: str  # the backend request ('auto', a name, a comma list)
    backend: Backend | None  # the backend selected for it (eager); None when traced
    angles: str = "table"  # KernelArgs.angles
    mrope_section: tuple | None = None
    mrope_interleaved: bool = False
    freqs: str = ""  # traced calls without tables: the frequency parameters as text
    seq_len: int = -1  # with freqs: the sequence length they scale for (-1: none)


# ---------------------------------------------------------------------------------------------
# Around every backend's run.

_verified: set = set()  # (backend name, call) of third-party backends whose outputs were checked


def run_backend(backend: Backend, args: KernelArgs, call: tuple | None = None,
                separate_outputs: bool = False):
    """Run ``backend`` on ``args`` and return (q_out, k_out).

    Out of place it allocates the outputs unless the backend does (``allocates_outputs``; never
    when ``separate_outputs``: the op's outputs may share no storage). In place it moves q's and
    k's version counters, so autograd sees the write whatever the backend wrote through. The
    first call of each kind on a third-party backend is checked (``_check_outputs``).
    """
    q, k = args.q, args.k
    if args.inplace:
        q_out, k_out = q, k
    elif args.q_out is not None:
        q_out, k_out = args.q_out, args.k_out
    elif backend.allocates_outputs and not separate_outputs:
        q_out = k_out = None
    else:
        q_out = torch.empty_like(q)
        k_out = None if k is None else torch.empty_like(k)
    if q.numel() == 0 and (k is None or k.numel() == 0):
        if q_out is None:
            q_out, k_out = torch.empty_like(q), (None if k is None else torch.empty_like(k))
        return q_out, k_out
    check = (call is not None and not registry.is_builtin(backend.name)
             and (backend.name, call) not in _verified)
    if check and not args.inplace:
        if q_out is None:  # see that every output element gets written: start from NaN
            q_out = torch.empty_like(q)
            k_out = None if k is None else torch.empty_like(k)
        q_out.fill_(float("nan"))
        if k_out is not None:
            k_out.fill_(float("nan"))
    made = backend.run(args._replace(q_out=q_out, k_out=k_out))
    if args.inplace:
        for t in (q, k):
            if t is not None and not t.is_inference():
                torch.autograd.graph.increment_version(t)
    elif q_out is None:
        if not (isinstance(made, tuple) and len(made) == 2):
            raise BackendError(f"backend {backend.name!r}: run() must return (q_out, k_out) when it "
                               f"allocates the outputs, got {type(made).__name__}")
        q_out, k_out = made
    if check:
        _check_outputs(backend, args, q_out, k_out)
        _verified.add((backend.name, call))
    return q_out, k_out


def _check_outputs(backend: Backend, args: KernelArgs, q_out, k_out) -> None:
    """A third-party backend's first call of a kind: outputs of the inputs' shape, dtype and
    device; out of place, every element written (none left at the NaN put there) and the
    pass-through dims copied. One host sync, once per kind (skipped while capturing a graph)."""
    for name, x, out in (("q", args.q, q_out), ("k", args.k, k_out)):
        if x is None:
            continue
        if not isinstance(out, torch.Tensor):
            raise BackendError(f"backend {backend.name!r} returned no tensor for {name}_out")
        if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
            raise BackendError(f"backend {backend.name!r} returned {name}_out of shape "
                               f"{list(out.shape)}, {out.dtype}, {out.device}; expected "
                               f"{list(x.shape)}, {x.dtype}, {x.device}")
        if args.inplace or (out.is_cuda and torch.cuda.is_current_stream_capturing()):
            continue
        r = args.rotary_dim
        finite_in = torch.isfinite(x[..., :r]).all(dim=-1)
        unwritten = (torch.isnan(out[..., :r]).all(dim=-1) & finite_in).any()
        tail_same = torch.equal(out[..., r:], x[..., r:]) or bool(
            ((out[..., r:] == x[..., r:]) | (out[..., r:].isnan() & x[..., r:].isnan())).all())
        if bool(unwritten) and args.freq_turns is not None:
            raise BackendError(f"backend {backend.name!r} left rows of {name}_out unwritten")
        if not tail_same:
            raise BackendError(f"backend {backend.name!r} did not copy the pass-through dims "
                               f"[{r}, {x.shape[-1]}) of {name}")


def rotate(spec: Spec, q, k, pos, pos_offset, cos, sin, freq_turns, attention_factor, inverse,
           needs_grad=False, call=None, q_out=None, k_out=None):
    """One rotation: the backend directly in eager mode, ``torch.ops.rope_ops`` when traced.
    Returns (q_out, k_out); in place, (q, k). ``q_out``/``k_out``: caller's outputs (out=)."""
    if not torch.compiler.is_compiling():
        args = KernelArgs(q, k, q_out, k_out, pos, pos_offset, cos, sin, freq_turns,
                          attention_factor, spec.layout, spec.rotary_dim, spec.interleaved,
                          inverse, spec.inplace, spec.angles, spec.mrope_section,
                          spec.mrope_interleaved)
        return run_backend(spec.backend, args, call)
    section = list(spec.mrope_section or ())
    common = (pos, pos_offset, cos, sin, freq_turns, attention_factor, spec.freqs, spec.seq_len,
              spec.layout, spec.rotary_dim, spec.interleaved, inverse, spec.angles, section,
              spec.mrope_interleaved, needs_grad, spec.request)
    if spec.inplace:
        torch.ops.rope_ops.rope_(q, k, *common)
        return q, k
    made_q, made_k = torch.ops.rope_ops.rope(q, k, *common)
    made_k = None if k is None else made_k
    if q_out is None:
        return made_q, made_k
    q_out.copy_(made_q)
    if k_out is not None:
        k_out.copy_(made_k)
    return q_out, k_out


# ---------------------------------------------------------------------------------------------
# The ops' kernels: what a compiled graph runs.

_HEADS = {"bshd": 2, "sbhd": 2, "bhsd": 1, "thd": 1}


def call_of(q, k, pos, cos, freq_turns, layout, rotary_dim, interleaved, inplace, needs_grad,
            angles, mrope_interleaved=False) -> RopeCall:
    """The selection metadata of a call (what backends' supports() read)."""
    heads = _HEADS[layout]
    return RopeCall(q.device.type, q.dtype, layout, "gptj" if interleaved else "neox", q.shape[-1],
                    rotary_dim, q.shape[heads], 0 if k is None else k.shape[heads], inplace,
                    None if pos is None else pos.dtype, freq_turns is None, needs_grad,
                    q.stride(-1) == 1 and (k is None or k.stride(-1) == 1), angles, cos.dtype,
                    mrope_interleaved=angles == "mrope" and mrope_interleaved)


def tables_of(cos, sin, freq_turns, attention_factor, freqs, seq_len, rotary_dim, device):
    """A traced call's tables: the tensors it got, or those its frequency text describes."""
    if cos is not None:
        return cos, sin, freq_turns, attention_factor
    from ._tables import tables_from_spec

    return tables_from_spec(freqs, rotary_dim, None if seq_len < 0 else seq_len, device)


def _run_op(inplace, q, k, pos, pos_offset, cos, sin, freq_turns, attention_factor, freqs, seq_len,
            layout, rotary_dim, interleaved, inverse, angles, mrope_section, mrope_interleaved,
            needs_grad, request):
    cos, sin, freq_turns, attention_factor = tables_of(cos, sin, freq_turns, attention_factor, freqs,
                                                       seq_len, rotary_dim, q.device)
    call = call_of(q, k, pos, cos, freq_turns, layout, rotary_dim, interleaved, inplace, needs_grad,
                   angles, mrope_interleaved)
    backend = _select.select(call, request)
    args = KernelArgs(q, k, None, None, pos, pos_offset, cos, sin, freq_turns, attention_factor,
                      layout, rotary_dim, interleaved, inverse, inplace, angles,
                      tuple(mrope_section) or None, mrope_interleaved)
    return run_backend(backend, args, call, separate_outputs=True)


@torch.library.impl(_LIB, "rope", "CompositeExplicitAutograd")
def _rope_kernel(q, k, *args):
    q_out, k_out = _run_op(False, q, k, *args)
    return q_out, (q.new_empty(0) if k_out is None else k_out)


@torch.library.register_fake("rope_ops::rope")
def _rope_fake(q, k, *args):
    return torch.empty_like(q), (q.new_empty(0) if k is None else torch.empty_like(k))


@torch.library.impl(_LIB, "rope_", "CompositeExplicitAutograd")
def _rope_inplace_kernel(q, k, *args):
    from ._memory import check_inplace_memory

    check_inplace_memory(q, k)  # traced calls could not check before (no data pointers)
    _run_op(True, q, k, *args)


@torch.library.register_fake("rope_ops::rope_")
def _rope_inplace_fake(q, k, *args):
    return None


# ---------------------------------------------------------------------------------------------
# Autograd.


def _last_dim_contiguous(grad):
    """Output gradients as the backends take them (stride 1 on head_dim); None stays None."""
    if grad is not None and grad.stride(-1) != 1:
        return grad.contiguous()
    return grad


class RopeFunction(torch.autograd.Function):
    """Forward RotaryEmbedding (or, with ``inverse``, RotaryEmbeddingGrad); backward the rotation
    the other way, differentiable again when ``create_graph=True``. Returns q_out alone when k
    is None: autograd allows a Function that writes a view in place one output only."""

    @staticmethod
    def forward(ctx, q, k, pos, cos, sin, freq_turns, pos_offset, attention_factor, spec, inverse):
        q_out, k_out = rotate(spec, q, k, pos, pos_offset, cos, sin, freq_turns, attention_factor,
                              inverse, needs_grad=True)
        ctx.save_for_backward(pos, cos, sin, freq_turns)
        ctx.pos_offset, ctx.attention_factor, ctx.spec, ctx.inverse = pos_offset, attention_factor, spec, inverse
        if spec.inplace:
            ctx.mark_dirty(*(t for t in (q, k) if t is not None))
        return q_out if k is None else (q_out, k_out)

    @staticmethod
    def backward(ctx, grad_q, grad_k=None):
        pos, cos, sin, freq_turns = ctx.saved_tensors
        spec = ctx.spec._replace(inplace=False)
        grad_q, grad_k = _last_dim_contiguous(grad_q), _last_dim_contiguous(grad_k)
        if torch.is_grad_enabled():  # create_graph=True: record this rotation too
            out = RopeFunction.apply(grad_q, grad_k, pos, cos, sin, freq_turns, ctx.pos_offset,
                                     ctx.attention_factor, spec, not ctx.inverse)
            gq, gk = (out, None) if grad_k is None else out
        else:
            gq, gk = rotate(spec, grad_q, grad_k, pos, ctx.pos_offset, cos, sin, freq_turns,
                            ctx.attention_factor, not ctx.inverse)
        return gq, gk, None, None, None, None, None, None, None, None


def rotate_with_grad(spec: Spec, q, k, pos, pos_offset, cos, sin, freq_turns, attention_factor,
                     inverse, split: bool):
    """The rotation recorded by autograd. ``split``: in place on views, one Function per tensor
    (each may return only the view it wrote)."""
    if split and k is not None:
        q_out = RopeFunction.apply(q, None, pos, cos, sin, freq_turns, pos_offset, attention_factor,
                                   spec, inverse)
        k_out = RopeFunction.apply(k, None, pos, cos, sin, freq_turns, pos_offset, attention_factor,
                                   spec, inverse)
        return q_out, k_out
    out = RopeFunction.apply(q, k, pos, cos, sin, freq_turns, pos_offset, attention_factor, spec,
                             inverse)
    return (out, None) if k is None else out


class BoundRopeFunction(torch.autograd.Function):
    """RopeFunction for rope_ops.apply's cached autograd plans (eager, out of place): the forward
    and backward launchers come bound to the call kind's tables and constants, so a training
    step passes 5 arguments through autograd instead of 10."""

    @staticmethod
    def forward(ctx, q, k, pos, pos_offset, bound):
        q_out, k_out = bound[0](q, k, pos, pos_offset)
        ctx.save_for_backward(pos)  # version-checked: positions changed in place raise in backward
        ctx.pos_offset, ctx.bound = pos_offset, bound
        return q_out, k_out

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        (pos,) = ctx.saved_tensors
        grad_q, grad_k = _last_dim_contiguous(grad_q), _last_dim_contiguous(grad_k)
        if torch.is_grad_enabled():  # create_graph=True: record this rotation too
            back = (ctx.bound[1], ctx.bound[0])
            gq, gk = BoundRopeFunction.apply(grad_q, grad_k, pos, ctx.pos_offset, back)
        else:
            gq, gk = ctx.bound[1](grad_q, grad_k, pos, ctx.pos_offset)
        return gq, gk, None, None, None


def needs_check(backend: Backend, call) -> bool:
    """Whether this kind of call on this backend has yet to pass the first-call output check."""
    return not registry.is_builtin(backend.name) and (backend.name, call) not in _verified


def bind(backend: Backend, cos, sin, freq_turns, attention_factor, layout, rotary_dim, interleaved,
         inverse, call=None):
    """``(q, k, pos, pos_offset) -> (q_out, k_out)`` for repeated eager out-of-place calls of one
    kind (``inverse``: the backward): the backend's own bound launcher when it has one, else
    run_backend with these constants."""
    bound = backend.bind(cos, sin, freq_turns, attention_factor, layout, rotary_dim, interleaved,
                         inverse)
    if bound is not None:
        return bound

    def rotate_bound(q, k, pos, pos_offset):
        args = KernelArgs(q, k, None, None, pos, pos_offset, cos, sin, freq_turns,
                          attention_factor, layout, rotary_dim, interleaved, inverse, False)
        return run_backend(backend, args, call)

    return rotate_bound


# ---------------------------------------------------------------------------------------------
# The fused prologue (rope_ops.prologue): running a backend, and its ops for torch.compile.


def q_out_dtype(q_scale: float):
    """The prologue's q dtype when it is not qkv's: float8 e4m3 with a q scale."""
    return torch.float8_e4m3fn if q_scale > 0 else None


def run_prologue_backend(backend: Backend, args, call=None):
    """Run the prologue's forward on ``backend``; returns (q, k, v): new tensors out of place,
    views of qkv in place. Moves the version counters of what it wrote in place (qkv, caches)."""
    from .prologue import _inplace_views

    qkv = args.qkv
    hq, hk, d = args.num_q_heads, args.num_kv_heads, args.head_dim
    lead = tuple(qkv.shape[:-1])
    if args.inplace:
        outs = _inplace_views(qkv, args)
    else:
        outs = tuple(torch.empty(*lead, h, d, dtype=dtype, device=qkv.device)
                     for h, dtype in ((hq, q_out_dtype(args.q_scale) or qkv.dtype), (hk, qkv.dtype),
                                      (hk, qkv.dtype)))
        args = args._replace(q_out=outs[0], k_out=outs[1], v_out=outs[2])
    if qkv.numel() == 0:
        return outs
    backend.run_prologue(args)
    written = [t for t in ((qkv,) if args.inplace else ()) + (args.k_cache, args.v_cache) if t is not None]
    for t in written:
        if not t.is_inference():
            torch.autograd.graph.increment_version(t)
    if call is not None and not registry.is_builtin(backend.name) and (backend.name, call) not in _verified:
        for name, out, heads in (("q", outs[0], hq), ("k", outs[1], hk), ("v", outs[2], hk)):
            dtype = (q_out_dtype(args.q_scale) if name == "q" else None) or qkv.dtype
            if out.shape != lead + (heads, d) or out.dtype != dtype:
                raise BackendError(f"backend {backend.name!r} returned a {name} of shape "
                                   f"{list(out.shape)}, {out.dtype}")
        _verified.add((backend.name, call))
    return outs


def run_prologue_backward_backend(backend: Backend, args, grad_q, grad_k, grad_v, call=None):
    """The prologue's backward on ``backend``: (grad_qkv, grad_q_weight, grad_k_weight)."""
    if args.qkv.numel() == 0:
        d = args.head_dim
        return (torch.zeros_like(args.qkv),
                None if args.q_weight is None else torch.zeros(d, device=args.qkv.device),
                None if args.k_weight is None else torch.zeros(d, device=args.qkv.device))
    grad_qkv, grad_qw, grad_kw = backend.run_prologue_backward(args, grad_q, grad_k, grad_v)

    def like_weight(g, w):
        return None if w is None else g.to(w.dtype)

    return grad_qkv, like_weight(grad_qw, args.q_weight), like_weight(grad_kw, args.k_weight)


_PROLOGUE_ARGS = ("Tensor? pos, SymInt pos_offset, Tensor? cos, Tensor? sin, Tensor? freq_turns, "
                  "float attention_factor, str freqs, SymInt seq_len, str angles, int[] mrope_section, "
                  "bool mrope_interleaved, str layout, int num_q_heads, int num_kv_heads, int head_dim, "
                  "SymInt rotary_dim, bool interleaved, bool rotate, Tensor? q_weight, Tensor? k_weight, "
                  "float eps, float weight_offset")
_CACHE_ARGS = ("Tensor(c!)? k_cache, Tensor(d!)? v_cache, Tensor? slots, float k_scale, "
               "float v_scale, float q_scale, bool needs_grad, str backend")
_LIB.define(f"qkv_prologue(Tensor qkv, {_PROLOGUE_ARGS}, {_CACHE_ARGS}) -> (Tensor, Tensor, Tensor)")
_LIB.define(f"qkv_prologue_(Tensor(a!) qkv, {_PROLOGUE_ARGS}, {_CACHE_ARGS}) -> ()")
_LIB.define(f"qkv_prologue_backward(Tensor qkv, Tensor? grad_q, Tensor? grad_k, Tensor? grad_v, "
            f"{_PROLOGUE_ARGS}, str backend) -> (Tensor, Tensor, Tensor)")


def _prologue_args(qkv, inplace, pos, pos_offset, cos, sin, freq_turns, attention_factor, freqs,
                   seq_len, angles, mrope_section, mrope_interleaved, layout, hq, hk, head_dim,
                   rotary_dim, interleaved, rotate, q_weight, k_weight, eps, weight_offset,
                   k_cache=None, v_cache=None, slots=None, k_scale=1.0, v_scale=1.0, q_scale=0.0):
    from .backend import PrologueArgs

    cos, sin, freq_turns, attention_factor = tables_of(cos, sin, freq_turns, attention_factor, freqs,
                                                       seq_len, rotary_dim, qkv.device)
    return PrologueArgs(qkv, None, None, None, pos, pos_offset, cos, sin, freq_turns,
                        attention_factor, layout, hq, hk, head_dim, rotary_dim, interleaved, rotate,
                        q_weight, k_weight, eps, weight_offset, inplace, k_cache, v_cache, slots,
                        k_scale, v_scale, angles, tuple(mrope_section) or None, mrope_interleaved,
                        q_scale)


def _prologue_call(args, needs_grad):
    return RopeCall(args.qkv.device.type, args.qkv.dtype, args.layout,
                    "gptj" if args.interleaved else "neox", args.head_dim, args.rotary_dim,
                    args.num_q_heads, args.num_kv_heads, args.inplace,
                    None if args.pos is None else args.pos.dtype, args.rotate and args.freq_turns is None,
                    needs_grad, True, args.angles, args.cos.dtype, "prologue",
                    None if args.k_cache is None else args.k_cache.dtype,
                    q_out_dtype=q_out_dtype(args.q_scale))


def _run_prologue_op(inplace, qkv, *rest):
    *fields, needs_grad, request = rest
    args = _prologue_args(qkv, inplace, *fields)
    call = _prologue_call(args, needs_grad)
    return run_prologue_backend(_select.select(call, request), args, call)


@torch.library.impl(_LIB, "qkv_prologue", "CompositeExplicitAutograd")
def _qkv_prologue_kernel(qkv, *rest):
    q, k, v = _run_prologue_op(False, qkv, *rest)
    return q, k, v


@torch.library.register_fake("rope_ops::qkv_prologue")
def _qkv_prologue_fake(qkv, pos, pos_offset, cos, sin, freq_turns, attention_factor, freqs, seq_len,
                       angles, mrope_section, mrope_interleaved, layout, hq, hk, head_dim, *rest):
    lead = tuple(qkv.shape[:-1])
    q_scale = rest[-3]
    return (qkv.new_empty(*lead, hq, head_dim, dtype=q_out_dtype(q_scale) or qkv.dtype),
            qkv.new_empty(*lead, hk, head_dim), qkv.new_empty(*lead, hk, head_dim))


@torch.library.impl(_LIB, "qkv_prologue_", "CompositeExplicitAutograd")
def _qkv_prologue_inplace_kernel(qkv, *rest):
    _run_prologue_op(True, qkv, *rest)


@torch.library.register_fake("rope_ops::qkv_prologue_")
def _qkv_prologue_inplace_fake(qkv, *rest):
    return None


@torch.library.impl(_LIB, "qkv_prologue_backward", "CompositeExplicitAutograd")
def _qkv_prologue_backward_kernel(qkv, grad_q, grad_k, grad_v, *rest):
    *fields, request = rest
    args = _prologue_args(qkv, False, *fields)
    call = _prologue_call(args, True)
    grad_qkv, gqw, gkw = run_prologue_backward_backend(_select.select(call, request), args, grad_q,
                                                       grad_k, grad_v, call)
    empty = qkv.new_empty(0)
    return grad_qkv, empty if gqw is None else gqw, empty if gkw is None else gkw


@torch.library.register_fake("rope_ops::qkv_prologue_backward")
def _qkv_prologue_backward_fake(qkv, grad_q, grad_k, grad_v, pos, pos_offset, cos, sin, freq_turns,
                                attention_factor, freqs, seq_len, angles, mrope_section,
                                mrope_interleaved, layout, hq, hk, head_dim, rotary_dim, interleaved,
                                rotate, q_weight, k_weight, *rest):
    empty = qkv.new_empty(0)
    return (torch.empty_like(qkv), empty if q_weight is None else q_weight.new_empty(head_dim),
            empty if k_weight is None else k_weight.new_empty(head_dim))
