"""Conformance tests of the variants: caller cos/sin per token (Hugging Face's form too) and in
low precision or as one cos|sin cache, mRoPE positions, caller outputs (out=), odd head_dim.

Mixed into ``RopeConformance`` (its fixtures ``backend_name``, ``backend_obj``, ``device``). A
backend that does not declare a variant (``Backend.angle_kinds`` / ``table_dtypes``) is skipped
with its reasons, as for any refused call.
"""

from __future__ import annotations

import pytest
import torch

import rope_ops
from rope_ops import RopeError

from .._reference import rope_reference
from .checks import assert_bitwise_equal, assert_rope_close, run_or_skip_refusal

_HEADS_AXIS = {"bshd": 2, "sbhd": 2, "bhsd": 1, "thd": 1}


def _shape(layout, batch, seq, heads, head_dim):
    return {"bshd": (batch, seq, heads, head_dim), "sbhd": (seq, batch, heads, head_dim),
            "bhsd": (batch, heads, seq, head_dim), "thd": (seq, heads, head_dim)}[layout]


def _dtype_for(backend_obj):
    return next(d for d in (torch.bfloat16, torch.float32, torch.float64) if d in backend_obj.dtypes)


_run = run_or_skip_refusal


# name -> (layout, style, head_dim, rotary_dim, table dtype, form, table shape kind)
_TOKEN_CASES = {
    "half_fp32_bshd": ("bshd", "neox", 64, 64, torch.float32, "half", "bs"),
    "hf_duplicated_bf16": ("bshd", "neox", 64, 64, torch.bfloat16, "duplicated", "bs"),
    "hf_duplicated_gptj_partial": ("bshd", "gptj", 64, 32, torch.float32, "duplicated", "bs"),
    "half_fp16_shared_s": ("sbhd", "neox", 32, 32, torch.float16, "half", "s"),
    "half_bhsd_one_s": ("bhsd", "gptj", 48, 48, torch.float32, "half", "1s"),
    "thd_partial_neox": ("thd", "neox", 80, 32, torch.float32, "duplicated", "t"),
}


def _token_tables(form, table_dtype, shape_kind, batch, seq, rotary_dim, style, gen):
    half = rotary_dim // 2
    lead = {"bs": (batch, seq), "s": (seq,), "1s": (1, seq), "t": (seq,)}[shape_kind]
    angles = torch.rand(*lead, half, generator=gen, dtype=torch.float64) * 6.3
    mag = 0.5 + torch.rand(*lead, half, generator=gen, dtype=torch.float64)
    c, s = (mag * angles.cos()).to(table_dtype), (mag * angles.sin()).to(table_dtype)
    if form == "half":
        return (c, s), (c, s)
    if style == "gptj":
        return (c.repeat_interleave(2, dim=-1), s.repeat_interleave(2, dim=-1)), (c, s)
    return (torch.cat([c, c], dim=-1), torch.cat([s, s], dim=-1)), (c, s)


class VariantTests:
    """The variants, held to every backend that declares them."""

    @pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
    @pytest.mark.parametrize("case", list(_TOKEN_CASES))
    def test_per_token_tables(self, backend_name, backend_obj, device, case, grad):
        """cos/sin given per token (no positions), as Hugging Face's rotary modules return them:
        the rotation by exactly those values, forward and backward."""
        if grad and not backend_obj.supports_backward:
            pytest.skip("backend has no backward")
        layout, style, head_dim, rotary_dim, table_dtype, form, shape_kind = _TOKEN_CASES[case]
        dtype = _dtype_for(backend_obj)
        gen = torch.Generator().manual_seed(31)
        batch, seq = (1, 9) if layout == "thd" else (2, 7)
        q = torch.randn(_shape(layout, batch, seq, 4, head_dim), generator=gen).to(dtype).to(device)
        k = torch.randn(_shape(layout, batch, seq, 2, head_dim), generator=gen).to(dtype).to(device)
        given, values = _token_tables(form, table_dtype, shape_kind, batch, seq, rotary_dim, style, gen)
        given = tuple(t.to(device) for t in given)
        ref_tables = tuple(t.reshape(1, seq, -1) if shape_kind == "t" else t for t in values)
        if grad:
            q.requires_grad_(True)
            k.requires_grad_(True)
        q_out, k_out = _run(rope_ops.apply, q, k, None, cos_sin=given, rotary_dim=rotary_dim,
                            style=style, layout=layout, backend=backend_name)
        for x, out, name in ((q, q_out, "q"), (k, k_out, "k")):
            ref = rope_reference(x, None, layout=layout, rotary_dim=rotary_dim, style=style,
                                 token_cos_sin=ref_tables)
            assert_rope_close(out, ref, x, rotary_dim=rotary_dim, style=style, what=f"{case} {name}")
        if grad:
            gq = torch.randn(q.shape, generator=gen).to(dtype).to(device)
            gk = torch.randn(k.shape, generator=gen).to(dtype).to(device)
            torch.autograd.backward((q_out, k_out), (gq, gk))
            for x, g, name in ((q, gq, "dq"), (k, gk, "dk")):
                ref = rope_reference(g, None, layout=layout, rotary_dim=rotary_dim, style=style,
                                     token_cos_sin=ref_tables, inverse=True)
                assert_rope_close(x.grad, ref, g, rotary_dim=rotary_dim, style=style, what=f"{case} {name}")

    @pytest.mark.parametrize("form", ["fp16_pair", "bf16_pair", "cos_sin_cache", "duplicated"])
    def test_position_tables_in_every_form(self, backend_name, backend_obj, device, form):
        """Caller tables indexed by position: fp16/bf16 tables, one [P, r] cos|sin cache read in
        place (vLLM/FlashInfer), the duplicated form with rotary_dim; positions past the table
        are NaN."""
        dtype = _dtype_for(backend_obj)
        gen = torch.Generator().manual_seed(32)
        rows, r = 48, 32
        angles = torch.rand(rows, r // 2, generator=gen, dtype=torch.float64) * 6.3
        table_dtype = {"fp16_pair": torch.float16, "bf16_pair": torch.bfloat16}.get(form, torch.float32)
        c, s = angles.cos().to(table_dtype), angles.sin().to(table_dtype)
        kwargs = {}
        if form == "cos_sin_cache":
            cos_sin = torch.cat([c, s], dim=-1).to(device)
        elif form == "duplicated":
            cos_sin = (torch.cat([c, c], dim=-1).to(device), torch.cat([s, s], dim=-1).to(device))
            kwargs["rotary_dim"] = r
        else:
            cos_sin = (c.to(device), s.to(device))
        q = torch.randn(2, 5, 4, 40, generator=gen).to(dtype).to(device)
        pos = torch.randint(0, rows + 10, (2, 5), generator=gen).to(device)
        if device.type == "cpu":
            pos = pos.clamp_max(rows - 1)  # past the table is a RopeError where it is known on the host
        q_out, _ = _run(rope_ops.apply, q, None, pos, cos_sin=cos_sin, backend=backend_name, **kwargs)
        ref = rope_reference(q, pos, layout="bshd", rotary_dim=r, style="neox", cos_sin=(c, s))
        assert_rope_close(q_out, ref, q, rotary_dim=r, style="neox", what=form)

    @pytest.mark.parametrize("layout", ["bshd", "thd"])
    @pytest.mark.parametrize("interleaved", [False, True], ids=["chunked", "interleaved"])
    @pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
    def test_mrope(self, backend_name, backend_obj, device, layout, interleaved, grad):
        """Multimodal RoPE: three positions per token (t, h, w) and mrope_section; positions
        past the table included."""
        if grad and not backend_obj.supports_backward:
            pytest.skip("backend has no backward")
        dtype = _dtype_for(backend_obj)
        gen = torch.Generator().manual_seed(33)
        head_dim, section = 64, (8, 12, 12)
        rope = rope_ops.RotaryEmbedding(head_dim, base=10000.0, max_position=40)
        batch, seq = (1, 11) if layout == "thd" else (2, 6)
        q = torch.randn(_shape(layout, batch, seq, 4, head_dim), generator=gen).to(dtype).to(device)
        k = torch.randn(_shape(layout, batch, seq, 2, head_dim), generator=gen).to(dtype).to(device)
        pos_shape = (3, seq) if layout == "thd" else (3, batch, seq)
        pos = torch.randint(0, 60, pos_shape, generator=gen).to(device)
        if grad:
            q.requires_grad_(True)
            k.requires_grad_(True)
        q_out, k_out = _run(rope_ops.apply, q, k, pos, rope=rope, mrope_section=section,
                            mrope_interleaved=interleaved, layout=layout, backend=backend_name)
        for x, out, name in ((q, q_out, "q"), (k, k_out, "k")):
            ref = rope_reference(x, pos, layout=layout, rotary_dim=head_dim, style="neox",
                                 inv_freq=rope.inv_freq, mrope_section=section,
                                 mrope_interleaved=interleaved)
            assert_rope_close(out, ref, x, rotary_dim=head_dim, style="neox", what=f"mrope {name}")
        if grad:
            gq = torch.randn(q.shape, generator=gen).to(dtype).to(device)
            torch.autograd.backward((q_out,), (gq,))
            ref = rope_reference(gq, pos, layout=layout, rotary_dim=head_dim, style="neox",
                                 inv_freq=rope.inv_freq, mrope_section=section,
                                 mrope_interleaved=interleaved, inverse=True)
            assert_rope_close(q.grad, ref, gq, rotary_dim=head_dim, style="neox", what="mrope dq")

    def test_mrope_bad_input(self, backend_name, backend_obj, device):
        q = torch.randn(2, 5, 4, 64, device=device)
        pos = torch.zeros(3, 2, 5, dtype=torch.int64, device=device)
        for kwargs, named in (({"mrope_section": (8, 8, 8)}, "mrope_section"),
                              ({"mrope_section": (16, 8)}, "mrope_section"),
                              ({"mrope_section": (16, 8, 8), "mrope_interleaved": 1}, "mrope_interleaved")):
            with pytest.raises(RopeError, match=named):
                rope_ops.apply(q, None, pos, backend=backend_name, **kwargs)
        with pytest.raises(RopeError, match="pos"):
            rope_ops.apply(q, None, pos[:2], mrope_section=(16, 8, 8), backend=backend_name)

    def test_out_argument(self, backend_name, backend_obj, device):
        """Outputs given by the caller, contiguous or strided, are written and returned; bad
        ones are refused before anything is written."""
        dtype = _dtype_for(backend_obj)
        gen = torch.Generator().manual_seed(34)
        q = torch.randn(2, 5, 4, 32, generator=gen).to(dtype).to(device).transpose(0, 1).contiguous().transpose(0, 1)
        k = torch.randn(2, 5, 2, 32, generator=gen).to(dtype).to(device)
        pos = torch.randint(0, 100, (2, 5), generator=gen).to(device)
        want = rope_ops.apply(q, k, pos, backend=backend_name)
        for q_out, k_out in ((torch.empty(2, 5, 4, 32, dtype=dtype, device=device),
                              torch.empty(2, 5, 2, 32, dtype=dtype, device=device)),
                             (torch.empty(2, 5, 8, 32, dtype=dtype, device=device)[:, :, ::2],
                              torch.empty(5, 2, 2, 32, dtype=dtype, device=device).transpose(0, 1))):
            got = _run(rope_ops.apply, q, k, pos, out=(q_out, k_out), backend=backend_name)
            assert got[0] is q_out and got[1] is k_out
            assert_bitwise_equal(q_out, want[0], "q_out written through out=")
            assert_bitwise_equal(k_out, want[1], "k_out written through out=")
        q_before = q.clone()
        for bad in ((q, k), (torch.empty(2, 5, 4, 16, dtype=dtype, device=device), None),
                    (torch.empty_like(q).requires_grad_(True) if dtype.is_floating_point else None,
                     torch.empty_like(k))):
            with pytest.raises(RopeError, match="out"):
                rope_ops.apply(q, k, pos, out=bad, backend=backend_name)
        assert_bitwise_equal(q, q_before, "q after refused out= calls")

    def test_odd_head_dim_with_even_rotary_dim(self, backend_name, backend_obj, device):
        """head_dim 41 with rotary_dim 40 (one pass-through dim), as Liger's tests use."""
        dtype = _dtype_for(backend_obj)
        gen = torch.Generator().manual_seed(35)
        q = torch.randn(2, 3, 4, 41, generator=gen).to(dtype).to(device)
        pos = torch.randint(0, 5000, (2, 3), generator=gen).to(device)
        rope = rope_ops.RotaryEmbedding(41, rotary_dim=40, max_position=64)
        for style in ("neox", "gptj"):
            rope = rope_ops.RotaryEmbedding(41, rotary_dim=40, max_position=64, style=style)
            q_out, _ = _run(rope_ops.apply, q, None, pos, rope=rope, backend=backend_name)
            ref = rope_reference(q, pos, layout="bshd", rotary_dim=40, style=style, inv_freq=rope.inv_freq)
            assert_rope_close(q_out, ref, q, rotary_dim=40, style=style, what=f"D=41 {style}")
