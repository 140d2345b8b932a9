"""The pure-PyTorch backend: runs on any device, every dtype including float64; the fallback.

Per call: the cos/sin rows of the call's positions, gathered once and shared by q, k and every
head (rows outside the table computed on the fly, only when some position may lie outside it);
then per tensor a few whole-row tensor ops in float32 (float64 for float64 inputs) and one
rounding to the input dtype at the end:

- neox: the rotary dims viewed as [2, r/2] (the pair's halves); widen once into a contiguous
  buffer, multiply by cos broadcast over both halves, add the other half times -sin / +sin
  (two ``addcmul_``), narrow once into the output. float32 out of place skips both copies.
- gptj: pairs are adjacent, so on the CPU and CUDA one complex multiplication rotates them
  (float32 and float64 pairs viewed as complex numbers); other devices take the neox way on a
  [r/2, 2] view.

On the CPU the tokens are rotated in slices whose float32 buffers stay in cache and are reused
from slice to slice (large fresh allocations page-fault there). Never a host sync on an
accelerator: whether all positions lie in the table is decided from host-known values only
(an int offset), or by reading the positions where they are on the CPU.
"""

from __future__ import annotations

import torch

from rope_ops.backend import (FLOAT_DTYPES, Backend, KernelArgs, bshd_view, cos_sin_rows, positions_bs,
                              prologue_backward_torch, prologue_forward_torch)

# Rotary elements (batch x tokens x heads x rotary_dim) per slice on the CPU: the two float32
# buffers of a slice (512 KiB each) stay in a core's L2 cache.
_CPU_CHUNK_ELEMENTS = 1 << 17
# Devices whose complex multiplication the gptj path may use.
_COMPLEX_DEVICES = ("cpu", "cuda")


class TorchBackend(Backend):
    name = "torch"
    priority = 0
    device_types = frozenset({"*"})  # any device torch runs on
    dtypes = frozenset(FLOAT_DTYPES)
    angle_kinds = frozenset({"table", "token", "mrope"})
    table_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16})
    supports_prologue = True
    prologue_cache_dtypes = frozenset(d for d in (getattr(torch, "float8_e4m3fn", None),) if d)

    def run_prologue(self, args) -> None:
        prologue_forward_torch(args)

    def run_prologue_backward(self, args, grad_q, grad_k, grad_v):
        return prologue_backward_torch(args, grad_q, grad_k, grad_v)

    def describe(self) -> dict:
        return {**super().describe(), "devices": ["any"]}

    def run(self, args: KernelArgs) -> None:
        q = bshd_view(args.q, args.layout)
        batch, seq = q.shape[0], q.shape[1]
        compute_dtype = torch.float64 if args.q.dtype == torch.float64 else torch.float32
        cos, sin = _cos_sin(args, batch, seq)  # [1 or B, S, r/2] float32
        if compute_dtype != torch.float32:
            cos, sin = cos.to(compute_dtype), sin.to(compute_dtype)
        if args.inverse:
            sin = -sin
        half = args.rotary_dim // 2
        device_type = args.q.device.type
        if args.interleaved and device_type in _COMPLEX_DEVICES:
            rotation = torch.complex(cos, sin).unsqueeze(2)  # c + i*s, broadcast over heads
            rotate = _rotate_complex
        else:
            rotation = (cos.unsqueeze(2), sin.unsqueeze(2))
            rotate = _rotate_real
        for x, out in ((args.q, args.q_out), (args.k, args.k_out)):
            if x is None:
                continue
            x, out = bshd_view(x, args.layout), bshd_view(out, args.layout)
            step = seq
            if device_type == "cpu":
                per_token = max(1, batch * x.shape[2] * args.rotary_dim)
                step = max(1, min(seq, _CPU_CHUNK_ELEMENTS // per_token))
            buffers = _Buffers(x, step, args.rotary_dim, compute_dtype)
            for s0 in range(0, seq, step):
                s1 = min(seq, s0 + step)
                part = (rotation[:, s0:s1] if isinstance(rotation, torch.Tensor)
                        else (rotation[0][:, s0:s1], rotation[1][:, s0:s1]))
                rotate(x[:, s0:s1, :, :2 * half], out[:, s0:s1, :, :2 * half], part, buffers,
                       args.interleaved, args.inplace)
            if not args.inplace and args.rotary_dim < x.shape[-1]:
                out[..., args.rotary_dim:].copy_(x[..., args.rotary_dim:])


class _Buffers:
    """The float32 (float64) buffers of one tensor's slices, allocated on first use and reused."""

    def __init__(self, x: torch.Tensor, step: int, rotary_dim: int, dtype: torch.dtype):
        self.shape = (x.shape[0], step, x.shape[2], rotary_dim)
        self.dtype, self.device = dtype, x.device
        self._widened = self._product = None

    def widened(self, n: int) -> torch.Tensor:
        if self._widened is None:
            self._widened = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self._widened[:, :n]

    def product(self, n: int) -> torch.Tensor:
        if self._product is None:
            self._product = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self._product[:, :n]


def _pairs(t: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The rotary dims [..., r] as [..., 2, r/2] (neox: the halves) or [..., r/2, 2] (gptj)."""
    half = t.shape[-1] // 2
    return t.unflatten(-1, (half, 2) if interleaved else (2, half))


def _rotate_real(x, out, rotation, buffers: _Buffers, interleaved: bool, inplace: bool) -> None:
    """out = (a*c - b*s, b*c + a*s) for the pairs (a, b) of x's rotary dims [B, n, H, r]."""
    cos, sin = rotation  # [1 or B, n, 1, r/2]
    axis = -1 if interleaved else -2  # the axis that tells a pair's two elements apart
    n = x.shape[1]
    cos_pairs = cos.unsqueeze(axis)  # broadcast over both elements of a pair
    direct = x.dtype == buffers.dtype and not inplace
    if direct:
        src, dst = _pairs(x, interleaved), _pairs(out, interleaved)  # products straight into out
    else:
        if x.dtype == buffers.dtype:
            src = _pairs(x, interleaved)  # in place: read x, write a buffer, copy back
        else:
            src = _pairs(buffers.widened(n), interleaved)
            src.copy_(_pairs(x, interleaved))  # the one widening
        dst = _pairs(buffers.product(n), interleaved)
    torch.mul(src, cos_pairs, out=dst)
    dst.select(axis, 0).addcmul_(src.select(axis, 1), sin, value=-1)
    dst.select(axis, 1).addcmul_(src.select(axis, 0), sin)
    if not direct:
        _pairs(out, interleaved).copy_(dst)  # the one narrowing


def _complex_view(t: torch.Tensor) -> torch.Tensor | None:
    """t's adjacent pairs [..., r] as complex numbers [..., r/2] without a copy, or None."""
    if t.dtype not in (torch.float32, torch.float64) or t.stride(-1) != 1 or t.storage_offset() % 2:
        return None
    if any(stride % 2 for stride in t.stride()[:-1]):
        return None
    return torch.view_as_complex(_pairs(t, True))


def _rotate_complex(x, out, rotation, buffers: _Buffers, interleaved: bool, inplace: bool) -> None:
    """gptj: each adjacent pair (a, b) as a + ib, times c + is."""
    n = x.shape[1]
    if x.dtype == buffers.dtype:
        src = _complex_view(x)
        dst = src if inplace else _complex_view(out)
        if src is not None and dst is not None:
            torch.mul(src, rotation, out=dst)
            return
    widened = buffers.widened(n)
    widened.copy_(x)
    product = torch.view_as_complex(_pairs(widened, True))
    product.mul_(rotation)
    out.copy_(widened)


def _cos_sin(args: KernelArgs, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (cos, sin) rows [1 or B, S, r/2] of the call's tokens, honouring the spec for any
    position and every angle source (``cos_sin_rows``); for table rows, the on-the-fly branch
    runs only when some position may lie outside the table."""
    if args.angles == "table":
        rows = _table_rows(args, seq)
        if rows is not None:
            return rows
    return cos_sin_rows(args, positions_bs(args, batch, seq))


def _table_rows(args: KernelArgs, seq: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The table rows of the call's positions when every position is known, without a device
    sync, to lie in the table: an int offset, or positions on the CPU; else None."""
    n_rows = args.cos.shape[0]
    if args.pos is None:
        start = args.pos_offset
        if not (0 <= start and start + seq <= n_rows):
            return None
        rows = args.cos[start:start + seq].unsqueeze(0), args.sin[start:start + seq].unsqueeze(0)
    else:
        positions = args.pos if args.pos.dim() == 2 else args.pos.unsqueeze(0)
        if positions.device.type != "cpu" or n_rows == 0 or positions.numel() == 0:
            return None
        low, high = torch.aminmax(positions)  # on the CPU a plain read, no device sync
        if int(low) < 0 or int(high) >= n_rows:
            return None
        flat = positions.reshape(-1)
        half = args.cos.shape[1]
        rows = (args.cos.index_select(0, flat).view(*positions.shape, half),
                args.sin.index_select(0, flat).view(*positions.shape, half))
    return rows[0].to(torch.float32), rows[1].to(torch.float32)
