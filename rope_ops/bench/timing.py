"""Timers: GPU time in a CUDA graph, host time of eager loops, CPU time as medians of repeats,
and the same-run copy every result is compared with.

GPU time: N calls captured in one CUDA graph, rotating input sets so L2 does not hold them,
replay time / N, after warm-up. Host time: wall time per call of a plain Python loop. CPU time:
the median (and spread) of several timed loops, after warm-up.
"""

from __future__ import annotations

import math
import statistics
import time

import torch


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
    max_calls), so the replay's own start-up (~10-20 us) is spread thin.
    """
    warm_up(closures)
    seconds = graph_seconds_per_call(closures, 20, repeats=3)
    wanted = max(20, min(max_calls, int(graph_seconds / max(seconds, 1e-9))))
    if wanted > 20:
        seconds = graph_seconds_per_call(closures, wanted, repeats)
    return seconds


def host_time_per_call(closures, device, iterations: int = 200) -> float:
    """Wall seconds per call of a plain eager loop, synchronised at its end (best of three)."""
    return host_times(closures, device, iterations)[1]


def host_times(closures, device, iterations: int = 200) -> tuple[float, float]:
    """(issue, wall) seconds per call of a plain eager loop, best of three loops: issue is the
    host's time to make the calls (the loop before the final synchronisation), wall includes
    waiting for the device. Host-bound calls have issue ~ wall; GPU-bound ones issue < wall."""
    for fn in closures:
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    issue, wall = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(iterations):
            closures[i % len(closures)]()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        issue.append((t1 - t0) / iterations)
        wall.append((t2 - t0) / iterations)
    return min(issue), min(wall)


def cpu_times(closures, repeats: int = 7, seconds: float = 0.05) -> dict:
    """CPU seconds per call: each of ``repeats`` loops runs ~``seconds`` of calls (rotating the
    closures); returns the median, min and max of the loops' per-call times, after two warm-up
    rounds (which also bring every allocation the calls make into the warmed allocator)."""
    for _ in range(2):
        for fn in closures:
            fn()
    t0 = time.perf_counter()
    for fn in closures:
        fn()
    one = max((time.perf_counter() - t0) / len(closures), 1e-7)
    calls = max(len(closures), math.ceil(seconds / one / len(closures)) * len(closures))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(calls):
            closures[i % len(closures)]()
        samples.append((time.perf_counter() - t0) / calls)
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "calls": calls, "samples": samples}


def l2_bytes(device) -> int:
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 << 20)


def copy_pairs(n_bytes: int, device, n_sets: int) -> list:
    elements = max(1, n_bytes // 2)
    return [(torch.empty(elements, dtype=torch.bfloat16, device=device).normal_(),
             torch.empty(elements, dtype=torch.bfloat16, device=device)) for _ in range(n_sets)]


def copy_time(n_bytes: int, device, n_sets: int) -> float:
    """Seconds for a copy of n_bytes (reads n_bytes, writes n_bytes), timed like the workloads.

    On a GPU the faster of graph replay and back-to-back eager launches (timed with events):
    a large memcpy captured in a graph can run on the copy engines, slower than the copy kernel
    eager launches use, and the reference should be the best copy the card does. On a CPU the
    median of cpu_times, into preallocated destinations.
    """
    pairs = copy_pairs(n_bytes, device, n_sets)
    closures = [lambda s=s, d=d: d.copy_(s) for s, d in pairs]
    if device.type != "cuda":
        return cpu_times(closures, repeats=5)["median"]
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
