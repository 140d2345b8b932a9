"""The pure-torch backend rotates large CPU calls in slices of tokens (backends/torch_backend.py):
with a tiny slice budget every call below is cut into many slices, uneven last one included, and
must still match the float64 reference, forward and backward, in and out of place."""

from __future__ import annotations

import pytest
import torch

import rope_ops
import rope_ops_backends.torch_backend as torch_backend
from rope_ops._reference import rope_reference
from rope_ops.testing.checks import assert_rope_close

SHAPES = {"bshd": (2, 13, 3, 64), "sbhd": (13, 2, 3, 64), "bhsd": (2, 3, 13, 64), "thd": (29, 3, 64)}


@pytest.fixture
def small_slices(monkeypatch):
    # a token is 96-192 rotary elements here (B <= 2, 3 heads, 32 dims): one token per slice
    monkeypatch.setattr(torch_backend, "_CPU_CHUNK_ELEMENTS", 100)


@pytest.mark.parametrize("layout", sorted(SHAPES))
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_rotation_matches_reference(small_slices, layout, style, inplace, dtype):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(SHAPES[layout], generator=gen).to(dtype)
    k = torch.randn(SHAPES[layout], generator=gen).to(dtype)
    seq = SHAPES[layout][{"bshd": 1, "sbhd": 0, "bhsd": 2, "thd": 0}[layout]]
    pos = torch.randint(0, 5000, (seq,), generator=gen)
    rope = rope_ops.RotaryEmbedding(64, rotary_dim=32, base=10000.0, max_position=4096, style=style)
    q_in, k_in = q.clone(), k.clone()
    q_out, k_out = rope_ops.apply(q, k, pos, rope=rope, layout=layout, inplace=inplace,
                                  backend="torch")
    for out, x in ((q_out, q_in), (k_out, k_in)):
        ref = rope_reference(x, pos, layout=layout, rotary_dim=32, style=style,
                             inv_freq=rope.inv_freq, attention_factor=rope.attention_factor)
        assert_rope_close(out, ref, x, rotary_dim=32, style=style)


def test_sliced_backward_matches_reference(small_slices):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 13, 3, 64, generator=gen, requires_grad=True)
    grad = torch.randn(2, 13, 3, 64, generator=gen)
    pos = torch.arange(13) + 4090  # crosses the end of the table
    rope = rope_ops.RotaryEmbedding(64, rotary_dim=32, base=10000.0, max_position=4096)
    q_out, _ = rope_ops.apply(q, None, pos, rope=rope, backend="torch")
    q_out.backward(grad)
    ref = rope_reference(grad, pos, layout="bshd", rotary_dim=32, style="neox",
                         inv_freq=rope.inv_freq, attention_factor=rope.attention_factor, inverse=True)
    assert_rope_close(q.grad, ref, grad, rotary_dim=32, style="neox", what="grad q")
