"""An example third-party rope_ops backend: each pair (x, y) is the complex number x + iy,
rotated by multiplying with c + is. A different formulation from the torch backend's, checked by
the same conformance suite.

It declares what it supports (CPU only, never picked automatically) and implements ``run``;
rope_ops does validation, selection, autograd and torch.compile registration around it.
"""

import torch

from rope_ops.backend import FLOAT_DTYPES, Backend, KernelArgs, bshd_view, cos_sin_rows, positions_bs


class ComplexBackend(Backend):
    name = "complex"
    priority = -10
    device_types = frozenset({"cpu"})
    auto_device_types = frozenset()  # only when asked for by name
    dtypes = frozenset(FLOAT_DTYPES)

    def run(self, args: KernelArgs) -> None:
        q = bshd_view(args.q, args.layout)
        positions = positions_bs(args, q.shape[0], q.shape[1])
        cos, sin = cos_sin_rows(args, positions)  # rows from the table, or computed / NaN past it
        rotation = torch.complex(cos.double(), -sin.double() if args.inverse else sin.double()).unsqueeze(2)
        r = args.rotary_dim
        if args.interleaved:
            first, second = slice(0, r, 2), slice(1, r, 2)
        else:
            first, second = slice(0, r // 2), slice(r // 2, r)
        for x, out in ((args.q, args.q_out), (args.k, args.k_out)):
            if x is None:
                continue
            x4, out4 = bshd_view(x, args.layout), bshd_view(out, args.layout)
            z = torch.complex(x4[..., first].double(), x4[..., second].double()) * rotation
            # float64 products of float32 tables: round once to float32 (SPEC: float32 math for
            # float32/16/bf16 inputs), then to the output dtype (exact for float32 outputs).
            real, imag = (z.real, z.imag) if x.dtype == torch.float64 else (z.real.float(), z.imag.float())
            out4[..., first].copy_(real)
            out4[..., second].copy_(imag)
            if not args.inplace and r < x4.shape[-1]:
                out4[..., r:].copy_(x4[..., r:])
