"""The Triton kernel's angle variants against the float64 reference, on hand-built KernelArgs:
per-token cos/sin (angles "token") and mRoPE (angles "mrope").

    TRITON_INTERPRET=1 pytest tests/test_triton_variants.py     # CPU, the Triton interpreter

On a machine with a GPU and without the variable, the same checks run on CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch
from _triton_support import DEVICE, needs_device

pytestmark = needs_device

pytest.importorskip("triton")

from rope_ops._mrope import mrope_axes  # noqa: E402
from rope_ops._reference import rope_reference  # noqa: E402
from rope_ops.backend import KernelArgs  # noqa: E402
from rope_ops.frequencies import compute_inv_freq, cos_sin_table, freq_turns_of  # noqa: E402
from rope_ops.testing.checks import assert_bitwise_equal, assert_rope_close  # noqa: E402

import rope_ops_backends.triton_backend as tb  # noqa: E402

SHAPE_OF = {
    "bshd": lambda B, S, H, D: (B, S, H, D),
    "sbhd": lambda B, S, H, D: (S, B, H, D),
    "bhsd": lambda B, S, H, D: (B, H, S, D),
    "thd": lambda B, S, H, D: (B * S, H, D),
}


def data(layout, B, S, H, D, dtype, gen):
    return torch.randn(SHAPE_OF[layout](B, S, H, D), generator=gen).to(dtype).to(DEVICE)


def run(args: KernelArgs, label: str | None):
    """Through the launch policy (run) or a candidate configuration (run_with)."""
    if label is None:
        tb.TritonBackend().run(args)
    else:
        tb.run_with(args, label)


def check(args: KernelArgs, inputs, style, ref_kw, what):
    for x, out, name in ((inputs[0], args.q_out, "q"), (inputs[1], args.k_out, "k")):
        if x is None:
            continue
        ref = rope_reference(x, args.pos, layout=args.layout, rotary_dim=args.rotary_dim,
                             style=style, inverse=args.inverse, **ref_kw)
        assert_rope_close(out, ref, x, rotary_dim=args.rotary_dim, style=style,
                          what=f"{what} {name}")
    if not args.inplace:
        assert_bitwise_equal(args.q.cpu(), inputs[0].cpu(), f"{what}: q input untouched")


# ---------------------------------------------------------------------------------------------
# Per-token cos/sin: row (b, s) of [B, S, R/2] tables through strides, no positions.

# name -> (layout, B, S, hq, hk, D, R, style, dtype, table dtype, table form, in place, inverse,
#          label)
TOKEN_CASES = {
    "bshd bf16 fp32 rows": ("bshd", 2, 5, 4, 2, 32, 32, "neox", torch.bfloat16, torch.float32,
                            "bs", False, False, None),
    "hf batch-broadcast bf16 rows, partial gptj": ("bshd", 3, 4, 3, 1, 40, 24, "gptj",
                                                   torch.bfloat16, torch.bfloat16, "1s", False,
                                                   False, None),
    "sbhd fp16 rows, in place, head grid": ("sbhd", 2, 3, 4, 2, 48, 48, "neox", torch.float16,
                                            torch.float16, "bs", True, False,
                                            "grid t1 hq2 hk1 w1"),
    "thd fp32, inverse, walk": ("thd", 1, 7, 5, 1, 24, 16, "neox", torch.float32,
                                torch.float32, "bs", False, True, "walk t2 hq2 hk1 w2"),
    "bhsd strided rows (cos|sin halves of one tensor)": ("bhsd", 2, 3, 2, 2, 20, 20, "gptj",
                                                         torch.bfloat16, torch.float32, "cache",
                                                         False, False, None),
}


def token_tables(form, B, S, half, table_dtype, gen):
    """(cos, sin) [B, S, half] views as rope_ops hands them to backends, and the values."""
    angles = torch.rand(B, S, half, generator=gen, dtype=torch.float64) * 6.3
    mag = 0.5 + torch.rand(B, S, half, generator=gen, dtype=torch.float64)
    if form == "1s":  # one row per token shared by the batch (stride 0 along B)
        angles, mag = angles[:1].expand(B, S, half), mag[:1].expand(B, S, half)
    c = (mag * angles.cos()).to(table_dtype).to(DEVICE)
    s = (mag * angles.sin()).to(table_dtype).to(DEVICE)
    if form == "cache":  # [B, S, 2 * half]: cos then sin, each a strided view
        both = torch.cat([c, s], dim=-1)
        c, s = both[..., :half], both[..., half:]
    return c, s


@pytest.mark.parametrize("name", list(TOKEN_CASES))
def test_per_token_tables(name):
    layout, B, S, hq, hk, D, R, style, dtype, table_dtype, form, inplace, inverse, label = \
        TOKEN_CASES[name]
    gen = torch.Generator().manual_seed(11)
    q, k = data(layout, B, S, hq, D, dtype, gen), data(layout, B, S, hk, D, dtype, gen)
    inputs = (q.clone(), k.clone())
    cos, sin = token_tables(form, 1 if layout == "thd" else B, S if layout != "thd" else B * S,
                            R // 2, table_dtype, gen)
    args = KernelArgs(q=q, k=k, q_out=q if inplace else torch.empty_like(q),
                      k_out=k if inplace else torch.empty_like(k), pos=None, pos_offset=0,
                      cos=cos, sin=sin, freq_turns=None, attention_factor=1.0, layout=layout,
                      rotary_dim=R, interleaved=style == "gptj", inverse=inverse, inplace=inplace,
                      angles="token")
    run(args, label)
    check(args, inputs, style, {"token_cos_sin": (cos, sin)}, name)


# ---------------------------------------------------------------------------------------------
# mRoPE: frequency i takes the table row of position pos[axis_i].


def test_in_kernel_axes_match_mrope_axes():
    """The kernel's axis rule (chunked: by section bounds; interleaved: i % 3 below 3 * section)
    is rope_ops._mrope.mrope_axes, for every section of a small half (interleaved with an empty
    h or w section: mrope_axes cannot build those; the kernel's rule gives that axis nothing)."""
    for half in (4, 5, 20, 24):
        for s1 in range(half + 1):
            for s2 in range(half + 1 - s1):
                section = (half - s1 - s2, s1, s2)
                i = torch.arange(half)
                chunked = torch.where(i < section[0], 0, torch.where(i < section[0] + s1, 1, 2))
                inter = torch.where((i % 3 == 1) & (i < 3 * s1), 1,
                                    torch.where((i % 3 == 2) & (i < 3 * s2), 2, 0))
                assert torch.equal(chunked, mrope_axes(section, False)), section
                if s1 and s2:
                    assert torch.equal(inter, mrope_axes(section, True)), section
                else:
                    assert s1 or not (inter == 1).any(), section
                    assert s2 or not (inter == 2).any(), section


# name -> (layout, B, S, D, section, interleaved, pos form, pos dtype, position range, caller
#          tables, label)
MROPE_CASES = {
    "chunked bshd [3, B, S]": ("bshd", 2, 5, 40, (4, 8, 8), False, "3bs", torch.int64, (0, 60),
                               False, None),
    "interleaved thd [3, T], past the table": ("thd", 1, 9, 40, (4, 10, 6), True, "3bs",
                                               torch.int64, (-30, 400), False, None),
    "chunked shared [3, S] int32, head grid": ("bshd", 3, 4, 32, (8, 4, 4), False, "3s",
                                               torch.int32, (0, 64), False,
                                               "grid t2 hq2 hk1 w1"),
    "interleaved caller tables (NaN past them), walk": ("sbhd", 2, 4, 48, (8, 8, 8), True, "3bs",
                                                        torch.int64, (0, 80), True,
                                                        "walk t2 hq2 hk1 w2"),
    "one axis only (20, 0, 0)": ("bshd", 2, 3, 40, (20, 0, 0), False, "3bs", torch.int64,
                                 (0, 64), False, None),
    "no time axis (0, 10, 10) interleaved": ("thd", 1, 6, 40, (0, 10, 10), True, "3bs",
                                             torch.int64, (0, 64), False, None),
}


@pytest.mark.parametrize("name", list(MROPE_CASES))
def test_mrope(name):
    layout, B, S, D, section, interleaved, form, pos_dtype, (lo, hi), caller, label = \
        MROPE_CASES[name]
    gen = torch.Generator().manual_seed(12)
    q, k = data(layout, B, S, 3, D, torch.bfloat16, gen), data(layout, B, S, 2, D, torch.bfloat16,
                                                               gen)
    inputs = (q.clone(), k.clone())
    if layout == "thd":
        pos = torch.randint(lo, hi, (3, B * S), generator=gen)
    elif form == "3s":
        pos = torch.randint(lo, hi, (3, S), generator=gen)
    else:
        pos = torch.randint(lo, hi, (3, B, S), generator=gen)
    pos = pos.to(pos_dtype).to(DEVICE)
    inv_freq = compute_inv_freq(D, 10000.0)[0]
    m = 1.0 if caller else 1.07
    cos, sin = (t.to(DEVICE) for t in cos_sin_table(inv_freq, m, 64))
    turns = None if caller else freq_turns_of(inv_freq).to(DEVICE)
    args = KernelArgs(q=q, k=k, q_out=torch.empty_like(q), k_out=torch.empty_like(k), pos=pos,
                      pos_offset=0, cos=cos, sin=sin, freq_turns=turns, attention_factor=m,
                      layout=layout, rotary_dim=D, interleaved=False, inverse=False,
                      inplace=False, angles="mrope", mrope_section=section,
                      mrope_interleaved=interleaved)
    run(args, label)
    ref_kw = {"mrope_section": section, "mrope_interleaved": interleaved}
    if caller:
        ref_kw["cos_sin"] = (cos, sin)
    else:
        ref_kw.update(inv_freq=inv_freq, attention_factor=m)
    check(args, inputs, "neox", ref_kw, name)


def test_mrope_with_one_section_is_positions():
    """mRoPE with every frequency on axis 0 is the plain kernel with pos[0], bit for bit."""
    gen = torch.Generator().manual_seed(13)
    q = data("bshd", 2, 4, 3, 32, torch.bfloat16, gen)
    pos = torch.randint(-20, 200, (3, 2, 4), generator=gen).to(DEVICE)
    inv_freq = compute_inv_freq(32, 10000.0)[0]
    cos, sin = (t.to(DEVICE) for t in cos_sin_table(inv_freq, 1.0, 64))
    turns = freq_turns_of(inv_freq).to(DEVICE)
    outs = []
    for kind, p, section in (("mrope", pos, (16, 0, 0)), ("table", pos[0], None)):
        out = torch.empty_like(q)
        tb.TritonBackend().run(KernelArgs(
            q=q, k=None, q_out=out, k_out=None, pos=p, pos_offset=0, cos=cos, sin=sin,
            freq_turns=turns, attention_factor=1.0, layout="bshd", rotary_dim=32,
            interleaved=False, inverse=False, inplace=False, angles=kind, mrope_section=section))
        outs.append(out)
    assert_bitwise_equal(outs[0], outs[1], "mRoPE (16, 0, 0) against positions pos[0]")


def test_backend_declares_the_variants():
    b = tb.TritonBackend()
    assert b.angle_kinds == frozenset({"table", "token", "mrope"})
    assert b.supports_prologue
