"""apply(angles=...): rotation angles in radians instead of cos/sin tables (TransformerEngine's
``freqs``), against the float64 reference built from the same angles.

TransformerEngine's RotaryPositionEmbedding returns freqs [S, 1, 1, r] float32: cat(a, a) for
NeoX pairs, each angle twice in a row for interleaved (GPT-J) pairs; its apply_rotary_pos_emb
rotates position s of the sequence with freqs[s]. Those forms are rebuilt here from random
angles (not from rope_ops' frequencies), so nothing rope_ops computes is trusted.
"""

import pytest
import torch

import rope_ops
from rope_ops import RopeError
from rope_ops._reference import rope_reference
from rope_ops.testing.checks import assert_rope_close

BACKENDS = ["torch", "cpu"]


def _te_freqs(angles: torch.Tensor, style: str) -> torch.Tensor:
    """TransformerEngine's freqs [P, 1, 1, r] for half-width angles [P, r/2]."""
    if style == "neox":
        full = torch.cat([angles, angles], dim=-1)
    else:
        full = torch.stack([angles, angles], dim=-1).flatten(-2)
    return full[:, None, None, :]


def _angles(rows: int, half: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # large angles too: positions up to ~1e5 times frequencies up to 1
    return torch.rand(rows, half, generator=g, dtype=torch.float32) * 1e5


def _reference_tables(angles: torch.Tensor):
    a = angles.to(torch.float64)
    return torch.cos(a), torch.sin(a)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformer_engine_freqs_match_the_reference(backend, style, dtype):
    S, B, H, D = 11, 2, 3, 64
    g = torch.Generator().manual_seed(1)
    q = torch.randn(S, B, H, D, generator=g).to(dtype)
    k = torch.randn(S, B, 1, D, generator=g).to(dtype)
    angles = _angles(S, D // 2, seed=2)
    freqs = _te_freqs(angles, style)
    q_out, k_out = rope_ops.apply(q, k, 0, angles=freqs, style=style, layout="sbhd", backend=backend)
    tables = _reference_tables(angles)
    for x, out in ((q, q_out), (k, k_out)):
        ref = rope_reference(x, 0, layout="sbhd", rotary_dim=D, style=style, cos_sin=tables)
        assert_rope_close(out, ref, x, rotary_dim=D, style=style)


@pytest.mark.parametrize("backend", BACKENDS)
def test_half_width_angles_with_positions_and_partial_rotary(backend):
    B, S, H, D, R = 2, 7, 2, 48, 16
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, S, H, D, generator=g)
    angles = _angles(40, R // 2, seed=4)  # [P, r/2]
    pos = torch.randint(0, 40, (B, S), generator=g)
    q_out, k_out = rope_ops.apply(q, None, pos, angles=angles, backend=backend)
    assert k_out is None
    ref = rope_reference(q, pos, layout="bshd", rotary_dim=R, style="neox", cos_sin=_reference_tables(angles))
    assert_rope_close(q_out, ref, q, rotary_dim=R, style="neox")
    # duplicated halves of width r need rotary_dim when r <= head_dim / 2, as cos_sin tables do
    dup = torch.cat([angles, angles], dim=-1)
    q_dup, _ = rope_ops.apply(q, None, pos, angles=dup, rotary_dim=R, backend=backend)
    assert torch.equal(q_dup, q_out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_token_angles_and_gradients(backend):
    B, S, H, D = 2, 5, 2, 32
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, S, H, D, generator=g, requires_grad=True)
    angles = _angles(B * S, D // 2, seed=6).view(B, S, D // 2)
    q_out, _ = rope_ops.apply(q, None, None, angles=angles, backend=backend)
    c, s = _reference_tables(angles)
    ref = rope_reference(q, None, layout="bshd", rotary_dim=D, style="neox", token_cos_sin=(c, s))
    assert_rope_close(q_out, ref, q, rotary_dim=D, style="neox")
    grad = torch.randn(B, S, H, D, generator=g)
    (q_grad,) = torch.autograd.grad(q_out, q, grad)
    ref_grad = rope_reference(grad, None, layout="bshd", rotary_dim=D, style="neox", token_cos_sin=(c, s),
                              inverse=True)
    assert_rope_close(q_grad, ref_grad, grad, rotary_dim=D, style="neox", what="grad")
    # apply_grad takes the same angles
    via_apply_grad, _ = rope_ops.apply_grad(grad, None, None, angles=angles, backend=backend)
    assert torch.equal(via_apply_grad, q_grad)


def test_angles_equal_tables_of_the_same_angles():
    q = torch.randn(9, 4, 64)
    angles = _angles(9, 32, seed=7)
    c, s = _reference_tables(angles)
    by_angles, _ = rope_ops.apply(q, None, 0, angles=angles, backend="torch")
    by_tables, _ = rope_ops.apply(q, None, 0, cos_sin=(c.float(), s.float()), backend="torch")
    assert torch.equal(by_angles, by_tables)


@pytest.mark.parametrize("bad, message", [
    (lambda a: a.to(torch.int64), "floating-point"),
    (lambda a: a.view(3, 3, 1, 32), r"\[P, 1, 1, w\]"),
    (lambda a: a[0, 0], "frequency axis"),
    (lambda a: [1.0, 2.0], "tensor of angles"),
])
def test_bad_angles_are_refused(bad, message):
    q = torch.randn(9, 4, 64)
    angles = _angles(9, 32, seed=8)
    with pytest.raises(RopeError, match=message):
        rope_ops.apply(q, None, 0, angles=bad(angles), backend="torch")


def test_angles_with_tables_or_grad_are_refused():
    q = torch.randn(9, 4, 64)
    angles = _angles(9, 32, seed=9)
    c, s = _reference_tables(angles)
    with pytest.raises(RopeError, match="not both"):
        rope_ops.apply(q, None, 0, angles=angles, cos_sin=(c.float(), s.float()))
    with pytest.raises(RopeError, match="requires grad"):
        rope_ops.apply(q, None, 0, angles=angles.requires_grad_())
    before = q.clone()
    with pytest.raises(RopeError):
        rope_ops.apply(q, None, 0, angles=angles.detach()[:, :5], rotary_dim=64, inplace=True)
    assert torch.equal(q, before)


@pytest.mark.parametrize("backend", ["torch"])
def test_angles_under_compile(backend):
    q = torch.randn(6, 2, 32)
    angles = _angles(6, 16, seed=10)
    eager, _ = rope_ops.apply(q, None, 0, angles=angles, backend=backend)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(q, angles):
        return rope_ops.apply(q, None, 0, angles=angles, backend=backend)[0]

    assert torch.equal(f(q, angles), eager)


def test_angles_on_dtensors(tmp_path):
    """rope_ops.distributed.apply takes angles= as rope_ops.apply does (one gloo rank)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import rope_ops.distributed as rd

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        q = torch.randn(2, 8, 4, 64)
        angles = _angles(8, 32, seed=11)
        pos = torch.arange(8)
        out, _ = rd.apply(distribute_tensor(q, mesh, [Shard(1)]), None, pos, angles=angles, backend="torch")
        want, _ = rope_ops.apply(q, None, pos, angles=angles, backend="torch")
        assert torch.equal(out.full_tensor(), want)
    finally:
        dist.destroy_process_group()
