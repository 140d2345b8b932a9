"""``python -m rope_ops bench``: PERF.md's workloads for every available backend and baseline.

Each result is reported against a copy measured in the same run: the same-bytes copy (a
device-to-device copy of half the bytes the workload must move, so it reads and writes exactly
that many bytes) and the card's copy bandwidth (a 2 GiB copy, bytes read + written).

GPU time: N calls captured in one CUDA graph, replay time / N, rotating input sets so that L2
(60 MB on the H200) does not hold them. Host time: wall time per eager call of a plain loop.
On a CPU the workloads are scaled down (``--scale``) and timed as plain loops.

Outputs: a table on stdout, ``--json PATH`` and ``--png PATH`` (a chart of % of copy bandwidth).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

import torch

import rope_ops
from rope_ops import registry
from rope_ops._reference import rope_reference
from rope_ops.testing.checks import assert_rope_close


@dataclass(frozen=True)
class Workload:
    name: str
    title: str
    seqs: int
    seq_len: int
    q_heads: int
    k_heads: int
    head_dim: int
    rotary_dim: int
    style: str = "neox"
    base: float = 500000.0
    backward: bool = False
    decode: bool = False  # random positions in [0, 32768), one token per sequence
    inplace: bool = False

    @property
    def tokens(self) -> int:
        return self.seqs * self.seq_len

    def bytes_moved(self, dtype: torch.dtype) -> int:
        """The floor: q and k read once and written once, one cos/sin row and position a token."""
        size = torch.empty((), dtype=dtype).element_size()
        heads = self.q_heads + self.k_heads
        touched = self.rotary_dim if self.inplace else self.head_dim
        data = 2 * self.tokens * heads * touched * size
        tables = self.tokens * self.rotary_dim * 4 + self.tokens * 8
        return (2 if self.backward else 1) * (data + tables)


WORKLOADS = {
    "W1": Workload("W1", "prefill Llama-3-8B", 4, 4096, 32, 8, 128, 128),
    "W2": Workload("W2", "decode", 256, 1, 32, 8, 128, 128, decode=True),
    "W3": Workload("W3", "GPT-J partial, out of place", 2, 4096, 16, 16, 256, 64, style="gptj", base=10000.0),
    "W3i": Workload("W3i", "GPT-J partial, in place", 2, 4096, 16, 16, 256, 64, style="gptj", base=10000.0,
                    inplace=True),
    "W4": Workload("W4", "training fwd+bwd", 2, 4096, 32, 32, 128, 128, backward=True),
    "W5": Workload("W5", "prefill 70B-like", 8, 4096, 64, 8, 128, 128),
}
TABLE_POSITIONS = 131072


def scaled(w: Workload, scale: int) -> Workload:
    if scale <= 1 or w.decode:
        return w
    return dataclasses.replace(w, seq_len=max(1, w.seq_len // scale))


# ---------------------------------------------------------------------------------------------
# Inputs and providers. A provider builds, for one workload, a list of closures (one per input
# set) that each run the workload once.


@dataclass
class InputSet:
    q: torch.Tensor  # thd [T, Hq, D]
    k: torch.Tensor
    pos: torch.Tensor  # [T] int64
    grad_q: torch.Tensor | None
    grad_k: torch.Tensor | None


def make_inputs(w: Workload, dtype, device, n_sets: int, seed: int = 0) -> list[InputSet]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    sets = []
    for _ in range(n_sets):
        q = torch.randn(w.tokens, w.q_heads, w.head_dim, generator=gen).to(device, dtype)
        k = torch.randn(w.tokens, w.k_heads, w.head_dim, generator=gen).to(device, dtype)
        if w.decode:
            pos = torch.randint(0, 32768, (w.tokens,), generator=gen)
        else:
            pos = torch.arange(w.seq_len).repeat(w.seqs)
        gq = gk = None
        if w.backward:
            gq, gk = torch.randn_like(q), torch.randn_like(k)
        sets.append(InputSet(q, k, pos.to(device), gq, gk))
    return sets


def provider_rope_ops(backend: str):
    def build(w: Workload, sets: list[InputSet], rope):
        def one(s: InputSet):
            if w.backward:
                def run():
                    rope_ops.apply(s.q, s.k, s.pos, rope=rope, backend=backend)
                    return rope_ops.apply_grad(s.grad_q, s.grad_k, s.pos, rope=rope, backend=backend)
            elif w.inplace:
                def run():
                    return rope_ops.apply(s.q, s.k, s.pos, rope=rope, backend=backend, inplace=True)
            else:
                def run():
                    return rope_ops.apply(s.q, s.k, s.pos, rope=rope, backend=backend)
            return run
        return [one(s) for s in sets]
    return build


def hf_style_rope(q, k, cos_full, sin_full, pos, style):
    """Hugging Face's eager formulation: gather cos/sin, cast to the input dtype, rotate_half."""
    cos = cos_full[pos].to(q.dtype).unsqueeze(1)
    sin = sin_full[pos].to(q.dtype).unsqueeze(1)
    r = cos.shape[-1]

    def rotate(x):
        rot, rest = x[..., :r], x[..., r:]
        if style == "neox":
            x1, x2 = rot.chunk(2, dim=-1)
            turned = torch.cat((-x2, x1), dim=-1)
        else:
            turned = torch.stack((-rot[..., 1::2], rot[..., ::2]), dim=-1).flatten(-2)
        return torch.cat((rot * cos + turned * sin, rest), dim=-1)

    return rotate(q), rotate(k)


def _full_width_tables(rope, device, style):
    cos, sin, _ = rope.tables(device)
    if style == "neox":
        return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    return cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)


def provider_hf(compiled: bool):
    def build(w: Workload, sets: list[InputSet], rope):
        device = sets[0].q.device
        cos_full, sin_full = _full_width_tables(rope, device, w.style)
        fn = torch.compile(hf_style_rope, fullgraph=True, dynamic=False) if compiled else hf_style_rope
        closures = []
        for s in sets:
            if w.backward:
                q, k = s.q.detach().requires_grad_(True), s.k.detach().requires_grad_(True)

                def run(q=q, k=k, s=s):
                    qo, ko = fn(q, k, cos_full, sin_full, s.pos, w.style)
                    return torch.autograd.grad((qo, ko), (q, k), (s.grad_q, s.grad_k))
            else:
                def run(s=s):
                    return fn(s.q, s.k, cos_full, sin_full, s.pos, w.style)
            closures.append(run)
        return closures
    return build


def provider_liger():
    """Liger-Kernel's Triton rope (bhsd layout, NeoX only, full rotary dim)."""
    from liger_kernel.ops.rope import LigerRopeFunction  # noqa: F401 (import check)
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    def build(w: Workload, sets: list[InputSet], rope):
        if w.style != "neox" or w.rotary_dim != w.head_dim or w.inplace:
            raise NotImplementedError("Liger supports full-width NeoX only")
        device = sets[0].q.device
        cos_full, sin_full = _full_width_tables(rope, device, "neox")
        closures = []
        for s in sets:
            # Liger wants [B, H, S, D] and cos/sin [B or 1, S, D]; its kernel writes in place.
            q = s.q.view(w.seqs, w.seq_len, w.q_heads, w.head_dim).transpose(1, 2)
            k = s.k.view(w.seqs, w.seq_len, w.k_heads, w.head_dim).transpose(1, 2)
            cos = cos_full[s.pos].view(w.seqs, w.seq_len, -1).to(q.dtype)
            sin = sin_full[s.pos].view(w.seqs, w.seq_len, -1).to(q.dtype)
            if w.backward:
                qg, kg = q.detach().requires_grad_(True), k.detach().requires_grad_(True)
                gq = s.grad_q.view(w.seqs, w.seq_len, w.q_heads, w.head_dim).transpose(1, 2)
                gk = s.grad_k.view(w.seqs, w.seq_len, w.k_heads, w.head_dim).transpose(1, 2)

                def run(qg=qg, kg=kg, cos=cos, sin=sin, gq=gq, gk=gk):
                    qo, ko = liger_rotary_pos_emb(qg, kg, cos, sin)
                    return torch.autograd.grad((qo, ko), (qg, kg), (gq, gk))
            else:
                def run(q=q, k=k, cos=cos, sin=sin):
                    return liger_rotary_pos_emb(q, k, cos, sin)
            closures.append(run)
        return closures
    return build


# ---------------------------------------------------------------------------------------------
# Timing


def warm_up(closures, rounds: int = 3) -> None:
    """Run the calls on a side stream (as CUDA-graph capture wants) and wait for them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in closures * rounds:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


def graph_seconds_per_call(closures, calls: int, repeats: int = 5, reduce=statistics.median) -> float:
    """Seconds per call of one CUDA graph holding `calls` calls (rotating through the closures),
    replayed `repeats` times; `reduce` picks from the replays (median, or min)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            closures[i % len(closures)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return reduce(times)


def gpu_time_per_call(closures, graph_seconds: float = 20e-3, max_calls: int = 1000,
                      repeats: int = 5) -> float:
    """Seconds per call from CUDA-graph replay, after warm-up, rotating the input sets.

    The graph holds enough calls for ~graph_seconds of GPU time (at least 20, at most
    max_calls), so the replay's own start-up (~10-20 us) is spread thin: with 20 calls of a
    130 us workload it still added ~1 % per call.
    """
    warm_up(closures)
    seconds = graph_seconds_per_call(closures, 20, repeats=3)
    wanted = max(20, min(max_calls, int(graph_seconds / max(seconds, 1e-9))))
    if wanted > 20:
        seconds = graph_seconds_per_call(closures, wanted, repeats)
    return seconds


def host_time_per_call(closures, device, iterations: int = 200) -> float:
    """Wall seconds per call of a plain eager loop (GPU: host cost; CPU: the whole time)."""
    for fn in closures:
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(iterations):
            closures[i % len(closures)]()
        sync()
        samples.append((time.perf_counter() - t0) / iterations)
    return min(samples)


def l2_bytes(device) -> int:
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 << 20)


def copy_time(n_bytes: int, device, n_sets: int) -> float:
    """Seconds for a copy of n_bytes (reads n_bytes, writes n_bytes), timed like the workloads.

    On a GPU the faster of graph replay and back-to-back eager launches (timed with events):
    a large memcpy captured in a graph can run on the copy engines, slower than the copy kernel
    eager launches use, and the reference should be the best copy the card does.
    """
    elements = max(1, n_bytes // 2)
    pairs = [(torch.empty(elements, dtype=torch.bfloat16, device=device).normal_(),
              torch.empty(elements, dtype=torch.bfloat16, device=device)) for _ in range(n_sets)]
    closures = [lambda s=s, d=d: d.copy_(s) for s, d in pairs]
    if device.type != "cuda":
        return host_time_per_call(closures, device, iterations=20)
    graphed = gpu_time_per_call(closures)
    calls = max(20, min(2000, int(2e-3 / max(graphed, 1e-7))))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(5):
        start.record()
        for i in range(calls):
            closures[i % len(closures)]()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / calls)
    return min(graphed, statistics.median(samples))


def copy_bandwidth(device) -> float:
    """Bytes read + written per second of a 2 GiB device-to-device copy (CPU: 256 MiB)."""
    n = (2 << 30) if device.type == "cuda" else (256 << 20)
    seconds = copy_time(n // 2, device, n_sets=1)
    return n / seconds


# ---------------------------------------------------------------------------------------------
# Correctness of every provider on a sample of tokens, against the float64 reference.


def refcheck(w: Workload, s: InputSet, outputs, rope) -> str:
    n = min(64, w.tokens)
    if w.backward:  # outputs are (dq, dk)
        xs = (s.grad_q[:n], s.grad_k[:n])
        inverse = True
    else:
        xs = (s.q[:n], s.k[:n])
        inverse = False
    try:
        for x, out in zip(xs, outputs):
            ref = rope_reference(x, s.pos[:n], layout="thd", rotary_dim=w.rotary_dim, style=w.style,
                                 inv_freq=rope.inv_freq, attention_factor=rope.attention_factor,
                                 inverse=inverse)
            out = out[:n] if out.dim() == 3 else out.transpose(1, 2).reshape(-1, *out.shape[1:2], out.shape[-1])[:n]
            assert_rope_close(out, ref, x, rotary_dim=w.rotary_dim, style=w.style)
        return "ok"
    except AssertionError as error:
        return f"MISMATCH: {str(error)[:120]}"


# ---------------------------------------------------------------------------------------------


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device) -> dict:
    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
            "torch": torch.__version__, "rope_ops": rope_ops.__version__, "machine": platform.machine()}
    info["commit"] = os.environ.get("ROPE_OPS_COMMIT") or _git_commit()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    else:
        info["cpu"] = platform.processor() or platform.machine()
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def provider_cuda_without_pdl():
    """The CUDA backend with programmatic dependent launch off: in the benchmark each call
    follows another RoPE call, whose early trigger PDL exploits; after a kernel without one (a
    GEMM) the gain is smaller. Both rows are shown so the difference is visible. Its host time
    includes switching PDL off and back around every call (two op calls)."""
    from rope_ops_backends import cuda_backend

    inner = provider_rope_ops("cuda")

    def build(w: Workload, sets: list[InputSet], rope):
        def without_pdl(run):
            def run_without_pdl():
                cuda_backend.set_launch(pdl=0)  # read at launch, so also when captured
                try:
                    return run()
                finally:
                    cuda_backend.set_launch(pdl=-1)
            return run_without_pdl
        return [without_pdl(r) for r in inner(w, sets, rope)]
    return build


def providers_for(device, wanted: list[str] | None) -> dict:
    found = {}
    loaded, _ = registry.load_all()
    for name, backend in loaded.items():
        if not backend.availability() and ("*" in backend.device_types or device.type in backend.device_types):
            found[f"rope_ops:{name}"] = provider_rope_ops(name)
            if name == "cuda" and device.type == "cuda":
                found["rope_ops:cuda (PDL off)"] = provider_cuda_without_pdl()
    found["hf-eager"] = provider_hf(compiled=False)
    found["hf-compile"] = provider_hf(compiled=True)
    if device.type == "cuda":
        try:
            found["liger"] = provider_liger()
        except ImportError:
            pass
    if wanted:
        found = {k: v for k, v in found.items() if any(k == x or k.endswith(":" + x) for x in wanted)}
    return found


def run(workloads: list[str], device, dtype, scale: int, wanted: list[str] | None, n_sets: int) -> dict:
    results = {"environment": environment(device), "dtype": str(dtype).replace("torch.", ""),
               "scale": scale, "rows": []}
    bandwidth = copy_bandwidth(device)
    results["copy_bandwidth_GBps"] = bandwidth / 1e9
    providers = providers_for(device, wanted)
    for key in workloads:
        w = scaled(WORKLOADS[key], scale)
        rope = rope_ops.RotaryEmbedding(w.head_dim, rotary_dim=w.rotary_dim, base=w.base,
                                        max_position=TABLE_POSITIONS if device.type == "cuda" else 32768,
                                        style=w.style, device=device)
        # Enough input sets that they cannot all sit in L2 (60 MB on the H200): >= 3x L2 in total.
        per_set = w.bytes_moved(dtype) // (2 if w.backward else 1)
        sets = make_inputs(w, dtype, device, max(n_sets, min(64, -(-l2_bytes(device) * 3 // per_set))))
        moved = w.bytes_moved(dtype)
        same_bytes = copy_time(moved // 2, device, len(sets))
        results["rows"].append({"workload": key, "title": w.title, "provider": "same-bytes copy",
                                "time_us": same_bytes * 1e6, "GBps": moved / same_bytes / 1e9,
                                "pct_copy": 100 * moved / same_bytes / bandwidth, "check": "-"})
        for name, build in providers.items():
            row = {"workload": key, "title": w.title, "provider": name}
            try:
                closures = build(w, sets, rope)
                # Checked on a fresh copy of set 0: some providers (Liger) write their inputs.
                fresh = InputSet(*(None if t is None else t.clone() for t in (getattr(sets[0], f.name) for f in dataclasses.fields(InputSet))))
                outputs = build(w, [fresh], rope)[0]()
                check = refcheck(w, sets[0], outputs, rope)
                if device.type == "cuda":
                    seconds = gpu_time_per_call(closures)
                    row["host_us"] = host_time_per_call(closures, device) * 1e6
                else:
                    seconds = host_time_per_call(closures, device, iterations=5)
                row.update(time_us=seconds * 1e6, GBps=moved / seconds / 1e9,
                           pct_copy=100 * moved / seconds / bandwidth,
                           vs_same_bytes_copy=same_bytes / seconds, check=check)
            except NotImplementedError as error:
                row.update(skipped=str(error))
            except Exception as error:  # one failing provider must not sink the whole run
                row.update(error=f"{type(error).__name__}: {str(error)[:200]}")
            results["rows"].append(row)
    return results


def render(results: dict) -> str:
    env = results["environment"]
    lines = [f"rope_ops bench  {env.get('gpu', env.get('cpu'))}  torch {env['torch']}  commit {env['commit']}  "
             f"{env['date']}  dtype {results['dtype']}  scale 1/{results['scale']}",
             f"copy bandwidth (read+write): {results['copy_bandwidth_GBps']:.0f} GB/s", "",
             f"{'W':4s} {'provider':22s} {'time us':>10s} {'GB/s':>8s} {'% copy':>7s} {'host us':>8s}  check"]
    for row in results["rows"]:
        if "time_us" in row:
            host = f"{row['host_us']:8.1f}" if "host_us" in row else " " * 8
            lines.append(f"{row['workload']:4s} {row['provider']:22s} {row['time_us']:10.2f} {row['GBps']:8.0f} "
                         f"{row['pct_copy']:6.1f}% {host}  {row['check']}")
        else:
            lines.append(f"{row['workload']:4s} {row['provider']:22s} {row.get('skipped') or row.get('error')}")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    """The results as a Markdown table (what BENCHMARKS.md records)."""
    env = results["environment"]
    head = (f"{env.get('gpu', env.get('cpu'))}, torch {env['torch']}"
            + (f", CUDA {env['cuda']}" if env.get("cuda") else "") + (f", triton {env['triton']}" if env.get("triton") else "")
            + f", rope_ops commit {env['commit']}, {env['date']}, {results['dtype']}"
            + (f", sequences scaled 1/{results['scale']}" if results["scale"] > 1 else "")
            + f"; copy bandwidth {results['copy_bandwidth_GBps']:.0f} GB/s (read + write)")
    lines = [head, "", "| W | provider | time (us) | GB/s | % of copy bandwidth | x same-bytes copy | host us/call | check |",
             "|---|---|---|---|---|---|---|---|"]
    for row in results["rows"]:
        if "time_us" not in row:
            lines.append(f"| {row['workload']} | {row['provider']} | {row.get('skipped') or row.get('error')} | | | | | |")
            continue
        ratio = f"{row['vs_same_bytes_copy']:.3f}" if "vs_same_bytes_copy" in row else "1"
        host = f"{row['host_us']:.1f}" if "host_us" in row else ""
        check = str(row.get("check", "")).split(":")[0]
        lines.append(f"| {row['workload']} | {row['provider']} | {row['time_us']:.2f} | {row['GBps']:.0f} | "
                     f"{row['pct_copy']:.1f} | {ratio} | {host} | {check} |")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if "pct_copy" in r]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(workloads)), 4.5))
    width = 0.8 / max(1, len(providers))
    for i, provider in enumerate(providers):
        values = [next((r["pct_copy"] for r in rows if r["workload"] == w and r["provider"] == provider), 0)
                  for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], values, width, label=provider)
    ax.set_xticks([x + width * (len(providers) - 1) / 2 for x in range(len(workloads))])
    ax.set_xticklabels([f"{w}\n" + textwrap.fill(WORKLOADS[w].title, 16) for w in workloads], fontsize=8)
    ax.set_ylabel("% of same-run copy bandwidth (higher is better)")
    env = results["environment"]
    ax.set_title(f"rope_ops on {env.get('gpu', env.get('cpu'))}, {results['dtype']}, commit {env['commit']}", fontsize=9)
    ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    ax.axhline(100, color="grey", lw=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rope_ops bench", description=__doc__)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--providers", default=None, help="comma list (default: all available)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--scale", type=int, default=None, help="divide sequence lengths (default: 1 on GPU, 32 on CPU)")
    parser.add_argument("--sets", type=int, default=None, help="input sets to rotate (default: 4 GPU, 2 CPU)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None)
    parser.add_argument("--markdown", default=None, help="write the table as Markdown")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    scale = args.scale or (1 if device.type == "cuda" else 32)
    n_sets = args.sets or (4 if device.type == "cuda" else 2)
    wanted = args.providers.split(",") if args.providers else None
    results = run(args.workloads.split(","), device, getattr(torch, args.dtype), scale, wanted, n_sets)
    print(render(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.png:
        plot(results, args.png)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results) + "\n")
    # Baselines compute in bf16 and are expected to miss our bound; ours must not.
    failed = [r for r in results["rows"] if r["provider"].startswith("rope_ops:")
              and (str(r.get("check", "")).startswith("MISMATCH") or "error" in r)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
