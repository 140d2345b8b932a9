"""The shipped Ascend C prologue kernels (prologue_kernel.h: QKV split + per-head RMSNorm + RoPE +
KV-cache write, and the backward) run in the CPU emulation against rope_ops' float64 reference.

Each case builds PrologueArgs as rope_ops.qkv_prologue would, turns them into the op's views and
tiling as the backend and the host glue do, runs every core in turn (tests/ascend/cpu_sim) and
checks: outputs within SPEC's bound at the normalised pair (docs/spec.md 9.4), pass-through dims of
heads without a norm bit for bit (inf and -0 included), v exact, caches written exactly at valid
slots (-1 and out-of-range slots skipped, every other byte untouched), gradients of qkv and of the
norm weights against float64 autograd, determinism, and the kernel's UB use equal to the tiling's.
"""

from __future__ import annotations

import shutil

import pytest
import torch

import rope_ops
from rope_ops._reference import prologue_reference
from rope_ops.backend import PrologueArgs
from rope_ops.frequencies import freq_turns_of
from rope_ops.testing.checks import assert_bitwise_equal, assert_rope_close
from rope_ops.testing.tolerances import ulp
from rope_ops_backends.ascend_backend import _kernel_call as kc
from rope_ops_backends.ascend_backend import tiling as tl

from ascend import fakes
from ascend.cpu_sim import rope_sim

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def sim():
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    return fakes.load_sim()


def _ids(dtype):
    return str(dtype).split(".")[1]


class Case:
    """One prologue call: inputs, PrologueArgs and the reference's keyword arguments."""

    def __init__(self, *, dtype=torch.float32, layout="thd", hq=4, hk=2, d=64, r=None, style="neox", q_norm=True,
                 k_norm=True, offset=0.0, rotate=True, inplace=False, extra=0, tokens=11, batch=2, seq=6,
                 angles="table", table_rows=32, table_dtype=torch.float32, cache=None, seed=0, pos_high=50,
                 eps=1e-6):
        r = d if r is None else r
        gen = torch.Generator().manual_seed(seed)
        self.hq, self.hk, self.d, self.r, self.style, self.dtype = hq, hk, d, r, style, dtype
        width = (hq + 2 * hk) * d
        lead = (tokens,) if layout == "thd" else (batch, seq)
        b, s = (1, tokens) if layout == "thd" else (batch, seq)
        self.qkv = torch.randn(*lead, width + extra, generator=gen).to(dtype)[..., :width]
        self.q_w = torch.randn(d, generator=gen) * 0.5 + (0.0 if offset else 1.0) if q_norm else None
        self.k_w = torch.randn(d, generator=gen) * 0.5 + (0.0 if offset else 1.0) if k_norm else None
        rope = rope_ops.RotaryEmbedding(d, rotary_dim=r, style=style, max_position=table_rows)
        self.inv = rope.inv_freq
        pos, cos, sin, freq, section, ref_angles = None, torch.empty(0, 1), torch.empty(0, 1), None, None, {}
        if rotate and angles == "table":
            pos = torch.randint(0, pos_high, lead, generator=gen)
            cos, sin = _tables(self.inv, table_rows)
            if table_dtype != torch.float32:  # caller tables in 16 bits: no freq_turns
                cos, sin = cos.to(table_dtype), sin.to(table_dtype)
                pos = pos.clamp_max(table_rows - 1)
                ref_angles = {"cos_sin": (cos, sin)}
            else:
                freq = freq_turns_of(self.inv)
                ref_angles = {"inv_freq": self.inv}
        elif rotate and angles == "cache":  # one [P, r] cos|sin cache, read in place
            pos = torch.randint(0, table_rows, lead, generator=gen)
            c, s_ = _tables(self.inv, table_rows)
            both = torch.cat([c, s_], dim=-1).to(table_dtype)
            cos, sin = both[:, : r // 2], both[:, r // 2:]
            ref_angles = {"cos_sin": (cos, sin)}
        elif rotate and angles == "token":
            a = torch.rand(b, s, r // 2, generator=gen, dtype=torch.float64) * 6.3
            cos, sin = a.cos().to(table_dtype), a.sin().to(table_dtype)
            ref_angles = {"token_cos_sin": (cos[0], sin[0]) if layout == "thd" else (cos, sin)}
        elif rotate and angles == "mrope":
            section = (r // 8, r // 8, r // 2 - 2 * (r // 8))
            pos = torch.randint(-3, pos_high, (3,) + lead, generator=gen)
            pos.view(3, -1)[:, 0] = torch.tensor([2**40 - 1, -(2**39) - 5, 123456789012])  # far past the table
            cos, sin = _tables(self.inv, table_rows)
            freq = freq_turns_of(self.inv)
            # The reference's float64 p * inv_freq is ~1e-4 rad off at 2^40: per-token tables of
            # exactly reduced angles (table rows where the axis's position is inside).
            c, s_ = _mrope_rows(pos.reshape(3, -1), self.inv, section, cos, sin)
            ref_angles = {"token_cos_sin": (c.view(*lead, -1), s_.view(*lead, -1)) if layout != "thd"
                          else (c, s_)}
        self.pos = pos
        self.ref_kw = dict(num_q_heads=hq, num_kv_heads=hk, head_dim=d, q_weight=self.q_w, k_weight=self.k_w,
                           eps=eps, weight_offset=offset, rotate=rotate, rotary_dim=r if rotate else d, style=style,
                           **ref_angles)
        self.caches = cache
        k_cache = v_cache = slots = None
        if cache is not None:
            n_slots, slot_values = cache
            k_cache = torch.randn(n_slots, hk, d, generator=gen).to(dtype)
            v_cache = torch.randn(n_slots, hk, d, generator=gen).to(dtype)
            slots = torch.tensor(slot_values).view(lead)
        self.args = PrologueArgs(
            self.qkv, None, None, None, pos, 0, cos, sin, freq, 1.0, layout, hq, hk, d, r if rotate else d,
            style == "gptj", rotate, self.q_w, self.k_w, eps, offset, inplace, k_cache, v_cache, slots, 1.0, 1.0,
            angles if angles in ("token", "mrope") else "table", section, angles == "mrope")
        if not inplace:
            self.args = self.args._replace(**{name: torch.full((*lead, h, d), float("nan")).to(dtype)
                                              for name, h in (("q_out", hq), ("k_out", hk), ("v_out", hk))})

    def reference(self, qkv=None, **grads):
        return prologue_reference(self.qkv if qkv is None else qkv, self.pos, **{**self.ref_kw, **grads})

    def normalised(self):
        return prologue_reference(self.qkv, None, **{**self.ref_kw, "rotate": False})


def _mrope_rows(positions, inv, section, cos, sin):
    """float64 per-token (c, s) [N, r/2] of mRoPE positions [3, N] (interleaved sections): the
    table's value where the frequency's position is inside it, else the exactly reduced angle."""
    from rope_ops._mrope import mrope_axes
    from rope_ops.frequencies import reduced_angle

    axes = mrope_axes(section, True).tolist()
    c = torch.empty(positions.shape[1], len(axes), dtype=torch.float64)
    s = torch.empty_like(c)
    for j in range(positions.shape[1]):
        for i, (axis, f) in enumerate(zip(axes, inv.tolist())):
            p = int(positions[axis, j])
            if 0 <= p < cos.shape[0]:
                c[j, i], s[j, i] = float(cos[p, i]), float(sin[p, i])
            else:
                angle = reduced_angle(p, f)
                c[j, i], s[j, i] = torch.cos(torch.tensor(angle, dtype=torch.float64)), torch.sin(
                    torch.tensor(angle, dtype=torch.float64))
    return c, s


def _tables(inv, rows):
    from rope_ops.frequencies import cos_sin_table

    c, s = cos_sin_table(inv, 1.0, rows)
    return c.clone(), s.clone()


def run_forward(sim, case: Case, ub=196608, cores=3):
    views = kc.prologue_views(case.args)
    t = tl.compute_tiling(kc.prologue_tiling_params(views, False), ub, cores)
    plan = fakes.prologue_launch(views.q, views.k, views.v, views.q_out, views.k_out, views.v_out,
                                 *views.angles.op_args(), views.rotary_dim, views.interleaved, views.rotate,
                                 views.q_weight, views.k_weight, views.eps, views.weight_offset, views.inplace,
                                 views.k_cache, views.v_cache, views.slots, ub, cores)
    stats = sim.run(rope_sim.PROLOGUE, plan.dtype, plan.tensors, t, tl.pack(t))
    assert stats["ub_peak"] == t["ubBytes"], "kernel UB allocation differs from the tiling's"
    return stats, t


def run_backward(sim, case: Case, grads, ub=196608, cores=3):
    args = case.args
    grad_qkv = torch.full(args.qkv.shape, float("nan")).to(args.qkv.dtype)
    views = kc.prologue_grad_views(args, grad_qkv, *grads)
    sums = [None if w is None else torch.full((cores, args.head_dim), float("nan")) for w in (views.q_weight,
                                                                                             views.k_weight)]
    t = tl.compute_tiling(kc.prologue_tiling_params(views, True), ub, cores)
    plan = fakes.prologue_grad_launch(views.q, views.k, views.v, views.xq, views.xk, views.q_out, views.k_out,
                                      views.v_out, *views.angles.op_args(), views.rotary_dim, views.interleaved,
                                      views.rotate, views.q_weight, views.k_weight, views.eps, views.weight_offset,
                                      sums[0], sums[1], ub, cores)
    stats = sim.run(rope_sim.PROLOGUE_GRAD, plan.dtype, plan.tensors, t, tl.pack(t))
    assert stats["ub_peak"] == t["ubBytes"], "kernel UB allocation differs from the tiling's"
    weight_grads = [None if s is None else s[: t["blockDim"]].sum(0) for s in sums]
    return grad_qkv, weight_grads, t


def check_forward(case: Case, what=""):
    args = case.args
    rq, rk, rv = case.reference()
    nq, nk, _ = case.normalised()
    q, k, v = (args.q_out, args.k_out, args.v_out) if not args.inplace else fakes_inplace_views(case)
    for out, ref, x, weight, name in ((q, rq, nq, case.q_w, "q"), (k, rk, nk, case.k_w, "k")):
        assert_rope_close(out, ref, x, rotary_dim=case.ref_kw["rotary_dim"], style=case.style, what=f"{what} {name}",
                          passthrough_exact=weight is None)
    if not args.inplace:
        assert_bitwise_equal(v.double(), rv, f"{what} v")
    return rq, rk, rv


def fakes_inplace_views(case: Case):
    heads = case.qkv.unflatten(-1, (case.hq + 2 * case.hk, case.d))
    return heads[..., : case.hq, :], heads[..., case.hq: case.hq + case.hk, :], heads[..., case.hq + case.hk:, :]


FORWARD_CASES = {
    "qwen3_thd": dict(),
    "gemma_offset_bshd": dict(layout="bshd", hq=4, hk=1, d=32, offset=1.0),
    "rope_only_gptj": dict(hq=3, hk=1, d=48, style="gptj", q_norm=False, k_norm=False),
    "norm_only": dict(layout="bshd", hq=2, hk=2, d=32, rotate=False),
    "nothing": dict(hq=2, hk=1, d=24, rotate=False, q_norm=False, k_norm=False),
    "k_norm_only_partial_gptj": dict(hq=4, hk=2, d=80, r=32, style="gptj", q_norm=False),
    "odd_head_dim": dict(hq=2, hk=1, d=41, r=40),
    "strided_rows_gqa": dict(hq=8, hk=1, d=96, extra=40, pos_high=200),
    "mqa_bshd_partial_neox": dict(layout="bshd", hq=6, hk=1, d=64, r=16, extra=8),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("name", list(FORWARD_CASES))
def test_forward(sim, name, dtype):
    case = Case(dtype=dtype, seed=1, **FORWARD_CASES[name])
    before = case.qkv.clone()
    run_forward(sim, case)
    check_forward(case, name)
    assert_bitwise_equal(case.qkv, before, "qkv after an out-of-place prologue")


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_in_place(sim, dtype):
    """In place: the normalised, rotated q and k heads written into qkv; v untouched."""
    case = Case(dtype=dtype, inplace=True, extra=24, seed=2, hq=4, hk=2, d=48, q_norm=False)
    before = case.qkv.clone()
    rq, rk, rv = case.reference(before)
    nq, nk, _ = prologue_reference(before, None, **{**case.ref_kw, "rotate": False})
    run_forward(sim, case)
    q, k, v = fakes_inplace_views(case)
    assert_rope_close(q, rq, nq, rotary_dim=48, style="neox", what="q in place")
    assert_rope_close(k, rk, nk, rotary_dim=48, style="neox", what="k in place", passthrough_exact=False)
    assert_bitwise_equal(v.double(), rv, "v untouched in place")


def test_pass_through_dims_exact_without_a_norm(sim):
    """A head without a norm: its pass-through dims come out bit for bit (inf, -0 and NaN kept),
    although the kernel rotates whole heads (C = 1, S' = -0, a zero partner)."""
    case = Case(dtype=torch.float32, d=40, r=16, q_norm=False, k_norm=False, seed=3, hq=2, hk=1)
    tail = case.qkv.unflatten(-1, (4, 40))[..., 16:]
    tail[0, 0, :4] = torch.tensor([float("inf"), -float("inf"), -0.0, float("nan")])
    run_forward(sim, case)
    got = case.args.q_out[..., 16:]
    want = case.qkv.unflatten(-1, (4, 40))[..., :2, 16:]
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    assert_bitwise_equal(got, want, "pass-through dims")


@pytest.mark.parametrize("angles,table_dtype", [("token", torch.float32), ("token", torch.bfloat16),
                                                ("mrope", torch.float32), ("table", torch.float16),
                                                ("cache", torch.float32), ("cache", torch.bfloat16)])
@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_every_angle_source(sim, angles, table_dtype, layout):
    """The prologue with each cos/sin source: per-token rows, mRoPE (positions to 2^40), fp16
    tables by position, one cos|sin cache (fp32, bf16)."""
    case = Case(dtype=torch.bfloat16, layout=layout, angles=angles, table_dtype=table_dtype, seed=4, d=64, r=48,
                style="gptj", k_norm=False)
    run_forward(sim, case, ub=32768, cores=2)
    check_forward(case, f"{angles} {table_dtype}")


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_cache_writes(sim, dtype, slot_dtype):
    """Rotated k and v land in the caches at their slots; -1 and slots outside the cache are
    skipped; nothing else of the caches changes; the cached k equals the returned k."""
    n_slots = 16
    slots = [3, -1, 0, 15, 16, 7, 2**31 - 1 if slot_dtype == torch.int32 else 2**40, 9, -5, 11, 1]
    case = Case(dtype=dtype, cache=(n_slots, slots), seed=5, hq=4, hk=2, d=32)
    case.args = case.args._replace(slots=case.args.slots.to(slot_dtype))
    k_before, v_before = case.args.k_cache.clone(), case.args.v_cache.clone()
    run_forward(sim, case, cores=4)
    _, rk, rv = check_forward(case, "cache")
    valid = [(t, s) for t, s in enumerate(slots) if 0 <= s < n_slots]
    written = torch.zeros(n_slots, dtype=torch.bool)
    for t, s in valid:
        written[s] = True
        assert_bitwise_equal(case.args.k_cache[s], case.args.k_out[t], f"k cache slot {s}")
        assert_bitwise_equal(case.args.v_cache[s].double(), rv[t], f"v cache slot {s}")
    assert_bitwise_equal(case.args.k_cache[~written], k_before[~written], "k cache rows of other slots")
    assert_bitwise_equal(case.args.v_cache[~written], v_before[~written], "v cache rows of other slots")


def test_cache_write_in_place_and_paged_view(sim):
    """In place with a cache: qkv's q and k heads rewritten, v heads untouched and cached; the
    caches are row-strided views (a paged cache's flat view of a wider allocation)."""
    slots = [5, 6, -1, 30, 2, 0, 1, 3, 4, 7, 8]
    case = Case(dtype=torch.float16, cache=(32, slots), inplace=True, seed=6, hq=2, hk=2, d=32, extra=16)
    wide_k, wide_v = torch.zeros(32, 2, 48, dtype=torch.float16), torch.zeros(32, 2, 48, dtype=torch.float16)
    case.args = case.args._replace(k_cache=wide_k[..., :32], v_cache=wide_v[..., 8:40])
    before = case.qkv.clone()
    _, rk, rv = case.reference(before)
    run_forward(sim, case, cores=2)
    _, k, v = fakes_inplace_views(case)
    assert_bitwise_equal(v, before.unflatten(-1, (6, 32))[:, 4:], "v heads in place")
    for t, s in enumerate(slots):
        if 0 <= s < 32:
            assert_bitwise_equal(wide_k[s, :, :32], k[t], f"k cache slot {s}")
            assert_bitwise_equal(wide_v[s, :, 8:40].double(), rv[t], f"v cache slot {s}")
    assert not wide_k[..., 32:].any() and not wide_v[..., :8].any() and not wide_v[..., 40:].any()


def test_many_tiles_and_cores(sim):
    """A UB that holds two rows: every core walks several tiles across batch entries."""
    case = Case(dtype=torch.bfloat16, layout="bshd", batch=3, seq=7, d=64, seed=7, hq=2, hk=1)
    probe = tl.compute_tiling(kc.prologue_tiling_params(kc.prologue_views(case.args), False), 196608, 1)
    _, t = run_forward(sim, case, ub=tl.UB_RESERVE + probe["fixedBytes"] + 2 * probe["rowBytes"], cores=3)
    assert t["tileRows"] == 2 and t["formerRows"] > 2 * t["tileRows"]
    check_forward(case, "tiles")


# ------------------------------------------------------------------------------ backward
def _assert_grad_close(got, ref, dtype, what, rel=1e-5):
    got64, ref64 = got.detach().double(), ref.detach().double()
    scale = ref64.abs().max().clamp_min(1.0)
    bound = rel * scale + ulp(ref64, dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32)
    bad = (got64 - ref64).abs() > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} out of bounds, worst {(got64 - ref64).abs().max()}"


BACKWARD_CASES = {
    "qwen3_thd": dict(),
    "gemma_offset_bshd": dict(layout="bshd", hq=4, hk=1, d=32, offset=1.0),
    "k_norm_only_partial_gptj": dict(hq=4, hk=2, d=80, r=32, style="gptj", q_norm=False),
    "norm_only": dict(layout="bshd", hq=2, hk=2, d=32, rotate=False),
    "rope_only_mrope": dict(hq=3, hk=1, d=48, q_norm=False, k_norm=False, angles="mrope"),
    "odd_head_dim_token": dict(hq=2, hk=1, d=41, r=40, angles="token"),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("name", list(BACKWARD_CASES))
def test_backward(sim, name, dtype):
    """Gradients of qkv and of both norm weights (per-core sums, several cores and tiles)
    against float64 autograd of the reference."""
    case = Case(dtype=dtype, seed=8, **BACKWARD_CASES[name])
    gen = torch.Generator().manual_seed(9)
    lead = case.qkv.shape[:-1]
    grads = [torch.randn(*lead, h, case.d, generator=gen).to(dtype) for h in (case.hq, case.hk, case.hk)]
    grad_qkv, (gqw, gkw), t = run_backward(sim, case, grads, ub=24576, cores=3)
    assert t["blockDim"] == 3
    x = case.qkv.double().requires_grad_(True)
    ws = {n: None if w is None else w.double().requires_grad_(True)
          for n, w in (("q_weight", case.q_w), ("k_weight", case.k_w))}
    outs = case.reference(x, **ws)
    torch.autograd.backward(outs, [g.double() for g in grads])
    _assert_grad_close(grad_qkv, x.grad, dtype, f"{name} d qkv")
    for got, (n, w) in ((gqw, ("q_weight", case.q_w)), (gkw, ("k_weight", case.k_w))):
        assert (got is None) == (w is None)
        if got is not None:
            _assert_grad_close(got, ws[n].grad, torch.float32, f"{name} d {n}", rel=1e-4)


def test_backward_missing_gradients_and_determinism(sim):
    """Output gradients that are None are zero; the same call twice gives the same bits."""
    case = Case(dtype=torch.float32, seed=10, d=32, hq=3, hk=1)
    gen = torch.Generator().manual_seed(11)
    lead = case.qkv.shape[:-1]
    gk = torch.randn(*lead, 1, 32, generator=gen)
    first, wq, t = run_backward(sim, case, (None, gk, None), cores=4)
    again, wq2, _ = run_backward(sim, case, (None, gk, None), cores=4)
    assert_bitwise_equal(first, again, "grad_qkv of the same call")
    assert_bitwise_equal(wq[1], wq2[1], "k weight gradient of the same call")
    heads = first.unflatten(-1, (5, 32))
    assert not heads[..., :3, :].any() and not heads[..., 4:, :].any(), "missing gradients are zero"
    assert not wq[0].any(), "the q weight gets no gradient without grad_q"
    x = case.qkv.double().requires_grad_(True)
    kw = case.k_w.double().requires_grad_(True)
    _, rk, _ = case.reference(x, k_weight=kw)
    rk.backward(gk.double())
    _assert_grad_close(first, x.grad, torch.float32, "d qkv")
    _assert_grad_close(wq[1], kw.grad, torch.float32, "d k_weight", rel=1e-4)
