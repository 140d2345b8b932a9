"""The pure-PyTorch backend: runs on any device, every dtype including float64; the fallback.

Lean on purpose: one gather of the table rows per call (shared by q and k and all heads), the
rotation as a few broadcast tensor ops in float32 (float64 for float64 inputs), one rounding to
the input dtype at the end, no Python loop over heads or tokens.
"""

from __future__ import annotations

import torch

from rope_ops.backend import FLOAT_DTYPES, Backend, KernelArgs, bshd_view, cos_sin_rows, positions_bs


class TorchBackend(Backend):
    name = "torch"
    priority = 0
    device_types = frozenset({"*"})  # any device torch runs on
    dtypes = frozenset(FLOAT_DTYPES)

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
            self._rotate(bshd_view(x, args.layout), bshd_view(out, args.layout), cos, sin, args, compute_dtype)

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
