"""rope_ops under context and tensor parallelism: a runnable example.

    python examples/distributed_cp.py                      # 2 CPU ranks on gloo
    python examples/distributed_cp.py --world-size 4
    python examples/distributed_cp.py --backend nccl --device cuda   # one GPU per rank

Each rank:
1. Context parallelism on plain tensors: takes its load-balanced ("zigzag") shard of a batch
   of sequences and of a varlen pack, rotates it with rope_ops.apply and its tokens' global
   positions (rope_ops.distributed.cp_positions), runs a backward; the shards, gathered, are the
   single-process result.
2. Tensor and sequence parallelism on DTensors: q and k sharded by heads, then by sequence,
   rotated by rope_ops.distributed.apply with no communication (CommDebugMode counts none).
See docs/distributed.md.
"""

from __future__ import annotations

import argparse
import datetime
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def gather_tokens(local: torch.Tensor, indices: torch.Tensor, total: int, dim: int) -> torch.Tensor:
    """Every rank's shard put back at its global token indices (a collective, for the check)."""
    world = dist.get_world_size()
    sizes = [None] * world
    dist.all_gather_object(sizes, (local.shape[dim], indices.tolist()))
    device = local.device
    if dist.get_backend() == "gloo":  # gloo gathers host memory
        local = local.cpu()
    shape = list(local.shape)
    pieces = []
    for size, _ in sizes:
        shape[dim] = size
        pieces.append(torch.empty(shape, dtype=local.dtype, device=local.device))
    dist.all_gather(pieces, local.contiguous())
    shape[dim] = total
    whole = torch.empty(shape, dtype=local.dtype, device=local.device)
    for piece, (_, where) in zip(pieces, sizes):
        whole.index_copy_(dim, torch.tensor(where, device=local.device), piece)
    return whole.to(device)


def runs(positions: torch.Tensor) -> str:
    """Positions as runs of consecutive values: '0..7, 24..31'."""
    values, out, start = positions.tolist(), [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            out.append(f"{values[start]}..{values[i - 1]}")
            start = i
    return ", ".join(out)


def context_parallel(rank: int, world: int, device: torch.device) -> None:
    import rope_ops
    from rope_ops.distributed import cp_positions, cp_shard, cp_token_indices

    g = torch.Generator().manual_seed(0)  # the same full batch on every rank
    batch, seq, heads, kv_heads, head_dim = 2, 16 * world, 8, 2, 64
    q = torch.randn(batch, seq, heads, head_dim, generator=g).to(device)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=g).to(device)

    # This rank's tokens: chunks r and 2N-1-r of 2N, as torch's context_parallel and
    # TransformerEngine split them; their positions are their places in the whole sequence.
    cp = dict(cp_size=world, cp_rank=rank, split="zigzag")
    q_local = cp_shard(q, 1, **cp).requires_grad_()
    k_local = cp_shard(k, 1, **cp).requires_grad_()
    pos_local = cp_positions(seq, device=device, **cp)
    q_rot, k_rot = rope_ops.apply(q_local, k_local, pos_local, base=500000.0)
    (q_rot.square().sum() + k_rot.square().sum()).backward()  # a rotation keeps norms

    whole_q, _ = rope_ops.apply(q, k, 0, base=500000.0)  # the single-process result
    gathered = gather_tokens(q_rot.detach(), cp_token_indices(seq, **cp), seq, dim=1)
    same = torch.equal(gathered, whole_q)

    # A varlen pack [T, H, D]: every document cut into 2N chunks (TransformerEngine's thd).
    cu_seqlens = [0, 6 * world, 8 * world, 16 * world]
    tokens = cu_seqlens[-1]
    packed = torch.randn(tokens, heads, head_dim, generator=g).to(device)
    cp = dict(cp_size=world, cp_rank=rank, split="zigzag", cu_seqlens=cu_seqlens)
    packed_rot, _ = rope_ops.apply(cp_shard(packed, 0, **cp), None, cp_positions(device=device, **cp))
    whole_packed, _ = rope_ops.apply(packed, None,
                                     rope_ops.positions_from_seqlens(cu_seqlens=cu_seqlens, device=device))
    same_packed = torch.equal(gather_tokens(packed_rot, cp_token_indices(**cp), tokens, dim=0), whole_packed)
    print(f"context parallel, rank {rank} of {world}: positions {runs(pos_local)} of 0..{seq - 1}; "
          f"varlen positions {runs(cp_positions(device=device, **cp))}")
    if rank == 0:
        print(f"context parallel: gathered shards == one process: {same} (bshd), {same_packed} (varlen)")
    assert same and same_packed


def tensor_and_sequence_parallel(rank: int, world: int, device: torch.device) -> None:
    import rope_ops
    import rope_ops.distributed as rd
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = DeviceMesh(device.type, torch.arange(world))
    g = torch.Generator().manual_seed(1)
    batch, seq, heads, head_dim = 2, 8 * world + 3, 4 * world, 64
    q = torch.randn(batch, seq, heads, head_dim, generator=g).to(device)
    k = torch.randn(batch, seq, heads, head_dim, generator=g).to(device)
    pos = torch.randint(0, 100_000, (batch, seq), generator=g).to(device)
    whole_q, _ = rope_ops.apply(q, k, pos)

    def placed(t, placements):  # this rank's part of a tensor every rank holds: no communication
        return DTensor.from_local(t, mesh, [Replicate()], run_check=False).redistribute(mesh, placements)

    for name, placement in (("heads (tensor parallel)", Shard(2)),
                            ("sequence (sequence parallel)", Shard(1))):
        dq = placed(q, [placement]).requires_grad_()
        dk = placed(k, [placement]).requires_grad_()
        with CommDebugMode() as comm:
            # pos: the whole [B, S] on every rank; each rank uses the positions of its tokens.
            q_rot, k_rot = rd.apply(dq, dk, pos)
            (q_rot.to_local().sum() + k_rot.to_local().sum()).backward()
        expected = placed(whole_q, [placement]).to_local()
        if rank == 0:
            print(f"DTensor sharded by {name}: q_out {q_rot.placements}, "
                  f"local == one process: {torch.equal(q_rot.to_local(), expected)}, "
                  f"collectives: {comm.get_total_counts()}")
        assert torch.equal(q_rot.to_local(), expected) and comm.get_total_counts() == 0


def worker(rank: int, world: int, port: int, backend: str, device_type: str) -> None:
    if device_type == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device(device_type, rank % getattr(torch, device_type).device_count())
        getattr(torch, device_type).set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        context_parallel(rank, world, device)
        tensor_and_sequence_parallel(rank, world, device)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--backend", default="gloo", help="torch.distributed backend: gloo or nccl")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (rank r on GPU r %% count)")
    args = parser.parse_args()
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.world_size, port, args.backend, args.device), nprocs=args.world_size)


if __name__ == "__main__":
    main()
