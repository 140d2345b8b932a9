"""One-off probe (H200): (1) why rope_ops.bench's W4 takes ~1.3 % longer than gpu_cuda_check's W4
with the same kernels, and which grid suits 64 heads per token; (2) W3 in place: what the
access pattern (128 of every 512 bytes) costs any kernel on this card.

Run from the repo root after tools/gpu_run.sh setup build:  python3 bench_out/w4_w3i_probe.py
"""
import ctypes
import glob
import os
import statistics
import sys

import torch

import rope_ops
from rope_ops import bench
from rope_ops.backend import KernelArgs
from rope_ops_backends import cuda_backend as cb

dev = torch.device("cuda")
bf16 = torch.bfloat16
backend = cb.CudaBackend()
assert not backend.availability(), backend.availability()
bw = bench.copy_bandwidth(dev)
print(f"copy bandwidth {bw / 1e9:.0f} GB/s  torch {torch.__version__}  {torch.cuda.get_device_name()}")
only = set(sys.argv[1:]) or {"w4", "profile", "config", "scale", "w3i"}


def t_us(closures, repeats=5):
    return bench.gpu_time_per_call(closures, repeats=repeats) * 1e6


def rope_for(w):
    return rope_ops.RotaryEmbedding(w.head_dim, rotary_dim=w.rotary_dim, base=w.base,
                                    max_position=bench.TABLE_POSITIONS, style=w.style, device=dev)


def direct_closures(w, sets, rope, pos_dtype=None, fwd_only=False):
    """The bench's inputs through CudaBackend.run with preallocated outputs (as gpu_cuda_check)."""
    cos, sin, ft = rope.tables(dev)
    out = []
    for s in sets:
        pos = s.pos if pos_dtype is None else s.pos.to(pos_dtype)
        mk = lambda a, b, inv: KernelArgs(  # noqa: E731
            q=a, k=b, q_out=torch.empty_like(a), k_out=torch.empty_like(b), pos=pos, pos_offset=0,
            cos=cos, sin=sin, freq_turns=ft, attention_factor=1.0, layout="thd",
            rotary_dim=w.rotary_dim, interleaved=w.style == "gptj", inverse=inv, inplace=False)
        f = mk(s.q, s.k, False)
        if fwd_only or not w.backward:
            out.append(lambda f=f: backend.run(f))
        else:
            b = mk(s.grad_q, s.grad_k, True)
            out.append(lambda f=f, b=b: (backend.run(f), backend.run(b)))
    return out


w4 = bench.WORKLOADS["W4"]
moved4 = w4.bytes_moved(bf16)


def pct(t, moved=moved4):
    return 100 * moved / (t * 1e-6) / bw


if only & {"w4", "profile", "config"}:
    rope4 = rope_for(w4)
    sets4 = bench.make_inputs(w4, bf16, dev, 4)
    via_apply = bench.provider_rope_ops("cuda")(w4, sets4, rope4)
    direct = direct_closures(w4, sets4, rope4)

if "w4" in only:
    print("\n== W4: bench path (rope_ops.apply + apply_grad) vs direct CudaBackend.run, alternated")
    direct32 = direct_closures(w4, sets4, rope4, pos_dtype=torch.int32)
    # apply + apply that keep nothing: two forwards (is the backward launch any different?)
    two_fwd = [lambda s=s: (rope_ops.apply(s.q, s.k, s.pos, rope=rope4, backend="cuda"),
                            rope_ops.apply(s.grad_q, s.grad_k, s.pos, rope=rope4, backend="cuda"))
               for s in sets4]
    copies = [(torch.empty(moved4 // 4, dtype=torch.uint8, device=dev),
               torch.empty(moved4 // 4, dtype=torch.uint8, device=dev)) for _ in range(4)]
    same_bytes = [lambda a=a, b=b: (b.copy_(a), a.copy_(b)) for a, b in copies]
    res = {}
    for rep in range(3):
        for name, cl in (("apply+apply_grad", via_apply), ("direct run, int64 pos", direct),
                         ("direct run, int32 pos", direct32), ("apply x2 (fwd, fwd)", two_fwd),
                         ("same-bytes copy (2 copies)", same_bytes)):
            res.setdefault(name, []).append(t_us(cl))
    for name, ts in res.items():
        print(f"W4 {name:28s} {' '.join(f'{t:.2f}' for t in ts)} us; best {min(ts):.2f} = {pct(min(ts)):.1f} %")
    del copies, same_bytes, direct32, two_fwd

if "profile" in only:
    print("\n== W4 kernels per call (torch.profiler, eager, 8 calls each)")
    from torch.profiler import ProfilerActivity, profile
    for name, cl in (("apply+apply_grad", via_apply), ("direct run", direct)):
        for fn in cl:
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(8):
                cl[i % len(cl)]()
            torch.cuda.synchronize()
        print(f"-- {name}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=70))

if "config" in only:
    print("\n== W4 (bench path) under grid configs {variant, max_heads, min_threads, block}")
    configs = [(-1, -1, -1, -1), (4, 4, 2048, 256), (4, 4, 2048, 128), (4, 8, 2048, 128),
               (4, 8, 2048, 256), (1, 8, 2048, 128), (1, 6, 2048, 128), (4, 6, 2048, 256),
               (4, 16, 2048, 128), (4, 2, 2048, 128), (-1, -1, -1, -1)]
    for v, u, mt, blk in configs:
        cb.set_config(v, u, mt)
        cb.set_launch(blk, -1, -1)
        try:
            ts = [t_us(via_apply, repeats=5) for _ in range(2)]
            dts = [t_us(direct, repeats=5) for _ in range(2)]
        finally:
            cb.set_config(-1, -1, -1)
            cb.set_launch(-1, -1, -1)
        print(f"W4 config {v:2d} {u:2d} {mt:5d} {blk:4d}: apply {min(ts):.2f} us ({pct(min(ts)):.1f} %), "
              f"direct {min(dts):.2f} us ({pct(min(dts)):.1f} %)", flush=True)

if only & {"w4", "profile", "config"}:
    del via_apply, direct, sets4
    torch.cuda.empty_cache()

if "scale" in only:
    print("\n== forward only, 64 heads x 128 (W4's kernel), by token count: ours vs same-bytes copy")
    print("   (a per-call fixed cost shows as the intercept of time vs bytes)")
    pts = []
    for tokens in (2048, 4096, 8192, 16384, 32768):
        w = bench.Workload("S", "scale", 1, tokens, 32, 32, 128, 128)
        rope = rope_for(w)
        per_set = w.bytes_moved(bf16)
        n = max(2, min(32, -(-bench.l2_bytes(dev) * 3 // per_set)))
        sets = bench.make_inputs(w, bf16, dev, n)
        ours = t_us(direct_closures(w, sets, rope))
        pairs = [(torch.empty(per_set // 2, dtype=torch.uint8, device=dev),
                  torch.empty(per_set // 2, dtype=torch.uint8, device=dev)) for _ in range(n)]
        cp = t_us([lambda a=a, b=b: b.copy_(a) for a, b in pairs])
        pts.append((per_set, ours, cp))
        print(f"tokens {tokens:6d}: {per_set / 1e6:8.1f} MB  ours {ours:8.2f} us  copy {cp:8.2f} us  "
              f"ours/copy {ours / cp:.4f}", flush=True)
        del sets, pairs
        torch.cuda.empty_cache()
    import numpy as np
    x = np.array([p[0] for p in pts], dtype=float) / 1e6
    for label, col in (("ours", 1), ("copy", 2)):
        y = np.array([p[col] for p in pts])
        slope, icpt = np.polyfit(x, y, 1)
        print(f"fit {label}: {icpt:.2f} us + {slope * 1e3:.3f} us/GB  (steady {1e3 / slope:.0f} GB/s)")


def load_cudart():
    cands = []
    for root in sys.path + [os.path.dirname(torch.__file__)]:
        cands += glob.glob(os.path.join(root, "nvidia", "*", "lib", "libcudart.so*"))
        cands += glob.glob(os.path.join(root, "nvidia", "cuda_runtime", "lib", "libcudart.so*"))
        cands += glob.glob(os.path.join(root, "torch", "lib", "libcudart*.so*"))
    cands += glob.glob("/usr/local/cuda/lib64/libcudart.so*")
    for c in cands:
        try:
            return ctypes.CDLL(c), c
        except OSError:
            continue
    return None, None


if "w3i" in only:
    print("\n== W3 in place: ours vs the same access pattern copied or touched by other kernels")
    w3i = bench.WORKLOADS["W3i"]
    rope3 = rope_for(w3i)
    sets3 = bench.make_inputs(w3i, bf16, dev, 8)
    ours = [t_us(bench.provider_rope_ops("cuda")(w3i, sets3, rope3)) for _ in range(3)]
    print(f"W3i rope_ops:cuda: {' '.join(f'{t:.2f}' for t in ours)} us")
    del sets3
    torch.cuda.empty_cache()
    rows = w3i.tokens * (w3i.q_heads + w3i.k_heads)  # 262144 head rows, 128 bytes rotate in each
    width = w3i.rotary_dim * 2
    lib, path = load_cudart()
    print(f"cudart: {path}")
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def touch(x_ptr, n_rows, scale, ROW_STRIDE: tl.constexpr, WIDTH: tl.constexpr, BLOCK_ROWS: tl.constexpr):
            r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            off = r.to(tl.int64)[:, None] * ROW_STRIDE + tl.arange(0, WIDTH)[None, :]
            m = (r < n_rows)[:, None]
            v = tl.load(x_ptr + off, mask=m)
            tl.store(x_ptr + off, (v.to(tl.float32) * scale).to(v.dtype), mask=m)
    except ImportError:
        touch = None
    print("pitch = bytes from one 128-byte row to the next (512 = W3 in place; 128 = dense).")
    print("touch: Triton in-place load+store of every row (best of BLOCK_ROWS x num_warps);")
    print("memcpy2D: cudaMemcpy2DAsync of the rows into a second buffer of the same pitch (eager, events).")
    for pitch in (128, 192, 256, 384, 512, 640, 768, 1024):
        n = 8
        bufs = [torch.empty(rows * pitch // 2, dtype=bf16, device=dev).normal_() for _ in range(n)]
        line = f"pitch {pitch:5d} B:"
        if touch is not None:
            best = None
            for br in (16, 32):
                for nw in (4, 8):
                    grid = (triton.cdiv(rows, br),)
                    calls = [lambda b=b: touch[grid](b, rows, 1.0, ROW_STRIDE=pitch // 2, WIDTH=width // 2,
                                                     BLOCK_ROWS=br, num_warps=nw) for b in bufs]
                    t = t_us(calls, repeats=3)
                    best = t if best is None else min(best, t)
            line += f" touch {best:7.2f} us"
        if lib is not None:
            dst = [torch.empty_like(b) for b in bufs[:4]]
            fn = lib.cudaMemcpy2DAsync
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                           ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            stream = torch.cuda.current_stream().cuda_stream
            calls = [lambda s=s, d=d: fn(d.data_ptr(), pitch, s.data_ptr(), pitch, width, rows, 3, stream)
                     for s, d in zip(bufs[:4], dst)]
            for c in calls:
                assert c() == 0
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            samples = []
            for _ in range(5):
                start.record()
                for i in range(200):
                    calls[i % 4]()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3 / 200)
            line += f"  memcpy2D {statistics.median(samples):7.2f} us"
            del dst
        print(line, flush=True)
        del bufs
        torch.cuda.empty_cache()
