"""The CUDA backend on the CPU, no GPU needed: its extension module (csrc/rope_torch.h: KernelArgs
to RopeParams, outputs, the kernel choice and candidates, BoundRope, its guard and its autograd)
built for CPU tensors over the host emulation of the kernels (tests/csrc/), whose per-thread code
is the kernels' own. Checked against the float64 reference: tools/gpu_cuda_check.py's cases with
every kernel configuration that can take each call, and the choice on the performance workloads.

What it cannot see: device-only behaviour (__ldg, real concurrency, the device's sincospif and
conversion rounding, alignment faults, programmatic dependent launch), the CUDA allocator and
streams, the build through backends/_build.py.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from _cuda_tools import emulation_c_api, ext, kernels_run, load_tool  # noqa: F401  (ext: fixture)

from rope_ops._reference import rope_reference
from rope_ops.backend import KernelArgs
from rope_ops.frequencies import compute_inv_freq, cos_sin_table, freq_turns_of
from rope_ops.testing.checks import assert_rope_close

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(scope="module")
def c_api(ext):
    return emulation_c_api()


@pytest.fixture(scope="module")
def check_tool():
    return load_tool("gpu_cuda_check")


@pytest.fixture(autouse=True)
def one_thread():
    """The cases' reference checks are many small float64 ops: on a shared 2-core machine, torch's
    own threads make them ~30x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def every_kernel() -> set[str]:
    """Every kernel instantiation csrc/dispatch.h can launch, as the emulation names them."""
    names = set()
    for dtype in ("float32", "float16", "bfloat16"):
        for style in ("neox", "gptj"):
            t = f"{dtype},{style}"
            names |= {f"{h}<{t},{s}>" for h in ("heads", "heads8") for s in ("rounds1", "pipe2", "rounds4")}
            names |= {f"flat<{t},{u},separate>" for u in (1, 2, 4, 8)}
            names |= {f"flat<{t},{u},joint>" for u in (2, 4, 6, 8)}
            names |= {f"flat<{t},{u},split>" for u in (1, 2, 4)}
            names |= {f"rows<{t}>", f"generic<{t}>"}
            # the other angle sources: the heads family with 16-byte vectors, the generic kernel
            for source in ("token", "mrope"):
                names |= {f"heads<{t},{s},{source}>" for s in ("rounds1", "pipe2", "rounds4")}
                names.add(f"generic<{t},{source}>")
        names |= {f"lean<{dtype},neox,{u}>" for u in (1, 2, 4, 8)}
    return names


def test_every_candidate_of_every_case_matches_the_reference(ext, check_tool):
    """tools/gpu_cuda_check.py's accuracy cases, each with the policy's choice and with every
    candidate configuration (run_with): within the reference's bound, bit for bit the choice's
    outputs (rows from the table), nothing written outside."""
    rn = check_tool.Runner(ext, "cpu")
    check_tool.accuracy(rn)
    assert not rn.failures, "\n".join(rn.failures[:20])
    assert rn.count > 350
    assert {"rows", "flat/split/v1", "lean", "heads/pipe2/u2/t128", "heads8/rounds4/u3/t256",
            "flat/joint+fly", "generic+nopdl"} <= set(rn.labels_run), rn.labels_run


def test_per_token_and_mrope_cases_match_the_reference(ext, check_tool):
    """tools/gpu_cuda_check.py's per-token cos/sin and mRoPE cases, each with the policy's choice
    and every candidate (the heads family and the generic kernel only)."""
    rn = check_tool.Runner(ext, "cpu")
    check_tool.angle_source_accuracy(rn)
    assert not rn.failures, "\n".join(rn.failures[:20])
    assert rn.count > 200
    families = {label.split("/")[0].split("+")[0] for label in rn.labels_run}
    assert families == {"heads", "generic"}, rn.labels_run
    assert {"heads/pipe2/u2/t128", "heads/rounds4/u3/t256", "heads/u1/t256+fly", "generic"} <= set(rn.labels_run)


def test_coverage_pass_reaches_every_kernel(ext, c_api, check_tool):
    """gpu_cuda_check.py --coverage (what the GPU run puts under compute-sanitizer): its calls'
    candidates run every kernel instantiation the dispatcher has, and match the reference."""
    c_api.rope_emulated_reset()
    rn = check_tool.Runner(ext, "cpu")
    check_tool.coverage(rn)
    assert not rn.failures, "\n".join(rn.failures[:20])
    ran = kernels_run(c_api)
    assert every_kernel() <= ran, sorted(every_kernel() - ran)
    assert ran <= every_kernel(), sorted(ran - every_kernel())


def test_surroundings_on_host(ext, check_tool):
    """Allocated outputs, BoundRope and its guard, the C++ autograd of with_grad (gradients, an
    unused output, create_graph, positions changed before the backward), extreme positions and
    empty calls: gpu_cuda_check's checks of them, on the CPU."""
    rn = check_tool.Runner(ext, "cpu")
    for check in (check_tool.alloc_outputs, check_tool.autograd_in_cpp,
                  check_tool.garbage_positions, check_tool.zero_tokens):
        check(rn)
    assert rn.count == 4
    assert not rn.failures, "\n".join(rn.failures[:20])


def _choice(ext, *, layout="thd", tokens, hq, hk, head_dim=128, rotary_dim=None, dtype=torch.bfloat16,
            style="neox", inplace=False, batch=1, pos="arange"):
    """The policy's choice for a call of this shape (an H200's properties: tests/csrc). The
    tensors are allocated, never touched."""
    r = rotary_dim or head_dim
    seq = tokens // batch
    shape = {"thd": lambda h: (tokens, h, head_dim), "bshd": lambda h: (batch, seq, h, head_dim)}[layout]
    q = torch.empty(shape(hq), dtype=dtype)
    k = torch.empty(shape(hk), dtype=dtype) if hk else None
    positions = torch.arange(tokens) if layout == "thd" else torch.arange(seq).expand(batch, seq).contiguous()
    if pos == "random":
        positions = torch.randint(0, 32768, positions.shape)
    table = torch.empty(131072, r // 2)
    args = KernelArgs(q, k, q if inplace else torch.empty_like(q),
                      k if inplace else (torch.empty_like(k) if k is not None else None), positions, 0,
                      table, table, torch.zeros(r // 2, dtype=torch.int64), 1.0, layout, r,
                      style == "gptj", False, inplace)
    return ext.candidates(args)[0]


def test_policy_on_the_performance_workloads(ext):
    """The choices measured best on the H200 for PERF.md's W1-W5 (csrc/NOTES.md)."""
    assert _choice(ext, layout="bshd", batch=4, tokens=16384, hq=32, hk=8) == "heads/pipe2/u4/t256"  # W1
    assert _choice(ext, tokens=256, hq=32, hk=8, pos="random") == "flat/joint"  # W2
    w3 = dict(layout="bshd", batch=2, tokens=8192, hq=16, hk=16, head_dim=256, rotary_dim=64, style="gptj")
    assert _choice(ext, **w3, inplace=True) == "heads/pipe2/u4/t128"
    assert _choice(ext, **w3) == "heads/rounds4/u8/t128"
    assert _choice(ext, layout="bshd", batch=2, tokens=8192, hq=32, hk=32) == "lean"  # W4
    assert _choice(ext, layout="bshd", batch=8, tokens=32768, hq=64, hk=8) == "lean"  # W5


def test_policy_rules_on_other_shapes(ext):
    """The rules of csrc/policy.h by class of shape, not by workload."""
    # a few tokens: the decode blocks split so that every SM gets work
    assert _choice(ext, tokens=8, hq=32, hk=8, pos="random") == "flat/split/v1"
    assert _choice(ext, tokens=64, hq=32, hk=8, pos="random") == "flat/split/v2"
    # decode-sized GPT-J and in place take the flat kernel too; what flat cannot take, heads
    assert _choice(ext, tokens=256, hq=32, hk=8, style="gptj") == "flat/joint"
    assert _choice(ext, tokens=256, hq=32, hk=8, inplace=True) == "flat/joint"
    assert _choice(ext, tokens=64, hq=32, hk=8, head_dim=80, rotary_dim=32).startswith("heads/")
    # in place with pass-through dims: rows of at least 128 rotary bytes take the rows kernel
    neox_w3 = dict(layout="bshd", batch=2, tokens=8192, hq=16, hk=16, head_dim=256, inplace=True)
    assert _choice(ext, **neox_w3, rotary_dim=64) == "rows"
    assert _choice(ext, **neox_w3, rotary_dim=32).startswith("heads/")
    assert _choice(ext, layout="bshd", batch=2, tokens=8192, hq=32, hk=32, head_dim=80, rotary_dim=32,
                   inplace=True).startswith("heads/pipe2/")
    # flat blocks of 8 KB or more on average: W1's heads in float32 do, in bfloat16 they do not
    assert _choice(ext, tokens=16384, hq=32, hk=8, dtype=torch.float32) == "lean"
    assert _choice(ext, tokens=16384, hq=8, hk=1, head_dim=256).startswith("heads/pipe2/")  # MQA
    # rotary halves of 24 bytes (GPT-NeoX-20B: head_dim 96, rotary 24): 8-byte vectors
    assert _choice(ext, tokens=4096, hq=64, hk=64, head_dim=96, rotary_dim=24).startswith("heads8/pipe2/")
    assert _choice(ext, tokens=4096, hq=64, hk=64, head_dim=96, rotary_dim=22) == "generic"
    # many heads per token: up to six heads per thread where flat cannot take the call
    assert _choice(ext, tokens=16384, hq=64, hk=8, head_dim=96) == "heads/pipe2/u6/t128"
    # GPT-J out of place: rounds of four heads, plain loads
    assert _choice(ext, tokens=16384, hq=32, hk=8, style="gptj").startswith("heads/rounds4/")


def test_labels_that_cannot_take_the_call_are_refused(ext):
    """run_with refuses, before writing anything, a label it does not know and a configuration
    that cannot take the call; every candidate label names itself back."""
    inv = compute_inv_freq(64, 10000.0)[0]
    cos, sin = cos_sin_table(inv, 1.0, 32)
    q = torch.randn(1, 5, 2, 64)
    out = torch.full_like(q, 3.0)
    args = KernelArgs(q, None, out, None, None, 0, cos, sin, None, 1.0, "bshd", 64, True, False, False)
    for label, why in (("bogus", "unknown"), ("heads/pipe2/u17/t128", "cannot take"),
                       ("lean", "cannot take"), ("flat/joint", "cannot take"), ("rows", "cannot take"),
                       ("heads/u1/t128+fly", "cannot take"), ("flat/split/v3", "cannot take"),
                       ("heads/u1/t48", "cannot take"), ("generic+bad", "unknown")):
        with pytest.raises(RuntimeError, match=why):
            ext.run_with(args, label)
        assert bool((out == 3.0).all()), label
    labels = ext.candidates(args)
    assert labels[0] == "flat/split/v1" and "generic" not in labels
    with pytest.raises(RuntimeError, match="outputs"):
        ext.run_with(args._replace(q_out=None), labels[0])


def test_rows_kernel_writes_only_the_rotary_dims(ext):
    """The rows kernel in place on every dtype and style, GQA (5 q heads, 2 k heads), positions
    past the table (rows from freq_turns), on views whose rows are evenly spaced (head stride
    D + 16) and on q and k as head slices of one packed tensor (they are not): the rotary dims
    match the reference, the pass-through dims, the gaps and the rest of the packed tensor keep
    their bits."""
    R, D = 32, 96
    inv = 10000.0 ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    cos, sin = cos_sin_table(inv, 1.0, 64)
    turns = freq_turns_of(inv)
    gen = torch.Generator().manual_seed(12)
    pos = torch.randint(0, 200, (3, 37), generator=gen)  # most beyond the 64-row table
    for dtype in DTYPES:
        for style in ("neox", "gptj"):
            for packed in (False, True):
                if packed:  # [3, 37, 5 q + 2 k + 2 v heads, D]
                    base = [torch.randn(3, 37, 9, D, generator=gen).to(dtype)]
                    q, k = base[0][:, :, :5], base[0][:, :, 5:7]
                else:
                    base = [torch.randn(3, 37, h, D + 16, generator=gen).to(dtype) for h in (5, 2)]
                    q, k = base[0][..., :D], base[1][..., :D]
                before = [x.clone() for x in base]
                qb, kb = q.clone(), k.clone()
                args = KernelArgs(q, k, q, k, pos, 0, cos, sin, turns, 1.0, "bshd", R,
                                  style == "gptj", False, True)
                assert "rows" in ext.candidates(args)
                ext.run_with(args, "rows")
                for got, x in ((q, qb), (k, kb)):
                    ref = rope_reference(x, pos, layout="bshd", rotary_dim=R, style=style, inv_freq=inv)
                    assert_rope_close(got, ref, x, rotary_dim=R, style=style)
                for x, y in zip(base, before):
                    assert torch.equal(x[..., R:], y[..., R:])
                if packed:
                    assert torch.equal(base[0][:, :, 7:], before[0][:, :, 7:])


def test_fast_div_is_exact(c_api):
    """The rows kernel's divisions (multiply-high and shift, constants from the host) equal
    integer division for every numerator below 2^31: small and large divisors (head counts,
    sequence lengths), numerators at the divisor's multiples and at the 2^31 edge."""
    gen = torch.Generator().manual_seed(13)
    top = 2**31 - 1
    divisors = list(range(1, 300)) + [2**k + e for k in range(9, 31) for e in (-1, 0, 1)] + \
        torch.randint(1, top, (200,), generator=gen).tolist() + [top]
    for d in divisors:
        edges = {0, 1, d - 1, d, d + 1, 2 * d - 1, 2 * d, top, top - 1, top - top % d, top - top % d - 1}
        numerators = [n for n in edges if 0 <= n <= top] + torch.randint(0, top, (20,), generator=gen).tolist()
        for n in numerators:
            assert c_api.rope_fast_div(d, n) == n // d, (d, n)


class RopeParams(ctypes.Structure):  # mirrors csrc/rope.h
    _fields_ = [
        ("q", ctypes.c_void_p), ("q_out", ctypes.c_void_p),
        ("q_stride", ctypes.c_int64 * 4), ("q_out_stride", ctypes.c_int64 * 4),
        ("k", ctypes.c_void_p), ("k_out", ctypes.c_void_p),
        ("k_stride", ctypes.c_int64 * 4), ("k_out_stride", ctypes.c_int64 * 4),
        ("B", ctypes.c_int64), ("S", ctypes.c_int64), ("Hq", ctypes.c_int64),
        ("Hk", ctypes.c_int64), ("D", ctypes.c_int64), ("R", ctypes.c_int64),
        ("dtype", ctypes.c_int), ("interleaved", ctypes.c_int), ("inverse", ctypes.c_int),
        ("copy_passthrough", ctypes.c_int),
        ("pos", ctypes.c_void_p), ("pos_kind", ctypes.c_int),
        ("pos_stride_b", ctypes.c_int64), ("pos_stride_s", ctypes.c_int64),
        ("pos_offset", ctypes.c_int64),
        ("cos_table", ctypes.c_void_p), ("sin_table", ctypes.c_void_p),
        ("table_rows", ctypes.c_int64), ("table_row_stride", ctypes.c_int64), ("freq_turns", ctypes.c_void_p),
        ("attention_factor", ctypes.c_float),
        ("angle_kind", ctypes.c_int),
        ("token_cos", ctypes.c_void_p), ("token_sin", ctypes.c_void_p), ("token_dtype", ctypes.c_int),
        ("token_cos_stride_b", ctypes.c_int64), ("token_cos_stride_s", ctypes.c_int64),
        ("token_sin_stride_b", ctypes.c_int64), ("token_sin_stride_s", ctypes.c_int64),
        ("pos_stride_axis", ctypes.c_int64), ("mrope_section", ctypes.c_int * 3),
        ("mrope_interleaved", ctypes.c_int),
    ]


class RopeDevice(ctypes.Structure):
    _fields_ = [("num_sms", ctypes.c_int), ("cc_major", ctypes.c_int), ("l2_bytes", ctypes.c_int64),
                ("pdl", ctypes.c_int)]


def test_inconsistent_params_are_refused_by_the_c_api(c_api):
    """rope_launch refuses inconsistent RopeParams (odd or too large rotary_dim, a positions
    tensor announced but absent, an unknown angle source, a negative table row stride, per-token cos/sin absent or of an unknown
    dtype, mRoPE without positions or with sections not summing to rotary_dim/2) without touching
    memory; empty calls are fine."""
    q = torch.zeros(1, 2, 1, 8)
    cos = torch.zeros(4, 4)
    p = RopeParams(q=q.data_ptr(), q_out=q.data_ptr(), B=1, S=2, Hq=1, D=8, R=8, dtype=0,
                   cos_table=cos.data_ptr(), sin_table=cos.data_ptr(), table_rows=4)
    p.q_stride[:] = p.q_out_stride[:] = (16, 8, 8, 1)
    dev = RopeDevice(132, 9, 50 << 20, 1)
    c_api.rope_launch.restype = ctypes.c_int
    launch = lambda: c_api.rope_launch(ctypes.byref(p), ctypes.byref(dev), None)  # noqa: E731
    assert launch() == 0
    for field, value in (("R", 7), ("R", 10), ("pos_kind", 2), ("pos_kind", 3), ("angle_kind", 3),
                         ("table_row_stride", -4)):
        old = getattr(p, field)
        setattr(p, field, value)
        assert launch() != 0, field
        setattr(p, field, old)
    # per-token cos/sin (angle_kind 1): given, of a known dtype
    p.angle_kind = 1
    assert launch() != 0
    p.token_cos = p.token_sin = cos.data_ptr()
    p.token_cos_stride_s = p.token_sin_stride_s = 4
    assert launch() == 0
    p.token_dtype = 3
    assert launch() != 0
    p.token_dtype = 0
    # mRoPE (angle_kind 2): positions from a tensor, sections summing to R/2
    pos = torch.zeros(3, 2, dtype=torch.int64)
    p.angle_kind = 2
    p.mrope_section[:] = (2, 1, 1)
    assert launch() != 0  # no positions tensor
    p.pos, p.pos_kind, p.pos_stride_s, p.pos_stride_axis = pos.data_ptr(), 2, 1, 2
    assert launch() == 0
    for section in ((2, 1, 2), (5, -1, 0)):
        p.mrope_section[:] = section
        assert launch() != 0, section
    p.angle_kind = 0
    p.S = 0
    p.q = p.q_out = None
    assert launch() == 0


def test_misaligned_freq_turns_take_the_generic_kernel(ext):
    """The vector kernels load freq_turns in 16-byte pairs: freq_turns 8 bytes past an aligned
    address leave only the generic kernel, with the same result."""
    inv = compute_inv_freq(64, 10000.0)[0]
    cos, sin = cos_sin_table(inv, 1.0, 16)
    storage = torch.zeros(33, dtype=torch.int64)
    storage[1:] = freq_turns_of(inv)
    turns = storage[1:]
    assert turns.data_ptr() % 16 == 8
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 5, 3, 64, generator=gen)
    pos = torch.tensor([[0, 3, 15, 16, 900], [2, 40, 7, 1000, 5]])  # some beyond the table
    args = KernelArgs(q, None, torch.empty_like(q), None, pos, 0, cos, sin, turns, 1.0, "bshd", 64,
                      False, False, False)
    assert ext.candidates(args) == ["generic", "generic+nopdl"]
    ext.run(args)
    ref = rope_reference(q, pos, layout="bshd", rotary_dim=64, style="neox", inv_freq=inv)
    assert_rope_close(args.q_out, ref, q, rotary_dim=64, style="neox")
    assert ext.candidates(args._replace(freq_turns=freq_turns_of(inv)))[0] != "generic"


def _copies_made(fn) -> list[str]:
    """The copying torch ops fn runs (the emulated extension's tensors live on the CPU, so its
    .contiguous() shows up as aten ops)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.key for e in prof.key_averages() if e.key in ("aten::clone", "aten::copy_", "aten::contiguous")]


@pytest.mark.parametrize("rows", [48, 1])
def test_tables_that_are_two_halves_of_one_cache(ext, rows):
    """cos and sin as the two halves of one [P, R] cos|sin cache (strided rows) are read in
    place, with the result of contiguous tables, by every configuration that takes the call;
    tables without one row stride (or with zero-stride rows) are copied for the call."""
    inv = compute_inv_freq(32, 10000.0)[0]
    cos, sin = cos_sin_table(inv, 1.0, rows)
    cache = torch.cat([cos, sin], dim=-1)
    q = torch.randn(2, 5, 4, 40)
    pos = torch.randint(0, rows, (2, 5))
    args = KernelArgs(q, None, None, None, pos, 0, cos, sin, None, 1.0, "bshd", 32, False, False, False)
    want = ext.run(args)
    halves = args._replace(cos=cache[:, :16], sin=cache[:, 16:])
    assert _copies_made(lambda: ext.run(halves)) == []
    for label in ext.candidates(halves):
        out = args._replace(cos=cache[:, :16], sin=cache[:, 16:], q_out=torch.empty_like(q))
        ext.run_with(out, label)
        assert torch.equal(out.q_out, want[0]), label
    wide = torch.cat([cos, torch.zeros_like(cos), sin], dim=-1)
    other = args._replace(cos=wide[:, :16], sin=sin.clone())  # row strides 48 and 16: copied
    got = ext.run(other)
    assert torch.equal(got[0], want[0])
    if rows > 1:
        assert _copies_made(lambda: ext.run(other)) != []
        same_row = args._replace(cos=cos[:1].expand(rows, 16), sin=sin[:1].expand(rows, 16),
                                 pos=torch.zeros_like(pos))  # zero-stride rows: copied, then read
        torch.testing.assert_close(ext.run(same_row)[0], ext.run(args._replace(pos=torch.zeros_like(pos)))[0],
                                   rtol=0, atol=0)


def test_kernel_args_fields_are_checked(ext):
    """The extension reads KernelArgs by position: the backend refuses a rope_ops whose fields
    differ from those the extension reads, naming both; a call with an unknown angle source is
    refused."""
    from rope_ops_backends import cuda_backend

    read = list(ext.kernel_args_fields)
    assert read == list(KernelArgs._fields[:len(read)]) and "inplace" in read and "angles" in read
    assert cuda_backend.kernel_args_reasons(ext) == []

    class Other:
        kernel_args_fields = list(reversed(KernelArgs._fields))

    (reason,) = cuda_backend.kernel_args_reasons(Other)
    assert "do not match" in reason and "'inplace'" in reason
    with pytest.raises(RuntimeError, match="angles"):
        ext.run(KernelArgs(torch.zeros(1, 1, 2), None, None, None, None, 0, torch.zeros(1, 1),
                           torch.zeros(1, 1), None, 1.0, "thd", 2, False, False, False, angles="rays"))


def test_angle_sources_rank_by_their_measured_speed():
    """Per-token cos/sin and chunked mRoPE rank above the Triton backend, interleaved mRoPE below
    it (slower on the H200); position tables of half precision are refused (the table sources
    read float32), per-token ones are not; the prologue still refuses both sources."""
    from rope_ops.backend import RopeCall
    from rope_ops_backends.cuda_backend import CudaBackend
    from rope_ops_backends.triton_backend import TritonBackend

    def call(angles, table_dtype=torch.float32, op="rope", interleaved=False):
        return RopeCall("cuda", torch.bfloat16, "thd", "neox", 128, 128, 32, 8, False, torch.int64,
                        angles == "token", False, True, angles=angles, table_dtype=table_dtype, op=op,
                        mrope_interleaved=interleaved)

    cuda = CudaBackend()
    for angles in ("table", "token", "mrope"):
        assert cuda.priority_for(call(angles)) == cuda.priority > TritonBackend.priority
        assert cuda.supports(call(angles)) == []
        assert angles == "table" or any("prologue" in r for r in cuda.supports(call(angles, op="prologue")))
    assert cuda.priority_for(call("mrope", interleaved=True)) < TritonBackend.priority
    assert cuda.supports(call("token", torch.float16)) == []
    for angles in ("table", "mrope"):
        (reason,) = cuda.supports(call(angles, torch.bfloat16))
        assert "float32" in reason
