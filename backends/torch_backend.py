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

# Rotary elements (batch x tokens x heads x rotary_dim) per slice on the CPU and per thread: the
# two float32 buffers of a thread's share of a slice (512 KiB each) stay in its core's L2 cache.
# Per thread, because every op of a slice is one parallel region: a slice of a fixed size split
# over 16 threads made regions so small that their start-up dominated (16 threads 6x slower
# than 1 on a 2048-token bf16 prefill).
_CPU_CHUNK_ELEMENTS_PER_THREAD = 1 << 17
# Devices whose complex multiplication the gptj path may use.
_COMPLEX_DEVICES = ("cpu", "cuda")


class TorchBackend(Backend):
    name = "torch"
    priority = 0
    device_types = frozenset({"*"})  # any device torch runs on
    dtypes = frozenset(FLOAT_DTYPES)
    angle_kinds = frozenset({"table", "token", "mrope"})
    table_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})
    supports_prologue = True
    prologue_cache_dtypes = frozenset(d for d in (getattr(torch, "float8_e4m3fn", None),) if d)
    prologue_q_dtypes = prologue_cache_dtypes

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
        cos, sin = _cos_sin(args, batch, seq, compute_dtype)  # [1 or B, S, r/2]
        if args.inverse:
            sin = -sin
        device_type = args.q.device.type
        if args.interleaved and device_type in _COMPLEX_DEVICES:
            rotation = torch.complex(cos, sin).unsqueeze(2)  # c + i*s, broadcast over heads
            rotate = _rotate_complex
        else:
            rotation = (cos.unsqueeze(2), sin.unsqueeze(2))
            rotate = _rotate_real
        r = args.rotary_dim
        for x, out in ((args.q, args.q_out), (args.k, args.k_out)):
            if x is None:
                continue
            x, out = bshd_view(x, args.layout), bshd_view(out, args.layout)
            step = seq
            if device_type == "cpu":
                per_token = max(1, batch * x.shape[2] * r)
                chunk = _CPU_CHUNK_ELEMENTS_PER_THREAD * torch.get_num_threads()
                step = max(1, min(seq, chunk // per_token))
            rotate(x[..., :r], out[..., :r], rotation, step, compute_dtype, args.interleaved,
                   args.inplace)
            if not args.inplace and r < x.shape[-1]:
                out[..., r:].copy_(x[..., r:])


def _pairs(t: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The rotary dims [..., r] as [..., 2, r/2] (neox: the halves) or [..., r/2, 2] (gptj)."""
    half = t.shape[-1] // 2
    return t.unflatten(-1, (half, 2) if interleaved else (2, half))


def _slices(seq: int, step: int):
    """(start, stop, full) of each slice of ``step`` tokens; full: a whole step long."""
    for s0 in range(0, seq, step):
        s1 = min(seq, s0 + step)
        yield s0, s1, s1 - s0 == step


def _rotate_real(x, out, rotation, step: int, dtype, interleaved: bool, inplace: bool) -> None:
    """out = (a*c - b*s, b*c + a*s) for the pairs (a, b) of x's rotary dims [B, S, H, r], a slice
    of ``step`` tokens at a time. Views of whole tensors and buffers are made once, outside the
    loop (each view costs about as much host time as a small op)."""
    cos, sin = rotation  # [1 or B, S, 1, r/2]
    axis = -1 if interleaved else -2  # the axis that tells a pair's two elements apart
    cos_pairs = cos.unsqueeze(axis)  # broadcast over both elements of a pair
    x_pairs, out_pairs = _pairs(x, interleaved), _pairs(out, interleaved)
    # float32/float64 out of place: the products go straight into the output; otherwise through
    # buffers every slice reuses (low precision: widened once into one of them)
    direct = x.dtype == dtype and not inplace
    buffers = None if direct else _Buffers((x.shape[0], step, *x.shape[2:]), dtype, x.device,
                                           widen=x.dtype != dtype, interleaved=interleaved)
    for s0, s1, full in _slices(x.shape[1], step):
        src = x_pairs[:, s0:s1]
        if direct:
            dst = out_pairs[:, s0:s1]
            src0, src1, dst0, dst1 = *_halves(src, axis), *_halves(dst, axis)
        else:
            views = buffers.full if full else buffers.first(s1 - s0)
            if views.widened is not None:
                views.widened.copy_(src)  # the one widening
                src, (src0, src1) = views.widened, views.widened_halves
            else:
                src0, src1 = _halves(src, axis)
            dst, (dst0, dst1) = views.product, views.product_halves
        sin_part = sin[:, s0:s1]
        torch.mul(src, cos_pairs[:, s0:s1], out=dst)
        dst0.addcmul_(src1, sin_part, value=-1)
        dst1.addcmul_(src0, sin_part)
        if not direct:
            out_pairs[:, s0:s1].copy_(dst)  # the one narrowing


def _halves(t, axis: int):
    """The first and second elements of every pair of a pair view."""
    return t.select(axis, 0), t.select(axis, 1)


class _Buffers:
    """The product buffer (and, for low precision, the widened input) of one tensor's slices, as
    pair views with their halves: for whole slices (``full``) and for a shorter last one."""

    def __init__(self, shape, dtype, device, widen: bool, interleaved: bool):
        self.axis = -1 if interleaved else -2
        self.widened = _pairs(torch.empty(shape, dtype=dtype, device=device), interleaved) if widen else None
        self.product = _pairs(torch.empty(shape, dtype=dtype, device=device), interleaved)
        self.full = _Views(self.widened, self.product, self.axis)

    def first(self, n: int) -> _Views:
        widened = None if self.widened is None else self.widened[:, :n]
        return _Views(widened, self.product[:, :n], self.axis)


class _Views:
    def __init__(self, widened, product, axis: int):
        self.widened, self.product = widened, product
        self.widened_halves = None if widened is None else _halves(widened, axis)
        self.product_halves = _halves(product, axis)


def _complex_view(t: torch.Tensor) -> torch.Tensor | None:
    """t's adjacent pairs [..., r] as complex numbers [..., r/2] without a copy, or None."""
    if t.dtype not in (torch.float32, torch.float64) or t.stride(-1) != 1 or t.storage_offset() % 2:
        return None
    if any(stride % 2 for stride in t.stride()[:-1]):
        return None
    return torch.view_as_complex(_pairs(t, True))


def _rotate_complex(x, out, rotation, step: int, dtype, interleaved: bool, inplace: bool) -> None:
    """gptj: each adjacent pair (a, b) as a + ib, times c + is: one multiplication of the whole
    tensor where its pairs can be viewed as complex numbers, else widened a slice at a time."""
    if x.dtype == dtype:
        src = _complex_view(x)
        dst = src if inplace else _complex_view(out)
        if src is not None and dst is not None:
            torch.mul(src, rotation, out=dst)
            return
    widened = torch.empty((x.shape[0], step, *x.shape[2:]), dtype=dtype, device=x.device)
    product = torch.view_as_complex(_pairs(widened, True))
    for s0, s1, full in _slices(x.shape[1], step):
        n = s1 - s0
        buf, buf_c = (widened, product) if full else (widened[:, :n], product[:, :n])
        buf.copy_(x[:, s0:s1])
        buf_c.mul_(rotation[:, s0:s1])
        out[:, s0:s1].copy_(buf)


def _cos_sin(args: KernelArgs, batch: int, seq: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) rows [1 or B, S, r/2] of the call's tokens in ``dtype``, honouring the spec for
    any position and every angle source (``cos_sin_rows``); for table rows, the on-the-fly branch
    runs only when some position may lie outside the table, and rows of a float64 table keep
    their precision for float64 calls."""
    if args.angles == "table":
        rows = _table_rows(args, seq)
        if rows is not None:
            return rows[0].to(dtype), rows[1].to(dtype)
    cos, sin = cos_sin_rows(args, positions_bs(args, batch, seq))
    return cos.to(dtype), sin.to(dtype)


def _table_rows(args: KernelArgs, seq: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The table rows (in the table's dtype) of the call's positions when every position is
    known, without a device sync, to lie in the table: an int offset, or positions on the CPU;
    else None."""
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
    return rows
