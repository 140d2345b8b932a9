"""Check and time the Triton backend on a CUDA GPU (PERF.md workloads W1-W5).

    python tools/gpu_triton_check.py            # checks, then timings (about 2-3 minutes)
    python tools/gpu_triton_check.py --no-sweep # skip the block-size sweep
    python tools/gpu_triton_check.py --no-pytest

1. Correctness: tests/test_triton_backend.py on CUDA tensors (subprocess), then W1-W5 at full size
   against a float64 reference computed on the GPU, each run twice (the first call goes through
   triton's JIT launch, the second through the backend's cached direct launch; both must match
   the reference, and each other bitwise).
2. GPU time: each call captured in a CUDA graph, replay time / calls, rotating input sets so L2
   does not hold them; reported as a share of a same-run 2 GiB device-to-device copy
   (bytes read + written), side by side with Liger-Kernel's rope and torch.compile of the
   Hugging Face eager form where those run.
3. Host time: wall time per call of a plain Python loop (backend.run, and rope_ops.apply if the
   core provides it).

Exit status 1 when a correctness check failed (timings never fail the run; targets are printed).
Smoke test without a GPU: TRITON_INTERPRET=1 python tools/gpu_triton_check.py --device cpu
(tiny shapes, checks only).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rope_ops import bench  # noqa: E402
from rope_ops.backend import KernelArgs  # noqa: E402
from rope_ops.frequencies import compute_inv_freq, cos_sin_table, freq_turns_of  # noqa: E402

try:
    import rope_ops_backends.triton_backend as tb  # noqa: E402
except ImportError:  # a checkout that is not pip-installed: backends/ is the package
    import importlib

    sys.modules["rope_ops_backends"] = importlib.import_module("backends")
    import rope_ops_backends.triton_backend as tb  # noqa: E402

T0 = time.time()
FAILURES: list[str] = []
ROWS: list[tuple] = []


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# ---------------------------------------------------------------------------------------------
# Tables


def inv_freq_of(rotary_dim, base):
    return compute_inv_freq(rotary_dim, base)[0]


def tables(inv_freq, n_rows, device, m=1.0):
    cos, sin = cos_sin_table(inv_freq, m, n_rows)
    return cos.to(device), sin.to(device)


# ---------------------------------------------------------------------------------------------
# Workloads (PERF.md)


def workloads(tiny: bool):
    # name, layout, B, S, hq, hk, D, R, style, base, pos kind, n_rows
    if tiny:
        return [
            ("W1", "bshd", 2, 8, 4, 2, 16, 16, "neox", 500000.0, "offset", 64),
            ("W2", "thd", 1, 6, 4, 2, 16, 16, "neox", 500000.0, "random", 64),
            ("W3", "bshd", 2, 8, 2, 2, 32, 8, "gptj", 10000.0, "offset", 64),
            ("W4", "bshd", 2, 8, 4, 4, 16, 16, "neox", 500000.0, "offset", 64),
            ("W5", "bshd", 2, 8, 8, 2, 16, 16, "neox", 500000.0, "offset", 64),
        ]
    return [
        ("W1", "bshd", 4, 4096, 32, 8, 128, 128, "neox", 500000.0, "offset", 131072),
        ("W2", "thd", 1, 256, 32, 8, 128, 128, "neox", 500000.0, "random", 131072),
        ("W3", "bshd", 2, 4096, 16, 16, 256, 64, "gptj", 10000.0, "offset", 131072),
        ("W4", "bshd", 2, 4096, 32, 32, 128, 128, "neox", 500000.0, "offset", 131072),
        ("W5", "bshd", 8, 4096, 64, 8, 128, 128, "neox", 500000.0, "offset", 131072),
    ]


class Work:
    def __init__(self, spec, device, n_sets, gen_seed=0):
        (self.name, self.layout, self.B, self.S, self.hq, self.hk, self.D, self.R, self.style,
         base, self.pos_kind, n_rows) = spec
        self.device = device
        self.inv_freq = inv_freq_of(self.R, base)
        self.cos, self.sin = tables(self.inv_freq, n_rows, device)
        self.turns = freq_turns_of(self.inv_freq).to(device)
        g = torch.Generator(device=device).manual_seed(gen_seed)
        shape = (lambda h: (self.B * self.S, h, self.D)) if self.layout == "thd" else (
            lambda h: (self.B, self.S, h, self.D))
        self.sets = []
        for _ in range(n_sets):
            q = torch.randn(shape(self.hq), generator=g, device=device, dtype=torch.bfloat16)
            k = torch.randn(shape(self.hk), generator=g, device=device, dtype=torch.bfloat16)
            if self.pos_kind == "random":
                pos = torch.randint(0, 32768, (self.B * self.S,), generator=g, device=device)
            else:
                pos = None
            self.sets.append((q, k, torch.empty_like(q), torch.empty_like(k), pos))

    def args(self, i, inverse=False, inplace=False, q=None, k=None):
        q0, k0, qo, ko, pos = self.sets[i]
        q = q0 if q is None else q
        k = k0 if k is None else k
        if inplace:
            qo, ko = q, k
        return KernelArgs(q=q, k=k, q_out=qo, k_out=ko, pos=pos, pos_offset=0, cos=self.cos,
                          sin=self.sin, freq_turns=self.turns, attention_factor=1.0,
                          layout=self.layout, rotary_dim=self.R,
                          interleaved=self.style == "gptj", inverse=inverse, inplace=inplace)

    def positions_bs(self, i):
        pos = self.sets[i][4]
        if pos is None:
            return torch.arange(self.S, device=self.device).expand(self.B, self.S)
        return pos.view(self.B, self.S)

    def io_bytes(self, rotary_only=False):
        d = self.R if rotary_only else self.D
        return 2 * 2 * self.B * self.S * (self.hq + self.hk) * d  # read + write, bf16


def reference_bshd(x, pos_bs, inv_freq, R, style, inverse=False):
    """float64 rotation of x (a [B,S,H,D] view), on x's device: independent of the kernel."""
    x64 = x.double()
    theta = pos_bs.double()[..., None] * inv_freq.to(x.device)[None, None, :]  # [B,S,R/2]
    c, s = torch.cos(theta)[:, :, None, :], torch.sin(theta)[:, :, None, :]
    if inverse:
        s = -s
    half = R // 2
    idx = torch.arange(half, device=x.device)
    a_i, b_i = (idx, idx + half) if style == "neox" else (2 * idx, 2 * idx + 1)
    out = x64.clone()
    a, b = x64[..., a_i], x64[..., b_i]
    out[..., a_i] = a * c - b * s
    out[..., b_i] = b * c + a * s
    return out


def check_close(name, out, inp, ref, R, style):
    """SPEC accuracy (bf16: 1 ulp at the reference + 2e-6 * max(1, |x|+|y|)); pass-through exact."""
    if not torch.equal(out[..., R:], inp[..., R:]):
        FAILURES.append(f"{name}: pass-through dims changed")
    o = out[..., :R].double()
    r = ref[..., :R]
    x = inp[..., :R].double()
    idx = torch.arange(R, device=out.device)
    partner = torch.where(idx < R // 2, idx + R // 2, idx - R // 2) if style == "neox" else idx ^ 1
    allow = 2e-6 * (x.abs() + x[..., partner].abs()).clamp_min(1.0)
    a = r.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    allow = allow + torch.exp2(torch.floor(torch.log2(a)) - 7)
    err = (o - r).abs()
    n_bad = int((err > allow).sum())
    if n_bad:
        FAILURES.append(f"{name}: {n_bad} elements out of tolerance (max err {float(err.max()):.3g})")
    return float(err.max())


def check_workload(w: Work, backend):
    """Each workload through the JIT launch, then the cached direct launch: both vs float64."""
    as4 = (lambda t: t.unsqueeze(0)) if w.layout == "thd" else (lambda t: t)
    for inverse, inplace in ((False, False), (True, False), (False, True)):
        if inplace and w.name not in ("W3", "W1"):
            continue
        q, k, qo, ko, pos = w.sets[0]
        results = []
        for attempt in range(2):
            qi, ki = q.clone(), k.clone()
            if inplace:
                backend.run(w.args(0, inverse, True, qi, ki))
                got = (qi.clone(), ki.clone())
            else:
                qo.fill_(float("nan"))
                ko.fill_(float("nan"))
                backend.run(w.args(0, inverse, False, qi, ki))
                got = (qo.clone(), ko.clone())
                if not (torch.equal(qi, q) and torch.equal(ki, k)):
                    FAILURES.append(f"{w.name}: out-of-place call modified its inputs")
            results.append(got)
        torch.cuda.synchronize() if w.device == "cuda" else None
        tag = f"{w.name}{' inverse' if inverse else ''}{' inplace' if inplace else ''}"
        if not (torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])):
            FAILURES.append(f"{tag}: direct launch differs from the JIT launch")
        pos_bs = w.positions_bs(0)
        errs = []
        for got, inp in ((results[1][0], q), (results[1][1], k)):
            ref = reference_bshd(as4(inp), pos_bs, w.inv_freq, w.R, w.style, inverse)
            errs.append(check_close(tag, as4(got), as4(inp), ref, w.R, w.style))
        log(f"check {tag:18s} max|err| q {errs[0]:.2e} k {errs[1]:.2e}")


# ---------------------------------------------------------------------------------------------
# Timing


def graph_time_us(fns, reps=None, iters=5):
    """Per-call GPU time: `reps` rounds of the calls captured in one CUDA graph, best replay."""
    if reps is None:
        reps = max(1, 64 // len(fns))
    bench.warm_up(fns, rounds=2)
    return bench.graph_seconds_per_call(fns, reps * len(fns), iters, reduce=min) * 1e6


def copy_bandwidth():
    """Bytes read + written per second of a 2 GiB device-to-device copy (rope_ops.bench's)."""
    return bench.copy_bandwidth(torch.device("cuda"))


def same_bytes_copy_us(w: Work, rotary_only=False):
    nbytes = w.io_bytes(rotary_only) // 2
    n_sets = max(2, math.ceil(200e6 / max(nbytes, 1)))
    bufs = [(torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda"),
             torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")) for _ in range(n_sets)]
    return graph_time_us([lambda s=s, d=d: d.copy_(s) for s, d in bufs])


def host_us(fn, n=2000):
    return bench.host_time_per_call([fn], torch.device("cuda"), iterations=n) * 1e6


# Peers -----------------------------------------------------------------------------------------


def liger_fns(w: Work):
    """Liger's rope_forward (in place; q as the [B,H,S,D] view of the bshd storage)."""
    try:
        from liger_kernel.ops.rope import rope_backward, rope_forward
    except Exception as e:
        return None, f"liger not importable ({type(e).__name__})"
    if w.style != "neox" or w.R != w.D:
        return None, "liger: neox full rotary only"
    fns = []
    for i in range(len(w.sets)):
        q, k, _, _, _ = w.sets[i]
        q4, k4 = (q.unsqueeze(0), k.unsqueeze(0)) if w.layout == "thd" else (q, k)
        pos_bs = w.positions_bs(i)
        if w.layout == "thd":  # Liger has no varlen: decode as B tokens of length 1
            q4, k4 = q.unsqueeze(1), k.unsqueeze(1)
            pos_bs = pos_bs.reshape(-1, 1)
        cb = w.cos[pos_bs]  # [B, S, R/2]
        sb = w.sin[pos_bs]
        if w.pos_kind != "random":
            cb, sb = cb[:1], sb[:1]
        cos = torch.cat([cb, cb], -1).contiguous()
        sin = torch.cat([sb, sb], -1).contiguous()
        qt, kt = q4.transpose(1, 2), k4.transpose(1, 2)
        if w.name == "W4":
            fns.append(lambda qt=qt, kt=kt, c=cos, s=sin: (rope_forward(qt, kt, c, s),
                                                           rope_backward(qt, kt, c, s)))
        else:
            fns.append(lambda qt=qt, kt=kt, c=cos, s=sin: rope_forward(qt, kt, c, s))
    return fns, ""


def hf_rope(q, k, pos_bs, cos_t, sin_t, rotary_dim, gptj):
    """The Hugging Face eager form (bshd), fp32 cos/sin gathered from the table."""
    c = cos_t[pos_bs].unsqueeze(2)  # [B, S, 1, R/2]
    s = sin_t[pos_bs].unsqueeze(2)

    def rot(x):
        xr, xp = x[..., :rotary_dim], x[..., rotary_dim:]
        if gptj:
            cc = torch.repeat_interleave(c, 2, -1)
            ss = torch.repeat_interleave(s, 2, -1)
            x1, x2 = xr[..., ::2], xr[..., 1::2]
            rh = torch.stack((-x2, x1), -1).flatten(-2)
        else:
            cc = torch.cat([c, c], -1)
            ss = torch.cat([s, s], -1)
            x1, x2 = xr[..., : rotary_dim // 2], xr[..., rotary_dim // 2:]
            rh = torch.cat((-x2, x1), -1)
        out = (xr.float() * cc + rh.float() * ss).to(x.dtype)
        return torch.cat([out, xp], -1) if xp.shape[-1] else out

    return rot(q), rot(k)


def compile_fns(w: Work):
    try:
        f = torch.compile(hf_rope, dynamic=False)
    except Exception as e:
        return None, f"torch.compile unavailable ({type(e).__name__})"
    fns = []
    for i in range(len(w.sets)):
        q, k, _, _, _ = w.sets[i]
        q4, k4 = (q.unsqueeze(0), k.unsqueeze(0)) if w.layout == "thd" else (q, k)
        pos_bs = w.positions_bs(i).contiguous()
        if w.name == "W4":
            qg, kg = q4.detach().requires_grad_(), k4.detach().requires_grad_()
            gq, gk = torch.randn_like(q4), torch.randn_like(k4)

            def fb(qg=qg, kg=kg, pos=pos_bs, gq=gq, gk=gk):
                oq, ok = f(qg, kg, pos, w.cos, w.sin, w.R, w.style == "gptj")
                torch.autograd.backward((oq, ok), (gq, gk))
            fns.append(fb)
        else:
            fns.append(lambda q4=q4, k4=k4, pos=pos_bs: f(q4, k4, pos, w.cos, w.sin, w.R,
                                                          w.style == "gptj"))
    return fns, ""


# ---------------------------------------------------------------------------------------------


COPY_US: dict[str, float] = {}  # same-bytes copy time per workload ("W3 in place": rotary bytes)


def work_fns(w: Work, backend, inplace=False):
    """The timed calls of a workload, one per input set. W4: forward on q, k, then the backward
    (inverse) on gradients of the same shape into separate outputs."""
    n = len(w.sets)
    if w.name != "W4":
        return [lambda i=i: backend.run(w.args(i, inplace=inplace)) for i in range(n)]
    grads = [(torch.randn_like(s[0]), torch.randn_like(s[1])) for s in w.sets]
    outs = [(torch.empty_like(s[0]), torch.empty_like(s[1])) for s in w.sets]

    def fwbw(i):
        backend.run(w.args(i))
        gq, gk = grads[i]
        backend.run(w.args(i, inverse=True, q=gq, k=gk)._replace(q_out=outs[i][0],
                                                                 k_out=outs[i][1]))
    return [lambda i=i: fwbw(i) for i in range(n)]


def time_peers(w: Work, row, liger_deadline=165.0, compile_deadline=150.0):
    """Liger and torch.compile on the same workload (after the sweeps: they are context, the
    sweeps decide defaults), each skipped past its deadline (seconds since start)."""
    for label, maker, deadline in (("liger", liger_fns, liger_deadline),
                                   ("compile", compile_fns, compile_deadline)):
        if time.time() - T0 > deadline:
            row[label] = "skipped (time)"
            continue
        try:
            pf, why = maker(w)
            row[label] = graph_time_us(pf) if pf else why
        except Exception as e:  # a peer failing is a note, not a failure
            row[label] = f"error {type(e).__name__}: {str(e)[:60]}"


def time_workload(w: Work, backend, bw):
    n = len(w.sets)
    fns = work_fns(w, backend)
    nbytes = (2 if w.name == "W4" else 1) * w.io_bytes()
    us = graph_time_us(fns)
    copy_us = same_bytes_copy_us(w) * (2 if w.name == "W4" else 1)
    COPY_US[w.name] = copy_us
    row = {"W": w.name, "mode": "out of place" + (" fwd+bwd" if w.name == "W4" else ""),
           "us": us, "pct": nbytes / (us * 1e-6) / bw * 100, "copy_us": copy_us}
    ROWS.append(row)
    if w.name in ("W1", "W3"):
        fns = [lambda i=i: backend.run(w.args(i, inplace=True)) for i in range(n)]
        us = graph_time_us(fns)
        rb = w.io_bytes(rotary_only=True)
        COPY_US[f"{w.name} in place"] = same_bytes_copy_us(w, rotary_only=True)
        ROWS.append({"W": w.name, "mode": "in place", "us": us,
                     "pct": rb / (us * 1e-6) / bw * 100,
                     "copy_us": COPY_US[f"{w.name} in place"]})


def verify_cfg(w: Work, backend, inplace):
    """One call of a swept configuration on set 0 (fresh copies), against the float64 reference:
    '' when within SPEC tolerance, else a note (sweep configurations are not failures of the
    run, but one that fails here must not become a default)."""
    as4 = (lambda t: t.unsqueeze(0)) if w.layout == "thd" else (lambda t: t)
    q, k, _, _, _ = w.sets[0]
    qi, ki = q.clone(), k.clone()
    if inplace:
        backend.run(w.args(0, False, True, qi, ki))
        got = (qi, ki)
    else:
        qo, ko = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
        backend.run(w.args(0, q=qi, k=ki)._replace(q_out=qo, k_out=ko))
        got = (qo, ko)
    torch.cuda.synchronize()
    n_fail = len(FAILURES)
    for g, inp in zip(got, (q, k)):
        ref = reference_bshd(as4(inp), w.positions_bs(0), w.inv_freq, w.R, w.style)
        check_close("sweep", as4(g), as4(inp), ref, w.R, w.style)
    bad = FAILURES[n_fail:]
    del FAILURES[n_fail:]
    return "INACCURATE: " + "; ".join(bad)[:80] if bad else ""


def sweep(w: Work, backend_cls, configs, inplace=False, deadline=170.0):
    """Time (BLOCK_T, BLOCK_H, num_warps[, head_grid]) choices for one workload (the default
    first), each through a fresh backend; configurations left when the run passes `deadline`
    seconds are skipped. Returns [(cfg, us or None, note)]."""
    orig = tb._pick_blocks
    out = []
    try:
        for cfg in configs:
            if time.time() - T0 > deadline:
                out.append((cfg, None, "skipped (time)"))
                continue
            tb._pick_blocks = lambda *a, cfg=cfg: cfg
            be = backend_cls()
            fns = work_fns(w, be, inplace)
            try:
                us = graph_time_us(fns, iters=3)
                note = verify_cfg(w, be, inplace)
                out.append((cfg, us, note))
            except Exception as e:
                out.append((cfg, None, f"{type(e).__name__}: {str(e)[:60]}"))
    finally:
        tb._pick_blocks = orig
    return out


# Configurations swept per workload, (BLOCK_T, BLOCK_H, num_warps[, head_grid[, stream[, pdl]]]);
# head_grid True = one program per (token block, head chunk); stream True = .cg loads
# and .cs stores; pdl True = programmatic dependent launch (each call's launch overlaps the
# previous call's tail; the graph here is back-to-back calls). The default is added in front.
# Prefill candidates differ mostly in how many bytes each SM keeps in flight: CTAs per SM (by
# registers; sm_90 offline with triton 3.6, the H200's) x 2 chunks in flight x chunk bytes.
# W4: old (2, 16, 8) 80 regs, 3 CTAs, 48 KB (W1's old (4, 8, 8): 61 regs, 4 CTAs, 64 KB: hence
# W4 88 % vs W1 92 %); (4, 16, 8) 79 regs, 3 CTAs, 96 KB; (2, 16, 4) 78 regs, 6 CTAs, 96 KB;
# (1, 32, 4) 87 regs, 5 CTAs, 80 KB; (2, 8, 2) 102 regs, 9 CTAs, 72 KB.
SWEEPS = {
    "W2": [(1, 32, 8), (1, 8, 2, True), (1, 8, 1, True), (1, 16, 2, True), (1, 32, 8, True),
           (1, 4, 1, True)],
    "W4": [(2, 16, 8), (2, 16, 4), (4, 16, 8, False, True), (1, 32, 4), (8, 16, 8, True),
           (2, 8, 2), (2, 8, 1), (2, 16, 4, False, True)],
    "W1": [(4, 16, 8, False, True), (4, 8, 8), (2, 16, 4), (2, 8, 2), (2, 8, 1)],
    "W3 in place": [(4, 16, 4, False, True), (4, 16, 8), (8, 16, 8), (2, 16, 4), (2, 16, 2)],
    # Programmatic dependent launch last (never launched before this run: if the driver refused
    # it, nothing else is lost), each next to the default in the same sweep.
    "W2 pdl": [(1, 16, 4, True, False, True), (1, 8, 2, True, False, True)],
    "W4 pdl": [(4, 16, 8, False, False, True)],
}


def norm_cfg(cfg):
    """The tuple without trailing False flags: (4, 16, 8, False, False) -> (4, 16, 8)."""
    c = list(cfg)
    while len(c) > 3 and not c[-1]:
        c.pop()
    return tuple(c)


def default_cfg(w: Work, inplace=False):
    return norm_cfg(tb._pick_blocks(w.B * w.S, w.hq, w.hk, w.D, w.R, (not inplace) and w.R < w.D))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--no-pytest", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-peers", action="store_true")
    opts = ap.parse_args()
    dev = opts.device
    tiny = dev != "cuda"
    import triton

    log(f"torch {torch.__version__}, triton {triton.__version__}, device "
        f"{torch.cuda.get_device_name() if dev == 'cuda' else dev}")
    backend = tb.TritonBackend()
    reasons = backend.availability()
    if reasons:
        print("Triton backend unavailable:", reasons)
        return 1

    # 1. correctness -----------------------------------------------------------------------
    # The unit tests on CUDA tensors run in a subprocess alongside (most of their time is kernel
    # compilation on the host; their tiny kernels barely touch the GPU); collected at the end.
    pytest_proc = None
    if not opts.no_pytest and dev == "cuda":
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        pytest_log = tempfile.TemporaryFile(mode="w+")
        pytest_proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:rope_ops", "-p", "no:cacheprovider",
             str(ROOT / "tests/test_triton_backend.py")],
            cwd=ROOT, env=env, stdout=pytest_log, stderr=subprocess.STDOUT, text=True)
    works = {}
    for spec in workloads(tiny):
        name = spec[0]
        n_sets = 1 if tiny else (48 if name == "W2" else 2)
        works[name] = Work(spec, dev, n_sets)
        check_workload(works[name], backend)
    log("direct launch active:", backend.fast_launch,
        "(plans with a direct runner: "
        f"{sum(p.runner is not None for p in backend._plans.values())}/{len(backend._plans)})")
    if dev != "cuda":
        print("FAILED" if FAILURES else "OK (checks only; timings need CUDA)")
        for f in FAILURES:
            print("  ", f)
        return 1 if FAILURES else 0

    # 2. GPU time --------------------------------------------------------------------------
    bw = copy_bandwidth()
    log(f"2 GiB device-to-device copy: {bw / 1e9:.0f} GB/s (read + write)")
    for name, w in works.items():
        try:
            time_workload(w, backend, bw)
        except Exception as e:
            ROWS.append({"W": name, "mode": f"timing error {type(e).__name__}: {str(e)[:80]}"})
        log(f"timed {name}")

    # 3. host time -------------------------------------------------------------------------
    w2 = works["W2"]
    a2 = w2.args(0)
    host = {"backend.run": host_us(lambda: backend.run(a2))}
    try:
        import rope_ops

        q, k, _, _, pos = w2.sets[0]
        apply = rope_ops.apply
        apply(q, k, pos, base=500000.0, backend="triton")
        host["rope_ops.apply"] = host_us(lambda: apply(q, k, pos, base=500000.0,
                                                       backend="triton"))
    except Exception as e:
        host["rope_ops.apply"] = f"n/a ({type(e).__name__}: {str(e)[:60]})"
    saved = backend.fast_launch
    backend.fast_launch = False
    for p in backend._plans.values():
        p.runner = None
    host["backend.run via triton JIT launch"] = host_us(lambda: backend.run(a2))
    backend.fast_launch = saved

    # 4. sweep ------------------------------------------------------------------------------
    # Before the peers; the misses (W2, W4) first; each sweep stops at its deadline (seconds since
    # start) so the whole run stays under 3 minutes.
    sweeps = {}
    if not opts.no_sweep:
        for name, deadline in (("W2", 110), ("W4", 126), ("W1", 137), ("W3 in place", 145),
                               ("W2 pdl", 150), ("W4 pdl", 153)):
            w = works[name.split()[0]]
            inplace = "in place" in name
            dflt = default_cfg(w, inplace)
            cfgs = [dflt] + [c for c in SWEEPS[name] if norm_cfg(c) != dflt]
            sweeps[name] = (dflt, sweep(w, tb.TritonBackend, cfgs, inplace, deadline))
            log(f"swept {name}")

    # 5. peers (context) -------------------------------------------------------------------
    if not opts.no_peers:
        for r in ROWS:
            if r.get("mode", "").startswith("out of place") and r["W"] in works:
                time_peers(works[r["W"]], r)
        log("timed peers")

    if pytest_proc is not None:
        try:
            pytest_proc.wait(timeout=max(10, 225 - (time.time() - T0)))
        except subprocess.TimeoutExpired:
            pytest_proc.kill()
            pytest_proc.wait()
            FAILURES.append("pytest tests/test_triton_backend.py timed out")
        pytest_log.seek(0)
        out = pytest_log.read()
        tail = out.strip().splitlines()[-3:]
        log("pytest tests/test_triton_backend.py (cuda):", " | ".join(tail))
        if pytest_proc.returncode != 0:
            FAILURES.append("pytest tests/test_triton_backend.py failed:\n" + out[-3000:])

    # report --------------------------------------------------------------------------------
    print()
    print(f"copy bandwidth (2 GiB, read+write): {bw / 1e9:.0f} GB/s")
    print("(% copy: of the 2 GiB copy above, which a graph runs on the copy engines: read"
          " '% same' = same-bytes copy time / triton time)")
    print(f"{'W':3s} {'mode':22s} {'triton us':>10s} {'% copy':>7s} {'copy us':>8s} "
          f"{'% same':>7s} {'liger us':>10s} {'compile us':>11s}")
    for r in ROWS:
        def fmt(v):
            return f"{v:10.2f}" if isinstance(v, float) else f"{str(v)[:30]:>10s}"
        if "us" not in r:
            print(f"{r['W']:3s} {r['mode']}")
            continue
        print(f"{r['W']:3s} {r['mode']:22s} {r['us']:10.2f} {r['pct']:6.1f}% {r['copy_us']:8.2f} "
              f"{r['copy_us'] / r['us'] * 100:6.1f}% "
              f"{fmt(r.get('liger', '-'))} {fmt(r.get('compile', '-'))}")
    print("targets: >= 92% of same-bytes copy on W1, W4, W5; W2 <= 4 us/call; W3 in place <= 25 us")
    print("host time per call (W2, plain Python loop):")
    for k_, v in host.items():
        print(f"   {k_:36s} {v if isinstance(v, str) else f'{v:.2f} us'}")
    best_lines = []
    for name, (dflt, res) in sweeps.items():
        copy_us = COPY_US.get(name.replace(" pdl", ""))
        print(f"sweep {name} (BLOCK_T, BLOCK_H, num_warps[, head_grid[, stream[, pdl]]]) -> us"
              f"{', % of same-bytes copy time' if copy_us else ''}; default {dflt}:")
        for cfg, us, note in res:
            pct = f"  {copy_us / us * 100:5.1f}%" if (copy_us and us) else ""
            tag = "  <- default" if cfg == dflt else ""
            print(f"   {str(norm_cfg(cfg)):28s} {f'{us:8.2f} us' if us else ''}{pct}{tag}"
                  f" {note}")
        timed = [(us, cfg) for cfg, us, note in res if us and not note]
        if timed:
            us, cfg = min(timed)
            d_us = next((u for c, u, _ in res if c == dflt and u), None)
            best_lines.append(f"   {name:12s} best {str(norm_cfg(cfg)):28s} {us:8.2f} us"
                              + (f" ({copy_us / us * 100:.1f}% of copy)" if copy_us else "")
                              + (f"; default {dflt} {d_us:.2f} us" if d_us else ""))
    if best_lines:
        print("sweep best per workload:")
        print("\n".join(best_lines))
    print(f"total {time.time() - T0:.0f} s")
    if FAILURES:
        print("FAILED checks:")
        for f in FAILURES:
            print("  ", f)
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
