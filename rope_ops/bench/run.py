"""Running the benchmark: per case, the floor, then every provider, checked and timed; host
time; kernel candidates. Progress (one line per case, with an ETA) goes to stderr."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch

import rope_ops

from . import providers as providers_mod
from .cases import CPU_TABLE_POSITIONS, HOST_CASES, TABLE_POSITIONS, WORKLOADS, Case
from .inputs import check_outputs, make_inputs
from .timing import copy_bandwidth, copy_pairs, copy_time, cpu_times, gpu_time_per_call, host_times, l2_bytes


CASE_ERROR = "(whole case)"  # the provider name of the row recording a case that could not run


@dataclass
class Options:
    cases: list[Case]
    providers: list[str]  # canonical names: backend names and peers
    device: torch.device
    sets: int | None = None  # input sets to rotate, at least (GPU: raised to exceed 3x L2)
    repeats: int | None = None  # GPU: graph replays; CPU: timed loops (median and spread)
    time_ms: float | None = None  # GPU: GPU time per graph; CPU: time per timed loop
    host: bool = True  # host time per eager call (GPU)
    candidates: bool = False  # time kernel candidates instead of providers
    threads: int | None = None
    progress: object = field(default_factory=lambda: sys.stderr)
    after_case: object = None  # called with the results so far after each case (saving them)


class Progress:
    """Per-case lines with the elapsed time and an ETA (mean time per case so far)."""

    def __init__(self, total: int, stream):
        self.total, self.stream, self.done = total, stream, 0
        self.start = time.perf_counter()

    def case_done(self, case: Case, seconds: float, note: str = "") -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        print(f"[{self.done}/{self.total}] {case.name:28s} {seconds:6.1f} s   elapsed {_clock(elapsed)}   "
              f"ETA {_clock(eta)}{'   ' + note if note else ''}", file=self.stream, flush=True)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


# ---------------------------------------------------------------------------------------------
# Environment


def warm_cpu_allocator() -> str:
    """Keep freed memory in the process (glibc malloc: no mmap for large blocks, no trimming), so
    that outputs and temporaries reuse pages already faulted in instead of faulting fresh ones.
    Returns what was done, for the report."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        ok = libc.mallopt(m_mmap_max, 0) == 1 and libc.mallopt(m_trim_threshold, 1 << 30) == 1
    except (OSError, AttributeError):
        ok = False
    if ok:
        return ("glibc malloc keeps freed blocks (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=1 GiB): "
                "after two warm-up rounds no call page-faults")
    return "allocator not warmed (no glibc mallopt here): only warm-up rounds before timing"


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(module: str) -> str | None:
    try:
        import importlib.metadata

        return importlib.metadata.version(module)
    except Exception:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] or None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _load_average() -> float | None:
    """The 1-minute load average: above the thread count, other processes compete for the CPUs
    (and CPU times are not what the code alone would give)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def environment(device: torch.device) -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": os.environ.get("ROPE_OPS_COMMIT") or _git_commit(),
           "rope_ops": rope_ops.__version__, "python": platform.python_version(), "torch": torch.__version__,
           "triton": _version("triton"), "transformers": _version("transformers"),
           "liger_kernel": _version("liger-kernel") or _version("liger_kernel"),
           "machine": platform.machine(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
           "threads": torch.get_num_threads(), "device": device.type, "load_average": _load_average()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda, driver=_driver_version(),
                   sms=props.multi_processor_count, l2_mb=l2_bytes(device) / 2**20)
    return env


# ---------------------------------------------------------------------------------------------
# One case


def _rope(case: Case, device: torch.device):
    rows = TABLE_POSITIONS if device.type == "cuda" else CPU_TABLE_POSITIONS
    return rope_ops.RotaryEmbedding(case.head_dim, rotary_dim=case.rot, base=case.base, max_position=rows,
                                    style=case.style, device=device)


def _n_sets(case: Case, opts: Options) -> int:
    if opts.device.type != "cuda":
        return opts.sets or 2
    per_set = max(1, case.bytes_moved() // (2 if case.train else 1) // 2)  # bytes one call reads
    return max(opts.sets or 4, min(64, -(-l2_bytes(opts.device) * 3 // per_set)))


def _apply_targets(row: dict, targets) -> None:
    mine = [t for t in targets if t.provider == row["provider"]]
    if not mine or "time_us" not in row:
        return
    row["targets"] = [{"target": t.text(), "met": t.met(row)} for t in mine]
    verdicts = [t["met"] for t in row["targets"]]
    row["met"] = None if None in verdicts else all(verdicts)


def _check_and_closures(provider, case, sets, rope):
    """The provider's closures, after one call on a fresh copy of set 0 checked against the
    reference (the fresh copy: some providers write their inputs)."""
    closures = provider.build(case, sets, rope)
    fresh = sets[0].fresh()
    before = fresh.fresh()
    outputs = provider.build(case, [fresh], rope)[0]()
    tables = providers_mod.peer_tables(case, before, rope) if case.angles == "token" else None
    check = check_outputs(case, before, provider.layout_outputs(case, outputs), rope.inv_freq,
                          rope.attention_factor, tables)
    return closures, check


def gpu_case(case: Case, opts: Options, bandwidth: float) -> list[dict]:
    from . import floors

    device = opts.device
    rope = _rope(case, device)
    sets = make_inputs(case, device, _n_sets(case, opts))
    moved = case.bytes_moved()
    copy_s = copy_time(moved // 2, device, len(sets))
    kind = case.floor_kind()
    base = {"case": case.name, "group": case.group, "bytes": moved, "sets": len(sets)}
    floor_row = {**base, "provider": f"floor ({kind})", "copy_us": copy_s * 1e6, "floor": True}
    try:
        if kind == "copy":
            floor_s, config = copy_s, "torch copy_"
        elif kind == "copy-kernel":
            floor_s, config = floors.copy_kernel_time(moved // 2, device, len(sets))
        elif kind == "dependent-load":
            tables = rope.tables(device)
            floor_s, config = floors.dependent_load_time(case, sets, tables.cos, tables.sin)
        else:
            floor_s, config = floors.inplace_floor_time(case, sets)
        floor_row.update(floor_config=config, time_us=floor_s * 1e6, GBps=moved / floor_s / 1e9,
                         pct_copy=100 * moved / floor_s / bandwidth)
    except Exception as error:  # no floor: the rows still get their times, without ratios to it
        floor_s = None
        floor_row["error"] = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    rows = [floor_row]
    graph_seconds = (opts.time_ms or 20) / 1e3
    for name in opts.providers:
        provider = providers_mod.make(name)
        row = {**base, "provider": provider.name}
        try:
            closures, check = _check_and_closures(provider, case, sets, rope)
            seconds = gpu_time_per_call(closures, graph_seconds=graph_seconds, repeats=opts.repeats or 5)
            row.update(time_us=seconds * 1e6, GBps=moved / seconds / 1e9, pct_copy=100 * moved / seconds / bandwidth,
                       x_copy=seconds / copy_s, check=check)
            if floor_s is not None:
                row.update(x_floor=seconds / floor_s, pct_floor=100 * floor_s / seconds)
            del closures
        except providers_mod.Skip as why:
            row["skipped"] = str(why)
        except Exception as error:  # one failing provider must not sink the run
            row["error"] = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
        _apply_targets(row, case.gpu_targets())
        rows.append(row)
    del sets
    torch.cuda.empty_cache()
    return rows


def cpu_case(case: Case, opts: Options) -> list[dict]:
    device = opts.device
    rope = _rope(case, device)
    sets = make_inputs(case, device, _n_sets(case, opts))
    moved = case.bytes_moved()
    repeats, seconds = opts.repeats or 7, (opts.time_ms or 50) / 1e3
    pairs = copy_pairs(moved // 2, device, len(sets))
    copy = cpu_times([lambda s=s, d=d: d.copy_(s) for s, d in pairs], repeats, seconds)
    del pairs
    base = {"case": case.name, "group": case.group, "bytes": moved, "sets": len(sets)}
    rows = [{**base, "provider": "same-bytes copy", "floor": True, **_cpu_stats(copy, moved)}]
    for name in opts.providers:
        provider = providers_mod.make(name)
        row = {**base, "provider": provider.name}
        try:
            closures, check = _check_and_closures(provider, case, sets, rope)
            row.update(_cpu_stats(cpu_times(closures, repeats, seconds), moved), check=check)
            row["pct_same_copy"] = 100 * copy["median"] / (row["time_us"] / 1e6)
        except providers_mod.Skip as why:
            row["skipped"] = str(why)
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
        rows.append(row)
    reference = {r["provider"]: r.get("time_us") for r in rows}
    for row in rows:
        for key, peer in (("x_hf_eager", "hf-eager"), ("x_hf_compile", "hf-compile")):
            if reference.get(peer) and "time_us" in row and row["provider"] != peer:
                row[key] = reference[peer] / row["time_us"]
        _apply_targets(row, case.cpu_targets())
    return rows


def _cpu_stats(times: dict, moved: int) -> dict:
    median = times["median"]
    return {"time_us": median * 1e6, "min_us": times["min"] * 1e6, "max_us": times["max"] * 1e6,
            "spread_pct": 100 * (times["max"] - times["min"]) / 2 / median, "calls": times["calls"],
            "GBps": moved / median / 1e9}


def host_rows(opts: Options) -> list[dict]:
    """Host time per eager call of W2 (decode inference) and W4 (training fwd+bwd)."""
    rows = []
    for key in HOST_CASES:
        case = WORKLOADS[key]
        rope = _rope(case, opts.device)
        sets = make_inputs(case, opts.device, 4)
        for name in opts.providers:
            provider = providers_mod.make(name)
            row = {"case": key, "provider": provider.name}
            try:
                closures = provider.build(case, sets, rope)
                issue, wall = host_times(closures, opts.device, iterations=200 if not case.train else 50)
                row.update(host_us=issue * 1e6, wall_us=wall * 1e6)
            except providers_mod.Skip as why:
                row["skipped"] = str(why)
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
            rows.append(row)
        del sets
    return rows


def candidate_entries(case: Case, opts: Options, modules: dict) -> list[dict]:
    from .candidates import time_candidates

    rope = _rope(case, opts.device)
    sets = make_inputs(case, opts.device, _n_sets(case, opts))
    entries = []
    for name, module in modules.items():
        for entry in time_candidates(case, sets, rope, module, graph_seconds=(opts.time_ms or 5) / 1e3):
            entries.append({"backend": name, **entry})
    del sets
    torch.cuda.empty_cache()
    return entries


# ---------------------------------------------------------------------------------------------


def run_candidates(opts: Options, results: dict, progress: Progress) -> dict:
    """--candidates: the kernel candidates of each backend that exposes them, on every case."""
    from .candidates import CANDIDATE_BACKENDS, backend_module

    wanted = [b for b in CANDIDATE_BACKENDS if b in opts.providers] or list(CANDIDATE_BACKENDS)
    modules, missing = {}, {}
    for name in wanted:
        module, why = backend_module(name)
        if module is None:
            missing[name] = why
            continue
        try:
            reasons = rope_ops.registry.availability(rope_ops.registry.get(name))
        except rope_ops.BackendError as error:
            reasons = [str(error)]
        if reasons:
            missing[name] = "unavailable: " + "; ".join(reasons)
        else:
            modules[name] = module
    results["candidates"], results["candidates_missing"] = [], missing
    for case in opts.cases:
        t0 = time.perf_counter()
        if modules:
            try:
                results["candidates"] += candidate_entries(case, opts, modules)
            except Exception as error:  # the case's inputs: record it, go on
                results["candidates"].append({"case": case.name, "backend": ", ".join(modules), "direction": "-",
                                              "candidates": [], "error": f"{type(error).__name__}: {error}"})
                torch.cuda.empty_cache()
        progress.case_done(case, time.perf_counter() - t0)
        if opts.after_case:
            opts.after_case(results)
    return results


def run(opts: Options) -> dict:
    device = opts.device
    if opts.threads:
        torch.set_num_threads(opts.threads)
    results = {"environment": environment(device), "cases": {c.name: {**c.__dict__, "describe": c.describe(),
                                                                          "floor_kind": c.floor_kind(),
                                                                          "size_class": c.size_class(),
                                                                          "targets": [t.__dict__ for t in c.targets]}
                                                             for c in opts.cases},
               "providers": [providers_mod.display_name(p) for p in opts.providers], "rows": []}
    if device.type == "cpu":
        results["environment"]["allocator"] = warm_cpu_allocator()
    progress = Progress(len(opts.cases), opts.progress)
    print(f"rope_ops bench: {len(opts.cases)} case(s) on {results['environment'].get('gpu') or 'CPU'}"
          + (f", {torch.get_num_threads()} threads" if device.type == "cpu" else "")
          + (", kernel candidates" if opts.candidates else f", providers {', '.join(results['providers'])}"),
          file=opts.progress, flush=True)
    if opts.candidates:
        return run_candidates(opts, results, progress)
    if device.type == "cuda":
        results["copy_bandwidth_GBps"] = copy_bandwidth(device) / 1e9
    for case in opts.cases:
        t0 = time.perf_counter()
        try:
            if device.type == "cuda":
                rows = gpu_case(case, opts, results["copy_bandwidth_GBps"] * 1e9)
            else:
                rows = cpu_case(case, opts)
        except Exception as error:  # the case as a whole (inputs, copy): record it, go on
            rows = [{"case": case.name, "group": case.group, "provider": CASE_ERROR,
                     "error": f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"}]
            if device.type == "cuda":
                torch.cuda.empty_cache()
        results["rows"] += rows
        bad = [r["provider"] for r in rows if _failed(r)]
        progress.case_done(case, time.perf_counter() - t0, f"FAILED: {', '.join(bad)}" if bad else "")
        if opts.after_case:
            opts.after_case(results)
    if opts.host and device.type == "cuda":
        t0 = time.perf_counter()
        results["host"] = host_rows(opts)
        print(f"host time: {time.perf_counter() - t0:.1f} s", file=opts.progress, flush=True)
    results["environment"]["load_average_end"] = _load_average()
    return results


def merge(parts: list[dict]) -> dict:
    """Results of several runs (e.g. halves of the matrix) as one: the first run's environment,
    every run's rows, host times and candidates."""
    merged = dict(parts[0])
    merged["rows"] = [row for part in parts for row in part.get("rows", [])]
    merged["cases"] = {name: case for part in parts for name, case in part.get("cases", {}).items()}
    for key in ("host", "candidates"):
        if any(key in part for part in parts):
            merged[key] = [item for part in parts for item in part.get(key, [])]
    missing = {name: why for part in parts for name, why in part.get("candidates_missing", {}).items()}
    if missing:
        merged["candidates_missing"] = missing
    bandwidths = sorted({round(p["copy_bandwidth_GBps"]) for p in parts if "copy_bandwidth_GBps" in p})
    if len(bandwidths) > 1:
        merged["environment"] = {**merged["environment"],
                                 "note": f"merged from {len(parts)} runs, copy bandwidths {bandwidths} GB/s"}
    return merged


def _failed(row: dict) -> bool:
    if row["provider"] == CASE_ERROR or (row.get("floor") and "error" in row):
        return True
    return row["provider"].startswith("rope_ops:") and ("error" in row or str(row.get("check", "")).startswith("MISMATCH"))


def failures(results: dict) -> list[str]:
    """What makes the run fail (its exit status): rope_ops rows that errored or whose outputs
    failed the check, a case or floor that could not run, policy choices whose outputs failed
    the check."""
    bad = [f"{r['case']} {r['provider']}: {r.get('error') or r.get('check')}" for r in results.get("rows", [])
           if _failed(r)]
    for entry in results.get("candidates", []):
        if entry.get("error"):
            bad.append(f"{entry['case']} {entry['backend']} candidates: {entry['error']}")
            continue
        policy = next((c for c in entry["candidates"] if c["label"] == entry.get("policy")), None)
        if policy is not None and (policy.get("error") or str(policy.get("check", "")).startswith("MISMATCH")):
            bad.append(f"{entry['case']} {entry['backend']} policy {policy['label']}: "
                       f"{policy.get('error') or policy.get('check')}")
    return bad
