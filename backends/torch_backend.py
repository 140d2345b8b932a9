"""The pure-PyTorch backend: runs on any device, every dtype including float64; the fallback.

Lean on purpose: one gather of the table rows per call (shared by q and k and all heads), the
rotation as a few broadcast tensor ops in float32 (float64 for float64 inputs), one rounding to
the input dtype at the end, no Python loop over heads (on the CPU, a loop over slices of tokens
keeps the temporaries small).
"""

from __future__ import annotations

import torch

from rope_ops.backend import FLOAT_DTYPES, Backend, KernelArgs, bshd_view, cos_sin_rows, positions_bs

_CPU_CHUNK_ELEMENTS = 1 << 19  # rotary elements per slice on the CPU (float32 temporaries ~1 MB)


class TorchBackend(Backend):
    name = "torch"
    priority = 0
    device_types = frozenset({"*"})  # any device torch runs on
    dtypes = frozenset(FLOAT_DTYPES)
    angle_kinds = frozenset({"table", "token", "mrope"})
    table_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})

    def describe(self) -> dict:
        return {**super().describe(), "devices": ["any"]}

    def run(self, args: KernelArgs) -> None:
        q = bshd_view(args.q, args.layout)
        batch, seq = q.shape[0], q.shape[1]
        positions = positions_bs(args, batch, seq)
        cos, sin = cos_sin_rows(args, positions)  # [B, S, r/2] float32
        compute_dtype = torch.float64 if args.q.dtype == torch.float64 else torch.float32
        cos = cos.to(compute_dtype).unsqueeze(2)  # broadcast over heads
        sin = sin.to(compute_dtype).unsqueeze(2)
        if args.inverse:
            sin = -sin
        for x, out in ((args.q, args.q_out), (args.k, args.k_out)):
            if x is None:
                continue
            x, out = bshd_view(x, args.layout), bshd_view(out, args.layout)
            step = seq
            if x.device.type == "cpu":
                # On the CPU, temporaries of many MB are fresh pages each time (page faults cost
                # more than the arithmetic): rotate in slices of tokens whose temporaries stay
                # small enough to be reused from the allocator and to sit in cache.
                per_token = max(1, batch * x.shape[2] * args.rotary_dim)
                step = max(1, _CPU_CHUNK_ELEMENTS // per_token)
            for s0 in range(0, seq, step):
                s1 = min(seq, s0 + step)
                self._rotate(x[:, s0:s1], out[:, s0:s1], cos[:, s0:s1], sin[:, s0:s1], args,
                             compute_dtype)

    @staticmethod
    def _rotate(x, out, cos, sin, args: KernelArgs, compute_dtype) -> None:
        r = args.rotary_dim
        if args.interleaved:
            first, second = slice(0, r, 2), slice(1, r, 2)
        else:
            first, second = slice(0, r // 2), slice(r // 2, r)
        a = x[..., first].to(compute_dtype)
        b = x[..., second].to(compute_dtype)
        new_a = torch.addcmul(a * cos, b, sin, value=-1)  # a*cos - b*sin, one temporary fewer
        new_b = torch.addcmul(b * cos, a, sin)
        # Both halves are computed before either is written: safe in place.
        out[..., first].copy_(new_a)
        out[..., second].copy_(new_b)
        if not args.inplace and r < x.shape[-1]:
            out[..., r:].copy_(x[..., r:])
