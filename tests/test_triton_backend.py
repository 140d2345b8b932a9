"""TritonBackend.run against the float64 reference, on hand-built KernelArgs.

Runs on CPU tensors under the Triton interpreter (the variable must be set before triton is
imported, so it is set on the command line):

    TRITON_INTERPRET=1 pytest tests/test_triton_backend.py

On a machine with a GPU and without the variable, the same checks run on CUDA tensors.
Otherwise every test is skipped.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if INTERPRET:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    DEVICE = None

pytestmark = pytest.mark.skipif(
    DEVICE is None, reason="needs TRITON_INTERPRET=1 (CPU interpreter) or a CUDA device")

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


def run_case(*, layout="bshd", B=2, S=3, hq=4, hk=2, D=16, R=None, dtype=torch.float32,
             style="neox", inplace=False, pos_kind="bs", pos_dtype=torch.int64, lo=0, hi=64,
             n_rows=64, base=10000.0, m=1.0, caller=False, inverse=False, packed=False,
             out_contig=False, small=True, seed=0):
    R = D if R is None else R
    gen = torch.Generator().manual_seed(seed)
    if packed:
        assert layout == "bshd"
        qkv = make_input("bshd", B, S, hq + 2 * max(hk, 1), D, dtype, gen)
        q = qkv[:, :, :hq]
        k = qkv[:, :, hq:hq + hk] if hk else None
        v_before = qkv[:, :, hq + hk:].clone()
    else:
        q = make_input(layout, B, S, hq, D, dtype, gen)
        k = make_input(layout, B, S, hk, D, dtype, gen) if hk else None
    q_in = q.clone()
    k_in = None if k is None else k.clone()
    pos, off, ref_pos = make_pos(pos_kind, layout, B, S, gen, pos_dtype, lo, hi)

    inv_freq = inv_freq_of(R, base)
    cos, sin = tables(inv_freq, n_rows, m, DEVICE)
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
    backend = tb.TritonBackend()
    old = tb._SMALL_TOKENS
    tb._SMALL_TOKENS = 1 << 30 if small else 0
    try:
        backend.run(args)
    finally:
        tb._SMALL_TOKENS = old

    ref_kw = dict(layout=layout, rotary_dim=R, style=style, inv_freq=inv_freq,
                  attention_factor=m, cos_sin=(cos, sin) if caller else None, inverse=inverse)
    what = f"{layout} {dtype} {style} R={R}/{D} hq={hq} hk={hk} inplace={inplace}"
    assert_close(q_out, q_in, rope_reference(q_in, ref_pos, **ref_kw), R, style, what + " q")
    if k is not None:
        assert_close(k_out, k_in, rope_reference(k_in, ref_pos, **ref_kw), R, style, what + " k")
    if not inplace:  # inputs untouched, bitwise
        assert torch.equal(q.cpu(), q_in.cpu())
        if k is not None:
            assert torch.equal(k.cpu(), k_in.cpu())
    if packed:  # v untouched
        assert torch.equal(qkv[:, :, hq + hk:].cpu(), v_before.cpu())


# ---------------------------------------------------------------------------------------------
# Tests.

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd", "thd"])
def test_layout_style_dtype(layout, style, dtype):
    run_case(layout=layout, style=style, dtype=dtype, pos_kind="shared" if layout == "sbhd" else "bs")


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("R,D", [(8, 16), (12, 20), (16, 32)])
def test_partial_rotary(R, D, inplace, style):
    # In place: the pass-through bytes are the input's (assert_close checks them bitwise).
    run_case(R=R, D=D, inplace=inplace, style=style, dtype=torch.bfloat16)


@pytest.mark.parametrize("hq,hk", [(4, 1), (8, 2), (3, 5), (2, 0), (5, 3)])
def test_gqa_mqa_k_none(hq, hk):
    run_case(hq=hq, hk=hk, dtype=torch.float16)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_packed_qkv_views(style, inplace):
    run_case(packed=True, hq=4, hk=2, style=style, inplace=inplace, dtype=torch.bfloat16)


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
    # Computed on the fly from freq_turns; with an attention factor, base 500000 as in PERF.md.
    run_case(lo=lo, hi=hi, style=style, n_rows=64, base=500000.0, m=1.1, D=32)


def test_large_offset_and_empty_table():
    run_case(pos_kind="offset", lo=(1 << 20) - 2, n_rows=64)
    run_case(pos_kind="offset", lo=(1 << 33) + 7, n_rows=64)  # int64 offset (JIT path)
    run_case(pos_kind="bs", lo=0, hi=100, n_rows=0)


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_caller_tables_out_of_range_nan(style):
    # Rows outside [0, 16): NaN in the rotary dims of that token; pass-through copied exactly.
    run_case(caller=True, lo=-5, hi=24, n_rows=16, style=style, R=8, D=16)
    run_case(caller=True, lo=-5, hi=24, n_rows=16, style=style, R=8, D=16, inplace=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_inverse(style, dtype):
    run_case(inverse=True, style=style, dtype=dtype, lo=0, hi=200, n_rows=64)


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_multi_token_blocks(style):
    # The prefill blocking (BLOCK_T > 1, ragged last block, several head chunks).
    run_case(small=False, B=3, S=7, hq=6, hk=2, D=16, R=12, style=style, dtype=torch.bfloat16)
    run_case(small=False, layout="sbhd", B=2, S=9, hq=3, hk=3, D=16, style=style,
             inplace=True, pos_kind="shared")


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


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_odd_sizes(style):
    # Smallest head (D = R = 2), a non-pow2 half (R/2 = 40), many non-pow2 heads in chunks.
    run_case(D=2, hq=1, hk=1, style=style)
    run_case(D=80, hq=3, hk=1, S=2, style=style, dtype=torch.bfloat16)
    run_case(small=False, D=8, R=6, hq=40, hk=5, B=1, S=5, style=style, dtype=torch.float16)


@pytest.mark.parametrize("cfg", [(1, 32, 8, False), (1, 2, 1, True), (2, 4, 2, True),
                                 (2, 2, 1, False), (4, 16, 4, False), (2, 4, 2, True, True),
                                 (2, 2, 1, False, True)], ids=str)
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_forced_block_configs(cfg, style, monkeypatch):
    # Every kernel path the sweep (tools/gpu_triton_check.py) can select: the per-token-block
    # chunk walk (decode EARLY = 2 when BLOCK_T = 1) and the head grid, ragged heads and tokens.
    monkeypatch.setattr(tb, "_pick_blocks", lambda *a: cfg)
    run_case(B=2, S=5, hq=5, hk=3, D=16, R=12, style=style, dtype=torch.bfloat16)
    run_case(B=2, S=5, hq=3, hk=0, D=16, style=style, inplace=True, lo=-10, hi=100, n_rows=64)
    run_case(layout="thd", B=1, S=7, hq=4, hk=2, D=16, style=style, inverse=True)
    # Sequences of one token (TOK_SPLIT = 2) and one sequence (TOK_SPLIT = 1), both position forms.
    run_case(B=3, S=1, hq=4, hk=2, D=16, style=style, pos_kind="bs")
    run_case(B=3, S=1, hq=4, hk=2, D=16, style=style, pos_kind="offset", lo=5)
    run_case(B=1, S=6, hq=4, hk=2, D=16, style=style, pos_kind="offset", lo=5)


def test_default_configs():
    # The H200 defaults (NOTES.md): W1/W4/W5 (4, 16, 8); W3 in place (4, 16, 4); W2 head grid.
    assert tb._pick_blocks(16384, 32, 8, 128, 128, False) == (4, 16, 8, False)
    assert tb._pick_blocks(8192, 32, 32, 128, 128, False) == (4, 16, 8, False)
    assert tb._pick_blocks(32768, 64, 8, 128, 128, False) == (4, 16, 8, False)
    assert tb._pick_blocks(8192, 16, 16, 256, 64, False) == (4, 16, 4, False)
    assert tb._pick_blocks(8192, 16, 16, 256, 64, True) == (1, 8, 4, False)
    assert tb._pick_blocks(256, 32, 8, 128, 128, False) == (1, 16, 2, True)
    # Block sizes are powers of two for any shape (tl.arange): partial rotary with a pass-through
    # copy once gave BLOCK_H 12 (decode, D 256, R 64) and BLOCK_T 3 (prefill, D 128, R 32).
    for n in (1, 7, 256, 300, 4096, 100000):
        for hq, hk in ((1, 0), (3, 1), (16, 16), (40, 5), (64, 8)):
            for D, R in ((2, 2), (80, 32), (128, 32), (128, 128), (256, 64), (96, 48), (2048, 1024)):
                for copy in (False, True):
                    cfg = tb._pick_blocks(n, hq, hk, D, R, copy and R < D)
                    assert all(v & (v - 1) == 0 for v in cfg[:3]), (n, hq, hk, D, R, copy, cfg)


def test_partial_rotary_big_pass_through():
    # Phi-like (R 32 of D 80 -> a 160-element tile per head) and GPT-J (R 64 of D 256) shapes
    # through both plans.
    for small in (True, False):
        run_case(small=small, B=1, S=5, hq=8, hk=2, D=80, R=32, dtype=torch.bfloat16)
        run_case(small=small, B=1, S=3, hq=16, hk=4, D=256, R=64, style="gptj",
                 dtype=torch.bfloat16)


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
    for _ in range(2):  # the plan's first (JIT) and later calls
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
