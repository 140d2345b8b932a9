"""The pure-torch backend's own paths (backends/torch_backend.py), against the float64 reference:
CPU calls rotated in slices of tokens (with a tiny slice budget every call is cut into many,
uneven last one included), the table rows taken without the on-the-fly branch when every
position is known to lie in the table, the float32 paths that write straight into the output,
the complex path of gptj and its fallback, float64; and no data-dependent host read off the CPU
(run on the meta device, where any such read raises; and on CUDA under sync debug mode)."""

from __future__ import annotations

import pytest
import torch

import rope_ops
import rope_ops_backends.torch_backend as torch_backend
from rope_ops._reference import rope_reference
from rope_ops.backend import KernelArgs
from rope_ops.testing.checks import assert_rope_close

SHAPES = {"bshd": (2, 13, 3, 64), "sbhd": (13, 2, 3, 64), "bhsd": (2, 3, 13, 64), "thd": (29, 3, 64)}
SEQ_AXIS = {"bshd": 1, "sbhd": 0, "bhsd": 2, "thd": 0}


@pytest.fixture
def small_slices(monkeypatch):
    # a token is 96-192 rotary elements here (B <= 2, 3 heads, 32 dims): one token per slice
    monkeypatch.setattr(torch_backend, "_CPU_CHUNK_ELEMENTS_PER_THREAD", 100)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)


def _check(q_out, k_out, q_in, k_in, pos, rope, layout, style, rotary_dim, inverse=False):
    for out, x in ((q_out, q_in), (k_out, k_in)):
        if x is None:
            continue
        ref = rope_reference(x, pos, layout=layout, rotary_dim=rotary_dim, style=style,
                             inv_freq=rope.inv_freq, attention_factor=rope.attention_factor,
                             inverse=inverse)
        assert_rope_close(out, ref, x, rotary_dim=rotary_dim, style=style)


@pytest.mark.parametrize("layout", sorted(SHAPES))
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_rotation_matches_reference(small_slices, layout, style, inplace, dtype):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(SHAPES[layout], generator=gen).to(dtype)
    k = torch.randn(SHAPES[layout], generator=gen).to(dtype)
    pos = torch.randint(0, 5000, (SHAPES[layout][SEQ_AXIS[layout]],), generator=gen)
    rope = rope_ops.RotaryEmbedding(64, rotary_dim=32, base=10000.0, max_position=4096, style=style)
    q_in, k_in = q.clone(), k.clone()
    q_out, k_out = rope_ops.apply(q, k, pos, rope=rope, layout=layout, inplace=inplace,
                                  backend="torch")
    _check(q_out, k_out, q_in, k_in, pos, rope, layout, style, 32)


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


@pytest.mark.parametrize("pos_kind", ["offset", "tensor", "int32 [S]"])
def test_positions_in_the_table_skip_the_on_the_fly_branch(monkeypatch, pos_kind):
    """Inside the table the rows are gathered (or sliced) directly; the masked on-the-fly branch
    (cos_sin_rows) runs only when some position may lie outside."""
    calls = []
    real = torch_backend.cos_sin_rows
    monkeypatch.setattr(torch_backend, "cos_sin_rows", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(5)
    rope = rope_ops.RotaryEmbedding(64, max_position=100)
    q = torch.randn(2, 9, 3, 64, generator=gen).to(torch.bfloat16)
    inside = {"offset": 91, "tensor": torch.randint(0, 100, (2, 9), generator=gen),
              "int32 [S]": torch.randint(0, 100, (9,), generator=gen).int()}[pos_kind]
    outside = {"offset": 92, "tensor": torch.randint(0, 100, (2, 9), generator=gen) + 1,
               "int32 [S]": torch.randint(-9, 91, (9,), generator=gen).int()}[pos_kind]
    if isinstance(outside, torch.Tensor):
        outside.view(-1)[0] = 100 if pos_kind == "tensor" else -1
    for pos, branch in ((inside, False), (outside, True)):
        calls.clear()
        q_out, _ = rope_ops.apply(q, None, pos, rope=rope, backend="torch")
        assert bool(calls) == branch, (pos_kind, pos, calls)
        _check(q_out, None, q, None, pos, rope, "bshd", "neox", 64)


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("view", ["dense", "packed", "odd_offset"])
@pytest.mark.parametrize("inplace", [False, True])
def test_every_path(style, dtype, view, inplace):
    """float32/float64 out of place straight into the output, in place through a buffer, the
    complex path of gptj where pairs can be viewed as complex numbers and the widening path
    where they cannot (a view starting at an odd element), low precision widened once."""
    gen = torch.Generator().manual_seed(6)
    if view == "dense":
        q = torch.randn(2, 5, 4, 48, generator=gen).to(dtype)
    elif view == "packed":
        q = torch.randn(2, 5, 7, 48, generator=gen).to(dtype)[:, :, 1:5]
    else:
        q = torch.randn(2, 5, 4, 49, generator=gen).to(dtype)[..., 1:]
    rope = rope_ops.RotaryEmbedding(48, rotary_dim=40, max_position=256, style=style)
    q_in = q.clone()
    for pos in (torch.randint(0, 256, (2, 5), generator=gen),  # table rows only
                torch.randint(-50, 400, (2, 5), generator=gen)):  # some rows on the fly
        for inverse in (False, True):
            q.copy_(q_in)  # in place wrote it: the same values again, through the same view
            fn = rope_ops.apply_grad if inverse else rope_ops.apply
            q_out, _ = fn(q, None, pos, rope=rope, inplace=inplace, backend="torch")
            assert (q_out is q) == inplace
            _check(q_out, None, q_in, None, pos, rope, "bshd", style, 40, inverse)


def test_no_host_read_off_the_cpu():
    """On a device other than the CPU the backend never reads data on the host: on the meta
    device (no data at all) every path runs, positions inside the table or not."""
    rope = rope_ops.RotaryEmbedding(64, max_position=32)
    cos, sin, turns, factor = (t.to("meta") if isinstance(t, torch.Tensor) else t
                               for t in rope.tables(torch.device("cpu")))
    backend = torch_backend.TorchBackend()
    for style in (False, True):
        for pos, offset in ((torch.zeros(2, 5, dtype=torch.int64, device="meta"), 0), (None, 3),
                            (None, 40)):
            q = torch.empty(2, 5, 4, 64, device="meta", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            args = KernelArgs(q, None, out, None, pos, offset, cos, sin, turns, factor, "bshd", 64,
                              style, False, False)
            backend.run(args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_calls_never_sync():
    """CUDA under sync debug mode "error": positions inside and outside the table, both styles,
    in place and out of place, forward and backward, without a host sync; results exact."""
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 33, 4, 64, generator=gen).to(torch.bfloat16).cuda()
    k = torch.randn(2, 33, 2, 64, generator=gen).to(torch.bfloat16).cuda()
    positions = [torch.randint(0, 1024, (2, 33), generator=gen).cuda(),
                 torch.randint(-100, 5000, (2, 33), generator=gen).cuda(), 7, 2000]
    for style in ("neox", "gptj"):
        rope_s = rope_ops.RotaryEmbedding(64, max_position=1024, style=style)
        for pos in positions:
            for inplace in (False, True):
                # the first calls of a kind build tables and caches (host-to-device copies): outside
                # sync debug mode
                rope_ops.apply(q.clone(), k.clone(), pos, rope=rope_s, backend="torch", inplace=inplace)
                rope_ops.apply_grad(q, k, pos, rope=rope_s, backend="torch")
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    q_out, k_out = rope_ops.apply(q.clone(), k.clone(), pos, rope=rope_s,
                                                  backend="torch", inplace=inplace)
                    gq, gk = rope_ops.apply_grad(q, k, pos, rope=rope_s, backend="torch")
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                _check(q_out, k_out, q, k, pos, rope_s, "bshd", style, 64)
                _check(gq, gk, q, k, pos, rope_s, "bshd", style, 64, inverse=True)
