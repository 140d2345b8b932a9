"""One-off: bench-style GPU time of W1/W4/W5 (and W3) with table rows vs rows computed on the fly
(set_launch(-1, 1, -1)), alternating, same input sets; accuracy of both against the reference."""
import torch, rope_ops
from rope_ops import bench
from rope_ops_backends import cuda_backend as cb

dev = torch.device("cuda")
assert not cb.CudaBackend().availability()  # builds/loads the extension (set_launch needs it)
bw = bench.copy_bandwidth(dev)
print(f"copy bandwidth {bw/1e9:.0f} GB/s")
for key in ("W1", "W4", "W5", "W3", "W3i", "W2"):
    w = bench.WORKLOADS[key]
    rope = rope_ops.RotaryEmbedding(w.head_dim, rotary_dim=w.rotary_dim, base=w.base,
                                    max_position=bench.TABLE_POSITIONS, style=w.style, device=dev)
    per_set = w.bytes_moved(torch.bfloat16) // (2 if w.backward else 1)
    sets = bench.make_inputs(w, torch.bfloat16, dev, max(4, min(64, -(-bench.l2_bytes(dev) * 3 // per_set))))
    closures = bench.provider_rope_ops("cuda")(w, sets, rope)
    res = {0: [], 1: []}
    checks = {}
    for rep in range(3):
        for fly in (0, 1):
            cb.set_launch(-1, fly, -1)
            try:
                if rep == 0:
                    fresh = bench.InputSet(*(None if t is None else t.clone() for t in (sets[0].q, sets[0].k, sets[0].pos, sets[0].grad_q, sets[0].grad_k)))
                    out = bench.provider_rope_ops("cuda")(w, [fresh], rope)[0]()
                    checks[fly] = bench.refcheck(w, sets[0], out, rope)
                res[fly].append(bench.gpu_time_per_call(closures) * 1e6)
            finally:
                cb.set_launch(-1, -1, -1)
    moved = w.bytes_moved(torch.bfloat16)
    for fly in (0, 1):
        t = min(res[fly])
        print(f"{key:4s} rows_on_the_fly={fly}: {' '.join(f'{x:.2f}' for x in res[fly])} us; best {t:.2f} us "
              f"= {100 * moved / (t * 1e-6) / bw:.1f} % of copy; check {checks[fly]}", flush=True)
    del sets, closures
    torch.cuda.empty_cache()
