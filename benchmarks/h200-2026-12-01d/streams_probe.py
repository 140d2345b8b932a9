"""One-off probe (H200): does W4's kernel lose bandwidth because it reads and writes four equal
streams (q, k, q_out, k_out) at once? Forward only, W4's shape (8192 tokens x 64 heads x 128,
bf16), one grid config for all cases ({4, 6, 2048, 128}), against a same-bytes copy."""
import subprocess
import sys

import torch

import rope_ops
from rope_ops import bench
from rope_ops.backend import KernelArgs
from rope_ops_backends import cuda_backend as cb

dev = torch.device("cuda")
bf16 = torch.bfloat16
backend = cb.CudaBackend()
assert not backend.availability()
T, D = 8192, 128
rope = rope_ops.RotaryEmbedding(D, base=500000.0, max_position=bench.TABLE_POSITIONS, device=dev)
cos, sin, ft = rope.tables(dev)
pos = torch.arange(4096, device=dev).repeat(2)
NSETS = 4


def smi():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,"
                               "clocks_throttle_reasons.active", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return str(e)


def args(q, k, qo, ko, inplace=False):
    return KernelArgs(q=q, k=k, q_out=qo, k_out=ko, pos=pos, pos_offset=0, cos=cos, sin=sin,
                      freq_turns=ft, attention_factor=1.0, layout="thd", rotary_dim=D,
                      interleaved=False, inverse=False, inplace=inplace)


def case(kind):
    calls = []
    for _ in range(NSETS):
        if kind == "separate q32 k32":
            q, k = torch.randn(T, 32, D, device=dev, dtype=bf16), torch.randn(T, 32, D, device=dev, dtype=bf16)
            a = args(q, k, torch.empty_like(q), torch.empty_like(k))
        elif kind == "q64, k None":
            q = torch.randn(T, 64, D, device=dev, dtype=bf16)
            a = args(q, None, torch.empty_like(q), None)
        elif kind == "separate q56 k8":
            q, k = torch.randn(T, 56, D, device=dev, dtype=bf16), torch.randn(T, 8, D, device=dev, dtype=bf16)
            a = args(q, k, torch.empty_like(q), torch.empty_like(k))
        elif kind == "packed in, separate out":
            x = torch.randn(T, 64, D, device=dev, dtype=bf16)
            q, k = x[:, :32], x[:, 32:]
            a = args(q, k, torch.empty(T, 32, D, device=dev, dtype=bf16), torch.empty(T, 32, D, device=dev, dtype=bf16))
        elif kind == "packed in, packed out":
            x, y = torch.randn(T, 64, D, device=dev, dtype=bf16), torch.empty(T, 64, D, device=dev, dtype=bf16)
            a = args(x[:, :32], x[:, 32:], y[:, :32], y[:, 32:])
        elif kind == "separate, in place":
            q, k = torch.randn(T, 32, D, device=dev, dtype=bf16), torch.randn(T, 32, D, device=dev, dtype=bf16)
            a = args(q, k, q, k, inplace=True)
        elif kind == "packed, in place":
            x = torch.randn(T, 64, D, device=dev, dtype=bf16)
            a = args(x[:, :32], x[:, 32:], x[:, :32], x[:, 32:], inplace=True)
        calls.append(lambda a=a: backend.run(a))
    return calls


moved = 2 * T * 64 * D * 2
bw = bench.copy_bandwidth(dev)
print(f"copy bandwidth {bw / 1e9:.0f} GB/s; {smi()}")
cb.set_config(4, 6, 2048)
cb.set_launch(128, -1, -1)
kinds = ["separate q32 k32", "q64, k None", "separate q56 k8", "packed in, separate out",
         "packed in, packed out", "separate, in place", "packed, in place"]
built = {k: case(k) for k in kinds}
pairs = [(torch.empty(moved // 2, dtype=torch.uint8, device=dev), torch.empty(moved // 2, dtype=torch.uint8, device=dev))
         for _ in range(NSETS)]
built["same-bytes copy"] = [lambda a=a, b=b: b.copy_(a) for a, b in pairs]
res = {}
for rep in range(3):
    for name, calls in built.items():
        res.setdefault(name, []).append(bench.gpu_time_per_call(calls) * 1e6)
    print(f"after rep {rep}: {smi()}", flush=True)
for name, ts in res.items():
    t = min(ts)
    print(f"{name:26s} {' '.join(f'{x:.2f}' for x in ts)} us; best {t:.2f} us = {moved / t / 1e3:.0f} GB/s "
          f"= {100 * moved / (t * 1e-6) / bw:.1f} % of copy")
