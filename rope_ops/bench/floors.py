"""Floor kernels (Triton, GPU): the least time a case's memory traffic can take, measured in the
same run and timed like the providers (CUDA graph, rotating input sets).

- ``copy_kernel``: a same-bytes copy in one launch; the floor of decode-sized calls, where a
  copy captured in a graph by torch may run on the copy engines.
- ``dependent_load_kernel``: for each token, load its position, then the cos/sin table row at
  it, then store the token's q and k data, which waits for the row (a select on it that is never
  taken): RoPE's chain of dependent loads, rotating nothing. The floor of few-token calls.
- ``inplace_kernel``: loads and stores back the rotary dims of q and k at their own strides,
  nothing else. The floor of in-place calls.

Each floor is the fastest of a few block sizes, so that it is a floor of the access pattern,
not of one configuration.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rope_ops.backend import bshd_view

from .timing import gpu_time_per_call


@triton.jit
def copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)


@triton.jit
def dependent_load_kernel(pos, cos, sin, src, dst, table_rows, heads, dim, rotary_half,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    p = tl.load(pos + token)
    row = tl.where((p >= 0) & (p < table_rows), p, 0)
    d = tl.arange(0, BLOCK_D)
    # the cos/sin element each data element would use (NeoX: d mod r/2), loaded per element
    index = d % rotary_half
    c = tl.load(cos + row * rotary_half + index, mask=d < 2 * rotary_half, other=0.0)
    s = tl.load(sin + row * rotary_half + index, mask=d < 2 * rotary_half, other=0.0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (h < heads)[:, None] & (d < dim)[None, :]
    offsets = token * heads * dim + h[:, None] * dim + d[None, :]
    x = tl.load(src + offsets, mask=mask)
    x = tl.where((c + s > 1e30)[None, :], 0.0, x).to(x.dtype)  # never taken: the store waits for the row
    tl.store(dst + offsets, x, mask=mask)


@triton.jit
def inplace_kernel(q, k, seq, q_heads, k_heads, q_sb, q_ss, q_sh, k_sb, k_ss, k_sh, q_chunks,
                   ROTARY: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    b = token // seq
    s = token % seq
    chunk = tl.program_id(1)
    # tl.cast: an argument equal to 1 arrives as a constant (MQA's one k head), the other as a
    # value; both branches must give the same types
    if chunk < q_chunks:
        base = q + b * q_sb + s * q_ss
        heads = tl.cast(q_heads, tl.int32)
        head_stride = tl.cast(q_sh, tl.int64)
        h0 = chunk * BLOCK_H
    else:
        base = k + b * k_sb + s * k_ss
        heads = tl.cast(k_heads, tl.int32)
        head_stride = tl.cast(k_sh, tl.int64)
        h0 = (chunk - q_chunks) * BLOCK_H
    h = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_R)
    mask = (h < heads)[:, None] & (d < ROTARY)[None, :]
    pointers = base + h[:, None].to(tl.int64) * head_stride + d[None, :]
    tl.store(pointers, tl.load(pointers, mask=mask), mask=mask)


# (heads per program, warps) tried by the per-token floors
HEAD_BLOCKS = ((1, 1), (2, 1), (4, 2), (8, 4), (16, 4), (32, 8))
COPY_BLOCKS = (512, 1024, 2048, 4096)


def launch_copy(src: torch.Tensor, dst: torch.Tensor, block: int) -> None:
    """dst <- src, both contiguous and of the same dtype, in one launch."""
    n = src.numel()
    copy_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, num_warps=4)


def launch_dependent_load(pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, src: torch.Tensor,
                          dst: torch.Tensor, rotary_dim: int, config) -> None:
    """dst <- src ([T, H, D] contiguous) one token at a time, each token's store waiting for the
    cos/sin row at its position (pos: int64 [T])."""
    block_h, warps = config
    tokens, heads, dim = src.shape
    grid = (tokens, triton.cdiv(heads, block_h))
    dependent_load_kernel[grid](pos, cos, sin, src, dst, cos.shape[0], heads, dim, rotary_dim // 2,
                                BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(dim), num_warps=warps)


def launch_inplace(q: torch.Tensor, k: torch.Tensor, layout: str, rotary_dim: int, config) -> None:
    """Load and store back dims [0, rotary_dim) of every head of q and k (any strides, stride 1
    on the last dim), in one launch."""
    block_h, warps = config
    q4, k4 = bshd_view(q, layout), bshd_view(k, layout)
    batch, seq, q_heads, k_heads = q4.shape[0], q4.shape[1], q4.shape[2], k4.shape[2]
    q_chunks = triton.cdiv(q_heads, block_h)
    grid = (batch * seq, q_chunks + triton.cdiv(k_heads, block_h))
    inplace_kernel[grid](q4, k4, seq, q_heads, k_heads, q4.stride(0), q4.stride(1), q4.stride(2),
                         k4.stride(0), k4.stride(1), k4.stride(2), q_chunks, ROTARY=rotary_dim,
                         BLOCK_H=block_h, BLOCK_R=triton.next_power_of_2(rotary_dim), num_warps=warps)


def _best(make_closures, configs) -> tuple[float, str]:
    best = None
    for config in configs:
        seconds = gpu_time_per_call(make_closures(config))
        if best is None or seconds < best[0]:
            best = (seconds, str(config))
    return best


def copy_kernel_time(n_bytes: int, device, n_sets: int) -> tuple[float, str]:
    """(seconds, block) of the best same-bytes copy kernel: reads and writes n_bytes."""
    words = max(1, n_bytes // 4)
    pairs = [(torch.randint(0, 1 << 30, (words,), dtype=torch.int32, device=device),
              torch.empty(words, dtype=torch.int32, device=device)) for _ in range(n_sets)]
    return _best(lambda block: [lambda s=s, d=d: launch_copy(s, d, block) for s, d in pairs], COPY_BLOCKS)


def dependent_load_time(case, sets, cos: torch.Tensor, sin: torch.Tensor) -> tuple[float, str]:
    """(seconds, (heads per program, warps)) of the best dependent-load kernel on the case's
    tokens: data of q's and k's heads side by side ([T, Hq + Hk, D], the same bytes), the
    positions of the case's input sets."""
    shape = (case.tokens, case.q_heads + case.k_heads, case.head_dim)
    data = [(torch.randn(shape, device=cos.device).to(case.torch_dtype),
             torch.empty(shape, device=cos.device, dtype=case.torch_dtype),
             s.positions.reshape(-1).contiguous()) for s in sets]
    return _best(lambda config: [lambda x=x, y=y, p=p: launch_dependent_load(p, cos, sin, x, y, case.rot, config)
                                 for x, y, p in data], HEAD_BLOCKS)


def inplace_floor_time(case, sets) -> tuple[float, str]:
    """(seconds, (heads per program, warps)) of the best kernel that only loads and stores back
    the rotary dims of the case's q and k, at their strides, in one launch."""
    return _best(lambda config: [lambda s=s: launch_inplace(s.q, s.k, case.layout, case.rot, config)
                                 for s in sets], HEAD_BLOCKS)
