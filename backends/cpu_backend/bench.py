"""The fused prologue on the cpu backend against the unfused pipeline, timed on the CPU.

``python -m rope_ops_backends.cpu_backend bench-prologue [--tokens 2048] [--threads 1,all]
[--json PATH]``

Shape: Qwen3-8B's attention prologue scaled to a CPU: 32 q and 8 kv heads of 128, bf16, QK-norm
(RMSNorm weights on q and k), rope_theta 1e6, positions arange per sequence. Workloads:

- prefill: 2048 tokens, out of place (new q, k, v);
- prefill+cache: the same in place, writing k and v into a bf16 KV cache at each token's slot;
- decode+cache: 16 tokens at random positions and slots, in place, with the cache write;
- training: forward and backward (input and weight gradients), out of place.

Providers: the cpu backend's qkv_prologue; the torch backend's (torch ops, float32 math); and the
unfused pipeline a model runs without it: split views, RMSNorm in torch (as Hugging Face's
Qwen3RMSNorm: float32 statistics, rounded to bf16, times the weight), ``rope_ops.apply`` on the
cpu backend, ``index_copy_`` into the cache (v stays a view of qkv: the pipeline copies nothing
it does not need). Each is timed as the median of several ~50 ms loops after warm-up, rotating
input sets, with freed memory kept in the process (no page faults in the timed calls), once
with one thread and once with all; ``% copy`` is a same-run copy of the bytes that must move
(read qkv once, write q, k, v; in place: write q and k) over the row's time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch

import rope_ops

HQ, HK, D = 32, 8, 128
EPS = 1e-6
THETA = 1e6


def _rms_norm_unfused(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm as Hugging Face's Qwen3RMSNorm computes it (a new bf16 tensor)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * normed.to(x.dtype)


def _split(qkv: torch.Tensor):
    return qkv.unflatten(-1, (HQ + 2 * HK, D)).split([HQ, HK, HK], dim=-2)


def unfused(qkv, pos, rope, q_w, k_w, cache=None, slots=None):
    """The pipeline without the fused prologue: (q, k, v)."""
    q, k, v = _split(qkv)
    q, k = _rms_norm_unfused(q, q_w), _rms_norm_unfused(k, k_w)
    if cache is None:
        q, k = rope_ops.apply(q, k, pos, rope=rope, layout="thd", backend="cpu")
        return q, k, v
    q, k = rope_ops.apply(q, k, pos, rope=rope, layout="thd", inplace=True, backend="cpu")
    cache[0].index_copy_(0, slots, k)
    cache[1].index_copy_(0, slots, v)
    return q, k, v


def fused(qkv, pos, rope, q_w, k_w, cache=None, slots=None, backend="cpu"):
    if cache is None:
        return rope_ops.qkv_prologue(qkv, pos, num_q_heads=HQ, num_kv_heads=HK, head_dim=D,
                                     q_norm=q_w, k_norm=k_w, eps=EPS, rope=rope, backend=backend)
    return rope_ops.qkv_prologue(qkv, pos, num_q_heads=HQ, num_kv_heads=HK, head_dim=D, q_norm=q_w,
                                 k_norm=k_w, eps=EPS, rope=rope, inplace=True, kv_cache=cache,
                                 slots=slots, backend=backend)


def _inputs(tokens: int, n_sets: int, decode: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    width = (HQ + 2 * HK) * D
    sets = []
    for _ in range(n_sets):
        qkv = torch.randn(tokens, width, generator=gen).bfloat16()
        pos = (torch.randint(0, 4096, (tokens,), generator=gen) if decode
               else torch.arange(tokens))
        sets.append((qkv, pos))
    q_w = (torch.randn(D, generator=gen) * 0.1 + 1).bfloat16()
    k_w = (torch.randn(D, generator=gen) * 0.1 + 1).bfloat16()
    return sets, q_w, k_w


def _row(workload, provider, threads, times, moved_bytes, copy_seconds):
    median = times["median"]
    spread = (times["max"] - times["min"]) / 2 / median * 100
    return {"workload": workload, "provider": provider, "threads": threads,
            "median_us": median * 1e6, "spread_pct": spread, "gb_per_s": moved_bytes / median / 1e9,
            "pct_copy": None if copy_seconds is None else copy_seconds / median * 100}


def run(tokens: int, thread_counts: list[int]) -> list[dict]:
    from rope_ops.bench.timing import copy_time, cpu_times

    rope = rope_ops.RotaryEmbedding(D, base=THETA, max_position=max(8192, tokens))
    width = (HQ + 2 * HK) * D
    rows = []
    workloads = [("prefill", tokens, False, False, False), ("prefill+cache", tokens, True, False, False),
                 ("decode+cache", 16, True, True, False), ("training", tokens, False, False, True)]
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for name, n, with_cache, decode, training in workloads:
            n_sets = 3 if n >= 256 else 16
            sets, q_w, k_w = _inputs(n, n_sets, decode)
            n_slots = max(4096, 2 * n)
            caches = [(torch.zeros(n_slots, HK, D, dtype=torch.bfloat16),
                       torch.zeros(n_slots, HK, D, dtype=torch.bfloat16)) for _ in sets]
            gen = torch.Generator().manual_seed(1)
            slots = [torch.randperm(n_slots, generator=gen)[:n] for _ in sets]
            if with_cache:  # read qkv; write q, k in place and k, v into the cache
                moved = n * width * 2 + n * (HQ + HK) * D * 2 + 2 * n * HK * D * 2
            elif training:  # forward: read qkv, write q k v; backward: read qkv and grads, write grad
                moved = 5 * n * width * 2
            else:
                moved = 2 * n * width * 2
            copy_seconds = copy_time(moved // 2, torch.device("cpu"), n_sets)
            providers = [("cpu qkv_prologue", lambda *a, **k: fused(*a, **k)),
                         ("torch qkv_prologue", lambda *a, **k: fused(*a, **k, backend="torch")),
                         ("unfused: torch RMSNorm + rope_ops.apply(cpu)" + (" + index_copy_" if with_cache else ""),
                          unfused)]
            for provider, fn in providers:
                if training:
                    grads = [[torch.randn(n, h, D, generator=gen).bfloat16() for h in (HQ, HK, HK)]
                             for _ in sets]
                    leaves = [(qkv.clone().requires_grad_(True), pos) for qkv, pos in sets]
                    weights = (q_w.clone().requires_grad_(True), k_w.clone().requires_grad_(True))

                    def step(i, fn=fn, leaves=leaves, grads=grads, weights=weights):
                        qkv, pos = leaves[i]
                        torch.autograd.backward(fn(qkv, pos, rope, *weights), grads[i])
                        qkv.grad = None
                        weights[0].grad = weights[1].grad = None

                    closures = [lambda i=i: step(i) for i in range(len(sets))]
                    times = cpu_times(closures)
                else:
                    def call(i, fn=fn):
                        qkv, pos = sets[i]
                        with torch.inference_mode():
                            if with_cache:
                                fn(qkv, pos, rope, q_w, k_w, caches[i], slots[i])
                            else:
                                fn(qkv, pos, rope, q_w, k_w)

                    closures = [lambda i=i: call(i) for i in range(len(sets))]
                    times = cpu_times(closures)
                rows.append(_row(name, provider, threads, times, moved, copy_seconds))
            rows.append(_row(name, "same-bytes copy", threads, {"median": copy_seconds, "min": copy_seconds,
                                                                "max": copy_seconds}, moved, copy_seconds))
    return rows


def report(rows: list[dict]) -> str:
    lines = ["| workload | threads | provider | median us | spread | GB/s | % copy | x unfused |",
             "|---|---|---|---|---|---|---|---|"]
    unfused_us = {(r["workload"], r["threads"]): r["median_us"] for r in rows
                  if r["provider"].startswith("unfused")}
    for r in rows:
        base = unfused_us.get((r["workload"], r["threads"]))
        speedup = f"{base / r['median_us']:.2f}" if base else ""
        pct = "" if r["pct_copy"] is None or r["provider"] == "same-bytes copy" else f"{r['pct_copy']:.0f} %"
        lines.append(f"| {r['workload']} | {r['threads']} | {r['provider']} | {r['median_us']:.1f} | "
                     f"±{r['spread_pct']:.1f}% | {r['gb_per_s']:.1f} | {pct} | {speedup} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rope_ops_backends.cpu_backend bench-prologue")
    parser.add_argument("--tokens", type=int, default=2048, help="prefill and training tokens")
    parser.add_argument("--threads", default="1,all",
                        help="comma-separated thread counts; 'all': torch.get_num_threads() at start")
    parser.add_argument("--json", help="also write the rows (and the environment) as JSON here")
    opts = parser.parse_args(argv)
    from rope_ops.bench.run import warm_cpu_allocator

    from . import CpuBackend, isa

    reasons = CpuBackend().availability()
    if reasons:
        print("cpu backend unavailable:", "; ".join(reasons))
        return 1
    all_threads = torch.get_num_threads()
    thread_counts = [all_threads if t == "all" else int(t) for t in opts.threads.split(",")]
    allocator = warm_cpu_allocator()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows = run(opts.tokens, thread_counts)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    env = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "torch_threads_default": all_threads, "isa": isa(), "torch": torch.__version__,
           "allocator": allocator, "load_average": [load, load_after],
           "shape": f"{opts.tokens} tokens, {HQ} q / {HK} kv heads, head_dim {D}, bf16, QK-norm"}
    print(f"# fused prologue, cpu backend ({env['isa']}); {env['shape']}; {env['cpus']} CPUs, "
          f"load average {load} -> {load_after}; {allocator}")
    print(report(rows))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)
    return 0
