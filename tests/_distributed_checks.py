"""Checks of rope_ops.distributed run by every rank of a spawned process group.

Each rank builds the same global inputs (one seed), computes the single-process result on them
and its own shard's result the distributed way, and compares them bit for bit (same backend;
``shape_dependent`` names the one exception), with CommDebugMode asserting that the sharded
forward and backward communicate nothing. The single-process results are checked against the
float64 reference as well.

``run_group`` spawns the ranks (a free port, a deadline so a hang fails) and returns each check's
outcome per rank. Device-agnostic: ``device="cuda"`` puts rank r on GPU r % count (several ranks
may share one GPU with gloo, as nothing is communicated); ``dist_backend="nccl"`` for one GPU per
rank. ``python tests/_distributed_checks.py --help`` runs a group from the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple

import torch

BASE = 10000.0
DEFAULT_TIMEOUT = 300.0  # seconds for a whole group: startup, every check, teardown


# ---------------------------------------------------------------------------------------------
# Spawning.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group(NamedTuple):
    outcomes: dict  # {check: {rank: "ok" | "skip: why" | "fail: traceback"}}
    seconds: dict  # {check: the slowest rank's time}


def run_group(world_size: int, *, rope_backends=("torch",), device: str = "cpu",
              dist_backend: str = "gloo", checks=None, timeout: float | None = None) -> Group:
    """Spawn ``world_size`` ranks that run ``checks`` (default: all for that size) and collect
    their outcomes. Raises RuntimeError when a rank dies or the group outlives ``timeout`` (its
    processes are killed)."""
    import torch.multiprocessing as mp

    names = list(checks or checks_for(world_size))
    if timeout is None:
        timeout = float(os.environ.get("ROPE_OPS_DIST_TIMEOUT", DEFAULT_TIMEOUT))
    with tempfile.TemporaryDirectory(prefix="rope_ops_dist_") as out_dir:
        options = {"port": free_port(), "world_size": world_size, "rope_backends": list(rope_backends),
                   "device": device, "dist_backend": dist_backend, "checks": names,
                   "out_dir": out_dir, "timeout": timeout}
        context = mp.start_processes(_worker, args=(options,), nprocs=world_size, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the {world_size}-rank group did not finish within {timeout:.0f} s "
                                       "(a hang); its processes were killed")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(5)
        results: dict = {name: {} for name in names}
        slowest: dict = {name: 0.0 for name in names}
        for rank in range(world_size):
            path = Path(out_dir) / f"rank{rank}.json"
            if not path.exists():
                raise RuntimeError(f"rank {rank} wrote no results")
            report = json.loads(path.read_text())
            for name, outcome in report["outcomes"].items():
                results[name][rank] = outcome
            for name, spent in report["seconds"].items():
                slowest[name] = max(slowest[name], spent)
        return Group(results, slowest)


def _worker(rank: int, options: dict) -> None:
    import torch.distributed as dist

    world = options["world_size"]
    device = _rank_device(options["device"], rank)
    dist.init_process_group(options["dist_backend"], init_method=f"tcp://127.0.0.1:{options['port']}",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=min(120, options["timeout"])))
    outcomes, seconds = {}, {}
    try:
        try:
            ctx = Ctx(rank, world, device, options["rope_backends"])
        except Exception:  # every check fails with the reason
            setup = "fail: setting up the rank: " + traceback.format_exc()
            outcomes = {name: setup for name in options["checks"]}
        else:
            for name in options["checks"]:
                start = time.monotonic()
                try:
                    skip = CHECKS[name](ctx)
                    outcomes[name] = "ok" if skip is None else f"skip: {skip}"
                except Exception:  # reported by the parent, with the traceback
                    outcomes[name] = "fail: " + traceback.format_exc()
                seconds[name] = time.monotonic() - start
    finally:
        Path(options["out_dir"], f"rank{rank}.json").write_text(
            json.dumps({"outcomes": outcomes, "seconds": seconds}))
        dist.destroy_process_group()


def _rank_device(device: str, rank: int) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    module = getattr(torch, device)
    index = rank % module.device_count()
    module.set_device(index)
    return torch.device(device, index)


# ---------------------------------------------------------------------------------------------
# What every check has at hand.


class Ctx:
    def __init__(self, rank, world, device, rope_backends):
        from torch.distributed.device_mesh import DeviceMesh

        import torch.distributed as dist

        self.rank, self.world, self.device = rank, world, device
        self.rope_backends = list(rope_backends)
        # gloo all-gathers device tensors by crashing (pytorch/pytorch#152645; several ranks on
        # one GPU can only use gloo): the checks' own all-gathers are left out there.
        self.gathers_on_device = device.type == "cpu" or dist.get_backend() != "gloo"
        self.meshes = {"1d": DeviceMesh(device.type, torch.arange(world))}
        if world == 4:
            self.meshes["2d"] = DeviceMesh(device.type, torch.arange(4).view(2, 2))

    def randn(self, *shape, dtype=torch.float32, seed=0):
        """The same values on every rank."""
        g = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=g).to(self.device, dtype)

    def positions(self, *shape, seed=0):
        """Random positions in [0, 5000), a few far outside any table (the same on every rank)."""
        g = torch.Generator().manual_seed(seed + 1000)
        pos = torch.randint(0, 5000, shape, generator=g)
        flat = pos.view(-1)
        flat[:: 5] += 2**35
        return pos.to(self.device)


def placed(full, mesh, placements):
    """The DTensor of the global ``full`` with ``placements`` (Replicate or Shard; each rank
    takes its slice, no communication)."""
    from torch.distributed.tensor import DTensor, Replicate

    whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return whole.redistribute(mesh, placements)


def summed(partial_dtensor) -> torch.Tensor:
    """The sum over ranks of a Partial DTensor's local values, reduced as CPU tensors (which
    gloo reduces on any machine), on the DTensor's device."""
    import torch.distributed as dist

    local = partial_dtensor.to_local().detach()
    total = local.cpu().clone()
    dist.all_reduce(total)
    return total.to(local.device)


def partial(full, mesh, rank):
    """A Partial(sum) DTensor of ``full``: rank 0 holds it, the others zeros (exact sums)."""
    from torch.distributed.tensor import DTensor, Partial

    local = full if rank == 0 else torch.zeros_like(full)
    return DTensor.from_local(local, mesh, [Partial()], run_check=False)


def expected_local(full, like, rank):
    """What ``like`` (a DTensor) should hold locally if it were ``full`` placed as it is."""
    from torch.distributed.tensor import Partial

    if any(isinstance(p, Partial) for p in like.placements):
        return full if rank == 0 else torch.zeros_like(full)
    return placed(full, like.device_mesh, like.placements).to_local()


def assert_same(got, want, what):
    """Bit for bit (NaN where want is NaN)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    assert bool(same.all()), f"{what}: {int((~same).sum())} of {got.numel()} elements differ"


def shape_dependent(backend: str, style: str) -> bool:
    """Whether a token's result may change with the shape of the call it is in.

    The torch backend rotates gptj pairs with torch's complex multiply, whose CPU kernel rounds
    its vectorised body and its scalar tail differently (fused or separate multiply-adds): the
    same token can come out a rounding apart in a shard and in the whole tensor. Such results
    are compared within SPEC's float32 allowance instead; everything else bit for bit.
    """
    return backend == "torch" and style == "gptj"


def assert_same_rotation(got, want, x, *, rotary_dim, style, exact=True, what):
    """``got`` equals ``want`` (both rotations of ``x``) bit for bit, or within SPEC's float32
    allowance at x's pairs when not ``exact``. A bitwise mismatch says whether it is within that
    allowance (a rounding that depends on the call's shape) or beyond it (a wrong rotation)."""
    from rope_ops.testing.checks import assert_rope_close

    def within_allowance():
        assert_rope_close(got.cpu(), want.double().cpu(), x.cpu(), rotary_dim=rotary_dim,
                          style=style, what=what)

    if not exact:
        within_allowance()
        return
    try:
        assert_same(got, want, what)
    except AssertionError as mismatch:
        try:
            within_allowance()
        except AssertionError as beyond:
            raise AssertionError(f"{mismatch}; beyond SPEC's allowance: {beyond}") from None
        raise AssertionError(f"{mismatch}, all within SPEC's float32 allowance (a rounding that "
                             "depends on the call's shape)") from None


class Failures:
    """Collects the failing cases of a check, so that one run reports all of them."""

    def __init__(self):
        self.messages = []

    @contextlib.contextmanager
    def case(self):
        try:
            yield
        except AssertionError as error:
            self.messages.append(str(error))

    def raise_any(self):
        if self.messages:
            raise AssertionError(f"{len(self.messages)} failing cases:\n" + "\n".join(self.messages))


@contextlib.contextmanager
def no_communication(what, allowed=None):
    """Fails when the block communicates; ``allowed``: the collectives (CommDebugMode counts) that
    torch itself makes for the same block without rope_ops, which rope_ops must not add to."""
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with mode:
        yield
    counts = dict(mode.get_comm_counts())
    assert counts == dict(allowed or {}), \
        f"{what}: {mode.get_total_counts()} collectives ({counts}; torch alone: {dict(allowed or {})})"


def torch_collectives(block):
    """The collectives torch makes running ``block()`` (a baseline for no_communication)."""
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with mode:
        block()
    return dict(mode.get_comm_counts())


def compiler_without_collectives(what):
    """A torch.compile backend (AOT autograd, run eagerly) that fails when the forward or
    backward graph it is given holds a collective: CommDebugMode cannot watch compiled code."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def keep(graph_module, example_inputs):
        found = [str(node.target) for node in graph_module.graph.nodes
                 if node.op == "call_function" and "c10d" in str(node.target)]
        assert not found, f"{what}: the compiled graph communicates: {found}"
        return make_boxed_func(graph_module)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def assert_matches_reference(out, x, pos, *, layout, rotary_dim, style, inverse=False, what):
    """The single-process result against the float64 reference (SPEC's bounds)."""
    from rope_ops._reference import rope_reference
    from rope_ops.frequencies import compute_inv_freq
    from rope_ops.testing.checks import assert_rope_close

    inv_freq, factor = compute_inv_freq(rotary_dim, BASE)
    if isinstance(pos, torch.Tensor):
        pos = pos.cpu()
    ref = rope_reference(x, pos, layout=layout, rotary_dim=rotary_dim, style=style, inv_freq=inv_freq,
                         attention_factor=factor, inverse=inverse)
    assert_rope_close(out.cpu(), ref, x.cpu(), rotary_dim=rotary_dim, style=style, what=what)


# ---------------------------------------------------------------------------------------------
# Rotation of DTensors: rope_ops.distributed.apply against the single-process rope_ops.apply.


def _rotation_cases(world):
    from torch.distributed.tensor import Partial, Replicate, Shard

    R, P = Replicate(), Partial()
    b, s, h, hk = 2, 2 * world + 1, 2 * world, world  # s: uneven shards
    t = 3 * world + 1
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    # name, layout, mesh, q shape, k shape, q placements, k placements, pos form, pos placements,
    # dtype, style, rotary_dim (head_dim 8)
    cases = [
        ("sequence bshd, pos DTensor", "bshd", "1d", (b, s, h, 8), (b, s, hk, 8), [Shard(1)], [Shard(1)],
         "tensor", [Shard(1)], f32, "neox", 8),
        ("sequence bshd, pos plain", "bshd", "1d", (b, s, h, 8), (b, s, hk, 8), [Shard(1)], [Shard(1)],
         "tensor", None, bf16, "gptj", 4),
        ("sequence bshd, pos int", "bshd", "1d", (b, s, h, 8), (b, s, hk, 8), [Shard(1)], [Shard(1)],
         "int", None, f32, "neox", 8),
        ("sequence bshd, pos [S] replicated", "bshd", "1d", (b, s, h, 8), (b, s, hk, 8), [Shard(1)],
         [Shard(1)], "shared", [R], f16, "neox", 6),
        ("heads bshd", "bshd", "1d", (b, s, h, 8), (b, s, hk, 8), [Shard(2)], [Shard(2)], "tensor",
         [R], bf16, "neox", 8),
        ("heads bshd, k replicated (GQA)", "bshd", "1d", (b, s, h, 8), (b, s, 1, 8), [Shard(2)], [R],
         "int", None, f32, "gptj", 8),
        ("batch bshd", "bshd", "1d", (world, s, h, 8), (world, s, hk, 8), [Shard(0)], [Shard(0)],
         "tensor", [Shard(0)], f32, "neox", 8),
        ("sequence sbhd", "sbhd", "1d", (s, b, h, 8), (s, b, hk, 8), [Shard(0)], [Shard(0)], "tensor",
         [Shard(1)], bf16, "neox", 8),
        ("sequence bhsd", "bhsd", "1d", (b, h, s, 8), (b, hk, s, 8), [Shard(2)], [Shard(2)], "tensor",
         None, f32, "gptj", 8),
        ("heads bhsd, pos int", "bhsd", "1d", (b, h, s, 8), (b, hk, s, 8), [Shard(1)], [Shard(1)], "int",
         None, f32, "neox", 8),
        ("tokens thd", "thd", "1d", (t, h, 8), (t, hk, 8), [Shard(0)], [Shard(0)], "tensor", [Shard(0)],
         bf16, "neox", 8),
        ("heads thd", "thd", "1d", (t, h, 8), (t, hk, 8), [Shard(1)], [Shard(1)], "tensor", None, f32,
         "neox", 8),
        ("heads [T, H*D] (head_dim=)", "flat", "1d", (t, h * 8), (t, hk * 8), [Shard(1)], [Shard(1)],
         "tensor", None, f32, "neox", 8),
        ("tokens [T, H*D] (head_dim=)", "flat", "1d", (t, h * 8), (t, hk * 8), [Shard(0)], [Shard(0)],
         "int", None, bf16, "gptj", 8),
        ("partial sums", "bshd", "1d", (b, s, h, 8), (b, s, hk, 8), [P], [P], "tensor", [R], f32, "neox", 8),
    ]
    if world == 4:
        cases += [
            ("sequence x heads (2-D mesh)", "bshd", "2d", (b, s, h, 8), (b, s, hk, 8),
             [Shard(1), Shard(2)], [Shard(1), Shard(2)], "tensor", [Shard(1), R], f32, "neox", 8),
            ("batch x sequence (2-D mesh)", "bshd", "2d", (4, s, h, 8), (4, s, hk, 8),
             [Shard(0), Shard(1)], [Shard(0), Shard(1)], "tensor", None, bf16, "neox", 8),
            ("sequence twice (2-D mesh)", "thd", "2d", (t, h, 8), (t, hk, 8), [Shard(0), Shard(0)],
             [Shard(0), Shard(0)], "int", None, f32, "gptj", 8),
        ]
    return cases


def check_rotation(c: Ctx):
    """Forward and backward of every sharding: bit for bit, no communication."""
    failures = Failures()
    for backend in c.rope_backends:
        for n, case in enumerate(_rotation_cases(c.world)):
            with failures.case():
                _check_rotation_case(c, backend, n, case)
    failures.raise_any()


def _check_rotation_case(c, backend, n, case):
    import rope_ops
    import rope_ops.distributed as rd
    from torch.distributed.tensor import DTensor, Partial

    (name, layout, mesh_name, q_shape, k_shape, q_pl, k_pl, pos_form, pos_pl, dtype, style,
     rotary_dim) = case
    what = f"{name} [{backend}, {dtype}]"
    mesh = c.meshes[mesh_name]
    flat = layout == "flat"
    layout_kw = {"head_dim": 8} if flat else {"layout": layout}
    q = c.randn(*q_shape, dtype=dtype, seed=n)
    k = c.randn(*k_shape, dtype=dtype, seed=100 + n)
    seq_dim = {"bshd": 1, "sbhd": 0, "bhsd": 2, "thd": 0, "flat": 0}[layout]
    batch = None if layout in ("thd", "flat") else q_shape[{"bshd": 0, "sbhd": 1, "bhsd": 0}[layout]]
    seq = q_shape[seq_dim]
    token_shape = (seq,) if batch is None else (batch, seq)
    if pos_form == "int":
        pos = 7
    elif pos_form == "shared":
        pos = c.positions(seq, seed=n)
    else:
        pos = c.positions(*token_shape, seed=n)
    kw = dict(rotary_dim=rotary_dim, style=style, base=BASE, backend=backend, **layout_kw)

    # Single process.
    q1, k1 = q.clone().requires_grad_(), k.clone().requires_grad_()
    ref_q, ref_k = rope_ops.apply(q1, k1, pos, **kw)
    grad_q = c.randn(*q_shape, dtype=dtype, seed=200 + n)
    grad_k = c.randn(*k_shape, dtype=dtype, seed=300 + n)
    torch.autograd.backward([ref_q, ref_k], [grad_q, grad_k])
    if n % 3 == 0:  # the float64 reference, on a few
        ref_layout = "thd" if flat else layout
        unflat = (lambda x: x.unflatten(-1, (-1, 8))) if flat else (lambda x: x)
        assert_matches_reference(unflat(ref_q.detach()), unflat(q), pos, layout=ref_layout,
                                 rotary_dim=rotary_dim, style=style, what=f"{what}: q")

    # Sharded.
    if isinstance(q_pl[0], Partial):
        dq, dk = partial(q, mesh, c.rank), partial(k, mesh, c.rank)
    else:
        dq, dk = placed(q, mesh, q_pl), placed(k, mesh, k_pl)
    dq, dk = dq.detach().requires_grad_(), dk.detach().requires_grad_()
    dpos = pos if pos_pl is None or not isinstance(pos, torch.Tensor) else placed(pos, mesh, pos_pl)
    with no_communication(f"{what}: forward"):
        out_q, out_k = rd.apply(dq, dk, dpos, **kw)
    assert isinstance(out_q, DTensor) and isinstance(out_k, DTensor), what
    assert tuple(out_q.placements) == tuple(dq.placements), f"{what}: q_out placed {out_q.placements}"
    assert tuple(out_k.placements) == tuple(dk.placements), f"{what}: k_out placed {out_k.placements}"
    assert out_q.shape == q.shape and out_k.shape == k.shape, f"{what}: global shapes"
    exact = not shape_dependent(backend, style)
    flat_view = (lambda x: x.unflatten(-1, (-1, 8))) if flat else (lambda x: x)

    def same(got, want_full, like, x_full, what):
        x = flat_view(expected_local(x_full, like, c.rank))
        assert_same_rotation(flat_view(got), flat_view(expected_local(want_full, like, c.rank)),
                             x, rotary_dim=rotary_dim, style=style, exact=exact, what=what)

    same(out_q.to_local(), ref_q.detach(), out_q, q, f"{what}: q_out")
    same(out_k.to_local(), ref_k.detach(), out_k, k, f"{what}: k_out")
    if isinstance(q_pl[0], Partial):
        g_q, g_k = partial(grad_q, mesh, c.rank), partial(grad_k, mesh, c.rank)
    else:
        g_q, g_k = placed(grad_q, mesh, q_pl), placed(grad_k, mesh, k_pl)
    with no_communication(f"{what}: backward"):
        torch.autograd.backward([out_q, out_k], [g_q, g_k])
    same(dq.grad.to_local(), q1.grad, dq, grad_q, f"{what}: grad q")
    same(dk.grad.to_local(), k1.grad, dk, grad_k, f"{what}: grad k")

    # RotaryEmbeddingGrad directly.
    with no_communication(f"{what}: apply_grad"):
        back_q, _ = rd.apply_grad(g_q, None, dpos, **kw)
    same(back_q.to_local(), q1.grad, dq, grad_q, f"{what}: apply_grad")


def check_angle_sources(c: Ctx):
    """Every angle source on a sequence-sharded q: caller tables (plain or replicated DTensors),
    per-token tables (sliced like q's tokens), mRoPE positions [3, B, S], a RotaryEmbedding,
    scaled frequencies; and out= DTensors."""
    import rope_ops
    import rope_ops.distributed as rd
    from rope_ops import BackendError
    from torch.distributed.tensor import Replicate, Shard

    mesh = c.meshes["1d"]
    b, s, h, d = 2, 2 * c.world + 1, 4, 8
    q, k = c.randn(b, s, h, d, seed=21), c.randn(b, s, 2, d, seed=22)
    refused = []
    g = torch.Generator().manual_seed(23)
    table_pos = torch.randint(0, 64, (b, s), generator=g).to(c.device)
    angles = torch.rand(64, d // 2, generator=g).to(c.device) * 6.0
    tables = (angles.cos(), angles.sin())
    token_angles = torch.rand(b, s, d // 2, generator=g).to(c.device) * 6.0
    token_tables = (token_angles.cos(), token_angles.sin())
    mrope_pos = torch.randint(0, 3000, (3, b, s), generator=g).to(c.device)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    for backend in c.rope_backends:
        module = rope_ops.RotaryEmbedding(d, base=BASE, device=c.device)
        # (name, positions, keywords, the same with plain tensors, positions' placement)
        variants = [
            ("caller tables", table_pos, dict(cos_sin=tables), None, None),
            ("caller tables as replicated DTensors", table_pos,
             dict(cos_sin=tuple(placed(t, mesh, [Replicate()]) for t in tables)),
             dict(cos_sin=tables), [Shard(1)]),
            ("per-token tables", None, dict(cos_sin=token_tables), None, None),
            ("per-token tables as DTensors", None,
             dict(cos_sin=tuple(placed(t, mesh, [Shard(1)]) for t in token_tables)),
             dict(cos_sin=token_tables), None),
            ("mRoPE positions", mrope_pos, dict(mrope_section=[1, 1, 2], base=BASE), None,
             [Shard(2)]),
            ("RotaryEmbedding", table_pos * 37, dict(rope=module), None, None),
            ("yarn scaling", table_pos * 37, dict(scaling=yarn, base=BASE), None, [Shard(1)]),
        ]
        for name, pos, kw, plain_kw, pos_pl in variants:
            what = f"{name} [{backend}]"
            try:
                ref_q, ref_k = rope_ops.apply(q, k, pos, backend=backend, **(plain_kw or kw))
            except BackendError:  # a source this backend does not declare: nothing to compare
                refused.append(what)
                continue
            dpos = pos if pos_pl is None else placed(pos, mesh, pos_pl)
            dq, dk = placed(q, mesh, [Shard(1)]), placed(k, mesh, [Shard(1)])
            with no_communication(what):
                out_q, out_k = rd.apply(dq, dk, dpos, backend=backend, **kw)
            assert_same(out_q.to_local(), expected_local(ref_q, out_q, c.rank), f"{what}: q")
            assert_same(out_k.to_local(), expected_local(ref_k, out_k, c.rank), f"{what}: k")

        what = f"out= [{backend}]"
        ref_q, ref_k = rope_ops.apply(q, k, 11, base=BASE, backend=backend)
        dq, dk = placed(q, mesh, [Shard(1)]), placed(k, mesh, [Shard(1)])
        given = (placed(torch.zeros_like(q), mesh, [Shard(1)]), placed(torch.zeros_like(k), mesh, [Shard(1)]))
        with no_communication(what):
            out_q, out_k = rd.apply(dq, dk, 11, base=BASE, backend=backend, out=given)
        assert out_q is given[0] and out_k is given[1], f"{what}: returns the given outputs"
        assert_same(given[0].to_local(), expected_local(ref_q, given[0], c.rank), f"{what}: q")
        assert_same(given[1].to_local(), expected_local(ref_k, given[1], c.rank), f"{what}: k")
    if refused:
        return "refused by the backend: " + ", ".join(refused)


def check_in_place(c: Ctx):
    """In place: without grad (each rank writes its shard), and in training on views of a packed
    QKV DTensor (gradients through the write); refusals write nothing."""
    import rope_ops
    import rope_ops.distributed as rd
    from rope_ops import RopeError
    from torch.distributed.tensor import Shard

    mesh = c.meshes["1d"]
    b, s, h, hk, d = 2, 2 * c.world + 1, 2 * c.world, c.world, 8
    for backend in c.rope_backends:
        kw = dict(base=BASE, backend=backend)
        for n, (placement, pos_pl) in enumerate(((Shard(1), [Shard(1)]), (Shard(2), None))):
            what = f"in place {placement} [{backend}]"
            q, k = c.randn(b, s, h, d, seed=n), c.randn(b, s, hk, d, seed=10 + n)
            pos = c.positions(b, s, seed=n)
            ref_q, ref_k = rope_ops.apply(q, k, pos, **kw)
            dq, dk = placed(q, mesh, [placement]), placed(k, mesh, [placement])
            version = dq._version
            dpos = pos if pos_pl is None else placed(pos, mesh, pos_pl)
            with no_communication(what):
                out_q, out_k = rd.apply(dq, dk, dpos, inplace=True, **kw)
            assert out_q is dq and out_k is dk, f"{what}: returns q and k themselves"
            assert dq._version > version, f"{what}: q's version counter did not move"
            assert_same(dq.to_local(), expected_local(ref_q, dq, c.rank), f"{what}: q")
            assert_same(dk.to_local(), expected_local(ref_k, dk, c.rank), f"{what}: k")

        # Training: q and k are views of one QKV DTensor (sequence-sharded). torch 2.11's
        # backward of the in-place write all-gathers (see torch_in_place_alone): left out where
        # that cannot run.
        if c.gathers_on_device:
            _check_in_place_training(c, mesh, b, s, h, hk, d, kw, backend)
        # A leaf that requires grad cannot be written in place: refused, untouched.
        dq = placed(c.randn(b, s, h, d, seed=9), mesh, [Shard(1)]).requires_grad_()
        before = dq.to_local().clone()
        try:
            rd.apply(dq, None, pos, inplace=True, **kw)
        except RopeError as e:
            assert "leaf" in str(e), e
        else:
            raise AssertionError("in place on a leaf DTensor that requires grad was not refused")
        assert_same(dq.to_local(), before, "refused in-place call wrote q")
    if not c.gathers_on_device:
        return ("in place on packed QKV views with grad: not run (torch 2.11's backward of an "
                "in-place write to a DTensor view all-gathers; gloo cannot on device tensors)")


def _check_in_place_training(c: Ctx, mesh, b, s, h, hk, d, kw, backend):
    """rope_ops.distributed.apply in place on q and k views of one sequence-sharded QKV DTensor
    that requires grad: output and gradient as the single-process ones, and no communication but
    what torch itself adds to an in-place write on a DTensor view."""
    import rope_ops
    import rope_ops.distributed as rd
    from torch.distributed.tensor import Shard

    what = f"in place on packed QKV views, with grad [{backend}]"
    width = (h + 2 * hk) * d
    qkv = c.randn(b, s, width, seed=7)
    grad = c.randn(b, s, width, seed=8)
    pos = c.positions(b, s, seed=7)

    def rotate_packed(x, apply, pos):
        y = x * 1.0
        q = y[..., : h * d].unflatten(-1, (h, d))
        k = y[..., h * d: (h + hk) * d].unflatten(-1, (hk, d))
        apply(q, k, pos, inplace=True, **kw)
        return y

    leaf = qkv.clone().requires_grad_()
    ref = rotate_packed(leaf, rope_ops.apply, pos)
    ref.backward(grad)
    def torch_in_place_alone():
        # torch 2.11's backward of any in-place op on a DTensor view (CopySlices) gathers the
        # whole gradient once; newer torch does not. rope_ops must add nothing to that.
        x = placed(qkv, mesh, [Shard(1)]).requires_grad_()
        y = x * 1.0
        y[..., : h * d].mul_(1.0)
        y.backward(placed(grad, mesh, [Shard(1)]))

    dleaf = placed(qkv, mesh, [Shard(1)]).requires_grad_()
    with no_communication(what, allowed=torch_collectives(torch_in_place_alone)):
        out = rotate_packed(dleaf, rd.apply, pos)
        out.backward(placed(grad, mesh, [Shard(1)]))
    assert_same(out.to_local(), expected_local(ref.detach(), out, c.rank), f"{what}: output")
    assert_same(dleaf.grad.to_local(), expected_local(leaf.grad, dleaf, c.rank), f"{what}: grad")


def check_refusals(c: Ctx):
    """What cannot run locally is a RopeError naming the argument, before anything is written."""
    import rope_ops.distributed as rd
    from rope_ops import RopeError
    from torch.distributed.tensor import Replicate, Shard

    mesh = c.meshes["1d"]
    b, s, h, d = 2, 2 * c.world, 2 * c.world, 8
    q, k = c.randn(b, s, h, d, seed=1), c.randn(b, s, h, d, seed=2)
    pos = c.positions(b, s)

    def refused(call, *words, untouched=()):
        before = [t.to_local().clone() for t in untouched]
        try:
            call()
        except RopeError as e:
            for word in words:
                assert word in str(e), f"RopeError without {word!r}: {e}"
        else:
            raise AssertionError(f"not refused (expected a RopeError about {words})")
        for t, was in zip(untouched, before):
            assert_same(t.to_local(), was, f"a refused call ({words}) wrote its input")

    head_dim_q = placed(q, mesh, [Shard(3)])
    refused(lambda: rd.apply(head_dim_q, None, pos, inplace=True, base=BASE), "q:", "head_dim",
            untouched=[head_dim_q])
    refused(lambda: rd.apply(placed(q, mesh, [Shard(1)]), placed(k, mesh, [Shard(3)]), pos, base=BASE),
            "k:", "head_dim")
    seq_q, batch_k = placed(q, mesh, [Shard(1)]), placed(k, mesh, [Shard(0)])
    refused(lambda: rd.apply(seq_q, batch_k, pos, inplace=True, base=BASE), "k:", "the same way",
            untouched=[seq_q, batch_k])
    heads_q = placed(q, mesh, [Shard(2)])
    refused(lambda: rd.apply(heads_q, None, placed(pos, mesh, [Shard(1)]), inplace=True, base=BASE),
            "pos:", "communication", untouched=[heads_q])
    refused(lambda: rd.apply(q, placed(k, mesh, [Shard(1)]), pos, base=BASE), "q:", "DTensor")
    refused(lambda: rd.apply(placed(q, mesh, [Shard(1)]), None, pos[:, :-1], base=BASE), "pos:")
    other_device = torch.device("meta")
    refused(lambda: rd.apply(placed(q, mesh, [Shard(1)]), None, pos.to(other_device), base=BASE),
            "pos:", "device")
    caller = (torch.ones(10, 4, device=c.device), torch.zeros(10, 4, device=c.device))
    refused(lambda: rd.apply(placed(q, mesh, [Shard(1)]), None,
                             torch.zeros(b, s, dtype=torch.long, device=c.device),
                             cos_sin=tuple(placed(t, mesh, [Shard(0)]) for t in caller)),
            "cos_sin", "replicated")
    # The same rules in the ops' sharding (torch.ops.rope_ops.rope on DTensors).
    tables = _replicated_tables(c, mesh, d)
    refused(lambda: torch.ops.rope_ops.rope(placed(q, mesh, [Shard(3)]), None,
                                            placed(pos, mesh, [Replicate()]), 0, *tables, "bshd", d,
                                            False, False, "table", [], False, False, "torch"),
            "q:", "head_dim")
    refused(lambda: torch.ops.rope_ops.rope(placed(q, mesh, [Shard(1)]), None, None, 0, *tables,
                                            "bshd", d, False, False, "table", [], False, False, "torch"),
            "pos:", "offset")
    refused(lambda: torch.ops.rope_ops.rope(placed(q, mesh, [Shard(2)]), None,
                                            placed(pos, mesh, [Shard(1)]), 0, *tables, "bshd", d, False,
                                            False, "table", [], False, False, "torch"),
            "pos:", "communication")


def _replicated_tables(c, mesh, rotary_dim):
    """(cos, sin, freq_turns, attention_factor): the tables rope_ops.apply(..., base=BASE)
    uses, replicated."""
    from rope_ops._tables import CACHE
    from rope_ops.embedding import DEFAULT_TABLE_ROWS
    from rope_ops.frequencies import frequencies
    from torch.distributed.tensor import Replicate

    cos, sin, turns, factor = CACHE.get(frequencies(rotary_dim, BASE, None, None, None),
                                        DEFAULT_TABLE_ROWS, c.device)
    return (*(placed(t, mesh, [Replicate()] * mesh.ndim) for t in (cos, sin, turns)), factor, "", -1)


def check_ops(c: Ctx):
    """torch.ops.rope_ops.rope / rope_ called on DTensors directly: the sharding rules run them
    locally (positions replicated are sliced, never gathered), bit for bit, no communication."""
    import rope_ops
    import rope_ops.distributed  # noqa: F401  (registers the ops' sharding rules)
    from torch.distributed.tensor import DTensor, Replicate, Shard

    b, s, h, hk, d = 2, 2 * c.world + 1, 2 * c.world, c.world, 8
    if c.gathers_on_device:
        try:  # the watch sees communication where there is some (an all-gather)
            with no_communication("control"):
                placed(c.randn(b, s, d), c.meshes["1d"], [Shard(1)]).full_tensor()
        except AssertionError as e:
            assert "collectives" in str(e), e
        else:
            raise AssertionError("no_communication missed an all-gather")
    failures = Failures()
    for backend in c.rope_backends:
        for mesh_name, q_pl, pos_pl in (("1d", [Shard(1)], [Replicate()]), ("1d", [Shard(1)], [Shard(1)]),
                                        ("1d", [Shard(2)], [Replicate()]),
                                        ("2d", [Shard(1), Shard(2)], [Replicate(), Replicate()]),
                                        ("2d", [Shard(0), Shard(1)], [Shard(0), Shard(1)])):
            if mesh_name not in c.meshes:
                continue
            mesh = c.meshes[mesh_name]
            what = f"op on {q_pl}, pos {pos_pl} [{backend}]"
            q, k = c.randn(b, s, h, d, seed=3), c.randn(b, s, hk, d, seed=4)
            pos = c.positions(b, s, seed=3)
            tables = _replicated_tables(c, mesh, d)
            args = (0, *tables, "bshd", d, False)
            for inverse in (False, True):
                rotate = rope_ops.apply_grad if inverse else rope_ops.apply
                ref_q, ref_k = rotate(q, k, pos, base=BASE, backend=backend)
                dq, dk, dpos = placed(q, mesh, q_pl), placed(k, mesh, q_pl), placed(pos, mesh, pos_pl)
                with no_communication(what):
                    out_q, out_k = torch.ops.rope_ops.rope(dq, dk, dpos, *args, inverse, "table", [],
                                                           False, False, backend)
                assert isinstance(out_q, DTensor) and tuple(out_q.placements) == tuple(q_pl), what
                x_q, x_k = dq.to_local().clone(), dk.to_local().clone()

                def same(got, want, x, what):
                    assert_same_rotation(got, want, x, rotary_dim=d, style="neox", what=what)

                with failures.case():
                    same(out_q.to_local(), expected_local(ref_q, out_q, c.rank), x_q, f"{what}: q")
                    same(out_k.to_local(), expected_local(ref_k, out_k, c.rank), x_k, f"{what}: k")
                with no_communication(f"{what}, in place"):
                    torch.ops.rope_ops.rope_(dq, dk, dpos, *args, inverse, "table", [], False, False,
                                             backend)
                with failures.case():
                    same(dq.to_local(), expected_local(ref_q, dq, c.rank), x_q, f"{what}: q in place")
                    same(dk.to_local(), expected_local(ref_k, dk, c.rank), x_k, f"{what}: k in place")
    failures.raise_any()


def check_compile(c: Ctx):
    """torch.compile(fullgraph=True) of rope_ops.distributed.apply on DTensors (forward and
    backward) and of the op on DTensors: the same bits as eager."""
    import rope_ops.distributed as rd
    from torch.distributed.tensor import Replicate, Shard

    mesh = c.meshes["1d"]
    b, s, h, d = 2, 2 * c.world, 2 * c.world, 8
    backend = c.rope_backends[0]
    q, k = c.randn(b, s, h, d, seed=5), c.randn(b, s, h, d, seed=6)
    pos = c.positions(b, s, seed=5)
    grad = c.randn(b, s, h, d, seed=7)

    def step(q, k, pos):
        return rd.apply(q, k, pos, base=BASE, backend=backend)

    compiled = torch.compile(step, backend=compiler_without_collectives("compiled apply"), fullgraph=True)
    results = []
    for fn in (step, compiled):
        dq = placed(q, mesh, [Shard(1)]).requires_grad_()
        dk = placed(k, mesh, [Shard(1)]).requires_grad_()
        out_q, out_k = fn(dq, dk, placed(pos, mesh, [Shard(1)]))
        torch.autograd.backward([out_q, out_k], [placed(grad, mesh, [Shard(1)])] * 2)
        results.append([out_q.to_local(), out_k.to_local(), dq.grad.to_local(), dk.grad.to_local()])
    for name, eager, traced in zip(("q_out", "k_out", "grad q", "grad k"), *results):
        assert_same(traced.detach(), eager.detach(), f"compiled apply: {name}")

    # The watch sees communication where there is some (an all-gather).
    gather = torch.compile(lambda x: x.redistribute(mesh, [Replicate()]).to_local() * 2,
                           backend=compiler_without_collectives("gather"), fullgraph=True)
    try:
        gather(placed(q, mesh, [Shard(1)]))
    except Exception as e:  # dynamo wraps the backend's AssertionError
        assert "communicates" in str(e), e
    else:
        raise AssertionError("compiler_without_collectives missed an all-gather")

    tables = _replicated_tables(c, mesh, d)

    def op(q, pos, cos, sin, turns):
        return torch.ops.rope_ops.rope(q, None, pos, 0, cos, sin, turns, tables[3], "", -1, "bshd", d,
                                       False, False, "table", [], False, False, backend)[0]

    dq, dpos = placed(q, mesh, [Shard(2)]), placed(pos, mesh, [Replicate()])
    eager = op(dq, dpos, *tables[:3])
    traced = torch.compile(op, backend=compiler_without_collectives("compiled op"),
                           fullgraph=True)(dq, dpos, *tables[:3])
    assert tuple(traced.placements) == (Shard(2),), traced.placements
    assert_same(traced.to_local(), eager.to_local(), "compiled op")


# ---------------------------------------------------------------------------------------------
# Context parallelism on plain tensors: each rank's shard and positions.


def check_context_parallel(c: Ctx):
    """A CP rank's shard rotated by rope_ops.apply with cp_positions equals that shard of the
    single-process result, and so do its gradients: contiguous and zigzag, one sequence and
    varlen packs."""
    import rope_ops
    import rope_ops.distributed as rd

    n, r = c.world, c.rank
    h, hk, d = 4, 2, 8
    failures = Failures()
    for backend in c.rope_backends:
        kw = dict(base=BASE, backend=backend)
        cases = []
        for split in rd.SPLITS:
            s = 4 * n if split == "zigzag" else 4 * n + 3
            cases.append((f"{split} bshd", split, "bshd", (2, s, h, d), (2, s, hk, d), 1, None, s, 0))
            cases.append((f"{split} sbhd, start 1000", split, "sbhd", (s, 2, h, d), (s, 2, hk, d), 0, None,
                          s, 1000))
        zig_docs = [0, 4 * n, 6 * n, 6 * n, 12 * n]  # lengths 4n, 2n, 0, 6n
        any_docs = [0, 5, 5, 6 * n + 1, 8 * n + 3]
        cases.append(("zigzag varlen thd", "zigzag", "thd", (zig_docs[-1], h, d), (zig_docs[-1], hk, d),
                      0, zig_docs, None, 0))
        cases.append(("contiguous varlen thd", "contiguous", "thd", (any_docs[-1], h, d),
                      (any_docs[-1], hk, d), 0, any_docs, None, [3, 0, 7, 2]))
        for m, (name, split, layout, q_shape, k_shape, dim, cu, seq_len, start) in enumerate(cases):
            what = f"CP {name} [{backend}]"
            dtype = torch.bfloat16 if m % 2 else torch.float32
            q, k = c.randn(*q_shape, dtype=dtype, seed=20 + m), c.randn(*k_shape, dtype=dtype, seed=40 + m)
            grad_q = c.randn(*q_shape, dtype=dtype, seed=60 + m)
            grad_k = c.randn(*k_shape, dtype=dtype, seed=80 + m)
            if cu is None:
                full_pos = start + torch.arange(seq_len, device=c.device)
            elif isinstance(start, int):
                full_pos = start + rope_ops.positions_from_seqlens(cu_seqlens=cu, device=c.device)
            else:
                full_pos = rope_ops.positions_from_seqlens(cu_seqlens=cu, start=start, device=c.device)
            q1, k1 = q.clone().requires_grad_(), k.clone().requires_grad_()
            ref_q, ref_k = rope_ops.apply(q1, k1, full_pos, layout=layout, **kw)
            torch.autograd.backward([ref_q, ref_k], [grad_q, grad_k])
            if m == 0:
                assert_matches_reference(ref_q.detach(), q, full_pos, layout=layout, rotary_dim=d,
                                         style="neox", what=f"{what}: q")

            cp = dict(cp_size=n, cp_rank=r, split=split, cu_seqlens=cu)
            local_pos = rd.cp_positions(seq_len, start=start, device=c.device, **cp)
            assert_same(local_pos, rd.cp_shard(full_pos, 0, **cp), f"{what}: positions")
            lq = rd.cp_shard(q, dim, **cp).clone().requires_grad_()
            lk = rd.cp_shard(k, dim, **cp).clone().requires_grad_()
            out_q, out_k = rope_ops.apply(lq, lk, local_pos, layout=layout, **kw)
            torch.autograd.backward([out_q, out_k], [rd.cp_shard(grad_q, dim, **cp),
                                                     rd.cp_shard(grad_k, dim, **cp)])

            def same(got, want, x, what):
                assert_same_rotation(got, rd.cp_shard(want, dim, **cp), rd.cp_shard(x, dim, **cp),
                                     rotary_dim=d, style="neox", what=what)

            with failures.case():
                same(out_q.detach(), ref_q.detach(), q, f"{what}: q_out")
                same(out_k.detach(), ref_k.detach(), k, f"{what}: k_out")
                same(lq.grad, q1.grad, grad_q, f"{what}: grad q")
                same(lk.grad, k1.grad, grad_k, f"{what}: grad k")
    failures.raise_any()


def check_context_parallel_dtensor(c: Ctx):
    """The contiguous CP split is DTensor's Shard along the sequence: a sequence-sharded DTensor
    rotated by rope_ops.distributed.apply holds what a CP rank computes from cp_positions."""
    import rope_ops
    import rope_ops.distributed as rd
    from torch.distributed.tensor import Shard

    mesh = c.meshes["1d"]
    s = 3 * c.world + 2
    q = c.randn(2, s, 4, 8, seed=11)
    for backend in c.rope_backends:
        out_q, _ = rd.apply(placed(q, mesh, [Shard(1)]), None, 50, base=BASE, backend=backend)
        cp = dict(cp_size=c.world, cp_rank=c.rank, split="contiguous")
        local_q, _ = rope_ops.apply(rd.cp_shard(q, 1, **cp), None,
                                    rd.cp_positions(s, start=50, device=c.device, **cp), base=BASE,
                                    backend=backend)
        assert_same(out_q.to_local(), local_q, f"sequence-sharded DTensor vs contiguous CP [{backend}]")


# ---------------------------------------------------------------------------------------------
# The fused prologue on DTensors.


def check_prologue(c: Ctx):
    """rope_ops.distributed.qkv_prologue on a token-sharded qkv: q, k, v and qkv's gradient bit
    for bit, the norm weights' gradients Partial (summed where used) and close; the prologue's
    ops on DTensors too; head-packed sharding refused."""
    import rope_ops
    import rope_ops.distributed as rd
    from rope_ops import RopeError, registry
    from torch.distributed.tensor import Partial, Replicate, Shard

    mesh = c.meshes["1d"]
    hq, hk, d = 4, 2, 8
    width = (hq + 2 * hk) * d
    backends = [b for b in c.rope_backends if registry.get(b).supports_prologue]
    if not backends:
        return f"no backend of {c.rope_backends} supports the prologue"
    for backend in backends:
        for layout, shape, placement, pos_pl in (("bshd", (2, 2 * c.world + 1, width), Shard(1), Shard(1)),
                                                 ("thd", (3 * c.world, width), Shard(0), Replicate())):
            what = f"prologue {layout} {placement} [{backend}]"
            qkv = c.randn(*shape, seed=30)
            weights = [1.0 + 0.1 * c.randn(d, seed=31), 1.0 + 0.1 * c.randn(d, seed=32)]
            token_shape = shape[:-1]
            pos = c.positions(*token_shape, seed=30)
            grads = [c.randn(*token_shape, heads, d, seed=33 + i) for i, heads in enumerate((hq, hk, hk))]
            kw = dict(num_q_heads=hq, num_kv_heads=hk, head_dim=d, base=BASE, backend=backend)

            x = qkv.clone().requires_grad_()
            w = [t.clone().requires_grad_() for t in weights]
            ref = rope_ops.qkv_prologue(x, pos, q_norm=w[0], k_norm=w[1], **kw)
            torch.autograd.backward(list(ref), grads)

            dx = placed(qkv, mesh, [placement]).requires_grad_()
            dw = [placed(t, mesh, [Replicate()]).requires_grad_() for t in weights]
            with no_communication(what):
                outs = rd.qkv_prologue(dx, placed(pos, mesh, [pos_pl]), q_norm=dw[0], k_norm=dw[1], **kw)
                torch.autograd.backward(list(outs), [placed(g, mesh, [placement]) for g in grads])
            for name, out, want in zip("qkv", outs, ref):
                assert tuple(out.placements) == (placement,), f"{what}: {name} placed {out.placements}"
                assert_same(out.to_local(), expected_local(want.detach(), out, c.rank), f"{what}: {name}")
            assert_same(dx.grad.to_local(), expected_local(x.grad, dx, c.rank), f"{what}: grad qkv")
            for name, got, want in (("q_norm", dw[0].grad, w[0].grad), ("k_norm", dw[1].grad, w[1].grad)):
                assert isinstance(got.placements[0], Partial), f"{what}: grad {name} placed {got.placements}"
                total = summed(got)  # the sum over ranks: communication, on purpose
                torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5, msg=f"{what}: grad {name}")

        head_split = placed(c.randn(2, 2 * c.world, width, seed=35), mesh, [Shard(2)])
        try:
            rd.qkv_prologue(head_split, 0, num_q_heads=hq, num_kv_heads=hk, head_dim=d, backend=backend)
        except RopeError as e:
            assert "qkv" in str(e) and "last dim" in str(e), e
        else:
            raise AssertionError("a qkv sharded along its packed heads dim was not refused")


def check_prologue_ops(c: Ctx):
    """The prologue's ops (forward, in place, backward) on DTensors through their sharding rules."""
    import rope_ops.distributed  # noqa: F401  (registers the ops' sharding rules)
    from rope_ops import registry
    from rope_ops.prologue import _prepare
    from torch.distributed.tensor import Partial, Replicate, Shard

    if not registry.get("torch").supports_prologue:
        return "the torch backend has no prologue"
    mesh = c.meshes["1d"]
    hq, hk, d = 4, 2, 8
    b, s = 2, 2 * c.world + 1
    qkv = c.randn(b, s, (hq + 2 * hk) * d, seed=50)
    pos = c.positions(b, s, seed=50)
    weights = [1.0 + 0.1 * c.randn(d, seed=51), 1.0 + 0.1 * c.randn(d, seed=52)]
    grads = [c.randn(b, s, heads, d, seed=53 + i) for i, heads in enumerate((hq, hk, hk))]
    rot = dict(rotary_dim=None, style=None, base=BASE, scaling=None, rope=None, cos_sin=None,
               max_position=None, seq_len=None, mrope_section=None, mrope_interleaved=False)
    _, args, spec = _prepare(qkv, pos, hq, hk, d, weights[0], weights[1], 1e-6, 0.0, True, False, None,
                             None, None, None, "torch", rot)
    rest = (args.pos_offset, args.cos, args.sin, args.freq_turns, args.attention_factor, "", -1,
            args.angles, [], False, args.layout, hq, hk, d, args.rotary_dim, args.interleaved, True)

    def replicated(t):
        return placed(t, mesh, [Replicate()])

    def op_args(x, p, wq, wk, *, dist):
        tables = [replicated(t) if dist else t for t in rest[1:4]]
        return (x, p, rest[0], *tables, *rest[4:], wq, wk, 1e-6, 0.0)

    cache_none = (None, None, None, 1.0, 1.0, 0.0, False, "torch")
    ref = torch.ops.rope_ops.qkv_prologue(*op_args(qkv, pos, *weights, dist=False), *cache_none)
    dx, dpos = placed(qkv, mesh, [Shard(1)]), replicated(pos)
    dws = [replicated(t) for t in weights]
    with no_communication("prologue op"):
        outs = torch.ops.rope_ops.qkv_prologue(*op_args(dx, dpos, *dws, dist=True), *cache_none)
    for name, out, want in zip("qkv", outs, ref):
        assert tuple(out.placements) == (Shard(1),), f"prologue op {name}: {out.placements}"
        assert_same(out.to_local(), expected_local(want, out, c.rank), f"prologue op: {name}")

    back_args = op_args(qkv, pos, *weights, dist=False)
    ref_back = torch.ops.rope_ops.qkv_prologue_backward(back_args[0], *grads, *back_args[1:], "torch")
    d_back = op_args(dx, dpos, *dws, dist=True)
    with no_communication("prologue backward op"):
        got = torch.ops.rope_ops.qkv_prologue_backward(
            d_back[0], *(placed(g, mesh, [Shard(1)]) for g in grads), *d_back[1:], "torch")
    assert_same(got[0].to_local(), expected_local(ref_back[0], got[0], c.rank), "prologue backward op: qkv")
    for i in (1, 2):
        assert isinstance(got[i].placements[0], Partial), f"weight grad {i} placed {got[i].placements}"
        torch.testing.assert_close(summed(got[i]), ref_back[i], rtol=1e-5, atol=1e-5)

    inplace = qkv.clone()
    torch.ops.rope_ops.qkv_prologue_(*op_args(inplace, pos, *weights, dist=False), *cache_none)
    d_inplace = placed(qkv.clone(), mesh, [Shard(1)])
    with no_communication("prologue in-place op"):
        torch.ops.rope_ops.qkv_prologue_(*op_args(d_inplace, dpos, *dws, dist=True), *cache_none)
    assert_same(d_inplace.to_local(), expected_local(inplace, d_inplace, c.rank), "prologue in-place op")


def proposed_hook(original):
    """rope_ops._api._apply with the routing proposed for rope_ops itself (docs/distributed.md):
    DTensor q or k go to rope_ops.distributed.apply_dtensor."""

    def _apply(q, k, pos, kw, inverse=False, mode="run"):
        if type(q) is not torch.Tensor or (k is not None and type(k) is not torch.Tensor):
            from rope_ops import distributed

            if distributed.is_dtensor(q) or distributed.is_dtensor(k):
                return distributed.apply_dtensor(q, k, pos, kw, inverse, mode)
        return original(q, k, pos, kw, inverse, mode)

    return _apply


def _routes_dtensors(c: Ctx) -> bool:
    import rope_ops
    from torch.distributed.tensor import Replicate

    probe = placed(torch.zeros(1, 2, 1, 2, device=c.device), c.meshes["1d"], [Replicate()])
    try:
        out, _ = rope_ops.apply(probe, None, 0, backend="torch")
    except RuntimeError as e:
        if "mixed torch.Tensor and DTensor" in str(e):
            return False
        raise
    return type(out) is type(probe)


def check_public_apply(c: Ctx):
    """rope_ops.apply, apply_grad and select_backend themselves on DTensors (eager and compiled),
    once rope_ops routes DTensors to rope_ops.distributed; until then, with the proposed routing
    patched in."""
    import rope_ops
    import rope_ops.distributed as rd
    from rope_ops import _api
    from torch.distributed.tensor import Shard

    routed = _routes_dtensors(c)
    original = _api._apply
    if not routed:
        _api._apply = proposed_hook(original)
    try:
        mesh = c.meshes["1d"]
        backend = c.rope_backends[0]
        q, grad = c.randn(2, 2 * c.world + 1, 4, 8, seed=12), c.randn(2, 2 * c.world + 1, 4, 8, seed=13)
        pos = c.positions(2, 2 * c.world + 1, seed=12)
        kw = dict(base=BASE, backend=backend)
        dq = placed(q, mesh, [Shard(1)])
        assert rope_ops.select_backend(dq, None, pos, **kw) == backend
        want_q, _ = rd.apply(dq, None, pos, **kw)
        want_grad, _ = rd.apply_grad(placed(grad, mesh, [Shard(1)]), None, pos, **kw)

        def step(x, pos):
            return rope_ops.apply(x, None, pos, **kw)[0]

        compiled = torch.compile(step, backend=compiler_without_collectives("compiled rope_ops.apply"),
                                 fullgraph=True)
        for fn, how in ((step, "eager"), (compiled, "compiled")):
            leaf = dq.detach().requires_grad_()
            watch = no_communication if fn is step else (lambda what: contextlib.nullcontext())
            with watch(f"rope_ops.apply on a DTensor, {how}"):
                out = fn(leaf, pos)
                out.backward(placed(grad, mesh, [Shard(1)]))
            assert tuple(out.placements) == (Shard(1),), out.placements
            assert_same(out.to_local(), want_q.to_local(), f"rope_ops.apply on a DTensor, {how}")
            assert_same(leaf.grad.to_local(), want_grad.to_local(), f"its gradient, {how}")
        back, _ = rope_ops.apply_grad(placed(grad, mesh, [Shard(1)]), None, pos, **kw)
        assert_same(back.to_local(), want_grad.to_local(), "rope_ops.apply_grad on a DTensor")
    finally:
        _api._apply = original
    if not routed:
        return ("rope_ops.apply does not route DTensors to rope_ops.distributed yet; passed with the "
                "proposed routing patched in")
    return None


def check_hang(c: Ctx):
    """Never returns: run_group's deadline must kill the group (not in checks_for)."""
    while True:
        time.sleep(1)


CHECKS = {
    "rotation": check_rotation,
    "angle_sources": check_angle_sources,
    "in_place": check_in_place,
    "refusals": check_refusals,
    "ops": check_ops,
    "compile": check_compile,
    "context_parallel": check_context_parallel,
    "context_parallel_dtensor": check_context_parallel_dtensor,
    "prologue": check_prologue,
    "prologue_ops": check_prologue_ops,
    "public_apply": check_public_apply,
    "hang": check_hang,
}


def checks_for(world_size: int) -> list[str]:
    """Everything on 2 ranks; on 4, what the mesh size changes (not compile: its cost is per
    rank, its behaviour is not)."""
    names = [name for name in CHECKS if name != "hang"]
    if world_size != 2:
        names.remove("compile")
    return names


# ---------------------------------------------------------------------------------------------
# Command line: the same groups on any machine.


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dist-backend", default="gloo", help="gloo or nccl")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (rank r on GPU r %% count)")
    parser.add_argument("--rope-backend", default="torch", help="comma list of rope_ops backends")
    parser.add_argument("--checks", default=None, help="comma list of " + ", ".join(CHECKS))
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT)
    args = parser.parse_args(argv)
    failed, summary = False, []
    for world in args.world_size:
        start = time.monotonic()
        checks = args.checks.split(",") if args.checks else None
        results, seconds = run_group(world, rope_backends=args.rope_backend.split(","),
                                     device=args.device, dist_backend=args.dist_backend,
                                     checks=checks, timeout=args.timeout)
        summary.append(f"{world} ranks ({args.dist_backend}, {args.device}, rope backends "
                       f"{args.rope_backend}): {time.monotonic() - start:.1f} s")
        for name, per_rank in results.items():
            states = "/".join(sorted(set(v.split(":")[0] for v in per_rank.values())))
            summary.append(f"  {name}: {states} ({seconds.get(name, 0.0):.1f} s)")
            for rank, outcome in sorted(per_rank.items()):  # the details first, the summary last
                if outcome.startswith("fail") or (outcome.startswith("skip") and rank == 0):
                    print(f"--- {world} ranks, {name}, rank {rank}: {outcome}")
            failed |= any(v.startswith("fail") for v in per_rank.values())
    print("\n".join(summary))
    print("FAILED" if failed else "PASSED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
