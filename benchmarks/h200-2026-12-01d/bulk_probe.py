"""One-off (H200): the bulk (TMA token rows) variant against the class defaults, bench-style
(rope_ops.apply / apply_grad, the bench's inputs), per workload and bulk config
{stages, blocks per SM, consumer threads}; outputs compared bitwise with the default's."""
import sys
import torch
import rope_ops
from rope_ops import bench
from rope_ops_backends import cuda_backend as cb

dev, bf16 = torch.device("cuda"), torch.bfloat16
assert not cb.CudaBackend().availability()
bw = bench.copy_bandwidth(dev)
print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
BULK = 6
configs = [(4, 3, 128), (3, 4, 128), (2, 6, 128), (4, 3, 224), (6, 2, 224), (8, 1, 224),
           (2, 4, 128), (3, 3, 96), (2, 8, 96), (4, 4, 64)]
keys = sys.argv[1:] or ["W4", "W1", "W5", "W3", "W3i", "W2"]


def force(v, a, b, blk):
    cb.set_config(v, a, b)
    cb.set_launch(blk, -1, -1)


for key in keys:
    w = bench.WORKLOADS[key]
    rope = rope_ops.RotaryEmbedding(w.head_dim, rotary_dim=w.rotary_dim, base=w.base,
                                    max_position=bench.TABLE_POSITIONS, style=w.style, device=dev)
    per_set = w.bytes_moved(bf16) // (2 if w.backward else 1)
    sets = bench.make_inputs(w, bf16, dev, max(4, min(64, -(-bench.l2_bytes(dev) * 3 // per_set))))
    moved = w.bytes_moved(bf16)
    closures = bench.provider_rope_ops("cuda")(w, sets, rope)

    def fresh_out():
        s = sets[0]
        fresh = bench.InputSet(*(None if t is None else t.clone() for t in (s.q, s.k, s.pos, s.grad_q, s.grad_k)))
        return bench.provider_rope_ops("cuda")(w, [fresh], rope)[0](), fresh

    ref_out, _ = fresh_out()
    ref_out = [t.clone() for t in ref_out]
    base_t = []
    results = []
    for cfg in [None] + configs + [None]:
        try:
            if cfg is None:
                force(-1, -1, -1, -1)
            else:
                force(BULK, *cfg)
            out, fresh = fresh_out()
            used = cb.last_variant() if hasattr(cb, "last_variant") else "?"
            same = all(torch.equal(a, b) for a, b in zip(out, ref_out))
            check = bench.refcheck(w, sets[0], out, rope) if cfg is not None else "-"
            t = bench.gpu_time_per_call(closures) * 1e6
        finally:
            force(-1, -1, -1, -1)
        if cfg is None:
            base_t.append(t)
        label = "default" if cfg is None else f"bulk {cfg}"
        print(f"{key:4s} {label:22s} ran variant {used}: {t:8.2f} us = {100 * moved / (t * 1e-6) / bw:5.1f} % "
              f"of copy; bitwise equal to default: {same}; check {check}", flush=True)
    del sets, closures
    torch.cuda.empty_cache()
