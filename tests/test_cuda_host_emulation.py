"""The CUDA kernels' per-thread code, run on the CPU (no GPU needed), against the float64 reference.

csrc/rope_kernels.cu keeps every per-thread function __host__ __device__; compiled with
-DROPE_HOST_EMULATION it exports rope_host_emulate(), which makes the same path choice and grid
sizing as rope_launch() and runs each would-be thread in turn on host pointers. This test builds
that as a shared library with nvcc, maps KernelArgs to RopeParams exactly as csrc/rope_binding.cpp
does (layout permutation, element strides), and runs the accuracy cases of
tools/gpu_cuda_check.py on CPU tensors, including the expected fast/generic path of each case.

What it cannot see: device-only behaviour (__ldg, real concurrency, the device's sincospif and
conversion rounding, alignment faults), the torch binding and the build through cpp_extension.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

from _cuda_tools import find_nvcc, load_tool

import pytest
import torch

from rope_ops.backend import LAYOUT_DIMS

ROOT = Path(__file__).resolve().parents[1]
CU = ROOT / "csrc" / "rope_kernels.cu"


_nvcc = find_nvcc


class RopeParams(ctypes.Structure):  # mirrors csrc/rope_kernels.h
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
        ("table_rows", ctypes.c_int64), ("freq_turns", ctypes.c_void_p),
        ("attention_factor", ctypes.c_float),
    ]


_DTYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def canon(t: torch.Tensor, layout: str):
    b, s, h, d = LAYOUT_DIMS[layout]
    if b is None:
        return (1, t.shape[s], t.shape[h], t.shape[d]), (0, t.stride(s), t.stride(h), t.stride(d))
    return ((t.shape[b], t.shape[s], t.shape[h], t.shape[d]),
            (t.stride(b), t.stride(s), t.stride(h), t.stride(d)))


def params(*, q, k, q_out, k_out, layout, rotary_dim, interleaved, inplace,
           cos, sin=None, pos=None, pos_offset=0, freq_turns=None, attention_factor=1.0,
           inverse=False) -> RopeParams:
    p = RopeParams()
    (B, S, Hq, D), st = canon(q, layout)
    _, sto = canon(q_out, layout)
    p.q, p.q_out = q.data_ptr(), q_out.data_ptr()
    p.q_stride[:], p.q_out_stride[:] = st, sto
    p.B, p.S, p.Hq, p.D = B, S, Hq, D
    if k is not None:
        (_, _, Hk, _), stk = canon(k, layout)
        _, stko = canon(k_out, layout)
        p.k, p.k_out = k.data_ptr(), k_out.data_ptr()
        p.k_stride[:], p.k_out_stride[:] = stk, stko
        p.Hk = Hk
    p.R = rotary_dim
    p.dtype = _DTYPE[q.dtype]
    p.interleaved, p.inverse, p.copy_passthrough = int(interleaved), int(inverse), int(not inplace)
    if pos is None:
        p.pos_kind, p.pos_offset = 0, pos_offset
    else:
        p.pos = pos.data_ptr()
        p.pos_kind = 1 if pos.dtype == torch.int32 else 2
        if pos.dim() == 1:
            p.pos_stride_b, p.pos_stride_s = 0, pos.stride(0)
        else:
            p.pos_stride_b, p.pos_stride_s = pos.stride(0), pos.stride(1)
    p.cos_table = cos.data_ptr()
    p.sin_table = (sin if sin is not None else cos).data_ptr()
    p.table_rows = cos.shape[0]
    p.freq_turns = freq_turns.data_ptr() if freq_turns is not None else None
    p.attention_factor = attention_factor
    return p


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (no CUDA toolkit on this machine)")
    out = tmp_path_factory.mktemp("rope_emu") / "librope_emu.so"
    proc = subprocess.run(
        [nvcc, "-O2", "-std=c++17", "-DROPE_HOST_EMULATION", "-Xcompiler", "-fPIC", "-shared",
         "-gencode=arch=compute_90,code=sm_90", str(CU), "-o", str(out)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    so = ctypes.CDLL(str(out))
    so.rope_host_emulate.argtypes = [ctypes.POINTER(RopeParams), ctypes.c_int]
    so.rope_host_emulate.restype = ctypes.c_int
    so.rope_pick_path.argtypes = [ctypes.POINTER(RopeParams)]
    so.rope_pick_path.restype = ctypes.c_int
    so.rope_set_tuning.argtypes = [ctypes.c_int, ctypes.c_int]
    so.rope_set_tuning.restype = None
    so.rope_set_config.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    so.rope_set_config.restype = None
    so.rope_set_launch.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    so.rope_set_launch.restype = None
    so.rope_set_flat_blocks.argtypes = [ctypes.c_int]
    so.rope_set_flat_blocks.restype = None
    so.rope_set_flat_lean.argtypes = [ctypes.c_int]
    so.rope_set_flat_lean.restype = None
    so.rope_num_variants.restype = ctypes.c_int
    so.rope_last_variant.restype = ctypes.c_int
    so.rope_variant_name.argtypes = [ctypes.c_int]
    so.rope_variant_name.restype = ctypes.c_char_p
    return so


@pytest.fixture(scope="module")
def check_tool():
    return load_tool("gpu_cuda_check")


class EmulatedBackend:
    def __init__(self, so):
        self.so = so

    def run(self, a):
        made = None
        if a.q_out is None:  # out of place, outputs allocated by the backend (as the C++ entry)
            made = (torch.empty_like(a.q), None if a.k is None else torch.empty_like(a.k))
            a = a._replace(q_out=made[0], k_out=made[1])
        p = params(q=a.q, k=a.k, q_out=a.q_out, k_out=a.k_out, layout=a.layout,
                   rotary_dim=a.rotary_dim, interleaved=a.interleaved, inplace=a.inplace,
                   cos=a.cos, sin=a.sin, pos=a.pos, pos_offset=a.pos_offset,
                   freq_turns=a.freq_turns, attention_factor=a.attention_factor,
                   inverse=a.inverse)
        rc = self.so.rope_host_emulate(ctypes.byref(p), 132)  # an H200's SM count
        if rc != 0:
            raise RuntimeError(f"rope_host_emulate returned {rc}")
        return made


LEAN_VARIANT = 8  # rope_last_variant's code for the flat path's lean kernel


@pytest.mark.parametrize("rows_on_the_fly,flat_blocks,lean", [(-1, -1, -1), (1, -1, -1), (-1, 0, -1), (-1, -1, 1)],
                         ids=["defaults", "rows_on_the_fly", "separate_flat_blocks", "lean_everywhere"])
def test_kernels_on_host_match_reference(lib, check_tool, monkeypatch, rows_on_the_fly, flat_blocks, lean):
    """The accuracy cases of tools/gpu_cuda_check.py; the second run computes every cos/sin row
    from freq_turns (caller tables still read their table); the third gives the flat kernel one
    block per token and tensor even where q and k would fit one block; the fourth sends every
    call the flat path's lean kernel can take to it, decode-sized ones included (by default it
    takes only larger calls, which these cases are not). (The block size only shapes the grid,
    which the emulation does not have: it runs every thread id in turn.)"""
    g = check_tool
    lib.rope_set_launch(-1, rows_on_the_fly, -1)
    lib.rope_set_flat_blocks(flat_blocks)
    lib.rope_set_flat_lean(lean)
    monkeypatch.setattr(g, "DEV", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(g, "large_tensor", lambda rn: None)

    def kernel_path(q, k, q_out, k_out, layout, r, interleaved, inplace, cos):
        p = params(q=q, k=k, q_out=q_out, k_out=k_out, layout=layout, rotary_dim=r,
                   interleaved=interleaved, inplace=inplace, cos=cos)
        return lib.rope_pick_path(ctypes.byref(p))

    monkeypatch.setattr(g, "kernel_path", kernel_path)

    class Tuning:
        @staticmethod
        def set_tuning(max_heads, min_threads):
            lib.rope_set_tuning(max_heads, min_threads)

        @staticmethod
        def set_config(variant, max_heads, min_threads):
            lib.rope_set_config(variant, max_heads, min_threads)

        @staticmethod
        def num_variants():
            return lib.rope_num_variants()

        @staticmethod
        def set_flat_lean(lean):
            lib.rope_set_flat_lean(lean)

        @staticmethod
        def last_variant():
            return lib.rope_last_variant()

    used = set()
    backend = EmulatedBackend(lib)
    plain_run = backend.run

    def run_recording(a):
        made = plain_run(a)
        used.add(lib.rope_last_variant())
        return made

    backend.run = run_recording
    rn = g.Runner(backend, Tuning())
    rn.lean_expected = rows_on_the_fly != 1  # the lean kernel never computes rows on the fly
    try:
        g.accuracy(rn)
    finally:
        lib.rope_set_config(-1, -1, -1)
        lib.rope_set_launch(-1, -1, -1)
        lib.rope_set_flat_blocks(-1)
        lib.rope_set_flat_lean(-1)
    assert rn.count > 250
    assert not rn.failures, "\n".join(rn.failures[:20])
    paths = list(rn.paths.values())
    assert paths.count(1) > 150 and paths.count(2) > 50, (paths.count(1), paths.count(2))
    # every fast-kernel variant (and the one-head-per-thread kernel, -1) ran
    assert used >= set(range(-1, lib.rope_num_variants())), sorted(used)
    # the flat path's lean kernel: in the accuracy cases' own lean pass, and in every case it can
    # take in the "lean_everywhere" run (never with every row computed on the fly)
    assert (LEAN_VARIANT in used) == (rows_on_the_fly != 1), sorted(used)
    assert lib.rope_variant_name(LEAN_VARIANT).startswith(b"lean flat")


def _variant_named(lib, word):
    n = lib.rope_num_variants()
    found = [v for v in range(n) if word in lib.rope_variant_name(v)]
    assert len(found) == 1, [lib.rope_variant_name(v) for v in range(n)]
    return found[0]


def test_variant_selection(lib):
    """rope_set_config forces a variant for several-heads-per-thread grids; one head per thread
    always takes the ROUNDS/1 kernel (-1); the rows kernel takes only calls that write the
    rotary dims alone (in place; others fall back to a heads-per-thread variant); -1 restores
    the class defaults (decode-sized NeoX calls: the flat kernel; partial-rotary NeoX in place
    with many tokens: the rows kernel)."""
    q = torch.randn(1, 40, 6, 64).to(torch.bfloat16)
    cos = torch.randn(64, 32)
    n = lib.rope_num_variants()
    flat, rows = _variant_named(lib, b"flat"), _variant_named(lib, b"rows")
    assert n >= 8

    def run(interleaved=False, inplace=False, x=q):
        out = x if inplace else torch.empty_like(x)  # held: params keeps only its address
        p = params(q=x, k=None, q_out=out, k_out=None,
                   layout="bshd", rotary_dim=32 if inplace else 64, interleaved=interleaved,
                   inplace=inplace, cos=cos, sin=cos)
        assert lib.rope_host_emulate(ctypes.byref(p), 132) == 0
        return lib.rope_last_variant()

    try:
        for v in range(n):
            lib.rope_set_config(v, 3, 1)
            assert run() == (4 if v == rows else v)  # out of place
            assert run(inplace=True) == v
            assert lib.rope_variant_name(v)
        lib.rope_set_config(-1, -1, -1)  # decode-sized NeoX call with the defaults: the flat kernel
        assert run() == flat
        assert run(interleaved=True) == -1  # GPT-J, small: one head per thread
        big = torch.randn(1, 18000, 8, 64).to(torch.bfloat16)  # in place, > one wave: large class
        assert run(inplace=True, x=big) == rows  # NeoX, rotary_dim 32 of 64
        assert run(interleaved=True, inplace=True, x=big) == 4  # GPT-J: heads per thread
    finally:
        lib.rope_set_config(-1, -1, -1)


def test_rows_kernel_writes_only_the_rotary_dims(lib):
    """The rows kernel in place, forced on every dtype and style, GQA (5 q heads, 2 k heads),
    positions beyond the table (computed from freq_turns); on views whose rows are evenly spaced
    (head stride D + 16) and on q and k as head slices of one packed tensor (they are not):
    matches the reference in the rotary dims, and leaves the pass-through dims, the gaps and
    the rest of the packed tensor bit for bit as they were."""
    from rope_ops._reference import rope_reference
    from rope_ops.frequencies import cos_sin_table, freq_turns_of
    from rope_ops.testing.checks import assert_rope_close

    R, D = 32, 96
    inv = 10000.0 ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    cos, sin = cos_sin_table(inv, 1.0, 64)
    turns = freq_turns_of(inv)
    rows = _variant_named(lib, b"rows")
    gen = torch.Generator().manual_seed(12)
    pos = torch.randint(0, 200, (3, 37), generator=gen)  # most beyond the 64-row table
    try:
        lib.rope_set_config(rows, -1, -1)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
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
                    p = params(q=q, k=k, q_out=q, k_out=k, layout="bshd", rotary_dim=R,
                               interleaved=style == "gptj", inplace=True, cos=cos, sin=sin,
                               pos=pos, freq_turns=turns)
                    assert lib.rope_pick_path(ctypes.byref(p)) == 1
                    assert lib.rope_host_emulate(ctypes.byref(p), 132) == 0
                    assert lib.rope_last_variant() == rows
                    for got, x in ((q, qb), (k, kb)):
                        ref = rope_reference(x, pos, layout="bshd", rotary_dim=R, style=style,
                                             inv_freq=inv)
                        assert_rope_close(got, ref, x, rotary_dim=R, style=style)
                    for x, y in zip(base, before):
                        assert torch.equal(x[..., R:], y[..., R:])
                    if packed:
                        assert torch.equal(base[0][:, :, 7:], before[0][:, :, 7:])
    finally:
        lib.rope_set_config(-1, -1, -1)


def test_fast_div_is_exact(lib):
    """The rows kernel's divisions (multiply-high and shift, constants from the host) equal
    integer division for every numerator below 2^31: small and large divisors (head counts,
    sequence lengths), numerators at the divisor's multiples and at the 2^31 edge."""
    lib.rope_fast_div.argtypes = [ctypes.c_uint32, ctypes.c_uint32]
    lib.rope_fast_div.restype = ctypes.c_uint32
    gen = torch.Generator().manual_seed(13)
    top = 2**31 - 1
    divisors = list(range(1, 300)) + [2**k + e for k in range(9, 31) for e in (-1, 0, 1)] + \
        torch.randint(1, top, (200,), generator=gen).tolist() + [top]
    for d in divisors:
        edges = {0, 1, d - 1, d, d + 1, 2 * d - 1, 2 * d, top, top - 1, top - top % d, top - top % d - 1}
        numerators = [n for n in edges if 0 <= n <= top] + torch.randint(0, top, (20,), generator=gen).tolist()
        for n in numerators:
            assert lib.rope_fast_div(d, n) == n // d, (d, n)


def test_invalid_params_are_refused(lib):
    q = torch.zeros(1, 2, 1, 8)
    cos = torch.zeros(4, 4)
    p = params(q=q, k=None, q_out=q, k_out=None, layout="bshd", rotary_dim=8,
               interleaved=False, inplace=True, cos=cos)
    assert lib.rope_host_emulate(ctypes.byref(p), 132) == 0
    p.R = 7  # odd rotary dim
    assert lib.rope_host_emulate(ctypes.byref(p), 132) != 0
    p.R = 10  # rotary dim > head dim
    assert lib.rope_pick_path(ctypes.byref(p)) == -1
    p.R = 8
    p.pos_kind = 2  # positions tensor announced but null
    assert lib.rope_host_emulate(ctypes.byref(p), 132) != 0


def test_misaligned_freq_turns_take_the_generic_path(lib):
    """The fast path loads freq_turns in 16-byte pairs: an 8-byte aligned view of them must send
    the call to the generic path (scalar loads), with the same result."""
    from rope_ops._reference import rope_reference
    from rope_ops.frequencies import cos_sin_table, freq_turns_of
    from rope_ops.testing.checks import assert_rope_close

    inv = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    cos, sin = cos_sin_table(inv, 1.0, 16)
    storage = torch.zeros(33, dtype=torch.int64)
    storage[1:] = freq_turns_of(inv)
    turns = storage[1:]  # 8 bytes past a 16-byte aligned allocation
    assert turns.data_ptr() % 16 == 8
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 5, 3, 64, generator=gen)
    pos = torch.tensor([[0, 3, 15, 16, 900], [2, 40, 7, 1000, 5]])  # some beyond the table
    out = torch.empty_like(q)
    p = params(q=q, k=None, q_out=out, k_out=None, layout="bshd", rotary_dim=64,
               interleaved=False, inplace=False, cos=cos, sin=sin, pos=pos, freq_turns=turns)
    assert lib.rope_pick_path(ctypes.byref(p)) == 2
    assert lib.rope_host_emulate(ctypes.byref(p), 132) == 0
    ref = rope_reference(q, pos, layout="bshd", rotary_dim=64, style="neox", inv_freq=inv)
    assert_rope_close(out, ref, q, rotary_dim=64, style="neox")
    storage2 = freq_turns_of(inv).clone()  # aligned: the fast path
    p.freq_turns = storage2.data_ptr()
    assert lib.rope_pick_path(ctypes.byref(p)) == 1


def test_sweep_times_knobless_kernels_once_per_setting(check_tool):
    """gpu_cuda_check's sweep: the flat and rows kernels' grids ignore the heads-per-thread,
    threads-per-SM and block-size knobs, so each gets one config (the flat kernel one per
    rows-on-the-fly / PDL setting on decode)."""
    class FakeBackend:
        @staticmethod
        def num_variants():
            return 8

        @staticmethod
        def variant_name(v):
            return {6: "flat (a block per token's q or k)", 7: "rows (in place)"}.get(v, f"pipe{v}")

    large = check_tool.sweep_configs(FakeBackend, small=False)
    assert [c for c in large if c[0] == 6] == [(6, 8, 4096, -1, -1, -1)]
    assert [c for c in large if c[0] == 7] == [(7, 8, 4096, -1, -1, -1)]
    assert len([c for c in large if c[0] == 4]) == 9
    assert len([c for c in check_tool.sweep_configs(FakeBackend, small=False, variants=[4])
                if c[0] == 6]) == 0
    small = check_tool.sweep_configs(FakeBackend, small=True)
    assert sorted((c[4], c[5]) for c in small if c[0] == 6) == [(0, 0), (0, 1), (1, 0), (1, 1)]
