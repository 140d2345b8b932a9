"""Conformance tests of the fused prologue (rope_ops.qkv_prologue): split + per-head RMSNorm +
RoPE (+ KV-cache write), forward and backward, against the float64 reference.

Accuracy (docs/spec.md, "Fused prologue"): float32 statistics and math, one rounding at the
end: every rotated element within SPEC's bound taken at the normalised (pre-rotation) pair, so
the norm's float32 arithmetic must stay inside the float32 allowance; v exactly the input.
Gradients: within 1e-5 relative (float32 sums over a head) plus one ulp of the dtype.

Mixed into ``RopeConformance``; a backend without ``supports_prologue`` is skipped with its reason.
"""

from __future__ import annotations

import pytest
import torch

import rope_ops
from rope_ops import RopeError

from .._reference import prologue_reference
from .checks import assert_bitwise_equal, assert_rope_close, run_or_skip_refusal
from .tolerances import ulp


_run = run_or_skip_refusal


def _dtype_for(backend_obj):
    return next(d for d in (torch.bfloat16, torch.float32, torch.float64) if d in backend_obj.dtypes)


# name -> (layout, Hq, Hk, D, rotary_dim, style, q_norm, k_norm, norm_offset, rotate, token stride extra)
_CASES = {
    "qwen3_thd": ("thd", 4, 2, 64, 64, "neox", True, True, 0.0, True, 0),
    "gemma_offset_bshd": ("bshd", 4, 1, 32, 32, "neox", True, True, 1.0, True, 0),
    "rope_only": ("thd", 3, 1, 48, 48, "gptj", False, False, 0.0, True, 0),
    "norm_only": ("bshd", 2, 2, 32, 32, "neox", True, True, 0.0, False, 0),
    "k_norm_only_partial_gptj": ("thd", 4, 2, 80, 32, "gptj", False, True, 0.0, True, 0),
    "strided_rows_hd96": ("thd", 2, 1, 96, 96, "neox", True, True, 0.0, True, 40),
}


def _inputs(case, dtype, device, seed, grad=False):
    layout, hq, hk, d, r, style, qn, kn, offset, rotate, extra = _CASES[case]
    gen = torch.Generator().manual_seed(seed)
    width = (hq + 2 * hk) * d
    lead = (11,) if layout == "thd" else (2, 6)
    buf = torch.randn(*lead, width + extra, generator=gen).to(dtype).to(device)
    qkv = buf[..., :width]
    if grad:
        qkv = qkv.detach().clone().requires_grad_(True)
    q_w = (torch.randn(d, generator=gen) * 0.5 + (0.0 if offset else 1.0)).to(device) if qn else None
    k_w = (torch.randn(d, generator=gen) * 0.5 + (0.0 if offset else 1.0)).to(device) if kn else None
    if grad:
        q_w = None if q_w is None else q_w.requires_grad_(True)
        k_w = None if k_w is None else k_w.requires_grad_(True)
    rope = rope_ops.RotaryEmbedding(d, rotary_dim=r, style=style, max_position=32)
    pos = torch.randint(0, 50, lead, generator=gen).to(device) if rotate else None  # past the table too
    kwargs = dict(num_q_heads=hq, num_kv_heads=hk, head_dim=d, q_norm=q_w, k_norm=k_w,
                  norm_offset=offset, rotate=rotate)
    if rotate:
        kwargs["rope"] = rope
    ref_kw = dict(num_q_heads=hq, num_kv_heads=hk, head_dim=d, q_weight=q_w, k_weight=k_w,
                  eps=1e-6, weight_offset=offset, rotate=rotate, rotary_dim=r, style=style,
                  inv_freq=rope.inv_freq)
    return qkv, pos, kwargs, ref_kw, (r, style)


def _normalised(qkv, ref_kw):
    """The float64 normalised heads (the pre-rotation pairs SPEC's bound is taken at)."""
    kw = dict(ref_kw, rotate=False)
    return prologue_reference(qkv.detach(), None, **kw)


def _assert_grad_close(got, ref, dtype, what, rel=1e-5):
    got64 = got.detach().to("cpu", torch.float64)
    ref64 = ref.detach().to("cpu", torch.float64)
    scale = ref64.abs().max().clamp_min(1.0)
    bound = rel * scale + ulp(ref64, dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32)
    err = (got64 - ref64).abs()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements out of bounds; "
                           f"worst error {err.max().item():.3g} (scale {scale.item():.3g})")


class PrologueTests:
    """rope_ops.qkv_prologue, held to every backend that declares it."""

    @pytest.mark.parametrize("case", list(_CASES))
    def test_prologue_forward(self, backend_name, backend_obj, device, case):
        dtype = _dtype_for(backend_obj)
        qkv, pos, kwargs, ref_kw, (r, style) = _inputs(case, dtype, device, seed=41)
        before = qkv.clone()
        q, k, v = _run(rope_ops.qkv_prologue, qkv, pos, backend=backend_name, **kwargs)
        rq, rk, rv = prologue_reference(qkv, pos, **ref_kw)
        nq, nk, _ = _normalised(qkv, ref_kw)
        for out, ref, x, name in ((q, rq, nq, "q"), (k, rk, nk, "k")):
            assert out.is_contiguous() and out.dtype == dtype and out.shape == ref.shape
            normed = kwargs["q_norm" if name == "q" else "k_norm"] is not None
            assert_rope_close(out, ref, x, rotary_dim=r, style=style, what=f"{case} {name}",
                              passthrough_exact=not normed)
        assert_bitwise_equal(v.to("cpu", torch.float64), rv, f"{case} v")
        assert_bitwise_equal(qkv, before, "qkv after an out-of-place prologue")

    def test_prologue_in_place(self, backend_name, backend_obj, device):
        dtype = _dtype_for(backend_obj)
        qkv, pos, kwargs, ref_kw, (r, style) = _inputs("strided_rows_hd96", dtype, device, seed=42)
        before = qkv.clone()
        q, k, v = _run(rope_ops.qkv_prologue, qkv, pos, inplace=True, backend=backend_name, **kwargs)
        assert q.data_ptr() == qkv.data_ptr(), "in place returns views of qkv"
        rq, rk, rv = prologue_reference(before, pos, **ref_kw)
        nq, nk, _ = _normalised(before, ref_kw)
        assert_rope_close(q, rq, nq, rotary_dim=r, style=style, what="q in place",
                          passthrough_exact=False)
        assert_rope_close(k, rk, nk, rotary_dim=r, style=style, what="k in place",
                          passthrough_exact=False)
        assert_bitwise_equal(v.to("cpu", torch.float64), rv, "v (untouched in place)")

    @pytest.mark.parametrize("case", ["qwen3_thd", "gemma_offset_bshd", "k_norm_only_partial_gptj",
                                      "norm_only"])
    def test_prologue_backward(self, backend_name, backend_obj, device, case):
        """Gradients of qkv and of both norm weights against float64 autograd of the reference."""
        if not backend_obj.supports_backward:
            pytest.skip("backend has no backward")
        dtype = _dtype_for(backend_obj)
        qkv, pos, kwargs, ref_kw, _ = _inputs(case, dtype, device, seed=43, grad=True)
        q, k, v = _run(rope_ops.qkv_prologue, qkv, pos, backend=backend_name, **kwargs)
        gen = torch.Generator().manual_seed(44)
        grads = [torch.randn(t.shape, generator=gen).to(dtype).to(device) for t in (q, k, v)]
        torch.autograd.backward((q, k, v), grads)
        ref_qkv = qkv.detach().to("cpu", torch.float64).requires_grad_(True)
        ref_w = {name: None if w is None else w.detach().to("cpu", torch.float64).requires_grad_(True)
                 for name, w in (("q_weight", kwargs["q_norm"]), ("k_weight", kwargs["k_norm"]))}
        rq, rk, rv = prologue_reference(ref_qkv, None if pos is None else pos.cpu(),
                                        **{**ref_kw, **ref_w})
        torch.autograd.backward((rq, rk, rv), [g.to("cpu", torch.float64) for g in grads])
        _assert_grad_close(qkv.grad, ref_qkv.grad, dtype, f"{case} d qkv")
        for name, w in (("q_weight", kwargs["q_norm"]), ("k_weight", kwargs["k_norm"])):
            if w is not None:
                _assert_grad_close(w.grad, ref_w[name].grad, torch.float32, f"{case} d {name}", rel=1e-4)

    @pytest.mark.parametrize("fp8", [False, True], ids=["same_dtype", "fp8"])
    def test_prologue_cache_write(self, backend_name, backend_obj, device, fp8):
        """Rotated k and v land in the cache at their slots; -1 skips; nothing else changes."""
        if fp8 and not hasattr(torch, "float8_e4m3fn"):
            pytest.skip("no float8 in this torch")
        dtype = _dtype_for(backend_obj)
        qkv, pos, kwargs, ref_kw, (r, style) = _inputs("qwen3_thd", dtype, device, seed=45)
        n_slots, hk, d = 40, kwargs["num_kv_heads"], kwargs["head_dim"]
        cache_dtype = torch.float8_e4m3fn if fp8 else dtype
        k_cache = torch.randn(n_slots, hk, d).to(cache_dtype).to(device)
        v_cache = torch.randn(n_slots, hk, d).to(cache_dtype).to(device)
        before = k_cache.clone(), v_cache.clone()
        gen = torch.Generator().manual_seed(46)
        slots = torch.randperm(n_slots, generator=gen)[: qkv.shape[0]].to(device)
        slots[3] = -1
        scales = (0.5, 2.0) if fp8 else None
        with torch.inference_mode():
            q, k, v = _run(rope_ops.qkv_prologue, qkv, pos, kv_cache=(k_cache, v_cache), slots=slots,
                           cache_scales=scales, backend=backend_name, **kwargs)
        _, rk, rv = prologue_reference(qkv, pos, **ref_kw)
        written = slots.cpu() >= 0
        untouched = torch.ones(n_slots, dtype=torch.bool)
        untouched[slots.cpu()[written]] = False
        assert_bitwise_equal(k_cache.cpu()[untouched].float(), before[0].cpu()[untouched].float(),
                             "cache rows of other slots")
        assert_bitwise_equal(v_cache.cpu()[untouched].float(), before[1].cpu()[untouched].float(),
                             "v cache rows of other slots")
        got_k = k_cache.cpu()[slots.cpu()[written]].to(torch.float64)
        got_v = v_cache.cpu()[slots.cpu()[written]].to(torch.float64)
        if fp8:
            # one rounding of value / scale to e4m3: within half an e4m3 ulp (3 mantissa bits)
            for got, ref, scale, name in ((got_k, rk, 0.5, "k"), (got_v, rv, 2.0, "v")):
                want = ref[written] / scale
                bound = want.abs() * 2.0**-4 + 2.0**-9
                assert ((got - want).abs() <= bound).all(), f"fp8 {name} cache"
        else:
            nk = _normalised(qkv, ref_kw)[1]
            assert_rope_close(got_k, rk[written], nk[written], rotary_dim=r, style=style, what="k cache",
                              dtype=cache_dtype)
            assert_bitwise_equal(got_v, rv[written], "v cache")
            assert_bitwise_equal(k_cache[slots[written.to(device)]], k[written.to(device)],
                                 "k cache equals the returned k")

    @pytest.mark.parametrize("q_scale", [0.25, 0.004], ids=["in_range", "saturating"])
    def test_prologue_fp8_q(self, backend_name, backend_obj, device, q_scale):
        """q_scale: q comes back as float8 e4m3 of q / q_scale, rounded once and saturating at
        +-448; k and v are those of the same call without it; with a float8 cache too."""
        fp8 = getattr(torch, "float8_e4m3fn", None)
        if fp8 is None or fp8 not in backend_obj.prologue_q_dtypes:
            pytest.skip(f"{backend_name} declares no float8 q (prologue_q_dtypes)")
        dtype = _dtype_for(backend_obj)
        qkv, pos, kwargs, ref_kw, _ = _inputs("qwen3_thd", dtype, device, seed=47)
        n_slots, hk, d = 32, kwargs["num_kv_heads"], kwargs["head_dim"]
        k_cache = torch.zeros(n_slots, hk, d, dtype=fp8, device=device)
        v_cache = torch.zeros(n_slots, hk, d, dtype=fp8, device=device)
        slots = torch.arange(qkv.shape[0], device=device)
        with torch.inference_mode():
            q8, k, v = _run(rope_ops.qkv_prologue, qkv, pos, q_scale=q_scale, backend=backend_name, **kwargs)
            q, k_plain, v_plain = rope_ops.qkv_prologue(qkv, pos, backend=backend_name, **kwargs)
            q8c, _, _ = rope_ops.qkv_prologue(qkv, pos, q_scale=q_scale, kv_cache=(k_cache, v_cache),
                                              slots=slots, cache_scales=(0.5, 2.0), backend=backend_name,
                                              **kwargs)
        assert q8.dtype == fp8 and q8.shape == q.shape and q8.is_contiguous()
        assert_bitwise_equal(k, k_plain, "k beside a float8 q")
        assert_bitwise_equal(v, v_plain, "v beside a float8 q")
        assert_bitwise_equal(q8c.view(torch.uint8), q8.view(torch.uint8), "float8 q with a cache write")
        rq, _, _ = prologue_reference(qkv, pos, **ref_kw)
        got = q8.cpu().to(torch.float64)
        want = (rq / q_scale).clamp(-448.0, 448.0)
        # one rounding to e4m3 (3 mantissa bits): half an ulp, plus the float32 math before it
        bound = want.abs() * 2.0**-4 + 2.0**-9
        assert ((got - want).abs() <= bound).all(), f"float8 q: worst {(got - want).abs().max():.3g}"
        if q_scale < 0.01:
            assert (got.abs() == 448.0).any(), "float8 q: no value saturated at this scale"
        with pytest.raises(RopeError, match="q_scale"):
            rope_ops.qkv_prologue(qkv, pos, q_scale=q_scale, inplace=True, backend=backend_name, **kwargs)
        with pytest.raises(RopeError, match="q_scale"):
            rope_ops.qkv_prologue(qkv, pos, q_scale=-1.0, backend=backend_name, **kwargs)
        trained = qkv.detach().clone().requires_grad_(True)
        with pytest.raises(RopeError, match="q_scale"):
            rope_ops.qkv_prologue(trained, pos, q_scale=q_scale, backend=backend_name, **kwargs)

    def test_prologue_bad_input(self, backend_name, backend_obj, device):
        dtype = _dtype_for(backend_obj)
        qkv, pos, kwargs, _, _ = _inputs("qwen3_thd", dtype, device, seed=47)
        n = qkv.shape[0]
        cache = torch.zeros(8, kwargs["num_kv_heads"], kwargs["head_dim"], dtype=dtype, device=device)
        bad = [
            ({"num_q_heads": 5}, "qkv"),
            ({"q_norm": torch.ones(3, device=device)}, "q_norm"),
            ({"eps": float("nan")}, "eps"),
            ({"rotate": False}, "rotate"),
            ({"kv_cache": (cache, cache)}, "slots"),
            ({"kv_cache": (cache, cache[:4]), "slots": torch.zeros(n, dtype=torch.int64, device=device)},
             "kv_cache"),
            ({"kv_cache": (cache, cache.clone()), "slots": torch.zeros(n, dtype=torch.float32, device=device)},
             "slots"),
            ({"slots": torch.zeros(n, dtype=torch.int64, device=device)}, "slots"),
            ({"inplace": 1}, "inplace"),
            ({"q_norm": torch.ones(1, kwargs["head_dim"], device=device)}, "q_norm"),
            ({"k_norm": torch.ones(kwargs["head_dim"], dtype=torch.int32, device=device)}, "k_norm"),
            ({"eps": -1e-6}, "eps"),
            ({"kv_cache": (cache, cache), "slots": torch.zeros(n, dtype=torch.int64, device=device)},
             "overlap"),
            ({"kv_cache": (qkv[:, : cache[0].numel()].unflatten(-1, cache.shape[1:]),
                           cache.new_zeros(n, *cache.shape[1:])),
              "slots": torch.arange(n, device=device)}, "overlaps qkv"),
            ({"kv_cache": (cache.to(torch.int8), cache.to(torch.int8)),
              "slots": torch.zeros(n, dtype=torch.int64, device=device)}, "kv_cache"),
        ]
        if pos is not None:
            bad += [({"pos": pos.float()}, "pos"), ({"pos": pos[:-1]}, "pos")]
        # qkv itself malformed: integer, a last dim with stride 2, one token without its token
        # dim; in place on elements that overlap
        bad += [({"qkv": qkv.to(torch.int32)}, "qkv"),
                ({"qkv": torch.stack([qkv, qkv], -1)[..., 0]}, "qkv"),
                ({"qkv": qkv[0]}, "qkv"),
                ({"qkv": qkv[:1].expand(qkv.shape), "inplace": True}, "qkv")]
        if device.type == "cpu":
            bad.append(({"kv_cache": (cache, cache.clone()),
                         "slots": torch.full((n,), 8, dtype=torch.int64)}, "slots"))
        before = qkv.clone()
        for extra, named in bad:
            call_kw = {**kwargs, **extra}
            call_qkv, call_pos = call_kw.pop("qkv", qkv), call_kw.pop("pos", pos)
            with pytest.raises(RopeError, match=named):
                rope_ops.qkv_prologue(call_qkv, call_pos, backend=backend_name, **call_kw)
            assert_bitwise_equal(qkv, before, f"qkv after a refused call ({named})")
        grad_qkv = qkv.detach().clone().requires_grad_(True)
        with pytest.raises(RopeError, match="inference"):
            rope_ops.qkv_prologue(grad_qkv, pos, kv_cache=(cache, cache.clone()),
                                  slots=torch.zeros(n, dtype=torch.int64, device=device),
                                  backend=backend_name, **kwargs)
        with pytest.raises(RopeError, match="inplace"):
            rope_ops.qkv_prologue(grad_qkv * 1, pos, inplace=True, backend=backend_name, **kwargs)

    def test_prologue_compiled(self, backend_name, backend_obj, device):
        """Under torch.compile (one graph), forward and backward equal eager."""
        if device.type not in ("cpu", "cuda"):
            pytest.skip(f"torch.compile is not exercised on {device.type}")
        dtype = _dtype_for(backend_obj)
        qkv, pos, kwargs, _, _ = _inputs("qwen3_thd", dtype, device, seed=48, grad=True)

        def step(qkv, pos):
            q, k, v = rope_ops.qkv_prologue(qkv, pos, backend=backend_name, **kwargs)
            return (q.float() * 2).sum() + k.float().sum() + v.float().sum()

        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        loss = _run(compiled, qkv, pos)
        (grad_compiled,) = torch.autograd.grad(loss, qkv)
        eager = step(qkv, pos)
        (grad_eager,) = torch.autograd.grad(eager, qkv)
        assert_bitwise_equal(loss.detach(), eager.detach(), "compiled loss")
        assert_bitwise_equal(grad_compiled, grad_eager, "compiled gradient")
        torch._dynamo.reset()
