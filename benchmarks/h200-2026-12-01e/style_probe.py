"""One-off (H200): is W4's gap to a copy in how neox pairs are read?

Times the CUDA backend's forward on W4's forward shape (and W1, W5) with NeoX pairs (a thread
loads both halves of its pairs: two 16-byte vectors 128 bytes apart, so a warp's load covers four
half rows) and with GPT-J pairs (same bytes; a thread's pairs sit in one vector, so a warp's load
covers 512 contiguous bytes, as a copy's does), each against a same-bytes copy, bench-style."""
import torch

import rope_ops
from rope_ops import bench

dev = torch.device("cuda")
bf16 = torch.bfloat16
bw = bench.copy_bandwidth(dev)
print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
for label, B, hq, hk in (("W4 fwd", 2, 32, 32), ("W1", 4, 32, 8), ("W5", 8, 64, 8)):
    per_set = 2 * B * 4096 * (hq + hk) * 128 * 2
    nsets = max(2, min(16, -(-bench.l2_bytes(dev) * 3 // per_set)))
    sets = [(torch.randn(B, 4096, hq, 128, device=dev, dtype=bf16),
             torch.randn(B, 4096, hk, 128, device=dev, dtype=bf16)) for _ in range(nsets)]
    pos = torch.arange(4096, device=dev).expand(B, 4096).contiguous()
    line = f"{label:7s}"
    pairs = [(torch.empty(per_set // 2, dtype=torch.uint8, device=dev),
              torch.empty(per_set // 2, dtype=torch.uint8, device=dev)) for _ in range(nsets)]
    tc = min(bench.gpu_time_per_call([lambda a=a, b=b: b.copy_(a) for a, b in pairs]) for _ in range(2))
    line += f" copy {tc * 1e6:8.2f} us"
    for style in ("neox", "gptj", "neox", "gptj"):
        rope = rope_ops.RotaryEmbedding(128, base=500000.0, max_position=bench.TABLE_POSITIONS,
                                        style=style, device="cuda")
        calls = [lambda q=q, k=k: rope_ops.apply(q, k, pos, rope=rope, backend="cuda") for q, k in sets]
        t = min(bench.gpu_time_per_call(calls) for _ in range(2))
        line += f" | {style} {t * 1e6:8.2f} us ({t / tc:.3f} x copy)"
    print(line, flush=True)
    del sets, pairs
    torch.cuda.empty_cache()
