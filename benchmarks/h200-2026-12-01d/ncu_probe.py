"""One-off (H200, under ncu): W4-shape forward (8192 tokens x 32+32 heads), W5-shape forward
(8192 tokens x 64+8) and a Triton copy of W4's bytes, each launched a few times."""
import sys
import torch
import triton
import triton.language as tl
import rope_ops
from rope_ops import bench
from rope_ops.backend import KernelArgs
from rope_ops_backends import cuda_backend as cb

dev, bf16, T, D = torch.device("cuda"), torch.bfloat16, 8192, 128
backend = cb.CudaBackend()
assert not backend.availability()
rope = rope_ops.RotaryEmbedding(D, base=500000.0, max_position=bench.TABLE_POSITIONS, device=dev)
cos, sin, ft = rope.tables(dev)
pos = torch.arange(4096, device=dev).repeat(2)


def rope_calls(hq, hk):
    out = []
    for _ in range(3):
        q, k = torch.randn(T, hq, D, device=dev, dtype=bf16), torch.randn(T, hk, D, device=dev, dtype=bf16)
        a = KernelArgs(q=q, k=k, q_out=torch.empty_like(q), k_out=torch.empty_like(k), pos=pos, pos_offset=0,
                       cos=cos, sin=sin, freq_turns=ft, attention_factor=1.0, layout="thd", rotary_dim=D,
                       interleaved=False, inverse=False, inplace=False)
        out.append(lambda a=a: backend.run(a))
    return out


@triton.jit
def copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


n = T * 64 * D
bufs = [(torch.randn(n, device=dev, dtype=bf16), torch.empty(n, device=dev, dtype=bf16)) for _ in range(3)]
for name, calls in (("w4", rope_calls(32, 32)), ("w5shape", rope_calls(64, 8)),
                    ("copy", [lambda s=s, d=d: copy_kernel[(triton.cdiv(n, 4096),)](s, d, n, BLOCK=4096, num_warps=8)
                              for s, d in bufs])):
    torch.cuda.nvtx.range_push(name)
    for i in range(6):
        calls[i % 3]()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
print("done")
