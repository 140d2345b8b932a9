"""Conformance tests of training and memory: in place under autograd, version counters, what
must be refused before anything is written, aliasing, second derivatives, references held.

Mixed into ``RopeConformance`` (its fixtures ``backend_name``, ``backend_obj``, ``device``).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import rope_ops
from rope_ops import RopeError

from .._reference import rope_reference
from .checks import assert_bitwise_equal, assert_rope_close

_HEADS_AXIS = {"bshd": 2, "thd": 1}


def _dtype_for(backend_obj) -> torch.dtype:
    return torch.float64 if torch.float64 in backend_obj.dtypes else torch.float32


def _packed(layout: str, heads: int, dtype, device, gen) -> torch.Tensor:
    shape = (2, 5, heads, 32) if layout == "bshd" else (9, heads, 32)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype).to(device)


class TrainingTests:
    """In place, autograd and memory, held to every backend."""

    @pytest.mark.parametrize("layout", ["bshd", "thd"])
    @pytest.mark.parametrize("with_k", [True, False], ids=["q_and_k", "q_only"])
    def test_inplace_packed_qkv_in_training(self, backend_name, backend_obj, device, layout, with_k):
        """The fused-QKV pattern: q and k are slices of the QKV projection's output, which
        requires grad; rotating them in place works and gives the reference gradients."""
        if not (backend_obj.supports_backward and backend_obj.supports_inplace):
            pytest.skip("backend has no backward or no in place")
        dtype = _dtype_for(backend_obj)
        gen = torch.Generator().manual_seed(21)
        hq, hk = 4, 2
        weight = _packed(layout, hq + 2 * hk, dtype, device, gen).requires_grad_(True)
        axis = _HEADS_AXIS[layout]
        rope = rope_ops.RotaryEmbedding(32, rotary_dim=24, max_position=16)
        n_tok = weight.shape[1] if layout == "bshd" else weight.shape[0]
        pos = torch.randint(0, 40, (n_tok,), generator=gen).to(device)  # past the table too
        qkv = weight * 1.0  # a non-leaf that requires grad, like a Linear's output
        q, k = qkv.narrow(axis, 0, hq), qkv.narrow(axis, hq, hk)
        q_out, k_out = rope_ops.apply(q, k if with_k else None, pos, rope=rope, inplace=True,
                                      layout=layout, backend=backend_name)
        assert q_out is q and (k_out is k if with_k else k_out is None)
        grad_out = _packed(layout, hq + 2 * hk, dtype, device, gen)
        qkv.backward(grad_out)
        # d qkv / d weight is the identity outside the rotated heads, the inverse rotation inside
        expected = grad_out.detach().to("cpu", torch.float64).clone()
        for start, count in ((0, hq), (hq, hk)) if with_k else ((0, hq),):
            part = grad_out.narrow(axis, start, count)
            expected.narrow(axis, start, count).copy_(rope_reference(
                part, pos, layout=layout, rotary_dim=24, style="neox", inv_freq=rope.inv_freq,
                inverse=True))
        assert_rope_close(weight.grad, expected, grad_out, rotary_dim=32, style="neox",
                          what="gradient of the packed QKV tensor")

    def test_inplace_write_is_visible_to_autograd(self, backend_name, backend_obj, device):
        """A tensor saved for backward and then rotated in place must make backward raise, as
        any in-place op does (the version counter moves), not give a wrong gradient."""
        if not backend_obj.supports_inplace:
            pytest.skip("backend has no in place")
        dtype = _dtype_for(backend_obj)
        x = torch.randn(2, 3, 4, 16, dtype=dtype, device=device, requires_grad=True)
        q = x * 1.0
        saved_by_mul = q * q  # saves q for its backward
        version = q._version
        rope_ops.apply(q, None, 7, inplace=True, backend=backend_name)
        assert q._version > version, "the in-place write did not move q's version counter"
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved_by_mul.sum().backward()

    @pytest.mark.parametrize("what", ["split_view", "no_grad_view", "leaf", "view_of_leaf"])
    def test_inplace_autograd_cannot_take_is_refused_before_writing(self, backend_name, backend_obj,
                                                                     device, what):
        if not backend_obj.supports_inplace:
            pytest.skip("backend has no in place")
        dtype = _dtype_for(backend_obj)
        leaf = torch.randn(2, 3, 8, 16, dtype=dtype, device=device, requires_grad=True)
        base = leaf * 1.0
        if what == "split_view":
            q, k, _ = base.split([4, 2, 2], dim=2)
        elif what == "no_grad_view":
            with torch.no_grad():
                q, k = base[:, :, :4], base[:, :, 4:6]
        elif what == "leaf":
            q, k = leaf, None
        else:
            q, k = leaf[:, :, :4], leaf[:, :, 4:6]
        before = leaf.detach().clone(), base.detach().clone()
        with pytest.raises(RopeError):
            rope_ops.apply(q, k, 0, inplace=True, backend=backend_name)
        assert_bitwise_equal(leaf.detach(), before[0], "input after a refused in-place call")
        assert_bitwise_equal(base.detach(), before[1], "input after a refused in-place call")

    def test_inplace_on_inference_tensors(self, backend_name, backend_obj, device):
        """Outside inference mode an inference tensor cannot be written in place: RopeError
        before writing; inside inference mode it works."""
        if not backend_obj.supports_inplace:
            pytest.skip("backend has no in place")
        dtype = _dtype_for(backend_obj)
        with torch.inference_mode():
            q = torch.randn(2, 3, 4, 16, dtype=dtype, device=device)
            k = torch.randn(2, 3, 2, 16, dtype=dtype, device=device)
        q_before, k_before = q.clone(), k.clone()
        with pytest.raises(RopeError, match="inference"):
            rope_ops.apply(q, k, 3, inplace=True, backend=backend_name)
        assert_bitwise_equal(q, q_before, "q after a refused call")
        assert_bitwise_equal(k, k_before, "k after a refused call")
        with torch.inference_mode():
            rope_ops.apply(q, k, 3, inplace=True, backend=backend_name)
        ref = rope_reference(q_before, 3, layout="bshd", rotary_dim=16, style="neox",
                             inv_freq=rope_ops.RotaryEmbedding(16).inv_freq)
        assert_rope_close(q, ref, q_before, rotary_dim=16, style="neox", what="q in inference mode")

    def test_inplace_overlap_is_judged_by_address(self, backend_name, backend_obj, device):
        """Two tensors over different storage objects that share bytes (as DLPack or numpy views
        give) overlap: refused in place; disjoint slices of one buffer are fine."""
        if not backend_obj.supports_inplace:
            pytest.skip("backend has no in place")
        dtype = _dtype_for(backend_obj)
        buf = torch.randn(2, 3, 8, 16, dtype=dtype, device=device)
        q = buf[:, :, :4]
        k = torch.from_dlpack(buf[:, :, 3:5])  # its own storage object, over q's last head
        assert k.untyped_storage() is not q.untyped_storage()
        before = buf.clone()
        with pytest.raises(RopeError, match="overlap"):
            rope_ops.apply(q, k, 0, inplace=True, backend=backend_name)
        assert_bitwise_equal(buf, before, "buffer after a refused call")
        rope_ops.apply(q, torch.from_dlpack(buf[:, :, 4:6]), 0, inplace=True, backend=backend_name)

    def test_second_derivatives(self, backend_name, backend_obj, device):
        """The backward is differentiable: with create_graph=True, the gradient of a gradient
        equals the float64 reference (a backward without a graph would make it zero or fail)."""
        if not backend_obj.supports_backward:
            pytest.skip("backend has no backward")
        dtype = _dtype_for(backend_obj)
        gen = torch.Generator().manual_seed(23)
        rope = rope_ops.RotaryEmbedding(16, rotary_dim=12, max_position=32)
        pos = torch.randint(0, 60, (2, 3), generator=gen).to(device)

        def rand(*shape):
            return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)

        q = rand(2, 3, 4, 16).requires_grad_(True)
        w, v = rand(2, 3, 4, 16), rand(2, 3, 4, 16)
        out, _ = rope_ops.apply(q, None, pos, rope=rope, backend=backend_name)
        (g,) = torch.autograd.grad((out * out * w).sum(), q, create_graph=True)
        (h,) = torch.autograd.grad((g * v).sum(), q)

        def ref(x, inverse=False):
            return rope_reference(x, pos, layout="bshd", rotary_dim=12, style="neox",
                                  inv_freq=rope.inv_freq, inverse=inverse)

        # g = R^T (2 w * R q), so dg/dq . v = R^T (2 w * R v)
        inner = 2 * w.to("cpu", torch.float64) * ref(v)
        expected = ref(inner, inverse=True)
        tolerance = 1e-5 if dtype == torch.float64 else 1e-4  # float32 tables: ~1e-7 per rotation
        torch.testing.assert_close(h.to("cpu", torch.float64), expected, rtol=tolerance,
                                   atol=tolerance)

    def test_holds_no_reference_to_inputs_or_outputs(self, backend_name, backend_obj, device):
        """After a call (plans cached included) nothing keeps the caller's tensors alive."""
        dtype = next(d for d in (torch.bfloat16, torch.float32, torch.float64) if d in backend_obj.dtypes)
        rope = rope_ops.RotaryEmbedding(32, max_position=16)
        refs = []
        for _ in range(3):
            q = torch.randn(2, 3, 4, 32, device=device).to(dtype)
            k = torch.randn(2, 3, 2, 32, device=device).to(dtype)
            pos = torch.arange(3, device=device)
            q_out, k_out = rope_ops.apply(q, k, pos, rope=rope, backend=backend_name)
            refs += [weakref.ref(t) for t in (q, k, pos, q_out, k_out)]
            del q, k, pos, q_out, k_out
        gc.collect()
        alive = sum(r() is not None for r in refs)
        assert alive == 0, f"{alive} of {len(refs)} tensors kept alive after the calls"

    def test_rotary_embedding_is_not_kept_alive(self, backend_name, backend_obj, device):
        """A RotaryEmbedding used for calls (and its tables) is freed when the caller drops it."""
        dtype = next(d for d in (torch.bfloat16, torch.float32, torch.float64) if d in backend_obj.dtypes)
        rope = rope_ops.RotaryEmbedding(32, max_position=64, device=device)
        q = torch.randn(2, 3, 4, 32, device=device).to(dtype)
        for _ in range(3):
            rope_ops.apply(q, None, 0, rope=rope, backend=backend_name)
        table = weakref.ref(rope.cos_table)
        module = weakref.ref(rope)
        del rope
        gc.collect()
        assert module() is None and table() is None
