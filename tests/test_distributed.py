"""rope_ops.distributed: context-parallel shards and positions (in process), and DTensor rotation,
sharding rules and CP checked by real process groups (2 and 4 ranks spawned on gloo; see
tests/_distributed_checks.py for what each rank checks).

The spawned groups run on ``--rope-device`` (default cpu) with ``--rope-backend`` (default: torch,
and the C++ cpu backend when it is available); ``ROPE_OPS_DIST_BACKEND=nccl`` for one GPU per rank.
The same groups run without pytest: ``python tests/_distributed_checks.py --help``.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import rope_ops
import rope_ops.distributed as rd
from rope_ops import RopeError

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")


# ---------------------------------------------------------------------------------------------
# Context-parallel shards and positions.


def _all_indices(cp_size, split, seq_len=None, cu_seqlens=None):
    return [rd.cp_token_indices(seq_len, cp_size=cp_size, cp_rank=r, split=split, cu_seqlens=cu_seqlens)
            for r in range(cp_size)]


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("split", rd.SPLITS)
def test_every_token_on_exactly_one_rank(cp_size, split):
    for seq_len in ([0, 8 * cp_size, 12 * cp_size] if split == "zigzag" else [0, 1, 5, 8 * cp_size + 3]):
        pieces = _all_indices(cp_size, split, seq_len=seq_len)
        assert torch.equal(torch.cat(pieces).sort().values, torch.arange(seq_len)), (split, seq_len)
    docs = [0, 2 * cp_size, 2 * cp_size, 8 * cp_size, 14 * cp_size]  # an empty sequence inside
    pieces = _all_indices(cp_size, split, cu_seqlens=docs)
    assert torch.equal(torch.cat(pieces).sort().values, torch.arange(docs[-1]))


def test_zigzag_takes_chunk_r_and_its_mirror():
    # 2 ranks, 16 tokens: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert rd.cp_token_indices(16, cp_size=2, cp_rank=0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert rd.cp_token_indices(16, cp_size=2, cp_rank=1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # 4 ranks, 8 tokens: rank r holds token r and token 7 - r.
    for r in range(4):
        assert rd.cp_token_indices(8, cp_size=4, cp_rank=r).tolist() == [r, 7 - r]


def test_contiguous_cuts_like_dtensor_shard():
    # torch.chunk's pieces: ceil(10 / 4) = 3 tokens each, the last rank the rest.
    for r, piece in enumerate(torch.arange(10).chunk(4)):
        assert rd.cp_token_indices(10, cp_size=4, cp_rank=r, split="contiguous").tolist() == piece.tolist()
    # 3 tokens on 4 ranks: the last rank holds none.
    assert rd.cp_token_indices(3, cp_size=4, cp_rank=3, split="contiguous").tolist() == []


def test_zigzag_matches_torch_context_parallel():
    """torch's context_parallel rearranges the sequence with its head-tail load balancer and
    gives rank r the r-th of cp_size equal pieces of the result."""
    balancer = pytest.importorskip(
        "torch.distributed.tensor.experimental._context_parallel._load_balancer")
    for cp_size, seq_len in ((2, 16), (4, 24), (3, 6)):
        order = balancer._HeadTailLoadBalancer(seq_len, cp_size, "cpu")._generate_indices()[0]
        for r, piece in enumerate(order.chunk(cp_size)):
            assert rd.cp_token_indices(seq_len, cp_size=cp_size, cp_rank=r).tolist() == piece.tolist()


def test_varlen_zigzag_is_per_sequence():
    """TransformerEngine's thd convention: each sequence cut into 2 * cp_size chunks, rank r
    holding chunks r and 2 * cp_size - 1 - r of each, sequence after sequence."""
    cu = [0, 8, 12, 12, 20]  # lengths 8, 4, 0, 8 on 2 ranks: chunks of 2, 1, 0, 2
    assert rd.cp_token_indices(cu_seqlens=cu, cp_size=2, cp_rank=0).tolist() == \
        [0, 1, 6, 7, 8, 11, 12, 13, 18, 19]
    assert rd.cp_token_indices(cu_seqlens=cu, cp_size=2, cp_rank=1).tolist() == \
        [2, 3, 4, 5, 9, 10, 14, 15, 16, 17]
    assert rd.cp_positions(cu_seqlens=cu, cp_size=2, cp_rank=1).tolist() == \
        [2, 3, 4, 5, 1, 2, 2, 3, 4, 5]


@pytest.mark.parametrize("split", rd.SPLITS)
def test_positions_are_the_global_positions_of_the_shard(split):
    """cp_positions = the single-process positions of the tokens cp_token_indices names, for one
    sequence (int start) and packs (per-sequence starts, as rope_ops.positions_from_seqlens)."""
    for cp_size in (2, 3):
        unit = 2 * cp_size if split == "zigzag" else 1
        seq_len = 6 * unit
        whole = 100 + torch.arange(seq_len)
        cu = [0, 4 * unit, 5 * unit, 9 * unit]
        start = [7, 0, 2**40]
        packed = rope_ops.positions_from_seqlens(cu_seqlens=cu, start=start)
        for r in range(cp_size):
            cp = dict(cp_size=cp_size, cp_rank=r, split=split)
            idx = rd.cp_token_indices(seq_len, **cp)
            assert torch.equal(rd.cp_positions(seq_len, start=100, **cp), whole[idx])
            idx = rd.cp_token_indices(cu_seqlens=cu, **cp)
            got = rd.cp_positions(cu_seqlens=torch.tensor(cu), start=torch.tensor(start), **cp)
            assert torch.equal(got, packed[idx])
            assert torch.equal(rd.cp_positions(cu_seqlens=cu, start=5, dtype=torch.int32, **cp),
                               (rope_ops.positions_from_seqlens(cu_seqlens=cu) + 5)[idx].int())


@pytest.mark.parametrize("split", rd.SPLITS)
def test_shard_selects_the_rank_tokens(split):
    x = torch.randn(2, 24, 3)
    cu = [0, 8, 8, 24]
    for r in range(2):
        cp = dict(cp_size=2, cp_rank=r, split=split)
        assert torch.equal(rd.cp_shard(x, 1, **cp), x[:, rd.cp_token_indices(24, **cp)])
        assert torch.equal(rd.cp_shard(x, -2, cu_seqlens=cu, **cp),
                           x[:, rd.cp_token_indices(cu_seqlens=cu, **cp)])
    view = rd.cp_shard(x, 1, cp_size=2, cp_rank=1, split="contiguous")
    assert view.data_ptr() == x[:, 12:].data_ptr(), "a contiguous shard is a view"


def test_shard_rotated_with_its_positions_equals_the_whole():
    """What a CP rank computes from its shard and cp_positions is its shard of the whole result."""
    q, k = torch.randn(2, 32, 4, 16), torch.randn(2, 32, 2, 16)
    whole_q, whole_k = rope_ops.apply(q, k, 3, backend="torch")
    for split in rd.SPLITS:
        for r in range(4):
            cp = dict(cp_size=4, cp_rank=r, split=split)
            got_q, got_k = rope_ops.apply(rd.cp_shard(q, 1, **cp), rd.cp_shard(k, 1, **cp),
                                          rd.cp_positions(32, start=3, **cp), backend="torch")
            assert torch.equal(got_q, rd.cp_shard(whole_q, 1, **cp))
            assert torch.equal(got_k, rd.cp_shard(whole_k, 1, **cp))


_BAD_CP_CALLS = [
    (lambda: rd.cp_positions(16, cp_size=0, cp_rank=0), ["cp_size"]),
    (lambda: rd.cp_positions(16, cp_size=2, cp_rank=2), ["cp_rank", "< cp_size"]),
    (lambda: rd.cp_positions(16, cp_size=2, cp_rank=True), ["cp_rank"]),
    (lambda: rd.cp_positions(16, cp_size=2, cp_rank=0, split="ring"), ["split", "zigzag"]),
    (lambda: rd.cp_positions(10, cp_size=2, cp_rank=0), ["seq_len", "multiple of 4"]),
    (lambda: rd.cp_positions(-1, cp_size=2, cp_rank=0, split="contiguous"), ["seq_len"]),
    (lambda: rd.cp_positions(16, cp_size=2, cp_rank=0, cu_seqlens=[0, 16]), ["exactly one"]),
    (lambda: rd.cp_positions(cp_size=2, cp_rank=0), ["exactly one"]),
    (lambda: rd.cp_positions(cp_size=2, cp_rank=0, cu_seqlens=[0, 8, 14]), ["sequence 1", "length 6"]),
    (lambda: rd.cp_positions(cp_size=2, cp_rank=0, cu_seqlens=[4, 8]), ["cu_seqlens", "start at 0"]),
    (lambda: rd.cp_positions(cp_size=2, cp_rank=0, cu_seqlens=[0, 8, 4], split="contiguous"),
     ["non-decreasing"]),
    (lambda: rd.cp_positions(cp_size=2, cp_rank=0, cu_seqlens=torch.tensor([0.0, 8.0])), ["integer"]),
    (lambda: rd.cp_positions(cp_size=2, cp_rank=0, cu_seqlens=[]), ["cu_seqlens"]),
    (lambda: rd.cp_positions(cp_size=2, cp_rank=0, cu_seqlens=[0, 8], start=[1, 2]), ["start"]),
    (lambda: rd.cp_positions(8, cp_size=2, cp_rank=0, start=[1]), ["start"]),
    (lambda: rd.cp_positions(8, cp_size=2, cp_rank=0, dtype=torch.float32), ["dtype"]),
    (lambda: rd.cp_positions(8, cp_size=2, cp_rank=0, start=2**31 - 6, dtype=torch.int32),
     ["dtype", "int64"]),
    (lambda: rd.cp_positions(cp_size=2, cp_rank=0, cu_seqlens=[0, 8], start=[2**31], dtype=torch.int32),
     ["dtype", "int64"]),
    (lambda: rd.cp_shard(torch.zeros(2, 8), 2, cp_size=2, cp_rank=0), ["dim"]),
    (lambda: rd.cp_shard(torch.zeros(2, 8), 1, cp_size=2, cp_rank=0, cu_seqlens=[0, 4]),
     ["cu_seqlens", "4 tokens"]),
]


@pytest.mark.parametrize("call, words", _BAD_CP_CALLS,
                         ids=[f"{words[0]}-{i}" for i, (_, words) in enumerate(_BAD_CP_CALLS)])
def test_bad_cp_arguments_are_rope_errors(call, words):
    with pytest.raises(RopeError) as error:
        call()
    for word in words:
        assert word in str(error.value)


def test_plain_tensors_pass_through():
    q, k = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    for got, want in zip(rd.apply(q, k, 4, backend="torch"), rope_ops.apply(q, k, 4, backend="torch")):
        assert torch.equal(got, want)
    for got, want in zip(rd.apply_grad(q, k, 4, backend="torch"),
                         rope_ops.apply_grad(q, k, 4, backend="torch")):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# Process groups: every rank against the single-process result.


def _rope_backends(config) -> list[str]:
    name = config.getoption("--rope-backend", default=None) or os.environ.get("ROPE_OPS_TEST_BACKEND")
    if name:
        return [name]
    from rope_ops import registry

    names = ["torch"]
    if "cpu" in registry.names() and not registry.availability(registry.get("cpu")):
        names.append("cpu")
    return names


def test_a_hanging_group_is_killed_and_fails():
    import _distributed_checks as checks

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not finish within 10 s"):
        checks.run_group(1, checks=["hang"], timeout=10)
    assert time.monotonic() - start < 30, "the group outlived its deadline"


_GROUPS: dict = {}


def _group(config, world_size: int) -> dict:
    """The outcomes of one spawned group (spawned once per session: spawn cost dominates)."""
    if world_size not in _GROUPS:
        import _distributed_checks as checks

        device = config.getoption("--rope-device", default=None) or "cpu"
        backend = os.environ.get("ROPE_OPS_DIST_BACKEND", "gloo")
        try:
            _GROUPS[world_size] = checks.run_group(world_size, rope_backends=_rope_backends(config),
                                                   device=device, dist_backend=backend).outcomes
        except RuntimeError as error:  # a hang or a dead rank: every check of the group fails
            _GROUPS[world_size] = error
    return _GROUPS[world_size]


def _cases():
    import _distributed_checks as checks

    return [pytest.param(world, name, id=f"{world}ranks-{name}")
            for world in (2, 4) for name in checks.checks_for(world)]


@pytest.mark.parametrize("world_size, check", _cases())
def test_ranks_agree_with_one_process(request, world_size, check):
    outcomes = _group(request.config, world_size)
    if isinstance(outcomes, Exception):
        pytest.fail(f"the {world_size}-rank group failed: {outcomes}")
    per_rank = outcomes[check]
    assert sorted(per_rank) == list(range(world_size)), f"ranks that reported: {sorted(per_rank)}"
    failures = {rank: outcome for rank, outcome in per_rank.items() if outcome.startswith("fail")}
    if failures:
        pytest.fail("\n".join(f"rank {rank}: {outcome}" for rank, outcome in sorted(failures.items())),
                    pytrace=False)
    skips = {outcome for outcome in per_rank.values() if outcome.startswith("skip")}
    if skips:
        pytest.skip("; ".join(sorted(skips)))


def test_readme_example_runs_on_two_cpu_ranks():
    """`python examples/distributed_cp.py`, as the README says: its ranks assert that the shards
    equal one process's result and that the DTensor rotations communicate nothing."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "distributed_cp.py"
    done = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "gathered shards == one process: True (bshd), True (varlen)" in out, out
    assert out.count("local == one process: True, collectives: 0") == 2, out
