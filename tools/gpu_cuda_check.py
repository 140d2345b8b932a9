#!/usr/bin/env python
"""GPU check of the rope_ops CUDA backend: build, accuracy against the float64 reference, and the
PERF.md workloads timed with CUDA graphs against a same-run device-to-device copy.

Run on a CUDA machine from the repository root (no install needed):

    python tools/gpu_cuda_check.py               # build + accuracy + timing (< 4 minutes)
    python tools/gpu_cuda_check.py --no-perf     # build + accuracy only
    python tools/gpu_cuda_check.py --perf-only   # build + timing only
    python tools/gpu_cuda_check.py --sweep       # also sweep the grid-tuning knobs per workload

Self-contained apart from rope_ops._reference (the float64 reference) and the backend under test:
it calls CudaBackend().run directly with hand-built KernelArgs. Exit status: 0 when the build
and every accuracy case pass, 1 otherwise (--strict-perf: also when a perf target is missed).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def _import_backend():
    try:
        import rope_ops_backends  # noqa: F401
    except ModuleNotFoundError:  # a checkout that was not pip-installed: backends/ is the package
        spec = importlib.util.spec_from_file_location(
            "rope_ops_backends", ROOT / "backends" / "__init__.py",
            submodule_search_locations=[str(ROOT / "backends")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["rope_ops_backends"] = mod
        spec.loader.exec_module(mod)
    import rope_ops_backends.cuda_backend as cb
    return cb


from rope_ops import bench  # noqa: E402
from rope_ops._reference import rope_reference  # noqa: E402
from rope_ops.backend import KernelArgs  # noqa: E402
from rope_ops.frequencies import compute_inv_freq, cos_sin_table, freq_turns_of  # noqa: E402

DEV = "cuda"
HEAD_AXIS = {"bshd": 2, "sbhd": 2, "bhsd": 1, "thd": 1}


# ------------------------------------------------------------------------------------------------
# tables


def tables(rotary_dim: int, base: float, rows: int, m: float = 1.0):
    """inv_freq (float64), the float32 cos/sin tables and freq_turns, as rope_ops builds them."""
    inv = compute_inv_freq(rotary_dim, base)[0]
    cos, sin = cos_sin_table(inv, m, rows)
    return inv, cos.to(DEV), sin.to(DEV), freq_turns_of(inv).to(DEV)


# ------------------------------------------------------------------------------------------------
# accuracy


def layout_shape(layout, B, S, H, D):
    return {"bshd": (B, S, H, D), "sbhd": (S, B, H, D), "bhsd": (B, H, S, D),
            "thd": (B * S, H, D)}[layout]


def make_tensor(layout, B, S, H, D, dtype, kind, gen):
    """(tensor, extra-check-buffer) of the given kind: contig, packed (handled by caller),
    lastdim (stride 2 on head_dim), misaligned (2-byte offset)."""
    shape = layout_shape(layout, B, S, H, D)
    if kind == "lastdim":
        big = torch.randn(*shape[:-1], 2 * D, generator=gen).to(dtype).to(DEV)
        return big[..., ::2]
    if kind == "misaligned":
        n = math.prod(shape)
        flat = torch.randn(n + 1, generator=gen).to(dtype).to(DEV)
        return flat[1:].view(shape)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEV)


def allowed(x64, ref, dtype, r, style, m):
    half = r // 2
    idx = torch.arange(half)
    a, b = (idx, idx + half) if style == "neox" else (2 * idx, 2 * idx + 1)
    pair = x64[..., a].abs() + x64[..., b].abs()
    part = 2e-6 * pair.clamp_min(1.0) * max(1.0, m)
    bound = torch.zeros_like(x64[..., :r])
    bound[..., a] = part
    bound[..., b] = part
    if dtype in (torch.float16, torch.bfloat16):
        min_exp, mant = (-14, 10) if dtype == torch.float16 else (-126, 7)
        e = torch.floor(torch.log2(ref[..., :r].abs().clamp_min(1e-300))).clamp_min(min_exp)
        bound = bound + torch.pow(2.0, e - mant)
    return bound


def compare(name, out, x_in, ref, dtype, r, style, m, nan_ok_rows=False):
    """Returns a list of problems (empty: pass)."""
    problems = []
    o = out.detach().to("cpu", torch.float64)
    x64 = x_in.detach().to("cpu", torch.float64)
    D = o.shape[-1]
    # pass-through dims exact (bitwise)
    if r < D:
        ob = out[..., r:].detach().cpu().contiguous()
        ib = x_in[..., r:].detach().cpu().contiguous()
        if not torch.equal(ob.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           ib.view(torch.int16 if dtype != torch.float32 else torch.int32)):
            problems.append(f"{name}: pass-through dims [{r},{D}) changed")
    ref_r, o_r = ref[..., :r], o[..., :r]
    ref_nan = torch.isnan(ref_r)
    out_nan = torch.isnan(o_r)
    if not torch.equal(ref_nan, out_nan):
        problems.append(f"{name}: NaN pattern differs (ref NaN {int(ref_nan.sum())}, "
                        f"out NaN {int(out_nan.sum())})")
    fin = ~ref_nan & ~out_nan
    bound = allowed(x64, ref, dtype, r, style, m)
    err = (o_r - ref_r).abs()
    bad = fin & ~(err <= bound)
    if bad.any():
        idx = tuple(int(v) for v in bad.nonzero()[0])
        problems.append(f"{name}: {int(bad.sum())} elements out of tolerance; first at {idx}: "
                        f"out {o_r[idx].item():.8g} ref {ref_r[idx].item():.8g} "
                        f"bound {bound[idx].item():.3g}; max err/bound "
                        f"{(err[fin] / bound[fin]).max().item():.3g}")
    return problems


def positions(kind, pdtype, layout, B, S, rows, gen, beyond):
    """(pos tensor or None, pos_offset, reference pos) for kind in offset | bs | s."""
    if kind == "offset":
        off = rows - S // 2 if beyond else 3
        return None, off, off
    n = (B * S,) if layout == "thd" else ((B, S) if kind == "bs" else (S,))
    numel = math.prod(n)
    p = torch.randint(0, rows, (numel,), generator=gen, dtype=torch.int64)
    if beyond:  # ~1/3 of the positions outside the table: negative, beyond it, up to +-2^20
        sel = torch.rand(numel, generator=gen) < 0.35
        far = torch.randint(-(1 << 20), 1 << 20, (numel,), generator=gen, dtype=torch.int64)
        p = torch.where(sel, far, p)
        p[0] = rows  # first row past the end
        if numel > 1:
            p[1] = -1
    p = p.view(n).to(pdtype)
    return p.to(DEV), 0, p


class Runner:
    def __init__(self, backend, cb):
        self.backend = backend
        self.cb = cb
        self.failures = []
        self.count = 0
        self.failed_cases = 0
        self.verbose = False
        self.paths = {}
        self.lean_expected = True  # the lean pass must reach the lean kernel (not with rows on the fly)

    def ok(self, name):
        if self.verbose:
            print(f"  ok   {name}")
        elif self.count % 50 == 0:
            print(f"  ... {self.count} cases, {self.failed_cases} failed", flush=True)

    def case(self, name, fn):
        self.count += 1
        try:
            problems = fn()
        except Exception as e:  # report and go on
            problems = [f"{name}: raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"]
        if problems:
            self.failed_cases += 1
            self.failures.extend(problems)
            print(f"  FAIL {name}")
            for p in problems[:4]:
                print(f"       {p}")
        return not problems


def run_case(rn: Runner, *, dtype, style, layout, D, r, Hq, Hk, B=2, S=37, inplace, inverse,
             pos_kind="bs", pdtype=torch.int64, beyond=True, caller_tables=False, kind="contig",
             strided_out=False, m=1.0, base=10000.0, rows=256, expect_path=None, seed=0):
    name = (f"{str(dtype)[6:]:8s} {style:4s} {layout} D{D} r{r} q{Hq}k{Hk} "
            f"{'inplace' if inplace else 'outplace'}{' inv' if inverse else ''} pos={pos_kind}"
            f"{'' if pos_kind == 'offset' else '/' + str(pdtype)[6:]}"
            f"{' beyond' if beyond else ''}{' caller-tables' if caller_tables else ''}"
            f" {kind}{' strided-out' if strided_out else ''}{f' m={m}' if m != 1.0 else ''}")

    def go():
        gen = torch.Generator().manual_seed(seed)
        inv, cos, sin, ft = tables(r, base, rows, m)
        v = None
        if kind == "packed":
            tot = Hq + 2 * Hk
            buf = make_tensor(layout, B, S, tot, D, dtype, "contig", gen)
            ax = HEAD_AXIS[layout]
            q = buf.narrow(ax, 0, Hq)
            k = buf.narrow(ax, Hq, Hk) if Hk else None
            v = buf.narrow(ax, Hq + Hk, Hk).clone() if Hk else None
            v_view = buf.narrow(ax, Hq + Hk, Hk) if Hk else None
        else:
            q = make_tensor(layout, B, S, Hq, D, dtype, kind, gen)
            k = make_tensor(layout, B, S, Hk, D, dtype, kind, gen) if Hk else None
        q_in, k_in = q.clone(), (k.clone() if k is not None else None)
        sentinel = []
        if inplace:
            q_out, k_out = q, k
        elif strided_out:
            def mk(t):
                shape = list(t.shape)
                big = torch.full(shape[:-1] + [shape[-1] + 8], 7.0, dtype=dtype, device=DEV)
                sentinel.append(big)
                return big[..., : shape[-1]]
            q_out = mk(q)
            k_out = mk(k) if k is not None else None
        else:
            q_out = torch.empty_like(q)
            k_out = torch.empty_like(k) if k is not None else None
        pos, off, ref_pos = positions(pos_kind, pdtype, layout, B, S, rows, gen, beyond)
        args = KernelArgs(q=q, k=k, q_out=q_out, k_out=k_out, pos=pos, pos_offset=off,
                          cos=cos, sin=sin, freq_turns=None if caller_tables else ft,
                          attention_factor=m, layout=layout, rotary_dim=r,
                          interleaved=(style == "gptj"), inverse=inverse, inplace=inplace)
        path = kernel_path(q, k, q_out, k_out, layout, r, style == "gptj", inplace, cos)
        rn.paths[name] = path
        rn.backend.run(args)
        torch.cuda.synchronize()
        problems = []
        if expect_path is not None and path != expect_path:
            problems.append(f"{name}: took kernel path {path}, expected {expect_path}")
        ref_kw = dict(layout=layout, rotary_dim=r, style=style, inverse=inverse)
        if caller_tables:
            ref_kw["cos_sin"] = (cos, sin)
        else:
            ref_kw.update(inv_freq=inv, attention_factor=m)
        rp = ref_pos if pos is None else ref_pos
        for label, x_in, out in (("q", q_in, q_out), ("k", k_in, k_out)):
            if x_in is None:
                continue
            ref = rope_reference(x_in, rp, **ref_kw)
            problems += compare(f"{name} [{label}]", out, x_in, ref, dtype, r, style, m)
        if not inplace:
            if not torch.equal(q, q_in) or (k is not None and not torch.equal(k, k_in)):
                problems.append(f"{name}: out-of-place call modified its inputs")
        if v is not None and not torch.equal(v_view, v):
            problems.append(f"{name}: the V part of the packed QKV buffer changed")
        for big in sentinel:
            if not bool((big[..., -8:] == 7.0).all()):
                problems.append(f"{name}: wrote outside the strided output view")
        return problems

    ok = rn.case(name, go)
    if ok:
        rn.ok(f"{name}  [path {rn.paths.get(name)}]")


LAYOUT_CODE = {"bshd": 0, "sbhd": 1, "bhsd": 2, "thd": 3}


def kernel_path(q, k, q_out, k_out, layout, r, interleaved, inplace, cos):
    """1: vectorized fast kernel, 2: generic kernel, 0: nothing to launch."""
    return int(torch.ops.rope_ops_cuda.pick_path(q, k, q_out, k_out, LAYOUT_CODE[layout], r,
                                                 interleaved, inplace, cos))


def lean_pass(rn: Runner, dtypes) -> None:
    """The flat path's lean kernel on every case it can take (by default it takes only calls
    larger than these): variant 6 forced, whole NeoX rows of dense tensors, every layout and
    position kind. Also run alone (--lean-only), e.g. under compute-sanitizer."""
    if hasattr(rn.cb, "set_flat_lean"):
        rn.cb.set_config(6, -1, -1)
        rn.cb.set_flat_lean(1)
        print("  -- variant 6 (flat) forced, lean kernel wherever it can take the call")
        lean_ran = 0
        try:
            for dtype in dtypes:
                for layout in ("bshd", "thd", "sbhd", "bhsd"):
                    for seed, (Hq, Hk, pos_kind, inverse) in enumerate(
                            ((8, 2, "s", False), (4, 4, "bs", True), (2, 0, "offset", False),
                             (6, 2, "s", True))):
                        run_case(rn, dtype=dtype, style="neox", layout=layout, D=128, r=128, Hq=Hq,
                                 Hk=Hk, B=2, S=37, inplace=False, inverse=inverse, pos_kind=pos_kind,
                                 rows=131072 if seed == 1 else 256, expect_path=1, seed=20 + seed)
                        lean_ran += rn.cb.last_variant() == 8
                    # positions beyond the table (rows from freq_turns), in place, int32
                    run_case(rn, dtype=dtype, style="neox", layout=layout, D=64, r=64, Hq=4, Hk=4,
                             B=1, S=50, inplace=True, inverse=False, pos_kind="s",
                             pdtype=torch.int32, expect_path=1, seed=30)
                    lean_ran += rn.cb.last_variant() == 8
        finally:
            rn.cb.set_flat_lean(-1)
            rn.cb.set_config(-1, -1, -1)
        print(f"     lean kernel ran on {lean_ran} of them")
        if rn.lean_expected:
            rn.case("lean kernel ran on at least 8 of the forced cases",
                    lambda: [] if lean_ran >= 8 else [f"lean kernel ran on only {lean_ran} of them"])


def accuracy(rn: Runner):
    print("\n== accuracy against rope_ops._reference (float64)")
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    for dtype in dtypes:
        for style in ("neox", "gptj"):
            for layout in ("bshd", "sbhd", "bhsd", "thd"):
                pk = "bs" if layout == "thd" else "s"
                # full rotary, GQA, beyond-table int64 positions, out of place: fast path
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=128, Hq=4, Hk=2,
                         inplace=False, inverse=False, pos_kind="bs", expect_path=1)
                # partial rotary, in place, int32 positions shared by the batch ([S]) or [T]
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=64, Hq=3, Hk=1,
                         inplace=True, inverse=False, pos_kind=pk, pdtype=torch.int32,
                         expect_path=1)
                # head_dim 64, MQA, offset positions running past the table, backward
                run_case(rn, dtype=dtype, style=style, layout=layout, D=64, r=64, Hq=5, Hk=1,
                         inplace=False, inverse=True, pos_kind="offset", expect_path=1)
                # packed QKV views, in place, partial rotary 96, backward
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=96, Hq=4, Hk=2,
                         inplace=True, inverse=True, kind="packed", expect_path=1)
                # packed QKV, out of place into strided outputs, attention factor
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=32, Hq=2, Hk=2,
                         inplace=False, inverse=False, kind="packed", strided_out=True, m=0.75,
                         expect_path=1)
                # GPT-J-like: head_dim 256, rotary 64, both in and out of place
                for ip in (True, False):
                    run_case(rn, dtype=dtype, style=style, layout=layout, D=256, r=64, Hq=2,
                             Hk=2, inplace=ip, inverse=False, expect_path=1)
                # generic path: odd number of pairs per half, no k
                run_case(rn, dtype=dtype, style=style, layout=layout, D=80, r=34, Hq=3, Hk=0,
                         inplace=False, inverse=False, expect_path=2)
                # generic path: stride 2 on head_dim, in place
                run_case(rn, dtype=dtype, style=style, layout=layout, D=64, r=48, Hq=2, Hk=2,
                         inplace=True, inverse=True, kind="lastdim", expect_path=2)
                # generic path: misaligned base pointer
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=128, Hq=2, Hk=1,
                         inplace=False, inverse=False, kind="misaligned", expect_path=2)
                # caller tables: out-of-table positions must give NaN rows
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=128, Hq=2, Hk=2,
                         inplace=False, inverse=False, caller_tables=True, expect_path=1)
    # small odd shapes: decode-like single token, one head, tiny head_dim
    run_case(rn, dtype=torch.bfloat16, style="neox", layout="thd", D=128, r=128, Hq=32, Hk=8,
             B=1, S=1, inplace=True, inverse=False, expect_path=1)
    run_case(rn, dtype=torch.float32, style="neox", layout="bshd", D=2, r=2, Hq=1, Hk=1,
             inplace=False, inverse=False, expect_path=2)
    run_case(rn, dtype=torch.float16, style="gptj", layout="bshd", D=8, r=8, Hq=1, Hk=0,
             inplace=True, inverse=False, expect_path=1)
    # positions from a big table, long sequences (many tokens per block boundary)
    run_case(rn, dtype=torch.bfloat16, style="neox", layout="bshd", D=128, r=128, Hq=8, Hk=2,
             B=3, S=700, inplace=False, inverse=False, rows=131072, base=500000.0, expect_path=1)
    # The cases above are small, so each thread gets one head (the decode kernel). Force the
    # several-heads-per-thread kernels (prefill) on the same shapes, with even and uneven splits,
    # for every kernel variant (rope_set_config).
    for variant in range(num_variants(rn.cb)):
        for max_heads in (8, 3):
            rn.cb.set_config(variant, max_heads, 1)
            print(f"  -- variant {variant}, max_heads_per_thread={max_heads}, min_threads_per_sm=1")
            try:
                for dtype in dtypes:
                    for style in ("neox", "gptj"):
                        run_case(rn, dtype=dtype, style=style, layout="bshd", D=128, r=128, Hq=7,
                                 Hk=3, inplace=False, inverse=False, expect_path=1, seed=1)
                        run_case(rn, dtype=dtype, style=style, layout="sbhd", D=128, r=64, Hq=5,
                                 Hk=2, inplace=True, inverse=True, kind="packed", pos_kind="s",
                                 pdtype=torch.int32, expect_path=1, seed=2)
                        run_case(rn, dtype=dtype, style=style, layout="thd", D=256, r=64, Hq=6,
                                 Hk=6, inplace=False, inverse=False, caller_tables=True,
                                 expect_path=1, seed=3)
                        run_case(rn, dtype=dtype, style=style, layout="bhsd", D=256, r=64, Hq=4,
                                 Hk=0, inplace=True, inverse=False, pos_kind="offset",
                                 expect_path=1, seed=4)
                        # whole rows: packed QKV views out of place, backward, int32 positions,
                        # attention factor; in place at full rotary with offset positions
                        run_case(rn, dtype=dtype, style=style, layout="thd", D=128, r=128, Hq=6,
                                 Hk=2, inplace=False, inverse=True, kind="packed",
                                 pdtype=torch.int32, m=0.75, expect_path=1, seed=8)
                        run_case(rn, dtype=dtype, style=style, layout="bshd", D=64, r=64, Hq=3,
                                 Hk=3, inplace=True, inverse=True, pos_kind="offset",
                                 expect_path=1, seed=9)
                        # many heads: the flat kernel's q and k no longer fit one block
                        run_case(rn, dtype=dtype, style=style, layout="thd", D=128, r=128, Hq=60,
                                 Hk=8, B=1, S=3, inplace=False, inverse=False, expect_path=1,
                                 seed=10)
            finally:
                rn.cb.set_config(-1, -1, -1)  # the per-class defaults
    # Every cos/sin row computed from freq_turns (the rows_on_the_fly knob, off in every class)
    # with blocks of 96 threads: the same cases must stay within SPEC's bound of the reference.
    if hasattr(rn.cb, "set_launch"):
        rn.cb.set_launch(96, 1, -1)
        print("  -- rows_on_the_fly=1, block_threads=96")
        try:
            for dtype in dtypes:
                for style in ("neox", "gptj"):
                    for layout in ("bshd", "thd"):
                        run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=128, Hq=4,
                                 Hk=2, inplace=False, inverse=False, pos_kind="bs",
                                 rows=131072, base=500000.0, expect_path=1, seed=5)
                        run_case(rn, dtype=dtype, style=style, layout=layout, D=256, r=64, Hq=3,
                                 Hk=1, inplace=True, inverse=True, pos_kind="bs", m=0.75,
                                 expect_path=1, seed=6)
                        run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=128, Hq=2,
                                 Hk=2, inplace=False, inverse=False, caller_tables=True,
                                 expect_path=1, seed=7)
        finally:
            rn.cb.set_launch(-1, -1, -1)
    lean_pass(rn, dtypes)
    alloc_outputs(rn)
    garbage_positions(rn)
    zero_tokens(rn)
    large_tensor(rn)
    pdl_chain(rn)


def num_variants(cb) -> int:
    return int(cb.num_variants()) if hasattr(cb, "num_variants") else 1


def guard_problems(name, bound, q, k, pos, want) -> list[str]:
    """BoundRope.guarded (rope_ops.apply's guard for repeats): runs the guarded call's metadata
    like the launcher, and returns None for every change the plan key would see."""
    problems = []
    guard = bound.guarded(q, k, pos)
    got = guard(q, k, pos)
    torch.cuda.synchronize()
    if got is None or not torch.equal(got[0], want[0]) or (k is not None and not torch.equal(got[1], want[1])):
        problems.append(f"{name}: GuardedRope on the guarded call's metadata differs from BoundRope")
    with torch.no_grad():
        if guard(q.clone().requires_grad_(), k, pos) is None:
            problems.append(f"{name}: GuardedRope refused a call that needs no gradient (no_grad)")
    changed = {
        "another dtype": (q.float() if q.dtype != torch.float32 else q.half(), k, pos),
        "another shape": (q[:, :-1], None if k is None else k[:, :-1], pos[..., :-1]),
        "a strided view": (q.transpose(0, 1).contiguous().transpose(0, 1), k, pos) if q.shape[0] > 1 else None,
        "k left out" if k is not None else "k added": (q, None if k is not None else q, pos),
        "int32 positions": (q, k, pos.int()) if pos.dtype != torch.int32 else (q, k, pos.long()),
        "an int offset": (q, k, 0),
        "a bool offset": (q, k, True),
        "needs a gradient": (q.clone().requires_grad_(), k, pos),
        "a tensor subclass": (torch.nn.Parameter(q, requires_grad=False), k, pos),
    }
    for label, args in changed.items():
        if args is not None and guard(*args) is not None:
            problems.append(f"{name}: GuardedRope ran a call with {label}")
    return problems


def alloc_outputs(rn: Runner):
    """run() with q_out = k_out = None (out of place): returns new outputs, bitwise equal to a
    call that writes into given outputs."""
    name = "run() allocating its outputs (q_out None), with and without k"

    def go():
        problems = []
        inv, cos, sin, ft = tables(128, 500000.0, 256)
        gen = torch.Generator().manual_seed(11)
        q = torch.randn(2, 37, 6, 128, generator=gen).to(torch.bfloat16).to(DEV)
        k = torch.randn(2, 37, 2, 128, generator=gen).to(torch.bfloat16).to(DEV)
        pos = torch.randint(0, 300, (2, 37), generator=gen).to(DEV)

        def call(q, k, pos, qo, ko):
            return KernelArgs(q=q, k=k, q_out=qo, k_out=ko, pos=pos, pos_offset=0, cos=cos, sin=sin,
                              freq_turns=ft, attention_factor=1.0, layout="bshd", rotary_dim=128,
                              interleaved=False, inverse=False, inplace=False)

        for kk in (k, None):
            mk = lambda qo, ko: call(q, kk, pos, qo, ko)  # noqa: E731
            qo = torch.empty_like(q)
            ko = torch.empty_like(kk) if kk is not None else None
            if rn.backend.run(mk(qo, ko)) is not None:
                problems.append(f"{name}: run() with given outputs returned something")
            made = rn.backend.run(mk(None, None))
            torch.cuda.synchronize()
            if not isinstance(made, tuple) or len(made) != 2:
                problems.append(f"{name}: run() with q_out None returned {type(made).__name__}")
                continue
            if made[0].shape != q.shape or not torch.equal(made[0], qo):
                problems.append(f"{name}: allocated q_out differs")
            if kk is None and made[1] is not None:
                problems.append(f"{name}: k_out returned without k")
            if kk is not None and (made[1] is None or not torch.equal(made[1], ko)):
                problems.append(f"{name}: allocated k_out differs")
            problems += output_layout_problems(name, made, qo, ko)
            # the bound launchers of rope_ops.apply's plans, forward and inverse (backward)
            bind = getattr(rn.backend, "bind", None)
            for inverse in (False, True) if bind is not None else ():
                bound = bind(cos, sin, ft, 1.0, "bshd", 128, False, inverse)
                want_q = torch.empty_like(q)
                want_k = torch.empty_like(kk) if kk is not None else None
                rn.backend.run(mk(want_q, want_k)._replace(inverse=inverse))
                got = bound(q, kk, pos, 0)
                torch.cuda.synchronize()
                if not torch.equal(got[0], want_q) or (kk is None) != (got[1] is None) or (
                        kk is not None and not torch.equal(got[1], want_k)):
                    problems.append(f"{name}: BoundRope differs (inverse={inverse})")
                problems += guard_problems(f"{name} (inverse={inverse})", bound, q, kk, pos, got)
        # packed QKV views (non-dense inputs: dense outputs in the same dimension order), and a
        # call too large for one shared allocation
        for label, (B, S, H) in (("packed", (2, 37, 10)), ("large", (2, 4096, 40))):
            qkv = torch.randn(B, S, H, 128, generator=gen).to(torch.bfloat16).to(DEV)
            q_, k_ = qkv[:, :, :H - 4], qkv[:, :, H - 4:H - 2]
            pos_ = torch.randint(0, 256, (B, S), generator=gen).to(DEV)
            qo, ko = torch.empty_like(q_), torch.empty_like(k_)
            rn.backend.run(call(q_, k_, pos_, qo, ko))
            made = rn.backend.run(call(q_, k_, pos_, None, None))
            torch.cuda.synchronize()
            if not (torch.equal(made[0], qo) and torch.equal(made[1], ko)):
                problems.append(f"{name}: {label}: allocated outputs differ")
            problems += output_layout_problems(f"{name}: {label}", made, qo, ko)
            shared = made[0].untyped_storage().data_ptr() == made[1].untyped_storage().data_ptr()
            if label == "large" and shared:
                problems.append(f"{name}: large call's outputs share one allocation")
        return problems

    if rn.case(name, go):
        rn.ok(name)


def output_layout_problems(name, made, qo, ko):
    """Outputs the backend allocated must look like empty_like's (same strides, 16-byte aligned)
    and, when they share one allocation (small calls), not overlap."""
    problems = []
    for label, got, like in (("q_out", made[0], qo), ("k_out", made[1], ko)):
        if got is None or like is None:
            continue
        if got.stride() != like.stride() or got.dtype != like.dtype or got.device != like.device:
            problems.append(f"{name}: {label} strides/dtype/device {got.stride()} {got.dtype} "
                            f"{got.device}, empty_like gives {like.stride()}")
        if got.data_ptr() % 16:
            problems.append(f"{name}: {label} not 16-byte aligned")
    if made[1] is not None and made[0].numel() and made[1].numel():
        a0, a1 = made[0].data_ptr(), made[0].data_ptr() + made[0].numel() * made[0].element_size()
        b0, b1 = made[1].data_ptr(), made[1].data_ptr() + made[1].numel() * made[1].element_size()
        if a0 < b1 and b0 < a1:
            problems.append(f"{name}: q_out and k_out overlap")
    return problems


def pdl_chain(rn: Runner):
    """Back-to-back dependent calls (each reads the previous call's output) with programmatic
    dependent launch on and off, eager and in a CUDA graph: bitwise equal results. A kernel that
    touched memory before griddepcontrol.wait would read stale inputs here."""
    name = "PDL: 24 dependent back-to-back calls, pdl on == pdl off, eager and CUDA graph"
    if not hasattr(rn.cb, "set_launch"):
        return

    def go():
        problems = []
        inv, cos, sin, ft = tables(128, 500000.0, 8192)
        gen = torch.Generator().manual_seed(13)
        x0 = torch.randn(4, 2048, 8, 128, generator=gen).to(DEV)
        k0 = torch.randn(4, 2048, 2, 128, generator=gen).to(DEV)
        pos = torch.randint(0, 8192, (4, 2048), generator=gen).to(DEV)
        n = 24
        bufs = [(torch.empty_like(x0), torch.empty_like(k0)) for _ in range(n)]

        def chain():
            q, k = x0, k0
            for i, (qo, ko) in enumerate(bufs):
                rn.backend.run(KernelArgs(q=q, k=k, q_out=qo, k_out=ko, pos=pos, pos_offset=0,
                                          cos=cos, sin=sin, freq_turns=ft, attention_factor=1.0,
                                          layout="bshd", rotary_dim=128, interleaved=False,
                                          inverse=i % 3 == 2, inplace=False))
                q, k = qo, ko
            return q, k

        results = {}
        for pdl in (0, 1):
            rn.cb.set_launch(-1, -1, pdl)
            try:
                for b in bufs:
                    b[0].fill_(float("nan"))
                    b[1].fill_(float("nan"))
                results[("eager", pdl)] = [t.clone() for t in chain()]
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    chain()
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = chain()
                for b in bufs:
                    b[0].fill_(float("nan"))
                    b[1].fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                results[("graph", pdl)] = [t.clone() for t in out]
                del g
            finally:
                rn.cb.set_launch(-1, -1, -1)
        ref = results[("eager", 0)]
        if not all(torch.isfinite(t).all() for t in ref):
            problems.append(f"{name}: non-finite results without PDL")
        for key, got in results.items():
            if not all(torch.equal(a, b) for a, b in zip(got, ref)):
                problems.append(f"{name}: {key} differs from eager without PDL")
        return problems

    if rn.case(name, go):
        rn.ok(name)


def garbage_positions(rn: Runner):
    """Huge / negative / extreme int64 positions: no fault, finite, norm-preserving rows."""
    name = "garbage int64 positions (+-2^40, +-2^62, int64 min/max), bf16 + fp32"

    def go():
        problems = []
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(5)
            inv, cos, sin, ft = tables(128, 500000.0, 64)
            vals = [2**40, -(2**40), 2**62, -(2**62), 2**63 - 1, -(2**63), 10**18, -7]
            pos = torch.tensor(vals, dtype=torch.int64, device=DEV)
            q = torch.randn(len(vals), 4, 128, generator=gen).to(dtype).to(DEV)
            out = torch.empty_like(q)
            for tables_given in (False, True):
                rn.backend.run(KernelArgs(q=q, k=None, q_out=out, k_out=None, pos=pos,
                                          pos_offset=0, cos=cos, sin=sin,
                                          freq_turns=None if tables_given else ft,
                                          attention_factor=1.0, layout="thd", rotary_dim=128,
                                          interleaved=False, inverse=False, inplace=False))
                torch.cuda.synchronize()
                o = out.float().cpu()
                if tables_given:
                    if not torch.isnan(o).all():
                        problems.append(f"{name}: caller tables, out-of-table rows not all NaN")
                    continue
                if not torch.isfinite(o).all():
                    problems.append(f"{name}: non-finite output")
                    continue
                x = q.float().cpu()
                nx = x[..., :64] ** 2 + x[..., 64:] ** 2
                no = o[..., :64] ** 2 + o[..., 64:] ** 2
                if not torch.allclose(nx, no, rtol=2e-2, atol=1e-3):
                    problems.append(f"{name}: rotation does not preserve pair norms ({dtype})")
        return problems

    if rn.case(name, go):
        rn.ok(name)


def zero_tokens(rn: Runner):
    name = "zero tokens (bshd S=0, thd T=0)"

    def go():
        inv, cos, sin, ft = tables(64, 10000.0, 16)
        for shape, layout in (((2, 0, 4, 64), "bshd"), ((0, 4, 64), "thd")):
            q = torch.empty(shape, dtype=torch.bfloat16, device=DEV)
            rn.backend.run(KernelArgs(q=q, k=q, q_out=torch.empty_like(q), k_out=torch.empty_like(q),
                                      pos=None, pos_offset=0, cos=cos, sin=sin, freq_turns=ft,
                                      attention_factor=1.0, layout=layout, rotary_dim=64,
                                      interleaved=False, inverse=False, inplace=False))
        torch.cuda.synchronize()
        return []

    if rn.case(name, go):
        rn.ok(name)


def large_tensor(rn: Runner):
    """> 2^31 elements in place (64-bit indexing): check the last tokens against the reference."""
    name = "large tensor: bf16 thd [2^21+5, 8, 128] (2.1e9 elements) in place, last tokens"

    def go():
        T = (1 << 21) + 5
        free, _ = torch.cuda.mem_get_info()
        if free < T * 8 * 128 * 2 * 1.3:
            print(f"  skip {name}: {free / 2**30:.1f} GiB free")
            return []
        inv, cos, sin, ft = tables(128, 500000.0, 4096)
        q = torch.empty(T, 8, 128, dtype=torch.bfloat16, device=DEV)
        tail = 7
        gen = torch.Generator().manual_seed(9)
        q[-tail:] = torch.randn(tail, 8, 128, generator=gen).to(torch.bfloat16).to(DEV)
        q[:-tail].zero_()
        x = q[-tail:].clone()
        rn.backend.run(KernelArgs(q=q, k=None, q_out=q, k_out=None, pos=None, pos_offset=0,
                                  cos=cos, sin=sin, freq_turns=ft, attention_factor=1.0,
                                  layout="thd", rotary_dim=128, interleaved=False, inverse=False,
                                  inplace=True))
        torch.cuda.synchronize()
        ref = rope_reference(x, T - tail, layout="thd", rotary_dim=128, style="neox",
                             inv_freq=inv)
        out = q[-tail:].clone()
        del q
        torch.cuda.empty_cache()
        return compare(name, out, x, ref, torch.bfloat16, 128, "neox", 1.0)

    if rn.case(name, go):
        rn.ok(name)


# ------------------------------------------------------------------------------------------------
# performance


def graph_time_us(calls, reps, trials=7):
    """Median GPU time per call (us): `reps` calls (rotating through `calls`) in one CUDA graph."""
    bench.warm_up(calls, rounds=1)
    return bench.graph_seconds_per_call(calls, reps, trials) * 1e6


def copy_bandwidth():
    """Bytes read + written per second of a 2 GiB device-to-device copy (rope_ops.bench's)."""
    return bench.copy_bandwidth(torch.device(DEV))


def workloads():
    """name, dict(spec). Sizes from /work/shared/PERF.md."""
    return [
        ("W1 prefill 8B", dict(layout="bshd", B=4, S=4096, Hq=32, Hk=8, D=128, r=128,
                                style="neox", base=500000.0, pos="arange_bs", inplace=False,
                                bwd=False, target=("pct", 95.0))),
        ("W2 decode", dict(layout="thd", B=1, S=256, Hq=32, Hk=8, D=128, r=128, style="neox",
                           base=500000.0, pos="random", inplace=False, bwd=False,
                           target=("us", 3.2))),
        ("W3 GPT-J in place", dict(layout="bshd", B=2, S=4096, Hq=16, Hk=16, D=256, r=64,
                                   style="gptj", base=10000.0, pos="arange_bs", inplace=True,
                                   bwd=False, target=("us", 18.0))),
        ("W3 GPT-J out of place", dict(layout="bshd", B=2, S=4096, Hq=16, Hk=16, D=256, r=64,
                                       style="gptj", base=10000.0, pos="arange_bs",
                                       inplace=False, bwd=False, target=("pct", 93.0))),
        ("W4 train fwd+bwd", dict(layout="bshd", B=2, S=4096, Hq=32, Hk=32, D=128, r=128,
                                  style="neox", base=500000.0, pos="arange_bs", inplace=False,
                                  bwd=True, target=("pct", 95.0))),
        ("W5 prefill 70B", dict(layout="bshd", B=8, S=4096, Hq=64, Hk=8, D=128, r=128,
                                style="neox", base=500000.0, pos="arange_bs", inplace=False,
                                bwd=False, target=("pct", 97.0))),
    ]


def floor_bytes(w):
    tokens = w["B"] * w["S"]
    heads = w["Hq"] + w["Hk"]
    width = w["r"] if w["inplace"] else w["D"]
    data = tokens * heads * width * 2 * 2  # bf16, read + write
    distinct_pos = 256 if w["pos"] == "random" else w["S"]
    table = distinct_pos * (w["r"] // 2) * 4 * 2
    pos_bytes = tokens * 8
    per_call = data + table + pos_bytes
    return per_call * (2 if w["bwd"] else 1)


def build_sets(w, cos, sin, ft, nsets, gen):
    sets = []
    shape = lambda H: layout_shape(w["layout"], w["B"], w["S"], H, w["D"])  # noqa: E731
    for _ in range(nsets):
        q = torch.randn(shape(w["Hq"]), device=DEV, dtype=torch.bfloat16)
        k = torch.randn(shape(w["Hk"]), device=DEV, dtype=torch.bfloat16)
        if w["pos"] == "random":
            pos = torch.randint(0, 32768, (w["B"] * w["S"],), device=DEV, dtype=torch.int64)
        else:
            pos = torch.arange(w["S"], device=DEV, dtype=torch.int64).expand(w["B"], w["S"])
            pos = pos.contiguous()
            if w["layout"] == "thd":
                pos = pos.reshape(-1)
        if w["inplace"]:
            qo, ko = q, k
        else:
            qo, ko = torch.empty_like(q), torch.empty_like(k)
        mk = lambda a, b, c, d, inv: KernelArgs(  # noqa: E731
            q=a, k=b, q_out=c, k_out=d, pos=pos, pos_offset=0, cos=cos, sin=sin, freq_turns=ft,
            attention_factor=1.0, layout=w["layout"], rotary_dim=w["r"],
            interleaved=w["style"] == "gptj", inverse=inv, inplace=w["inplace"])
        fwd = mk(q, k, qo, ko, False)
        # backward: gradients of the outputs rotated back; separate tensors, as in training and
        # in rope_ops.bench (reading the forward's outputs would find part of them in L2)
        bwd = None
        if w["bwd"]:
            bwd = mk(torch.randn_like(q), torch.randn_like(k), torch.empty_like(q),
                     torch.empty_like(k), True)
        sets.append((fwd, bwd))
    return sets


def perf(rn: Runner, sweep: bool, strict: bool, only: str | None = None, wide: bool = False,
         variants: list[int] | None = None):
    print("\n== timing (CUDA graphs, rotating input sets, bf16, table of 131072 rows)")
    cb = rn.cb
    bw = copy_bandwidth()
    print(f"same-run 2 GiB device-to-device copy: {bw / 1e9:.0f} GB/s (read + written)")
    l2 = bench.l2_bytes(torch.device(DEV))
    misses = []
    rows_out = []
    winners = []
    for name, w in workloads():
        if only and not name.startswith(tuple(only.split(","))):
            continue
        try:
            inv, cos, sin, ft = tables(w["r"], w["base"], 131072)
            per_set = floor_bytes(w)
            nsets = max(2, min(64, math.ceil(4 * l2 / per_set)))
            sets = build_sets(w, cos, sin, ft, nsets, None)
            run = rn.backend.run
            calls = []
            for fwd, bwd in sets:
                if bwd is None:
                    calls.append(lambda f=fwd: run(f))
                else:
                    calls.append(lambda f=fwd, b=bwd: (run(f), run(b)))
            reps = max(len(calls), min(400, int(2e4 / max(1.0, per_set / bw * 1e6)) + 1))
            reps = max(reps, 20)
            t = graph_time_us(calls, reps)
            used = cb.last_variant() if hasattr(cb, "last_variant") else None
            if used is not None:
                print(f"   {name}: default config ran variant {used} ({cb.variant_name(used)}): "
                      f"{t:.2f} us", flush=True)
            # same-bytes copy: half the floor read, half written, same rotation
            nbytes = per_set // 2
            bufs = [(torch.empty(nbytes, dtype=torch.uint8, device=DEV),
                     torch.empty(nbytes, dtype=torch.uint8, device=DEV)) for _ in range(nsets)]
            copies = [lambda a=a, b=b: b.copy_(a) for a, b in bufs]
            tc = graph_time_us(copies, reps)
            del bufs
            pct = per_set / (t * 1e-6) / bw * 100
            pct_copy = per_set / (tc * 1e-6) / bw * 100
            if w["inplace"] and sweep:
                for label, (tf, how) in pattern_floor(w, reps).items():
                    print(f"   {name}: triton load/store of the same bytes, {label}: "
                          f"{tf:.2f} us ({how})", flush=True)
            kind, goal = w["target"]
            met = (pct >= goal) if kind == "pct" else (t <= goal)
            tgt = f">={goal:.0f}%" if kind == "pct" else f"<={goal}us"
            rows_out.append((name, t, tc, pct, pct_copy, per_set, tgt, met, nsets))
            if not met:
                misses.append(f"{name}: {t:.2f} us ({pct:.1f} %), target {tgt}")
            best = None
            if sweep:
                verify = make_verify(sets, run, w["inplace"])
                key = class_key(w)
                best, bt, wrong = tuning_sweep(cb, calls, reps, t, verify, "small" in key,
                                               variants=variants, wide=wide)
                winners.append((name, key, t, bt))
                if wrong:  # an accuracy failure, not a perf miss
                    msg = f"{name}: configs whose outputs differ from the default's: {wrong}"
                    rn.failures.append(msg)
                    print(f"  FAIL {msg}")
            del sets, calls
            torch.cuda.empty_cache()
            if best:
                print(f"   {name} [{key}]: sweep best {best}", flush=True)
        except Exception as e:
            misses.append(f"{name}: raised {type(e).__name__}: {e}")
            print(f"  FAIL {name}: {type(e).__name__}: {e}")
            traceback.print_exc(limit=3)
    print(f"\n{'workload':24s} {'kernel us':>10s} {'copy us':>9s} {'% of copy BW':>13s} "
          f"{'copy %':>7s} {'floor MB':>9s} {'target':>9s} {'sets':>5s}")
    for name, t, tc, pct, pctc, nb, tgt, met, ns in rows_out:
        print(f"{name:24s} {t:10.2f} {tc:9.2f} {pct:12.1f}% {pctc:6.1f}% {nb / 1e6:9.1f} "
              f"{tgt:>9s} {ns:5d}  {'ok' if met else 'MISS'}")
    if winners:
        print("\nsweep winners (edit kDefaultConfig in csrc/rope_kernels.cu: {variant, "
              "max_heads_per_thread, min_threads_per_sm, block_threads, rows_on_the_fly} per class; "
              "-1 = keep):")
        for name, key, t, (tb, v, mh, mt, bt, fly, pdl) in winners:
            print(f"  {name:24s} class [{key}]  default {t:8.2f} us  best {tb:8.2f} us  "
                  f"-> {{{v}, {mh}, {mt}, {bt}, {fly}}} pdl={pdl}  "
                  f"({cb.variant_name(v) if v >= 0 else 'default'})")
        print("  variants: " + "; ".join(f"{v} = {cb.variant_name(v)}"
                                         for v in range(num_variants(cb))))
    host_time(rn)
    if misses:
        print("perf targets missed:\n  " + "\n  ".join(misses))
    return misses if strict else []


def pattern_floor(w, reps):
    """The same bytes as an in-place workload touched by a plain Triton load/store kernel: rows
    of r elements at a stride of D (the in-place access pattern) and the same rows packed
    densely. Returns {label: (us, config)}; {} without triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return {}

    @triton.jit
    def touch(x_ptr, n_rows, scale, ROW_STRIDE: tl.constexpr, WIDTH: tl.constexpr,
              BLOCK_ROWS: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        off = rows.to(tl.int64)[:, None] * ROW_STRIDE + tl.arange(0, WIDTH)[None, :]
        m = (rows < n_rows)[:, None]
        v = tl.load(x_ptr + off, mask=m)
        # a run-time scale (1.0) so the store of the loaded value cannot be folded away
        tl.store(x_ptr + off, (v.to(tl.float32) * scale).to(v.dtype), mask=m)

    rows = w["B"] * w["S"] * (w["Hq"] + w["Hk"])
    nsets = 8
    out = {}
    for label, stride in (("strided (in-place pattern)", w["D"]), ("dense", w["r"])):
        bufs = [torch.randn(rows * stride, device=DEV).to(torch.bfloat16) for _ in range(nsets)]
        best = None
        for br in (8, 16, 32, 64):
            for nw in (2, 4, 8):
                grid = (triton.cdiv(rows, br),)
                calls = [lambda b=b: touch[grid](b, rows, 1.0, ROW_STRIDE=stride, WIDTH=w["r"],
                                                 BLOCK_ROWS=br, num_warps=nw) for b in bufs]
                t = graph_time_us(calls, reps, trials=3)
                if best is None or t < best[0]:
                    best = (t, f"BLOCK_ROWS={br}, num_warps={nw}")
        out[label] = best
        del bufs
    return out


def class_key(w):
    """The kDefaultConfig row (csrc/rope_kernels.cu) of a workload: [many] small/large, in/out,
    style (many: at least 64 heads per token)."""
    ct = (w["r"] // 2 // 8) if w["style"] == "neox" else w["r"] // 8
    if not w["inplace"]:
        ct += (w["D"] - w["r"]) // 8
    small = w["B"] * w["S"] * ct * (w["Hq"] + w["Hk"]) < torch.cuda.get_device_properties(0).multi_processor_count * 2048
    many = "many " if w["Hq"] + w["Hk"] >= 64 else ""
    return f"{many}{'small' if small else 'large'} {'in ' if w['inplace'] else 'out'} {w['style']}"


def variant_names(cb) -> dict:
    """Variant number -> name ("" for a build that cannot name them)."""
    names = {}
    for v in range(num_variants(cb)):
        name = cb.variant_name(v) if hasattr(cb, "variant_name") else ""
        names[v] = name.decode() if isinstance(name, bytes) else str(name)
    return names


def flat_variant(cb):
    """The flat kernel's variant number, or None for a build without it."""
    return next((v for v, name in variant_names(cb).items() if "flat" in name), None)


def knobless_variants(cb) -> set:
    """Variants whose grid ignores heads per thread, threads per SM and block size: the flat
    kernel and the rows kernel."""
    return {v for v, name in variant_names(cb).items() if "flat" in name or name.startswith("rows")}


def sweep_configs(cb, small, variants=None):
    """(variant, max_heads_per_thread, min_threads_per_sm, block_threads, rows_on_the_fly, pdl)
    to time; -1: the class default (pdl -1: on). ``variants``: only these (default: all). The
    flat kernel gets one config per rows-on-the-fly / PDL setting: the grid knobs do not
    apply to it (nor to the rows kernel: one config)."""
    flat = flat_variant(cb)
    knobless = knobless_variants(cb)
    wanted = list(variants) if variants else list(range(num_variants(cb)))
    cfgs = []
    if small:  # decode-sized: block size x heads per thread x table or on-the-fly rows x PDL
        for pdl in (0, 1):
            for fly in (0, 1):
                if flat is not None and flat in wanted:
                    cfgs.append((flat, 2, 128, -1, fly, pdl))
                for bt in (64, 128, 256):
                    cfgs.append((-1, 1, 4096, bt, fly, pdl))  # one head per thread
                    for mh, mt in ((2, 128), (2, 512), (4, 128)):
                        cfgs.append((4, mh, mt, bt, fly, pdl))
        return cfgs
    # one head per thread (the ROUNDS/1 kernel whatever the variant)
    cfgs.append((-1, 1, 4096, -1, -1, -1))
    for v in wanted:  # 9 per variant: ~8 s per workload
        cfgs.append((v, 8, 4096, -1, -1, -1))
        if v in knobless:
            continue
        for mh in (2, 4, 8, 16):
            for mt in (2048, 8192):
                cfgs.append((v, mh, mt, -1, -1, -1))
    return cfgs


def wide_configs():
    """--wide: heads per thread x threads per SM x block size for the pipelined variants (the
    grid's wave quantization: how full the last wave of blocks is)."""
    return [(v, mh, mt, bt, -1, -1) for v in (3, 4) for mh in (2, 3, 4, 5, 6, 8)
            for mt in (1024, 2048) for bt in (64, 128, 256)]


def refine_configs(best):
    """Block size and PDL around the best (v, mh, mt) of the first pass."""
    v, mh, mt = best[:3]
    return [(v, mh, mt, bt, -1, pdl) for pdl in (0, 1) for bt in (128, 256)]


def snapshot_outputs(args_list):
    return [t.clone() for t in args_list if t is not None]


def tuning_sweep(cb, calls, reps, baseline, verify, small, variants=None, wide=False):
    """Times every config; `verify()` returns False when a config's outputs differ (bitwise) from
    the default config's. Returns (summary line, best (t, v, mh, mt, bt, fly, pdl), wrong
    configs)."""
    results = []
    wrong = []

    def time_configs(cfgs):
        for cfg in cfgs:
            v, mh, mt, bt, fly, pdl = cfg
            cb.set_config(v, mh, mt)
            cb.set_launch(bt, fly, pdl)
            try:
                # on-the-fly rows differ from table rows in the last bits: compared with the
                # float64 reference by the accuracy cases, here only within one bf16 ulp
                if not verify(exact=fly != 1):
                    wrong.append(cfg)
                    continue
                results.append((graph_time_us(calls, reps, trials=3), *cfg))
            finally:
                cb.set_config(-1, -1, -1)  # per-class defaults
                cb.set_launch(-1, -1, -1)

    time_configs(wide_configs() if wide and not small else sweep_configs(cb, small, variants))
    if not small and results:
        time_configs(refine_configs(min(results)[1:]))
    results.sort()
    if wide and not small:  # every config, to pick one that suits the whole class
        print("      all: " + "; ".join(f"{r[1:5]}={r[0]:.2f}" for r in sorted(results, key=lambda r: r[1:])))
    if not small:
        per_variant = {}
        for r in results:
            per_variant.setdefault(r[1], r)
        print("      best per variant: " + ", ".join(
            f"v{v}: {r[0]:.2f} us ({r[2]},{r[3]})" for v, r in sorted(per_variant.items())))
    else:
        best_of = {}
        for r in results:
            best_of.setdefault((r[4], r[5], r[6]), r)
        print("      best per (block_threads, rows_on_the_fly, pdl): " + ", ".join(
            f"{k}: {r[0]:.2f} us (v{r[1]},{r[2]},{r[3]})" for k, r in sorted(best_of.items())))
    for pdl in (0, 1):
        got = [r for r in results if r[6] in ((pdl,) if pdl == 0 else (1, -1))]
        if got:
            print(f"      best with pdl={pdl}: {got[0][0]:.2f} us {got[0][1:]}")
    t, v, mh, mt, bt, fly, pdl = results[0]
    name = cb.variant_name(v) if v >= 0 else "class default"
    line = (f"{t:.2f} us with variant {v} ({name}), max_heads_per_thread={mh}, "
            f"min_threads_per_sm={mt}, block_threads={bt}, rows_on_the_fly={fly}, pdl={pdl} "
            f"(default config {baseline:.2f} us); "
            f"next: " + ", ".join(f"{r[0]:.2f}@{r[1:]}" for r in results[1:4]))
    return line, results[0], wrong


def make_verify(sets, run, inplace):
    """A checker: rerun set 0's forward (restoring in-place inputs) and compare bitwise with the
    outputs of the class-default config, captured now."""
    fwd = sets[0][0]
    q_in = fwd.q.clone()
    k_in = fwd.k.clone() if fwd.k is not None else None

    def once():
        if inplace:
            fwd.q.copy_(q_in)
            if k_in is not None:
                fwd.k.copy_(k_in)
        run(fwd)
        torch.cuda.synchronize()
        return [t.clone() for t in (fwd.q_out, fwd.k_out) if t is not None]

    ref = once()

    def verify(exact=True):
        got = once()
        if exact:
            return all(torch.equal(a, b) for a, b in zip(got, ref))
        return all(bool(((a.float() - b.float()).abs() <= b.float().abs() * 2.0**-7 + 1e-6).all())
                   for a, b in zip(got, ref))

    return verify


def host_time(rn: Runner):
    """Wall time per eager CudaBackend.run call on W2 shapes (host-bound loop)."""
    inv, cos, sin, ft = tables(128, 500000.0, 131072)
    q = torch.randn(256, 32, 128, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(256, 8, 128, device=DEV, dtype=torch.bfloat16)
    pos = torch.randint(0, 32768, (256,), device=DEV)
    args = KernelArgs(q=q, k=k, q_out=torch.empty_like(q), k_out=torch.empty_like(k), pos=pos,
                      pos_offset=0, cos=cos, sin=sin, freq_turns=ft, attention_factor=1.0,
                      layout="thd", rotary_dim=128, interleaved=False, inverse=False,
                      inplace=False)
    run = rn.backend.run
    op = torch.ops.rope_ops_cuda.rope.default
    eager = rn.cb._state["eager"]
    alloc_args = args._replace(q_out=None, k_out=None)
    bound = rn.backend.bind(cos, sin, ft, 1.0, "thd", 128, False, False)
    qo, ko = args.q_out, args.k_out

    def timed(fn, n=3000):
        return bench.host_time_per_call([fn], torch.device(DEV), iterations=n) * 1e6

    res = {
        "pybind entry (outputs given)": timed(lambda: eager(
            q, k, qo, ko, pos, 0, cos, sin, ft, 1.0, 3, 128, False, False, False)),
        "pybind entry (allocates outputs)": timed(lambda: eager(
            q, k, None, None, pos, 0, cos, sin, ft, 1.0, 3, 128, False, False, False)),
        "BoundRope (apply's cached plan)": timed(lambda: bound(q, k, pos, 0)),
        "torch.empty_like(q), torch.empty_like(k)": timed(
            lambda: (torch.empty_like(q), torch.empty_like(k))),
        "raw torch.ops.rope_ops_cuda.rope": timed(lambda: op(
            q, k, qo, ko, pos, 0, cos, sin, ft, 1.0, 3, 128, False, False, False)),
        "CudaBackend.run (outputs given)": timed(lambda: run(args)),
        "CudaBackend.run (q_out None)": timed(lambda: run(alloc_args)),
    }
    try:
        import rope_ops

        def app():
            return rope_ops.apply(q, k, pos, layout="thd", base=500000.0, backend="cuda")
        app()
        res["rope_ops.apply(backend='cuda')"] = timed(app)
    except Exception as e:  # report, do not fail the check
        print(f"  rope_ops.apply not timed: {type(e).__name__}: {e}")
    print("host time per eager call, W2 shapes (best of three loops of 3000):")
    for label, us in res.items():
        print(f"  {label:40s} {us:7.2f} us")
    print("  (target for rope_ops.apply: <= 15 us)")


# ------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-perf", action="store_true")
    ap.add_argument("--perf-only", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="sweep the grid-tuning knobs")
    ap.add_argument("--strict-perf", action="store_true", help="exit 1 on a missed perf target")
    ap.add_argument("--only", default=None, help="time only workloads whose names start so (comma list: W1,W4)")
    ap.add_argument("--wide", action="store_true",
                    help="with --sweep: heads x threads x block size grid for the large classes")
    ap.add_argument("--variants", default=None,
                    help="with --sweep: only these kernel variants (comma list: 4,6,7)")
    ap.add_argument("--lean-only", action="store_true",
                    help="only the lean-kernel accuracy pass (short enough for compute-sanitizer)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every passing case")
    a = ap.parse_args()
    t_start = time.time()
    if not torch.cuda.is_available():
        print("no CUDA device: this script needs a GPU")
        return 1
    print(f"torch {torch.__version__} CUDA {torch.version.cuda}, "
          f"{torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}")
    cb = _import_backend()
    backend = cb.CudaBackend()
    t0 = time.time()
    reasons = backend.availability()
    if reasons:
        print("CUDA backend unavailable:\n  " + "\n  ".join(reasons))
        return 1
    print(f"extension ready in {time.time() - t0:.1f} s ({cb.build_dir(cb.visible_archs())})")
    rn = Runner(backend, cb)
    rn.verbose = a.verbose
    if a.lean_only:
        lean_pass(rn, (torch.float32, torch.float16, torch.bfloat16))
        print(f"\nlean pass: {rn.count - rn.failed_cases}/{rn.count} cases passed, "
              f"{len(rn.failures)} problems")
        return 1 if rn.failures else 0
    if not a.perf_only:
        accuracy(rn)
        print(f"\naccuracy: {rn.count - rn.failed_cases}/{rn.count} cases passed, "
              f"{len(rn.failures)} problems")
        paths = list(rn.paths.values())
        print(f"kernel paths taken: fast {paths.count(1)}, generic {paths.count(2)}")
    perf_fail = []
    if not a.no_perf:
        perf_fail = perf(rn, a.sweep, a.strict_perf, a.only, a.wide,
                         [int(v) for v in a.variants.split(",")] if a.variants else None)
    print(f"\ntotal {time.time() - t_start:.0f} s")
    if rn.failures or perf_fail:
        print(f"FAILED: {len(rn.failures)} accuracy problems, {len(perf_fail)} perf misses")
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
