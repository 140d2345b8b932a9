"""AscendBackend without an NPU: a fake ``torch_npu`` that implements npu_rotary_mul's documented
semantics (and refuses, like CANN's error 561002, what its documentation says it cannot take).

Covers: lazy/guarded import and availability reasons; argument translation to npu_rotary_mul
(full-width cos/sin, modes, shapes, float32 compute, partial rotary, in place, inverse); the
limits pre-check and the tier choice; the pure-torch fallback; tier 1 (our kernels) with the
kernel op replaced by the CPU simulation of the shipped kernels; autograd through rope_ops.apply.
Tensors are CPU tensors: AscendBackend.run never looks at the device type.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rope_ops import BackendError
from rope_ops._reference import rope_reference
from rope_ops.testing.tolerances import allowed_error
from rope_ops.backend import KernelArgs
from rope_ops.frequencies import compute_inv_freq, cos_sin_table, freq_turns_of
from rope_ops_backends import ascend_backend as ab
from rope_ops_backends.ascend_backend import limits

ROOT = Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ------------------------------------------------------------------------------ fakes
from ascend.fakes import Refused, install_fake_torch_npu  # noqa: E402


@pytest.fixture
def fake_npu(monkeypatch):
    """Install a fake torch_npu (with npu_rotary_mul) and torch.npu; yields (backend, calls)."""
    calls = []
    dev = install_fake_torch_npu(monkeypatch, calls)
    for var in ("ROPE_OPS_ASCEND_TIERS", "ROPE_OPS_ASCEND_LIB", "ROPE_OPS_ASCEND_UB_SIZE", "ROPE_OPS_ASCEND_CORES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(ab, "library_candidates", lambda: [Path("/nonexistent/librope_ops_ascend.so")])
    b = ab.AscendBackend()
    b.fake_device = dev
    return b, calls


# ------------------------------------------------------------------------------ helpers
def _inv(r):
    inv = compute_inv_freq(r, 10000.0)
    return inv[0] if isinstance(inv, tuple) else inv


def make_args(*, layout="bshd", style="neox", dtype=torch.float32, B=2, S=6, Hq=3, Hk=2, D=32, r=None,
              pos="int64", table_rows=64, caller_tables=False, inverse=False, inplace=False, seed=0,
              q_noncontig=False):
    r = D if r is None else r
    g = torch.Generator().manual_seed(seed)

    def mk(h):
        if layout == "thd":
            return torch.randn(B * S, h, D, generator=g).to(dtype)
        t = torch.randn(B, S, h, D, generator=g).to(dtype)
        return {"bshd": t, "sbhd": t.transpose(0, 1).contiguous(), "bhsd": t.transpose(1, 2).contiguous()}[layout]

    q = mk(Hq)
    if q_noncontig:  # stride 2 on head_dim
        q = torch.stack((q, q), dim=-1)[..., 0]
    k = mk(Hk) if Hk else None
    inv = _inv(r)
    cos, sin = cos_sin_table(inv, 1.0, table_rows)
    if pos == "offset":
        p, off = None, 3
    elif pos == "shared":
        p, off = torch.arange(S) + 5, 0
    else:
        shape = (B * S,) if layout == "thd" else (B, S)
        p = torch.randint(-2, table_rows + 30, shape, generator=g).to(torch.int32 if pos == "int32" else torch.int64)
        if p.numel():
            p.view(-1)[0] = 2**20 - 3
        off = 0
    args = KernelArgs(q=q, k=k, q_out=q if inplace else torch.full_like(q, float("nan")),
                      k_out=(k if inplace else torch.full_like(k, float("nan"))) if k is not None else None,
                      pos=p, pos_offset=off, cos=cos, sin=sin, freq_turns=None if caller_tables else freq_turns_of(inv),
                      attention_factor=1.0, layout=layout, rotary_dim=r, interleaved=style == "gptj",
                      inverse=inverse, inplace=inplace)
    ref_kw = dict(layout=layout, rotary_dim=r, style=style, inverse=inverse)
    if caller_tables:
        ref_kw["cos_sin"] = (cos, sin)
    else:
        ref_kw["inv_freq"] = inv
    inputs = (q.clone(), None if k is None else k.clone())
    return args, ref_kw, inputs


def check_outputs(args, ref_kw, inputs):
    pos = args.pos if args.pos is not None else args.pos_offset
    r, style = ref_kw["rotary_dim"], ref_kw["style"]
    for x0, out in zip(inputs, (args.q_out, args.k_out)):
        if x0 is None:
            continue
        ref = rope_reference(x0, pos, **ref_kw)
        got = out.detach().to(torch.float64)
        x = x0.to(torch.float64)
        bound = allowed_error(x0, ref.nan_to_num(), x0.dtype, r, style)  # SPEC "Accuracy"
        nan = torch.isnan(ref)
        assert torch.equal(torch.isnan(got[..., :r]), nan[..., :r])
        ok = ((got - ref).abs() <= bound) | nan
        ok[..., r:] = got[..., r:] == x[..., r:]
        assert bool(ok.all()), f"{(~ok).sum().item()} elements off, max {(got - ref).abs()[~ok].max().item()}"


# ------------------------------------------------------------------------------ import/availability
def test_import_does_not_import_torch_npu():
    code = ("import sys, rope_ops_backends.ascend_backend as m; b = m.AscendBackend(); "
            "assert 'torch_npu' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_not_installed_reason(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch_npu" else None)
    reasons = ab.AscendBackend().availability()
    assert "torch_npu is not installed" in reasons[0]
    assert any("own Ascend C kernels" in r and "not built" in r for r in reasons)


@pytest.mark.parametrize("exc,text", [
    ("ImportError('libhccl.so: cannot open shared object file')", "libhccl.so"),
    ("OSError('libascendcl.so: cannot open shared object file')", "libascendcl.so"),
    ("RuntimeError('Failed to load the backend extension: torch_npu')", "Failed to load the backend"),
])
def test_broken_torch_npu_reason(tmp_path, monkeypatch, exc, text):
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"raise {exc}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    reasons = ab.AscendBackend().availability()
    assert "failed to import" in reasons[0] and "CANN" in reasons[0]
    assert text in reasons[0] and exc.split("(")[0] in reasons[0]


def test_no_device_reason(fake_npu):
    b, _ = fake_npu
    b.fake_device.count = 0
    assert any("no NPU device visible" in r for r in b.availability())


def test_available_with_fake(fake_npu):
    b, _ = fake_npu
    assert b.availability() == []
    tiers = {t["tier"]: t for t in b.describe()["tiers"]}
    assert not tiers["kernels"]["usable"] and "not built" in tiers["kernels"]["status"]
    assert tiers["npu_rotary_mul"]["usable"] and tiers["torch"]["usable"]


# ------------------------------------------------------------------------------ tier 2
@pytest.mark.parametrize("inverse", [False, True], ids=["fwd", "grad"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rotary_mul_translation(fake_npu, style, dtype, inverse):
    b, calls = fake_npu
    args, ref_kw, inputs = make_args(style=style, dtype=dtype, inverse=inverse)
    b.run(args)
    assert b.last_tier == "npu_rotary_mul", b.last_reasons
    check_outputs(args, ref_kw, inputs)
    assert len(calls) == 2  # q and k
    B, S, r = 2, 6, 32
    for call, h in zip(calls, (3, 2)):
        assert call["x"] == (1, B * S, h, r) and call["x_dtype"] == torch.float32
        assert call["cos"] == (1, B * S, 1, r) and call["rotate"] is None
        assert call["mode"] == ("interleave" if style == "gptj" else "half")
    # Full-width expansion of the per-token rows.
    c = calls[0]["r1"].reshape(B * S, r)
    s = calls[0]["r2"].reshape(B * S, r)
    if style == "gptj":
        assert torch.equal(c[:, 0::2], c[:, 1::2]) and torch.equal(s[:, 0::2], s[:, 1::2])
    else:
        assert torch.equal(c[:, : r // 2], c[:, r // 2:]) and torch.equal(s[:, : r // 2], s[:, r // 2:])
    # Backward = sin negated (rotation by minus the angle).
    p0 = args.pos.view(-1)[1].item()  # token 1 (token 0 is far outside the table)
    if 0 <= p0 < args.cos.shape[0]:
        sign = -1 if inverse else 1
        assert torch.equal(s[1, 0], sign * args.sin[p0, 0])


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd", "thd"])
@pytest.mark.parametrize("pos", ["offset", "shared", "int32", "int64"])
def test_rotary_mul_layouts_positions(fake_npu, layout, pos):
    b, calls = fake_npu
    if layout == "thd" and pos == "shared":
        pos = "int64"
    args, ref_kw, inputs = make_args(layout=layout, pos=pos, dtype=torch.bfloat16, D=64)
    b.run(args)
    assert b.last_tier == "npu_rotary_mul", b.last_reasons
    check_outputs(args, ref_kw, inputs)


def test_rotary_mul_bnsd_native_when_allowed(fake_npu):
    b, calls = fake_npu
    # bhsd, D/2 = 32 floats (aligned), B*N = 2*3 <= 8*S: CANN accepts BNSD -> no transpose copy.
    args, ref_kw, inputs = make_args(layout="bhsd", D=64, S=8, pos="shared", Hk=0)
    b.run(args)
    assert calls[-1]["x"] == (2, 3, 8, 64) and calls[-1]["cos"] == (1, 1, 8, 64)
    check_outputs(args, ref_kw, inputs)
    # Per-batch positions: cos B1SD.
    args, ref_kw, inputs = make_args(layout="bhsd", D=64, S=8, pos="int64", Hk=0)
    b.run(args)
    assert calls[-1]["x"] == (2, 3, 8, 64) and calls[-1]["cos"] == (2, 1, 8, 64)
    check_outputs(args, ref_kw, inputs)
    # B*N > 8*S: the skip rule -> merged BSND form instead.
    args, ref_kw, inputs = make_args(layout="bhsd", D=64, S=1, Hq=20, Hk=0, pos="shared")
    b.run(args)
    assert calls[-1]["x"] == (1, 2, 20, 64)
    check_outputs(args, ref_kw, inputs)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("inplace", [False, True])
def test_rotary_mul_partial_rotary(fake_npu, dtype, inplace):
    b, calls = fake_npu
    args, ref_kw, inputs = make_args(D=80, r=48, dtype=dtype, inplace=inplace, style="gptj")
    b.run(args)
    assert b.last_tier == "npu_rotary_mul"
    assert calls[0]["x"][-1] == 48
    check_outputs(args, ref_kw, inputs)


def test_rotary_mul_caller_tables_nan(fake_npu):
    b, _ = fake_npu
    args, ref_kw, inputs = make_args(caller_tables=True, table_rows=10)
    b.run(args)
    assert b.last_tier == "npu_rotary_mul"
    check_outputs(args, ref_kw, inputs)


@pytest.mark.parametrize("case,why", [
    (dict(D=896), "D=896 >= 896"),
    (dict(D=16, Hq=1000, Hk=0), "N=1000 must be < 1000"),
    (dict(D=16, Hq=500, Hk=0, style="gptj"), "B*N=500"),  # fine: 500 < 1000 (control)
    (dict(D=16, Hq=1000, Hk=0, style="gptj"), "B*N=1000 must be < 1000"),
])
def test_limits_fall_back_to_torch(fake_npu, case, why):
    b, calls = fake_npu
    args, ref_kw, inputs = make_args(S=2, **case)
    b.run(args)
    if why.startswith("B*N=500"):
        assert b.last_tier == "npu_rotary_mul"
    else:
        assert b.last_tier == "torch", b.last_reasons
        assert any(why in r for r in b.last_reasons["npu_rotary_mul"]), b.last_reasons
        assert not calls
    check_outputs(args, ref_kw, inputs)


def test_old_soc_gptj_falls_back(fake_npu):
    b, calls = fake_npu
    b.fake_device.name = "Ascend310P3"
    args, ref_kw, inputs = make_args(style="gptj")
    b.run(args)
    assert b.last_tier == "torch" and not calls
    check_outputs(args, ref_kw, inputs)
    args, ref_kw, inputs = make_args(style="neox")
    b.run(args)
    assert b.last_tier == "npu_rotary_mul"


def test_fake_really_refuses_what_limits_refuse(fake_npu):
    """The pre-check is what keeps the op from failing: calling it anyway raises."""
    _, calls = fake_npu
    rm = sys.modules["torch_npu"].npu_rotary_mul
    with pytest.raises(Refused):
        rm(torch.zeros(1, 4, 1, 896), torch.zeros(1, 4, 1, 896), torch.zeros(1, 4, 1, 896))
    with pytest.raises(Refused):
        rm(torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8), rotary_mode="interleave")


def test_tiers_env(fake_npu, monkeypatch):
    b, calls = fake_npu
    monkeypatch.setenv("ROPE_OPS_ASCEND_TIERS", "torch")
    args, ref_kw, inputs = make_args()
    b.run(args)
    assert b.last_tier == "torch" and not calls
    check_outputs(args, ref_kw, inputs)


def test_tiers_env_without_torch_fails_loudly(fake_npu, monkeypatch):
    b, calls = fake_npu
    monkeypatch.setenv("ROPE_OPS_ASCEND_TIERS", "npu_rotary_mul")
    args, _, _ = make_args(D=896)  # outside npu_rotary_mul's limits
    with pytest.raises(BackendError, match="no tier allowed"):
        b.run(args)


def test_zero_tokens(fake_npu):
    b, calls = fake_npu
    args, _, _ = make_args(S=0)
    b.run(args)
    assert not calls


# ------------------------------------------------------------------------------ limits unit tests
def test_bnsd_skip_rule():
    # D/2 aligned (fp32: D/2 = 8 floats = 32 bytes): refuse when B*N > 8*S.
    assert not limits.bnsd_skip(2, 4, 1, 16, 4, 40)  # 8 <= 8
    assert limits.bnsd_skip(3, 3, 1, 16, 4, 40)  # 9 > 8
    # D/2 unaligned and D < 80: refuse when 2*B*N > ceil(S/cores).
    assert limits.bnsd_skip(1, 1, 40, 14, 2, 40)  # 2 > 1
    assert not limits.bnsd_skip(1, 1, 80, 14, 2, 40)  # 2 <= 2
    assert not limits.bnsd_skip(1, 1, 40, 82, 2, 40)  # D >= 80: accepted


def test_rotary_mul_reasons_cases():
    ok = dict(layout="BSND", mode="half", dtype="float32")
    assert limits.rotary_mul_reasons((2, 8, 4, 64), (1, 8, 1, 64), **ok) == []
    assert limits.rotary_mul_reasons((2, 8, 4, 64), (2, 8, 1, 64), **ok) == []
    assert limits.rotary_mul_reasons((2, 8, 4, 64), (2, 8, 4, 64), **ok) == []
    assert limits.rotary_mul_reasons((2, 8, 4, 64), (2, 1, 4, 64), **ok)  # not an allowed form
    assert limits.rotary_mul_reasons((2, 8, 4, 63), (1, 8, 1, 63), **ok)  # odd D
    assert limits.rotary_mul_reasons((1000, 8, 4, 64), (1, 8, 1, 64), **ok)
    il = dict(layout="BSND", mode="interleave", dtype="float16")
    assert limits.rotary_mul_reasons((1, 8, 4, 64), (1, 8, 1, 64), **il) == []
    assert limits.rotary_mul_reasons((2, 8, 4, 64), (2, 8, 1, 64), **il)  # not S-only
    assert limits.rotary_mul_reasons((1, 8, 4, 64), (1, 8, 1, 64), soc_name="Ascend910A", **il)
    assert limits.rotary_mul_reasons((1, 8, 4, 64), (1, 8, 1, 64), dtype="float64", layout="BSND", mode="half")
    bn = dict(layout="BNSD", mode="half", dtype="float32")
    assert limits.rotary_mul_reasons((2, 3, 8, 64), (1, 1, 8, 64), **bn) == []
    assert any("skip rule" in r for r in limits.rotary_mul_reasons((2, 30, 1, 64), (1, 1, 1, 64), **bn))


# ------------------------------------------------------------------------------ tier 3
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_torch_tier_matches_reference(fake_npu, monkeypatch, layout):
    b, _ = fake_npu
    monkeypatch.setenv("ROPE_OPS_ASCEND_TIERS", "torch")
    args, ref_kw, inputs = make_args(layout=layout, D=40, r=24, style="gptj", inverse=True, dtype=torch.float16)
    b.run(args)
    check_outputs(args, ref_kw, inputs)


# ------------------------------------------------------------------------------ tier 1 via the CPU simulation
@pytest.fixture
def sim_kernels(fake_npu):
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    from ascend.fakes import use_sim_kernels

    b, calls = fake_npu
    launched = []
    use_sim_kernels(b, launched=launched)
    return b, calls, launched


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd", "thd"])
def test_kernel_tier_through_backend(sim_kernels, style, layout):
    b, calls, launched = sim_kernels
    for inverse in (False, True):
        args, ref_kw, inputs = make_args(layout=layout, style=style, inverse=inverse, dtype=torch.bfloat16,
                                         D=40, r=32, pos="int32")
        b.run(args)
        assert b.last_tier == "kernels", b.last_reasons
        assert launched[-1][0] is inverse
        check_outputs(args, ref_kw, inputs)
    assert not calls  # tier 2 never used


def test_kernel_tier_refusals_fall_through(sim_kernels, monkeypatch):
    b, calls, _ = sim_kernels
    args, ref_kw, inputs = make_args(q_noncontig=True)
    b.run(args)
    assert b.last_tier == "npu_rotary_mul"
    assert any("stride 1 on head_dim" in r for r in b.last_reasons["kernels"])
    check_outputs(args, ref_kw, inputs)
    monkeypatch.setenv("ROPE_OPS_ASCEND_UB_SIZE", "4096")  # one row of D=512 does not fit
    args, ref_kw, inputs = make_args(D=512)
    b.run(args)
    assert b.last_tier == "npu_rotary_mul"
    assert any("unified buffer" in r for r in b.last_reasons["kernels"])
    check_outputs(args, ref_kw, inputs)


def test_kernel_tier_uses_device_core_count(sim_kernels):
    b, _, launched = sim_kernels
    b.fake_device.cores = 7
    args, ref_kw, inputs = make_args(B=3, S=5)
    b.run(args)
    assert launched[-1][1]["blockDim"] == 7
    check_outputs(args, ref_kw, inputs)


# ------------------------------------------------------------------------------ autograd through rope_ops
from ascend.fakes import CpuRoutedAscendBackend as _CpuRoutedAscend  # noqa: E402


@pytest.mark.parametrize("tier", ["npu_rotary_mul", "torch"])
def test_autograd_through_rope_ops_apply(fake_npu, monkeypatch, tier):
    import rope_ops
    from rope_ops import registry
    from rope_ops_backends.torch_backend import TorchBackend

    monkeypatch.setenv("ROPE_OPS_ASCEND_TIERS", tier)
    b = _CpuRoutedAscend()
    q = torch.randn(2, 5, 4, 32, requires_grad=True)
    k = torch.randn(2, 5, 2, 32, requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    with registry.override({"ascend": b, "torch": TorchBackend()}):
        qo, ko = rope_ops.apply(q, k, pos, rotary_dim=24, style="gptj", backend="ascend")
        (qo.square().sum() + (ko * 3).sum()).backward()
    assert b.tier_counts[tier] == 2, b.tier_counts  # forward and backward
    inv = _inv(24)
    gq = rope_reference(2 * qo.detach(), pos, layout="bshd", rotary_dim=24, style="gptj", inv_freq=inv, inverse=True)
    gk = rope_reference(torch.full_like(ko, 3.0), pos, layout="bshd", rotary_dim=24, style="gptj", inv_freq=inv,
                        inverse=True)
    torch.testing.assert_close(q.grad.double(), gq, rtol=0, atol=1e-5)
    torch.testing.assert_close(k.grad.double(), gk, rtol=0, atol=1e-5)
    ref = rope_reference(q.detach(), pos, layout="bshd", rotary_dim=24, style="gptj", inv_freq=inv)
    torch.testing.assert_close(qo.detach().double(), ref, rtol=0, atol=1e-5)
