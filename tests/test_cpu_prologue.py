"""The cpu backend's fused prologue (rope_ops.qkv_prologue: QKV split + per-head RMSNorm + RoPE +
KV-cache write), kernel by kernel. The shared conformance suite runs separately:
``pytest --pyargs rope_ops.testing --rope-backend cpu -k prologue``.

Every instruction-set kernel this machine can run (forced one at a time through ``use_isa``) is
checked against the float64 reference, and its backward against float64 autograd of that
reference: every dtype, thd and bshd, GQA and MQA, partial rotary, gptj, the norm on and off for
q and k, Gemma's weight offset, strided qkv rows, in place, every angle kind (positions inside
and outside the table, an int offset, caller and per-token tables, mRoPE, no rotation), head
sizes with vector remainders. Then what the kernels promise beyond the reference: cache writes
(-1, out-of-range slots never written, float8 rounded as torch rounds), a float8 q (q_scale)
rounded from the same float32 values as the data-dtype q, absent and strided
output gradients, weight gradients independent of the thread count, and the x86 kernels
agreeing bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import rope_ops
import rope_ops_backends.cpu_backend as cpu_backend
from rope_ops._reference import prologue_reference
from rope_ops.backend import PrologueArgs, _float8_of, prologue_backward_torch
from rope_ops.testing.checks import assert_bitwise_equal, assert_rope_close
from rope_ops.testing.tolerances import ulp

from _cpu_support import backend, isa  # noqa: F401  (fixtures)
from _float8_support import check_float8_cache, check_float8_q

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8 = getattr(torch, "float8_e4m3fn", None)


# (layout, q heads, kv heads, head_dim, rotary_dim, style, q norm, k norm, weight offset, angles,
#  extra row elements (strided rows), in place)
_CASES = {
    "qwen3_thd_past_table": ("thd", 4, 2, 128, 128, "neox", True, True, 0.0, "table", 0, False),
    "mqa_gemma_gptj_offset": ("bshd", 4, 1, 128, 128, "gptj", True, True, 1.0, "offset", 0, False),
    "partial_k_norm_strided_inplace": ("thd", 3, 3, 80, 32, "neox", False, True, 0.0, "table", 24, True),
    "mrope_q_norm_gptj_strided": ("bshd", 2, 2, 40, 24, "gptj", True, False, 0.0, "mrope", 8, False),
    "rope_only_per_token": ("thd", 6, 2, 96, 96, "neox", False, False, 0.0, "token", 0, False),
    "caller_tables_d72_inplace": ("bshd", 2, 1, 72, 72, "neox", True, True, 0.0, "caller", 0, True),
    "norm_only_d34": ("thd", 2, 1, 34, 34, "neox", True, True, 0.0, "none", 0, False),
}
_BACKWARD = ["qwen3_thd_past_table", "mqa_gemma_gptj_offset", "mrope_q_norm_gptj_strided",
             "rope_only_per_token", "norm_only_d34"]


def _inputs(name, dtype, seed, lead=None):
    """(qkv, pos, keyword arguments of qkv_prologue, of prologue_reference, (rotary_dim, style))."""
    layout, hq, hk, d, r, style, q_norm, k_norm, offset, angles, extra, _ = _CASES[name]
    gen = torch.Generator().manual_seed(seed)
    lead = lead or ((19,) if layout == "thd" else (2, 9))
    width = (hq + 2 * hk) * d
    qkv = torch.randn(*lead, width + extra, generator=gen).to(dtype)[..., :width]
    center = 0.0 if offset else 1.0
    q_w = torch.randn(d, generator=gen) * 0.5 + center if q_norm else None
    k_w = (torch.randn(d, generator=gen) * 0.5 + center).to(torch.bfloat16) if k_norm else None
    api = dict(num_q_heads=hq, num_kv_heads=hk, head_dim=d, q_norm=q_w, k_norm=k_w,
               norm_offset=offset)
    ref = dict(num_q_heads=hq, num_kv_heads=hk, head_dim=d, q_weight=q_w, k_weight=k_w,
               eps=1e-6, weight_offset=offset, rotary_dim=r, style=style)
    rope = rope_ops.RotaryEmbedding(d, rotary_dim=r, style=style, base=10000.0, max_position=32)
    pos = None
    if angles in ("table", "offset", "mrope"):
        api["rope"] = rope
        ref.update(inv_freq=rope.inv_freq, attention_factor=rope.attention_factor)
        if angles == "table":
            pos = torch.randint(-20, 80, lead, generator=gen)  # negative and past the 32 rows
        elif angles == "offset":
            pos = 29  # tokens run past the table's end
        else:
            pos = torch.randint(0, 60, (3, *lead), generator=gen)
            section = (r // 2 - 2 * (r // 6), r // 6, r // 6)
            api["mrope_section"] = ref["mrope_section"] = section
    elif angles == "token":
        turns = torch.rand(*lead, r // 2, generator=gen, dtype=torch.float64) * 6.3
        tables = (turns.cos().float(), turns.sin().float())
        api["cos_sin"], ref["token_cos_sin"] = tables, tables
    elif angles == "caller":
        turns = torch.rand(50, r // 2, generator=gen, dtype=torch.float64) * 6.3
        tables = (turns.cos().float(), turns.sin().float())
        api["cos_sin"], ref["cos_sin"] = tables, tables
        pos = torch.randint(0, 50, lead, generator=gen)
    else:
        api["rotate"] = ref["rotate"] = False
    return qkv, pos, api, ref, (r, style)


def _normalised(qkv, ref):
    """float64 q, k, v after the norm only: the pairs SPEC's bound is taken at."""
    return prologue_reference(qkv.detach(), None, **dict(ref, rotate=False))


def _assert_outputs(outs, qkv, pos, ref, rotation, what, dtype):
    r, style = rotation
    expected = prologue_reference(qkv, pos, **ref)
    normed = _normalised(qkv, ref)
    for out, want, x, name, weight in zip(outs[:2], expected, normed, "qk", ("q_weight", "k_weight")):
        assert out.dtype == dtype and out.shape == want.shape
        assert_rope_close(out, want, x, rotary_dim=r, style=style, what=f"{what} {name}",
                          passthrough_exact=ref[weight] is None)
    assert_bitwise_equal(outs[2].to(torch.float64), expected[2], f"{what} v")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(_CASES))
def test_forward_matches_reference(isa, name, dtype):
    qkv, pos, api, ref, rotation = _inputs(name, dtype, seed=1)
    inplace = _CASES[name][-1]
    before = qkv.clone()
    outs = rope_ops.qkv_prologue(qkv, pos, inplace=inplace, backend="cpu", **api)
    if inplace:
        assert outs[0].data_ptr() == qkv.data_ptr()
        assert_bitwise_equal(outs[2], _normalised(before, ref)[2].to(dtype), "v untouched in place")
    else:
        assert all(t.is_contiguous() for t in outs)
        assert_bitwise_equal(qkv, before, "qkv after an out-of-place call")
    _assert_outputs(outs, before, pos, ref, rotation, f"{isa} {name}", dtype)


def _reference_grads(qkv, pos, ref, grads):
    x = qkv.detach().to(torch.float64).requires_grad_(True)
    weights = {k: None if ref[k] is None else ref[k].detach().to(torch.float64).requires_grad_(True)
               for k in ("q_weight", "k_weight")}
    outs = prologue_reference(x, pos, **{**ref, **weights})
    torch.autograd.backward(outs, [g.to(torch.float64) for g in grads])
    return x.grad, *(None if w is None else w.grad for w in weights.values())


def _assert_grad_close(got, want, dtype, what, rel=1e-5):
    """SPEC: within 1e-5 relative (of the largest reference element) plus one ulp of the dtype."""
    got64, want64 = got.detach().to(torch.float64), want.detach().to(torch.float64)
    bound = rel * want64.abs().max().clamp_min(1.0) + ulp(want64, dtype)
    err = (got64 - want64).abs()
    assert not (err > bound).any(), f"{what}: {int((err > bound).sum())} elements out of bounds, " \
                                    f"worst {err.max().item():.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", _BACKWARD)
def test_backward_matches_reference_autograd(isa, name, dtype):
    qkv, pos, api, ref, _ = _inputs(name, dtype, seed=2)
    x = qkv.detach().clone().requires_grad_(True)
    weights = {k: None if api[k] is None else api[k].detach().clone().requires_grad_(True)
               for k in ("q_norm", "k_norm")}
    outs = rope_ops.qkv_prologue(x, pos, backend="cpu", **{**api, **weights})
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(t.shape, generator=gen).to(dtype) for t in outs]
    torch.autograd.backward(outs, grads)
    want_x, want_qw, want_kw = _reference_grads(qkv, pos, ref, grads)
    _assert_grad_close(x.grad, want_x, dtype, f"{isa} {name} d qkv")
    for key, want in (("q_norm", want_qw), ("k_norm", want_kw)):
        if weights[key] is not None:
            assert weights[key].grad.dtype == weights[key].dtype
            _assert_grad_close(weights[key].grad.float(), want, weights[key].dtype,
                               f"{isa} {name} d {key}", rel=1e-4)


# ---------------------------------------------------------------------------------------------
# The backend called directly (what rope_ops' validation keeps from reaching the kernels).


def _args(name, dtype, seed, lead=None, **changes) -> tuple[PrologueArgs, dict]:
    """The PrologueArgs rope_ops would pass for case ``name`` (a case rotating with its rope's
    tables, or not rotating), and the reference's keyword arguments."""
    qkv, pos, api, ref, _ = _inputs(name, dtype, seed, lead)
    layout, hq, hk, d, r, style, *_ = _CASES[name]
    rotate = api.get("rotate", True)
    assert "mrope_section" not in api and ("rope" in api or not rotate), name
    if rotate:
        cos, sin, freq_turns, factor = api["rope"].tables(torch.device("cpu"))
    else:
        cos = sin = torch.empty(0, 1)
        freq_turns, factor = None, 1.0
    lead_shape = tuple(qkv.shape[:-1])
    outs = tuple(torch.empty(*lead_shape, h, d, dtype=dtype) for h in (hq, hk, hk))
    args = PrologueArgs(qkv, *outs, pos if isinstance(pos, torch.Tensor) else None,
                        pos if isinstance(pos, int) else 0, cos, sin, freq_turns, factor, layout, hq,
                        hk, d, r, style == "gptj", rotate, api["q_norm"], api["k_norm"], 1e-6,
                        api["norm_offset"], False, None, None, None, 1.0, 1.0)
    return args._replace(**changes), ref


@pytest.mark.parametrize("cache_dtype", ["same", "float8"])
def test_cache_write_skips_out_of_range_slots(isa, cache_dtype):
    """Slots -1 and outside [0, num_slots) (which rope_ops refuses for CPU slots, so only a direct
    call reaches them) are skipped: guard rows around the cache stay as they were, rows of
    other slots too; written rows hold the returned k and v (or their float8 of value/scale)."""
    if cache_dtype == "float8" and FP8 is None:
        pytest.skip("no float8 in this torch")
    dtype = torch.bfloat16
    n_slots, guard = 24, 4
    args, ref = _args("qwen3_thd_past_table", dtype, seed=4)
    hk, d = args.num_kv_heads, args.head_dim
    store = FP8 if cache_dtype == "float8" else dtype
    gen = torch.Generator().manual_seed(5)
    buffers = [torch.randn(n_slots + 2 * guard, hk, d, generator=gen).to(store) for _ in range(2)]
    before = [b.clone() for b in buffers]
    k_cache, v_cache = (b[guard:guard + n_slots] for b in buffers)
    tokens = args.qkv.shape[0]
    slots = torch.randperm(n_slots, generator=gen)[:tokens].clone()
    slots[[1, 4, 6, 9]] = torch.tensor([-1, -guard, n_slots, n_slots + guard - 1])
    slots[11] = 2**40
    scales = (0.5, 4.0) if cache_dtype == "float8" else (1.0, 1.0)
    args = args._replace(k_cache=k_cache, v_cache=v_cache, slots=slots, k_scale=scales[0],
                         v_scale=scales[1])
    cpu_backend.CpuBackend().run_prologue(args)
    valid = (slots >= 0) & (slots < n_slots)
    written = torch.zeros(n_slots + 2 * guard, dtype=torch.bool)
    written[slots[valid] + guard] = True
    for buffer, old, name in zip(buffers, before, "kv"):
        assert_bitwise_equal(buffer[~written].view(torch.uint8), old[~written].view(torch.uint8),
                             f"{name} cache rows not written to")
    for cache, out, scale, name in ((k_cache, args.k_out, scales[0], "k"), (v_cache, args.v_out, scales[1], "v")):
        got = cache[slots[valid]]
        if cache_dtype == "same":
            assert_bitwise_equal(got, out[valid], f"{name} cache rows")
        else:
            want = prologue_reference(args.qkv, args.pos, **ref)[1 if name == "k" else 2][valid] / scale
            err = (got.to(torch.float64) - want).abs()
            # one rounding of value / scale: half an e4m3 ulp (3 mantissa bits; 2^-10 below 2^-6),
            # with room for the float32 value's own error at a tie
            assert (err <= (want.abs() * 2.0**-4 + 2.0**-10) * 1.001).all(), f"float8 {name} cache"


@pytest.mark.skipif(FP8 is None, reason="no float8 in this torch")
def test_float8_cache_rounding(isa):
    check_float8_cache("cpu")


@pytest.mark.skipif(FP8 is None, reason="no float8 in this torch")
def test_float8_cache_rounding_on_the_torch_backend():
    check_float8_cache("torch")


@pytest.mark.skipif(FP8 is None, reason="no float8 in this torch")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(_CASES))
def test_float8_q_is_float8_of_the_float32_q(isa, name, dtype):
    """q_scale: q is the torch backend's float8 of the float32 q (what a float32 qkv of the same
    values returns: the kernels compute in float32 from exact loads), bit for bit; k and v are
    those of the call without q_scale. Each case out of place (a float8 q never is in place)."""
    qkv, pos, api, _, _ = _inputs(name, dtype, seed=15)
    before = qkv.clone()
    with torch.inference_mode():
        for q_scale in (0.25, 0.004, 1 / 3):
            q8, k, v = rope_ops.qkv_prologue(qkv, pos, q_scale=q_scale, backend="cpu", **api)
            _, k_plain, v_plain = rope_ops.qkv_prologue(qkv, pos, backend="cpu", **api)
            q32, _, _ = rope_ops.qkv_prologue(qkv.float(), pos, backend="cpu", **api)
            assert q8.dtype == FP8 and q8.shape == q32.shape and q8.is_contiguous()
            assert_bitwise_equal(q8.view(torch.uint8), _float8_of(q32, q_scale).view(torch.uint8),
                                 f"{isa} {name} float8 q, q_scale {q_scale}")
            assert_bitwise_equal(k, k_plain, f"{isa} {name} k beside a float8 q")
            assert_bitwise_equal(v, v_plain, f"{isa} {name} v beside a float8 q")
    assert_bitwise_equal(qkv, before, "qkv after a float8 q")


@pytest.mark.skipif(FP8 is None, reason="no float8 in this torch")
def test_float8_q_rounding(isa):
    """The float8 q's rounding, bit for bit (check_float8_q)."""
    check_float8_q("cpu", isa)


def test_cache_through_the_api_paged_and_in_place(isa):
    """A paged cache [blocks, block_size, Hk, D] taken as its flat view, written by an in-place
    call: the rows hold the in-place k and the (untouched) v; -1 skips."""
    dtype = torch.float16
    qkv, pos, api, ref, rotation = _inputs("caller_tables_d72_inplace", dtype, seed=7)
    hk, d = api["num_kv_heads"], api["head_dim"]
    k_cache = torch.zeros(5, 8, hk, d, dtype=dtype)
    v_cache = torch.zeros(5, 8, hk, d, dtype=dtype)
    slots = torch.randperm(40)[: qkv.shape[0] * qkv.shape[1]].reshape(qkv.shape[:2])
    slots[0, 3] = -1
    before = qkv.clone()
    with torch.inference_mode():
        q, k, v = rope_ops.qkv_prologue(qkv, pos, inplace=True, kv_cache=(k_cache, v_cache),
                                        slots=slots, backend="cpu", **api)
    _assert_outputs((q, k, v), before, pos, ref, rotation, f"{isa} in place", dtype)
    flat_k, flat_v = k_cache.view(40, hk, d), v_cache.view(40, hk, d)
    keep = slots >= 0
    assert_bitwise_equal(flat_k[slots[keep]], k[keep], "k cache")
    assert_bitwise_equal(flat_v[slots[keep]], v[keep], "v cache")
    unused = torch.ones(40, dtype=torch.bool)
    unused[slots[keep]] = False
    assert not flat_k[unused].any() and not flat_v[unused].any()


def test_absent_and_strided_output_gradients(isa):
    """Output gradients that are None (zero), broadcast (stride 0) or without stride 1 on
    head_dim: the same as the torch ops' backward given the dense equivalents."""
    dtype = torch.float32
    args, _ = _args("qwen3_thd_past_table", dtype, seed=8)
    hq, hk, d = args.num_q_heads, args.num_kv_heads, args.head_dim
    tokens = args.qkv.shape[0]
    gen = torch.Generator().manual_seed(9)
    grad_q = torch.randn(tokens, hq, 2 * d, generator=gen)[..., ::2]  # stride 2 on head_dim
    grad_v = torch.randn(1, hk, d, generator=gen).expand(tokens, hk, d)  # stride 0 over tokens
    backend = cpu_backend.CpuBackend()
    for given in ((grad_q, None, grad_v), (None, grad_q[:, :hk], None), (None, None, None)):
        got = backend.run_prologue_backward(args, *given)
        want = prologue_backward_torch(args, *[None if g is None else g.contiguous() for g in given])
        _assert_grad_close(got[0], want[0], dtype, f"{isa} d qkv")
        for g, w, name in zip(got[1:], want[1:], ("q", "k")):
            assert g.dtype == torch.float32 and g.shape == (d,), name
            _assert_grad_close(g, w, torch.float32, f"{isa} d {name} weight", rel=1e-4)
        if given[0] is None:
            assert not got[0][:, : hq * d].any(), "q part of grad_qkv without grad_q"


def test_threads_do_not_change_any_bit(backend):
    """Forward and backward (weight gradients included) give the same bits on one thread and on
    several, over enough tokens for many chunks and blocks."""
    dtype = torch.bfloat16
    args, _ = _args("mqa_gemma_gptj_offset", dtype, seed=10, lead=(3, 97))
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(t.shape, generator=gen).to(dtype) for t in (args.q_out, args.k_out, args.v_out)]
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, max(2, threads), 3):
            torch.set_num_threads(n)
            outs = tuple(torch.empty_like(t) for t in (args.q_out, args.k_out, args.v_out))
            backend.run_prologue(args._replace(q_out=outs[0], k_out=outs[1], v_out=outs[2]))
            results.append(outs + tuple(backend.run_prologue_backward(args, *grads)))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b, what in zip(results[0], other, ("q", "k", "v", "d qkv", "d q_weight", "d k_weight")):
            assert_bitwise_equal(a, b, f"{what}: one thread vs several")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["qwen3_thd_past_table", "partial_k_norm_strided_inplace", "norm_only_d34"])
def test_x86_kernels_agree_bit_for_bit(backend, name, dtype):
    """AVX2 (8 lanes), AVX-512 and AVX512_BF16 (16) sum a head's squares and dot products in the
    same 32 lanes and one tree, and fuse the same multiply-adds: the same bits forward and
    backward (float32 outputs show any difference in the sums)."""
    have = cpu_backend.available_isas()
    if "avx512" not in have:
        pytest.skip(f"needs AVX2 and AVX-512 (this CPU has {have})")
    args, _ = _args(name, dtype, seed=12)
    gen = torch.Generator().manual_seed(13)
    grads = [torch.randn(t.shape, generator=gen).to(dtype) for t in (args.q_out, args.k_out, args.v_out)]
    results = {}
    for isa_name in have[1:]:
        with cpu_backend.use_isa(isa_name):
            outs = tuple(torch.empty_like(t) for t in (args.q_out, args.k_out, args.v_out))
            backend.run_prologue(args._replace(q_out=outs[0], k_out=outs[1], v_out=outs[2]))
            results[isa_name] = outs + tuple(t for t in backend.run_prologue_backward(args, *grads)
                                             if t is not None)
    for isa_name in have[2:]:
        for a, b in zip(results["avx2"], results[isa_name]):
            assert_bitwise_equal(a, b, f"avx2 vs {isa_name}")


def test_module_refuses_inconsistent_arguments(backend):
    """The extension's own guards (rope_ops validates first; these catch misuse of the module):
    a clear error, nothing written."""
    args, _ = _args("qwen3_thd_past_table", torch.float32, seed=14)
    module = cpu_backend._module()
    bad = [
        (dict(q_out=args.q_out[:, :1]), "q_out must have shape"),
        (dict(v_out=args.v_out.double()), "v_out must be a CPU tensor of qkv's dtype"),
        (dict(head_dim=64), "last dim"),
        (dict(layout="sbhd"), "thd or bshd"),
        (dict(k_cache=torch.zeros(4, 2, 128)), "needs v_cache and slots"),
        (dict(q_weight=torch.ones(3)), "q_weight must be"),
        (dict(q_scale=0.5), "q_out must be a float8_e4m3fn CPU tensor"),
        (dict(q_scale=-1.0), "q_scale must be"),
        (dict(q_scale=1e-60), "q_scale must be"),  # 0 in float32
    ]
    if FP8 is not None:
        q8 = torch.zeros(args.q_out.shape, dtype=FP8)
        bad += [(dict(q_out=q8), "q_out must be a CPU tensor of qkv's dtype"),
                (dict(q_out=q8, q_scale=0.5, inplace=True), "q_scale must be")]
    for change, message in bad:
        before = args.q_out.clone()
        with pytest.raises(RuntimeError, match=message):
            module.prologue(args._replace(**change), None)
        assert_bitwise_equal(args.q_out, before, f"q_out after a refused call ({message})")


def test_supports_prologue_calls(backend):
    call = rope_ops.backend.RopeCall("cpu", torch.bfloat16, "thd", "neox", 128, 128, 32, 8, False,
                                     torch.int64, False, False, True, op="prologue",
                                     cache_dtype=FP8)
    assert backend.supports(call) == []
    assert backend.supports(call._replace(cache_dtype=torch.bfloat16)) == []
    assert backend.supports(call._replace(cache_dtype=torch.float16)) != []
    if FP8 is not None:
        assert backend.supports(call._replace(q_out_dtype=FP8)) == []
    assert backend.supports(call._replace(q_out_dtype=torch.float16)) != []
