"""qkv_prologue(q_scale=...): q as float8 e4m3 for FP8 attention. The values are checked by the
conformance suite (test_prologue_fp8_q) on every backend that declares them; here: which
backends declare it, selection around those that do not, arguments, and torch.compile."""

import pytest
import torch

import rope_ops
from rope_ops import RopeError
from rope_ops.backend import RopeCall

FP8 = getattr(torch, "float8_e4m3fn", None)
pytestmark = pytest.mark.skipif(FP8 is None, reason="no float8 in this torch")


def _call(device="cpu"):
    return RopeCall(device, torch.bfloat16, "thd", "neox", 64, 64, 4, 2, False, torch.int64, False, False,
                    True, op="prologue", q_out_dtype=FP8)


def test_a_backend_without_a_float8_q_refuses_it():
    from rope_ops_backends.torch_backend import TorchBackend

    class NoFloat8Q(TorchBackend):  # a prologue backend that does not declare the float8 q
        prologue_q_dtypes = frozenset()

    assert f"no q output in {FP8}" in NoFloat8Q().supports(_call())
    assert NoFloat8Q().supports(_call()._replace(q_out_dtype=None)) == []
    assert TorchBackend().supports(_call()) == []


def _qkv(tokens=5, hq=4, hk=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, (hq + 2 * hk) * d, generator=g), dict(num_q_heads=hq, num_kv_heads=hk,
                                                                       head_dim=d)


def test_automatic_selection_takes_a_backend_that_declares_it():
    qkv, kw = _qkv()
    with torch.no_grad():
        q, k, v = rope_ops.qkv_prologue(qkv, 3, q_scale=0.5, **kw)
    assert q.dtype == FP8 and k.dtype == v.dtype == qkv.dtype


@pytest.mark.parametrize("scale, message", [
    (0.0, "q_scale"), (-2.0, "q_scale"), (float("nan"), "q_scale"), (float("inf"), "q_scale"),
    (torch.tensor([1.0, 2.0]), "one number"), ("1", "q_scale"), (1e-60, "normal float32"),
    (1e300, "normal float32"),
])
def test_bad_q_scales_are_refused(scale, message):
    qkv, kw = _qkv()
    with torch.no_grad(), pytest.raises(RopeError, match=message):
        rope_ops.qkv_prologue(qkv, 0, q_scale=scale, backend="torch", **kw)


def test_a_tensor_scale_is_its_value():
    qkv, kw = _qkv(seed=1)
    with torch.no_grad():
        a, _, _ = rope_ops.qkv_prologue(qkv, 0, q_scale=torch.tensor(0.25), backend="torch", **kw)
        b, _, _ = rope_ops.qkv_prologue(qkv, 0, q_scale=0.25, backend="torch", **kw)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_float8_q_under_compile_matches_eager():
    qkv, kw = _qkv(seed=2)
    w = torch.rand(64) + 0.5

    def prologue(qkv, w):
        return rope_ops.qkv_prologue(qkv, 0, q_norm=w, k_norm=w, q_scale=0.5, backend="torch", **kw)

    with torch.no_grad():
        eager = prologue(qkv, w)
        compiled = torch.compile(prologue, fullgraph=True, backend="aot_eager")(qkv, w)
    assert compiled[0].dtype == FP8
    assert torch.equal(compiled[0].view(torch.uint8), eager[0].view(torch.uint8))
    for got, want in zip(compiled[1:], eager[1:]):
        assert torch.equal(got, want)


def test_cache_scales_are_checked_as_q_scale_is():
    qkv, kw = _qkv(seed=3)
    caches = (torch.zeros(8, 2, 64, dtype=FP8), torch.zeros(8, 2, 64, dtype=FP8))
    before = [c.view(torch.uint8).clone() for c in caches]
    for scales, message in (((torch.tensor([1.0, 2.0]), 1.0), "one number"), ((0.0, 1.0), "cache_scales")):
        with torch.no_grad(), pytest.raises(RopeError, match=message):
            rope_ops.qkv_prologue(qkv, 0, kv_cache=caches, slots=torch.arange(5), cache_scales=scales,
                                  backend="torch", **kw)
    assert all(torch.equal(c.view(torch.uint8), b) for c, b in zip(caches, before))
    with torch.no_grad():
        rope_ops.qkv_prologue(qkv, 0, kv_cache=caches, slots=torch.arange(5),
                              cache_scales=(torch.tensor(0.5), 2.0), backend="torch", **kw)
