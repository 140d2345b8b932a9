"""Memory held by rope_ops is bounded in bytes, keyed only by what changes results, and never
keeps what a caller discarded alive."""

import gc
import weakref

import torch

import rope_ops
from rope_ops import _plans
from rope_ops._tables import CACHE, MAX_ENTRIES, TableCache
from rope_ops.frequencies import Frequencies, compute_inv_freq

DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}


def test_distinct_seq_len_under_default_type_builds_nothing_new():
    q = torch.randn(1, 4, 2, 64)
    rope_ops.apply(q, None, 0, base=4321.0)
    entries, held = len(CACHE), CACHE.bytes_held()
    for n in range(1, 500):
        rope_ops.apply(q, None, 0, base=4321.0, seq_len=n, max_position=8192)
    assert len(CACHE) <= entries + 1  # max_position=8192 is one more table, shared by all n
    assert CACHE.bytes_held() <= held + 8192 * 64 * 4 + 4096


def test_dynamic_ntk_per_decode_step_builds_no_table_per_step():
    """Each stretched length has its own frequencies; they get no table (rows computed on the
    fly), so a decode loop's memory stays flat, and the result is exact for every step."""
    rope = rope_ops.RotaryEmbedding(64, scaling=DYNAMIC, max_position=128)
    q = torch.randn(1, 1, 2, 64, dtype=torch.float64)
    held = CACHE.bytes_held()
    for n in range(129, 129 + 300):
        pos = torch.tensor([n - 1])
        out, _ = rope_ops.apply(q, None, pos, rope=rope, seq_len=n)
    grown = CACHE.bytes_held() - held
    assert grown < 300 * 64 * 8 + 4096, grown  # at most the per-length frequency constants
    assert len(CACHE) <= MAX_ENTRIES
    built = rope_ops.RotaryEmbedding(64, scaling=DYNAMIC, max_position=128, seq_len=n)
    from rope_ops._reference import rope_reference

    ref = rope_reference(q, pos, layout="bshd", rotary_dim=64, style="neox", inv_freq=built.inv_freq)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


def test_with_seq_len_per_step_keeps_nothing():
    rope = rope_ops.RotaryEmbedding(64, scaling=DYNAMIC, max_position=128)
    q = torch.randn(1, 1, 2, 64)
    refs = []
    for n in range(200, 260):
        step = rope.with_seq_len(n)
        step(q, None, torch.tensor([n - 1]))
        refs.append(weakref.ref(step))
        del step
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_new_rotary_embedding_per_call_is_freed():
    q = torch.randn(2, 3, 4, 32)
    refs = []
    for i in range(20):
        rope = rope_ops.RotaryEmbedding(32, base=1000.0 + i, max_position=256)
        rope_ops.apply(q, None, 0, rope=rope)
        rope_ops.apply(q, None, 0, rope=rope)  # the plan path too
        refs.append((weakref.ref(rope), weakref.ref(rope.cos_table)))
        del rope
    gc.collect()
    assert all(a() is None and b() is None for a, b in refs)
    assert not any(isinstance(k, rope_ops.RotaryEmbedding) for k in _plans.FUNCTIONAL._plans)


def test_table_cache_is_bounded_in_bytes_and_drops_least_recently_used():
    cache = TableCache(budget=3 * 1024 * 16 * 4 * 2 + 10_000)
    freqs = [Frequencies(*compute_inv_freq(32, 1000.0 + i)) for i in range(6)]
    dropped = []
    cache.on_evict.append(lambda: dropped.append(1))
    first = cache.get(freqs[0], 1024, torch.device("cpu"))
    for f in freqs[1:]:
        cache.get(f, 1024, torch.device("cpu"))
        cache.get(freqs[0], 1024, torch.device("cpu"))  # keep the first one recently used
        assert cache.bytes_held() <= cache.budget
    assert len(cache) == 3 and dropped
    assert cache.get(freqs[0], 1024, torch.device("cpu")) is first


def test_functional_plans_forget_dropped_tables():
    """Plans hold tables; when the cache drops one, plans are forgotten, so they cannot keep
    a dropped table alive."""
    q = torch.randn(1, 3, 2, 32)
    rope_ops.apply(q, None, 0, base=999.0)
    assert _plans.FUNCTIONAL._plans
    table = weakref.ref(next(iter(_plans.FUNCTIONAL._plans.values()))[0])
    CACHE.clear()
    assert not _plans.FUNCTIONAL._plans
    gc.collect()
    assert table() is None


def test_caches_first_filled_under_inference_mode_serve_training():
    """What the first call caches (frequencies, tables, the empty table of a call without
    rotation) outlives it: filled under torch.inference_mode, it must still serve a training
    call, whose backward saves it, with gradients equal to a fresh process's."""
    from rope_ops._reference import rope_reference

    base = 7777.0  # a table no other test builds first
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(5, 4 * 16, generator=gen)  # float32: every CPU backend takes it
    w = torch.rand(16, generator=gen) + 0.5
    pos = torch.tensor([0, 3, 1, 7, 2])
    for backend in ("torch", "cpu"):
        CACHE.clear()
        prologue_kw = dict(num_q_heads=2, num_kv_heads=1, head_dim=16, backend=backend)
        with torch.inference_mode():
            module = rope_ops.RotaryEmbedding(16, base=base + 1.0)
            rope_ops.qkv_prologue(qkv, pos, base=base, q_norm=w, **prologue_kw)
            rope_ops.qkv_prologue(qkv, None, rotate=False, k_norm=w, **prologue_kw)
            rope_ops.apply(qkv[:, :32].view(5, 2, 16), None, pos, base=base, layout="thd", backend=backend)
        x = qkv.clone().requires_grad_(True)
        q, k, v = rope_ops.qkv_prologue(x, pos, base=base, **prologue_kw)
        (q.sum() + 2 * k.sum()).backward()
        inv_freq, _ = compute_inv_freq(16, base)
        back = rope_reference(torch.ones(5, 3, 16, dtype=torch.float64), pos, layout="thd", rotary_dim=16,
                              style="neox", inv_freq=inv_freq, inverse=True)  # q's 2 heads, k's 1
        want = torch.cat([back[:, :2].flatten(1), 2 * back[:, 2:].flatten(1), torch.zeros(5, 16,
                                                                                          dtype=torch.float64)], 1)
        torch.testing.assert_close(x.grad.double(), want, rtol=0, atol=1e-5)
        x = qkv.clone().requires_grad_(True)
        _, k, _ = rope_ops.qkv_prologue(x, None, rotate=False, k_norm=w, **prologue_kw)
        k.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
        q = qkv[:, :32].view(5, 2, 16).clone().requires_grad_(True)
        out, _ = rope_ops.apply(q, None, pos, base=base, layout="thd", backend=backend)
        out.sum().backward()
        assert q.grad is not None
        x = qkv.clone().requires_grad_(True)  # a module made under inference_mode trains too
        q, _, _ = rope_ops.qkv_prologue(x, pos, rope=module, **prologue_kw)
        q.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
