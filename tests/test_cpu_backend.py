"""The cpu backend's own tests (the shared conformance suite runs separately:
``pytest --pyargs rope_ops.testing --rope-backend cpu``).

Every instruction-set kernel this machine can run (generic, AVX2, AVX-512, forced one at a time
through ``use_isa``) is checked against the float64 reference: dtypes, styles, layouts, head
sizes with and without vector remainders, strided views (the generic strided path too), in
place, inverse, positions inside and outside the table and up to 2^40, caller and per-token
tables, mRoPE; its bf16/fp16 rounding bit for bit against torch's; and the backend's behaviour
around the kernels: selection, threads, the build failing, the instruction-set override.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import rope_ops
import rope_ops_backends.cpu_backend as cpu_backend
from rope_ops._reference import rope_reference
from rope_ops.backend import KernelArgs
from rope_ops.frequencies import reduced_angle
from rope_ops.testing.checks import assert_bitwise_equal, assert_rope_close

from _cpu_support import backend, isa  # noqa: F401  (fixtures)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HEADS_AXIS = {"bshd": 2, "sbhd": 2, "bhsd": 1, "thd": 1}


def _shape(layout, batch, seq, heads, head_dim):
    return {"bshd": (batch, seq, heads, head_dim), "sbhd": (seq, batch, heads, head_dim),
            "bhsd": (batch, heads, seq, head_dim), "thd": (seq, heads, head_dim)}[layout]


def _qk(layout, batch, seq, q_heads, k_heads, head_dim, dtype, gen, view="dense"):
    """q and k in ``layout``: dense, packed into one QKV tensor, or with head_dim not of stride 1
    (the generic strided path)."""
    if view == "packed":
        axis = _HEADS_AXIS[layout]
        qkv = torch.randn(_shape(layout, batch, seq, q_heads + 2 * k_heads, head_dim), generator=gen).to(dtype)
        return qkv.narrow(axis, 0, q_heads), qkv.narrow(axis, q_heads, k_heads)
    if view == "strided_dim":  # stride 2 on head_dim
        q = torch.randn(_shape(layout, batch, seq, q_heads, 2 * head_dim), generator=gen).to(dtype)
        k = torch.randn(_shape(layout, batch, seq, k_heads, 2 * head_dim), generator=gen).to(dtype)
        return q[..., ::2], k[..., ::2]
    q = torch.randn(_shape(layout, batch, seq, q_heads, head_dim), generator=gen).to(dtype)
    k = torch.randn(_shape(layout, batch, seq, k_heads, head_dim), generator=gen).to(dtype)
    return q, k


# (layout, style, head_dim, rotary_dim, view, inplace, inverse, positions)
_CASES = [
    ("bshd", "neox", 128, 128, "dense", False, False, "table"),  # the compile-time r/2 = 64 path
    ("bshd", "gptj", 64, 64, "dense", False, True, "table"),  # r/2 = 32
    ("sbhd", "neox", 256, 256, "packed", True, False, "beyond"),  # r/2 = 128, rows on the fly
    ("bhsd", "gptj", 80, 80, "dense", False, False, "negative"),  # r/2 = 40: vector remainder
    ("thd", "neox", 96, 32, "packed", False, True, "table"),  # partial rotary
    ("thd", "gptj", 46, 46, "dense", True, False, "beyond"),  # r = 46: odd pairs count
    ("bshd", "neox", 2, 2, "dense", False, False, "offset"),  # one pair
    ("bhsd", "neox", 40, 24, "strided_dim", False, False, "beyond"),  # generic strided path
    ("sbhd", "gptj", 36, 36, "strided_dim", True, True, "table"),
    ("bshd", "gptj", 160, 96, "packed", False, False, "int32"),  # r/2 = 48, partial
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(len(_CASES)), ids=lambda i: "-".join(map(str, _CASES[i][:5])))
def test_isa_matches_reference(isa, case, dtype):
    layout, style, head_dim, rotary_dim, view, inplace, inverse, kind = _CASES[case]
    gen = torch.Generator().manual_seed(case)
    batch, seq = (1, 23) if layout == "thd" else (2, 11)
    q, k = _qk(layout, batch, seq, 5, 2, head_dim, dtype, gen, view)
    table = 64
    pos = {"table": torch.randint(0, table, (batch, seq), generator=gen),
           "beyond": torch.randint(0, 50_000, (batch, seq), generator=gen),
           "negative": torch.randint(-3000, 3000, (batch, seq), generator=gen),
           "int32": torch.randint(0, 5000, (seq,), generator=gen).int(),
           "offset": 40}[kind]
    if layout == "thd" and isinstance(pos, torch.Tensor):
        pos = pos.reshape(-1)[:seq]
    rope = rope_ops.RotaryEmbedding(head_dim, rotary_dim=rotary_dim, base=10000.0,
                                    max_position=table, style=style)
    q_in, k_in = q.clone(), k.clone()
    fn = rope_ops.apply_grad if inverse else rope_ops.apply
    q_out, k_out = fn(q, k, pos, rope=rope, layout=layout, inplace=inplace, backend="cpu")
    if inplace:
        assert q_out is q and k_out is k
    else:
        assert_bitwise_equal(q, q_in, "q (out of place)")
    for out, x, name in ((q_out, q_in, "q"), (k_out, k_in, "k")):
        ref = rope_reference(x, pos, layout=layout, rotary_dim=rotary_dim, style=style,
                             inv_freq=rope.inv_freq, attention_factor=rope.attention_factor,
                             inverse=inverse)
        assert_rope_close(out, ref, x, rotary_dim=rotary_dim, style=style, what=f"{isa} {name}")


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_x86_kernels_agree_bit_for_bit(backend, style, dtype):
    """AVX2, AVX-512 and AVX512_BF16 fuse the same multiply-adds and round the same way: results
    do not depend on which of them a CPU runs."""
    have = cpu_backend.available_isas()
    if "avx512" not in have:
        pytest.skip(f"needs AVX2 and AVX-512 (this CPU has {have})")
    gen = torch.Generator().manual_seed(7)
    q, k = _qk("bshd", 2, 9, 3, 1, 104, dtype, gen)  # r/2 = 52: vectors and remainders
    pos = torch.randint(-100, 100_000, (2, 9), generator=gen)
    rope = rope_ops.RotaryEmbedding(104, max_position=1000, style=style)
    outputs = {}
    for name in have[1:]:
        with cpu_backend.use_isa(name):
            outputs[name] = rope_ops.apply(q, k, pos, rope=rope, backend="cpu")
    for name in have[2:]:
        for a, b, what in zip(outputs["avx2"], outputs[name], ("q", "k")):
            assert_bitwise_equal(a, b, f"{what}: avx2 vs {name}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_rounding_is_exact(isa, dtype):
    """With cos = m and sin = 0 each output is the float32 product x*m rounded once to the
    dtype: bit for bit torch's own rounding, subnormals, overflow to inf and NaN included."""
    gen = torch.Generator().manual_seed(11)
    bits = torch.randint(0, 1 << 16, (4096,), generator=gen, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype)
    x = x[torch.isfinite(x.float())]  # finite inputs: a NaN or inf partner times sin 0 is NaN
    n = (x.numel() // 64) * 64
    q = x[:n].reshape(1, n // 64, 1, 64)
    seq = q.shape[1]
    # scales spread over [2^-20, 4) (underflow to subnormal, overflow in fp16), and scales of
    # few significant bits, whose exact products often fall halfway between two outputs (ties)
    scale = torch.exp2(torch.rand(seq, 32, generator=gen, dtype=torch.float64) * 22 - 20).float()
    short = torch.tensor([1 + 2**-8, 1 + 2**-11, 1 + 3 * 2**-12, 1.5, 0.75 + 2**-9, 1 + 2**-9,
                          1.25 * 2**-10, 1 + 2**-12])
    ties = torch.randint(0, short.numel(), (seq // 2, 32), generator=gen)
    scale[: seq // 2] = short[ties]
    scale[0] = 1.0
    cos, sin = scale, torch.zeros_like(scale)
    q_out, _ = rope_ops.apply(q, None, None, cos_sin=(cos, sin), backend="cpu")
    expected = (q.float() * torch.cat([scale, scale], dim=-1).reshape(1, seq, 1, 64)).to(dtype)
    assert_bitwise_equal(q_out, expected, f"{isa}: rounding of x*m to {dtype}")
    nan_q = torch.full((1, 1, 1, 64), float("nan"), dtype=dtype)
    nan_out, _ = rope_ops.apply(nan_q, None, None, cos_sin=(cos[:1], sin[:1]), backend="cpu")
    assert torch.isnan(nan_out).all(), f"{isa}: NaN in, NaN out"


def test_rows_on_the_fly_are_exact_to_2p40(isa):
    """Positions beyond a 16-row table, up to 2^40 and negative, against the exact reduced
    angle (a float64 product p * inv_freq is itself off by ~1e-4 rad at 2^40)."""
    gen = torch.Generator().manual_seed(5)
    rope = rope_ops.RotaryEmbedding(64, base=10000.0, max_position=16)
    low = torch.randint(-(1 << 20), 1 << 20, (20,), generator=gen)
    high = torch.randint(1 << 39, 1 << 40, (20,), generator=gen) * torch.tensor([1, -1]).repeat(10)
    pos = torch.cat([low, high, torch.tensor([15, 16, -1, (1 << 40) - 1])])
    q = torch.randn(pos.numel(), 3, 64, generator=gen)
    q_out, _ = rope_ops.apply(q, None, pos, rope=rope, layout="thd", backend="cpu")
    inv_freq = rope.inv_freq.tolist()
    angles = torch.tensor([[reduced_angle(int(p), f) for f in inv_freq] for p in pos.tolist()],
                          dtype=torch.float64)
    m = rope.attention_factor
    token_tables = ((m * angles.cos()).unsqueeze(0), (m * angles.sin()).unsqueeze(0))
    ref = rope_reference(q, None, layout="thd", rotary_dim=64, style="neox",
                         token_cos_sin=token_tables)
    assert_rope_close(q_out, ref, q, rotary_dim=64, style="neox", what=f"{isa} positions to 2^40")


def test_any_int64_position_is_a_rotation(isa):
    """Beyond 2^40 nothing is promised but a rotation: finite outputs, every pair's norm kept."""
    rope = rope_ops.RotaryEmbedding(32, max_position=8)
    pos = torch.tensor([2**63 - 1, -(2**63), 2**62 + 12345, -(2**50) - 7])
    q = torch.randn(4, 2, 32, dtype=torch.float32)
    q_out, _ = rope_ops.apply(q, None, pos, rope=rope, layout="thd", backend="cpu")
    assert torch.isfinite(q_out).all()
    norms_in = q[..., :16] ** 2 + q[..., 16:] ** 2
    norms_out = q_out[..., :16] ** 2 + q_out[..., 16:] ** 2
    torch.testing.assert_close(norms_out, norms_in, rtol=1e-5, atol=1e-6)


def test_caller_table_rows_outside_are_nan(isa):
    """Positions outside caller tables (no frequencies to compute them from) give NaN rows, only
    for those tokens, and no read outside the table: the kernel's own path (rope_ops.apply
    refuses such positions on the CPU before any kernel runs)."""
    gen = torch.Generator().manual_seed(3)
    cos, sin = torch.rand(10, 16, generator=gen), torch.rand(10, 16, generator=gen)
    q = torch.randn(1, 6, 2, 32, generator=gen).to(torch.bfloat16)
    pos = torch.tensor([[0, 9, 10, -1, 5, 1 << 40]])
    args = KernelArgs(q, None, None, None, pos, 0, cos, sin, None, 1.0, "bshd", 32, False, False, False)
    q_out, k_out = cpu_backend.CpuBackend().run(args)
    assert k_out is None
    outside = torch.tensor([False, False, True, True, False, True])
    assert torch.isnan(q_out[0, outside]).all()
    assert not torch.isnan(q_out[0, ~outside]).any()
    inside_pos = pos.clamp(0, 9)
    ref = rope_reference(q, inside_pos, layout="bshd", rotary_dim=32, style="neox", cos_sin=(cos, sin))
    assert_rope_close(q_out[:, ~outside], ref[:, ~outside], q[:, ~outside], rotary_dim=32, style="neox")


@pytest.mark.parametrize("table_dtype", DTYPES, ids=str)
def test_table_forms_and_per_token_rows(isa, table_dtype):
    """Tables in float16/bfloat16, one [P, r] cos|sin cache (strided rows), and per-token rows
    broadcast over the batch (stride 0)."""
    gen = torch.Generator().manual_seed(9)
    angles = torch.rand(40, 24, generator=gen, dtype=torch.float64) * 6.3
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1).to(table_dtype)  # [P, r]
    q, k = _qk("bshd", 2, 7, 3, 1, 56, torch.bfloat16, gen)
    pos = torch.randint(0, 40, (2, 7), generator=gen)
    q_out, k_out = rope_ops.apply(q, k, pos, cos_sin=cache, style="gptj", backend="cpu")
    tables = (cache[:, :24], cache[:, 24:])
    for out, x in ((q_out, q), (k_out, k)):
        ref = rope_reference(x, pos, layout="bshd", rotary_dim=48, style="gptj", cos_sin=tables)
        assert_rope_close(out, ref, x, rotary_dim=48, style="gptj", what=f"{isa} cache {table_dtype}")
    token = (angles[:7].cos().to(table_dtype), angles[:7].sin().to(table_dtype))  # [S, r/2]
    q_out, _ = rope_ops.apply(q, None, None, cos_sin=token, backend="cpu")
    ref = rope_reference(q, None, layout="bshd", rotary_dim=48, style="neox", token_cos_sin=token)
    assert_rope_close(q_out, ref, q, rotary_dim=48, style="neox", what=f"{isa} per token")


@pytest.mark.parametrize("interleaved", [False, True], ids=["chunked", "interleaved"])
def test_mrope(isa, interleaved):
    """Three positions a token, frequencies split among them; some positions beyond the table."""
    gen = torch.Generator().manual_seed(13)
    section = (8, 12, 12)
    rope = rope_ops.RotaryEmbedding(64, base=10000.0, max_position=100)
    q, k = _qk("thd", 1, 15, 4, 2, 64, torch.float32, gen)
    pos = torch.randint(0, 300, (3, 15), generator=gen)
    q_out, k_out = rope_ops.apply(q, k, pos, rope=rope, mrope_section=section,
                                  mrope_interleaved=interleaved, backend="cpu")
    for out, x in ((q_out, q), (k_out, k)):
        ref = rope_reference(x, pos, layout="thd", rotary_dim=64, style="neox", inv_freq=rope.inv_freq,
                             mrope_section=section, mrope_interleaved=interleaved)
        assert_rope_close(out, ref, x, rotary_dim=64, style="neox", what=f"{isa} mrope")


def test_threads_split_tokens_exactly(backend):
    """Threads take token ranges that cut through sequences; the result is the same bits as one
    thread's and matches the reference."""
    gen = torch.Generator().manual_seed(17)
    q, k = _qk("bshd", 3, 61, 4, 2, 64, torch.bfloat16, gen)  # 183 tokens: over one thread's grain
    pos = torch.randint(0, 5000, (3, 61), generator=gen)
    rope = rope_ops.RotaryEmbedding(64, max_position=4096)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = rope_ops.apply(q, k, pos, rope=rope, backend="cpu")
        torch.set_num_threads(max(2, threads))
        multi = rope_ops.apply(q, k, pos, rope=rope, backend="cpu")
    finally:
        torch.set_num_threads(threads)
    for a, b, x in zip(single, multi, (q, k)):
        assert_bitwise_equal(a, b, "one thread vs several")
        ref = rope_reference(x, pos, layout="bshd", rotary_dim=64, style="neox", inv_freq=rope.inv_freq)
        assert_rope_close(b, ref, x, rotary_dim=64, style="neox")


def test_selected_automatically_for_cpu_tensors(backend, monkeypatch):
    monkeypatch.delenv("ROPE_OPS_BACKEND", raising=False)
    q = torch.randn(1, 3, 2, 64)
    for dtype in DTYPES:
        assert rope_ops.select_backend(q.to(dtype), q.to(dtype), 0) == "cpu"
    assert rope_ops.select_backend(q.double(), None, 0) == "torch"  # float64 stays on torch


def test_refuses_what_it_cannot_take(backend):
    base = rope_ops.backend.RopeCall("cpu", torch.bfloat16, "bshd", "neox", 128, 128, 4, 2, False,
                                     torch.int64, False, False, True)
    assert backend.supports(base) == []
    for change, word in (({"device_type": "cuda"}, "device"), ({"dtype": torch.float64}, "dtype"),
                         ({"head_dim": 16384, "rotary_dim": 16384}, "rotary_dim")):
        reasons = backend.supports(base._replace(**change))
        assert reasons and any(word in r for r in reasons), (change, reasons)


def test_use_isa_refuses_unknown_names(backend):
    before = cpu_backend.isa()
    with pytest.raises(RuntimeError, match="not available"):
        with cpu_backend.use_isa("sse9"):
            pass
    assert cpu_backend.isa() == before
    assert cpu_backend.available_isas()[0] == "generic"


def test_build_failure_leaves_the_backend_unavailable(monkeypatch):
    """A failing build is a reason, never an exception, and automatic selection falls back."""
    import rope_ops_backends._build as build_module

    def failing_build(*args, **kwargs):
        raise build_module.BuildError("the compiler said no")

    monkeypatch.setattr(cpu_backend, "_state", {"module": None, "reasons": None})
    monkeypatch.setattr(build_module, "build_extension", failing_build)
    monkeypatch.setattr(cpu_backend, "toolchain_reasons", lambda: [])
    reasons = cpu_backend.CpuBackend().availability()
    assert reasons and "the compiler said no" in reasons[0]


_SUBPROCESS = """
import os, torch, rope_ops
import rope_ops_backends.cpu_backend as cpu_backend
reasons = cpu_backend.CpuBackend().availability()
q = torch.randn(1, 2, 2, 32)
print("REASONS", reasons)
print("SELECTED", rope_ops.select_backend(q, None, 0))
if not reasons:
    print("ISA", cpu_backend.isa())
"""


def _run_subprocess(env_changes: dict, tmp_path) -> str:
    env = {**os.environ, **env_changes}
    env.pop("ROPE_OPS_BACKEND", None)
    result = subprocess.run([sys.executable, "-c", _SUBPROCESS], env=env, capture_output=True,
                            text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_without_a_compiler_torch_serves(tmp_path):
    """No compiler and nothing cached: unavailable with the reason, and CPU calls go to torch."""
    out = _run_subprocess({"CXX": str(tmp_path / "no-such-compiler"),
                           "ROPE_OPS_CACHE": str(tmp_path / "empty-cache")}, tmp_path)
    assert "no C++ compiler" in out and "SELECTED torch" in out, out


def test_isa_variable_forces_an_instruction_set(backend, tmp_path):
    out = _run_subprocess({"ROPE_OPS_CPU_ISA": "generic"}, tmp_path)
    assert "ISA generic" in out and "SELECTED cpu" in out, out
    out = _run_subprocess({"ROPE_OPS_CPU_ISA": "sse9"}, tmp_path)
    assert "ROPE_OPS_CPU_ISA" in out and "SELECTED torch" in out, out


def test_repeats_take_the_bound_launcher(backend):
    """rope_ops.apply's repeats run through the backend's C++ BoundRope and its guard; the guard
    lets through only calls of the metadata it was made for."""
    rope = rope_ops.RotaryEmbedding(64, max_position=128)
    bound = backend.bind(*rope.tables(torch.device("cpu")), "bshd", 64, False, False)
    assert type(bound).__name__ == "BoundRope"
    q, k = torch.randn(4, 1, 8, 64).bfloat16(), torch.randn(4, 1, 2, 64).bfloat16()
    pos = torch.randint(0, 128, (4, 1))
    guard = bound.guarded(q, k, pos)
    q_out, k_out = guard(q, k, pos)
    for out, x in ((q_out, q), (k_out, k)):
        ref = rope_reference(x, pos, layout="bshd", rotary_dim=64, style="neox", inv_freq=rope.inv_freq)
        assert_rope_close(out, ref, x, rotary_dim=64, style="neox")
    assert guard(q.float(), k.float(), pos) is None
    assert guard(q, None, pos) is None
    assert guard(q, k, 3) is None
    assert guard(q.requires_grad_(), k, pos) is None
