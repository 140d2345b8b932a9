"""Check and time the Triton backend on a CUDA GPU, in one run.

    python tools/gpu_triton_check.py [--json PATH] [--no-pytest] [--conformance] [--study]
                                     [--prologue] [--jobs N] [--budget SECONDS]
    TRITON_INTERPRET=1 python tools/gpu_triton_check.py --smoke      # no GPU: step 3, tiny
    TRITON_INTERPRET=1 python tools/gpu_triton_check.py --host-cpu   # no GPU: Python path cost

1. Compile: every kernel the later steps launch is compiled first by --jobs worker processes
   (triton's on-disk cache is shared), so the GPU does not wait on one compiling process.
2. Tests: tests/test_triton_backend.py, test_triton_variants.py, test_triton_prologue.py on
   CUDA tensors (unless --no-pytest) and, with --conformance, the conformance suite for triton,
   in shards alongside steps 1 and 3 (correctness only: no timing runs while they share the
   GPU).
3. Accuracy on large shapes: PERF.md's W1-W5 and classes of shape the launch policy has rules
   for (head_dim 64/80/96/256, fp16/fp32, MQA/GQA, partial rotary, bhsd/sbhd, packed QKV views,
   decode of 1/8/64 tokens, positions past the table), each through the policy's launch twice
   (triton's JIT launch, then the direct launch: bitwise equal) and the backward, against a
   float64 reference computed on the GPU; rope_ops.apply (bound launcher and guard) bitwise
   equal to run(). The angle variants on large shapes (per-token bf16/fp32 rows, mRoPE chunked
   and interleaved with positions past the table), forward and inverse. The fused prologue
   (prefill, in place, training with its backward, decode with bf16 and float8 cache writes,
   partial gptj, mRoPE, fp32) against float64 on the GPU: outputs, cache rows, grad_qkv and
   the norm weights' gradients.
4. GPU time of every case through the policy: its calls captured in a CUDA graph, replay time
   / calls, rotating input sets of 400 MB in all so L2 does not hold them (decode-sized sets,
   at most 64, still fit in L2); against a same-run device-to-device copy of the same bytes
   (read + written once) -- "% copy" -- and PERF.md's targets.
5. Host time per call (plain Python loop): rope_ops.apply eager on W2 (the guard path), the
   bound launcher, backend.run, the direct launch alone, the JIT launch, torch.empty_like x2.
6. --study: every kernel_candidates() configuration of every case timed, the best against the
   policy's choice (the bench's --candidates does the same on its matrix).
7. --prologue (timed before step 4): the prologue's prefill (16384 tokens, 32/8 heads, D 128,
   bf16, QK-norm; out of place and in place), training forward + backward ([2, 4096]) and
   decode with a bf16 / float8 cache write (256 tokens), each against a same-run copy of the
   bytes that must move (qkv read once, q, k, v written once, cache rows, positions, distinct
   table rows, weights; the backward's reads and grad_qkv), the policy without its register cap,
   the unfused pipeline (torch RMSNorm + rope_ops.apply) and Hugging Face's Qwen3 prologue under
   torch.compile on the forward cases, every prologue candidate configuration and, on the
   training cases, the backward's own candidates (`backward_candidates`: token block, warps,
   pipeline stages, programs per SM) behind the policy's forward; on the decode cases, the
   policy with every angle computed from freq_turns (an empty table: no position -> table row
   load in the chain).

Exit status 1 when a correctness check failed; timings never fail the run. The summary ends with
the lines to send back; --json writes everything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rope_ops.backend import KernelArgs  # noqa: E402
from rope_ops.bench.timing import graph_seconds_per_call, warm_up  # noqa: E402
from rope_ops.frequencies import compute_inv_freq, cos_sin_table, freq_turns_of  # noqa: E402

try:
    import rope_ops_backends.triton_backend as tb  # noqa: E402
except ImportError:  # a checkout that is not pip-installed: backends/ is the package
    import importlib

    sys.modules["rope_ops_backends"] = importlib.import_module("backends")
    import rope_ops_backends.triton_backend as tb  # noqa: E402

T0 = time.time()
FAILURES: list[str] = []
DEVICE = "cuda"


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# ---------------------------------------------------------------------------------------------
# Cases.


@dataclass(frozen=True)
class Shape:
    """A rope call's name, layout and sizes (thd: B * S tokens in one sequence)."""

    name: str
    layout: str
    B: int
    S: int
    hq: int
    hk: int
    D: int


class HasDtype:
    """rotary and torch_dtype of a case with fields R (0: D), D and dtype."""

    @property
    def rotary(self) -> int:
        return self.R or self.D

    @property
    def torch_dtype(self):
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class Case(HasDtype, Shape):
    R: int = 0  # 0: D
    style: str = "neox"
    dtype: str = "bfloat16"
    base: float = 500000.0
    pos: str = "arange"  # arange per sequence | random (0..32767) | past (beyond the table)
    inplace: bool = False
    backward: bool = False  # timed forward + backward
    packed: bool = False  # q, k views of one [B, S, hq + 2 hk, D] tensor

    def data_bytes(self) -> int:
        """q and k read once and written once (in place: the rotary dims only), per direction."""
        dims = self.rotary if self.inplace else self.D
        size = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.B * self.S * (self.hq + self.hk) * dims * size


CASES = [
    Case("W1", "bshd", 4, 4096, 32, 8, 128),
    Case("W2", "thd", 1, 256, 32, 8, 128, pos="random"),
    Case("W3", "bshd", 2, 4096, 16, 16, 256, 64, "gptj", base=10000.0),
    Case("W3 in place", "bshd", 2, 4096, 16, 16, 256, 64, "gptj", base=10000.0, inplace=True),
    Case("W4 fwd+bwd", "bshd", 2, 4096, 32, 32, 128, backward=True),
    Case("W5", "bshd", 8, 4096, 64, 8, 128),
    Case("fp16 sbhd", "sbhd", 4, 4096, 32, 8, 128, dtype="float16"),
    Case("bhsd", "bhsd", 4, 4096, 32, 8, 128),
    Case("fp32 GQA fwd+bwd", "bshd", 2, 4096, 32, 8, 128, dtype="float32", backward=True),
    Case("Phi-2 hd80 r32", "bshd", 4, 4096, 32, 32, 80, 32),
    Case("Phi-3 hd96", "bshd", 4, 4096, 32, 32, 96),
    Case("NeoX-20B hd96 r24 in place", "bshd", 4, 2048, 64, 64, 96, 24, inplace=True),
    Case("Gemma hd256", "bshd", 4, 4096, 16, 8, 256),
    Case("MQA hd64", "bshd", 8, 4096, 71, 1, 64),
    Case("hd64 GQA", "bshd", 8, 4096, 32, 8, 64),
    Case("Qwen2 28/4", "bshd", 4, 4096, 28, 4, 128),
    Case("packed QKV", "bshd", 4, 4096, 32, 8, 128, packed=True),
    Case("varlen thd", "thd", 1, 16384, 32, 8, 128, pos="random"),
    Case("past the table", "thd", 1, 4096, 32, 8, 128, pos="past"),
    Case("decode 64", "thd", 1, 64, 32, 8, 128, pos="random"),
    Case("decode 8", "thd", 1, 8, 32, 8, 128, pos="random"),
    Case("decode 1", "thd", 1, 1, 32, 8, 128, pos="random"),
]
TABLE_ROWS = 131072
L2_ROTATION_BYTES = 400e6  # input sets per timed case: at least this many bytes in all


class Inputs:
    """Input sets, tables and outputs of one case on the GPU."""

    def __init__(self, case: Case, n_sets: int, device="cuda"):
        self.case = case
        self.inv_freq = compute_inv_freq(case.rotary, case.base)[0]
        cos, sin = cos_sin_table(self.inv_freq, 1.0, TABLE_ROWS)
        self.cos, self.sin = cos.to(device), sin.to(device)
        self.turns = freq_turns_of(self.inv_freq).to(device)
        g = torch.Generator(device=device).manual_seed(hash(case.name) % 1000)
        self.sets = []
        for _ in range(n_sets):
            q, k = self._qk(g, device)
            pos = self._positions(g, device)
            q_out = q if case.inplace else torch.empty_like(q)
            k_out = k if case.inplace else torch.empty_like(k)
            grads = (torch.randn_like(q), torch.randn_like(k)) if case.backward else None
            grad_outs = (torch.empty_like(q), torch.empty_like(k)) if case.backward else None
            self.sets.append((q, k, q_out, k_out, pos, grads, grad_outs))

    def _qk(self, g, device):
        c = self.case
        shape = {"bshd": lambda h: (c.B, c.S, h, c.D), "sbhd": lambda h: (c.S, c.B, h, c.D),
                 "bhsd": lambda h: (c.B, h, c.S, c.D), "thd": lambda h: (c.B * c.S, h, c.D)}[c.layout]
        if c.packed:
            qkv = torch.randn(shape(c.hq + 2 * c.hk), generator=g, device=device, dtype=c.torch_dtype)
            return qkv[:, :, :c.hq], qkv[:, :, c.hq:c.hq + c.hk]
        q = torch.randn(shape(c.hq), generator=g, device=device, dtype=c.torch_dtype)
        k = torch.randn(shape(c.hk), generator=g, device=device, dtype=c.torch_dtype)
        return q, k

    def _positions(self, g, device):
        c = self.case
        n = c.B * c.S
        if c.pos == "random":
            p = torch.randint(0, 32768, (n,), generator=g, device=device)
        elif c.pos == "past":  # around the table's end, and negative
            p = torch.randint(TABLE_ROWS - 2048, TABLE_ROWS + 2048, (n,), generator=g, device=device)
            p[::7] = -p[::7]
        else:
            return None  # offset 0: arange per sequence
        return p if c.layout == "thd" else p.view(c.B, c.S)

    def args(self, i, inverse=False, q=None, k=None) -> KernelArgs:
        c = self.case
        q0, k0, qo, ko, pos, grads, grad_outs = self.sets[i]
        if inverse:
            q0, k0 = grads
            qo, ko = grad_outs
        q = q0 if q is None else q
        k = k0 if k is None else k
        if c.inplace:
            qo, ko = q, k
        return KernelArgs(q=q, k=k, q_out=qo, k_out=ko, pos=pos, pos_offset=0, cos=self.cos,
                          sin=self.sin, freq_turns=self.turns, attention_factor=1.0,
                          layout=c.layout, rotary_dim=c.rotary, interleaved=c.style == "gptj",
                          inverse=inverse, inplace=c.inplace)

    def positions_bs(self, i) -> torch.Tensor:
        c = self.case
        pos = self.sets[i][4]
        if pos is None:
            return torch.arange(c.S, device=self.cos.device).expand(c.B, c.S)
        return pos.reshape(c.B, c.S)


def as_bshd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return {"bshd": lambda: t, "thd": lambda: t.unsqueeze(0), "sbhd": lambda: t.transpose(0, 1),
            "bhsd": lambda: t.transpose(1, 2)}[layout]()


# ---------------------------------------------------------------------------------------------
# Accuracy (SPEC): a float64 reference on the GPU, independent of the kernel's code.


def reference(x, pos_bs, inv_freq, R, style, inverse=False):
    """float64 rotation of x (a [B,S,H,D] view); float64 angles are exact enough for the cases'
    positions (|p| < 2^18)."""
    theta = pos_bs.double()[..., None] * inv_freq.to(x.device, torch.float64)[None, None, :]
    return rotate_reference(x.double(), torch.cos(theta), torch.sin(theta), R, style, inverse)


def rotate_reference(x64, c, s, R, style, inverse=False):
    """x64 [B, S, H, D] (float64) rotated by float64 (c, s) [B, S, R/2]: shared by the heads."""
    c, s = c[:, :, None, :], s[:, :, None, :]
    if inverse:
        s = -s
    half = R // 2
    idx = torch.arange(half, device=x64.device)
    a_i, b_i = (idx, idx + half) if style == "neox" else (2 * idx, 2 * idx + 1)
    out = x64.clone()
    a, b = x64[..., a_i], x64[..., b_i]
    out[..., a_i] = a * c - b * s
    out[..., b_i] = b * c + a * s
    return out


def check_close(tag, out, inp, ref, R, style) -> float:
    """SPEC accuracy: float32 2e-6 * max(1, |x|+|y|); bf16/fp16 one ulp at the reference more.
    Pass-through dims bitwise. Returns the largest error in ulps of the allowance."""
    if not torch.equal(out[..., R:], inp[..., R:]):
        FAILURES.append(f"{tag}: pass-through dims changed")
    o, r, x = out[..., :R].double(), ref[..., :R], inp[..., :R].double()
    idx = torch.arange(R, device=out.device)
    partner = torch.where(idx < R // 2, idx + R // 2, idx - R // 2) if style == "neox" else idx ^ 1
    allow = 2e-6 * (x.abs() + x[..., partner].abs()).clamp_min(1.0)
    if out.dtype != torch.float32:
        mant = {torch.bfloat16: 7, torch.float16: 10}[out.dtype]
        a = r.abs().clamp_min(torch.finfo(out.dtype).tiny)
        allow = allow + torch.exp2(torch.floor(torch.log2(a)) - mant)
    ratio = float(((o - r).abs() / allow).max())
    if not ratio <= 1.0:
        FAILURES.append(f"{tag}: error {ratio:.2f} x the SPEC allowance")
    return ratio


def check_case(case: Case, backend) -> dict:
    """The case through the policy's launch twice (JIT, then direct: bitwise equal), forward
    and (W1, training cases) backward, against the float64 reference."""
    inp = Inputs(case, 1, DEVICE)
    row = {"case": case.name, "policy": tb.kernel_candidates(inp.args(0))[0]}
    positions = inp.positions_bs(0)
    for inverse in ((False, True) if case.backward else (False,)):
        args = inp.args(0, inverse)
        q, k = args.q, args.k
        q_in, k_in = q.clone(), k.clone()
        results = []
        for attempt in range(2):  # the launch's JIT call, then its direct launch
            if case.inplace:
                q.copy_(q_in)  # restores the data, keeps the views
                k.copy_(k_in)
            else:
                args.q_out.fill_(float("nan"))
                args.k_out.fill_(float("nan"))
            backend.run(args)
            results.append((args.q_out.clone(), args.k_out.clone()))
            if not case.inplace and not (torch.equal(q_in, q) and torch.equal(k_in, k)):
                FAILURES.append(f"{case.name}: out-of-place call modified its inputs")
        tag = case.name + (" backward" if inverse else "")
        if not all(torch.equal(a, b) for a, b in zip(*results)):
            FAILURES.append(f"{tag}: direct launch differs from the JIT launch")
        worst = 0.0
        for got, x in zip(results[1], (q_in, k_in)):
            x4 = as_bshd(x, case.layout)
            ref = reference(x4, positions, inp.inv_freq, case.rotary, case.style, inverse)
            worst = max(worst, check_close(tag, as_bshd(got, case.layout), x4, ref,
                                           case.rotary, case.style))
        row["backward" if inverse else "forward"] = round(worst, 3)
    return row


def check_apply_paths():
    """rope_ops.apply's bound launcher and guard give run()'s bits (W2 and a GQA prefill)."""
    import rope_ops

    prefill = Case("prefill", "bshd", 2, 512 if DEVICE == "cuda" else 3, 32, 8, 128)
    for case in (CASES[1], prefill):
        inp = Inputs(case, 1, DEVICE)
        rope = rope_ops.RotaryEmbedding(case.D, base=case.base, max_position=TABLE_ROWS,
                                        device=DEVICE)
        q, k, qo, ko, pos, _, _ = inp.sets[0]
        want = tb.TritonBackend()
        p = pos if pos is not None else 0
        cos, sin, turns, m = rope.tables(q.device)
        args = KernelArgs(q, k, qo, ko, pos, 0, cos, sin, turns, m, case.layout, case.D, False,
                          False, False)
        want.run(args)
        for attempt in range(3):  # plan, then guard
            a, b = rope_ops.apply(q, k, p, rope=rope, backend="triton")
            if not (torch.equal(a, qo) and torch.equal(b, ko)):
                FAILURES.append(f"apply {case.name} call {attempt}: differs from backend.run")
        if DEVICE == "cuda" and not any(g is not None for g in rope._guards.values()):
            FAILURES.append(f"apply {case.name}: no guard was made for the repeated call")
    log("apply paths (bound launcher, guard) bitwise equal to run()")


# ---------------------------------------------------------------------------------------------
# The angle variants (per-token cos/sin, mRoPE) on large shapes against a float64 reference.


@dataclass(frozen=True)
class VariantCase(Shape):
    angles: str  # "token": per-token rows, no positions | "mrope": [3, ...] positions
    section: tuple = (16, 24, 24)
    interleaved: bool = False
    table_dtype: str = "bfloat16"  # per-token rows (Hugging Face's are the model's dtype)
    style: str = "neox"


VARIANT_CASES = [
    VariantCase("per-token bf16 rows (HF) W1 shape", "bshd", 4, 4096, 32, 8, 128, "token"),
    VariantCase("per-token fp32 rows thd gptj", "thd", 1, 8192, 32, 8, 128, "token",
                table_dtype="float32", style="gptj"),
    VariantCase("mRoPE chunked (Qwen2-VL)", "bshd", 2, 4096, 28, 4, 128, "mrope", (16, 24, 24)),
    VariantCase("mRoPE interleaved (Qwen3-VL) thd", "thd", 1, 8192, 32, 8, 128, "mrope",
                (24, 20, 20), True),
]


def variant_inputs(vc: VariantCase, g):
    """(KernelArgs maker, q, k, float64 (c, s) [B, S, R/2] of the reference)."""
    from rope_ops._mrope import mrope_axes

    shape = {"bshd": lambda h: (vc.B, vc.S, h, vc.D), "thd": lambda h: (vc.B * vc.S, h, vc.D)}
    q = torch.randn(shape[vc.layout](vc.hq), generator=g, device=DEVICE).to(torch.bfloat16)
    k = torch.randn(shape[vc.layout](vc.hk), generator=g, device=DEVICE).to(torch.bfloat16)
    half = vc.D // 2
    pos, turns = None, None
    if vc.angles == "token":
        angle = torch.rand(1, vc.B * vc.S if vc.layout == "thd" else vc.S, half, generator=g,
                           device=DEVICE, dtype=torch.float64) * 6.3
        b = 1 if vc.layout == "thd" else vc.B
        cos = angle.cos().to(getattr(torch, vc.table_dtype)).expand(b, angle.shape[1], half)
        sin = angle.sin().to(getattr(torch, vc.table_dtype)).expand(b, angle.shape[1], half)
        c64, s64 = cos.double(), sin.double()
    else:
        inv_freq = compute_inv_freq(vc.D, 500000.0)[0]
        cos, sin = (t.to(DEVICE) for t in cos_sin_table(inv_freq, 1.0, TABLE_ROWS))
        turns = freq_turns_of(inv_freq).to(DEVICE)
        n = vc.B * vc.S
        pos = torch.randint(0, TABLE_ROWS + 8192, (3, n), generator=g, device=DEVICE)  # past too
        if vc.layout != "thd":
            pos = pos.view(3, vc.B, vc.S)
        axes = mrope_axes(vc.section, vc.interleaved).to(DEVICE)
        per_freq = pos.reshape(3, vc.B, vc.S)[axes].permute(1, 2, 0).double()  # [B, S, R/2]
        theta = per_freq * inv_freq.to(DEVICE, torch.float64)
        c64, s64 = torch.cos(theta), torch.sin(theta)

    def make(x, y, xo, yo, inverse):
        return KernelArgs(q=x, k=y, q_out=xo, k_out=yo, pos=pos, pos_offset=0, cos=cos, sin=sin,
                          freq_turns=turns, attention_factor=1.0, layout=vc.layout,
                          rotary_dim=vc.D, interleaved=vc.style == "gptj", inverse=inverse,
                          inplace=False, angles=vc.angles,
                          mrope_section=vc.section if vc.angles == "mrope" else None,
                          mrope_interleaved=vc.interleaved)

    return make, q, k, c64, s64


def check_variant(vc: VariantCase, backend) -> dict:
    """Forward and inverse through the policy's launch (the forward twice: JIT then direct
    launch, bitwise equal) against the float64 reference."""
    g = torch.Generator(device=DEVICE).manual_seed(7)
    make, q, k, c64, s64 = variant_inputs(vc, g)
    row = {"case": vc.name}
    for inverse in (False, True):
        outs = []
        for attempt in range(1 if inverse else 2):
            qo, ko = torch.empty_like(q), torch.empty_like(k)
            backend.run(make(q, k, qo, ko, inverse))
            outs.append((qo, ko))
        tag = vc.name + (" inverse" if inverse else "")
        if len(outs) == 2 and not all(torch.equal(a, b) for a, b in zip(*outs)):
            FAILURES.append(f"{tag}: direct launch differs from the JIT launch")
        worst = 0.0
        for got, x in zip(outs[-1], (q, k)):
            x4 = as_bshd(x, vc.layout)
            ref = rotate_reference(x4.double(), c64, s64, vc.D, vc.style, inverse)
            worst = max(worst, check_close(tag, as_bshd(got, vc.layout), x4, ref, vc.D, vc.style))
        row["backward" if inverse else "forward"] = round(worst, 3)
    return row


# ---------------------------------------------------------------------------------------------
# The fused prologue: accuracy on large shapes, and (--prologue) GPU time.


@dataclass(frozen=True)
class PrologueCase(HasDtype):
    name: str
    T: int  # tokens in all
    batch: int = 0  # 0: thd [T, W]; else bshd [batch, T / batch, W]
    hq: int = 32
    hk: int = 8
    D: int = 128
    R: int = 0  # 0: D
    style: str = "neox"
    dtype: str = "bfloat16"
    q_norm: bool = True
    k_norm: bool = True
    inplace: bool = False
    cache: str = ""  # "", or the cache's dtype: "bfloat16", "float8_e4m3fn"
    pos: str = "arange"  # arange per 4096-token sequence | random in [0, 32768)
    angles: str = "table"  # or "mrope": [3, T] positions, interleaved
    section: tuple = (24, 20, 20)  # mRoPE's (Qwen3-VL's)
    backward: bool = False  # timed forward + backward
    timed: bool = True  # in --prologue's timing (else accuracy only)

    def lead(self) -> tuple:
        return (self.T,) if not self.batch else (self.batch, self.T // self.batch)

    def data_bytes(self) -> int:
        """Bytes that must move: qkv read once and q, k, v written once (in place: the q and k
        heads read and written), the cache rows, positions, distinct table rows, weights; the
        backward reads the q and k heads again, the output gradients, writes grad_qkv."""
        e = self.torch_dtype.itemsize
        heads = self.hq + 2 * self.hk
        moved = self.T * self.D * e * (2 * (self.hq + self.hk) if self.inplace else 2 * heads)
        if self.cache:
            moved += self.T * 2 * self.hk * self.D * getattr(torch, self.cache).itemsize
        rows = min(self.T, 4096) if self.pos == "arange" else min(self.T, 32768)
        moved += self.T * 8 * (3 if self.angles == "mrope" else 1)
        moved += rows * self.rotary // 2 * 4 * 2 + 2 * self.D * 4
        if self.backward:
            moved += self.T * self.D * e * ((self.hq + self.hk) + 2 * heads)
        return moved


PROLOGUE_CASES = [
    PrologueCase("prologue prefill QK-norm", 16384),
    PrologueCase("prologue prefill in place", 16384, inplace=True),
    PrologueCase("prologue training fwd+bwd", 8192, batch=2, backward=True),
    PrologueCase("prologue decode + bf16 cache", 256, pos="random", cache="bfloat16"),
    PrologueCase("prologue decode + fp8 cache", 256, pos="random", cache="float8_e4m3fn"),
    PrologueCase("prologue gptj r64 of 128, k norm only, fp16", 4096, R=64, style="gptj",
                 dtype="float16", q_norm=False, timed=False),
    PrologueCase("prologue mRoPE interleaved", 4096, angles="mrope", timed=False),
    PrologueCase("prologue fp32 training hd64 fwd+bwd", 4096, batch=2, D=64, dtype="float32",
                 backward=True, timed=False),
]
CACHE_SLOTS = 1 << 20  # the decode workload's cache: a million slots, 256 of them written


class PrologueInputs:
    """Input sets (qkv, outputs, positions, slots, output gradients) of one prologue case; the
    weights, tables and caches are shared."""

    def __init__(self, pc: PrologueCase, n_sets: int, device="cuda"):
        from rope_ops.backend import PrologueArgs

        self.pc = pc
        g = torch.Generator(device=device).manual_seed(hash(pc.name) % 1000)
        R, D = pc.rotary, pc.D
        self.inv_freq = compute_inv_freq(R, 500000.0)[0]
        self.cos, self.sin = (t.to(device) for t in cos_sin_table(self.inv_freq, 1.0, TABLE_ROWS))
        self.turns = freq_turns_of(self.inv_freq).to(device)
        self.weights = [(torch.randn(D, generator=g, device=device) * 0.3 + 1.0) if on else None
                        for on in (pc.q_norm, pc.k_norm)]
        self.k_cache = self.v_cache = None
        if pc.cache:
            cache_dtype = getattr(torch, pc.cache)
            self.k_cache = torch.zeros(CACHE_SLOTS, pc.hk, D, device=device).to(cache_dtype)
            self.v_cache = torch.zeros(CACHE_SLOTS, pc.hk, D, device=device).to(cache_dtype)
        scales = (0.5, 2.0) if pc.cache == "float8_e4m3fn" else (1.0, 1.0)
        lead, width = pc.lead(), (pc.hq + 2 * pc.hk) * D
        self.sets = []
        for _ in range(n_sets):
            qkv = torch.randn(*lead, width, generator=g, device=device).to(pc.torch_dtype)
            outs = [None if pc.inplace else torch.empty(*lead, h, D, dtype=pc.torch_dtype,
                                                        device=device)
                    for h in (pc.hq, pc.hk, pc.hk)]
            if pc.angles == "mrope":
                pos = torch.randint(0, 32768, (3, pc.T), generator=g, device=device)
                if pc.batch:
                    pos = pos.view(3, *lead)
            elif pc.pos == "random":
                pos = torch.randint(0, 32768, lead, generator=g, device=device)
            else:
                pos = (torch.arange(pc.T, device=device) % 4096).view(lead)
            slots = None
            if pc.cache:
                slots = torch.randperm(CACHE_SLOTS, generator=g, device=device)[:pc.T].view(lead)
            grads = [torch.randn(*lead, h, D, generator=g, device=device).to(pc.torch_dtype)
                     for h in (pc.hq, pc.hk, pc.hk)] if pc.backward else None
            args = PrologueArgs(
                qkv=qkv, q_out=outs[0], k_out=outs[1], v_out=outs[2], pos=pos, pos_offset=0,
                cos=self.cos, sin=self.sin, freq_turns=self.turns, attention_factor=1.0,
                layout="bshd" if pc.batch else "thd", num_q_heads=pc.hq, num_kv_heads=pc.hk,
                head_dim=D, rotary_dim=R, interleaved=pc.style == "gptj", rotate=True,
                q_weight=self.weights[0], k_weight=self.weights[1], eps=1e-6, weight_offset=0.0,
                inplace=pc.inplace, k_cache=self.k_cache, v_cache=self.v_cache, slots=slots,
                k_scale=scales[0], v_scale=scales[1], angles=pc.angles,
                mrope_section=pc.section if pc.angles == "mrope" else None,
                mrope_interleaved=pc.angles == "mrope")
            self.sets.append((args, grads))

    def angles64(self, args):
        """float64 (c, s) [B, S, R/2] of the reference (thd: B = 1)."""
        from rope_ops._mrope import mrope_axes

        pc = self.pc
        b, s = (pc.batch, pc.T // pc.batch) if pc.batch else (1, pc.T)
        inv = self.inv_freq.to(args.qkv.device, torch.float64)
        if pc.angles == "mrope":
            axes = mrope_axes(args.mrope_section, args.mrope_interleaved).to(args.qkv.device)
            p = args.pos.reshape(3, b, s)[axes].permute(1, 2, 0).double()
            theta = p * inv
        else:
            theta = args.pos.reshape(b, s, 1).double() * inv
        return torch.cos(theta), torch.sin(theta)


def prologue_reference_gpu(inp: PrologueInputs, args, qkv64, weights64):
    """float64 (q, k, v, normalised q, normalised k) as [B, S, H, D] (thd: B = 1), on the GPU;
    differentiable in qkv64 and the weights."""
    pc = inp.pc
    x = qkv64 if pc.batch else qkv64.unsqueeze(0)
    heads = x.unflatten(-1, (pc.hq + 2 * pc.hk, pc.D))
    q, k, v = heads.split([pc.hq, pc.hk, pc.hk], dim=-2)

    def norm(t, w):
        if w is None:
            return t
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    nq, nk = norm(q, weights64[0]), norm(k, weights64[1])
    c, s = inp.angles64(args)
    R = pc.rotary
    rq = torch.cat([rotate_reference(nq[..., :R], c, s, R, pc.style), nq[..., R:]], dim=-1)
    rk = torch.cat([rotate_reference(nk[..., :R], c, s, R, pc.style), nk[..., R:]], dim=-1)
    return rq, rk, v, nq, nk


def prologue_close(tag, out, ref, normed, R, style, dtype, exact_tail) -> float:
    """The prologue's bound (docs/spec.md 9.4): rotary elements within 2e-6 * max(1, |x|+|y|)
    of the normalised pair plus one ulp of the dtype; computed pass-through dims within
    2e-6 * max(1, |ref|) plus one ulp (bitwise where nothing was computed)."""
    from rope_ops.testing.tolerances import ulp

    o = out.double()
    idx = torch.arange(R, device=out.device)
    partner = torch.where(idx < R // 2, idx + R // 2, idx - R // 2) if style == "neox" else idx ^ 1
    x = normed[..., :R]
    allow = 2e-6 * (x.abs() + x[..., partner].abs()).clamp_min(1.0) + ulp(ref[..., :R], dtype)
    ratio = float(((o[..., :R] - ref[..., :R]).abs() / allow).max())
    if R < out.shape[-1]:
        tail, tail_ref = o[..., R:], ref[..., R:]
        if exact_tail:
            if not torch.equal(tail, tail_ref):
                FAILURES.append(f"{tag}: pass-through dims changed")
        else:
            tail_allow = 2e-6 * tail_ref.abs().clamp_min(1.0) + ulp(tail_ref, dtype)
            ratio = max(ratio, float(((tail - tail_ref).abs() / tail_allow).max()))
    if not ratio <= 1.0:
        FAILURES.append(f"{tag}: error {ratio:.2f} x the allowance")
    return ratio


def check_prologue(pc: PrologueCase) -> dict:
    """Forward (outputs, qkv untouched or written in place, the cache) and, for training cases,
    backward (grad_qkv, weight gradients) against float64 on the GPU."""
    from rope_ops.testing.tolerances import ulp
    from rope_ops_backends.triton_backend import prologue as tp

    inp = PrologueInputs(pc, 1, DEVICE)
    args, grads = inp.sets[0]
    dtype, R = pc.torch_dtype, pc.rotary
    row = {"case": pc.name, "policy": tp.prologue_candidates(args)[0]}
    before = args.qkv.clone()
    tp.run_prologue(args)
    w64 = [None if w is None else w.double().requires_grad_(pc.backward) for w in inp.weights]
    x64 = before.double().requires_grad_(pc.backward)
    rq, rk, rv, nq, nk = prologue_reference_gpu(inp, args, x64, w64)
    if pc.inplace:
        heads = as_bs(args.qkv, pc).unflatten(-1, (pc.hq + 2 * pc.hk, pc.D))
        q, k, v = heads.split([pc.hq, pc.hk, pc.hk], dim=-2)
    else:
        q, k, v = (as_bs(t, pc) for t in (args.q_out, args.k_out, args.v_out))
        if not torch.equal(args.qkv, before):
            FAILURES.append(f"{pc.name}: out-of-place call modified qkv")
    worst = 0.0
    for out, ref, normed, w, name in ((q, rq, nq, inp.weights[0], "q"),
                                      (k, rk, nk, inp.weights[1], "k")):
        worst = max(worst, prologue_close(f"{pc.name} {name}", out, ref.detach(), normed.detach(),
                                          R, pc.style, dtype, exact_tail=w is None))
    if not torch.equal(v.double(), rv.detach()):
        FAILURES.append(f"{pc.name}: v differs from the input's v heads")
    row["forward"] = round(worst, 3)
    if pc.cache:
        slots = args.slots.reshape(-1)
        got_k, got_v = inp.k_cache[slots], inp.v_cache[slots]
        if pc.cache == "float8_e4m3fn":
            for got, ref, scale, name in ((got_k, rk, args.k_scale, "k"),
                                          (got_v, rv, args.v_scale, "v")):
                want = ref.detach().reshape(got.shape) / scale
                if ((got.double() - want).abs() > want.abs() * 2.0 ** -4 + 2.0 ** -10).any():
                    FAILURES.append(f"{pc.name}: fp8 {name} cache beyond half an e4m3 ulp")
        elif not (torch.equal(got_k, k.reshape(got_k.shape))
                  and torch.equal(got_v, v.reshape(got_v.shape))):
            FAILURES.append(f"{pc.name}: cache rows differ from the returned k, v")
    if pc.backward:
        got = tp.run_prologue_backward(args, *grads)
        torch.autograd.backward((rq, rk, rv), [as_bs(t, pc).double() for t in grads])
        for g, ref, gdtype, rel, name in ((got[0], x64.grad, dtype, 1e-5, "d qkv"),
                                          (got[1], w64[0].grad if w64[0] is not None else None,
                                           torch.float32, 1e-4, "d q_norm"),
                                          (got[2], w64[1].grad if w64[1] is not None else None,
                                           torch.float32, 1e-4, "d k_norm")):
            if ref is None:
                continue
            bound = rel * ref.abs().max().clamp_min(1.0) + ulp(ref, gdtype)
            ratio = float(((g.double() - ref).abs() / bound).max())
            row[name] = round(ratio, 3)
            if not ratio <= 1.0:
                FAILURES.append(f"{pc.name} {name}: error {ratio:.2f} x the allowance")
    del inp
    torch.cuda.empty_cache()
    return row


def as_bs(t: torch.Tensor, pc: PrologueCase) -> torch.Tensor:
    return t if pc.batch else t.unsqueeze(0)


def prologue_n_sets(pc: PrologueCase) -> int:
    return max(2, min(64, math.ceil(L2_ROTATION_BYTES / max(pc.data_bytes(), 1))))


def table_free_sets(inp: PrologueInputs) -> list:
    """The input sets' arguments with an empty table: every angle computed from freq_turns (the
    decode's position -> table row load out of its chain; the same angles to float32 rounding)."""
    return [a._replace(cos=a.cos[:0], sin=a.sin[:0]) for a, _ in inp.sets]


def prologue_fns(inp: PrologueInputs, label=None, max_registers="policy", backward=None) -> list:
    """The timed calls of a prologue case, one per input set (forward, then the backward).
    ``backward``: a tp.BackwardCandidate for the backward (the forward then the policy's)."""
    from rope_ops_backends.triton_backend import prologue as tp

    cap = tp.PROLOGUE_MAX_REGISTERS if max_registers == "policy" else max_registers
    # the backward's configuration: the candidate's, else the forward's label (None: the policy)
    bwd_label, stages, per_sm = (label, None, None) if backward is None else backward
    fwd_label = label if backward is None else None
    fns = []
    for args, grads in inp.sets:
        if inp.pc.backward:
            fns.append(lambda a=args, g=grads: (
                tp.run_prologue(a, fwd_label, cap),
                tp.run_prologue_backward(a, *g, bwd_label, cap, programs_per_sm=per_sm,
                                         stages=stages)))
        else:
            fns.append(lambda a=args: tp.run_prologue(a, label, cap))
    return fns


def unfused_fns(inp: PrologueInputs) -> list:
    """The same forward unfused: split views, torch's RMSNorm per head, rope_ops.apply on the
    triton backend, v made contiguous (the baseline the fusion saves passes over)."""
    import rope_ops

    pc = inp.pc
    rope = rope_ops.RotaryEmbedding(pc.D, rotary_dim=pc.rotary, base=500000.0,
                                    max_position=TABLE_ROWS, style=pc.style,
                                    device=inp.cos.device)
    ws = [None if w is None else w.to(pc.torch_dtype) for w in inp.weights]
    fns = []
    for args, _ in inp.sets:
        def fn(a=args):
            heads = a.qkv.unflatten(-1, (pc.hq + 2 * pc.hk, pc.D))
            q, k, v = heads.split([pc.hq, pc.hk, pc.hk], dim=-2)
            if ws[0] is not None:
                q = torch.nn.functional.rms_norm(q, (pc.D,), ws[0], 1e-6)
            if ws[1] is not None:
                k = torch.nn.functional.rms_norm(k, (pc.D,), ws[1], 1e-6)
            rope_ops.apply(q, k, a.pos, rope=rope, backend="triton")
            v.contiguous()
        fns.append(fn)
    return fns


def hf_compiled_fns(inp: PrologueInputs) -> list:
    """The same forward as Hugging Face's Qwen3 attention runs it (q_norm / k_norm modules on the
    projections' head views, apply_rotary_pos_emb with the model's per-token cos/sin, computed
    once per model call and so outside the timed function), under torch.compile(fullgraph=True);
    q, k and v come out contiguous, as the fused op's do. NeoX style only."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    pc = inp.pc
    norms = []
    for w in inp.weights:
        norm = torch.nn.Identity()
        if w is not None:
            norm = Qwen3RMSNorm(pc.D, eps=1e-6).to(device=inp.cos.device, dtype=pc.torch_dtype)
            with torch.no_grad():
                norm.weight.copy_(w)
        norms.append(norm)

    def prologue(qkv, cos, sin):
        lead = qkv.shape[:-1]
        q, k, v = qkv.split([pc.hq * pc.D, pc.hk * pc.D, pc.hk * pc.D], dim=-1)
        q = norms[0](q.view(*lead, pc.hq, pc.D)).transpose(-3, -2)
        k = norms[1](k.view(*lead, pc.hk, pc.D)).transpose(-3, -2)
        v = v.view(*lead, pc.hk, pc.D)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=-3)
        return q.transpose(-3, -2).contiguous(), k.transpose(-3, -2).contiguous(), v.contiguous()

    compiled = torch.compile(prologue, fullgraph=True)
    full = torch.cat([inp.cos, inp.cos], dim=-1), torch.cat([inp.sin, inp.sin], dim=-1)
    fns = []
    for args, _ in inp.sets:
        pos = args.pos.long()
        cos, sin = (t[pos].to(pc.torch_dtype) for t in full)  # HF's [.., S, D] rows in the model dtype
        fns.append(lambda a=args, c=cos, s=sin: compiled(a.qkv, c, s))
    return fns


def baseline_fns(inp: PrologueInputs) -> dict:
    """The passes the fusion replaces, timed beside it on the out-of-place forward cases without
    a cache: {row key: (label, fns)} (Hugging Face's prologue for NeoX only)."""
    pc = inp.pc
    if pc.backward or pc.cache or pc.inplace:
        return {}
    out = {"unfused_us": ("unfused", unfused_fns(inp))}
    if pc.style == "neox":
        out["hf_compiled_us"] = ("HF Qwen3 compiled", hf_compiled_fns(inp))
    return out


def time_prologue(pc: PrologueCase, study: bool, deadline: float) -> dict:
    """GPU time of the policy's launch against a same-run copy of the bytes that must move; the
    policy without the register cap; the unfused pipeline (forward cases); every candidate
    configuration while time is left before ``deadline``."""
    from rope_ops_backends.triton_backend import prologue as tp

    inp = PrologueInputs(pc, prologue_n_sets(pc))
    moved = pc.data_bytes()
    copy = copy_us(moved)
    us = graph_us(prologue_fns(inp))
    labels = tp.prologue_candidates(inp.sets[0][0])
    row = {"case": pc.name, "MB": round(moved / 1e6, 1), "us": round(us, 2),
           "copy_us": round(copy, 2), "pct_copy": round(100 * copy / us, 1), "policy": labels[0]}
    row["no_register_cap_us"] = round(graph_us(prologue_fns(inp, max_registers=None), iters=3), 2)
    for key, (_, fns) in baseline_fns(inp).items():
        row[key] = round(graph_us(fns, iters=3), 2)
    if study:
        time_candidates(row, labels, lambda label, inp=inp: graph_us(
            prologue_fns(inp, label), iters=3), deadline)
    if study and pc.cache:
        free = table_free_sets(inp)
        row["table_free_us"] = round(graph_us([lambda a=a: tp.run_prologue(a) for a in free],
                                              iters=3), 2)
    if study and pc.backward:  # the backward's own neighbours, the forward as the policy has it
        cands = {c.describe(): c for c in tp.backward_candidates(inp.sets[0][0])}
        sub = {}
        time_candidates(sub, list(cands), lambda d, inp=inp: graph_us(
            prologue_fns(inp, backward=cands[d]), iters=3), deadline)
        row["backward_candidates"] = sub["candidates"]
        if "best" in sub:
            row["backward_best"], row["backward_best_us"] = sub["best"], sub["best_us"]
    del inp
    torch.cuda.empty_cache()
    return row


def warm_prologue(names: list[str], study: bool) -> None:
    """Compile the prologue kernels of these cases (policy, uncapped, and with --prologue's
    study every candidate) by running each once on the case's shapes."""
    from rope_ops_backends.triton_backend import prologue as tp

    for pc in PROLOGUE_CASES:
        if pc.name not in names:
            continue
        inp = PrologueInputs(pc, 1)
        runs = [("policy",), (None,)]
        if study and pc.timed:
            runs += [(label,) for label in tp.prologue_candidates(inp.sets[0][0])]
        for run in runs:
            if run[0] == "policy":
                fns = prologue_fns(inp)
            elif run[0] is None:
                fns = prologue_fns(inp, max_registers=None)
            else:
                fns = prologue_fns(inp, run[0])
            fns[0]()
        del inp
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# GPU time.


def graph_us(fns, iters=5, calls=48) -> float:
    """Per-call GPU time: `calls` calls (cycling fns) captured in one CUDA graph, best replay.
    Every fn runs before the capture (a launch's first call compiles or loads its kernel)."""
    warm_up(fns, rounds=1)
    return graph_seconds_per_call(fns, calls, repeats=iters, reduce=min) * 1e6


def copy_us(nbytes: int) -> float:
    """A copy kernel moving nbytes in all (nbytes / 2 read, nbytes / 2 written), the best of a
    few block sizes (rope_ops.bench's floor: a copy torch captures in a graph may run on the copy
    engines, slower than the SMs)."""
    from rope_ops.bench.floors import copy_kernel_time

    n_sets = max(2, min(64, math.ceil(L2_ROTATION_BYTES / nbytes)))
    seconds, _ = copy_kernel_time(max(4, nbytes // 2), "cuda", n_sets)
    return seconds * 1e6


def time_candidates(row: dict, labels, us_of, deadline: float = math.inf) -> None:
    """row["candidates"]: us_of(label), the GPU time of each configuration, while time is left
    before ``deadline``; row["best"] and row["best_us"]: the fastest of those that ran."""
    row["candidates"] = {}
    for label in labels:
        if time.time() > deadline:
            row["candidates"][label] = "skipped: budget"
            continue
        try:
            row["candidates"][label] = round(us_of(label), 2)
        except Exception as e:  # a candidate that fails is a note, not a failure
            row["candidates"][label] = f"{type(e).__name__}: {str(e)[:60]}"
    timed = {k: v for k, v in row["candidates"].items() if isinstance(v, float)}
    if timed:
        row["best"] = min(timed, key=timed.get)
        row["best_us"] = timed[row["best"]]


def case_fns(inp: Inputs, run) -> list:
    """The timed calls of a case, one per input set: run(args) forward, then the backward."""
    fns = []
    for i in range(len(inp.sets)):
        a = inp.args(i)
        if inp.case.backward:
            b = inp.args(i, inverse=True)
            fns.append(lambda a=a, b=b: (run(a), run(b)))
        else:
            fns.append(lambda a=a: run(a))
    return fns


def n_sets_for(case: Case) -> int:
    return max(2, min(64, math.ceil(L2_ROTATION_BYTES / max(case.data_bytes(), 1))))


def time_case(case: Case, backend, study: bool) -> dict:
    inp = Inputs(case, n_sets_for(case))
    moved = case.data_bytes() * (2 if case.backward else 1)
    copy = copy_us(moved)
    us = graph_us(case_fns(inp, backend.run))
    row = {"case": case.name, "MB": round(moved / 1e6, 1), "us": round(us, 2),
           "copy_us": round(copy, 2), "pct_copy": round(100 * copy / us, 1),
           "policy": tb.kernel_candidates(inp.args(0))[0]}
    if study:
        time_candidates(row, tb.kernel_candidates(inp.args(0)), lambda label, inp=inp: graph_us(
            case_fns(inp, lambda a: tb.run_with(a, label)), iters=3))
    del inp
    torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------------------------------------
# Host time.


def host_us(fn, n=2000) -> float:
    """Wall time per call of a plain loop, best of three, synchronised at the end of each."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def host_times() -> dict:
    import rope_ops

    case = CASES[1]  # W2
    inp = Inputs(case, 1)
    q, k, qo, ko, pos, _, _ = inp.sets[0]
    rope = rope_ops.RotaryEmbedding(128, base=500000.0, max_position=TABLE_ROWS, device="cuda")
    cos, sin, turns, m = rope.tables(q.device)
    backend = tb.TritonBackend()
    args = KernelArgs(q, k, qo, ko, pos, 0, cos, sin, turns, m, "thd", 128, False, False, False)
    backend.run(args)
    launch = next(iter(backend._launches.values()))
    bound = backend.bind(cos, sin, turns, m, "thd", 128, False, False)
    bound(q, k, pos, 0)
    guard = bound.guarded(q, k, pos)
    state = tb._kernels()
    out = {
        "rope_ops.apply eager (W2)": host_us(lambda: rope_ops.apply(q, k, pos, rope=rope,
                                                                     backend="triton")),
        "guard(q, k, pos)": host_us(lambda: guard(q, k, pos)) if guard else "no guard",
        "bound(q, k, pos, 0)": host_us(lambda: bound(q, k, pos, 0)),
        "backend.run, outputs given": host_us(lambda: backend.run(args)),
        "direct launch alone": host_us(lambda: launch(q, k, qo, ko, pos, cos, sin, turns, 0, m)),
        "torch.empty_like(q), (k)": host_us(lambda: (torch.empty_like(q), torch.empty_like(k))),
    }
    saved = state["direct"]
    state["direct"] = False
    try:
        out["launch through triton's JIT"] = host_us(
            lambda: launch(q, k, qo, ko, pos, cos, sin, turns, 0, m), n=500)
    finally:
        state["direct"] = saved
    out["direct launch on"] = bool(state["direct"]) and launch.compiled is not None
    return out


# ---------------------------------------------------------------------------------------------
# Parallel compile and unit-test shards.


def warm_worker(names: list[str], study: bool, prologue_study: bool) -> None:
    """Compile the kernels of these cases (policy, and with --study every candidate) by
    launching each once on the case's own shapes: the specialization is the same. The
    variants' and the prologue's cases too (with --prologue every prologue candidate)."""
    backend = tb.TritonBackend()
    for vc in VARIANT_CASES:
        if vc.name in names:
            make, q, k, _, _ = variant_inputs(vc, torch.Generator(device="cuda").manual_seed(0))
            for inverse in (False, True):
                backend.run(make(q, k, torch.empty_like(q), torch.empty_like(k), inverse))
    warm_prologue(names, prologue_study)
    for case in CASES:
        if case.name not in names:
            continue
        inp = Inputs(case, 1)
        labels = tb.kernel_candidates(inp.args(0)) if study else []
        for inverse in ((False, True) if case.backward else (False,)):
            backend.run(inp.args(0, inverse))
            for label in labels:
                tb.run_with(inp.args(0, inverse), label)
        del inp
        torch.cuda.empty_cache()
    torch.cuda.synchronize()


def _spawn(label: str, cmd: list[str], env: dict) -> tuple:
    log_file = tempfile.TemporaryFile(mode="w+")  # not a pipe: a full pipe would stall the child
    return label, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_file,
                                   stderr=subprocess.STDOUT, text=True), log_file


def start_processes(jobs: int, study: bool, unit_tests: bool, conformance: bool,
                    prologue: bool) -> list:
    """Compile workers (the cases split among them) and test shards (the unit tests and the
    conformance suite's tests, split among them), started at once."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    procs = []
    names = [c.name for c in CASES] + [c.name for c in VARIANT_CASES] + \
        [c.name for c in PROLOGUE_CASES]
    testing = unit_tests or conformance
    n_warm = max(1, jobs // 3) if testing else jobs
    for w in range(n_warm):
        mine = names[w::n_warm]
        cmd = [sys.executable, __file__, "--warm", json.dumps(mine)] + \
            (["--study"] if study else []) + (["--prologue"] if prologue else [])
        procs.append(_spawn("compile " + ", ".join(mine), cmd, env))
    if testing:
        targets = (["tests/test_triton_backend.py", "tests/test_triton_variants.py",
                    "tests/test_triton_prologue.py"] if unit_tests else []) + \
                  (["rope_ops.testing"] if conformance else [])
        pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                  "--rope-backend", "triton"]
        collect = subprocess.run(pytest + ["--collect-only", "--pyargs", *targets], cwd=ROOT,
                                 env=env, capture_output=True, text=True)
        ids = [line for line in collect.stdout.splitlines() if "::" in line]
        if not ids:
            FAILURES.append("pytest collected no tests:\n" + collect.stdout[-2000:]
                            + collect.stderr[-2000:])
        n_shards = max(1, jobs - n_warm)
        for i in range(n_shards):
            if ids[i::n_shards]:
                procs.append(_spawn(f"test shard {i + 1}/{n_shards}", pytest + ids[i::n_shards],
                                    env))
        log(f"{len(ids)} tests in {n_shards} shards, {n_warm} compile workers")
    return procs


def wait_processes(procs, deadline_s: float, required: bool = True) -> None:
    """Wait for each until deadline_s after the start; one still running then is killed, a
    failure if required (a compile worker is not: what it left, the JIT compiles later)."""
    for label, p, log_file in procs:
        try:
            p.wait(timeout=max(5.0, deadline_s - (time.time() - T0)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            if not required:
                log(f"{label}: stopped at the deadline")
                continue
            FAILURES.append(f"{label}: timed out")
        log_file.seek(0)
        out = log_file.read()
        tail = " | ".join(out.strip().splitlines()[-2:])
        log(f"{label}: exit {p.returncode}: {tail[-200:]}")
        if p.returncode != 0 and required:
            FAILURES.append(f"{label} failed:\n{out[-3000:]}")


# ---------------------------------------------------------------------------------------------


def host_cpu() -> int:
    """The Python path's cost per call on this CPU, with a launcher that does nothing: what the
    backend adds around triton's launcher (checks, keys, allocation), W2 shapes, float32."""
    import rope_ops

    if not tb._INTERPRET:
        print("--host-cpu needs TRITON_INTERPRET=1 (CPU tensors)")
        return 2

    class NoLauncher:  # stands for a CompiledKernel: function, packed_metadata, run()
        function, packed_metadata = 0, ()

        def run(self, *args):
            pass

    class NoHooks:
        launch_enter_hook = launch_exit_hook = None

    q, k = torch.randn(256, 32, 128), torch.randn(256, 8, 128)
    pos = torch.randint(0, 32768, (256,))
    rope = rope_ops.RotaryEmbedding(128, base=500000.0, max_position=TABLE_ROWS)
    cos, sin, turns, m = rope.tables(q.device)
    backend = tb.TritonBackend()
    args = KernelArgs(q, k, torch.empty_like(q), torch.empty_like(k), pos, 0, cos, sin, turns, m,
                      "thd", 128, False, False, False)
    bound = backend.bind(cos, sin, turns, m, "thd", 128, False, False)
    guard = bound.guarded(q, k, pos)
    rope_ops.apply(q, k, pos, rope=rope, backend="triton")  # makes apply's plan and guard
    rope_ops.apply(q, k, pos, rope=rope, backend="triton")
    backend.run(args)
    bound(q, k, pos, 0)
    state = tb._kernels()
    state.update(direct=True, runtime=NoHooks(), stream=lambda index: 0)
    launches = list(backend._launches.values()) + list(bound.launches.values())
    for plan, _ in rope._plans.values():
        launches += list(getattr(plan, "launches", {}).values())
    for launch in launches:
        launch.compiled = NoLauncher()
    launch = launches[0]

    def per_call(fn, n=3000):
        best = math.inf
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t) / n)
        return best * 1e6

    rows = {
        "rope_ops.apply eager (guard path)": lambda: rope_ops.apply(q, k, pos, rope=rope,
                                                                      backend="triton"),
        "guard(q, k, pos)": lambda: guard(q, k, pos),
        "bound(q, k, pos, 0)": lambda: bound(q, k, pos, 0),
        "backend.run, outputs given": lambda: backend.run(args),
        "_Launch call (no launcher)": lambda: launch(q, k, args.q_out, args.k_out, pos, cos, sin,
                                                     turns, 0, m),
        "torch.empty_like(q), (k)": lambda: (torch.empty_like(q), torch.empty_like(k)),
    }
    print(f"host cost per call without triton's launcher, W2 shapes on this CPU "
          f"(torch {torch.__version__}):")
    for label, fn in rows.items():
        print(f"   {label:36s} {per_call(fn):6.2f} us")
    return 0


def smoke() -> int:
    """The checks of step 3 on tiny versions of the cases, through the Triton interpreter."""
    global DEVICE, CASES, TABLE_ROWS, VARIANT_CASES, PROLOGUE_CASES, CACHE_SLOTS
    if not tb._INTERPRET:
        print("--smoke needs TRITON_INTERPRET=1")
        return 2
    DEVICE, TABLE_ROWS, CACHE_SLOTS = "cpu", 64, 16
    CASES = [replace(c, B=min(c.B, 2), S=min(c.S, 3), hq=min(c.hq, 5), hk=min(c.hk, 3))
             for c in CASES]
    VARIANT_CASES = [replace(c, B=min(c.B, 2), S=min(c.S, 5), hq=min(c.hq, 3), hk=min(c.hk, 2),
                             D=32, section=(4, 6, 6) if c.interleaved else (8, 4, 4))
                     for c in VARIANT_CASES]
    PROLOGUE_CASES = [replace(c, T=6, hq=3, hk=1, D=min(c.D, 32), R=min(c.R, 16),
                              batch=min(c.batch, 2), section=(8, 4, 4)) for c in PROLOGUE_CASES]
    backend = tb.TritonBackend()
    for case in CASES:
        row = check_case(case, backend)
        log(f"check {case.name:28s} {row['policy']:22s} {row.get('forward')} {row.get('backward', '')}")
    check_apply_paths()
    for vc in VARIANT_CASES:
        row = check_variant(vc, backend)
        log(f"check {vc.name:28s} {row.get('forward')} {row.get('backward', '')}")
    for pc in PROLOGUE_CASES:
        row = check_prologue(pc)
        log(f"check {pc.name:28s} {row}")
    print("FAILED:\n  " + "\n  ".join(FAILURES) if FAILURES else "smoke checks passed")
    return 1 if FAILURES else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--no-pytest", action="store_true", help="skip the unit tests on CUDA")
    ap.add_argument("--conformance", action="store_true",
                    help="also the conformance suite (--rope-backend triton), in the test shards")
    ap.add_argument("--budget", type=float, default=540.0,
                    help="seconds: tests past 60 %% of it are killed (failures), timing and the "
                         "study stop before it ends")
    ap.add_argument("--study", action="store_true", help="time every candidate configuration")
    ap.add_argument("--prologue", action="store_true",
                    help="time the fused prologue's cases (policy, no register cap, unfused, "
                         "every candidate) before the rope cases")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                    help="processes: a third compile, the rest run test shards")
    ap.add_argument("--smoke", action="store_true",
                    help="without a GPU: TRITON_INTERPRET=1, the checks on tiny versions of the cases")
    ap.add_argument("--host-cpu", action="store_true",
                    help="without a GPU: TRITON_INTERPRET=1, the Python path's cost per call")
    ap.add_argument("--warm", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.host_cpu:
        return host_cpu()
    if opts.warm:
        warm_worker(json.loads(opts.warm), opts.study, opts.prologue)
        return 0
    if opts.smoke:
        return smoke()
    import triton

    log(f"torch {torch.__version__}, triton {triton.__version__}, "
        f"{torch.cuda.get_device_name()}, {tb.device_info(torch.device('cuda'))}")
    backend = tb.TritonBackend()
    reasons = backend.availability()
    if reasons:
        print("Triton backend unavailable:", reasons)
        return 1
    results: dict = {"triton": triton.__version__, "torch": torch.__version__,
                     "gpu": torch.cuda.get_device_name()}

    procs = start_processes(opts.jobs, opts.study, not opts.no_pytest, opts.conformance,
                            opts.prologue)
    compiling = [p for p in procs if p[0].startswith("compile")]
    wait_processes(compiling, deadline_s=0.35 * opts.budget, required=False)
    log("kernels compiled")
    results["accuracy"] = []
    for case in CASES:
        row = check_case(case, backend)
        results["accuracy"].append(row)
        log(f"check {case.name:28s} {row['policy']:22s} worst error / allowance: "
            f"{row.get('forward')} {row.get('backward', '')}")
    check_apply_paths()
    for vc in VARIANT_CASES:
        row = check_variant(vc, backend)
        results["accuracy"].append(row)
        log(f"check {vc.name:28s} worst error / allowance: {row.get('forward')} "
            f"{row.get('backward', '')}")
    for pc in PROLOGUE_CASES:
        row = check_prologue(pc)
        results["accuracy"].append(row)
        log(f"check {pc.name:28s} {row['policy']:22s} worst error / allowance: "
            + ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("case", "policy")))
    wait_processes([p for p in procs if p not in compiling], deadline_s=0.6 * opts.budget)

    # Timing only now: nothing else uses the GPU.
    results["prologue_time"] = []
    if opts.prologue:
        for pc in PROLOGUE_CASES:
            if not pc.timed:
                continue
            if time.time() - T0 > opts.budget - 60:
                results["prologue_time"].append({"case": pc.name, "skipped": "budget"})
                continue
            row = time_prologue(pc, True, T0 + opts.budget - 60)
            results["prologue_time"].append(row)
            extra = f"  best {row['best']} {row['best_us']} us" if "best" in row else ""
            log(f"time {pc.name:28s} {row['us']:9.2f} us  copy {row['copy_us']:9.2f} us  "
                f"{row['pct_copy']:5.1f} % copy  {row['policy']}{extra}")
    results["time"] = []
    for case in CASES:
        if time.time() - T0 > opts.budget - 40:
            results["time"].append({"case": case.name, "skipped": "budget"})
            continue
        study = opts.study and time.time() - T0 < opts.budget - 90
        row = time_case(case, backend, study)
        results["time"].append(row)
        extra = f"  best {row['best']} {row['best_us']} us" if "best" in row else ""
        log(f"time {case.name:28s} {row['us']:9.2f} us  copy {row['copy_us']:9.2f} us  "
            f"{row['pct_copy']:5.1f} % copy  {row['policy']}{extra}")
    results["host_us"] = host_times()

    print("\n=== summary (send back) ===")
    print(f"triton {results['triton']}, torch {results['torch']}, {results['gpu']}")
    print(f"{'case':30s} {'MB':>8s} {'us':>9s} {'copy us':>9s} {'% copy':>7s}  policy"
          + ("  [best candidate: us]" if opts.study else ""))
    for r in results["time"]:
        if "skipped" in r:
            print(f"{r['case']:30s} skipped ({r['skipped']})")
            continue
        note = ""
        if r["MB"] >= 64:
            target = 92 if r["case"] in ("W1", "W4 fwd+bwd", "W5") else 90
            note = "" if r["pct_copy"] >= target else f"  below {target} %"
        if "best" in r:
            note += f"  [{r['best']}: {r['best_us']}]"
        print(f"{r['case']:30s} {r['MB']:8.1f} {r['us']:9.2f} {r['copy_us']:9.2f} "
              f"{r['pct_copy']:6.1f}%  {r['policy']}{note}")
    print("targets: >= 90 % of copy on cases >= 64 MB (W1, W4, W5 >= 92 %); W2 <= 4 us/call")
    if results["prologue_time"]:
        print(f"{'prologue case':30s} {'MB':>8s} {'us':>9s} {'copy us':>9s} {'% copy':>7s}  "
              f"policy  [no cap us] [unfused us] [best candidate: us]")
        for r in results["prologue_time"]:
            if "skipped" in r:
                print(f"{r['case']:30s} skipped ({r['skipped']})")
                continue
            note = "" if r["MB"] < 64 or r["pct_copy"] >= 85 else "  below 85 %"
            note += f"  [no cap {r['no_register_cap_us']}]"
            if "unfused_us" in r:
                note += f"  [unfused {r['unfused_us']}]"
            if "hf_compiled_us" in r:
                note += f"  [HF Qwen3 compiled {r['hf_compiled_us']}]"
            if "best" in r:
                note += f"  [{r['best']}: {r['best_us']}]"
            if "table_free_us" in r:
                note += f"  [angles without the table {r['table_free_us']}]"
            if "backward_best" in r:
                note += f"  [backward {r['backward_best']}: {r['backward_best_us']}]"
            print(f"{r['case']:30s} {r['MB']:8.1f} {r['us']:9.2f} {r['copy_us']:9.2f} "
                  f"{r['pct_copy']:6.1f}%  {r['policy']}{note}")
        print("prologue target (PERF.md): >= 85 % of copy on prefill and training")
    print("host time per call (W2):")
    for k_, v in results["host_us"].items():
        print(f"   {k_:36s} {v if not isinstance(v, float) else f'{v:.2f} us'}")
    print("target: rope_ops.apply eager <= 20 us")
    print(f"total {time.time() - T0:.0f} s")
    results["failures"] = FAILURES
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=1))
    if FAILURES:
        print("FAILED checks:")
        for f in FAILURES:
            print("  ", f[:3000])
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
