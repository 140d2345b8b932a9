"""Conformance tests under torch.compile: no graph break, static and dynamic shapes, and every
argument reaching the kernel the same way as in eager mode.

Mixed into ``RopeConformance`` (its fixtures ``backend_name``, ``backend_obj``, ``device``).
Most tests compile with the ``aot_eager`` backend: it runs Dynamo and AOTAutograd (graph capture,
functionalization of the in-place op, the autograd graph), which is where arguments get lost or
graphs break, without the C++ compile time of inductor; one test compiles with inductor.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import rope_ops

from .checks import assert_bitwise_equal, run_or_skip_refusal

_COMPILE_DEVICES = ("cpu", "cuda")


def _skip_unless_compilable(device):
    if device.type not in _COMPILE_DEVICES:
        pytest.skip(f"torch.compile is not exercised on {device.type}")


def _dtype_for(backend_obj) -> torch.dtype:
    return next(d for d in (torch.float32, torch.bfloat16, torch.float64) if d in backend_obj.dtypes)


# name -> (apply kwargs, q shape, k heads or None, position kind, apply_grad?)
_VARIANTS = {
    "neox": ({}, (2, 5, 4, 32), 2, "bs", False),
    "gptj_partial": ({"style": "gptj", "rotary_dim": 16}, (2, 5, 4, 32), 2, "bs", False),
    "q_only": ({}, (2, 5, 4, 32), None, "s", False),
    "int_offset": ({}, (2, 5, 4, 32), 2, 1000, False),
    "sbhd": ({"layout": "sbhd"}, (5, 2, 4, 32), 2, "s", False),
    "bhsd": ({"layout": "bhsd"}, (2, 4, 5, 32), 2, "bs", False),
    "thd": ({}, (7, 4, 32), 1, "t", False),
    "scaling_yarn": ({"scaling": {"rope_type": "yarn", "factor": 4.0,
                                  "original_max_position_embeddings": 16}, "max_position": 64},
                     (2, 5, 4, 32), 2, "bs", False),
    "dynamic_seq_len": ({"scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position": 16,
                         "seq_len": 100}, (2, 5, 4, 32), 2, "bs", False),
    "caller_tables": ({"cos_sin": "tables"}, (2, 5, 4, 32), 2, "bs", False),
    "caller_tables_bf16_cache": ({"cos_sin": "cache_bf16"}, (2, 5, 4, 32), 2, "bs", False),
    "per_token_tables": ({"cos_sin": "per_token"}, (2, 5, 4, 32), 2, None, False),
    "mrope": ({"mrope_section": (4, 6, 6)}, (2, 5, 4, 32), 2, "3bs", False),
    "mrope_interleaved_grad": ({"mrope_section": (4, 6, 6), "mrope_interleaved": True},
                               (2, 5, 4, 32), 2, "3bs", True),
    "out": ({"out": "buffers"}, (2, 5, 4, 32), 2, "bs", False),
    "inplace": ({"inplace": True}, (2, 5, 4, 32), 2, "bs", False),
    "grad": ({}, (2, 5, 4, 32), 2, "bs", True),
    "grad_inplace": ({"inplace": True}, (2, 5, 4, 32), 2, "bs", True),
    "grad_inplace_gptj": ({"inplace": True, "style": "gptj", "rotary_dim": 16}, (2, 5, 4, 32), 2,
                          "bs", True),
}


def _variant_inputs(name, dtype, device, seed=0):
    kwargs, shape, k_heads, pos_kind, grad = _VARIANTS[name]
    kwargs = dict(kwargs)
    gen = torch.Generator().manual_seed(seed)
    layout = kwargs.get("layout", "thd" if len(shape) == 3 else "bshd")
    heads_axis = {"bshd": 2, "sbhd": 2, "bhsd": 1, "thd": 1}[layout]
    q = torch.randn(shape, generator=gen).to(dtype).to(device)
    k = None
    if k_heads is not None:
        k_shape = list(shape)
        k_shape[heads_axis] = k_heads
        k = torch.randn(k_shape, generator=gen).to(dtype).to(device)
    batch, seq = {"bshd": (shape[0], shape[1]), "sbhd": (shape[1], shape[0]),
                  "bhsd": (shape[0], shape[2]), "thd": (1, shape[0])}[layout]
    if isinstance(pos_kind, int) or pos_kind is None:
        pos = pos_kind
    else:
        size = {"bs": (batch, seq), "s": (seq,), "t": (seq,), "3bs": (3, batch, seq)}[pos_kind]
        pos = torch.randint(0, 200, size, generator=gen).to(device)
    r = kwargs.get("rotary_dim", shape[-1])
    if kwargs.get("cos_sin") == "tables":
        angles = torch.rand(256, r // 2, generator=gen, dtype=torch.float64) * 6.3
        kwargs["cos_sin"] = (angles.cos().float().to(device), angles.sin().float().to(device))
    elif kwargs.get("cos_sin") == "cache_bf16":
        angles = torch.rand(256, r // 2, generator=gen, dtype=torch.float64) * 6.3
        kwargs["cos_sin"] = torch.cat([angles.cos(), angles.sin()], -1).to(torch.bfloat16).to(device)
    elif kwargs.get("cos_sin") == "per_token":
        angles = torch.rand(batch, seq, r // 2, generator=gen, dtype=torch.float64) * 6.3
        kwargs["cos_sin"] = (angles.cos().float().to(device), angles.sin().float().to(device))
    return q, k, pos, kwargs, grad


class CompileTests:
    """torch.compile, held to every backend."""

    def test_compile_fullgraph(self, backend_name, backend_obj, device):
        """Inductor, static shapes, forward and backward: equal to eager, no graph break, no
        recompile on a second call of the same shapes."""
        _skip_unless_compilable(device)
        rope = rope_ops.RotaryEmbedding(64, max_position=32)

        def step(q, k, pos):
            q_out, k_out = rope_ops.apply(q, k, pos, rope=rope, backend=backend_name)
            return (q_out * 2).sum() + k_out.sum()

        compiled = torch.compile(step, fullgraph=True, dynamic=False)
        gen = torch.Generator().manual_seed(6)
        dtype = _dtype_for(backend_obj)
        for trial in range(2):
            q = torch.randn(2, 8, 4, 64, generator=gen).to(dtype).to(device).requires_grad_(True)
            k = torch.randn(2, 8, 2, 64, generator=gen).to(dtype).to(device).requires_grad_(True)
            pos = torch.randint(0, 100, (2, 8), generator=gen).to(device)
            with torch._dynamo.config.patch(error_on_recompile=trial == 1), warnings.catch_warnings():
                # torch deprecates custom ops whose returns alias inputs or each other (an error
                # in future torch): fail on the warning now.
                warnings.filterwarnings("error", message=r".*may not alias any inputs")
                loss = compiled(q, k, pos)
            loss.backward()
            grads = q.grad.clone(), k.grad.clone()
            q.grad = k.grad = None
            eager = step(q, k, pos)
            eager.backward()
            torch.testing.assert_close(loss, eager, rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(grads[0], q.grad)
            torch.testing.assert_close(grads[1], k.grad)
        torch._dynamo.reset()

    @pytest.mark.parametrize("variant", list(_VARIANTS))
    def test_compile_every_argument_matches_eager(self, backend_name, backend_obj, device, variant):
        """Each argument reaches the kernel the same way compiled as eager (in place, inverse,
        caller tables, scaling, seq_len, layouts, offsets, q only), bit for bit, with no graph
        break; a second compile for new shapes has none either."""
        _skip_unless_compilable(device)
        dtype = _dtype_for(backend_obj)
        q, k, pos, kwargs, grad = _variant_inputs(variant, dtype, device)
        if kwargs.get("inplace") and not backend_obj.supports_inplace:
            pytest.skip("backend has no in place")
        if grad and not backend_obj.supports_backward:
            pytest.skip("backend has no backward")
        fn = rope_ops.apply_grad if grad else rope_ops.apply
        with_out = kwargs.pop("out", None) is not None

        def call(q, k, pos, q_out=None, k_out=None):
            extra = {"out": (q_out, k_out)} if with_out else {}
            return fn(q, k, pos, backend=backend_name, **kwargs, **extra)

        compiled = torch.compile(call, fullgraph=True, backend="aot_eager", dynamic=False)
        for seed in (1, 2):  # the second round has other shapes: a recompile, still one graph
            if seed == 2:
                q = torch.cat([q, q], dim=0)
                k = None if k is None else torch.cat([k, k], dim=0)
                if kwargs.get("mrope_section") is not None:
                    pos = torch.cat([pos, pos], dim=1)
                elif isinstance(pos, torch.Tensor) and pos.dim() == 2 and kwargs.get("layout") != "sbhd":
                    pos = torch.cat([pos, pos], dim=0)
                elif isinstance(pos, torch.Tensor) and (kwargs.get("layout") == "sbhd" or q.dim() == 3):
                    pos = torch.cat([pos, pos], dim=0)
                if isinstance(kwargs.get("cos_sin"), tuple) and kwargs["cos_sin"][0].dim() == 3:
                    kwargs["cos_sin"] = tuple(torch.cat([t, t], dim=0) for t in kwargs["cos_sin"])
            eager_q, eager_k = q.clone(), None if k is None else k.clone()
            compiled_q, compiled_k = q.clone(), None if k is None else k.clone()
            outs = [(torch.empty_like(q), None if k is None else torch.empty_like(k))
                    if with_out else (None, None) for _ in range(2)]
            want = run_or_skip_refusal(call, eager_q, eager_k, pos, *outs[0])
            got = compiled(compiled_q, compiled_k, pos, *outs[1])
            assert_bitwise_equal(got[0], want[0], f"{variant}: q compiled vs eager")
            if k is not None:
                assert_bitwise_equal(got[1], want[1], f"{variant}: k compiled vs eager")
            if kwargs.get("inplace"):
                assert_bitwise_equal(compiled_q, eager_q, f"{variant}: q written in place")
            if with_out:
                assert got[0] is outs[1][0], f"{variant}: compiled out= did not return the out tensor"
        torch._dynamo.reset()

    @pytest.mark.parametrize("mode", ["dynamic", "automatic", "mark_dynamic"])
    def test_compile_with_dynamic_shapes(self, backend_name, backend_obj, device, mode):
        """Token count, batch and head count varying under dynamic=True, automatic dynamic
        shapes, and mark_dynamic: no error, no graph break, results equal to eager; with
        mark_dynamic on every varying dim, no recompile."""
        _skip_unless_compilable(device)
        dtype = _dtype_for(backend_obj)
        rope = rope_ops.RotaryEmbedding(32, max_position=64)

        def step(q, k, pos):
            q_out, k_out = rope_ops.apply(q, k, pos, rope=rope, backend=backend_name)
            functional, _ = rope_ops.apply(q, None, pos, base=500.0, backend=backend_name)
            return q_out, k_out, functional

        dynamic = {"dynamic": True, "automatic": None, "mark_dynamic": False}[mode]
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=dynamic)
        gen = torch.Generator().manual_seed(8)
        # (B, S, Hq, Hk); sizes 0 and 1 are always specialized by Dynamo (a recompile), so the
        # no-recompile check of mark_dynamic keeps its marked sizes >= 2
        if mode == "mark_dynamic":
            shapes = [(2, 5, 4, 2), (3, 9, 4, 2), (4, 17, 6, 3), (2, 6, 8, 4)]
        else:
            shapes = [(2, 5, 4, 2), (3, 9, 4, 2), (1, 17, 6, 3), (2, 6, 8, 1), (2, 1, 4, 2)]
        for i, (b, s, hq, hk) in enumerate(shapes):
            q = torch.randn(b, s, hq, 32, generator=gen).to(dtype).to(device)
            k = torch.randn(b, s, hk, 32, generator=gen).to(dtype).to(device)
            pos = torch.randint(0, 100, (b, s), generator=gen).to(device)
            if mode == "mark_dynamic":
                for t in (q, k):
                    for dim in (0, 1, 2):
                        torch._dynamo.mark_dynamic(t, dim)
                torch._dynamo.mark_dynamic(pos, 0)
                torch._dynamo.mark_dynamic(pos, 1)
            with torch._dynamo.config.patch(error_on_recompile=mode == "mark_dynamic" and i > 0):
                got = compiled(q, k, pos)
            want = step(q, k, pos)
            for g, w, what in zip(got, want, ("q", "k", "functional q")):
                assert_bitwise_equal(g, w, f"{mode} shapes {(b, s, hq, hk)}: {what}")
        torch._dynamo.reset()

    def test_compiled_graph_holds_its_tables(self, backend_name, backend_obj, device):
        """A compiled function keeps working after rope_ops' table cache is emptied and its
        RotaryEmbedding is only reachable through the function (no registry looked up by key)."""
        _skip_unless_compilable(device)
        from rope_ops._tables import CACHE

        dtype = _dtype_for(backend_obj)

        def make():
            rope = rope_ops.RotaryEmbedding(32, max_position=64, base=777.0)
            return lambda q, pos: rope_ops.apply(q, None, pos, rope=rope, backend=backend_name)[0]

        fn = make()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        functional = torch.compile(
            lambda q, pos: rope_ops.apply(q, None, pos, base=321.0, backend=backend_name)[0],
            fullgraph=True, backend="aot_eager")
        q = torch.randn(2, 5, 4, 32).to(dtype).to(device)
        pos = torch.arange(5, device=device)
        first, first_functional = compiled(q, pos), functional(q, pos)
        CACHE.clear()
        import gc
        gc.collect()
        assert_bitwise_equal(compiled(q, pos), first, "after the cache was emptied")
        assert_bitwise_equal(functional(q, pos), first_functional, "functional, cache emptied")
        torch._dynamo.reset()

    def test_compile_without_a_backend_argument(self, backend_name, backend_obj, device):
        """The backend request from use_backend / ROPE_OPS_BACKEND (no backend=) is read when
        the graph is made: full graph, same result as eager."""
        _skip_unless_compilable(device)
        dtype = _dtype_for(backend_obj)
        q = torch.randn(2, 5, 4, 32).to(dtype).to(device)
        pos = torch.arange(5, device=device)

        def call(q, pos):
            return rope_ops.apply(q, None, pos, base=1e4)[0]

        with rope_ops.use_backend(backend_name):
            got = torch.compile(call, fullgraph=True, backend="aot_eager")(q, pos)
            want = call(q, pos)
        assert_bitwise_equal(got, want, "compiled without backend=")
        torch._dynamo.reset()

    def test_op_outputs_have_their_own_storage(self, backend_name, backend_obj, device):
        """torch.ops.rope_ops.rope (what traced code calls) returns q_out and k_out that share
        no storage with each other or the inputs, even where the backend's eager path pairs
        small outputs in one allocation."""
        rope = rope_ops.RotaryEmbedding(64, max_position=32)
        dtype = next(d for d in (torch.bfloat16, torch.float32, torch.float64) if d in backend_obj.dtypes)
        q = torch.randn(2, 8, 4, 64, device=device, dtype=dtype)
        k = torch.randn(2, 8, 2, 64, device=device, dtype=dtype)
        pos = torch.randint(0, 32, (2, 8), device=device)
        cos, sin, turns, factor = rope.tables(q.device)
        q_out, k_out = torch.ops.rope_ops.rope(q, k, pos, 0, cos, sin, turns, factor, "", -1, "bshd",
                                               64, False, False, "table", [], False, False,
                                               backend_name)
        storages = [t.untyped_storage().data_ptr() for t in (q, k, q_out, k_out)]
        assert len(set(storages)) == 4, storages
        expected_q, expected_k = rope_ops.apply(q, k, pos, rope=rope, backend=backend_name)
        assert_bitwise_equal(q_out, expected_q, "q_out of the op")
        assert_bitwise_equal(k_out, expected_k, "k_out of the op")
