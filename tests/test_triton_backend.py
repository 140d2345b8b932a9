"""TritonBackend.run against the float64 reference, on hand-built KernelArgs.

Runs on CPU tensors under the Triton interpreter (the variable must be set before triton is
imported, so it is set on the command line):

    TRITON_INTERPRET=1 pytest tests/test_triton_backend.py

On a machine with a GPU and without the variable, the same checks run on CUDA tensors.
Otherwise every test is skipped.
"""

from __future__ import annotations

import pytest
import torch
from _triton_support import DEVICE, INTERPRET, needs_device

pytestmark = needs_device

pytest.importorskip("triton")

from rope_ops._reference import rope_reference  # noqa: E402
from rope_ops.backend import KernelArgs  # noqa: E402
from rope_ops.frequencies import compute_inv_freq, cos_sin_table, freq_turns_of  # noqa: E402

import rope_ops_backends.triton_backend as tb  # noqa: E402

SHAPE_OF = {  # tensor shape for (B, S, H, D) in each layout
    "bshd": lambda B, S, H, D: (B, S, H, D),
    "sbhd": lambda B, S, H, D: (S, B, H, D),
    "bhsd": lambda B, S, H, D: (B, H, S, D),
    "thd": lambda B, S, H, D: (B * S, H, D),
}
HEAD_AXIS = {"bshd": 2, "sbhd": 2, "bhsd": 1, "thd": 1}


# ---------------------------------------------------------------------------------------------
# Tables, as the core builds them: float32 from float64 angles; turns as wrapped int64.


def inv_freq_of(rotary_dim: int, base: float) -> torch.Tensor:
    return compute_inv_freq(rotary_dim, base)[0]


def tables(inv_freq: torch.Tensor, n_rows: int, m: float, device):
    cos, sin = cos_sin_table(inv_freq, m, n_rows)
    return cos.to(device), sin.to(device)


# ---------------------------------------------------------------------------------------------
# Accuracy check (SPEC "Accuracy").


def _partner(rotary_dim: int, style: str) -> torch.Tensor:
    idx = torch.arange(rotary_dim)
    half = rotary_dim // 2
    if style == "neox":
        return torch.where(idx < half, idx + half, idx - half)
    return idx ^ 1


def _ulp(ref: torch.Tensor, dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    mant = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    a = ref.abs().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(a)) - mant)


def assert_close(out, inp, ref, rotary_dim, style, what=""):
    """out: backend result; inp: its input (same layout); ref: float64 reference."""
    o = out.detach().cpu().to(torch.float64)
    x = inp.detach().cpu().to(torch.float64)
    # Pass-through dims: exact (bitwise for the same dtype).
    assert torch.equal(out.detach().cpu()[..., rotary_dim:], inp.detach().cpu()[..., rotary_dim:]), \
        f"{what}: pass-through dims changed"
    o, r, x = o[..., :rotary_dim], ref[..., :rotary_dim], x[..., :rotary_dim]
    nan_ref = torch.isnan(r)
    assert torch.equal(torch.isnan(o), nan_ref), f"{what}: NaN pattern differs from the reference"
    pair = x.abs() + x[..., _partner(rotary_dim, style)].abs()
    allow = 2e-6 * pair.clamp_min(1.0)
    if out.dtype != torch.float32:
        allow = allow + _ulp(r, out.dtype)
    err = (o - r).abs()
    bad = (err > allow) & ~nan_ref
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements out of tolerance, max err "
                           f"{float(err[~nan_ref].max())}, max allowed {float(allow.max())}")


# ---------------------------------------------------------------------------------------------
# Building cases.


def make_input(layout, B, S, H, D, dtype, gen, scale=1.0):
    return (torch.randn(SHAPE_OF[layout](B, S, H, D), generator=gen, dtype=torch.float32) * scale
            ).to(dtype).to(DEVICE)


def make_pos(kind, layout, B, S, gen, pos_dtype=torch.int64, lo=0, hi=64):
    """(pos tensor or None, offset, reference pos)."""
    if kind == "offset":
        return None, lo, lo
    if layout == "thd":
        p = torch.randint(lo, hi, (B * S,), generator=gen, dtype=torch.int64)
    elif kind == "shared":
        p = torch.randint(lo, hi, (S,), generator=gen, dtype=torch.int64)
    else:
        p = torch.randint(lo, hi, (B, S), generator=gen, dtype=torch.int64)
    p = p.to(pos_dtype).to(DEVICE)
    return p, 0, p


def make_args(*, layout="bshd", B=2, S=3, hq=4, hk=2, D=16, R=None, dtype=torch.float32,
              style="neox", inplace=False, pos_kind="bs", pos_dtype=torch.int64, lo=0, hi=64,
              n_rows=64, base=10000.0, m=1.0, caller=False, inverse=False, packed=False,
              out_contig=False, seed=0, table_dtype=torch.float32, table_cache=False):
    """(KernelArgs, inputs before the call, reference keywords, packed tensor or None).
    caller: tables without freq_turns, in table_dtype; table_cache: cos and sin the two halves
    of one [P, R] tensor (rows strided)."""
    R = D if R is None else R
    gen = torch.Generator().manual_seed(seed)
    qkv = None
    if packed:
        assert layout == "bshd"
        qkv = make_input("bshd", B, S, hq + 2 * max(hk, 1), D, dtype, gen)
        q = qkv[:, :, :hq]
        k = qkv[:, :, hq:hq + hk] if hk else None
    else:
        q = make_input(layout, B, S, hq, D, dtype, gen)
        k = make_input(layout, B, S, hk, D, dtype, gen) if hk else None
    pos, off, ref_pos = make_pos(pos_kind, layout, B, S, gen, pos_dtype, lo, hi)
    inv_freq = inv_freq_of(R, base)
    cos, sin = tables(inv_freq, n_rows, m, DEVICE)
    if table_cache:
        cos, sin = torch.cat([cos, sin], dim=-1).split(R // 2, dim=-1)
    cos, sin = cos.to(table_dtype), sin.to(table_dtype)
    turns = None if caller else freq_turns_of(inv_freq).to(DEVICE)
    if inplace:
        q_out, k_out = q, k
    elif out_contig:
        q_out = torch.empty(q.shape, dtype=dtype, device=DEVICE)
        k_out = None if k is None else torch.empty(k.shape, dtype=dtype, device=DEVICE)
    else:
        q_out = torch.empty_like(q)
        k_out = None if k is None else torch.empty_like(k)
    args = KernelArgs(q=q, k=k, q_out=q_out, k_out=k_out, pos=pos, pos_offset=off, cos=cos,
                      sin=sin, freq_turns=turns, attention_factor=m, layout=layout,
                      rotary_dim=R, interleaved=(style == "gptj"), inverse=inverse,
                      inplace=inplace)
    ref_kw = dict(layout=layout, rotary_dim=R, style=style, inv_freq=inv_freq,
                  attention_factor=m, cos_sin=(cos, sin) if caller else None, inverse=inverse)
    before = (q.clone(), None if k is None else k.clone(),
              None if qkv is None else qkv[:, :, hq + hk:].clone())
    return args, before, ref_pos, ref_kw, qkv


def check_result(args, before, ref_pos, ref_kw, qkv, what=""):
    q_in, k_in, v_before = before
    R, style = args.rotary_dim, ref_kw["style"]
    what = (f"{what} {args.layout} {args.q.dtype} {style} R={R}/{args.q.shape[-1]} "
            f"inplace={args.inplace}")
    assert_close(args.q_out, q_in, rope_reference(q_in, ref_pos, **ref_kw), R, style, what + " q")
    if args.k is not None:
        assert_close(args.k_out, k_in, rope_reference(k_in, ref_pos, **ref_kw), R, style,
                     what + " k")
    if not args.inplace:  # inputs untouched, bitwise
        assert torch.equal(args.q.cpu(), q_in.cpu())
        if args.k is not None:
            assert torch.equal(args.k.cpu(), k_in.cpu())
    if qkv is not None:  # v untouched
        hq = args.q.shape[2]
        hk = 0 if args.k is None else args.k.shape[2]
        assert torch.equal(qkv[:, :, hq + hk:].cpu(), v_before.cpu())


def run_case(cfg=None, **kw):
    """One call through the backend (the launch policy's configuration, or the candidate label
    cfg through run_with) against the float64 reference."""
    args, before, ref_pos, ref_kw, qkv = make_args(**kw)
    if cfg is None:
        tb.TritonBackend().run(args)
    else:
        tb.run_with(args, cfg)
    check_result(args, before, ref_pos, ref_kw, qkv, what=cfg or "policy")


# ---------------------------------------------------------------------------------------------
# Tests: the kernel, through the launch policy's configuration.

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd", "thd"])
def test_layout_style_dtype(layout, style, dtype):
    run_case(layout=layout, style=style, dtype=dtype, pos_kind="shared" if layout == "sbhd" else "bs")


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("R,D", [(8, 16), (12, 20), (16, 32), (32, 80), (24, 96), (2, 34)])
def test_partial_rotary(R, D, inplace, style):
    # Rotary pieces (R/2 12 -> 8 + 4) and pass-through pieces ([24, 96) -> 8, 32, 32;
    # [2, 34) -> 2, 4 and a masked 32). In place, the pass-through bytes are the input's
    # (assert_close checks them bitwise).
    run_case(R=R, D=D, inplace=inplace, style=style, dtype=torch.bfloat16)


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("D", [80, 96, 112, 40])
def test_head_dim_not_a_power_of_two(D, style):
    # Rotary pairs in two pieces (40 -> 32 + 8, 48 -> 32 + 16, 56 -> 32 + a masked 32,
    # 20 -> 16 + 4), through the token walk and the head grid.
    run_case(D=D, hq=3, hk=1, S=4, style=style, dtype=torch.bfloat16)
    run_case("walk t2 hq2 hk1 w2", D=D, hq=3, hk=1, S=4, style=style, dtype=torch.float16,
             inplace=True)
    run_case("grid t2 hq2 hk1 w2", D=D, hq=3, hk=1, S=4, style=style, dtype=torch.float32,
             inverse=True)


@pytest.mark.parametrize("hq,hk", [(4, 1), (8, 2), (3, 5), (2, 0), (5, 3), (7, 1), (0, 2)])
def test_gqa_mqa_k_none(hq, hk):
    run_case(hq=hq, hk=hk, dtype=torch.float16)
    run_case("walk t2 hq4 hk1 w1", hq=hq, hk=hk, S=5, dtype=torch.float16)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_packed_qkv_views(style, inplace):
    run_case(packed=True, hq=4, hk=2, style=style, inplace=inplace, dtype=torch.bfloat16)
    run_case(packed=True, hq=4, hk=2, D=24, R=16, style=style, inplace=inplace,
             dtype=torch.bfloat16)


def test_out_of_place_into_other_strides():
    run_case(packed=True, out_contig=True, R=8, D=16)
    run_case(layout="bhsd", out_contig=True)


def test_noncontiguous_head_dim():
    # A view with stride 2 on head_dim (every other element of a wider tensor).
    gen = torch.Generator().manual_seed(5)
    big = make_input("bshd", 2, 3, 2, 32, torch.float32, gen)
    q = big[..., ::2]
    inv_freq = inv_freq_of(16, 10000.0)
    cos, sin = tables(inv_freq, 64, 1.0, DEVICE)
    pos = torch.arange(3, device=DEVICE)
    out = torch.empty(q.shape, device=DEVICE)
    args = KernelArgs(q=q, k=None, q_out=out, k_out=None, pos=pos, pos_offset=0, cos=cos,
                      sin=sin, freq_turns=freq_turns_of(inv_freq).to(DEVICE), attention_factor=1.0,
                      layout="bshd", rotary_dim=16, interleaved=False, inverse=False,
                      inplace=False)
    tb.TritonBackend().run(args)
    ref = rope_reference(q, pos, layout="bshd", rotary_dim=16, style="neox", inv_freq=inv_freq)
    assert_close(out, q, ref, 16, "neox", "stride-2 head_dim")


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("kind", ["offset", "shared", "bs", "thd"])
def test_position_forms(kind, pos_dtype):
    layout = "thd" if kind == "thd" else "bshd"
    run_case(layout=layout, pos_kind="bs" if kind == "thd" else kind, pos_dtype=pos_dtype,
             lo=3 if kind == "offset" else 0)


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("lo,hi", [(64, 5000), (-3000, 0), ((1 << 20) - 4096, 1 << 20),
                                   (-(1 << 31), (1 << 31) - 1)])
def test_positions_outside_table(lo, hi, style):
    # Computed on the fly from freq_turns; with an attention factor, base 500000 as in PERF.md;
    # R/2 = 20 (two pieces) so both pieces' rows go on the fly.
    run_case(lo=lo, hi=hi, style=style, n_rows=64, base=500000.0, m=1.1, D=40)


def test_large_offset_and_empty_table():
    run_case(pos_kind="offset", lo=(1 << 20) - 2, n_rows=64)
    run_case(pos_kind="offset", lo=(1 << 33) + 7, n_rows=64)  # int64 offset (JIT path)
    run_case(pos_kind="offset", lo=-(1 << 32) - 5, n_rows=64)  # negative, beyond int32
    run_case(pos_kind="bs", lo=0, hi=100, n_rows=0)


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_caller_tables_out_of_range_nan(style):
    # Rows outside [0, 16): NaN in the rotary dims of that token; pass-through copied exactly.
    run_case(caller=True, lo=-5, hi=24, n_rows=16, style=style, R=8, D=16)
    run_case(caller=True, lo=-5, hi=24, n_rows=16, style=style, R=8, D=16, inplace=True)
    run_case(caller=True, lo=-5, hi=24, n_rows=16, style=style, R=24, D=32, pos_kind="shared")


@pytest.mark.parametrize("table_dtype", DTYPES, ids=str)
def test_caller_tables_any_dtype_strided_rows(table_dtype):
    # Caller tables in float16/bfloat16 are read as such and rotated in float32; rows may be
    # strided (cos and sin the halves of one [P, R] cos|sin cache).
    for cache in (False, True):
        run_case(caller=True, table_dtype=table_dtype, table_cache=cache, n_rows=32, lo=-2, hi=40,
                 R=24, D=32, dtype=torch.bfloat16)
        run_case("grid t1 hq2 hk2 w1", caller=True, table_dtype=table_dtype, table_cache=cache,
                 n_rows=32, hi=32, style="gptj", inplace=True, dtype=torch.float16)
    # Builtin (float32) tables given as the halves of one cache, positions past it on the fly.
    run_case(table_cache=True, n_rows=16, lo=-5, hi=100, R=40, D=48)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_inverse(style, dtype):
    run_case(inverse=True, style=style, dtype=dtype, lo=0, hi=200, n_rows=64)


def test_zero_tokens():
    run_case(B=0, S=3)
    run_case(layout="thd", B=1, S=0)


def test_inverse_undoes_forward():
    gen = torch.Generator().manual_seed(3)
    q = make_input("bshd", 2, 4, 3, 16, torch.float32, gen)
    inv_freq = inv_freq_of(16, 10000.0)
    cos, sin = tables(inv_freq, 32, 1.0, DEVICE)
    turns = freq_turns_of(inv_freq).to(DEVICE)
    pos = torch.tensor([[0, 5, 31, 40], [7, -2, 1 << 19, 3]], device=DEVICE)
    out = torch.empty_like(q)
    back = torch.empty_like(q)
    be = tb.TritonBackend()
    for src, dst, inv in ((q, out, False), (out, back, True)):
        be.run(KernelArgs(q=src, k=None, q_out=dst, k_out=None, pos=pos, pos_offset=0, cos=cos,
                          sin=sin, freq_turns=turns, attention_factor=1.0, layout="bshd",
                          rotary_dim=16, interleaved=False, inverse=inv, inplace=False))
    assert torch.allclose(back, q, atol=1e-5, rtol=1e-5)


def test_backend_declarations():
    b = tb.TritonBackend()
    assert b.name == "triton" and b.priority == 10
    assert b.auto_devices() == frozenset({"cuda"})
    assert "cuda" in b.device_types
    assert ("cpu" in b.device_types) == INTERPRET
    assert b.availability() == []


@pytest.mark.parametrize("hk", [2, 0])
def test_allocates_outputs(hk):
    # q_out = k_out = None (out of place): run() allocates and returns (q_out, k_out).
    gen = torch.Generator().manual_seed(7)
    q = make_input("bshd", 2, 3, 4, 16, torch.bfloat16, gen)
    k = make_input("bshd", 2, 3, hk, 16, torch.bfloat16, gen) if hk else None
    inv_freq = inv_freq_of(16, 10000.0)
    cos, sin = tables(inv_freq, 64, 1.0, DEVICE)
    pos = torch.arange(3, device=DEVICE)
    be = tb.TritonBackend()
    assert be.allocates_outputs
    for _ in range(2):  # the launch's first and later calls
        args = KernelArgs(q=q, k=k, q_out=None, k_out=None, pos=pos, pos_offset=0, cos=cos,
                          sin=sin, freq_turns=freq_turns_of(inv_freq).to(DEVICE),
                          attention_factor=1.0, layout="bshd", rotary_dim=16, interleaved=False,
                          inverse=False, inplace=False)
        made = be.run(args)
        assert isinstance(made, tuple) and len(made) == 2
        qo, ko = made
        ref_kw = dict(layout="bshd", rotary_dim=16, style="neox", inv_freq=inv_freq)
        assert_close(qo, q, rope_reference(q, pos, **ref_kw), 16, "neox", "allocated q")
        if hk:
            assert_close(ko, k, rope_reference(k, pos, **ref_kw), 16, "neox", "allocated k")
        else:
            assert ko is None
    # Given outputs: written, None returned.
    qo2 = torch.empty_like(q)
    assert be.run(args._replace(q_out=qo2, k_out=None if k is None else torch.empty_like(k))) is None
    assert torch.equal(qo2, qo)
    # No tokens: still returns (empty) outputs.
    q0 = q[:, :0]
    made = be.run(args._replace(q=q0, k=None if k is None else k[:, :0], pos=pos[:0]))
    assert made[0].shape == q0.shape


# ---------------------------------------------------------------------------------------------
# Every configuration the benchmark can time (kernel_candidates / run_with).


CANDIDATE_CASES = {
    # one sequence (TOK_SPLIT 1), GQA, partial rotary in pieces, positions past the table
    "thd gqa partial": dict(layout="thd", B=1, S=7, hq=6, hk=2, D=24, R=16, lo=-10, hi=100),
    # batches (division), MQA, gptj, non-pow2 half, in place
    "bshd mqa gptj": dict(B=2, S=5, hq=5, hk=1, D=20, style="gptj", inplace=True),
    # sequences of one token (TOK_SPLIT 2), offset positions, inverse
    "decode batch": dict(B=4, S=1, hq=4, hk=2, D=16, pos_kind="offset", lo=9, inverse=True),
    # bhsd, q only, pass-through pieces
    "bhsd q only": dict(layout="bhsd", B=2, S=6, hq=3, hk=0, D=48, R=8),
}


@pytest.mark.parametrize("name", list(CANDIDATE_CASES))
def test_every_candidate(name):
    kw = CANDIDATE_CASES[name]
    args = make_args(dtype=torch.bfloat16, **kw)[0]
    labels = tb.kernel_candidates(args)
    assert len(labels) == len(set(labels)) >= 4
    kinds = {tb.parse_label(label).head_grid for label in labels}
    assert kinds == {False, True}, labels  # both grids among the candidates
    for label in labels:
        run_case(label, dtype=torch.bfloat16, **kw)


def test_candidates_policy_first_and_labels():
    args = make_args(layout="thd", B=1, S=256, hq=32, hk=8, D=128, dtype=torch.bfloat16)[0]
    labels = tb.kernel_candidates(args)
    policy = tb.launch_policy(tb.shape_of(args), tb.device_info(args.q.device))
    assert labels[0] == policy.label()
    for label in labels:
        assert tb.parse_label(label).label() == label
    for bad in ("walk t3 hq16 hk8 w8", "walk t4 hq16 hk8 w3", "fast", "walk t4 hq16 hk8", None):
        with pytest.raises(ValueError):
            tb.parse_label(bad)
    with pytest.raises(ValueError, match="q_out"):
        tb.run_with(args._replace(q_out=None, k_out=None), labels[0])
    # In place, the outputs are q and k whatever q_out says.
    args, before, ref_pos, ref_kw, qkv = make_args(S=5, inplace=True, dtype=torch.bfloat16)
    tb.run_with(args._replace(q_out=None, k_out=None), "grid t1 hq2 hk2 w1")
    check_result(args, before, ref_pos, ref_kw, qkv, "run_with in place")


# ---------------------------------------------------------------------------------------------
# The launch policy and the pieces (pure functions: no kernel runs).

H200 = tb.DeviceInfo(sm_count=132)


def policy(n_tokens, hq, hk, D, R=None, elem=2, inplace=False, device=H200):
    shape = tb.CallShape(n_tokens, hq, hk, D, D if R is None else R, elem, inplace)
    return tb.launch_policy(shape, device).label()


def test_policy_on_perf_workloads():
    # The H200-measured configurations of PERF.md's workloads (NOTES.md) follow from the rules.
    assert policy(16384, 32, 8, 128) == "walk t4 hq16 hk8 w8"  # W1
    assert policy(256, 32, 8, 128) == "grid t1 hq16 hk8 w2"  # W2
    assert policy(8192, 16, 16, 256, 64, inplace=True) == "walk t4 hq16 hk16 w4"  # W3 in place
    assert policy(8192, 16, 16, 256, 64) == "walk t2 hq16 hk16 w8"  # W3 out of place
    assert policy(8192, 32, 32, 128) == "walk t4 hq16 hk16 w8"  # W4
    assert policy(32768, 64, 8, 128) == "walk t4 hq16 hk8 w8"  # W5


def test_policy_rules():
    # Chunks in bytes: fp32 halves the tokens per chunk of bf16, keeps heads and warps.
    assert policy(16384, 32, 8, 128, elem=4) == "walk t2 hq16 hk8 w8"
    # Head chunks pad at most 1/8: 28 q heads go in 4s; MQA's one k head in a chunk of 1.
    assert policy(16384, 28, 4, 128) == "walk t16 hq4 hk4 w8"
    assert policy(65536, 32, 1, 128) == "walk t4 hq16 hk1 w8"
    # Head grid when token blocks do not fill the GPU (4 per SM): fewer tokens per program
    # first; then (few tokens) narrower chunks until every SM has a program.
    assert policy(2048, 32, 8, 128) == "grid t4 hq16 hk8 w8"
    assert policy(64, 32, 8, 128) == "grid t1 hq16 hk8 w2"
    assert policy(8, 32, 8, 128) == "grid t1 hq2 hk4 w1"
    assert policy(1, 32, 8, 128) == "grid t1 hq1 hk1 w1"
    # The same call on a smaller GPU walks sooner.
    assert policy(2048, 32, 8, 128, device=tb.DeviceInfo(sm_count=16)) == "walk t4 hq16 hk8 w8"


def test_policy_always_valid():
    for n in (1, 7, 256, 300, 4096, 100000):
        for hq, hk in ((1, 0), (3, 1), (16, 16), (40, 5), (64, 8), (71, 1)):
            for D, R in ((2, 2), (80, 32), (128, 32), (128, 128), (256, 64), (96, 48), (2048, 1024)):
                for elem in (2, 4):
                    for inplace in (False, True):
                        shape = tb.CallShape(n, hq, hk, D, R, elem, inplace)
                        cfgs = tb.candidate_configs(shape, H200)
                        assert cfgs[0] == tb.launch_policy(shape, H200)
                        for c in cfgs:
                            assert all(v >= 1 and v & (v - 1) == 0 for v in c[1:]), (shape, c)
                            assert c.num_warps <= 8 and c.block_hq <= 32 and c.block_t <= 64


def test_pieces_cover_exactly():
    for R in range(2, 300, 2):
        a, b = tb.rotary_pieces(R)
        half = R // 2
        assert a & (a - 1) == 0 and a <= half and (b == 0) == (a == half)
        if b:
            assert b & (b - 1) == 0 and half - a <= b < 2 * (half - a)
        for D in range(R, R + 260, 2):
            widths = tb.pass_pieces(R, D)
            if D == R:
                assert widths == (0, 0, 0)
                continue
            off, covered = R, []
            for i, w in enumerate(widths):
                if w == 0:
                    assert all(x == 0 for x in widths[i:])
                    break
                assert w & (w - 1) == 0
                if i < 2:  # aligned, unmasked
                    assert off % w == 0 and off + w <= D
                covered.append((off, min(off + w, D)))
                off += w
            assert covered[0][0] == R and covered[-1][1] == D
            assert all(x[1] == y[0] for x, y in zip(covered, covered[1:]))
            if widths[2]:  # the masked third piece wastes less than half of itself
                assert off - D < widths[2] // 2 + 1


# ---------------------------------------------------------------------------------------------
# bind(): the launcher rope_ops.apply caches per call kind, and its guard for exact repeats.


def bound_setup(hk=2, rotary=16, D=16, turns=True):
    inv_freq = inv_freq_of(rotary, 10000.0)
    cos, sin = tables(inv_freq, 64, 1.0, DEVICE)
    t = freq_turns_of(inv_freq).to(DEVICE) if turns else None
    bound = tb.TritonBackend().bind(cos, sin, t, 1.0, "thd", rotary, False, False)
    gen = torch.Generator().manual_seed(11)
    q = make_input("thd", 1, 6, 3, D, torch.bfloat16, gen)
    k = make_input("thd", 1, 6, hk, D, torch.bfloat16, gen) if hk else None
    ref_kw = dict(layout="thd", rotary_dim=rotary, style="neox", inv_freq=inv_freq)
    return bound, q, k, ref_kw


def check_bound_out(out, q, k, pos, ref_kw):
    qo, ko = out
    r = ref_kw["rotary_dim"]
    assert_close(qo, q, rope_reference(q, pos, **ref_kw), r, "neox", "bound q")
    if k is None:
        assert ko is None
    else:
        assert_close(ko, k, rope_reference(k, pos, **ref_kw), r, "neox", "bound k")


@pytest.mark.parametrize("hk", [2, 0])
def test_bound_and_guard(hk):
    bound, q, k, ref_kw = bound_setup(hk)
    pos = torch.tensor([5, 0, 63, 64, -3, 1000], device=DEVICE)
    check_bound_out(bound(q, k, pos, 0), q, k, pos, ref_kw)
    check_bound_out(bound(q, k, None, 7), q, k, 7, ref_kw)
    guard = bound.guarded(q, k, pos)
    assert guard is not None
    for _ in range(2):
        check_bound_out(guard(q, k, pos), q, k, pos, ref_kw)
    pos2 = pos.flip(0).contiguous()  # same metadata, other values and storage
    check_bound_out(guard(q, k, pos2), q, k, pos2, ref_kw)
    q2 = q + 1  # same metadata, another tensor
    check_bound_out(guard(q2, k, pos), q2, k, pos, ref_kw)
    guard_int = bound.guarded(q, k, 3)
    check_bound_out(guard_int(q, k, 40), q, k, 40, ref_kw)


def test_guard_refuses_other_calls():
    bound, q, k, ref_kw = bound_setup()
    pos = torch.arange(6, device=DEVICE)
    guard = bound.guarded(q, k, pos)
    guard_int = bound.guarded(q, k, 0)
    wide = torch.empty(6, 3, 32, dtype=q.dtype, device=DEVICE)
    others = [
        (q[:5], k[:5], pos[:5]),  # sizes
        (wide[..., :16], k, pos),  # strides
        (q.half(), k.half(), pos),  # dtype
        (q, k.half(), pos),  # k's dtype
        (q, None, pos),  # k missing
        (q, k[:, :1], pos),  # k's heads
        (q, k, pos.int()),  # position dtype
        (q, k, torch.arange(12, device=DEVICE)[::2]),  # position strides
        (q, k, 3),  # an offset instead of a tensor
    ]
    for args in others:
        assert guard(*args) is None, args
    # Misaligned: a view starting one element into a buffer (same sizes and strides).
    buf = torch.empty(q.numel() + 8, dtype=q.dtype, device=DEVICE)
    q_off = buf[1:1 + q.numel()].view(q.shape)
    assert guard(q_off, k, pos) is None
    # Needing a gradient: refused with grad mode on, taken in no_grad.
    qg = q.clone().requires_grad_(True)
    assert guard(qg, k, pos) is None
    with torch.no_grad():
        check_bound_out(guard(qg, k, pos), q, k, pos, ref_kw)
    # Offsets: a tensor refused, int32 accepted, beyond int32 refused (another signature).
    assert guard_int(q, k, pos) is None
    assert guard_int(q, k, 1 << 31) is None
    assert guard_int(q, k, True) is None  # bool is not an offset
    check_bound_out(guard_int(q, k, -(1 << 31)), q, k, -(1 << 31), ref_kw)
    # A subclass of Tensor is not the guarded call.
    class Sub(torch.Tensor):
        pass
    assert guard(q.as_subclass(Sub), k, pos) is None


def test_bound_handles_any_shape_of_the_kind():
    # The bound launcher (not the guard) takes every shape of its call kind: a launch each.
    bound, q, k, ref_kw = bound_setup(D=24)
    for n in (6, 1, 0, 3):
        qn, kn = q[:n], k[:n]
        pos = torch.arange(n, device=DEVICE) * 7
        out = bound(qn, kn, pos, 0)
        if n:
            check_bound_out(out, qn, kn, pos, ref_kw)
        else:
            assert out[0].shape == qn.shape and out[1].shape == kn.shape
    packed = make_input("thd", 1, 6, 5, 24, torch.bfloat16, torch.Generator().manual_seed(2))
    qv, kv = packed[:, :3], packed[:, 3:]
    pos = torch.arange(6, device=DEVICE)
    check_bound_out(bound(qv, kv, pos, 0), qv, kv, pos, ref_kw)
    guard = bound.guarded(qv, kv, pos)
    check_bound_out(guard(qv, kv, pos), qv, kv, pos, ref_kw)


def test_bound_empty_table_and_caller_tables():
    inv_freq = inv_freq_of(16, 10000.0)
    cos, sin = tables(inv_freq, 0, 1.0, DEVICE)
    bound = tb.TritonBackend().bind(cos, sin, freq_turns_of(inv_freq).to(DEVICE), 1.0, "thd", 16,
                                    False, False)
    q = make_input("thd", 1, 4, 2, 16, torch.float32, torch.Generator().manual_seed(1))
    pos = torch.tensor([0, 1, 50, -9], device=DEVICE)
    ref_kw = dict(layout="thd", rotary_dim=16, style="neox", inv_freq=inv_freq)
    check_bound_out(bound(q, None, pos, 0), q, None, pos, ref_kw)
    cos, sin = tables(inv_freq, 8, 1.0, DEVICE)
    bound = tb.TritonBackend().bind(cos, sin, None, 1.0, "thd", 16, False, True)
    qo, _ = bound(q, None, pos, 0)
    ref = rope_reference(q, pos, layout="thd", rotary_dim=16, style="neox", cos_sin=(cos, sin),
                         inverse=True)
    assert_close(qo, q, ref, 16, "neox", "caller tables, inverse")


def test_apply_through_bound_plans():
    # rope_ops.apply's fast path (plan, then guard) with this backend, eager, against the
    # reference; two call kinds in turn, an offset form, autograd through the bound plans.
    import rope_ops

    gen = torch.Generator().manual_seed(4)
    rope = rope_ops.RotaryEmbedding(32, base=10000.0, max_position=64, device=DEVICE)
    inv_freq = inv_freq_of(32, 10000.0)
    ref_kw = dict(layout="thd", rotary_dim=32, style="neox", inv_freq=inv_freq)
    q = make_input("thd", 1, 5, 4, 32, torch.bfloat16, gen)
    k = make_input("thd", 1, 5, 2, 32, torch.bfloat16, gen)
    pos = torch.tensor([3, 0, 70, 2, -1], device=DEVICE)
    for _ in range(3):
        for qq, kk, pp in ((q, k, pos), (q[:3], k[:3], pos[:3]), (q, k, 9)):
            qo, ko = rope_ops.apply(qq, kk, pp, rope=rope, backend="triton")
            assert_close(qo, qq, rope_reference(qq, pp, **ref_kw), 32, "neox", "apply q")
            assert_close(ko, kk, rope_reference(kk, pp, **ref_kw), 32, "neox", "apply k")
    qg = q.float().requires_grad_(True)
    kg = k.float().requires_grad_(True)
    for _ in range(2):
        qo, ko = rope_ops.apply(qg, kg, pos, rope=rope, backend="triton")
        gq, gk = torch.autograd.grad((qo, ko), (qg, kg), (torch.ones_like(qo), torch.ones_like(ko)))
        grad_kw = dict(ref_kw, inverse=True)
        ones_q, ones_k = torch.ones_like(qg), torch.ones_like(kg)
        assert_close(gq, ones_q, rope_reference(ones_q, pos, **grad_kw), 32, "neox", "grad q")
        assert_close(gk, ones_k, rope_reference(ones_k, pos, **grad_kw), 32, "neox", "grad k")
