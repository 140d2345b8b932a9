"""AscendBackend against hostile calls and broken installs, through rope_ops.apply, on every tier.

The backend is routed to CPU tensors (ascend.fakes) with a fake torch_npu; the kernel tier runs
the shipped Ascend C kernels in the CPU emulation (tests/ascend/cpu_sim). Each test runs once per
tier (ROPE_OPS_ASCEND_TIERS restricted to it, plus torch where the tier cannot take a call) and
checks that the intended tier served it:

* positions up to 2^40 (on-the-fly rows) against angles reduced exactly;
* in place: inference tensors refused outside inference mode (input untouched) and rotated inside
  it; version counters moved (autograd sees the write); views of a tensor that requires grad
  (packed QKV in training) with the right gradients;
* q without heads and k with some (k alone is rotated);
* the prologue's float8 q (q_scale) and float8 cache on the torch tier (the kernels write neither),
  bit for bit as rope_ops.backend._float8_of of the float32 q;
* configuration errors and refusals are BackendError / reasons, raised before anything is
  written; availability() never raises or hangs, whatever `import torch_npu` does.
"""

from __future__ import annotations

import shutil
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest
import torch

import rope_ops
from rope_ops import BackendError, RopeError, registry
from rope_ops._reference import prologue_reference, rope_reference
from rope_ops.backend import KernelArgs, _float8_of
from rope_ops.frequencies import compute_inv_freq, cos_sin_table, freq_turns_of, reduced_angle
from rope_ops.testing.checks import assert_rope_close
from rope_ops_backends import ascend_backend as ab
from rope_ops_backends.torch_backend import TorchBackend

from _float8_support import float8_saturating, float8_test_values
from ascend import fakes

TIERS = {"kernels": "kernels,torch", "npu_rotary_mul": "npu_rotary_mul,torch", "torch": "torch"}
ENV_VARS = ("ROPE_OPS_ASCEND_TIERS", "ROPE_OPS_ASCEND_LIB", "ROPE_OPS_ASCEND_UB_SIZE",
            "ROPE_OPS_ASCEND_CORES", "ROPE_OPS_ASCEND_PROBE_TIMEOUT", "ROPE_OPS_BACKEND")


def _clean_env(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(ab, "library_candidates", lambda: [Path("/nonexistent/librope_ops_ascend.so")])


def _routed(monkeypatch, tiers: str, with_kernels: bool):
    _clean_env(monkeypatch)
    monkeypatch.setenv("ROPE_OPS_ASCEND_TIERS", tiers)
    fakes.install_fake_torch_npu(monkeypatch)
    backend = fakes.CpuRoutedAscendBackend()
    if with_kernels:
        if shutil.which("g++") is None and shutil.which("c++") is None:
            pytest.skip("no C++ compiler")
        fakes.use_sim_kernels(backend)
    return backend


@pytest.fixture(params=list(TIERS))
def tier(request, monkeypatch):
    """(tier name, backend) with rope_ops' registry holding only it and the torch fallback."""
    backend = _routed(monkeypatch, TIERS[request.param], request.param == "kernels")
    with registry.override({"ascend": backend, "torch": TorchBackend()}):
        yield request.param, backend


def _reference(x, pos, rope, layout="bshd", inverse=False):
    return rope_reference(x, pos, layout=layout, rotary_dim=rope.rotary_dim, style=rope.style,
                          inv_freq=rope.inv_freq, attention_factor=rope.attention_factor,
                          inverse=inverse)


# ------------------------------------------------------------------------------ huge positions
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_positions_up_to_2_pow_40(tier, style, dtype):
    name, backend = tier
    rope = rope_ops.RotaryEmbedding(64, rotary_dim=48, base=500000.0, max_position=2048, style=style,
                                    scaling={"rope_type": "yarn", "factor": 4.0})
    positions = torch.tensor([[2**40 - 1, -(2**40 - 1), 2**39 + 77, 5],
                              [123456789012, 2**31 + 3, -(2**35), 2047]])
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 3, 64, generator=gen).to(dtype)
    k = torch.randn(2, 4, 1, 64, generator=gen).to(dtype)
    q_out, k_out = rope(q, k, positions, backend="ascend")
    assert backend.tier_counts[name] == 1, (backend.tier_counts, backend.last_reasons)
    angles = torch.tensor([[reduced_angle(p, f) for f in rope.inv_freq.tolist()]
                           for p in positions.reshape(-1).tolist()], dtype=torch.float64)
    m = rope.attention_factor
    tables = (m * torch.cos(angles), m * torch.sin(angles))
    token = torch.arange(8).view(2, 4)
    for x, out in ((q, q_out), (k, k_out)):
        ref = rope_reference(x, token, layout="bshd", rotary_dim=48, style=style, cos_sin=tables)
        assert_rope_close(out, ref, x, rotary_dim=48, style=style, what=f"{name} tier")


# ------------------------------------------------------------------------------ in place
def test_inplace_on_inference_tensors(tier):
    name, backend = tier
    rope = rope_ops.RotaryEmbedding(32)
    pos = torch.tensor([0, 3, 70000, 9])
    with torch.inference_mode():
        q = torch.randn(2, 4, 3, 32)
        k = torch.randn(2, 4, 1, 32)
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(RopeError, match="inference"):
        rope(q, k, pos, inplace=True, backend="ascend")
    assert torch.equal(q, q0) and torch.equal(k, k0)
    assert sum(backend.tier_counts.values()) == 0
    with torch.inference_mode():
        q_out, k_out = rope(q, k, pos, inplace=True, backend="ascend")
    assert q_out is q and k_out is k and backend.tier_counts[name] == 1
    assert_rope_close(q, _reference(q0, pos, rope), q0, rotary_dim=32, style="neox", what="q")
    assert_rope_close(k, _reference(k0, pos, rope), k0, rotary_dim=32, style="neox", what="k")


def test_inplace_moves_version_counters(tier):
    name, backend = tier
    q = torch.randn(1, 5, 2, 16)
    k = torch.randn(1, 5, 2, 16)
    versions = q._version, k._version
    rope_ops.apply(q, k, 0, inplace=True, backend="ascend")
    assert backend.tier_counts[name] == 1
    assert q._version > versions[0] and k._version > versions[1]
    # A tensor saved for backward and then rotated in place: autograd must notice.
    leaf = torch.randn(1, 5, 2, 16, requires_grad=True)
    x = leaf * 1.0
    saved = x.sin()  # saves x
    rope_ops.apply(x, None, 0, inplace=True, backend="ascend")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_inplace_on_views_of_a_tensor_that_requires_grad(tier, layout):
    """Packed QKV in training: q and k are slices of one tensor that requires grad."""
    name, backend = tier
    rope = rope_ops.RotaryEmbedding(40, rotary_dim=24, style="gptj")
    hq, hk = 3, 2
    gen = torch.Generator().manual_seed(2)
    shape = (2, 6, hq + 2 * hk, 40) if layout == "bshd" else (12, hq + 2 * hk, 40)
    pos = torch.tensor([[0, 1, 2, 3, 90000, 5], [7, 8, 9, 10, 11, 12]])
    pos = pos if layout == "bshd" else pos.reshape(-1)
    leaf = torch.randn(shape, generator=gen, requires_grad=True)
    weight = torch.randn(shape, generator=gen)
    qkv = leaf * 1.0
    q, k = qkv[..., :hq, :], qkv[..., hq:hq + hk, :]
    q_out, k_out = rope(q, k, pos, layout=layout, inplace=True, backend="ascend")
    assert q_out is q and k_out is k
    forward_runs = backend.tier_counts[name]
    (qkv * weight).sum().backward()
    assert forward_runs >= 1 and backend.tier_counts[name] > forward_runs
    assert sum(backend.tier_counts.values()) == backend.tier_counts[name], backend.tier_counts
    expected = weight.double().clone()
    for heads in (slice(0, hq), slice(hq, hq + hk)):
        part = weight[..., heads, :]
        expected[..., heads, :] = _reference(part, pos, rope, layout=layout, inverse=True)
    assert_rope_close(leaf.grad, expected, weight, rotary_dim=24, style="gptj", what="d(qkv)")
    x0 = leaf.detach()
    assert_rope_close(qkv.detach()[..., :hq, :], _reference(x0[..., :hq, :], pos, rope, layout), x0[..., :hq, :],
                      rotary_dim=24, style="gptj", what="q in place")


# ------------------------------------------------------------------------------ shapes
@pytest.mark.parametrize("inplace", [False, True])
def test_q_without_heads(tier, inplace):
    name, backend = tier
    rope = rope_ops.RotaryEmbedding(64)
    q = torch.randn(2, 5, 0, 64)
    k = torch.randn(2, 5, 2, 64)
    k0 = k.clone()
    q_out, k_out = rope(q, k, 3, inplace=inplace, backend="ascend")
    assert q_out.shape == q.shape and backend.tier_counts[name] == 1
    assert_rope_close(k_out, _reference(k0, 3, rope), k0, rotary_dim=64, style="neox", what="k")


# ------------------------------------------------------------------------------ configuration errors
@pytest.mark.parametrize("var,value,text", [
    ("ROPE_OPS_ASCEND_TIERS", "kernel,torch", "unknown tiers ['kernel']"),
    ("ROPE_OPS_ASCEND_TIERS", ",", "unknown tiers"),
    ("ROPE_OPS_ASCEND_UB_SIZE", "192K", "ROPE_OPS_ASCEND_UB_SIZE='192K'"),
    ("ROPE_OPS_ASCEND_CORES", "-3", "ROPE_OPS_ASCEND_CORES='-3'"),
    ("ROPE_OPS_ASCEND_PROBE_TIMEOUT", "soon", "ROPE_OPS_ASCEND_PROBE_TIMEOUT='soon'"),
])
def test_bad_configuration_is_a_reason_and_a_backend_error(monkeypatch, var, value, text):
    backend = _routed(monkeypatch, "kernels,npu_rotary_mul,torch", with_kernels=False)
    monkeypatch.setenv(var, value)
    assert any(text in r for r in backend.availability()), backend.availability()
    q = torch.randn(1, 4, 2, 32)
    q0 = q.clone()
    with registry.override({"ascend": backend, "torch": TorchBackend()}):
        assert rope_ops.select_backend(q, None, 0) == "torch"  # auto: the next backend
        with pytest.raises(BackendError, match=var):
            rope_ops.apply(q, None, 0, inplace=True, backend="ascend")
    assert torch.equal(q, q0)
    # run() itself refuses before writing (the variable may change after selection)
    inv, _ = compute_inv_freq(32, 10000.0)
    cos, sin = cos_sin_table(inv, 1.0, 8)
    args = KernelArgs(q, None, q, None, None, 0, cos, sin, freq_turns_of(inv), 1.0, "bshd", 32,
                      False, False, True)
    with pytest.raises(BackendError, match=var):
        backend.run(args)
    assert torch.equal(q, q0)


def test_only_tiers_that_cannot_take_the_call_is_a_backend_error_before_writing(monkeypatch):
    backend = _routed(monkeypatch, "kernels", with_kernels=True)
    with registry.override({"ascend": backend, "torch": TorchBackend()}):
        # stride 2 on head_dim: known from metadata, refused at selection
        q = torch.randn(1, 4, 2, 32, 2)[..., 0]
        with pytest.raises(BackendError, match="stride 1 on head_dim"):
            rope_ops.apply(q, None, 0, backend="ascend")
        # a row too wide for the unified buffer: known per call, refused by run() before writing
        monkeypatch.setenv("ROPE_OPS_ASCEND_UB_SIZE", "4096")
        q = torch.randn(1, 4, 2, 512)
        q0 = q.clone()
        with pytest.raises(BackendError, match="unified buffer"):
            rope_ops.apply(q, None, 0, inplace=True, backend="ascend")
        assert torch.equal(q, q0)


# ------------------------------------------------------------------------------ availability never raises or hangs
def _torch_npu_package(tmp_path, monkeypatch, body: str):
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)


@pytest.mark.parametrize("body,text", [
    ("raise AttributeError(\"module 'torch' has no attribute '_npu_thing'\")", "AttributeError"),
    ("raise SystemExit(3)", "SystemExit"),
    ("assert False, 'CANN version mismatch'", "CANN version mismatch"),
    ("import torch\ntorch.npu = None\nraise TypeError('half initialised')", "TypeError"),
])
def test_import_raising_anything_is_a_reason(tmp_path, monkeypatch, body, text):
    _clean_env(monkeypatch)
    monkeypatch.setattr(torch, "npu", None, raising=False)
    _torch_npu_package(tmp_path, monkeypatch, body)
    backend = ab.AscendBackend()
    reasons = backend.availability()
    assert "failed to import" in reasons[0] and text in reasons[0], reasons
    assert backend.describe()["tiers"][2]["usable"] is False  # describe() does not raise either


def test_hanging_import_is_a_reason_after_the_probe_timeout(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    gate = types.ModuleType("_rope_ops_test_gate")
    gate.release = threading.Event()
    monkeypatch.setitem(sys.modules, "_rope_ops_test_gate", gate)
    _torch_npu_package(tmp_path, monkeypatch, "import _rope_ops_test_gate as g\n"
                                               "g.release.wait(60)\n"
                                               "raise ImportError('released by the test')\n")
    monkeypatch.setenv("ROPE_OPS_ASCEND_PROBE_TIMEOUT", "0.5")
    backend = ab.AscendBackend()
    try:
        start = time.monotonic()
        reasons = backend.availability()
        assert time.monotonic() - start < 10
        assert any("did not finish within 0.5 s" in r for r in reasons), reasons
        assert backend.availability() == reasons  # probed once: no second wait
    finally:
        gate.release.set()
        for thread in threading.enumerate():
            if thread.name == "rope_ops-ascend-probe":
                thread.join(10)
    assert "torch_npu" not in sys.modules


def test_import_that_needs_the_main_thread_is_retried_there(tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    fakes.install_fake_torch_npu(monkeypatch)  # torch.npu; the module itself comes from tmp_path
    monkeypatch.delitem(sys.modules, "torch_npu")
    _torch_npu_package(tmp_path, monkeypatch, textwrap.dedent("""
        import threading
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("signal only works in main thread of the main interpreter")
        def npu_rotary_mul(*args, **kwargs):
            raise AssertionError("not called here")
        """))
    try:
        backend = ab.AscendBackend()
        assert backend.availability() == []
        assert backend._probe().rotary_mul is sys.modules["torch_npu"].npu_rotary_mul
    finally:
        sys.modules.pop("torch_npu", None)


def test_broken_driver_and_unreadable_library_paths_are_reasons(monkeypatch):
    _clean_env(monkeypatch)
    device = fakes.install_fake_torch_npu(monkeypatch)

    def device_count():
        raise RuntimeError("drvGetDevNum failed")

    device.device_count = device_count

    class UnreadablePath(type(Path())):
        def is_file(self):
            raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(ab, "library_candidates", lambda: [UnreadablePath("/root/secret/librope_ops_ascend.so")])
    backend = ab.AscendBackend()
    reasons = backend.availability()
    assert any("torch.npu is not usable" in r and "drvGetDevNum" in r for r in reasons), reasons
    assert any("not built" in r for r in reasons), reasons


def test_supports_and_availability_report_exceptions_as_reasons(monkeypatch):
    """What the registry sees: reasons, never an exception, even from a half-broken process."""
    _clean_env(monkeypatch)
    backend = ab.AscendBackend()
    def broken_probe():
        raise MemoryError("probe")

    monkeypatch.setattr(backend, "_probe", broken_probe)
    assert backend.availability() == ["ascend backend: MemoryError: probe"]
    assert registry.reasons(backend, None) == ["ascend backend: MemoryError: probe"]


def test_kernels_take_every_angle_source_and_leave_the_rest_to_the_other_tiers(monkeypatch):
    """The kernels serve every angle source and table dtype (per-token cos/sin, fp16 tables,
    mRoPE); what they cannot take (a stride on head_dim) goes to the next tier with the reason, or
    is refused before writing when only the kernels are allowed."""
    backend = _routed(monkeypatch, "kernels,torch", with_kernels=True)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 5, 3, 32, generator=gen)
    angles = torch.rand(2, 5, 16, generator=gen, dtype=torch.float64) * 6
    token_tables = (angles.cos().float(), angles.sin().float())
    table = torch.rand(64, 16, generator=gen, dtype=torch.float64) * 6
    half_tables = (table.cos().half(), table.sin().half())
    pos = torch.randint(0, 64, (2, 5), generator=gen)
    rope = rope_ops.RotaryEmbedding(32, max_position=16)
    mrope_pos = torch.randint(0, 40, (3, 2, 5), generator=gen)
    with registry.override({"ascend": backend, "torch": TorchBackend()}):
        out, _ = rope_ops.apply(q, None, None, cos_sin=token_tables, backend="ascend")
        assert backend.last_tier == "kernels", backend.last_reasons
        ref = rope_reference(q, None, layout="bshd", rotary_dim=32, style="neox", token_cos_sin=token_tables)
        assert_rope_close(out, ref, q, rotary_dim=32, style="neox", what="per-token tables")
        out, _ = rope_ops.apply(q, None, pos, cos_sin=half_tables, backend="ascend")
        assert backend.last_tier == "kernels", backend.last_reasons
        ref = rope_reference(q, pos, layout="bshd", rotary_dim=32, style="neox", cos_sin=half_tables)
        assert_rope_close(out, ref, q, rotary_dim=32, style="neox", what="fp16 tables")
        out, _ = rope_ops.apply(q, None, mrope_pos, rope=rope, mrope_section=(4, 6, 6), backend="ascend")
        assert backend.last_tier == "kernels", backend.last_reasons
        ref = rope_reference(q, mrope_pos, layout="bshd", rotary_dim=32, style="neox", inv_freq=rope.inv_freq,
                             mrope_section=(4, 6, 6))
        assert_rope_close(out, ref, q, rotary_dim=32, style="neox", what="mRoPE")
        strided = torch.randn(2, 5, 3, 64, generator=gen)[..., ::2]
        out, _ = rope_ops.apply(strided, None, pos, cos_sin=half_tables, backend="ascend")
        assert backend.last_tier == "torch"
        assert any("stride 1 on head_dim" in r for r in backend.last_reasons["kernels"]), backend.last_reasons
        monkeypatch.setenv("ROPE_OPS_ASCEND_TIERS", "kernels")
        before = strided.clone()
        with pytest.raises(BackendError, match="stride 1 on head_dim"):
            rope_ops.apply(strided, None, pos, cos_sin=half_tables, inplace=True, backend="ascend")
        assert torch.equal(strided, before)


def test_prologue_tiers(monkeypatch):
    """The fused prologue: the kernels serve it with a cache in qkv's dtype; a float8 cache goes to
    the torch tier; with only the kernels (or npu_rotary_mul, which has no prologue) allowed it is
    refused before anything is written."""
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    backend = _routed(monkeypatch, "kernels,torch", with_kernels=True)
    gen = torch.Generator().manual_seed(6)
    hq, hk, d = 4, 2, 32
    qkv = torch.randn(7, (hq + 2 * hk) * d, generator=gen)
    pos = torch.randint(0, 40, (7,), generator=gen)
    slots = torch.randperm(20, generator=gen)[:7]
    kw = dict(num_q_heads=hq, num_kv_heads=hk, head_dim=d, q_norm=torch.ones(d), k_norm=torch.ones(d),
              backend="ascend")
    with registry.override({"ascend": backend, "torch": TorchBackend()}), torch.inference_mode():
        caches = (torch.zeros(20, hk, d), torch.zeros(20, hk, d))
        rope_ops.qkv_prologue(qkv, pos, kv_cache=caches, slots=slots, **kw)
        assert backend.last_tier == "kernels", backend.last_reasons
        fp8 = (torch.zeros(20, hk, d, dtype=torch.float8_e4m3fn), torch.zeros(20, hk, d, dtype=torch.float8_e4m3fn))
        rope_ops.qkv_prologue(qkv, pos, kv_cache=fp8, slots=slots, cache_scales=(1.0, 1.0), **kw)
        assert backend.last_tier == "torch"
        assert any("KV cache" in r for r in backend.last_reasons["kernels"]), backend.last_reasons
        for only in ("kernels", "npu_rotary_mul"):
            monkeypatch.setenv("ROPE_OPS_ASCEND_TIERS", only)
            before = qkv.clone(), fp8[0].view(torch.uint8).clone()
            with pytest.raises(BackendError):
                rope_ops.qkv_prologue(qkv, pos, kv_cache=fp8, slots=slots, cache_scales=(1.0, 1.0), inplace=True,
                                      **kw)
            assert torch.equal(qkv, before[0]) and torch.equal(fp8[0].view(torch.uint8), before[1])


def _fp8_prologue_inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    hq, hk, d = 4, 2, 32
    qkv = (torch.randn(9, (hq + 2 * hk) * d, generator=gen) * 3).to(dtype)
    pos = torch.randint(0, 40, (9,), generator=gen)
    w = (torch.randn(d, generator=gen) * 0.5 + 1.0, torch.randn(d, generator=gen) * 0.5 + 1.0)
    kw = dict(num_q_heads=hq, num_kv_heads=hk, head_dim=d, q_norm=w[0], k_norm=w[1], backend="ascend")
    rope = rope_ops.RotaryEmbedding(d, max_position=64)
    ref_kw = dict(num_q_heads=hq, num_kv_heads=hk, head_dim=d, q_weight=w[0], k_weight=w[1], eps=1e-6,
                  weight_offset=0.0, rotate=True, rotary_dim=d, style="neox", inv_freq=rope.inv_freq)
    return qkv, pos, kw, ref_kw, rope


def _fp8_caches(hk=2, d=32, slots=20):
    gen = torch.Generator().manual_seed(8)
    return tuple(torch.randn(slots, hk, d, generator=gen).to(torch.float8_e4m3fn) for _ in range(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("q_scale", [0.25, 0.004], ids=["in_range", "saturating"])
def test_prologue_float8_q(monkeypatch, dtype, q_scale):
    """q_scale: the torch tier writes q as float8 of q / q_scale (the kernels write q in qkv's
    dtype only, as they do the caches): within one e4m3 rounding of the float64 reference,
    saturating at +-448; bit for bit _float8_of of the float32 q (the torch tier's, and the
    kernels' where their float32 q equals it); k, v and a float8 cache as without q_scale."""
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    backend = _routed(monkeypatch, "kernels,torch", with_kernels=True)
    qkv, pos, kw, ref_kw, rope = _fp8_prologue_inputs(dtype)
    slots = torch.tensor([3, -1, 0, 19, 8, 7, 11, 5, 2])
    with registry.override({"ascend": backend, "torch": TorchBackend()}), torch.inference_mode():
        q_kernels, k_kernels, v_kernels = rope_ops.qkv_prologue(qkv, pos, rope=rope, **kw)
        assert backend.last_tier == "kernels", backend.last_reasons
        q8, k, v = rope_ops.qkv_prologue(qkv, pos, rope=rope, q_scale=q_scale, **kw)
        assert backend.last_tier == "torch"
        assert backend.last_reasons["kernels"] == [
            f"kernels: q output of dtype torch.float8_e4m3fn (the kernels write q in qkv's dtype {dtype})"]
        plain_caches, fp8_caches = _fp8_caches(), _fp8_caches()
        _, k_c, v_c = rope_ops.qkv_prologue(qkv, pos, rope=rope, kv_cache=plain_caches, slots=slots,
                                            cache_scales=(0.5, 2.0), **kw)
        q8c, k8c, v8c = rope_ops.qkv_prologue(qkv, pos, rope=rope, q_scale=q_scale, kv_cache=fp8_caches,
                                              slots=slots, cache_scales=(0.5, 2.0), **kw)
        assert backend.last_tier == "torch" and len(backend.last_reasons["kernels"]) == 2, backend.last_reasons
        monkeypatch.setenv("ROPE_OPS_ASCEND_TIERS", "torch")
        q_torch, k_torch, v_torch = rope_ops.qkv_prologue(qkv, pos, rope=rope, **kw)
        q32, _, _ = rope_ops.qkv_prologue(qkv.float(), pos, rope=rope, **kw)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == q_kernels.shape and q8.is_contiguous()
    # k and v: those of the same call without q_scale on the same (torch) tier; v exact on both
    for got, want, name in ((k, k_torch, "k"), (v, v_torch, "v"), (v, v_kernels, "v"), (k8c, k_c, "k, cache"),
                            (v8c, v_c, "v, cache")):
        assert torch.equal(got, want), name
    for got, want in zip(fp8_caches, plain_caches):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "float8 cache beside a float8 q"
    assert torch.equal(q8c.view(torch.uint8), q8.view(torch.uint8)), "float8 q with a cache write"
    # One rounding of the float32 math (in float32 for a bf16 qkv too) to e4m3
    if dtype == torch.float32:
        assert torch.equal(q_torch, q32)
    assert torch.equal(q8.view(torch.uint8), _float8_of(q32, q_scale).view(torch.uint8))
    if dtype == torch.float32:  # the kernels' float32 q where it equals torch's, bit for bit
        same = q_kernels == q32
        assert same.float().mean() > 0.5
        assert torch.equal(q8.view(torch.uint8)[same], _float8_of(q_kernels, q_scale).view(torch.uint8)[same])
    rq, _, _ = prologue_reference(qkv, pos, **ref_kw)
    got = q8.to(torch.float64)
    want = (rq / q_scale).clamp(-448.0, 448.0)
    bound = want.abs() * 2.0**-4 + 2.0**-9  # half an e4m3 ulp (3 mantissa bits), plus the float32 math
    assert ((got - want).abs() <= bound).all(), f"float8 q: worst {(got - want).abs().max():.3g}"
    assert not torch.isnan(got).any()
    assert (got.abs() == 448.0).any() == (q_scale < 0.01), "saturation at +-448 exactly when past it"


def test_prologue_float8_q_rounding_cases(monkeypatch):
    """e4m3's hard cases (ties, subnormals, the saturation threshold, infinities, NaN) in q, bit
    for bit as the float8 cache rounds them, for scales that keep the division exact."""
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    backend = _routed(monkeypatch, "kernels,torch", with_kernels=True)
    gen = torch.Generator().manual_seed(9)
    values = float8_test_values(gen).float().reshape(-1, 2, 64)
    qkv = torch.cat([values.flatten(1), torch.randn(values.shape[0], 2 * 64, generator=gen)], -1)
    with registry.override({"ascend": backend, "torch": TorchBackend()}), torch.inference_mode():
        for scale in (1.0, 2.0**-6, 2.0**9):
            q8, _, _ = rope_ops.qkv_prologue(qkv, None, num_q_heads=2, num_kv_heads=1, head_dim=64, rotate=False,
                                             q_scale=scale, backend="ascend")
            assert backend.last_tier == "torch", backend.last_reasons
            want = float8_saturating(values / scale)
            nan = torch.isnan(values)
            assert torch.equal(torch.isnan(q8.float()), nan), f"scale {scale}: NaN"
            assert torch.equal(q8.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan]), f"scale {scale}"


@pytest.mark.parametrize("only", ["kernels", "npu_rotary_mul"])
def test_prologue_float8_q_refused_without_the_torch_tier(monkeypatch, only):
    """Without the torch tier a float8 q is refused by metadata, saying what the tiers lack, and
    nothing (qkv, caches) is written."""
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    backend = _routed(monkeypatch, only, with_kernels=only == "kernels")
    qkv, pos, kw, _, rope = _fp8_prologue_inputs()
    call_caches = tuple(torch.zeros(20, 2, 32) for _ in range(2))
    slots = torch.arange(9)
    want = ("kernels: q output of dtype torch.float8_e4m3fn" if only == "kernels"
            else "npu_rotary_mul: no fused prologue")
    with registry.override({"ascend": backend, "torch": TorchBackend()}), torch.inference_mode():
        if only == "kernels":  # the same call without q_scale: the kernels take it
            rope_ops.qkv_prologue(qkv, pos, rope=rope, kv_cache=call_caches, slots=slots, **kw)
            assert backend.last_tier == "kernels", backend.last_reasons
        before = qkv.clone(), [c.clone() for c in call_caches]
        with pytest.raises(BackendError, match=want):
            rope_ops.qkv_prologue(qkv, pos, rope=rope, q_scale=0.5, kv_cache=call_caches, slots=slots, **kw)
    assert torch.equal(qkv, before[0]) and all(torch.equal(c, b) for c, b in zip(call_caches, before[1]))


def test_prologue_reasons_name_the_float8_q():
    """The kernel tier's per-call reasons: a float8 q_out is named as such (not as an unsupported
    qkv dtype), beside a float8 cache's own reason; the backward is unaffected."""
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    from rope_ops.backend import PrologueArgs
    from rope_ops_backends.ascend_backend import _kernel_call as kc

    qkv, pos, _, _, rope = _fp8_prologue_inputs(torch.bfloat16)
    cos, sin = cos_sin_table(rope.inv_freq, 1.0, 64)
    outs = [torch.empty(9, h, 32, dtype=dt) for h, dt in ((4, torch.float8_e4m3fn), (2, torch.bfloat16),
                                                         (2, torch.bfloat16))]
    args = PrologueArgs(qkv, *outs, pos, 0, cos, sin, freq_turns_of(rope.inv_freq), 1.0, "thd", 4, 2, 32, 32,
                        False, True, None, None, 1e-6, 0.0, False, None, None, None, 1.0, 1.0, q_scale=0.5)
    q_why = "kernels: q output of dtype torch.float8_e4m3fn (the kernels write q in qkv's dtype torch.bfloat16)"
    assert kc.prologue_reasons(kc.prologue_views(args), False, 196608, 4) == [q_why]
    caches = _fp8_caches()
    with_cache = args._replace(k_cache=caches[0], v_cache=caches[1], slots=torch.arange(9))
    assert kc.prologue_reasons(kc.prologue_views(with_cache), False, 196608, 4) == [
        q_why, "kernels: KV cache of dtype torch.float8_e4m3fn (the kernels write torch.bfloat16 caches)"]
    plain = args._replace(q_out=torch.empty(9, 4, 32, dtype=torch.bfloat16), q_scale=0.0)
    assert kc.prologue_reasons(kc.prologue_views(plain), False, 196608, 4) == []
    grads = [torch.randn(9, h, 32).bfloat16() for h in (4, 2, 2)]
    grad_views = kc.prologue_grad_views(plain, torch.empty_like(qkv), *grads)
    assert kc.prologue_reasons(grad_views, True, 196608, 4) == []
