#!/usr/bin/env python
"""Correctness check of the rope_ops CUDA backend on a GPU: build the extension, then run every
accuracy case against the float64 reference with the kernel the policy chooses and with every
other kernel configuration that can take the call (``kernel_candidates``), and the checks of what
surrounds the kernels (allocated outputs, bound launchers and their guard, autograd in C++,
programmatic dependent launch chains, extreme positions, empty and > 2^31-element calls).

Run on a CUDA machine from the repository root (no install needed):

    python tools/gpu_cuda_check.py               # everything (a few minutes)
    python tools/gpu_cuda_check.py --coverage    # only the pass that reaches every kernel
                                                 # (short enough for compute-sanitizer)
    python tools/gpu_cuda_check.py --choice-only # each case with the policy's choice only
    python tools/gpu_cuda_check.py --prologue-only  # the fused prologue's kernels only
    python tools/gpu_cuda_check.py --prologue-only --prologue-timing  # and their GPU time

Timing is the benchmark's (``python -m rope_ops bench``). Exit status 0 only when the build and
every case pass. tests/test_cuda_host_emulation.py runs the same cases on the CPU through the host
emulation (``Runner`` takes any module with the extension's functions and a device).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import math
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rope_ops._reference import rope_reference  # noqa: E402
from rope_ops.backend import KernelArgs  # noqa: E402
from rope_ops.frequencies import compute_inv_freq, cos_sin_table, freq_turns_of, reduced_angle  # noqa: E402
from rope_ops.testing.checks import assert_rope_close  # noqa: E402

HEAD_AXIS = {"bshd": 2, "sbhd": 2, "bhsd": 1, "thd": 1}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def import_backend():
    """rope_ops_backends.cuda_backend, from a checkout that was not pip-installed too."""
    try:
        import rope_ops_backends  # noqa: F401
    except ModuleNotFoundError:  # backends/ is the package
        spec = importlib.util.spec_from_file_location(
            "rope_ops_backends", ROOT / "backends" / "__init__.py",
            submodule_search_locations=[str(ROOT / "backends")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["rope_ops_backends"] = mod
        spec.loader.exec_module(mod)
    import rope_ops_backends.cuda_backend as cb
    return cb


# ------------------------------------------------------------------------------------------------
# The runner: one module (the extension's functions), one device.


class Runner:
    """Runs cases through ``module`` (run, candidates, run_with, BoundRope) on ``device``."""

    def __init__(self, module, device: str, every_candidate: bool = True):
        self.module = module
        self.device = device
        self.every_candidate = every_candidate
        self.failures: list[str] = []
        self.count = 0
        self.failed_cases = 0
        self.verbose = False
        self.labels_run = collections.Counter()  # candidate label -> cases
        self.choices = collections.Counter()  # the policy's choice -> cases

    def case(self, name, fn):
        self.count += 1
        try:
            problems = fn()
        except Exception as e:  # report and go on
            problems = [f"{name}: raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"]
        if problems:
            self.failed_cases += 1
            self.failures.extend(problems)
            print(f"  FAIL {name}")
            for p in problems[:4]:
                print(f"       {p}")
        elif self.verbose:
            print(f"  ok   {name}")
        elif self.count % 50 == 0:
            print(f"  ... {self.count} cases, {self.failed_cases} failed", flush=True)
        return not problems

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()


def tables(rn: Runner, rotary_dim: int, base: float, rows: int, m: float = 1.0):
    """inv_freq (float64), the float32 cos/sin tables and freq_turns, as rope_ops builds them."""
    inv = compute_inv_freq(rotary_dim, base)[0]
    cos, sin = cos_sin_table(inv, m, rows)
    return inv, cos.to(rn.device), sin.to(rn.device), freq_turns_of(inv).to(rn.device)


def layout_shape(layout, B, S, H, D):
    return {"bshd": (B, S, H, D), "sbhd": (S, B, H, D), "bhsd": (B, H, S, D),
            "thd": (B * S, H, D)}[layout]


def positions(kind, pdtype, layout, B, S, rows, gen, beyond, huge):
    """(pos tensor or None, pos_offset, positions for the reference) for kind in offset | bs | s.
    beyond: ~1/3 of them outside the table (negative, past its end, up to +-2^20); huge: up to
    +-2^40 (the range the fixed-point frequencies keep exact)."""
    if kind == "offset":
        off = rows - S // 2 if beyond else 3
        if huge:
            off = (1 << 40) - 4096
        return None, off, off
    n = (B * S,) if layout == "thd" else ((B, S) if kind == "bs" else (S,))
    numel = math.prod(n)
    p = torch.randint(0, rows, (numel,), generator=gen, dtype=torch.int64)
    if beyond or huge:
        limit = (1 << 40) - 1 if huge else 1 << 20
        sel = torch.rand(numel, generator=gen) < 0.35
        far = torch.randint(-limit, limit, (numel,), generator=gen, dtype=torch.int64)
        p = torch.where(sel, far, p)
        p[0] = rows  # first row past the end
        if numel > 1:
            p[1] = -1
    p = p.view(n).to(pdtype)
    return p, 0, p


def exact_token_cos_sin(ref_pos, layout, B, S, inv, m):
    """Per-token (m*cos, m*sin) [B, S, r/2] from exactly reduced angles: the reference for
    positions where a float64 product p * inv_freq is not exact."""
    if isinstance(ref_pos, int):  # token s has position ref_pos + s (thd: tokens of all sequences)
        p = torch.arange(B * S if layout == "thd" else S, dtype=torch.int64) + ref_pos
        p = p.view(1, B * S) if layout == "thd" else p.expand(B, S)
    else:
        p = ref_pos.to(torch.int64)
        p = p.view(1, B * S) if layout == "thd" else (p.expand(B, S) if p.dim() == 1 else p)
    angles = torch.tensor([[[reduced_angle(int(v), float(f)) for f in inv] for v in row] for row in p],
                          dtype=torch.float64)
    return m * angles.cos(), m * angles.sin()


def token_cos_sin(layout, B, S, half, m, dtype, view, gen):
    """The caller's (m*cos, m*sin) per token, [B, S, half] ([1, B*S, half] for thd) of ``dtype``:
    view "dense"; "odd": rows of an odd pitch, 1 element past an aligned start (misaligned, odd
    strides); "broadcast": one [S, half] row set shared by the batch (stride 0, [1, S, half])."""
    b, s = (1, B * S) if layout == "thd" else (B, S)
    if view == "broadcast":
        b = 1
    angles = (torch.rand(2, b, s, half, generator=gen, dtype=torch.float64) * 2 - 1) * math.pi
    made = []
    for values in (m * angles[0].cos(), m * angles[1].sin()):
        if view == "odd":
            buf = torch.zeros(b, s + 2, half + 3, dtype=dtype)
            t = buf[:, 1:s + 1, 1:half + 1]
            t.copy_(values)
        else:
            t = values.to(dtype)
        made.append(t.expand(B if layout != "thd" else 1, s, half) if view == "broadcast" else t)
    return made[0], made[1]


def mrope_section_of(half: int) -> tuple[int, int, int]:
    """Three uneven counts summing to half (Qwen2-VL's (16, 24, 24) for 64 frequencies)."""
    t = half // 4
    h = (half - t) // 2
    return t, h, half - t - h


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def run_case(rn: Runner, *, dtype, style, layout, D, r, Hq, Hk, B=2, S=37, inplace, inverse,
             pos_kind="bs", pdtype=torch.int64, beyond=True, huge=False, caller_tables=False,
             kind="contig", strided_out=False, m=1.0, base=10000.0, rows=256, expect_generic=False,
             seed=0, source="table", token_dtype=torch.float32, token_view="dense",
             mrope_interleaved=False, one_cache=False):
    """One call checked with the policy's choice (CudaBackend.run) and, unless the runner says
    otherwise, with every candidate configuration (run_with): each within the reference's bound,
    every table-reading configuration bit for bit equal to the choice, inputs (out of place),
    pass-through dims, the rest of packed buffers and the bytes around strided outputs untouched.
    ``one_cache``: cos and sin are the two halves of one [rows, r] cos|sin cache (read in place)."""
    name = (f"{str(dtype)[6:]:8s} {style:4s} {layout} D{D} r{r} q{Hq}k{Hk} B{B}S{S} "
            f"{'inplace' if inplace else 'outplace'}{' inv' if inverse else ''} pos={pos_kind}"
            f"{'' if pos_kind == 'offset' else '/' + str(pdtype)[6:]}"
            f"{' beyond' if beyond else ''}{' huge' if huge else ''}"
            f"{' caller-tables' if caller_tables else ''} {kind}"
            f"{' strided-out' if strided_out else ''}{f' m={m}' if m != 1.0 else ''}"
            f"{' one-cache' if one_cache else ''}")
    if source == "token":  # no positions
        name = name.split(" pos=")[0] + f" {kind} token-cos-sin/{str(token_dtype)[6:]}/{token_view}"
    elif source == "mrope":
        name += f" mrope/{'interleaved' if mrope_interleaved else 'chunked'}"

    def go():
        gen = torch.Generator().manual_seed(seed)
        inv, cos, sin, ft = tables(rn, r, base, rows, m)
        if one_cache:
            cache = torch.cat([cos, sin], dim=-1)
            cos, sin = cache[:, : r // 2], cache[:, r // 2:]
        ax = HEAD_AXIS[layout]
        if kind == "packed":  # q, k, v heads of one buffer
            bases = [torch.randn(layout_shape(layout, B, S, Hq + 2 * Hk, D), generator=gen).to(dtype)]

            def views(bs):
                buf = bs[0]
                return buf.narrow(ax, 0, Hq), (buf.narrow(ax, Hq, Hk) if Hk else None)
        else:
            def make(H):
                shape = layout_shape(layout, B, S, H, D)
                if kind == "lastdim":  # stride 2 on head_dim
                    return torch.randn(*shape[:-1], 2 * D, generator=gen).to(dtype), lambda b: b[..., ::2]
                if kind == "misaligned":  # 2-4 bytes past an aligned address
                    return (torch.randn(math.prod(shape) + 1, generator=gen).to(dtype),
                            lambda b: b[1:].view(shape))
                return torch.randn(shape, generator=gen).to(dtype), lambda b: b
            made = [make(Hq)] + ([make(Hk)] if Hk else [])
            bases = [b for b, _ in made]

            def views(bs):
                return made[0][1](bs[0]), (made[1][1](bs[1]) if Hk else None)
        bases = [b.to(rn.device) for b in bases]
        q_in, k_in = (t.clone() if t is not None else None for t in views(bases))
        pos, off, ref_pos = positions(pos_kind, pdtype, layout, B, S, rows, gen, beyond, huge)
        ref_kw = dict(layout=layout, rotary_dim=r, style=style, inverse=inverse)
        table_cos, table_sin = cos, sin
        angle_kw = {}
        if source == "token":
            pos, off, ref_pos = None, 0, 0
            table_cos, table_sin = token_cos_sin(layout, B, S, r // 2, m, token_dtype, token_view, gen)
            ref_kw["token_cos_sin"] = (table_cos, table_sin)
            angle_kw = dict(angles="token")
        elif source == "mrope":
            pos = ref_pos = torch.stack([positions(pos_kind, pdtype, layout, B, S, rows, gen, beyond,
                                                   False)[0] for _ in range(3)])
            section = mrope_section_of(r // 2)
            ref_kw.update(mrope_section=section, mrope_interleaved=mrope_interleaved)
            angle_kw = dict(angles="mrope", mrope_section=section, mrope_interleaved=mrope_interleaved)
        table_cos, table_sin = table_cos.to(rn.device), table_sin.to(rn.device)
        pos = None if pos is None else pos.to(rn.device)

        if source == "token":
            pass
        elif caller_tables:
            ref_kw["cos_sin"] = (cos, sin)
        elif huge:
            ref_kw["token_cos_sin"] = exact_token_cos_sin(ref_pos, layout, B, S, inv, m)
        else:
            ref_kw.update(inv_freq=inv, attention_factor=m)
        refs = [rope_reference(x, ref_pos, **ref_kw) if x is not None else None for x in (q_in, k_in)]

        def outputs(q, k):
            if inplace:
                return q, k, []
            if strided_out:  # views into buffers of a sentinel value, 8 elements wider
                bufs = [torch.full(list(t.shape[:-1]) + [D + 8], 7.0, dtype=dtype, device=rn.device)
                        for t in (q, k) if t is not None]
                outs = [b[..., :D] for b in bufs]
                return outs[0], (outs[1] if k is not None else None), bufs
            nan = float("nan")
            return (torch.full_like(q, nan), torch.full_like(k, nan) if k is not None else None, [])

        def fresh():
            """New inputs (clones of the same values), outputs and KernelArgs for one run."""
            bs = [b.clone() for b in bases]
            q, k = views(bs)
            q_out, k_out, sentinels = outputs(q, k)
            args = KernelArgs(q=q, k=k, q_out=q_out, k_out=k_out, pos=pos, pos_offset=off,
                              cos=table_cos, sin=table_sin,
                              freq_turns=None if caller_tables or source == "token" else ft,
                              attention_factor=m, layout=layout, rotary_dim=r,
                              interleaved=style == "gptj", inverse=inverse, inplace=inplace,
                              **angle_kw)
            return args, bs, sentinels

        def call(label, same_as=None):
            """Run once (label None: the policy's choice) on fresh inputs; (problems, outputs).
            Outputs are checked against the reference, or, given same_as, for the same bits."""
            args, bs, sentinels = fresh()
            q_out, k_out = args.q_out, args.k_out
            if label is None:
                rn.module.run(args)
            else:
                rn.module.run_with(args, label)
            rn.sync()
            what = f"{name} [{label or 'choice'}]"
            problems = []
            outs = [t for t in (q_out, k_out) if t is not None]
            if same_as is not None and all(torch.equal(bits(a), bits(b)) for a, b in zip(outs, same_as)):
                pass  # the choice's outputs, checked against the reference
            else:
                if same_as is not None:
                    problems.append(f"{what}: differs in bits from the policy's choice")
                for tag, out, ref, x in (("q", q_out, refs[0], q_in), ("k", k_out, refs[1], k_in)):
                    if out is None:
                        continue
                    try:
                        assert_rope_close(out, ref, x, rotary_dim=r, style=style, what=f"{what} {tag}")
                    except AssertionError as e:
                        problems.append(str(e))
            if not inplace:
                for x, x_in in zip(views(bs), (q_in, k_in)):
                    if x is not None and not torch.equal(bits(x), bits(x_in)):
                        problems.append(f"{what}: an out-of-place call modified its input")
            if kind == "packed" and Hk:
                v_now = bs[0].narrow(ax, Hq + Hk, Hk)
                if not torch.equal(bits(v_now), bits(bases[0].narrow(ax, Hq + Hk, Hk))):
                    problems.append(f"{what}: the V part of the packed QKV buffer changed")
            for buf in sentinels:
                if not bool((buf[..., D:] == 7.0).all()):
                    problems.append(f"{what}: wrote outside the strided output view")
            return problems, outs

        problems, chosen = call(None)
        labels = list(rn.module.candidates(fresh()[0]))
        rn.choices[labels[0]] += 1
        if (labels[0] == "generic") != expect_generic:
            problems.append(f"{name}: the policy chose {labels[0]}; expected "
                            f"{'the generic kernel' if expect_generic else '16-byte vectors'}")
        for label in labels if rn.every_candidate else labels[:1]:
            rn.labels_run[label] += 1
            # rows from the table: the same bits whatever the kernel (the same math in each)
            problems += call(label, same_as=None if "fly" in label else chosen)[0]
        return problems

    rn.case(name, go)


# ------------------------------------------------------------------------------------------------
# The cases


def accuracy(rn: Runner):
    """Every dtype, style and layout: full and partial rotary, GQA/MQA, q only, in place, packed
    QKV views, strided outputs, position kinds, positions past the table and up to 2^40, caller
    tables (NaN past them), inverse, the attention factor, and the generic kernel's shapes."""
    print("\n== accuracy against rope_ops._reference (float64), every candidate kernel")
    for dtype in DTYPES:
        for style in ("neox", "gptj"):
            for layout in ("bshd", "sbhd", "bhsd", "thd"):
                pk = "bs" if layout == "thd" else "s"
                # full rotary, GQA, beyond-table int64 positions, out of place
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=128, Hq=4, Hk=2,
                         inplace=False, inverse=False, pos_kind="bs")
                # partial rotary, in place, int32 positions shared by the batch ([S]) or [T]
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=64, Hq=3, Hk=1,
                         inplace=True, inverse=False, pos_kind=pk, pdtype=torch.int32)
                # head_dim 64, MQA, offset positions running past the table, backward; the
                # tables the two halves of one cos|sin cache
                run_case(rn, dtype=dtype, style=style, layout=layout, D=64, r=64, Hq=5, Hk=1,
                         inplace=False, inverse=True, pos_kind="offset", one_cache=True)
                # packed QKV views, in place, partial rotary 96, backward
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=96, Hq=4, Hk=2,
                         inplace=True, inverse=True, kind="packed")
                # packed QKV, out of place into strided outputs, attention factor
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=32, Hq=2, Hk=2,
                         inplace=False, inverse=False, kind="packed", strided_out=True, m=0.75)
                # GPT-J-like: head_dim 256, rotary 64, in and out of place
                for ip in (True, False):
                    run_case(rn, dtype=dtype, style=style, layout=layout, D=256, r=64, Hq=2,
                             Hk=2, inplace=ip, inverse=False)
                # head_dim 80, rotary 32 (Phi-2), q only; head_dim 96 whole
                run_case(rn, dtype=dtype, style=style, layout=layout, D=80, r=32, Hq=3, Hk=0,
                         inplace=False, inverse=False, pos_kind=pk)
                run_case(rn, dtype=dtype, style=style, layout=layout, D=96, r=96, Hq=2, Hk=1,
                         inplace=True, inverse=True, pos_kind="bs")
                # rotary halves (GPT-J: rotary dims) of whole 8-byte vectors only (GPT-NeoX-20B's
                # rotary 24 in bf16): the heads family with 8-byte vectors
                r8 = eight_byte_rotary(dtype, style)
                run_case(rn, dtype=dtype, style=style, layout=layout, D=96, r=r8, Hq=4, Hk=2,
                         inplace=layout in ("sbhd", "thd"), inverse=False, pos_kind=pk)
                # and an odd number of 8-byte pass-through vectors, head rows at 8-byte but not
                # 16-byte boundaries
                run_case(rn, dtype=dtype, style=style, layout=layout,
                         D=96 + 8 // torch.empty((), dtype=dtype).element_size(), r=r8, Hq=3, Hk=2,
                         inplace=False, inverse=True, pos_kind=pk)
                # positions up to +-2^40 (rows from the fixed-point frequencies), [B, S] and offset
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=128, Hq=2, Hk=2,
                         inplace=False, inverse=False, pos_kind="bs", huge=True, m=0.75)
                run_case(rn, dtype=dtype, style=style, layout=layout, D=64, r=32, Hq=2, Hk=1,
                         inplace=True, inverse=True, pos_kind="offset", huge=True)
                # an odd number of pairs per half, no k: the generic kernel (float32 GPT-J pairs
                # are whole 8-byte vectors: the heads family)
                run_case(rn, dtype=dtype, style=style, layout=layout, D=80, r=34, Hq=3, Hk=0,
                         inplace=False, inverse=False, expect_generic=not fp32_gptj(dtype, style))
                # generic kernel: stride 2 on head_dim, in place
                run_case(rn, dtype=dtype, style=style, layout=layout, D=64, r=48, Hq=2, Hk=2,
                         inplace=True, inverse=True, kind="lastdim", expect_generic=True)
                # generic kernel: misaligned base pointer
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=128, Hq=2, Hk=1,
                         inplace=False, inverse=False, kind="misaligned", expect_generic=True)
                # caller tables: out-of-table positions give NaN rows
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=128, Hq=2, Hk=2,
                         inplace=False, inverse=False, caller_tables=True)
    # small odd shapes: one token, one head, tiny head_dim
    run_case(rn, dtype=torch.bfloat16, style="neox", layout="thd", D=128, r=128, Hq=32, Hk=8,
             B=1, S=1, inplace=True, inverse=False)
    run_case(rn, dtype=torch.float32, style="neox", layout="bshd", D=2, r=2, Hq=1, Hk=1,
             inplace=False, inverse=False, expect_generic=True)
    run_case(rn, dtype=torch.float16, style="gptj", layout="bshd", D=8, r=8, Hq=1, Hk=0,
             inplace=True, inverse=False)
    # a big table, many tokens: more than one wave of threads (not decode-sized)
    run_case(rn, dtype=torch.bfloat16, style="neox", layout="bshd", D=128, r=128, Hq=8, Hk=2,
             B=3, S=700, inplace=False, inverse=False, rows=131072, base=500000.0)


def angle_source_accuracy(rn: Runner):
    """The caller's cos/sin per token and mRoPE (the heads family and the generic kernel take
    them): every dtype, style and layout; float32, float16 and bfloat16 per-token tables, dense,
    of odd strides and misaligned, or shared by the batch; mRoPE chunked and interleaved, int32 and
    int64 positions past the table (on the fly) or caller tables (NaN past them); GQA/MQA, q only,
    partial rotary, in place, packed QKV, inverse, and the generic kernel's shapes."""
    print("\n== per-token cos/sin and mRoPE against rope_ops._reference, every candidate kernel")
    views = ("dense", "odd", "broadcast")
    for dtype in DTYPES:
        for style in ("neox", "gptj"):
            for li, layout in enumerate(("bshd", "sbhd", "bhsd", "thd")):
                pk = "bs" if layout == "thd" else "s"
                token_dtype = DTYPES[li % 3]
                # full rotary, GQA, out of place
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=128, Hq=4, Hk=2,
                         inplace=False, inverse=False, source="token", token_dtype=token_dtype,
                         token_view=views[li % 3])
                # partial rotary, in place, backward, half-precision tables of odd strides
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=64, Hq=3, Hk=1,
                         inplace=True, inverse=True, source="token", token_view="odd",
                         token_dtype=torch.bfloat16 if li % 2 else torch.float16)
                # packed QKV into strided outputs, q only over an odd rotary half: generic kernel
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=32, Hq=2, Hk=2,
                         inplace=False, inverse=False, kind="packed", strided_out=True,
                         source="token", token_dtype=torch.float16, token_view=views[(li + 1) % 3])
                run_case(rn, dtype=dtype, style=style, layout=layout, D=80, r=34, Hq=3, Hk=0,
                         inplace=False, inverse=True, source="token", token_view="odd",
                         token_dtype=token_dtype, expect_generic=True)
                # mRoPE chunked: int64 [3, B, S] positions past the table, GQA, out of place
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=128, Hq=4, Hk=2,
                         inplace=False, inverse=False, pos_kind="bs", source="mrope", m=0.75)
                # mRoPE chunked, sections (12, 18, 18): chunks of frequencies inside one section
                # read table vectors, chunks across a boundary one value at a time; the tables
                # the two halves of one cos|sin cache
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=96, Hq=3, Hk=2,
                         inplace=False, inverse=True, pos_kind="bs", source="mrope", one_cache=True)
                # mRoPE interleaved: int32 [3, S] / [3, T], partial rotary, in place, backward
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=64, Hq=5, Hk=1,
                         inplace=True, inverse=True, pos_kind=pk, pdtype=torch.int32,
                         source="mrope", mrope_interleaved=True)
                # mRoPE with caller tables (NaN past them), packed QKV, interleaved
                run_case(rn, dtype=dtype, style=style, layout=layout, D=128, r=96, Hq=4, Hk=2,
                         inplace=True, inverse=False, kind="packed", caller_tables=True,
                         source="mrope", mrope_interleaved=True)
                # mRoPE on the generic kernel: stride 2 on head_dim; 8-byte rotary halves
                run_case(rn, dtype=dtype, style=style, layout=layout, D=64, r=48, Hq=2, Hk=2,
                         inplace=True, inverse=True, kind="lastdim", source="mrope",
                         expect_generic=True)
                run_case(rn, dtype=dtype, style=style, layout=layout, D=96,
                         r=eight_byte_rotary(dtype, style), Hq=4, Hk=2, inplace=False,
                         inverse=False, pos_kind=pk, source="mrope", expect_generic=True)
    # one token; many tokens over more than one wave of threads
    run_case(rn, dtype=torch.bfloat16, style="neox", layout="thd", D=128, r=128, Hq=32, Hk=8,
             B=1, S=1, inplace=True, inverse=False, source="token", token_dtype=torch.bfloat16)
    run_case(rn, dtype=torch.bfloat16, style="neox", layout="thd", D=128, r=128, Hq=32, Hk=8,
             B=1, S=1, inplace=False, inverse=False, source="mrope", pos_kind="bs")
    run_case(rn, dtype=torch.bfloat16, style="neox", layout="bshd", D=128, r=128, Hq=8, Hk=2,
             B=3, S=300, inplace=False, inverse=False, source="token", token_view="odd",
             token_dtype=torch.bfloat16)
    run_case(rn, dtype=torch.float16, style="gptj", layout="bshd", D=128, r=128, Hq=8, Hk=2,
             B=3, S=300, inplace=False, inverse=False, source="mrope", pos_kind="bs",
             rows=131072, base=500000.0, mrope_interleaved=True)


def fp32_gptj(dtype, style) -> bool:
    """float32 GPT-J pairs fill 8-byte vectors whatever rotary_dim is."""
    return dtype == torch.float32 and style == "gptj"


def eight_byte_rotary(dtype, style) -> int:
    """A rotary_dim whose halves (GPT-J: whole rotary dims) are whole 8-byte vectors but not
    16-byte ones."""
    if torch.empty((), dtype=dtype).element_size() == 2:
        return 24 if style == "neox" else 20
    return 20 if style == "neox" else 10


# Heads per call that reach every instantiation of the flat and lean kernels (their vectors per
# thread), for 8-element vectors (bf16/fp16) and 4-element ones (fp32) with head_dim 128.
COVERAGE_HEADS = {2: ((4, 4), (12, 4), (24, 8), (40, 8), (48, 16)),
                  4: ((2, 2), (6, 2), (12, 4), (20, 4), (24, 8))}


def coverage(rn: Runner):
    """Calls whose candidates reach every kernel instantiation: each vectors-per-thread count of
    the flat (separate, joint, split) and lean kernels, every heads schedule with 16- and 8-byte
    vectors, the rows kernel (in place, partial rotary) and the generic kernel, for every dtype
    and style, with position tables, per-token cos/sin and mRoPE. Few tokens each, so this pass
    is short enough for compute-sanitizer (--coverage)."""
    print("\n== coverage: every kernel instantiation")
    for dtype in DTYPES:
        size = torch.empty((), dtype=dtype).element_size()
        for style in ("neox", "gptj"):
            for i, (hq, hk) in enumerate(COVERAGE_HEADS[size]):
                run_case(rn, dtype=dtype, style=style, layout="thd", D=128, r=128, Hq=hq, Hk=hk,
                         B=1, S=3, inplace=False, inverse=i % 2 == 1, pos_kind="bs", seed=40 + i)
            run_case(rn, dtype=dtype, style=style, layout="bshd", D=128, r=64, Hq=3, Hk=1, B=2,
                     S=5, inplace=True, inverse=False, pos_kind="s", seed=46)
            run_case(rn, dtype=dtype, style=style, layout="bshd", D=96, r=eight_byte_rotary(dtype, style),
                     Hq=5, Hk=3, B=1, S=3, inplace=False, inverse=True, pos_kind="s", seed=48)
            run_case(rn, dtype=dtype, style=style, layout="bshd", D=40, r=18, Hq=2, Hk=1, B=1,
                     S=3, inplace=False, inverse=False, expect_generic=not fp32_gptj(dtype, style),
                     seed=47)
            run_case(rn, dtype=dtype, style=style, layout="bshd", D=64, r=64, Hq=2, Hk=1, B=1,
                     S=3, inplace=True, inverse=False, kind="lastdim", expect_generic=True, seed=49)
            # tables read in place as the two halves of one cos|sin cache (row stride r)
            run_case(rn, dtype=dtype, style=style, layout="thd", D=128, r=128, Hq=6, Hk=2, B=1,
                     S=3, inplace=False, inverse=False, pos_kind="bs", one_cache=True, seed=52)
            # the other angle sources: every heads schedule (candidates) and the generic kernel
            for source in ("token", "mrope"):
                run_case(rn, dtype=dtype, style=style, layout="thd", D=128, r=128, Hq=6, Hk=2,
                         B=1, S=3, inplace=False, inverse=True, pos_kind="bs", source=source,
                         token_dtype=torch.float16, token_view="odd", seed=50)
                run_case(rn, dtype=dtype, style=style, layout="bshd", D=40, r=18, Hq=2, Hk=1,
                         B=2, S=3, inplace=True, inverse=False, pos_kind="bs", source=source,
                         mrope_interleaved=True, expect_generic=True, seed=51)


# ------------------------------------------------------------------------------------------------
# Around the kernels


def alloc_outputs(rn: Runner):
    """run() with q_out = k_out = None (out of place) returns new outputs, bit for bit those of a
    call into given outputs, with empty_like's strides, 16-byte aligned, not overlapping (small
    calls share one allocation, large ones do not); BoundRope forward and inverse equal run(),
    and its guard runs only calls with the guarded metadata."""
    name = "run() allocating its outputs; BoundRope and its guard"

    def go():
        problems = []
        inv, cos, sin, ft = tables(rn, 128, 500000.0, 256)
        gen = torch.Generator().manual_seed(11)
        q = torch.randn(2, 37, 6, 128, generator=gen).to(torch.bfloat16).to(rn.device)
        k = torch.randn(2, 37, 2, 128, generator=gen).to(torch.bfloat16).to(rn.device)
        pos = torch.randint(0, 300, (2, 37), generator=gen).to(rn.device)

        def call(q, k, pos, qo, ko, inverse=False):
            return KernelArgs(q=q, k=k, q_out=qo, k_out=ko, pos=pos, pos_offset=0, cos=cos, sin=sin,
                              freq_turns=ft, attention_factor=1.0, layout="bshd", rotary_dim=128,
                              interleaved=False, inverse=inverse, inplace=False)

        for kk in (k, None):
            qo = torch.empty_like(q)
            ko = torch.empty_like(kk) if kk is not None else None
            if rn.module.run(call(q, kk, pos, qo, ko)) is not None:
                problems.append(f"{name}: run() with given outputs returned something")
            made = rn.module.run(call(q, kk, pos, None, None))
            rn.sync()
            if not isinstance(made, tuple) or len(made) != 2:
                problems.append(f"{name}: run() with q_out None returned {type(made).__name__}")
                continue
            if not torch.equal(made[0], qo):
                problems.append(f"{name}: allocated q_out differs")
            if (kk is None) != (made[1] is None) or (kk is not None and not torch.equal(made[1], ko)):
                problems.append(f"{name}: allocated k_out differs")
            problems += output_layout_problems(name, made, qo, ko)
            for inverse in (False, True):
                bound = rn.module.BoundRope(cos, sin, ft, 1.0, "bshd", 128, False, inverse)
                want_q = torch.empty_like(q)
                want_k = torch.empty_like(kk) if kk is not None else None
                rn.module.run(call(q, kk, pos, want_q, want_k, inverse))
                got = bound(q, kk, pos, 0)
                rn.sync()
                if not torch.equal(got[0], want_q) or (kk is None) != (got[1] is None) or (
                        kk is not None and not torch.equal(got[1], want_k)):
                    problems.append(f"{name}: BoundRope differs (inverse={inverse})")
                problems += guard_problems(f"{name} (inverse={inverse})", bound, q, kk, pos, got)
        # packed QKV views (non-dense inputs: dense outputs in the same dimension order), and a
        # call too large for one shared allocation
        for label, (B, S, H) in (("packed", (2, 37, 10)), ("large", (2, 4096, 40))):
            qkv = torch.randn(B, S, H, 128, generator=gen).to(torch.bfloat16).to(rn.device)
            q_, k_ = qkv[:, :, :H - 4], qkv[:, :, H - 4:H - 2]
            pos_ = torch.randint(0, 256, (B, S), generator=gen).to(rn.device)
            qo, ko = torch.empty_like(q_), torch.empty_like(k_)
            rn.module.run(call(q_, k_, pos_, qo, ko))
            made = rn.module.run(call(q_, k_, pos_, None, None))
            rn.sync()
            if not (torch.equal(made[0], qo) and torch.equal(made[1], ko)):
                problems.append(f"{name}: {label}: allocated outputs differ")
            problems += output_layout_problems(f"{name}: {label}", made, qo, ko)
            shared = made[0].untyped_storage().data_ptr() == made[1].untyped_storage().data_ptr()
            if label == "large" and shared:
                problems.append(f"{name}: large call's outputs share one allocation")
        return problems

    rn.case(name, go)


def output_layout_problems(name, made, qo, ko):
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


def guard_problems(name, bound, q, k, pos, want) -> list[str]:
    """BoundRope.guarded runs the guarded call's metadata like the launcher, and returns None for
    every change the plan key would see."""
    problems = []
    guard = bound.guarded(q, k, pos)
    got = guard(q, k, pos)
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


def autograd_in_cpp(rn: Runner):
    """BoundRope.with_grad (the plans of calls that need a gradient): outputs as the bound call,
    gradients = the rotation of the output gradients the other way (against the reference), also
    when only one output is used, when k is absent, twice differentiable (create_graph), and
    positions changed in place before the backward raise."""
    name = "BoundRope.with_grad: autograd in C++"

    def go():
        problems = []
        inv, cos, sin, ft = tables(rn, 64, 10000.0, 64)
        gen = torch.Generator().manual_seed(12)
        pos = torch.randint(-10, 200, (2, 9), generator=gen).to(rn.device)  # past the table too
        for dtype in (torch.float32, torch.bfloat16):
            fwd = rn.module.BoundRope(cos, sin, ft, 1.0, "bshd", 64, True, False)
            for with_k in (True, False):
                q = torch.randn(2, 9, 3, 80, generator=gen).to(dtype).to(rn.device).requires_grad_()
                k = torch.randn(2, 9, 1, 80, generator=gen).to(dtype).to(rn.device).requires_grad_() if with_k else None
                q_out, k_out = fwd.with_grad(q, k, pos, 0)
                want = fwd(q.detach(), None if k is None else k.detach(), pos, 0)
                if not torch.equal(q_out, want[0]) or (with_k and not torch.equal(k_out, want[1])):
                    problems.append(f"{name}: forward differs from the bound call ({dtype}, k={with_k})")
                if (k_out is None) == with_k:
                    problems.append(f"{name}: k_out {'missing' if with_k else 'returned without k'}")
                gq = torch.randn_like(q_out)
                gk = torch.randn_like(k_out) if with_k else None
                outs, grads = (q_out, k_out) if with_k else (q_out,), (gq, gk) if with_k else (gq,)
                torch.autograd.backward(outs, grads)
                for label, x, g in (("q", q, gq), ("k", k, gk)):
                    if x is None:
                        continue
                    ref = rope_reference(g, pos, layout="bshd", rotary_dim=64, style="gptj",
                                         inv_freq=inv, inverse=True)
                    try:
                        assert_rope_close(x.grad, ref, g, rotary_dim=64, style="gptj", what=f"{name} grad {label}")
                    except AssertionError as e:
                        problems.append(str(e))
            # only q_out used: k's gradient stays None... k.grad of an unused output is zero-free
            q = torch.randn(2, 9, 3, 80, generator=gen).to(rn.device).requires_grad_()
            k = torch.randn(2, 9, 1, 80, generator=gen).to(rn.device).requires_grad_()
            q_out, _ = fwd.with_grad(q, k, pos, 0)
            q_out.sum().backward()
            if k.grad is not None or q.grad is None:
                problems.append(f"{name}: an unused output's input got a gradient, or the used one none")
            # second derivative: d/dg <grad(q_out . g), h> is the forward rotation of h (linear)
            q = torch.randn(2, 9, 3, 80, generator=gen, dtype=torch.float32).to(rn.device).requires_grad_()
            g = torch.randn(2, 9, 3, 80, generator=gen).to(rn.device).requires_grad_()
            q_out, _ = fwd.with_grad(q, None, pos, 0)
            (dq,) = torch.autograd.grad(q_out, q, g, create_graph=True)
            h = torch.randn_like(dq)
            (dg,) = torch.autograd.grad(dq, g, h)
            ref = rope_reference(h, pos, layout="bshd", rotary_dim=64, style="gptj", inv_freq=inv)
            try:
                assert_rope_close(dg, ref, h, rotary_dim=64, style="gptj", what=f"{name} second derivative")
            except AssertionError as e:
                problems.append(str(e))
            # positions changed in place before the backward
            q = torch.randn(2, 9, 3, 80, generator=gen).to(rn.device).requires_grad_()
            p2 = pos.clone()
            q_out, _ = fwd.with_grad(q, None, p2, 0)
            p2.add_(1)
            try:
                q_out.sum().backward()
                problems.append(f"{name}: positions modified in place before the backward went unnoticed")
            except RuntimeError as e:
                if "modified by an inplace operation" not in str(e):
                    problems.append(f"{name}: unexpected error for modified positions: {e}")
        # an int offset instead of positions
        fwd = rn.module.BoundRope(cos, sin, ft, 1.0, "thd", 64, False, False)
        q = torch.randn(5, 2, 64, generator=gen).to(rn.device).requires_grad_()
        q_out, _ = fwd.with_grad(q, None, None, 7)
        g = torch.randn_like(q_out)
        q_out.backward(g)
        ref = rope_reference(g, 7, layout="thd", rotary_dim=64, style="neox", inv_freq=inv, inverse=True)
        try:
            assert_rope_close(q.grad, ref, g, rotary_dim=64, style="neox", what=f"{name} offset grad")
        except AssertionError as e:
            problems.append(str(e))
        return problems

    rn.case(name, go)


def garbage_positions(rn: Runner):
    """Extreme int64 positions (+-2^62, int64 min/max, 10^18): no fault, finite, pair norms kept
    (no accuracy is promised past 2^40); caller tables give NaN rows."""
    name = "garbage int64 positions (+-2^62, int64 min/max, 10^18), bf16 + fp32"

    def go():
        problems = []
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(5)
            inv, cos, sin, ft = tables(rn, 128, 500000.0, 64)
            vals = [2**41, -(2**41), 2**62, -(2**62), 2**63 - 1, -(2**63), 10**18, -7]
            pos = torch.tensor(vals, dtype=torch.int64, device=rn.device)
            q = torch.randn(len(vals), 4, 128, generator=gen).to(dtype).to(rn.device)
            out = torch.empty_like(q)
            for tables_given in (False, True):
                rn.module.run(KernelArgs(q=q, k=None, q_out=out, k_out=None, pos=pos, pos_offset=0,
                                         cos=cos, sin=sin, freq_turns=None if tables_given else ft,
                                         attention_factor=1.0, layout="thd", rotary_dim=128,
                                         interleaved=False, inverse=False, inplace=False))
                rn.sync()
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

    rn.case(name, go)


def zero_tokens(rn: Runner):
    name = "zero tokens (bshd S=0, thd T=0)"

    def go():
        inv, cos, sin, ft = tables(rn, 64, 10000.0, 16)
        for shape, layout in (((2, 0, 4, 64), "bshd"), ((0, 4, 64), "thd")):
            q = torch.empty(shape, dtype=torch.bfloat16, device=rn.device)
            rn.module.run(KernelArgs(q=q, k=q, q_out=torch.empty_like(q), k_out=torch.empty_like(q),
                                     pos=None, pos_offset=0, cos=cos, sin=sin, freq_turns=ft,
                                     attention_factor=1.0, layout=layout, rotary_dim=64,
                                     interleaved=False, inverse=False, inplace=False))
        rn.sync()
        return []

    rn.case(name, go)


def large_tensor(rn: Runner):
    """> 2^31 elements in place (64-bit indexing): the last tokens against the reference."""
    name = "large tensor: bf16 thd [2^21+5, 8, 128] (2.1e9 elements) in place, last tokens"

    def go():
        T = (1 << 21) + 5
        free, _ = torch.cuda.mem_get_info()
        if free < T * 8 * 128 * 2 * 1.3:
            print(f"  skip {name}: {free / 2**30:.1f} GiB free")
            return []
        inv, cos, sin, ft = tables(rn, 128, 500000.0, 4096)
        q = torch.empty(T, 8, 128, dtype=torch.bfloat16, device=rn.device)
        tail = 7
        gen = torch.Generator().manual_seed(9)
        q[-tail:] = torch.randn(tail, 8, 128, generator=gen).to(torch.bfloat16).to(rn.device)
        q[:-tail].zero_()
        x = q[-tail:].clone()
        rn.module.run(KernelArgs(q=q, k=None, q_out=q, k_out=None, pos=None, pos_offset=0,
                                 cos=cos, sin=sin, freq_turns=ft, attention_factor=1.0,
                                 layout="thd", rotary_dim=128, interleaved=False, inverse=False,
                                 inplace=True))
        rn.sync()
        ref = rope_reference(x, T - tail, layout="thd", rotary_dim=128, style="neox", inv_freq=inv)
        out = q[-tail:].clone()
        del q
        torch.cuda.empty_cache()
        try:
            assert_rope_close(out, ref, x, rotary_dim=128, style="neox", what=name)
        except AssertionError as e:
            return [str(e)]
        return []

    rn.case(name, go)


def pdl_chain(rn: Runner):
    """Back-to-back dependent calls (each reads the previous call's output) with the policy's
    choice (programmatic dependent launch on sm_90) and the same kernels without it, eager and in
    a CUDA graph: bit for bit equal. A kernel that touched memory before griddepcontrol.wait
    would read stale inputs here. Decode-sized (flat kernel) and prefill-sized (lean, heads)."""
    name = "PDL: 24 dependent back-to-back calls, with == without, eager and CUDA graph"

    def go():
        problems = []
        inv, cos, sin, ft = tables(rn, 128, 500000.0, 8192)
        gen = torch.Generator().manual_seed(13)
        for tokens, hq, hk in ((64, 32, 8), (8192, 32, 32), (8192, 32, 8)):
            x0 = torch.randn(tokens, hq, 128, generator=gen).to(torch.bfloat16).to(rn.device)
            k0 = torch.randn(tokens, hk, 128, generator=gen).to(torch.bfloat16).to(rn.device)
            pos = torch.randint(0, 8192, (tokens,), generator=gen).to(rn.device)
            n = 24
            bufs = [(torch.empty_like(x0), torch.empty_like(k0)) for _ in range(n)]

            def args_of(q, k, qo, ko, i):
                return KernelArgs(q=q, k=k, q_out=qo, k_out=ko, pos=pos, pos_offset=0, cos=cos,
                                  sin=sin, freq_turns=ft, attention_factor=1.0, layout="thd",
                                  rotary_dim=128, interleaved=False, inverse=i % 3 == 2,
                                  inplace=False)

            choice = rn.module.candidates(args_of(x0, k0, None, None, 0))[0]
            without = choice + "+nopdl" if "nopdl" not in choice else choice

            def chain(label):
                q, k = x0, k0
                for i, (qo, ko) in enumerate(bufs):
                    rn.module.run_with(args_of(q, k, qo, ko, i), label)
                    q, k = qo, ko
                return q, k

            results = {}
            for label in (without, choice):
                for b in bufs:
                    b[0].fill_(float("nan"))
                    b[1].fill_(float("nan"))
                results[("eager", label)] = [t.clone() for t in chain(label)]
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    chain(label)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = chain(label)
                for b in bufs:
                    b[0].fill_(float("nan"))
                    b[1].fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                results[("graph", label)] = [t.clone() for t in out]
                del g
            ref = results[("eager", without)]
            if not all(torch.isfinite(t).all() for t in ref):
                problems.append(f"{name}: non-finite results without PDL ({choice})")
            for key, got in results.items():
                if not all(torch.equal(a, b) for a, b in zip(got, ref)):
                    problems.append(f"{name}: {key} differs from eager without PDL ({tokens} tokens)")
        return problems

    rn.case(name, go)


# ------------------------------------------------------------------------------------------------
# The fused prologue (rope_ops.qkv_prologue): module.prologue / module.prologue_backward, each
# case against the float64 reference (prologue_reference) and against rope_ops' float32 torch ops
# (prologue_forward_torch: the same math, so within one rounding), caches and slots included.


def _fp8():
    return getattr(torch, "float8_e4m3fn", None)


def prologue_call(rn: Runner, gen, *, dtype, style, thd, D, r, Hq, Hk, T=13, B=2, S=7, extra=0,
                  q_norm=True, k_norm=True, offset=0.0, rotate=True, pos_kind="i64", inplace=False,
                  cache=None, slot_values=None, weight_dtype=torch.float32, table_rows=64, q_scale=0.0):
    """(PrologueArgs with outputs allocated, inv_freq, the reference's positions). cache: None,
    "same" or "fp8"; slot_values: the slots to write (any int values) or None (a random
    permutation with -1 for every fourth token); q_scale > 0: q_out float8 (q / q_scale)."""
    from rope_ops.backend import PrologueArgs

    lead = (T,) if thd else (B, S)
    width = (Hq + 2 * Hk) * D
    buf = torch.randn(*lead, width + extra, generator=gen).to(dtype).to(rn.device)
    qkv = buf[..., :width]
    if not rotate:
        r = D
    inv = None
    if rotate:
        inv, cos, sin, turns = tables(rn, r, 10000.0, table_rows)
    else:
        cos = sin = torch.empty(0, 1, device=rn.device)
        turns = None
    pos, pos_offset, ref_pos = None, 0, None
    if rotate:
        if pos_kind == "offset":
            pos_offset = table_rows - 3  # the last tokens past the table
            ref_pos = pos_offset
        else:
            p = torch.randint(0, table_rows, lead, generator=gen, dtype=torch.int64)
            flat = p.view(-1)
            flat[0] = table_rows  # past the table: computed from freq_turns
            flat[-1] = -3
            if flat.numel() > 2:
                flat[1] = 40000
            pos = p.to(torch.int32 if pos_kind == "i32" else torch.int64).to(rn.device)
            ref_pos = p
    weights = []
    for on in (q_norm, k_norm):
        w = None
        if on:
            w = (torch.randn(D, generator=gen) * 0.5 + (0.0 if offset else 1.0)).to(weight_dtype).to(rn.device)
        weights.append(w)
    outs = (None, None, None)
    if not inplace:
        outs = tuple(torch.empty(*lead, h, D, dtype=dt, device=rn.device)
                     for h, dt in ((Hq, _fp8() if q_scale else dtype), (Hk, dtype), (Hk, dtype)))
    k_cache = v_cache = slots = None
    k_scale = v_scale = 1.0
    if cache is not None:
        n_slots = 2 * math.prod(lead) + 3
        cache_dtype = _fp8() if cache == "fp8" else dtype
        # views of the first n_slots rows of larger buffers: the rows after them must stay as they
        # are (nothing written out of bounds, whatever the slot values)
        k_cache = torch.randn(n_slots + 2, Hk, D, generator=gen).to(cache_dtype).to(rn.device)[:n_slots]
        v_cache = torch.randn(n_slots + 2, Hk, D, generator=gen).to(cache_dtype).to(rn.device)[:n_slots]
        if slot_values is None:
            sl = torch.randperm(n_slots, generator=gen)[: math.prod(lead)]
            sl[:: 4] = -1
            slot_values = sl.view(lead)
        slots = slot_values.to(rn.device)
        if cache == "fp8":
            k_scale, v_scale = 0.5, 2.0
    args = PrologueArgs(qkv, *outs, pos, pos_offset, cos, sin, turns, 1.0, "thd" if thd else "bshd",
                        Hq, Hk, D, r, style == "gptj", rotate, weights[0], weights[1], 1e-6, offset,
                        inplace, k_cache, v_cache, slots, k_scale, v_scale, q_scale=q_scale)
    return args, inv, ref_pos


def _clone_storage(t):
    """A copy of t over a copy of its whole storage (same strides, offset and surroundings)."""
    if t is None:
        return None
    n = t.untyped_storage().nbytes() // t.element_size()
    base = t.as_strided((n,), (1,), 0).clone()
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


def _storage_bytes(t):
    n = t.untyped_storage().nbytes() // t.element_size()
    return t.as_strided((n,), (1,), 0).cpu().view(torch.uint8)


def _copy_args(args):
    """args over copies of everything the forward writes (qkv, outputs, caches), each with its
    strides and storage offset (alignment)."""
    cp = _clone_storage
    qkv = _clone_storage(args.qkv) if args.inplace else args.qkv
    return args._replace(qkv=qkv, q_out=cp(args.q_out), k_out=cp(args.k_out), v_out=cp(args.v_out),
                         k_cache=_clone_storage(args.k_cache), v_cache=_clone_storage(args.v_cache))


def _views(args):
    """(q, k, v) views of the forward's results."""
    if args.inplace:
        heads = args.qkv.unflatten(-1, (args.num_q_heads + 2 * args.num_kv_heads, args.head_dim))
        hq, hk = args.num_q_heads, args.num_kv_heads
        return heads[..., :hq, :], heads[..., hq:hq + hk, :], heads[..., hq + hk:, :]
    return args.q_out, args.k_out, args.v_out


def _close(name, got, want, dtype, fp8_step=2.0 ** -3) -> list[str]:
    """got within one rounding of `dtype` (plus float32 noise) of want; NaN where want is NaN.
    float8: within fp8_step of |want| (an e4m3 ulp is 2^-3 of it; 2^-4 is half of one) plus the
    subnormal step 2^-9."""
    from rope_ops.testing.tolerances import ulp

    g = got.detach().to("cpu", torch.float64)
    w = want.detach().to("cpu", torch.float64)
    if not torch.equal(torch.isnan(g), torch.isnan(w)):
        return [f"{name}: NaN in different places"]
    g, w = g.nan_to_num(0.0), w.nan_to_num(0.0)
    if dtype == _fp8():  # e4m3: 3 mantissa bits, subnormal step 2^-9
        bound = w.abs() * fp8_step + 2.0 ** -9
    else:
        bound = 2 * ulp(w, dtype) + 2e-5 * (1.0 + w.abs())
    bad = (g - w).abs() > bound
    if bad.any():
        i = bad.nonzero()[0].tolist()
        return [f"{name}: {int(bad.sum())} of {bad.numel()} elements differ, e.g. at {i}: "
                f"{g[tuple(i)].item()} vs {w[tuple(i)].item()}"]
    return []


def prologue_forward_problems(rn: Runner, name, args, inv, ref_pos) -> list[str]:
    """The kernel's forward against the float64 reference and rope_ops' torch ops."""
    from rope_ops._reference import prologue_reference
    from rope_ops.backend import prologue_forward_torch

    got_args, want_args = _copy_args(args), _copy_args(args)
    before = got_args.qkv.clone()
    if not rn.module.prologue(got_args):
        return [f"{name}: the kernels did not take the call"]
    rn.sync()
    prologue_forward_torch(want_args)
    problems = []
    got, want = _views(got_args), _views(want_args)
    dtype = args.qkv.dtype
    for part, g, w in zip("qkv", got, want):
        if part == "v":
            if not torch.equal(bits(g.cpu()), bits(w.cpu())):
                problems.append(f"{name}: v differs from the input")
        elif part == "q" and args.q_scale > 0:
            problems += _close(f"{name} float8 q", g.float(), w.float(), _fp8())
        else:
            problems += _close(f"{name} {part}", g, w, dtype)
    if not args.inplace and not torch.equal(bits(got_args.qkv.cpu()), bits(before.cpu())):
        problems.append(f"{name}: qkv changed by an out-of-place call")
    if args.inplace:  # the storage beyond the q and k rows (v, row padding) untouched
        q = got_args.qkv
        n = q.untyped_storage().nbytes() // q.element_size()
        index = torch.arange(n).as_strided(q.shape, q.stride(), q.storage_offset())
        written = torch.zeros(n, dtype=torch.bool)
        written[index[..., :(args.num_q_heads + args.num_kv_heads) * args.head_dim].reshape(-1)] = True
        after = q.as_strided((n,), (1,), 0).cpu()
        start = args.qkv.as_strided((n,), (1,), 0).cpu()  # args ran on copies: the input
        if not torch.equal(bits(after[~written]), bits(start[~written])):
            problems.append(f"{name}: in place wrote outside the q and k rows")
    if args.k_cache is not None:
        cache_dtype = args.k_cache.dtype
        for label, g, w in (("k_cache", got_args.k_cache, want_args.k_cache),
                            ("v_cache", got_args.v_cache, want_args.v_cache)):
            problems += _close(f"{name} {label}", g.float(), w.float(), cache_dtype)
            outside = g.numel() * g.element_size()  # the buffer's rows after the cache's view
            if not torch.equal(_storage_bytes(g)[outside:], _storage_bytes(args.k_cache if label == "k_cache"
                                                                            else args.v_cache)[outside:]):
                problems.append(f"{name}: {label} written outside its slots")
            if cache_dtype != _fp8() and label == "v_cache" and not torch.equal(bits(g.cpu()), bits(w.cpu())):
                problems.append(f"{name}: v_cache differs from v")
    # float64 reference of the q and k outputs (positions within +-2^16: a float64 product is exact
    # enough)
    if args.rotate and ref_pos is not None and not isinstance(ref_pos, int):
        ref_pos = ref_pos.cpu()
    ref = prologue_reference(before if args.inplace else args.qkv, ref_pos, num_q_heads=args.num_q_heads,
                             num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                             q_weight=args.q_weight, k_weight=args.k_weight, eps=args.eps,
                             weight_offset=args.weight_offset, rotate=args.rotate,
                             rotary_dim=args.rotary_dim, style="gptj" if args.interleaved else "neox",
                             inv_freq=inv)
    normalised = prologue_reference(before if args.inplace else args.qkv, None,
                                    num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                                    head_dim=args.head_dim, q_weight=args.q_weight,
                                    k_weight=args.k_weight, eps=args.eps,
                                    weight_offset=args.weight_offset, rotate=False,
                                    rotary_dim=args.rotary_dim, style="neox")
    for part, g, rf, x in zip("qk", got[:2], ref[:2], normalised[:2]):
        if part == "q" and args.q_scale > 0:
            problems += _fp8_q_reference_problems(name, g, rf, args.q_scale)
            continue
        try:
            assert_rope_close(g, rf, x, rotary_dim=args.rotary_dim if args.rotate else 0,
                              style="gptj" if args.interleaved else "neox", what=f"{name} {part}",
                              passthrough_exact=False)
        except AssertionError as e:
            problems.append(str(e)[:300])
    return problems


def _fp8_q_reference_problems(name, got, ref, q_scale) -> list[str]:
    """A float8 q against the float64 reference: ref / q_scale saturated at +-448, within half an
    e4m3 ulp (3 mantissa bits; subnormal step 2^-9) plus the float32 math before the rounding."""
    if got.dtype != _fp8():
        return [f"{name}: q is {got.dtype}, not float8_e4m3fn"]
    want = (ref.detach().to("cpu", torch.float64) / q_scale).clamp(-448.0, 448.0)
    return _close(f"{name} float8 q against the reference", got, want, _fp8(), fp8_step=2.0 ** -4 + 1e-5)


def prologue_backward_problems(rn: Runner, name, args, inv, ref_pos, which=(True, True, True)) -> list[str]:
    """The kernel's backward against float64 autograd of the reference; its weight gradients
    the same bits twice (deterministic)."""
    from rope_ops._reference import prologue_reference

    gen = torch.Generator().manual_seed(7)
    shapes = [args.qkv.shape[:-1] + (h, args.head_dim)
              for h in (args.num_q_heads, args.num_kv_heads, args.num_kv_heads)]
    grads = [torch.randn(sh, generator=gen).to(args.qkv.dtype).to(rn.device) if on else None
             for sh, on in zip(shapes, which)]
    out = rn.module.prologue_backward(args, *grads)
    if out is None:
        return [f"{name}: the backward kernels did not take the call"]
    again = rn.module.prologue_backward(args, *grads)
    rn.sync()
    grad_qkv, gqw, gkw = out
    problems = []
    for label, a, b in (("q_weight", gqw, again[1]), ("k_weight", gkw, again[2]), ("qkv", grad_qkv, again[0])):
        if (a is None) != (b is None) or (a is not None and not torch.equal(a.cpu(), b.cpu())):
            problems.append(f"{name}: grad of {label} differs between two runs")
    x = args.qkv.detach().to("cpu", torch.float64).requires_grad_(True)
    ws = [None if w is None else w.detach().to("cpu", torch.float64).requires_grad_(True)
          for w in (args.q_weight, args.k_weight)]
    if args.rotate and ref_pos is not None and not isinstance(ref_pos, int):
        ref_pos = ref_pos.cpu()
    ref = prologue_reference(x, ref_pos, num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                             head_dim=args.head_dim, q_weight=ws[0], k_weight=ws[1], eps=args.eps,
                             weight_offset=args.weight_offset, rotate=args.rotate,
                             rotary_dim=args.rotary_dim, style="gptj" if args.interleaved else "neox",
                             inv_freq=inv)
    outs = [(o, g.to("cpu", torch.float64)) for o, g in zip(ref, grads) if g is not None]
    if outs:
        torch.autograd.backward([o for o, _ in outs], [g for _, g in outs])

    def grad_close(label, got, want, dtype, rel):
        from rope_ops.testing.tolerances import ulp

        want = torch.zeros_like(x if label == "qkv" else ws[0] if ws[0] is not None else ws[1]) \
            if want is None else want
        g64, w64 = got.detach().to("cpu", torch.float64), want.detach()
        scale = w64.abs().max().clamp_min(1.0)
        bound = rel * scale + ulp(w64, dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32)
        bad = (g64 - w64).abs() > bound
        if bad.any():
            return [f"{name}: grad of {label}: {int(bad.sum())} of {bad.numel()} out of bounds, worst "
                    f"{(g64 - w64).abs().max().item():.3g} (scale {scale.item():.3g})"]
        return []

    problems += grad_close("qkv", grad_qkv, x.grad, args.qkv.dtype, 1e-5)
    for label, got, w in (("q_weight", gqw, ws[0]), ("k_weight", gkw, ws[1])):
        if (got is None) != (w is None):
            problems.append(f"{name}: grad of {label} given where the weight is not (or missing)")
        elif w is not None:
            problems += grad_close(label, got, w.grad, torch.float32, 1e-4)
    return problems


# (D, rotary_dim, row padding; without rotation the kernels run as NeoX, so only the 64 and 80
# shapes, whose kernels others reach too, alternate it off): whole 16-byte rows (vectors, one unit per lane), partial rotary,
# a GPT-NeoX-20B-like rotary 24 in rows padded by 3 elements (single elements, 4 units per lane),
# an odd head_dim (single elements), a wide head (vectors, 4 units per lane).
PROLOGUE_DIMS = ((128, 128, 8), (64, 32, 0), (80, 32, 0), (96, 24, 3), (17, 10, 0), (384, 128, 0))


def prologue_cases(rn: Runner):
    """The forward over dtypes, styles, head dims and the call's options, and the backward of
    each shape; caches with random and invalid slots; float8 saturation and NaN; a float8 q."""
    gen = torch.Generator().manual_seed(2026)
    n = 0
    for dtype in DTYPES:
        for style in ("neox", "gptj"):
            for D, r, extra in PROLOGUE_DIMS:
                n += 1
                opts = dict(thd=n % 2 == 0, extra=extra, q_norm=n % 4 != 1, k_norm=n % 5 != 2,
                            offset=1.0 if n % 3 == 1 else 0.0, rotate=D != 64 or n % 2 == 0,
                            pos_kind=("i64", "i32", "offset")[n % 3], inplace=n % 4 == 3,
                            cache=(None, "same", "fp8")[n % 3] if _fp8() else None,
                            weight_dtype=torch.bfloat16 if n % 6 == 5 else torch.float32)
                Hq, Hk = (4, 2) if D < 256 else (2, 1)
                name = (f"prologue {str(dtype)[6:]} {style} D{D} r{r} "
                        + " ".join(f"{k}={v}" for k, v in opts.items() if v not in (None, False, 0, 0.0)))
                args, inv, ref_pos = prologue_call(rn, gen, dtype=dtype, style=style, D=D, r=r,
                                                   Hq=Hq, Hk=Hk, **opts)
                rn.case(name, lambda: prologue_forward_problems(rn, name, args, inv, ref_pos))
                bopts = dict(opts, cache=None, inplace=False, rotate=D != 80 or n % 2 == 1,
                             q_norm=n % 3 != 2, k_norm=n % 4 != 0)
                bargs, binv, bpos = prologue_call(rn, gen, dtype=dtype, style=style, D=D, r=r,
                                                  Hq=Hq, Hk=Hk, **bopts)
                which = (n % 5 != 1, n % 3 != 0, n % 4 != 1)
                rn.case(name + " backward",
                        lambda: prologue_backward_problems(rn, name + " backward", bargs, binv, bpos, which))
    # a few tokens with many heads: a token's rows over several blocks
    args, inv, ref_pos = prologue_call(rn, gen, dtype=torch.bfloat16, style="neox", thd=True, D=128,
                                       r=128, Hq=64, Hk=8, T=2, cache="same")
    rn.case("prologue decode split rows", lambda: prologue_forward_problems(rn, "decode", args, inv, ref_pos))
    # more tokens than backward blocks (8 per SM): each block walks several tokens, adding their
    # weight gradients up before its row of partial sums
    bargs, binv, bpos = prologue_call(rn, gen, dtype=torch.bfloat16, style="neox", thd=True, D=128,
                                      r=128, Hq=4, Hk=2, T=2500, offset=1.0)
    rn.case("prologue backward, several tokens per block",
            lambda: prologue_backward_problems(rn, "chunks", bargs, binv, bpos))
    # slots anywhere in int64 / int32: only [0, num_slots) are written
    for sdtype, extremes in ((torch.int64, (-1, -7, 1 << 40, -(1 << 62), (1 << 63) - 1)),
                             (torch.int32, (-1, -(1 << 31), (1 << 31) - 1))):
        for cache in ("same", "fp8") if _fp8() else ("same",):
            T = 12
            n_slots = 2 * T + 3
            sl = torch.randperm(n_slots, generator=gen)[:T].to(torch.int64)
            for i, v in enumerate(extremes + (n_slots, n_slots + 1)):
                sl[i] = v
            args, inv, ref_pos = prologue_call(rn, gen, dtype=torch.float16, style="gptj", thd=True,
                                               D=64, r=64, Hq=2, Hk=2, T=T, cache=cache,
                                               slot_values=sl.to(sdtype))
            name = f"prologue slots {sdtype} {cache}"
            rn.case(name, lambda: prologue_forward_problems(rn, name, args, inv, ref_pos))
    if _fp8():  # saturation at +-448 and NaN in the float8 cache
        args, inv, ref_pos = prologue_call(rn, gen, dtype=torch.float32, style="neox", thd=True, D=32,
                                           r=32, Hq=1, Hk=1, T=6, cache="fp8", q_norm=False, k_norm=False)
        v = args.qkv.unflatten(-1, (3, 32))[:, 2]
        v[0, :4] = torch.tensor([1e6, -1e6, float("inf"), float("nan")])
        v[1, :3] = torch.tensor([897.0, -895.9, 449.0])
        args = args._replace(slots=torch.arange(6, device=rn.device))
        rn.case("prologue fp8 saturation and NaN",
                lambda: prologue_forward_problems(rn, "fp8 saturation", args, inv, ref_pos)
                + _fp8_saturation_problems(rn, args))
    if _fp8():  # q as float8 of q / q_scale (0.004 saturates much of it at +-448), with caches
        for i, (dtype, style, D, r, extra, cache, q_scale) in enumerate((
                (torch.bfloat16, "neox", 128, 128, 8, "fp8", 0.25),  # vectors, 1 unit per lane
                (torch.float16, "gptj", 96, 24, 3, "same", 0.004),  # single elements, 4 units
                (torch.float32, "neox", 17, 10, 0, None, 0.5),  # single elements, odd head_dim
                (torch.float32, "gptj", 64, 32, 0, "fp8", 0.004),
                (torch.bfloat16, "neox", 384, 128, 0, None, 1 / 3))):  # vectors, 4 units per lane
            Hq, Hk = (4, 2) if D < 256 else (2, 1)
            args, inv, ref_pos = prologue_call(rn, gen, dtype=dtype, style=style, thd=i % 2 == 0, D=D,
                                               r=r, Hq=Hq, Hk=Hk, extra=extra, cache=cache, q_scale=q_scale)
            name = f"prologue float8 q {str(dtype)[6:]} {style} D{D} r{r} q_scale={q_scale:.3g} cache={cache}"
            rn.case(name, lambda: prologue_forward_problems(rn, name, args, inv, ref_pos))
        # a float8 q_out one byte off alignment: single elements
        args, inv, ref_pos = prologue_call(rn, gen, dtype=torch.bfloat16, style="neox", thd=True, D=128,
                                           r=64, Hq=4, Hk=2, T=5, cache="fp8", q_scale=0.25)
        q_out = torch.empty(args.q_out.numel() + 1, dtype=_fp8(), device=rn.device)[1:].view(args.q_out.shape)
        args = args._replace(q_out=q_out)
        rn.case("prologue float8 q unaligned",
                lambda: prologue_forward_problems(rn, "float8 q unaligned", args, inv, ref_pos))
    # a head row of more than 128 units: the kernels refuse it (the backend then runs torch ops)
    args, inv, ref_pos = prologue_call(rn, gen, dtype=torch.float32, style="neox", thd=True, D=300,
                                       r=300, Hq=1, Hk=1, T=3)
    rn.case("prologue refuses 300-element rows", lambda: [] if not rn.module.prologue(args) else
            ["the kernels took a row of 300 single elements"])


def _fp8_saturation_problems(rn: Runner, args) -> list[str]:
    got = _copy_args(args)
    rn.module.prologue(got)
    rn.sync()
    vals = got.v_cache[:2, 0, :4].float().cpu() * 2.0  # v_scale 2: the cache holds value / 2
    # value / 2 saturates at 448 (inf too), NaN stays NaN; 449 / 2 rounds to 224
    want = torch.tensor([[896.0, -896.0, 896.0], [896.0, -896.0, 448.0]])
    if not torch.isnan(vals[0, 3]) or not torch.equal(vals[:, :3], want):
        return [f"fp8 saturation: got {vals.tolist()}"]
    return []



def load_triton_check():
    """tools/gpu_triton_check.py as a module (its prologue cases, inputs and timing)."""
    spec = importlib.util.spec_from_file_location("gpu_triton_check", ROOT / "tools" / "gpu_triton_check.py")
    tc = importlib.util.module_from_spec(spec)
    sys.modules["gpu_triton_check"] = tc
    spec.loader.exec_module(tc)
    return tc


def prologue_timed_calls(pc, inp, forward, backward) -> list:
    """One call per input set of a gpu_triton_check prologue case: forward(args), then
    backward(args, *output_grads) for the training cases."""
    if pc.backward:
        return [lambda a=a, g=g: (forward(a), backward(a, *g)) for a, g in inp.sets]
    return [lambda a=a: forward(a) for a, _ in inp.sets]


def prologue_timing(rn: Runner) -> None:
    """GPU time of the CUDA prologue kernels on tools/gpu_triton_check.py's prologue cases (its
    inputs, its CUDA-graph timing), against a same-run copy of the bytes that must move and the
    Triton kernel on the same inputs. Prints; never fails."""
    tc = load_triton_check()
    from rope_ops_backends.triton_backend import prologue as tp

    print("\nprologue timing, us per call (% of copy: a same-bytes copy's time / the call's)")
    for pc in tc.PROLOGUE_CASES:
        if pc.angles != "table":
            continue  # mRoPE: not a CUDA kernel
        inp = tc.PrologueInputs(pc, tc.prologue_n_sets(pc))
        copy = tc.copy_us(pc.data_bytes())
        cuda_us = tc.graph_us(prologue_timed_calls(pc, inp, rn.module.prologue, rn.module.prologue_backward))
        try:
            triton = f"{tc.graph_us(prologue_timed_calls(pc, inp, tp.run_prologue, tp.run_prologue_backward)):.2f}"
        except Exception as e:  # Triton missing or failing is a note here
            triton = f"{type(e).__name__}"
        try:  # the passes the fusion saves, in the same run
            baselines = "".join(f", {label} {tc.graph_us(fns, iters=3):.2f}"
                                for label, fns in tc.baseline_fns(inp).values())
        except Exception as e:
            baselines = f", baselines: {type(e).__name__}: {e}"
        if pc.cache:  # decode without the position -> table row load
            free = tc.table_free_sets(inp)
            for name, run in (("cuda", rn.module.prologue), ("triton", tp.run_prologue)):
                try:
                    us = tc.graph_us([lambda a=a, run=run: run(a) for a in free], iters=3)
                    baselines += f", {name} without the table {us:.2f}"
                except Exception as e:
                    baselines += f", {name} without the table: {type(e).__name__}"
        print(f"  {pc.name}: cuda {cuda_us:.2f} ({100 * copy / cuda_us:.1f} % of copy), triton {triton}, "
              f"copy {copy:.2f}{baselines}", flush=True)
        del inp
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coverage", action="store_true",
                    help="only the calls that reach every kernel (for compute-sanitizer)")
    ap.add_argument("--choice-only", action="store_true",
                    help="each case with the policy's choice only, not every candidate")
    ap.add_argument("--prologue-only", action="store_true", help="only the fused prologue's cases")
    ap.add_argument("--prologue-timing", action="store_true",
                    help="also time the prologue kernels against a copy and Triton")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every passing case")
    a = ap.parse_args()
    t_start = time.time()
    if not torch.cuda.is_available():
        print("no CUDA device: this script needs a GPU")
        return 1
    print(f"torch {torch.__version__} CUDA {torch.version.cuda}, "
          f"{torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}")
    cb = import_backend()
    t0 = time.time()
    reasons = cb.CudaBackend().availability()
    if reasons:
        print("CUDA backend unavailable:\n  " + "\n  ".join(reasons))
        return 1
    print(f"extension ready in {time.time() - t0:.1f} s (cache {cb.cache_dir()})")
    rn = Runner(cb._module(), "cuda", every_candidate=not a.choice_only)
    rn.verbose = a.verbose
    if a.prologue_only:
        prologue_cases(rn)
    else:
        coverage(rn)
        prologue_cases(rn)
    if not a.coverage and not a.prologue_only:
        accuracy(rn)
        angle_source_accuracy(rn)
        alloc_outputs(rn)
        autograd_in_cpp(rn)
        garbage_positions(rn)
        zero_tokens(rn)
        pdl_chain(rn)
        large_tensor(rn)
    if a.prologue_timing:
        prologue_timing(rn)
    print(f"\n{rn.count - rn.failed_cases}/{rn.count} cases passed, {len(rn.failures)} problems")
    print("policy's choices: " + ", ".join(f"{k} {v}" for k, v in sorted(rn.choices.items())))
    print(f"candidate configurations run: {len(rn.labels_run)}")
    print(f"total {time.time() - t_start:.0f} s")
    if rn.failures:
        print("FAILED")
        return 1
    print("PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
