"""torch.library registration of the op, and autograd.

The op schema is defined once here, backend-agnostic; its one kernel (CompositeExplicitAutograd,
every device) runs the backend named in the call, and a fake kernel gives torch.compile the
output metadata. Autograd lives in an ``autograd.Function`` outside the op, whose backward is the
same op with ``inverse=True`` (RotaryEmbeddingGrad).

Host cost: going through the dispatcher costs several microseconds per call (measured in
BENCHMARKS.md), a large share of the 15 us budget of a decode step, so eager calls run the
backend directly and only traced code (torch.compile) goes through ``torch.ops.rope_ops``. Both
paths run the same ``run_backend``.
"""

from __future__ import annotations

import torch

from . import registry
from ._memory import check_inplace_memory
from .backend import KernelArgs
from .embedding import rope_by_key

_LIB = torch.library.Library("rope_ops", "DEF")  # kept alive for the life of the process
# The frequencies travel as ``rope_key`` (a RotaryEmbedding registered by key, whose tables are
# fetched for the tensors' device at run time), or as caller tables cos/sin (then rope_key is "").
_LIB.define(
    "rope(Tensor q, Tensor? k, Tensor? pos, SymInt pos_offset, Tensor? cos, Tensor? sin, "
    "str rope_key, str layout, int rotary_dim, bool interleaved, bool inverse, str backend) "
    "-> (Tensor, Tensor)")
_LIB.define(
    "rope_(Tensor(a!) q, Tensor(b!)? k, Tensor? pos, SymInt pos_offset, Tensor? cos, Tensor? sin, "
    "str rope_key, str layout, int rotary_dim, bool interleaved, str backend) -> ()")


def _tables(q, cos, sin, rope_key):
    """(cos, sin, freq_turns, attention_factor) for the call."""
    if cos is not None:
        return cos, sin, None, 1.0
    rope = rope_by_key(rope_key)
    cos, sin, freq_turns = rope.tables(q.device)
    return cos, sin, freq_turns, rope.attention_factor


def run_backend(backend_name, q, k, pos, pos_offset, cos, sin, freq_turns, attention_factor, layout,
                rotary_dim, interleaved, inverse, inplace, separate_outputs=False):
    """Run the backend (a name, or the object itself on the eager path), allocating outputs out
    of place unless it does so itself (``separate_outputs``: always here, one storage each; a
    backend may put both in one allocation). Returns (q_out, k_out)."""
    backend = registry.get(backend_name) if isinstance(backend_name, str) else backend_name
    if inplace:
        q_out, k_out = q, k
    elif backend.allocates_outputs and not separate_outputs:
        q_out = k_out = None
    else:
        q_out = torch.empty_like(q)
        k_out = None if k is None else torch.empty_like(k)
    if 0 in q.shape and (k is None or 0 in k.shape):
        if q_out is None:
            q_out, k_out = torch.empty_like(q), (None if k is None else torch.empty_like(k))
        return q_out, k_out
    made = backend.run(KernelArgs(q, k, q_out, k_out, pos, pos_offset, cos, sin, freq_turns,
                                  attention_factor, layout, rotary_dim, interleaved, inverse, inplace))
    return (q_out, k_out) if q_out is not None else made


def bind(backend, cos, sin, freq_turns, attention_factor, layout, rotary_dim, interleaved, inverse):
    """``(q, k, pos, pos_offset) -> (q_out, k_out)`` for repeated eager out-of-place calls of one
    kind (``inverse``: the backward): the backend's own bound launcher when it has one, else
    run_backend with these constants."""
    bound = backend.bind(cos, sin, freq_turns, attention_factor, layout, rotary_dim, interleaved,
                         inverse)
    if bound is not None:
        return bound

    def rotate(q, k, pos, pos_offset):
        return run_backend(backend, q, k, pos, pos_offset, cos, sin, freq_turns, attention_factor,
                           layout, rotary_dim, interleaved, inverse, False)

    return rotate


@torch.library.impl(_LIB, "rope", "CompositeExplicitAutograd")
def _rope_kernel(q, k, pos, pos_offset, cos, sin, rope_key, layout, rotary_dim, interleaved, inverse,
                 backend):
    # A custom op's returns may not share storage with each other (torch.compile checks; an error
    # in future torch), and a backend may pair small outputs in one allocation: allocate here.
    q_out, k_out = run_backend(backend, q, k, pos, pos_offset, *_tables(q, cos, sin, rope_key), layout,
                               rotary_dim, interleaved, inverse, False, separate_outputs=True)
    return q_out, (q.new_empty(0) if k_out is None else k_out)


@torch.library.register_fake("rope_ops::rope")
def _rope_fake(q, k, pos, pos_offset, cos, sin, rope_key, layout, rotary_dim, interleaved, inverse,
               backend):
    return torch.empty_like(q), (q.new_empty(0) if k is None else torch.empty_like(k))


@torch.library.impl(_LIB, "rope_", "CompositeExplicitAutograd")
def _rope_inplace_kernel(q, k, pos, pos_offset, cos, sin, rope_key, layout, rotary_dim, interleaved,
                         backend):
    check_inplace_memory(q, k)  # traced calls could not check before (no data pointers)
    run_backend(backend, q, k, pos, pos_offset, *_tables(q, cos, sin, rope_key), layout, rotary_dim,
                interleaved, False, True)


@torch.library.register_fake("rope_ops::rope_")
def _rope_inplace_fake(q, k, pos, pos_offset, cos, sin, rope_key, layout, rotary_dim, interleaved,
                       backend):
    return None


def rope_call(backend, q, k, pos, pos_offset, cos, sin, freq_turns, attention_factor, rope_key,
              layout, rotary_dim, interleaved, inverse, inplace):
    """The op, direct in eager mode and through torch.ops when traced. Returns (q_out, k_out).

    Eager callers pass the tables; traced callers pass caller tables or only ``rope_key``.
    """
    if not torch.compiler.is_compiling():
        if cos is None:
            cos, sin, freq_turns, attention_factor = _tables(q, None, None, rope_key)
        return run_backend(backend, q, k, pos, pos_offset, cos, sin, freq_turns, attention_factor,
                           layout, rotary_dim, interleaved, inverse, inplace)
    if freq_turns is not None:  # builtin tables: let the op fetch them by key
        cos = sin = None
    if inplace:
        torch.ops.rope_ops.rope_(q, k, pos, pos_offset, cos, sin, rope_key, layout, rotary_dim,
                                 interleaved, backend)
        return q, k
    q_out, k_out = torch.ops.rope_ops.rope(q, k, pos, pos_offset, cos, sin, rope_key, layout,
                                           rotary_dim, interleaved, inverse, backend)
    return q_out, (None if k is None else k_out)


def _last_dim_contiguous(grad):
    """Output gradients as the backends take them (stride 1 on head_dim); None stays None."""
    if grad is not None and grad.stride(-1) != 1:
        return grad.contiguous()
    return grad


class RopeFunction(torch.autograd.Function):
    """Forward RotaryEmbedding; backward RotaryEmbeddingGrad (rotation by minus the angle)."""

    @staticmethod
    def forward(ctx, q, k, pos, pos_offset, cos, sin, freq_turns, attention_factor, rope_key, layout,
                rotary_dim, interleaved, inplace, backend):
        q_out, k_out = rope_call(backend, q, k, pos, pos_offset, cos, sin, freq_turns,
                                 attention_factor, rope_key, layout, rotary_dim, interleaved, False,
                                 inplace)
        ctx.save_for_backward(pos, cos, sin, freq_turns)
        ctx.params = (pos_offset, attention_factor, rope_key, layout, rotary_dim, interleaved, backend)
        if inplace:
            ctx.mark_dirty(*(t for t in (q, k) if t is not None))
        return q_out, k_out

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        pos, cos, sin, freq_turns = ctx.saved_tensors
        pos_offset, attention_factor, rope_key, layout, rotary_dim, interleaved, backend = ctx.params
        # Autograd materializes unused output gradients as zeros, so grad_q is never None.
        gq, gk = rope_call(backend, _last_dim_contiguous(grad_q), _last_dim_contiguous(grad_k), pos,
                           pos_offset, cos, sin, freq_turns, attention_factor, rope_key, layout,
                           rotary_dim, interleaved, True, False)
        return gq, gk, None, None, None, None, None, None, None, None, None, None, None, None


class BoundRopeFunction(torch.autograd.Function):
    """RopeFunction for rope_ops.apply's cached autograd plans (eager, out of place): the forward
    and backward launchers come bound to the call kind's tables and constants (``bind``), so a
    training step passes 5 arguments through autograd instead of 14."""

    @staticmethod
    def forward(ctx, q, k, pos, pos_offset, bound):
        q_out, k_out = bound[0](q, k, pos, pos_offset)
        ctx.save_for_backward(pos)  # version-checked: positions changed in place raise in backward
        ctx.pos_offset, ctx.rotate_back = pos_offset, bound[1]
        return q_out, k_out

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        (pos,) = ctx.saved_tensors
        gq, gk = ctx.rotate_back(_last_dim_contiguous(grad_q), _last_dim_contiguous(grad_k), pos,
                                 ctx.pos_offset)
        return gq, gk, None, None, None
