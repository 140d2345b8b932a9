"""Host cost per call of each way into the op (W2 decode shapes), to justify the eager path.

    python tools/host_cost.py [--device cuda] [--backend cuda]

Rows: the backend's run() alone; rope_ops.apply eager (what users call: repeats of one call kind,
through the backend's guard where it has one); two call kinds in turn (each call misses the guard
and takes the metadata key; per call); two frequency sets (RotaryEmbeddings) in turn (each
keeps its guard; per call); the same call through
the dispatcher (torch.ops.rope_ops.rope, as torch.compile would); apply with autograd recording
(forward only); apply forward+backward (into leaf .grad, accumulating) and forward +
torch.autograd.grad (q, k as activations), next to torch's own floor for the latter: an
autograd.Function whose forward and backward only allocate. Where the backend's bound launcher
records autograd itself (``with_grad``: the CUDA backend's, in C++), forward + autograd.grad
through it too: what apply's plans of training calls cost when they use it. Wall time per call
over a plain loop, synchronised once.
"""

from __future__ import annotations

import argparse

import torch

import rope_ops
from rope_ops import registry
from rope_ops.bench import host_time_per_call
from rope_ops.backend import KernelArgs


def per_call(fn, device) -> float:
    """Microseconds per call: best of three plain loops (rope_ops.bench's host timer), divided
    by the calls one run of fn makes (``fn.calls``, see in_turn)."""
    n = 2000 if device.type == "cuda" else 50
    return host_time_per_call([fn], device, iterations=n) * 1e6 / getattr(fn, "calls", 1)


def in_turn(*calls):
    """One row that makes these calls one after another (timed per call)."""
    def run():
        for call in calls:
            call()
    run.calls = len(calls)
    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(256, 32, 128, device=device, dtype=dtype)
    k = torch.randn(256, 8, 128, device=device, dtype=dtype)
    pos = torch.randint(0, 32768, (256,), device=device)
    rope = rope_ops.RotaryEmbedding(128, base=500000.0, max_position=131072, device=device)
    # a second set of frequencies, as models that alternate local and global RoPE layers have
    rope_local = rope_ops.RotaryEmbedding(128, base=10000.0, max_position=131072, device=device)
    name = args.backend or rope_ops.select_backend(q, k, pos, rope=rope)
    backend = registry.get(name)
    why = backend.availability()
    if why:
        raise SystemExit(f"backend {name} unavailable: {'; '.join(why)}")
    cos, sin, turns, factor = rope.tables(device)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    kernel_args = KernelArgs(q, k, q_out, k_out, pos, 0, cos, sin, turns, factor, "thd", 128, False,
                             False, False)
    qg, kg = q.clone().requires_grad_(True), k.clone().requires_grad_(True)

    def fwd_bwd():
        a, b = rope_ops.apply(qg, kg, pos, rope=rope, backend=name)
        torch.autograd.backward((a, b), (q, k))

    def fwd_grad():  # q, k as activations: gradients to them, no accumulation into leaves
        a, b = rope_ops.apply(qg, kg, pos, rope=rope, backend=name)
        return torch.autograd.grad((a, b), (qg, kg), (q, k))

    class Identity(torch.autograd.Function):  # torch's own floor: one op forward and backward
        @staticmethod
        def forward(ctx, x, y):
            return torch.empty_like(x), torch.empty_like(y)

        @staticmethod
        def backward(ctx, gx, gy):
            return torch.empty_like(gx), torch.empty_like(gy)

    def identity_grad():
        a, b = Identity.apply(qg, kg)
        return torch.autograd.grad((a, b), (qg, kg), (q, k))

    rows = {
        "backend.run() alone (outputs preallocated)": lambda: backend.run(kernel_args),
        "rope_ops.apply eager": lambda: rope_ops.apply(q, k, pos, rope=rope, backend=name),
        "rope_ops.apply eager, two call kinds in turn": in_turn(
            lambda: rope_ops.apply(q, k, pos, rope=rope, backend=name),
            lambda: rope_ops.apply(q[:255], k[:255], pos[:255], rope=rope, backend=name)),
        "rope_ops.apply eager, two frequency sets in turn": in_turn(
            lambda: rope_ops.apply(q, k, pos, rope=rope, backend=name),
            lambda: rope_ops.apply(q, k, pos, rope=rope_local, backend=name)),
        "torch.ops.rope_ops.rope (dispatcher path)": lambda: torch.ops.rope_ops.rope(
            q, k, pos, 0, cos, sin, turns, factor, "thd", 128, False, False, "table", [], False,
            False, name),
        "rope_ops.apply recording autograd (forward)": lambda: rope_ops.apply(qg, kg, pos, rope=rope, backend=name),
        "rope_ops.apply forward + backward": fwd_bwd,
        "rope_ops.apply forward + autograd.grad": fwd_grad,
        "floor: empty autograd.Function + autograd.grad": identity_grad,
    }
    bound = backend.bind(cos, sin, turns, factor, "thd", 128, False, False)
    if hasattr(bound, "with_grad"):
        def bound_grad():
            a, b = bound.with_grad(qg, kg, pos, 0)
            return torch.autograd.grad((a, b), (qg, kg), (q, k))

        rows["bound launcher, autograd in the backend: forward + autograd.grad"] = bound_grad
    print(f"host cost per call, W2 shapes, backend {name}, device {device}, torch {torch.__version__}")
    for label, fn in rows.items():
        print(f"  {label:48s} {per_call(fn, device):8.1f} us")


if __name__ == "__main__":
    main()
