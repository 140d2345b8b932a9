"""The shipped Ascend C rotation kernels, run on the CPU against rope_ops._reference (no NPU needed).

ascend_kernels/kernels/*.cpp and rope_kernel.h are compiled unchanged with g++ against
tests/ascend/cpu_sim/kernel_operator.h, a small emulation of the Ascend C APIs they use (GM/UB
bounds and alignment checks, DataCopy/DataCopyPad semantics with 32-byte padding, queue state,
Cast rounding; see that header for what it models and what it does not). Every core's block runs
in turn with the tiling that backends/ascend_backend/tiling.py predicts for the host glue.
Covered: the rotate stage (dtypes, styles, layouts, strides, partial rotary, in place, tiles, core
splits, both copy paths) and the three cos/sin sources: tables by position (float32, float16 and
bfloat16, row-strided: the two halves of one cos|sin cache), cos/sin per token, and mRoPE.
The fused prologue's kernels: tests/test_ascend_prologue_sim.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rope_ops._reference import rope_reference
from rope_ops.testing.tolerances import allowed_error
from rope_ops.backend import KernelArgs
from rope_ops.frequencies import compute_inv_freq, cos_sin_table, freq_turns_of
from rope_ops_backends.ascend_backend import _kernel_call as kc
from rope_ops_backends.ascend_backend import tiling as tl

from ascend import fakes

ROOT = Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
STYLES = ["neox", "gptj"]


@pytest.fixture(scope="module")
def sim():
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    return fakes.load_sim()


def _inv_freq(r, base=10000.0):
    inv = compute_inv_freq(r, base)
    return inv[0] if isinstance(inv, tuple) else inv


# SPEC "Accuracy": the conformance suite's per-element bound.
_allowed = allowed_error


def _make_qk(shape_bshd, layout, dtype, heads, gen):
    b, s, _, d = shape_bshd
    if layout == "thd":
        return torch.randn(b * s, heads, d, generator=gen).to(dtype)
    full = torch.randn(b, s, heads, d, generator=gen).to(dtype)
    if layout == "bshd":
        return full
    if layout == "sbhd":
        return full.transpose(0, 1).contiguous()
    return full.transpose(1, 2).contiguous()  # bhsd


def run_case(sim, *, layout="bshd", style="neox", dtype=torch.float32, B=2, S=7, Hq=3, Hk=2, D=32, r=None,
             pos="offset", offset=0, table_rows=64, caller_tables=False, inverse=False, inplace=False,
             ub=196608, cores=4, packed=False, attention_factor=1.0, seed=0, check_stats=True):
    r = D if r is None else r
    gen = torch.Generator().manual_seed(seed)
    if packed:  # q and k as strided slices of one packed [B, S, Hq+2Hk, D] tensor (bshd)
        qkv = torch.randn(B, S, Hq + 2 * Hk, D, generator=gen).to(dtype)
        q, k = qkv[:, :, :Hq], (qkv[:, :, Hq:Hq + Hk] if Hk else None)
    else:
        q = _make_qk((B, S, Hq, D), layout, dtype, Hq, gen)
        k = _make_qk((B, S, Hk, D), layout, dtype, Hk, gen) if Hk else None
    q0 = q.clone()
    k0 = None if k is None else k.clone()
    inv = _inv_freq(r)
    cos, sin = cos_sin_table(inv, attention_factor, table_rows)
    cos, sin = cos.clone(), sin.clone()  # own storage: the emulator bounds reads to exactly [P, r/2]
    n_tok = B * S
    if pos == "offset":
        p_arg, p_ref = None, offset
    else:
        int_dtype = torch.int32 if pos.endswith("32") else torch.int64
        lo, hi = -3, table_rows + 40
        if layout == "thd":
            p_arg = torch.randint(lo, hi, (n_tok,), generator=gen)
        elif pos.startswith("shared"):
            p_arg = torch.randint(lo, hi, (S,), generator=gen)
        else:
            p_arg = torch.randint(lo, hi, (B, S), generator=gen)
        p_arg.view(-1)[0] = 2**20 - 1  # far outside any table
        p_arg = p_arg.to(int_dtype)
        p_ref = p_arg
    q_out = q if inplace else torch.full_like(q, float("nan"))
    k_out = None if k is None else (k if inplace else torch.full_like(k, float("nan")))
    args = KernelArgs(q=q, k=k, q_out=q_out, k_out=k_out, pos=p_arg, pos_offset=0 if p_arg is not None else offset,
                      cos=cos, sin=sin, freq_turns=None if caller_tables else freq_turns_of(inv),
                      attention_factor=attention_factor, layout=layout, rotary_dim=r,
                      interleaved=style == "gptj", inverse=inverse, inplace=inplace)
    views = kc.kernel_views(args)
    t = tl.compute_tiling(kc.tiling_params(views, inverse), ub, cores)
    stats = sim.launch(views, t, tl.pack(t), inverse)

    ref_kw = dict(layout=layout, rotary_dim=r, style=style, inverse=inverse)
    if caller_tables:
        ref_kw["cos_sin"] = (cos, sin)
    else:
        ref_kw.update(inv_freq=inv, attention_factor=attention_factor)
    for x0, out in ((q0, q_out), (k0, k_out)):
        if x0 is None:
            continue
        ref = rope_reference(x0, p_ref, **ref_kw)
        got = out.to(torch.float64)
        nan_rows = torch.isnan(ref[..., :r])
        # Caller tables: out-of-table tokens must come out NaN in the rotary dims.
        assert torch.equal(torch.isnan(got[..., :r]), nan_rows)
        bound = _allowed(x0, ref, dtype, r, style)
        err = (got - ref).abs()
        ok = err <= bound
        ok[..., :r] |= nan_rows
        ok[..., r:] = got[..., r:] == x0.to(torch.float64)[..., r:]  # pass-through: bit exact
        assert bool(ok.all()), f"max err {err[~ok].max().item()} ({(~ok).sum().item()} elements)"
    if check_stats:
        es = q.element_size()
        assert stats["ub_peak"] == t["ubBytes"], "kernel UB allocation differs from the tiling's"
        # Each q element of the rotary dims (plus the tail when not in place) is read once and
        # written once, whatever the tiling.
        per_head = r + (0 if inplace else D - r)
        if not packed:
            assert stats["q_io"][0] == n_tok * Hq * per_head * es
            assert stats["q_out_io"][1] == n_tok * Hq * per_head * es
        # cos/sin: one row per in-table token per tile, never per head.
        if p_arg is None:
            positions = (torch.arange(B * S) if layout == "thd" else torch.arange(S).expand(B, S)) + offset
        else:
            positions = p_arg.to(torch.int64)
            positions = positions.expand(B, S) if positions.dim() == 1 and layout != "thd" else positions
        inside = int(((positions >= 0) & (positions < table_rows)).sum())
        assert stats["cos_io"] == (inside * (r // 2) * 4, 0)
        assert stats["sin_io"] == (inside * (r // 2) * 4, 0)
    return stats, t


@pytest.mark.parametrize("inverse", [False, True], ids=["fwd", "grad"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("style", STYLES)
def test_modes_dtypes(sim, style, dtype, inverse):
    run_case(sim, style=style, dtype=dtype, inverse=inverse, pos="int64")


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd", "thd"])
@pytest.mark.parametrize("style", STYLES)
def test_layouts(sim, layout, style):
    run_case(sim, layout=layout, style=style, dtype=torch.float16, pos="int32", B=3, S=5)


@pytest.mark.parametrize("D,r", [(14, 10), (22, 22), (64, 32), (80, 64), (130, 2), (2, 2), (96, 94)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("style", STYLES)
def test_partial_rotary_and_unaligned(sim, D, r, dtype, style):
    run_case(sim, D=D, r=r, dtype=dtype, style=style, pos="int64", inverse=r % 4 == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_inplace_writes_only_rotary_dims(sim, dtype):
    run_case(sim, D=40, r=24, dtype=dtype, inplace=True, pos="shared64")


@pytest.mark.parametrize("style", STYLES)
def test_packed_qkv_views(sim, style):
    run_case(sim, packed=True, style=style, dtype=torch.bfloat16, D=48, r=32, pos="int64")


def test_gqa_mqa_and_no_k(sim):
    run_case(sim, Hq=8, Hk=1, pos="int32")
    run_case(sim, Hq=4, Hk=0, pos="int32")


def test_many_tiles_small_ub(sim):
    # A UB that holds 2 rows: every core walks several tiles, segments cross batch entries.
    t0 = tl.compute_tiling(_probe_params(D=64, es=2), 196608, 1)
    ub = tl.UB_RESERVE + t0["fixedBytes"] + 2 * t0["rowBytes"]
    _, t = run_case(sim, D=64, dtype=torch.float16, B=3, S=9, ub=ub, cores=2, pos="int64")
    assert t["tileRows"] == 2 and t["formerRows"] > 2 * t["tileRows"]


def _probe_params(D, es):
    return {"batch": 1, "seq": 1, "qHeads": 1, "kHeads": 0, "headDim": D, "rotaryDim": D, "elemSize": es,
            "qStrideS": D, "qoStrideS": D, "rotate": 1}


@pytest.mark.parametrize("cores", [1, 3, 5, 40])
def test_core_splits(sim, cores):
    run_case(sim, B=2, S=11, cores=cores, pos="offset", offset=3)


@pytest.mark.parametrize("style", STYLES)
def test_positions_outside_table_on_the_fly(sim, style):
    # Offsets far beyond the 16-row table, negative positions, positions near 2^20: computed by
    # the kernel's scalar path from freq_turns to SPEC accuracy.
    run_case(sim, style=style, table_rows=16, pos="offset", offset=2**20 - 10, S=8)
    run_case(sim, style=style, table_rows=16, pos="offset", offset=-5, S=8)
    run_case(sim, style=style, table_rows=0, pos="int64", dtype=torch.float32)
    run_case(sim, style=style, table_rows=16, pos="int64", attention_factor=1.25, inverse=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_caller_tables_out_of_table_is_nan(sim, dtype):
    run_case(sim, caller_tables=True, table_rows=20, pos="int64", dtype=dtype, D=40, r=32)


def test_zero_tokens(sim):
    t = tl.compute_tiling({**_probe_params(32, 4), "seq": 0}, 196608, 8)
    assert t["blockDim"] == 0  # the host glue does not launch


def test_emulator_catches_out_of_bounds_table_read(sim):
    """The emulator's GM checks bite: lie to the kernel about the table size."""
    r = 16
    q = torch.randn(1, 4, 1, r)
    cos, sin = cos_sin_table(_inv_freq(r), 1.0, 4)
    args = KernelArgs(q=q, k=None, q_out=torch.empty_like(q), k_out=None, pos=torch.tensor([0, 1, 2, 9]),
                      pos_offset=0, cos=cos.clone(), sin=sin.clone(), freq_turns=None, attention_factor=1.0,
                      layout="bshd", rotary_dim=r, interleaved=False, inverse=False, inplace=False)
    views = kc.kernel_views(args)
    p = kc.tiling_params(views, False)
    p["tableRows"] = 16  # wrong: the table has 4 rows
    t = tl.compute_tiling(p, 196608, 2)
    with pytest.raises(sim.error_type, match="GM access outside"):
        sim.launch(views, t, tl.pack(t), False)


def test_emulator_catches_ub_overflow(sim):
    r = 64
    q = torch.randn(1, 8, 2, r)
    cos, sin = cos_sin_table(_inv_freq(r), 1.0, 8)
    args = KernelArgs(q=q, k=None, q_out=torch.empty_like(q), k_out=None, pos=None, pos_offset=0,
                      cos=cos.clone(), sin=sin.clone(), freq_turns=None, attention_factor=1.0, layout="bshd",
                      rotary_dim=r, interleaved=False, inverse=False, inplace=False)
    views = kc.kernel_views(args)
    t = tl.compute_tiling(kc.tiling_params(views, False), 196608, 1)
    t["ubSize"] = t["ubBytes"] - 32  # a UB smaller than what the tiling planned for
    with pytest.raises(sim.error_type, match="unified buffer overflow"):
        sim.launch(views, t, tl.pack(t), False)


def test_sincos_turns_accuracy(sim):
    import math

    worst = 0.0
    for i in range(4096):
        top = ((i * 2654435761) % 2**32) - 2**31
        if i < 8:
            top = [-(2**31), 2**31 - 1, 0, 1, -1, 2**30, -(2**30), 2**29][i]
        c, s = sim.sincos(top, 1.0)
        a = top * 2 * math.pi / 2**32
        worst = max(worst, abs(c - math.cos(a)), abs(s - math.sin(a)))
    assert worst < 3e-7, worst


@st.composite
def random_cases(draw):
    D = draw(st.integers(1, 100)) * 2
    packed = draw(st.integers(0, 4)) == 0
    return dict(
        layout="bshd" if packed else draw(st.sampled_from(["bshd", "sbhd", "bhsd", "thd"])),
        packed=packed,
        style=draw(st.sampled_from(STYLES)),
        dtype=draw(st.sampled_from(DTYPES)),
        B=draw(st.integers(1, 4)), S=draw(st.integers(1, 24)), Hq=draw(st.integers(1, 6)),
        Hk=draw(st.integers(0, 3)), D=D, r=draw(st.integers(1, D // 2)) * 2,
        pos=draw(st.sampled_from(["offset", "int32", "int64", "shared32", "shared64"])),
        offset=draw(st.sampled_from([0, 7, -4, 2**20 - 30, 2**31 + 5])), table_rows=draw(st.integers(0, 70)),
        caller_tables=draw(st.booleans()), inverse=draw(st.booleans()), inplace=draw(st.booleans()),
        cores=draw(st.integers(1, 9)), ub=draw(st.sampled_from([196608, 8192, 16384])),
        seed=draw(st.integers(0, 1000)),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=random_cases())
def test_random_cases(sim, case):
    if case["layout"] == "thd" and case["pos"].startswith("shared"):
        case["pos"] = "int64"
    try:
        run_case(sim, **case)
    except tl.TilingError as e:
        assert e.status == tl.UB_TOO_SMALL and case["ub"] < 196608


def test_aligned_rows_use_datacopy_unaligned_use_datacopypad(sim):
    # fp16, D = r = 64: rows of 128 bytes, gaps of whole blocks -> DataCopy with block strides.
    stats, _ = run_case(sim, dtype=torch.float16, D=64, Hk=0, pos="int64")
    assert stats["datacopy_calls"] > 0
    pads_aligned = stats["datacopypad_calls"]
    # Only the cos/sin row copies (2 per in-table token) use DataCopyPad then.
    assert pads_aligned <= 2 * 2 * 7
    # fp16, D = 14, r = 10: 20-byte rows -> DataCopyPad only.
    stats, _ = run_case(sim, dtype=torch.float16, D=14, r=10, Hk=0, pos="int64")
    assert stats["datacopy_calls"] == 0 and stats["datacopypad_calls"] > pads_aligned
    # Whole-block rows and gaps, but the tensor starts 2 bytes into its storage: the kernel checks
    # the GM address and takes DataCopyPad (the emulator rejects unaligned DataCopy).
    B, S, H, D = 2, 5, 2, 32
    flat = torch.randn(B * S * H * D + 1).to(torch.float16)
    q = flat[1:].view(B, S, H, D)
    q0 = q.clone()
    inv = _inv_freq(D)
    cos, sin = cos_sin_table(inv, 1.0, 16)
    out = torch.empty_like(q)
    args = KernelArgs(q=q, k=None, q_out=out, k_out=None, pos=None, pos_offset=2, cos=cos.clone(), sin=sin.clone(),
                      freq_turns=freq_turns_of(inv), attention_factor=1.0, layout="bshd", rotary_dim=D,
                      interleaved=False, inverse=False, inplace=False)
    views = kc.kernel_views(args)
    t = tl.compute_tiling(kc.tiling_params(views, False), 196608, 3)
    stats = sim.launch(views, t, tl.pack(t), False)
    assert stats["datacopypad_calls"] > 0 and stats["datacopy_calls"] > 0  # in: Pad; out (aligned): DataCopy
    ref = rope_reference(q0, 2, layout="bshd", rotary_dim=D, style="neox", inv_freq=inv)
    assert bool(((out.double() - ref).abs() <= _allowed(q0, ref, torch.float16, D, "neox")).all())


def test_kernel_source_lint():
    """Static checks on the device code the emulator cannot make (it runs pipes in order)."""
    import re

    code = "".join(re.sub(r"//[^\n]*", "", (ROOT / "ascend_kernels" / name).read_text())
                   for name in ("rope_kernel.h", "prologue_kernel.h"))
    # Every SetFlag has its WaitFlag for the same event kind, right after it.
    pairs = re.findall(r"SetFlag<HardEvent::(\w+)>\((\w+)\);\s*WaitFlag<HardEvent::(\w+)>\((\w+)\);", code)
    assert len(pairs) == len(re.findall(r"SetFlag<", code)) == len(re.findall(r"WaitFlag<", code)) > 0
    assert all(a == c and b == d for a, b, c, d in pairs)
    # Every queue tensor allocated is freed, and every queue that enqueues also dequeues.
    for queue in set(re.findall(r"(\w+_)\.(?:template )?AllocTensor", code)):
        assert re.search(rf"{queue}\.FreeTensor", code), queue
    for queue in set(re.findall(r"(\w+_)\.EnQue", code)) | {"copyQueue_"}:
        assert re.search(rf"{queue}\.(?:template )?DeQue", code), queue
    # Scalar writes into UB are fenced from vector use on both sides.
    assert "HardEvent::S_V" in code and "HardEvent::V_S" in code
    # No plain DataCopy with an element count (only block-param DataCopy or DataCopyPad).
    assert not re.search(r"DataCopy\([^;]*,\s*[a-z]\w*Count\)", code)


# ------------------------------------------------------------------------------ huge positions
def exact_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, m: float = 1.0):
    """float64 m*cos, m*sin of position * inv_freq with the angle reduced exactly (a float64
    product is off by ~1e-4 rad at 2^40): [N, r/2] for positions [N]."""
    import math

    from rope_ops.frequencies import reduced_angle

    rows = [[reduced_angle(int(p), float(f)) for f in inv_freq.tolist()] for p in positions.tolist()]
    angle = torch.tensor(rows, dtype=torch.float64)
    return m * torch.cos(angle), m * torch.sin(angle)


HUGE = [2**40 - 1, -(2**40 - 1), 2**40 - 4097, 2**39 + 12345, -(2**33) - 7, 2**31 + 5, 123456789012]


@pytest.mark.parametrize("pos_dtype", ["offset", "int64"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("style", STYLES)
def test_positions_up_to_2_pow_40_meet_spec(sim, style, dtype, pos_dtype):
    """SPEC's bound for every |position| < 2^40 with builtin tables: the kernel's on-the-fly angle
    (rope_math.h) against angles reduced exactly, rows inside the table mixed in."""
    gen = torch.Generator().manual_seed(11)
    B, S, Hq, Hk, D, r = 2, 7, 2, 1, 48, 48
    inv = _inv_freq(r, 500000.0)
    cos, sin = cos_sin_table(inv, 1.25, 16)
    cos, sin = cos.clone(), sin.clone()
    if pos_dtype == "offset":
        offset, pos = 2**40 - 2 * S, None
        positions = (offset + torch.arange(S)).expand(B, S)
    else:
        offset = 0
        pos = torch.tensor(HUGE * 2, dtype=torch.int64)[: B * S].view(B, S)
        pos[1, 0], pos[1, 1] = 3, 15  # table rows in the same tile
        positions = pos
    q = torch.randn(B, S, Hq, D, generator=gen).to(dtype)
    k = torch.randn(B, S, Hk, D, generator=gen).to(dtype)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    args = KernelArgs(q=q, k=k, q_out=q_out, k_out=k_out, pos=pos, pos_offset=offset, cos=cos, sin=sin,
                      freq_turns=freq_turns_of(inv), attention_factor=1.25, layout="bshd", rotary_dim=r,
                      interleaved=style == "gptj", inverse=False, inplace=False)
    views = kc.kernel_views(args)
    t = tl.compute_tiling(kc.tiling_params(views, False), 196608, 3)
    sim.launch(views, t, tl.pack(t), False)
    c, s = exact_cos_sin(positions.reshape(-1), inv, 1.25)
    token = torch.arange(B * S).view(B, S)
    for x, out in ((q, q_out), (k, k_out)):
        ref = rope_reference(x, token, layout="bshd", rotary_dim=r, style=style, cos_sin=(c, s))
        err = (out.double() - ref).abs()
        assert bool((err <= _allowed(x, ref, dtype, r, style)).all()), err.max().item()


def test_positions_beyond_2_pow_40_stay_rotations(sim):
    """Past 2^40 SPEC promises no accuracy, but every int64 position still gives a rotation:
    finite outputs, each pair's norm kept, no read outside the table."""
    r = 32
    extremes = torch.tensor([-(2**63), 2**63 - 1, 2**62, -(2**62), 2**50 + 3, -(2**41)], dtype=torch.int64)
    q = torch.randn(1, extremes.numel(), 2, r, generator=torch.Generator().manual_seed(3))
    out = torch.empty_like(q)
    inv = _inv_freq(r)
    cos, sin = cos_sin_table(inv, 1.0, 8)
    args = KernelArgs(q=q, k=None, q_out=out, k_out=None, pos=extremes.view(1, -1), pos_offset=0,
                      cos=cos.clone(), sin=sin.clone(), freq_turns=freq_turns_of(inv), attention_factor=1.0,
                      layout="bshd", rotary_dim=r, interleaved=False, inverse=False, inplace=False)
    views = kc.kernel_views(args)
    t = tl.compute_tiling(kc.tiling_params(views, False), 196608, 2)
    stats = sim.launch(views, t, tl.pack(t), False)
    assert stats["cos_io"] == (0, 0)
    assert bool(torch.isfinite(out).all())
    norm_in = q[..., : r // 2].square() + q[..., r // 2:].square()
    norm_out = out[..., : r // 2].square() + out[..., r // 2:].square()
    torch.testing.assert_close(norm_out, norm_in, rtol=2e-6, atol=1e-6)


# ------------------------------------------------------------------------------ the cos/sin sources
def launch_args(sim, args: KernelArgs, ub=196608, cores=3):
    """Views, tiling and launch of ``args`` as the host glue would; (stats, tiling)."""
    views = kc.kernel_views(args)
    t = tl.compute_tiling(kc.tiling_params(views, args.inverse), ub, cores)
    stats = sim.launch(views, t, tl.pack(t), args.inverse)
    assert stats["ub_peak"] == t["ubBytes"], "kernel UB allocation differs from the tiling's"
    return stats, t


def _io_tensors(layout, dtype, B, S, Hq, Hk, D, gen):
    q = _make_qk((B, S, Hq, D), layout, dtype, Hq, gen)
    k = _make_qk((B, S, Hk, D), layout, dtype, Hk, gen) if Hk else None
    return q, k


def _check_rotation(q, k, q_out, k_out, ref_of, dtype, r, style):
    """Outputs within SPEC's bound of ref_of(x); NaN exactly where the reference is; tail exact."""
    from rope_ops.testing.checks import assert_rope_close

    for x, out, name in ((q, q_out, "q"), (k, k_out, "k")):
        if x is not None:
            assert_rope_close(out, ref_of(x), x, rotary_dim=r, style=style, what=name, dtype=dtype)


TOKEN_FORMS = ["contiguous", "rows_of_a_wider_tensor", "shared_by_the_batch", "broadcast_over_tokens"]


@pytest.mark.parametrize("inverse", [False, True], ids=["fwd", "grad"])
@pytest.mark.parametrize("table_dtype", DTYPES, ids=lambda d: "table_" + str(d).split(".")[1])
@pytest.mark.parametrize("style", STYLES)
def test_token_rows_source(sim, style, table_dtype, inverse):
    """Caller cos/sin per token [B, S, r/2] (any strides) for every dtype, style and direction;
    each token's row read once, positions never read."""
    gen = torch.Generator().manual_seed(7)
    B, S, Hq, Hk, D, r = 3, 5, 3, 2, 40, 24
    for dtype in DTYPES:
        q, k = _io_tensors("sbhd", dtype, B, S, Hq, Hk, D, gen)  # strided [B, S, H, D] views
        angles = torch.rand(B, S, r // 2, generator=gen, dtype=torch.float64) * 200 - 100
        cos, sin = (1.5 * torch.cos(angles)).to(table_dtype), (1.5 * torch.sin(angles)).to(table_dtype)
        q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
        args = KernelArgs(q, k, q_out, k_out, None, 0, cos, sin, None, 1.0, "sbhd", r, style == "gptj", inverse,
                          False, "token")
        stats, t = launch_args(sim, args, ub=8192, cores=2)  # small UB: several tiles
        assert t["tileRows"] < t["formerRows"]

        def ref_of(x):
            return rope_reference(x, None, layout="sbhd", rotary_dim=r, style=style, token_cos_sin=(cos, sin),
                                  inverse=inverse)

        _check_rotation(q, k, q_out, k_out, ref_of, dtype, r, style)
        row = (r // 2) * cos.element_size()
        assert stats["cos_io"] == (B * S * row, 0) and stats["sin_io"] == (B * S * row, 0)


@pytest.mark.parametrize("form", TOKEN_FORMS)
@pytest.mark.parametrize("layout", ["bshd", "thd", "bhsd"])
def test_token_rows_in_every_layout_and_stride(sim, form, layout):
    """Per-token tables as rope_ops hands them over: [B, S, r/2] views of [B, S, r] tensors, of
    [1, S, w] / [S, w] tables expanded over the batch (stride 0), of one row broadcast over the
    tokens (stride 0 on S: one copy per token)."""
    gen = torch.Generator().manual_seed(8)
    B, S, D, r = (1, 13, 48, 48) if layout == "thd" else (2, 9, 48, 48)
    half = r // 2
    q, k = _io_tensors(layout, torch.bfloat16, B, S, 4, 1, D, gen)
    wide = torch.rand(B, S, r, generator=gen, dtype=torch.float64) * 6
    if form == "contiguous":
        c, s = wide[..., :half].cos().float().contiguous(), wide[..., :half].sin().float().contiguous()
    elif form == "rows_of_a_wider_tensor":
        cs = torch.cat([wide[..., :half].cos(), wide[..., :half].sin()], dim=-1).float()
        c, s = cs[..., :half], cs[..., half:]
    elif form == "shared_by_the_batch":
        one = wide[:1]
        c, s = one[..., :half].cos().float().expand(B, S, half), one[..., :half].sin().float().expand(B, S, half)
    else:
        one = wide[:, :1]
        c, s = one[..., :half].cos().float().expand(B, S, half), one[..., :half].sin().float().expand(B, S, half)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    args = KernelArgs(q, k, q_out, k_out, None, 0, c, s, None, 1.0, layout, r, False, False, False, "token")
    launch_args(sim, args, ub=16384, cores=3)
    tables = (c[0], s[0]) if layout == "thd" else (c, s)

    def ref_of(x):
        return rope_reference(x, None, layout=layout, rotary_dim=r, style="neox", token_cos_sin=tables)

    _check_rotation(q, k, q_out, k_out, ref_of, torch.bfloat16, r, "neox")


CACHE_FORMS = ["fp16_pair", "bf16_pair", "cos_sin_cache", "bf16_cos_sin_cache", "fp32_pair"]


@pytest.mark.parametrize("form", CACHE_FORMS)
@pytest.mark.parametrize("style", STYLES)
def test_position_tables_strided_and_low_precision(sim, form, style):
    """Caller tables by position: fp16/bf16 pairs (converted to float32 in UB) and one [P, r]
    cos|sin cache read in place through its two row-strided halves; rows outside the table NaN;
    each in-table token's row read once per table, in the table's dtype."""
    gen = torch.Generator().manual_seed(9)
    P, B, S, Hq, Hk, D, r = 37, 2, 11, 3, 2, 64, 48
    table_dtype = {"fp16_pair": torch.float16, "bf16_pair": torch.bfloat16,
                   "bf16_cos_sin_cache": torch.bfloat16}.get(form, torch.float32)
    angles = torch.rand(P, r // 2, generator=gen, dtype=torch.float64) * 6.3
    c, s = angles.cos().to(table_dtype), angles.sin().to(table_dtype)
    if "cache" in form:
        cache = torch.cat([c, s], dim=-1)
        cos, sin = cache[:, : r // 2], cache[:, r // 2:]
        assert cos.stride(0) == r
    else:
        cos, sin = c, s
    for dtype in DTYPES:
        q, k = _io_tensors("bshd", dtype, B, S, Hq, Hk, D, gen)
        pos = torch.randint(-4, P + 6, (B, S), generator=gen)
        q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
        args = KernelArgs(q, k, q_out, k_out, pos, 0, cos, sin, None, 1.0, "bshd", r, style == "gptj", False, False)
        stats, _ = launch_args(sim, args, ub=12288, cores=2)

        def ref_of(x):
            return rope_reference(x, pos, layout="bshd", rotary_dim=r, style=style, cos_sin=(c, s))

        _check_rotation(q, k, q_out, k_out, ref_of, dtype, r, style)
        inside = int(((pos >= 0) & (pos < P)).sum())
        row = (r // 2) * c.element_size()
        if "cache" in form:  # one storage: both halves' reads
            assert stats["cos_io"] == (2 * inside * row, 0)
        else:
            assert stats["cos_io"] == (inside * row, 0) and stats["sin_io"] == (inside * row, 0)


def test_low_precision_tables_with_on_the_fly_rows(sim):
    """The kernel's 16-bit table path with freq_turns: rows outside the table computed on the fly
    after the cast (the scalar writes must not be overwritten by it)."""
    gen = torch.Generator().manual_seed(10)
    r = 32
    inv = _inv_freq(r)
    c32, s32 = cos_sin_table(inv, 1.0, 24)
    c, s = c32.to(torch.float16), s32.to(torch.float16)
    q = torch.randn(2, 9, 2, r, generator=gen)
    pos = torch.randint(0, 60, (2, 9), generator=gen)
    out = torch.empty_like(q)
    args = KernelArgs(q, None, out, None, pos, 0, c, s, freq_turns_of(inv), 1.0, "bshd", r, False, False, False)
    launch_args(sim, args, cores=2)
    inside = pos < 24
    exact_c, exact_s = exact_cos_sin(pos.reshape(-1), inv)
    token_c = torch.where(inside.reshape(-1, 1), c.double()[pos.clamp_max(23).reshape(-1)], exact_c)
    token_s = torch.where(inside.reshape(-1, 1), s.double()[pos.clamp_max(23).reshape(-1)], exact_s)
    ref = rope_reference(q, None, layout="bshd", rotary_dim=r, style="neox",
                         token_cos_sin=(token_c.view(2, 9, -1), token_s.view(2, 9, -1)))
    assert bool(((out.double() - ref).abs() <= _allowed(q, ref, torch.float32, r, "neox")).all())


# ------------------------------------------------------------------------------ mRoPE
def mrope_exact_tables(positions: torch.Tensor, inv: torch.Tensor, section, interleaved, m=1.0):
    """float64 per-token (c, s) [N, r/2] of mRoPE positions [3, N], each frequency at its axis's
    position with the angle reduced exactly."""
    import math

    from rope_ops._mrope import mrope_axes
    from rope_ops.frequencies import reduced_angle

    axes = mrope_axes(section, interleaved).tolist()
    rows = [[reduced_angle(int(positions[a, j]), float(f)) for a, f in zip(axes, inv.tolist())]
            for j in range(positions.shape[1])]
    angle = torch.tensor(rows, dtype=torch.float64)
    return m * torch.cos(angle), m * torch.sin(angle)


SECTIONS = [((8, 12, 12), False), ((8, 12, 12), True), ((16, 0, 16), False), ((4, 14, 14), True),
            ((0, 0, 32), False)]


@pytest.mark.parametrize("section,interleaved", SECTIONS, ids=lambda v: str(v))
def test_mrope_source(sim, section, interleaved):
    """Three positions per token, frequency i from its axis's row (chunked and interleaved
    sections, an axis without frequencies); positions inside and outside the table, shared by the
    batch or not; rows read only for axes that own frequencies."""
    gen = torch.Generator().manual_seed(11)
    r, P = 64, 40
    inv = _inv_freq(r)
    cos, sin = cos_sin_table(inv, 1.0, P)
    cos, sin = cos.clone(), sin.clone()
    for dtype, shape, layout in ((torch.float32, (3, 2, 7), "bshd"), (torch.bfloat16, (3, 7), "bshd"),
                                 (torch.float16, (3, 13), "thd")):
        B, S = (1, 13) if layout == "thd" else (2, 7)
        q, k = _io_tensors(layout, dtype, B, S, 3, 2, r + 8, gen)
        pos = torch.randint(-5, P + 30, shape, generator=gen)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        args = KernelArgs(q, k, q_out, k_out, pos, 0, cos, sin, freq_turns_of(inv), 1.0, layout, r, False, False,
                          False, "mrope", section, interleaved)
        stats, _ = launch_args(sim, args, ub=16384, cores=2)

        def ref_of(x):
            return rope_reference(x, pos, layout=layout, rotary_dim=r, style="neox", inv_freq=inv,
                                  mrope_section=section, mrope_interleaved=interleaved)

        _check_rotation(q, k, q_out, k_out, ref_of, dtype, r, "neox")
        full = pos if pos.dim() == 3 else pos.unsqueeze(1).expand(3, B, S)
        used = torch.tensor([n > 0 for n in section]).view(3, 1, 1)
        inside = int((((full >= 0) & (full < P)) & used).sum())
        assert stats["cos_io"] == (inside * (r // 2) * 4, 0)


@pytest.mark.parametrize("interleaved", [False, True], ids=["chunked", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_mrope_positions_up_to_2_pow_40(sim, dtype, interleaved):
    """mRoPE with positions to +-2^40 on every axis (and table rows mixed in) against angles
    reduced exactly, frequency by frequency; forward and inverse."""
    gen = torch.Generator().manual_seed(12)
    r, section = 48, (8, 8, 8)
    inv = _inv_freq(r, 500000.0)
    cos, sin = cos_sin_table(inv, 1.25, 16)
    cos, sin = cos.clone(), sin.clone()
    B, S = 2, 6
    pos = torch.tensor(HUGE * 6, dtype=torch.int64)[: 3 * B * S].view(3, B, S)
    pos[0, 1, :3] = torch.tensor([0, 5, 15])
    pos[2, 0, 2] = 7
    for inverse in (False, True):
        q, k = _io_tensors("bshd", dtype, B, S, 2, 1, r, gen)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        args = KernelArgs(q, k, q_out, k_out, pos, 0, cos, sin, freq_turns_of(inv), 1.25, "bshd", r, True,
                          inverse, False, "mrope", section, interleaved)
        launch_args(sim, args, cores=3)
        c, s = mrope_exact_tables(pos.reshape(3, -1), inv, section, interleaved, 1.25)
        inside = ((pos >= 0) & (pos < 16)).reshape(3, -1)
        from rope_ops._mrope import mrope_axes

        axes = mrope_axes(section, interleaved)
        for j in range(B * S):  # table rows where the axis's position is inside: the table's values
            for i, a in enumerate(axes.tolist()):
                if inside[a, j]:
                    c[j, i], s[j, i] = cos[pos.reshape(3, -1)[a, j], i], sin[pos.reshape(3, -1)[a, j], i]

        def ref_of(x):
            return rope_reference(x, None, layout="bshd", rotary_dim=r, style="gptj",
                                  token_cos_sin=(c.view(B, S, -1), s.view(B, S, -1)), inverse=inverse)

        _check_rotation(q, k, q_out, k_out, ref_of, dtype, r, "gptj")


@pytest.mark.parametrize("table_dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_mrope_caller_tables(sim, table_dtype):
    """mRoPE on caller tables (fp32/fp16/bf16, one cos|sin cache for fp32): a frequency whose
    axis's position is outside the table is NaN, the others are the table's values."""
    gen = torch.Generator().manual_seed(13)
    P, r, section = 20, 32, (4, 6, 6)
    angles = torch.rand(P, r // 2, generator=gen, dtype=torch.float64) * 6.3
    c, s = angles.cos().to(table_dtype), angles.sin().to(table_dtype)
    if table_dtype == torch.float32:
        cache = torch.cat([c, s], dim=-1)
        cos, sin = cache[:, : r // 2], cache[:, r // 2:]
    else:
        cos, sin = c, s
    q = torch.randn(1, 9, 2, r, generator=gen)
    pos = torch.randint(0, P, (3, 9), generator=gen)
    pos[1, 3] = P + 2  # one h position past the table
    pos[2, 5] = -1  # one w position before it
    out = torch.full_like(q, 7.0)
    args = KernelArgs(q, None, out, None, pos, 0, cos, sin, None, 1.0, "bshd", r, False, False, False, "mrope",
                      section, True)
    launch_args(sim, args, cores=2)
    ref = rope_reference(q, pos, layout="bshd", rotary_dim=r, style="neox", cos_sin=(c, s), mrope_section=section,
                         mrope_interleaved=True)
    from rope_ops.testing.checks import assert_rope_close

    assert_rope_close(out, ref, q, rotary_dim=r, style="neox", what="mrope caller tables")
    assert bool(torch.isnan(out[0, 3]).any()) and bool(torch.isnan(out[0, 5]).any())
