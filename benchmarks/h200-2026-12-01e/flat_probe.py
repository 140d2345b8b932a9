"""One-off (H200): is W4's ~4 % gap to a copy in our kernels or in any hand-written kernel?

Builds flat_probe.cu with nvcc and times, on W4's forward shape, W1 and W5 (bf16, contiguous
[tokens, H, 128], NeoX), each against torch's copy of the same bytes, bench-style (CUDA graphs,
rotating input sets): a plain hand-written CUDA copy (flat_copy: U 16-byte vectors per thread,
PDL on or off), the library's CUDA kernel (rope_ops.apply), and flat_rope (one block per token's
q or k heads, copy-like contiguous block ranges, partner halves by shuffles), whose output must
equal the library's bit for bit."""
import ctypes
import subprocess
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

import rope_ops
from rope_ops import bench

HERE = Path(__file__).resolve().parent
so = Path("/tmp/flat_probe.so")
subprocess.run(["nvcc", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-shared",
                "-gencode=arch=compute_90,code=sm_90", str(HERE / "flat_probe.cu"), "-o", str(so)],
               check=True)
lib = ctypes.CDLL(str(so))
P, LL, I = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int
lib.probe_copy.argtypes = [P, P, LL, I, I, I, I, I, P]
lib.probe_rope.argtypes = [P, P, P, P, P, P, P, LL, I, I, I, I, I, P]



@triton.jit
def triton_copy(src, dst, n, BLOCK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = off < n
    tl.store(dst + off, tl.load(src + off, mask=m), mask=m)


dev = torch.device("cuda")
bf16 = torch.bfloat16
bw = bench.copy_bandwidth(dev)
print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
stream = lambda: P(torch.cuda.current_stream().cuda_stream)  # noqa: E731


def timed(calls):
    return min(bench.gpu_time_per_call(calls) for _ in range(2)) * 1e6


rope = rope_ops.RotaryEmbedding(128, base=500000.0, max_position=bench.TABLE_POSITIONS, device="cuda")
cos, sin, _ = rope.tables(dev)
assert cos.is_contiguous() and cos.shape[1] == 64 and cos.dtype == torch.float32
for label, tokens, hq, hk in (("W4 fwd", 8192, 32, 32), ("W1", 16384, 32, 8), ("W5", 32768, 64, 8)):
    per_set = 2 * tokens * (hq + hk) * 128 * 2
    nsets = max(2, min(16, -(-bench.l2_bytes(dev) * 3 // per_set)))
    pos = torch.arange(4096, device=dev).repeat(tokens // 4096)
    sets = [(torch.randn(tokens, hq, 128, device=dev, dtype=bf16), torch.randn(tokens, hk, 128, device=dev, dtype=bf16))
            for _ in range(nsets)]
    outs = [(torch.empty_like(q), torch.empty_like(k)) for q, k in sets]
    pairs = [(torch.empty(per_set // 2, dtype=torch.uint8, device=dev),
              torch.empty(per_set // 2, dtype=torch.uint8, device=dev)) for _ in range(nsets)]
    res = {"torch copy": timed([lambda a=a, b=b: b.copy_(a) for a, b in pairs])}
    nvec = per_set // 2 // 16
    for threads, u, pdl, ld, st in ((128, 4, 1, 0, 0), (128, 4, 1, 1, 0), (128, 4, 1, 1, 1), (64, 1, 1, 1, 0),
                                    (64, 2, 1, 1, 0), (64, 4, 1, 1, 0), (128, 1, 1, 1, 0), (128, 2, 1, 1, 0),
                                    (256, 1, 1, 1, 0), (256, 2, 1, 1, 0), (256, 4, 1, 1, 0)):
        def cp(a, b, threads=threads, u=u, pdl=pdl, ld=ld, st=st):
            assert lib.probe_copy(P(a.data_ptr()), P(b.data_ptr()), nvec, threads, u, pdl, ld, st, stream()) == 0
        calls = [lambda a=a, b=b: cp(a, b) for a, b in pairs]
        calls[0]()
        torch.cuda.synchronize()
        assert torch.equal(pairs[0][0], pairs[0][1])
        res[f"our copy {threads}x{u} pdl{pdl} {('ld.cs', 'ld', 'ld.nc')[ld]}{'+st.cs' if st else ''}"] = timed(calls)
    tri = [lambda a=a, b=b: triton_copy[(triton.cdiv(per_set // 2, 8192),)](a, b, per_set // 2, BLOCK=8192, num_warps=4)
           for a, b in pairs]
    res["triton copy 8 KB/4 warps"] = timed(tri)
    res["library cuda"] = timed([lambda q=q, k=k: rope_ops.apply(q, k, pos, rope=rope, backend="cuda") for q, k in sets])
    ref_q, ref_k = rope_ops.apply(sets[0][0], sets[0][1], pos, rope=rope, backend="cuda")
    for threads, pdl, ld in ((128, 1, 0), (128, 1, 1), (256, 1, 1), (64, 1, 1)):
        if (max(hq, hk) * 16 + threads - 1) // threads > 8:
            continue
        def rp(q, k, qo, ko, threads=threads, pdl=pdl, ld=ld):
            rc = lib.probe_rope(P(q.data_ptr()), P(k.data_ptr()), P(qo.data_ptr()), P(ko.data_ptr()), P(pos.data_ptr()),
                                P(cos.data_ptr()), P(sin.data_ptr()), tokens, hq, hk, threads, pdl, ld, stream())
            assert rc == 0, rc
        calls = [lambda s=s, o=o: rp(*s, *o) for s, o in zip(sets, outs)]
        calls[0]()
        torch.cuda.synchronize()
        same = torch.equal(outs[0][0], ref_q) and torch.equal(outs[0][1], ref_k)
        res[f"flat rope {threads} pdl{pdl} {('ld.cs', 'ld')[ld]}{'' if same else ' WRONG'}"] = timed(calls)
    tc = res["torch copy"]
    print(f"{label}: " + " | ".join(f"{n} {t:.2f} ({t / tc:.3f})" for n, t in res.items()), flush=True)
    del sets, outs, pairs
    torch.cuda.empty_cache()
