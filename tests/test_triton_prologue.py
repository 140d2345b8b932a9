"""The Triton fused prologue (split + per-head RMSNorm + RoPE + KV-cache write) and its backward
against the float64 reference: on hand-built PrologueArgs (what rope_ops' checks never let
through too: slots outside the cache on the device, zero-stride gradients) and through
rope_ops.qkv_prologue with autograd.

    TRITON_INTERPRET=1 pytest tests/test_triton_prologue.py     # CPU, the Triton interpreter

On a machine with a GPU and without the variable, the same checks run on CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch
from _float8_support import FP8, check_float8_cache, float8_saturating, float8_test_values
from _triton_support import DEVICE, INTERPRET, needs_device

pytestmark = needs_device

pytest.importorskip("triton")

import rope_ops  # noqa: E402
from rope_ops._reference import prologue_reference  # noqa: E402
from rope_ops.backend import PrologueArgs  # noqa: E402
from rope_ops.frequencies import compute_inv_freq, cos_sin_table, freq_turns_of  # noqa: E402
from rope_ops.testing.checks import assert_bitwise_equal, assert_rope_close  # noqa: E402
from rope_ops.testing.tolerances import ulp  # noqa: E402

import rope_ops_backends.triton_backend as tb  # noqa: E402
from rope_ops_backends.triton_backend import prologue as tp  # noqa: E402

N_ROWS = 48  # table rows: the cases' positions go past them


class Case:
    """One prologue call: inputs, its PrologueArgs (outputs allocated) and reference keywords."""

    def __init__(self, *, layout="thd", lead=(13,), hq=3, hk=1, D=48, R=None, style="neox",
                 dtype=torch.bfloat16, q_norm=True, k_norm=True, offset=0.0, rotate=True,
                 angles="table", caller=False, inplace=False, cache=None, extra_cols=0,
                 section=(8, 8, 8), interleaved_mrope=False, weight_dtype=torch.float32,
                 q_scale=0.0, seed=0):
        R = D if R is None else R
        gen = torch.Generator().manual_seed(seed)
        width = (hq + 2 * hk) * D
        buf = torch.randn(*lead, width + extra_cols, generator=gen).to(dtype).to(DEVICE)
        self.qkv = buf[..., :width]
        self.before = self.qkv.clone()

        def weight(on):
            if not on:
                return None
            w = torch.randn(D, generator=gen) * 0.5 + (0.0 if offset else 1.0)
            return w.to(weight_dtype).to(DEVICE)

        self.q_w, self.k_w = weight(q_norm), weight(k_norm)
        inv_freq = compute_inv_freq(R if rotate else 2, 10000.0)[0]
        cos, sin = (t.to(DEVICE) for t in cos_sin_table(inv_freq, 1.0, N_ROWS))
        turns = None if caller else freq_turns_of(inv_freq).to(DEVICE)
        pos = None
        ref_angles = {"inv_freq": inv_freq}
        if caller:
            ref_angles = {"cos_sin": (cos, sin)}
        if rotate and angles == "table":
            pos = torch.randint(-10, N_ROWS + 30, lead, generator=gen).to(DEVICE)
        elif rotate and angles == "mrope":
            pos = torch.randint(0, N_ROWS + 30, (3, *lead), generator=gen).to(DEVICE)
            ref_angles.update(mrope_section=section, mrope_interleaved=interleaved_mrope)
        elif rotate and angles == "token":
            b, s = (1, lead[0]) if layout == "thd" else lead
            ang = torch.rand(1, s, R // 2, generator=gen, dtype=torch.float64) * 6.3
            cos = ang.cos().to(torch.bfloat16).to(DEVICE).expand(b, s, R // 2)
            sin = ang.sin().to(torch.bfloat16).to(DEVICE).expand(b, s, R // 2)
            turns = None
            ref_angles = {"token_cos_sin": (cos, sin)}
        if not rotate:
            cos = sin = torch.empty(0, 1, device=DEVICE)
            turns = None
        self.k_cache = self.v_cache = self.slots = None
        if cache is not None:
            n_tokens = self.qkv.numel() // width
            n_slots = n_tokens + 8
            self.k_cache = torch.randn(n_slots, hk, D, generator=gen).to(cache).to(DEVICE)
            self.v_cache = torch.randn(n_slots, hk, D, generator=gen).to(cache).to(DEVICE)
            slots = torch.randperm(n_slots, generator=gen)[:n_tokens]  # distinct: one writer each
            slots[1] = -1
            slots[2] = n_slots + 3  # outside the cache: skipped (the device path)
            slots[3] = -(1 << 40)
            self.slots = slots.reshape(lead).to(DEVICE)
            self.cache_before = (self.k_cache.clone(), self.v_cache.clone())
        scales = (0.5, 2.0) if cache is FP8 else (1.0, 1.0)
        outs = [None if inplace else torch.empty(*lead, h, D, dtype=t, device=DEVICE)
                for h, t in ((hq, FP8 if q_scale else dtype), (hk, dtype), (hk, dtype))]
        self.args = PrologueArgs(
            qkv=self.qkv, q_out=outs[0], k_out=outs[1], v_out=outs[2], pos=pos, pos_offset=0,
            cos=cos, sin=sin, freq_turns=turns, attention_factor=1.0, layout=layout,
            num_q_heads=hq, num_kv_heads=hk, head_dim=D, rotary_dim=R,
            interleaved=style == "gptj", rotate=rotate, q_weight=self.q_w, k_weight=self.k_w,
            eps=1e-6, weight_offset=offset, inplace=inplace, k_cache=self.k_cache,
            v_cache=self.v_cache, slots=self.slots, k_scale=scales[0], v_scale=scales[1],
            angles=angles, mrope_section=section if angles == "mrope" else None,
            mrope_interleaved=interleaved_mrope, q_scale=q_scale)
        self.ref_kw = dict(num_q_heads=hq, num_kv_heads=hk, head_dim=D, q_weight=self.q_w,
                           k_weight=self.k_w, eps=1e-6, weight_offset=offset, rotate=rotate,
                           rotary_dim=R, style=style, **ref_angles)
        self.R, self.style, self.dtype = R, style, dtype

    def outputs(self):
        if self.args.inplace:
            hq, hk, d = self.args.num_q_heads, self.args.num_kv_heads, self.args.head_dim
            heads = self.qkv.unflatten(-1, (hq + 2 * hk, d))
            return heads[..., :hq, :], heads[..., hq:hq + hk, :], heads[..., hq + hk:, :]
        return self.args.q_out, self.args.k_out, self.args.v_out

    def check_forward(self, what):
        ref_q, ref_k, ref_v = prologue_reference(self.before, self.args.pos, **self.ref_kw)
        norm_q, norm_k, _ = prologue_reference(self.before, None,
                                               **{**self.ref_kw, "rotate": False})
        R = self.R if self.args.rotate else 0
        q, k, v = self.outputs()
        for out, ref, x, w, name in ((q, ref_q, norm_q, self.q_w, "q"),
                                     (k, ref_k, norm_k, self.k_w, "k")):
            assert_rope_close(out, ref, x, rotary_dim=R, style=self.style, what=f"{what} {name}",
                              passthrough_exact=w is None)
        assert_bitwise_equal(v.to("cpu", torch.float64), ref_v, f"{what} v")
        if not self.args.inplace:
            assert_bitwise_equal(self.qkv, self.before, f"{what}: qkv untouched")
        return ref_k, ref_v, norm_k


def run_forward(case: Case, label=None):
    tp.run_prologue(case.args, label)


# name -> Case keywords
FORWARD_CASES = {
    "qwen3 thd bf16 (pieces 16 + 8)": dict(),
    "bshd fp16 gptj partial r32 of 80, k norm only, gemma offset": dict(
        layout="bshd", lead=(2, 5), hq=4, hk=2, D=80, R=32, style="gptj", dtype=torch.float16,
        q_norm=False, offset=1.0),
    "norm only, odd head_dim 41 fp32": dict(D=41, rotate=False, dtype=torch.float32,
                                            lead=(6,), hq=2, hk=2),
    "rope only (no norm) in place, strided rows": dict(q_norm=False, k_norm=False, inplace=True,
                                                       extra_cols=24),
    "norm + rope in place, bf16 weights": dict(inplace=True, weight_dtype=torch.bfloat16,
                                               style="gptj", D=40, R=40),
    "per-token cos/sin bshd": dict(layout="bshd", lead=(2, 4), angles="token", D=32),
    "mRoPE interleaved thd": dict(angles="mrope", D=48, section=(8, 8, 8), interleaved_mrope=True),
    "caller tables: NaN rows past them": dict(caller=True, D=32, hq=2),
    "MQA 7 q heads, one kv head": dict(hq=7, hk=1, D=16, lead=(9,)),
}


@pytest.mark.parametrize("name", list(FORWARD_CASES))
def test_forward(name):
    case = Case(seed=1, **FORWARD_CASES[name])
    run_forward(case)
    case.check_forward(name)


@pytest.mark.parametrize("label",
                         ["walk t2 hq2 hk1 w1", "grid t1 hq2 hk1 w2", "grid t4 hq4 hk1 w4"])
def test_forward_both_grids(label):
    """The token walk and the head grid (q, k and v chunks as separate programs), chunks that
    pad heads (3 q heads in chunks of 2 or 4)."""
    case = Case(seed=2, lead=(7,), cache=torch.bfloat16)
    run_forward(case, label)
    case.check_forward(label)
    check_cache(case, label)


def check_cache(case: Case, what):
    """Rotated k and v at their slots, in the cache's dtype (float8: value / scale, one
    rounding); slots outside [0, n_slots) skipped; other rows untouched."""
    ref_k, ref_v, norm_k = prologue_reference(case.before, case.args.pos, **case.ref_kw)[1:] + \
        (prologue_reference(case.before, None, **{**case.ref_kw, "rotate": False})[1],)
    n_slots = case.k_cache.shape[0]
    slots = case.slots.reshape(-1).cpu()
    keep = (slots >= 0) & (slots < n_slots)
    untouched = torch.ones(n_slots, dtype=torch.bool)
    untouched[slots[keep]] = False
    for cache, before, name in ((case.k_cache, case.cache_before[0], "k"),
                                (case.v_cache, case.cache_before[1], "v")):
        assert_bitwise_equal(cache.cpu()[untouched].float(), before.cpu()[untouched].float(),
                             f"{what}: {name} cache rows of other slots")
    hk, d = case.args.num_kv_heads, case.args.head_dim
    got_k = case.k_cache.cpu()[slots[keep]].to(torch.float64)
    got_v = case.v_cache.cpu()[slots[keep]].to(torch.float64)
    flat = (lambda t: t.reshape(-1, hk, d)[keep])
    if case.k_cache.dtype == FP8:
        for got, ref, scale, name in ((got_k, flat(ref_k), case.args.k_scale, "k"),
                                      (got_v, flat(ref_v), case.args.v_scale, "v")):
            want = ref / scale
            # one rounding to e4m3 (3 mantissa bits): half an ulp, 2^-10 absolute below normals
            bound = want.abs() * 2.0 ** -4 + 2.0 ** -10
            assert ((got - want).abs() <= bound).all(), f"{what}: fp8 {name} cache"
            torch_bits = want.to(torch.float32).to(FP8).to(torch.float64)
            assert (got != torch_bits).float().mean() < 0.01, f"{what}: fp8 {name} rounding"
    else:
        assert_rope_close(got_k, flat(ref_k), flat(norm_k), rotary_dim=case.R, style=case.style,
                          what=f"{what} k cache", dtype=case.k_cache.dtype, passthrough_exact=False)
        assert_bitwise_equal(got_v, flat(ref_v), f"{what} v cache")
        if not case.args.inplace:
            k_out = case.args.k_out.reshape(-1, hk, d)[keep.to(DEVICE)]
            assert_bitwise_equal(case.k_cache[case.slots.reshape(-1)[keep.to(DEVICE)]], k_out,
                                 f"{what}: the k cache equals the returned k")


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "in_place"])
def test_cache_write(cache, inplace):
    if cache == "fp8" and FP8 is None:
        pytest.skip("no float8 in this torch")
    dtype = torch.bfloat16 if cache == "bf16" else FP8
    case = Case(seed=3, layout="bshd", lead=(2, 6), hq=4, hk=2, D=32, cache=dtype, inplace=inplace)
    run_forward(case)
    case.check_forward(f"{cache} cache")
    check_cache(case, f"{cache} cache")


# ---------------------------------------------------------------------------------------------
# Backward.


def assert_grad_close(got, ref, dtype, what, rel=1e-5):
    """Within rel of the largest reference element plus one ulp of the dtype (the suite's
    prologue bound)."""
    got64 = got.detach().to("cpu", torch.float64)
    scale = ref.abs().max().clamp_min(1.0)
    low_precision = dtype in (torch.bfloat16, torch.float16)
    bound = rel * scale + ulp(ref, dtype if low_precision else torch.float32)
    err = (got64 - ref).abs()
    assert not (err > bound).any(), f"{what}: worst error {err.max().item():.3g}"


def reference_backward(case: Case, grads):
    """float64 autograd of the reference: (d qkv, d q_weight, d k_weight)."""
    x = case.before.detach().to("cpu", torch.float64).requires_grad_(True)
    ws = {name: None if w is None else w.detach().to("cpu", torch.float64).requires_grad_(True)
          for name, w in (("q_weight", case.q_w), ("k_weight", case.k_w))}
    pos = case.args.pos
    outs = prologue_reference(x, None if pos is None else pos.cpu(), **{**case.ref_kw, **ws})
    pairs = [(o, g.to("cpu", torch.float64)) for o, g in zip(outs, grads) if g is not None]
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return x.grad, ws["q_weight"], ws["k_weight"]


def assert_backward_matches(got, ref, dtype, what):
    """run_prologue_backward's (d qkv, d q_weight, d k_weight) against reference_backward's:
    d qkv within the dtype's bound, the weights' gradients within float32's."""
    ref_x, ref_qw, ref_kw = ref
    assert_grad_close(got[0], ref_x, dtype, f"{what}: d qkv")
    assert_grad_close(got[1], ref_qw.grad, torch.float32, f"{what}: d q_weight", rel=1e-4)
    assert_grad_close(got[2], ref_kw.grad, torch.float32, f"{what}: d k_weight", rel=1e-4)


# name -> (Case keywords, which gradients are given: q, k, v; label)
BACKWARD_CASES = {
    "qwen3 thd bf16, blocks of tokens per program": (dict(lead=(37,)), "qkv",
                                                     "walk t2 hq2 hk1 w1"),
    "bshd fp32 gptj partial, q and v grads None": (dict(layout="bshd", lead=(2, 5), hq=2, hk=2,
                                                        D=40, R=24, style="gptj",
                                                        dtype=torch.float32, offset=1.0), "k",
                                                   None),
    "norm only, odd head_dim 41, v grad only and k's None": (dict(D=41, rotate=False,
                                                                  dtype=torch.float32,
                                                                  lead=(5,), hq=2, hk=1), "qv",
                                                             None),
    "rope only (no weights)": (dict(q_norm=False, k_norm=False, D=32), "qkv", None),
    "mRoPE chunked, fp16": (dict(angles="mrope", D=48, section=(12, 6, 6), dtype=torch.float16),
                            "qkv", None),
    "per-token cos/sin": (dict(layout="bshd", lead=(2, 3), angles="token", D=32), "qkv", None),
}


@pytest.mark.parametrize("name", list(BACKWARD_CASES))
def test_backward(name):
    kw, given, label = BACKWARD_CASES[name]
    case = Case(seed=4, **kw)
    gen = torch.Generator().manual_seed(5)
    lead, d = case.qkv.shape[:-1], case.args.head_dim
    hq, hk = case.args.num_q_heads, case.args.num_kv_heads
    grads = [torch.randn(*lead, h, d, generator=gen).to(case.dtype).to(DEVICE)
             if n in given else None for h, n in ((hq, "q"), (hk, "k"), (hk, "v"))]
    got = tp.run_prologue_backward(case.args, *grads, label=label)
    ref_x, ref_qw, ref_kw = reference_backward(case, grads)
    assert got[0].shape == case.qkv.shape and got[0].dtype == case.dtype
    assert_grad_close(got[0], ref_x, case.dtype, f"{name}: d qkv")
    for w, g, ref, wname in ((case.q_w, got[1], ref_qw, "q"), (case.k_w, got[2], ref_kw, "k")):
        if w is None:
            assert g is None
            continue
        assert g.dtype == torch.float32 and g.shape == (d,)
        ref_grad = torch.zeros(d, dtype=torch.float64) if ref.grad is None else ref.grad
        assert_grad_close(g, ref_grad, torch.float32, f"{name}: d {wname}_weight", rel=1e-4)


def test_backward_candidates_all_match_the_reference():
    """Every configuration the tooling times for the backward (the policy's first, then its
    neighbours, each fitting the shared-memory budget) gives the reference's gradients."""
    case = Case(seed=7, lead=(9,), hq=4, hk=2, D=32)
    cands = tp.backward_candidates(case.args)
    assert cands[0] == (tp.backward_config(case.args).label(), tp.backward_stages(
        case.args, tp.backward_config(case.args), tp.BACKWARD_STAGES),
        tp.BACKWARD_PROGRAMS_PER_SM)
    assert len(set(cands)) == len(cands) >= 5
    gen = torch.Generator().manual_seed(8)
    grads = [torch.randn(9, h, 32, generator=gen).to(case.dtype).to(DEVICE) for h in (4, 2, 2)]
    ref = reference_backward(case, grads)
    for cand in cands:
        cfg = tb.parse_label(cand.label)
        assert tp.backward_stages(case.args, cfg, cand.stages) == cand.stages
        got = tp.run_prologue_backward(case.args, *grads, label=cand.label,
                                       programs_per_sm=cand.programs_per_sm, stages=cand.stages)
        assert_backward_matches(got, ref, case.dtype, cand.describe())


def test_backward_zero_stride_gradients():
    """Gradients as autograd hands them for a sum (expanded, all strides 0) and transposed
    views: read through their strides."""
    case = Case(seed=6, layout="bshd", lead=(2, 4), hq=2, hk=2, D=32)
    g_q = torch.full((), 0.75).to(case.dtype).to(DEVICE).expand(2, 4, 2, 32)
    g_k = torch.randn(2, 4, 32, 2).to(case.dtype).to(DEVICE).transpose(-1, -2)
    got = tp.run_prologue_backward(case.args, g_q, g_k, None)
    assert_backward_matches(got, reference_backward(case, [g_q, g_k, None]), case.dtype,
                            "strides 0 and transposed")


def test_backward_is_deterministic():
    case = Case(seed=7, lead=(29,))
    gen = torch.Generator().manual_seed(8)
    grads = [torch.randn(29, h, 48, generator=gen).to(case.dtype).to(DEVICE) for h in (3, 1, 1)]
    first = tp.run_prologue_backward(case.args, *grads)
    again = tp.run_prologue_backward(case.args, *grads)
    for a, b, name in zip(first, again, ("d qkv", "d q_weight", "d k_weight")):
        assert_bitwise_equal(a, b, name)


@pytest.mark.parametrize("grid", ["1 per SM", "the policy's per SM", "1 per token"])
def test_backward_any_number_of_programs(grid):
    """The backward's result does not depend on its grid: programs walking many token blocks
    each (under the interpreter's 2 SMs: 68 and 17) or one each (136 programs and partial rows;
    on a 132-SM GPU the policy's 4 per SM is that grid too)."""
    tokens = 136
    case = Case(seed=9, lead=(tokens,), hq=1, hk=1, D=16)
    sm = tb.device_info(case.args.qkv.device).sm_count
    per_sm = {"1 per SM": 1, "the policy's per SM": tp.BACKWARD_PROGRAMS_PER_SM,
              "1 per token": -(-tokens // sm)}[grid]
    gen = torch.Generator().manual_seed(10)
    grads = [torch.randn(tokens, 1, 16, generator=gen).to(case.dtype).to(DEVICE)
             for _ in range(3)]
    label = tp.backward_config(case.args)._replace(block_t=1).label()
    launch = tp.backward_launch(case.args, *grads, label=label, programs_per_sm=per_sm)
    assert launch.programs == min(tokens, per_sm * sm)
    got = tp.run_prologue_backward(case.args, *grads, label=label, programs_per_sm=per_sm)
    assert_backward_matches(got, reference_backward(case, grads), case.dtype, grid)


@pytest.mark.parametrize("rows,d,weights", [(600, 80, (True, True)), (257, 48, (False, True)),
                                             (3, 128, (True, False))])
def test_weight_grad_sums(rows, d, weights):
    """weight_grads adds up the backward's partial rows per column: several 256-row steps, a
    ragged last column block, one weight absent (its gradient None, its partials never read)."""
    gen = torch.Generator().manual_seed(rows)
    partials = [torch.randn(rows if on else 1, d, generator=gen).to(DEVICE) for on in weights]
    ws = [torch.ones(d, device=DEVICE) if on else None for on in weights]
    args = Case(seed=1, lead=(5,)).args._replace(head_dim=d, q_weight=ws[0], k_weight=ws[1])
    got = tp.weight_grads(args, partials, rows)
    for g, p, on in zip(got, partials, weights):
        if not on:
            assert g is None
            continue
        want = p.double().sum(0)
        torch.testing.assert_close(g.double(), want, rtol=0, atol=1e-5 * rows ** 0.5 * 4)


# ---------------------------------------------------------------------------------------------
# Through rope_ops.qkv_prologue: selection, autograd, the variants' arguments.


def test_qkv_prologue_autograd_through_the_backend():
    gen = torch.Generator().manual_seed(9)
    hq, hk, d = 4, 2, 32
    qkv = torch.randn(2, 5, (hq + 2 * hk) * d, generator=gen).to(torch.bfloat16).to(DEVICE)
    qkv.requires_grad_(True)
    q_w = (torch.randn(d, generator=gen) * 0.3 + 1).to(DEVICE).requires_grad_(True)
    k_w = (torch.randn(d, generator=gen) * 0.3 + 1).to(DEVICE).requires_grad_(True)
    pos = torch.randint(0, 40, (3, 2, 5), generator=gen).to(DEVICE)
    rope = rope_ops.RotaryEmbedding(d, max_position=32)
    q, k, v = rope_ops.qkv_prologue(qkv, pos, num_q_heads=hq, num_kv_heads=hk, head_dim=d,
                                    q_norm=q_w, k_norm=k_w, rope=rope, mrope_section=(8, 4, 4),
                                    backend="triton")
    grads = [torch.randn(t.shape, generator=gen).to(t.dtype).to(DEVICE) for t in (q, k, v)]
    torch.autograd.backward((q, k, v), grads)
    x = qkv.detach().to("cpu", torch.float64).requires_grad_(True)
    w64 = [w.detach().to("cpu", torch.float64).requires_grad_(True) for w in (q_w, k_w)]
    ref = prologue_reference(x, pos.cpu(), num_q_heads=hq, num_kv_heads=hk, head_dim=d,
                             q_weight=w64[0], k_weight=w64[1], rotary_dim=d, style="neox",
                             inv_freq=rope.inv_freq, mrope_section=(8, 4, 4))
    for out, r, name in zip((q, k, v), ref, "qkv"):
        assert out.dtype == torch.bfloat16 and out.shape == r.shape, name
    torch.autograd.backward(ref, [g.to("cpu", torch.float64) for g in grads])
    assert_grad_close(qkv.grad, x.grad, torch.bfloat16, "d qkv")
    assert_grad_close(q_w.grad, w64[0].grad, torch.float32, "d q_norm", rel=1e-4)
    assert_grad_close(k_w.grad, w64[1].grad, torch.float32, "d k_norm", rel=1e-4)


def test_backward_stages_fit_the_device():
    """The backward's pipeline stages step down to what one program's shared memory holds: all
    three on an H100-sized device (8 warps), fewer on one with 99 KiB a block (sm_86 / sm_89), none where
    one stage alone would not fit; and the policy's own configuration fits the device the test
    runs on."""
    case = Case(seed=11, lead=(4,), hq=32, hk=8, D=256)
    # chunks of 8 heads, one token a step, 8 warps (a per-warp budget above what 3 stages take):
    # 47 KiB staged per stage (the policy's chunks depend on the device's SMs, so the
    # configuration is fixed here)
    cfg = tp.KernelConfig(False, 1, 8, 8, 8)
    per_stage = tp.staged_bytes(case.args, cfg)
    for shared, want in ((227 * 1024, 3), (99 * 1024, 2), (48 * 1024, 1)):
        device = tb.DeviceInfo(sm_count=132, shared_memory=shared)
        stages = tp.backward_stages(case.args, cfg, 3, device=device)
        assert stages == want, (shared, per_stage, stages)
        assert (stages - 1) * per_stage <= shared - tp.BACKWARD_SHARED_RESERVE
    device = tb.device_info(case.qkv.device)
    for lead in ((4,), (64,), (2, 300)):
        args = Case(seed=12, lead=lead, hq=32, hk=8, D=256).args
        cfg = tp.backward_config(args)
        stages = tp.backward_stages(args, cfg, tp.BACKWARD_STAGES)
        assert 1 <= stages <= tp.BACKWARD_STAGES
        staged = (stages - 1) * tp.staged_bytes(args, cfg)
        assert staged <= device.shared_memory - tp.BACKWARD_SHARED_RESERVE


def test_policy_and_candidates():
    h200 = tb.DeviceInfo(sm_count=132)
    w1 = tb.CallShape(16384, 32, 8, 128, 128, 2, False)
    cfg = tb.launch_policy(w1, h200, rules=tp.PROLOGUE_RULES)
    assert cfg.label() == "walk t4 hq8 hk8 w4"  # 8 KiB chunks, 64 bytes per thread in the walk
    decode = tb.CallShape(64, 32, 8, 128, 128, 2, False)
    cfg = tb.launch_policy(decode, h200, rules=tp.PROLOGUE_RULES)
    assert cfg.head_grid and cfg.num_warps * 32 * 32 == cfg.block_t * cfg.block_hq * 256
    case = Case(seed=10, lead=(64,), hq=8, hk=2, D=64)
    labels = tp.prologue_candidates(case.args)
    assert labels[0] == tb.launch_policy(tp.prologue_shape(case.args),
                                         tb.device_info(case.qkv.device),
                                         rules=tp.PROLOGUE_RULES).label()
    assert len(set(labels)) == len(labels) >= 4
    assert tp.prologue_pieces(0, 41) == (0, 0, 32, 8, 1)  # no rotation: every dim passes
    assert tp.prologue_pieces(32, 80) == (16, 0, 32, 16, 0)


@pytest.mark.skipif(FP8 is None, reason="no float8 in this torch")
def test_float8_cache_rounding_saturates():
    """value / scale rounded to e4m3 bit for bit, saturating at +-448, NaN kept (on a GPU: the
    interpreter's float32 -> e4m3 conversion turns NaN into -256)."""
    check_float8_cache("triton", DEVICE, nan=not INTERPRET)


# ---------------------------------------------------------------------------------------------
# A float8 q (PrologueArgs.q_scale).

Q_FP8_LABELS = ["walk t2 hq2 hk1 w1", "grid t1 hq2 hk1 w2"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8)


@pytest.mark.skipif(FP8 is None, reason="no float8 in this torch")
@pytest.mark.parametrize("q_scale", [0.25, 0.004], ids=["in_range", "saturating"])
@pytest.mark.parametrize("label", Q_FP8_LABELS)
def test_float8_q(label, q_scale):
    """q stored as float8 of q / q_scale (one rounding, saturating at +-448) by the token walk
    and the head grid; k, v and the float8 cache bit for bit as without q_scale."""
    plain = Case(seed=11, lead=(7,), cache=FP8)
    case = Case(seed=11, lead=(7,), cache=FP8, q_scale=q_scale)
    run_forward(plain, label)
    run_forward(case, label)
    for got, want, name in ((case.args.k_out, plain.args.k_out, "k"),
                            (case.args.v_out, plain.args.v_out, "v"),
                            (case.k_cache, plain.k_cache, "k cache"),
                            (case.v_cache, plain.v_cache, "v cache")):
        assert torch.equal(_bits(got), _bits(want)), f"{label}: {name} beside a float8 q"
    ref_q = prologue_reference(case.before, case.args.pos, **case.ref_kw)[0]
    q8 = case.args.q_out
    assert q8.dtype == FP8 and not torch.isnan(q8.cpu().float()).any()
    got = q8.cpu().to(torch.float64)
    want = (ref_q / q_scale).clamp(-448.0, 448.0)
    # one rounding to e4m3 (3 mantissa bits): half an ulp, 2^-10 absolute below normals, plus
    # the float32 math before it
    bound = want.abs() * 2.0 ** -4 + 2.0 ** -9
    assert ((got - want).abs() <= bound).all(), f"{label}: float8 q"
    torch_bits = float8_saturating((ref_q / q_scale).to(torch.float32)).to(torch.float64)
    assert (got != torch_bits).float().mean() < 0.01, f"{label}: float8 q rounding"
    if q_scale < 0.01:
        assert (got.abs() == 448.0).any(), f"{label}: nothing saturated"


@pytest.mark.skipif(FP8 is None, reason="no float8 in this torch")
@pytest.mark.parametrize("label", Q_FP8_LABELS)
def test_float8_q_rounding_bit_for_bit(label):
    """Without norm or rotation q is its input, so with scales of powers of two q / q_scale is
    exact and its float8 is the cache's rounding bit for bit (float8_saturating): ties to even,
    subnormals, saturation; NaN too on a GPU (the interpreter's conversion turns NaN into
    -256)."""
    gen = torch.Generator().manual_seed(12)
    tokens, hq, d = 16, 2, 64
    q = float8_test_values(gen)[: tokens * hq * d].reshape(tokens, hq * d)
    is_nan = torch.isnan(q.float())
    for scale in (1.0, 2.0 ** -6, 2.0 ** 9):
        case = Case(seed=12, lead=(tokens,), hq=hq, hk=1, D=d, rotate=False, q_norm=False,
                    k_norm=False, q_scale=scale)
        qkv = torch.cat([q, torch.randn(tokens, 2 * d, generator=gen).bfloat16()], -1)
        args = case.args._replace(qkv=qkv.to(DEVICE))
        tp.run_prologue(args, label)
        got = args.q_out.cpu().reshape(tokens, hq * d)
        want = float8_saturating(q.float() / scale)
        if not INTERPRET:
            assert torch.equal(torch.isnan(got.float()), is_nan), f"{label}, scale {scale}: NaN"
        assert torch.equal(got.view(torch.uint8)[~is_nan], want.view(torch.uint8)[~is_nan]), \
            f"{label}, scale {scale}"
