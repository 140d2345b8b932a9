"""Time probe kernels against the library's own kernels and a same-bytes copy, on the GPU.

    python tools/kernel_probe.py tools/probes/flat_steps.cu [--shapes W4f,W1] [--only 0,2,3]

The probe source (see tools/probes/kernel_probe.h for its C interface) is built with nvcc into a
shared library and called through ctypes; it usually #includes csrc/rope_kernels.cu, so probe 0
can be the library's own launch and the others variations of it. For each PERF.md-like shape
(bf16, contiguous [tokens, H, D], float32 tables over 131072 positions), every probe's output on
one input set must equal probe 0's bit for bit ("DIFF" otherwise), and each is timed like the
benchmark (CUDA graph replay, rotating input sets so L2 does not hold them) next to torch's copy
of the bytes it must move. One build, one process: the ratios in a line come from one run.
This is a development tool for kernel work; `python -m rope_ops bench` is what reports results.
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

import rope_ops
from rope_ops import bench

ROOT = Path(__file__).resolve().parent.parent


class ProbeCall(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("q", "k", "q_out", "k_out", "pos", "cos_t", "sin_t",
                                               "freq_turns")] + \
               [("tokens", ctypes.c_int64), ("table_rows", ctypes.c_int64)] + \
               [(n, ctypes.c_int) for n in ("Hq", "Hk", "D", "R", "interleaved", "inverse", "inplace",
                                            "pdl")]


@dataclass
class Shape:
    tokens: int
    hq: int
    hk: int
    head_dim: int = 128
    rotary_dim: int = 128
    style: str = "neox"
    base: float = 500000.0
    inverse: bool = False
    inplace: bool = False
    decode: bool = False


SHAPES = {
    "W1": Shape(16384, 32, 8),
    "W2": Shape(256, 32, 8, decode=True),
    "W3": Shape(8192, 16, 16, 256, 64, "gptj", 10000.0),
    "W3i": Shape(8192, 16, 16, 256, 64, "gptj", 10000.0, inplace=True),
    # not PERF.md workloads: W3i with NeoX pairs, and W1 in place (whole rows rotary)
    "W3ni": Shape(8192, 16, 16, 256, 64, "neox", 10000.0, inplace=True),
    "W1i": Shape(16384, 32, 8, inplace=True),
    "W4f": Shape(8192, 32, 32),
    "W4b": Shape(8192, 32, 32, inverse=True),
    "W5": Shape(32768, 64, 8),
}


def build(source: Path, arch: str = "90", verbose: bool = False, nvcc: str = "nvcc") -> ctypes.CDLL:
    """nvcc-build `source` into a shared library (CUDA runtime linked statically, so it loads on
    a machine without a GPU) and declare the probe interface's signatures."""
    so = Path(tempfile.mkdtemp(prefix="kernel_probe_")) / (source.stem + ".so")
    cmd = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-shared", f"-gencode=arch=compute_{arch},code=sm_{arch}",
           "-I", str(ROOT / "csrc"), "-I", str(ROOT / "tools" / "probes"), str(source), "-o", str(so)]
    if verbose:
        cmd.insert(1, "-Xptxas=-v")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if verbose or done.returncode:
        print(done.stdout + done.stderr)
    done.check_returncode()
    lib = ctypes.CDLL(str(so))
    lib.probe_count.restype = ctypes.c_int
    lib.probe_name.restype = ctypes.c_char_p
    lib.probe_name.argtypes = [ctypes.c_int]
    lib.probe_launch.argtypes = [ctypes.c_int, ctypes.POINTER(ProbeCall), ctypes.c_void_p]
    lib.probe_launch.restype = ctypes.c_int
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("--shapes", default="W4f,W4b,W1,W5,W3,W3i,W2")
    ap.add_argument("--only", default=None, help="probe numbers to run (0 always runs)")
    ap.add_argument("--arch", default="90")
    ap.add_argument("--pdl", type=int, default=1)
    ap.add_argument("--ptxas", action="store_true", help="print ptxas's resource report")
    a = ap.parse_args()
    lib = build(a.source, a.arch, a.ptxas)
    probes = range(lib.probe_count())
    if a.only:
        probes = sorted({0, *(int(x) for x in a.only.split(","))})
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; "
          f"copy bandwidth {bench.copy_bandwidth(dev) / 1e9:.0f} GB/s", flush=True)
    for i in probes:
        print(f"  probe {i}: {lib.probe_name(i).decode()}")
    for name in a.shapes.split(","):
        run_shape(lib, name, SHAPES[name], probes, dev, a.pdl)


def run_shape(lib, name: str, sh: Shape, probes, dev, pdl: int) -> None:
    bf16 = torch.bfloat16
    rope = rope_ops.RotaryEmbedding(sh.head_dim, rotary_dim=sh.rotary_dim, base=sh.base,
                                    max_position=bench.TABLE_POSITIONS, style=sh.style, device="cuda")
    cos, sin, turns = rope.tables(dev)
    per_set = 2 * sh.tokens * (sh.hq + sh.hk) * sh.head_dim * 2  # bytes read + written
    nsets = max(2, min(16, -(-bench.l2_bytes(dev) * 3 // per_set)))
    gen = torch.Generator(device="cpu").manual_seed(0)
    if sh.decode:
        pos = torch.randint(0, 32768, (sh.tokens,), generator=gen).to(dev)
    else:
        pos = torch.arange(4096).repeat(-(-sh.tokens // 4096))[:sh.tokens].to(dev)
    sets = [(torch.randn(sh.tokens, sh.hq, sh.head_dim, generator=gen).to(dev, bf16),
             torch.randn(sh.tokens, sh.hk, sh.head_dim, generator=gen).to(dev, bf16)) for _ in range(nsets)]
    outs = [(torch.empty_like(q), torch.empty_like(k)) for q, k in sets]
    stream = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)  # noqa: E731

    def call(which, q, k, qo, ko):
        c = ProbeCall(q.data_ptr(), k.data_ptr(), qo.data_ptr(), ko.data_ptr(), pos.data_ptr(), cos.data_ptr(),
                      sin.data_ptr(), turns.data_ptr(), sh.tokens, cos.shape[0], sh.hq, sh.hk, sh.head_dim,
                      sh.rotary_dim, int(sh.style == "gptj"), int(sh.inverse), int(sh.inplace), pdl)
        return lib.probe_launch(which, ctypes.byref(c), stream())

    # moved bytes: the rotary dims only in place, whole rows otherwise
    moved = per_set * sh.rotary_dim // sh.head_dim if sh.inplace else per_set
    pairs = [(torch.empty(moved // 2, dtype=torch.uint8, device=dev),
              torch.empty(moved // 2, dtype=torch.uint8, device=dev)) for _ in range(nsets)]
    copy_us = timed([lambda a=a, b=b: b.copy_(a) for a, b in pairs])
    first = (sets[0][0].clone(), sets[0][1].clone())  # in-place timing rewrites the sets
    expected = None
    results = []
    for which in probes:
        q0, k0 = first[0].clone(), first[1].clone()
        qo, ko = torch.empty_like(q0), torch.empty_like(k0)
        rc = call(which, q0, k0, qo, ko)
        if rc == 1:
            continue
        assert rc == 0, f"probe {which} on {name}: error {rc}"
        torch.cuda.synchronize()
        got = (q0, k0) if sh.inplace else (qo, ko)
        if expected is None:
            expected = got
            mark = ""
        else:
            same = all(torch.equal(x, y) for x, y in zip(got, expected))
            mark = "" if same else " DIFF " + str(max((x.float() - y.float()).abs().max().item()
                                                     for x, y in zip(got, expected)))
        calls = [lambda s=s, o=o: call(which, *s, *o) for s, o in zip(sets, outs)]
        us = timed(calls)
        results.append(f"{which}: {us:.2f} ({us / copy_us:.3f}){mark}")
    print(f"{name} (copy {copy_us:.2f} us): " + " | ".join(results), flush=True)
    del sets, outs, pairs
    torch.cuda.empty_cache()


def timed(calls) -> float:
    return min(bench.gpu_time_per_call(calls) for _ in range(2)) * 1e6


if __name__ == "__main__":
    main()
