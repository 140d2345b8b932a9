"""RotaryEmbedding as a torch.nn.Module, and the call forms other libraries' users bring."""

import subprocess
import sys

import pytest
import torch

import rope_ops
from rope_ops import RopeError
from rope_ops._reference import rope_reference


def test_rotary_embedding_is_a_module_with_derived_buffers():
    rope = rope_ops.RotaryEmbedding(64, max_position=128)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.rope = rope
    assert any(m is rope for m in model.modules())
    names = dict(rope.named_buffers())
    assert set(names) == {"cos_table", "sin_table", "freq_turns"}
    assert rope.state_dict() == {}  # derived from the arguments: never saved with a model
    assert "rope_type='default'" in repr(rope)


def test_dtype_casts_keep_tables_exact():
    rope = rope_ops.RotaryEmbedding(64, max_position=128)
    cos = rope.cos_table.clone()
    for cast in (torch.nn.Module.half, torch.nn.Module.bfloat16, torch.nn.Module.double):
        cast(rope)
        assert rope.cos_table.dtype == torch.float32 and rope.freq_turns.dtype == torch.int64
        assert torch.equal(rope.cos_table, cos)
    q = torch.randn(1, 3, 2, 64, dtype=torch.float64)
    out, _ = rope(q, None, torch.tensor([1, 50, 127]))
    ref = rope_reference(q, torch.tensor([1, 50, 127]), layout="bshd", rotary_dim=64, style="neox",
                         inv_freq=rope.inv_freq)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


def test_to_device_moves_tables_and_drops_plans():
    rope = rope_ops.RotaryEmbedding(32, max_position=16)
    q = torch.randn(1, 3, 2, 32)
    rope(q, None, 0)
    assert rope._plans
    rope.to("meta")
    assert rope.cos_table.device.type == "meta" and not rope._plans
    rope.to_empty(device="cpu")  # as a model initialised on meta is materialised: rebuilt exactly
    out, _ = rope(q, None, 0)
    ref = rope_reference(q, 0, layout="bshd", rotary_dim=32, style="neox", inv_freq=rope.inv_freq)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)


def test_positions_one_by_s_broadcast_over_the_batch():
    """HF passes position_ids [1, S] for a batch of B."""
    q, k = torch.randn(3, 5, 4, 32), torch.randn(3, 5, 2, 32)
    pos = torch.tensor([[4, 9, 1, 0, 30]])
    q_out, k_out = rope_ops.apply(q, k, pos)
    expected, _ = rope_ops.apply(q, k, pos.expand(3, 5).contiguous())
    assert torch.equal(q_out, expected)
    with pytest.raises(RopeError, match="pos"):
        rope_ops.apply(q, k, torch.zeros(2, 5, dtype=torch.int64))


def test_two_dimensional_heads_flattened_with_head_dim():
    """vLLM's form: q [T, Hq*D], k [T, Hk*D], positions [T]."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(7, 4 * 32, generator=gen), torch.randn(7, 2 * 32, generator=gen)
    pos = torch.randint(0, 100, (7,), generator=gen)
    q_out, k_out = rope_ops.apply(q, k, pos, head_dim=32)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    want_q, want_k = rope_ops.apply(q.view(7, 4, 32), k.view(7, 2, 32), pos)
    assert torch.equal(q_out, want_q.flatten(-2)) and torch.equal(k_out, want_k.flatten(-2))
    q2 = q.clone()
    rope_ops.apply(q2, None, pos, head_dim=32, inplace=True)
    assert torch.equal(q2, want_q.flatten(-2))
    for bad in ({"head_dim": 30}, {"head_dim": 0}, {"head_dim": 32, "layout": "bshd"}):
        with pytest.raises(RopeError, match="head_dim"):
            rope_ops.apply(q, k, pos, **bad)


@pytest.mark.parametrize("kwargs, named", [
    ({"cu_seqlens": [0, 5, 3]}, "cu_seqlens"),
    ({"cu_seqlens": [1, 5]}, "cu_seqlens"),
    ({"seqlens": [3, -1]}, "seqlens"),
    ({"seqlens": [1.5, 2]}, "seqlens"),
    ({"seqlens": [[1, 2]]}, "seqlens"),
    ({"seqlens": [1, 2], "start": [0.5, 1]}, "start"),
    ({"seqlens": [1, 2], "dtype": torch.float32}, "dtype"),
])
def test_positions_from_seqlens_validates(kwargs, named):
    with pytest.raises(RopeError, match=named):
        rope_ops.positions_from_seqlens(**kwargs)


def test_caller_table_width_sets_rotary_dim_and_must_agree():
    cos, sin = torch.rand(10, 8), torch.rand(10, 8)
    q = torch.randn(1, 4, 2, 32)
    out, _ = rope_ops.apply(q, None, 0, cos_sin=(cos, sin))
    assert torch.equal(out[..., 16:], q[..., 16:])  # rotary_dim = 2 * width: partial rotary
    with pytest.raises(RopeError, match="cos_sin"):
        rope_ops.apply(q, None, 0, cos_sin=(cos, sin), rotary_dim=32)


def test_conformance_suite_with_an_unknown_backend_is_one_usage_error():
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--pyargs", "rope_ops.testing",
                          "--rope-backend", "nonsense", "-p", "no:cacheprovider"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 4, out.stdout[-2000:]  # pytest's usage-error exit code
    text = out.stdout + out.stderr
    assert text.count("no such rope_ops backend") == 1 and "registered" in text


def test_positions_one_by_s_on_repeats_of_every_backend_kind():
    """[1, S] positions keep working when a call kind repeats through its cached plan."""
    rope = rope_ops.RotaryEmbedding(16, max_position=64)
    q, k = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16)
    pos = torch.arange(9)[None]
    first = rope_ops.apply(q, k, pos, rope=rope, layout="bhsd")
    for _ in range(3):
        again = rope_ops.apply(q, k, pos, rope=rope, layout="bhsd")
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])
