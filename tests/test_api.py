"""Public API beyond the conformance suite: helpers, caching, CLI, the op registration."""

import json
import subprocess
import sys

import pytest
import torch

import rope_ops
from rope_ops import RopeError
from rope_ops._reference import rope_reference


def test_positions_from_seqlens_and_cu_seqlens():
    expected = torch.tensor([0, 1, 2, 0, 0, 1, 2, 3])
    assert torch.equal(rope_ops.positions_from_seqlens([3, 1, 4]), expected)
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert torch.equal(rope_ops.positions_from_seqlens(cu_seqlens=cu), expected)
    with_start = rope_ops.positions_from_seqlens([3, 1, 4], start=[10, 0, 100], dtype=torch.int32)
    assert with_start.dtype == torch.int32
    assert with_start.tolist() == [10, 11, 12, 0, 100, 101, 102, 103]
    assert rope_ops.positions_from_seqlens([0, 2]).tolist() == [0, 1]
    with pytest.raises(RopeError):
        rope_ops.positions_from_seqlens([3], cu_seqlens=[0, 3])
    with pytest.raises(RopeError):
        rope_ops.positions_from_seqlens([3, 1], start=[1])


def test_varlen_packed_batch_matches_padded_batch():
    """Two sequences packed as thd rotate exactly as each one alone with an offset."""
    lengths, start = [5, 3], [0, 7]
    q = torch.randn(8, 4, 64)
    pos = rope_ops.positions_from_seqlens(lengths, start=start)
    packed, _ = rope_ops.apply(q, None, pos)
    first, _ = rope_ops.apply(q[None, :5], None, 0)
    second, _ = rope_ops.apply(q[None, 5:], None, 7)
    torch.testing.assert_close(packed, torch.cat([first[0], second[0]]), rtol=0, atol=0)


def test_seq_len_of():
    assert rope_ops.seq_len_of(torch.tensor([[3, 9], [1, 2]])) == 10
    with pytest.raises(RopeError):
        rope_ops.seq_len_of(5)


def test_apply_reuses_cached_tables():
    from rope_ops._tables import CACHE

    q = torch.randn(1, 3, 2, 48)
    rope_ops.apply(q, None, 0, base=1234.0)
    n, held = len(CACHE), CACHE.bytes_held()
    for offset in range(5):
        rope_ops.apply(q, None, offset, base=1234.0)
    assert len(CACHE) == n and CACHE.bytes_held() == held


def test_rotary_embedding_call_and_conflicts():
    rope = rope_ops.RotaryEmbedding(32, rotary_dim=16, base=500.0, max_position=10, style="gptj")
    q = torch.randn(2, 4, 3, 32, dtype=torch.float64)
    out, _ = rope(q, None, torch.tensor([0, 1, 50, 3]))
    ref = rope_reference(q, torch.tensor([0, 1, 50, 3]), layout="bshd", rotary_dim=16, style="gptj",
                         inv_freq=rope.inv_freq)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    with pytest.raises(RopeError, match="rope="):
        rope_ops.apply(q, None, 0, rope=rope, base=10.0)
    with pytest.raises(RopeError, match="head_dim"):
        rope_ops.apply(q[..., :16], None, 0, rope=rope)
    assert "gptj" in repr(rope)


def test_attention_factor_scales_q_and_k():
    scaling = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64}
    rope = rope_ops.RotaryEmbedding(64, scaling=scaling, max_position=1024)
    assert rope.attention_factor > 1.2
    q = torch.randn(1, 1, 1, 64, dtype=torch.float64)
    out, kout = rope_ops.apply(q, q.clone(), 0, rope=rope)
    # At position 0 the rotation is the identity, so the output is m * x.
    torch.testing.assert_close(out, q * rope.attention_factor)
    torch.testing.assert_close(kout, q * rope.attention_factor)


def test_inplace_on_leaf_requiring_grad_is_refused():
    q = torch.randn(1, 2, 2, 8, requires_grad=True)
    with pytest.raises(RopeError, match="leaf"):
        rope_ops.apply(q, None, 0, inplace=True)


def test_inplace_disjoint_views_of_one_tensor_are_allowed():
    qkv = torch.randn(6, 4 + 2 + 2, 32)
    q, k = qkv[:, :4], qkv[:, 4:6]
    v_before = qkv[:, 6:].clone()
    rope_ops.apply(q, k, torch.arange(6), inplace=True)
    assert torch.equal(qkv[:, 6:], v_before)
    with pytest.raises(RopeError, match="overlap"):
        rope_ops.apply(qkv[:, :4], qkv[:, 3:5], torch.arange(6), inplace=True)
    expanded = torch.randn(1, 1, 4, 32).expand(2, 3, 4, 32)
    with pytest.raises(RopeError, match="overlap"):
        rope_ops.apply(expanded, None, 0, inplace=True)


def test_op_tables_from_text_when_traced_calls_have_none():
    """A traced call without tables passes the op its frequency parameters as text; the op
    builds (or finds) the tables when it runs, equal to the eager call's."""
    from rope_ops._tables import freqs_spec

    q = torch.randn(2, 5, 4, 16)
    pos = torch.randint(0, 100, (2, 5))
    spec = freqs_spec(777.0, None, 64, 64)
    got_q, _ = torch.ops.rope_ops.rope(q, None, pos, 0, None, None, None, 1.0, spec, -1, "bshd", 16,
                                       False, False, "table", [], False, False, "torch")
    want, _ = rope_ops.apply(q, None, pos, base=777.0, max_position=64, backend="torch")
    assert torch.equal(got_q, want)


def test_op_registration_passes_opcheck():
    q, k = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16)
    pos = torch.randint(0, 40, (2, 5))
    rope = rope_ops.RotaryEmbedding(16, max_position=32)
    cos, sin, turns, factor = rope.tables(torch.device("cpu"))
    torch.library.opcheck(torch.ops.rope_ops.rope.default,
                          (q, k, pos, 0, cos, sin, turns, factor, "", -1, "bshd", 16, False, False, "table",
                           [], False, False, "torch"))
    torch.library.opcheck(torch.ops.rope_ops.rope.default,
                          (q, None, None, 3, cos, sin, None, 1.0, "", -1, "bshd", 16, True, True, "table", [],
                           False, True, "torch"))
    torch.library.opcheck(torch.ops.rope_ops.rope_.default,
                          (q.clone(), k.clone(), pos, 0, cos, sin, turns, factor, "", -1, "bshd", 16,
                           False, True, "table", [], False, False, "torch"))


def test_fast_path_repeats_checks_that_depend_on_values():
    """Repeated calls reuse a plan keyed by metadata; what depends on values is still checked."""
    from rope_ops import _plans

    q = torch.randn(2, 3, 4, 16)
    rope_ops.apply(q, None, 5)
    assert any(key[0] == q.shape for key in _plans.FUNCTIONAL._plans)
    with pytest.raises(RopeError, match="offset"):
        rope_ops.apply(q, None, 2**63)
    out, _ = rope_ops.apply(q, None, 7)  # a different offset through the same plan is honoured
    ref = rope_reference(q, 7, layout="bshd", rotary_dim=16, style="neox",
                         inv_freq=rope_ops.RotaryEmbedding(16).inv_freq)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
    with pytest.raises(RopeError, match="pos"):
        rope_ops.apply(q, None, torch.arange(3.0))


def test_autograd_calls_reuse_a_plan_and_follow_grad_mode():
    """Autograd calls get their own cached plan (forward and backward bound once); gradients stay
    those of the float64 reference, and the same shapes without a gradient (no_grad, or inputs
    that do not require grad) take the inference plan and record nothing."""
    from rope_ops import _select

    _select.clear_cache()
    rope = rope_ops.RotaryEmbedding(32, rotary_dim=24, base=10000.0, style="gptj")
    gen = torch.Generator().manual_seed(3)
    q0 = torch.randn(2, 5, 4, 32, generator=gen, dtype=torch.float64)
    k0 = torch.randn(2, 5, 2, 32, generator=gen, dtype=torch.float64)
    pos = torch.randint(0, 100, (2, 5), generator=gen)
    gq, gk = torch.randn_like(q0), torch.randn_like(k0)
    want_q = rope_reference(gq, pos, layout="bshd", rotary_dim=24, style="gptj", inv_freq=rope.inv_freq,
                            inverse=True)
    want_k = rope_reference(gk, pos, layout="bshd", rotary_dim=24, style="gptj", inv_freq=rope.inv_freq,
                            inverse=True)
    for step in range(3):  # the first call plans, the others reuse the plan
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_(step != 1)
        qo, ko = rope_ops.apply(q, k, pos, rope=rope)
        assert qo.grad_fn is not None and ko.grad_fn is not None
        torch.autograd.backward((qo, ko), (gq, gk))
        torch.testing.assert_close(q.grad, want_q, rtol=0, atol=1e-6)  # float32 tables
        if step != 1:
            torch.testing.assert_close(k.grad, want_k, rtol=0, atol=1e-6)
        else:
            assert k.grad is None
    grad_keys = [key for key in rope._plans if key[0] == q0.shape and key[-1]]
    assert len(grad_keys) == 1, grad_keys  # k requiring grad or not: the same autograd plan
    with torch.no_grad():
        qo, ko = rope_ops.apply(q, k, pos, rope=rope)
    assert qo.grad_fn is None and not qo.requires_grad
    qo2, _ = rope_ops.apply(q0, k0, pos, rope=rope)
    assert qo2.grad_fn is None
    torch.testing.assert_close(qo, qo2, rtol=0, atol=0)
    assert any(key[0] == q0.shape and not key[-1] for key in rope._plans)


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd", "thd"])
def test_inplace_head_slices_of_one_packed_tensor_in_every_layout(layout):
    """q and k as slices of one tensor along its heads axis are disjoint in every layout (the
    overlap check follows the heads axis, wherever the layout puts it); overlapping slices and
    slices along another axis that interleave are refused."""
    shape = {"bshd": (2, 5, 8, 16), "sbhd": (5, 2, 8, 16), "bhsd": (2, 8, 5, 16), "thd": (5, 8, 16)}[layout]
    axis = {"bshd": 2, "sbhd": 2, "bhsd": 1, "thd": 1}[layout]
    packed = torch.randn(shape)
    q, k = packed.narrow(axis, 0, 4), packed.narrow(axis, 4, 2)
    pos = 0
    before = packed.clone()
    rope_ops.apply(q, k, pos, layout=layout, inplace=True)
    want_q, want_k = rope_ops.apply(before.narrow(axis, 0, 4), before.narrow(axis, 4, 2), pos, layout=layout)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(packed.narrow(axis, 6, 2), before.narrow(axis, 6, 2))
    with pytest.raises(RopeError, match="overlap"):
        rope_ops.apply(packed.narrow(axis, 0, 4), packed.narrow(axis, 3, 2), pos, layout=layout, inplace=True)


def test_overlap_is_judged_by_address_across_storages():
    """numpy views of one buffer are separate torch storages over the same bytes."""
    np = pytest.importorskip("numpy")
    base = np.random.randn(2, 3, 8, 16).astype(np.float32)
    q = torch.from_numpy(base[:, :, :4])
    k = torch.from_numpy(base[:, :, 3:5])
    before = base.copy()
    with pytest.raises(RopeError, match="overlap"):
        rope_ops.apply(q, k, 0, inplace=True)
    assert (base == before).all()
