"""rope_ops.apply's guard path: a repeat of the last call kind made with the same keyword
arguments runs through the backend's guard.

The CUDA backend's guard is C++ (GuardedRope in csrc/rope_binding.cpp) and runs only on a GPU;
here a backend with a Python guard that keeps the same contract (Backend.bind) drives the core's
side of it, through the conformance suite's repeated-calls test, and a guard that forgets one
check shows that test fails when a guard lets a changed call through.
"""

import pytest
import torch

import rope_ops
from rope_ops import RopeError, _plans, _select, registry
from rope_ops._ops import run_backend
from rope_ops.backend import KernelArgs
from rope_ops._reference import rope_reference
from rope_ops.testing import RopeConformance
from rope_ops_backends.torch_backend import TorchBackend


class PythonGuard:
    """Backend.bind's guard contract in Python: run only calls with the guarded call's metadata."""

    def __init__(self, bound, q, k, pos, ignore=None):
        self.bound, self.ignore = bound, ignore  # ignore: a check left out (a faulty guard)
        self.expected = self.metadata(q, k, pos)
        self.hits = self.misses = 0

    def metadata(self, q, k, pos):
        def of(t, strides):
            if t is None:
                return None
            return (t.shape if self.ignore != "shape" else None, t.stride() if strides else None,
                    t.dtype if self.ignore != "dtype" else None, t.device)
        return of(q, True), of(k, True), int if type(pos) is int else of(pos, False)

    def __call__(self, q, k, pos):
        plain = type(q) is torch.Tensor and (k is None or type(k) is torch.Tensor) and (
            type(pos) is torch.Tensor or (type(pos) is int and -(2**62) < pos < 2**62))
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))
        needs_grad = needs_grad and self.ignore != "grad"
        if not plain or needs_grad or self.metadata(q, k, pos) != self.expected:
            self.misses += 1
            return None
        self.hits += 1
        return self.bound(q, k, None, pos) if type(pos) is int else self.bound(q, k, pos, 0)


class Bound:
    def __init__(self, launch, guards, ignore):
        self.launch, self.guards, self.ignore = launch, guards, ignore

    def __call__(self, q, k, pos, pos_offset):
        return self.launch(q, k, pos, pos_offset)

    def guarded(self, q, k, pos):
        guard = PythonGuard(self, q, k, pos, self.ignore)
        self.guards.append(guard)
        return guard


class Guarding(TorchBackend):
    """The torch backend with bound launchers that have a guard (ignore: a check it leaves out)."""

    name = "cuda"  # a built-in name: built-ins are trusted without the first-call output check

    def __init__(self, ignore=None):
        self.ignore = ignore
        self.guards: list[PythonGuard] = []

    def bind(self, cos, sin, freq_turns, attention_factor, layout, rotary_dim, interleaved, inverse):
        @torch.no_grad()  # like a real kernel: autograd only sees it through rope_ops' function
        def launch(q, k, pos, pos_offset):
            return run_backend(self, KernelArgs(q, k, None, None, pos, pos_offset, cos, sin,
                                                freq_turns, attention_factor, layout, rotary_dim,
                                                interleaved, inverse, False))
        return Bound(launch, self.guards, self.ignore)


def run_repeats(backend) -> int:
    """The conformance suite's repeated-calls test on ``backend``; returns how many inference
    plans it made."""
    made = []
    original = _plans.remember_plan

    def remember(holder, key, entry):
        made.append(key)
        original(holder, key, entry)

    _plans.remember_plan = remember
    try:
        with registry.override({"cuda": backend, "torch": TorchBackend()}):
            RopeConformance().test_repeats_follow_each_call("cuda", backend, torch.device("cpu"))
    finally:
        _plans.remember_plan = original
    return sum(1 for key in made if not key[-1])


def test_repeats_run_through_the_guard_and_changes_miss_it():
    backend = Guarding()
    inference_plans = run_repeats(backend)
    hits = sum(g.hits for g in backend.guards)
    misses = sum(g.misses for g in backend.guards)
    assert hits >= 5 and misses >= 10, (hits, misses)
    # one guard per inference plan, made with the plan (not per call)
    assert len(backend.guards) == inference_plans >= 8, (len(backend.guards), inference_plans)


@pytest.mark.parametrize("ignore", ["shape", "dtype", "grad"])
def test_a_guard_that_leaves_out_a_check_fails_the_repeats_test(ignore):
    # pytest.fail's exception (a failed pytest.raises) is a BaseException
    with pytest.raises(BaseException) as failure:
        run_repeats(Guarding(ignore=ignore))
    assert not isinstance(failure.value, (pytest.skip.Exception, KeyboardInterrupt)), failure.value


def test_guards_are_forgotten_with_the_cache():
    backend = Guarding()
    with registry.override({"cuda": backend, "torch": TorchBackend()}):
        q = torch.randn(1, 3, 2, 8)
        rope_ops.apply(q, q.clone(), 0, backend="cuda")
        assert _plans.FUNCTIONAL._guards
        _select.clear_cache()
        assert not _plans.FUNCTIONAL._guards and not _plans.FUNCTIONAL._plans


def test_alternating_frequencies_each_keep_their_guard():
    """Layers that alternate two RotaryEmbeddings (local and global RoPE, as in Gemma) each repeat
    through their own guard, with each one's own frequencies."""
    backend = Guarding()
    local = rope_ops.RotaryEmbedding(16, base=10000.0, max_position=64)
    wide = rope_ops.RotaryEmbedding(16, base=1000000.0, max_position=64)
    gen = torch.Generator().manual_seed(5)
    pos = torch.randint(0, 64, (2, 3), generator=gen)
    with registry.override({"cuda": backend, "torch": TorchBackend()}):
        for step in range(4):
            for rope in (local, wide):
                q = torch.randn(2, 3, 4, 16, generator=gen)
                out, _ = rope_ops.apply(q, None, pos, rope=rope, backend="cuda")
                ref = rope_reference(q, pos, layout="bshd", rotary_dim=16, style="neox",
                                     inv_freq=rope.inv_freq)
                torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
        assert len(backend.guards) == 2
        assert all(g.hits == 3 and g.misses == 0 for g in backend.guards), \
            [(g.hits, g.misses) for g in backend.guards]


def test_autograd_plans_get_no_guard():
    backend = Guarding()
    with registry.override({"cuda": backend, "torch": TorchBackend()}):
        q = torch.randn(1, 3, 2, 8, requires_grad=True)
        for _ in range(3):
            out, _ = rope_ops.apply(q, None, 0, backend="cuda")
            assert out.grad_fn is not None
        assert backend.guards == [] and not _plans.FUNCTIONAL._guards


# ---------------------------------------------------------------------------------------------
# Per-token tables: repeats skip the full path, keyed by the tensors' metadata.


def _hf_tables(batch, seq, half, style="neox", dtype=torch.float32, gen=None):
    """(cos, sin) in Hugging Face's duplicated [B, S, 2 * half] form and their half-width values."""
    angle = torch.rand(batch, seq, half, generator=gen, dtype=torch.float64) * 6.3
    c, s = angle.cos(), angle.sin()
    if style == "neox":
        full = torch.cat([c, c], -1), torch.cat([s, s], -1)
    else:
        full = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
    return tuple(t.to(dtype) for t in full), (c, s)


@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_per_token_repeats_skip_the_full_path(monkeypatch, style, backend):
    """Each repeat of a per-token call kind runs without the full path, reads the new call's own
    tables and rotates as the reference says; a changed kind (other shapes, strides, dtype,
    request, grad mode) goes through the full path, which validates it."""
    if backend not in registry.names() or registry.availability(registry.get(backend)):
        pytest.skip(f"backend {backend!r} unavailable here")
    from rope_ops import _api

    full_paths = []
    original = _api._apply
    monkeypatch.setattr(_api, "_apply", lambda *a, **kw: full_paths.append(kw.get("mode")) or original(*a, **kw))
    _plans.TOKEN_PLANS.clear()
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 5, 4, 16, generator=gen).transpose(1, 2)  # HF's [B, H, S, D] view
    k = torch.randn(2, 5, 2, 16, generator=gen).transpose(1, 2)
    with rope_ops.use_backend(backend):
        for step in range(4):
            (cos, sin), (c, s) = _hf_tables(2, 5, 8, style, gen=gen)
            q_out, k_out = rope_ops.apply(q, k, None, cos_sin=(cos, sin), rotary_dim=16, style=style,
                                          layout="bhsd")
            for x, out in ((q, q_out), (k, k_out)):
                ref = rope_reference(x, None, layout="bhsd", rotary_dim=16, style=style, token_cos_sin=(c, s))
                torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)
        assert full_paths == ["token_plan"]  # the first call only
        # half-width tables with stride 2 along frequencies: each repeat copies them as the full
        # path does (the kernels read frequencies contiguously)
        for step in range(3):
            _, (c, s) = _hf_tables(2, 5, 8, style, gen=gen)
            wide = [torch.stack([t, torch.full_like(t, float("nan"))], -1).flatten(-2).float() for t in (c, s)]
            q_out, _ = rope_ops.apply(q, k, None, cos_sin=(wide[0][..., ::2], wide[1][..., ::2]), rotary_dim=16,
                                      style=style, layout="bhsd")
            ref = rope_reference(q, None, layout="bhsd", rotary_dim=16, style=style, token_cos_sin=(c, s))
            torch.testing.assert_close(q_out.double(), ref, rtol=0, atol=1e-5)
        assert full_paths == ["token_plan"] * 2
        full_paths.pop()
        # a changed kind: validated by the full path (a table of the wrong length is refused)
        (bad_cos, bad_sin), _ = _hf_tables(2, 4, 8, style, gen=gen)
        with pytest.raises(RopeError, match="per-token"):
            rope_ops.apply(q, k, None, cos_sin=(bad_cos, bad_sin), rotary_dim=16, style=style, layout="bhsd")
        rope_ops.apply(q, k, None, cos_sin=tuple(t.to(torch.bfloat16) for t in (cos, sin)), rotary_dim=16,
                       style=style, layout="bhsd")
        assert full_paths[1:] == ["token_plan", "token_plan"]
    # the request is part of the kind: backend="torch" repeats use_backend("torch")'s kind only
    rope_ops.apply(q, k, None, cos_sin=(cos, sin), rotary_dim=16, style=style, layout="bhsd", backend="torch")
    assert len(full_paths) == (3 if backend == "torch" else 4)


def test_per_token_fast_path_records_gradients_and_refuses_tables_that_need_them():
    _plans.TOKEN_PLANS.clear()
    gen = torch.Generator().manual_seed(6)
    (cos, sin), (c, s) = _hf_tables(1, 3, 4, gen=gen)
    for _ in range(3):
        q = torch.randn(1, 3, 2, 8, generator=gen, requires_grad=True)
        g = torch.randn(1, 3, 2, 8, generator=gen)
        q_out, _ = rope_ops.apply(q, None, None, cos_sin=(cos, sin), backend="torch")
        (grad,) = torch.autograd.grad(q_out, q, g)
        ref = rope_reference(g, None, layout="bshd", rotary_dim=8, style="neox", token_cos_sin=(c, s),
                             inverse=True)
        torch.testing.assert_close(grad.double(), ref, rtol=0, atol=1e-5)
    needing = cos.clone().requires_grad_(True)
    for _ in range(2):  # never planned: refused every time
        with pytest.raises(RopeError, match="requires grad"):
            rope_ops.apply(q, None, None, cos_sin=(needing, sin), backend="torch")


def test_per_token_plans_are_forgotten_with_the_backends():
    """A registry change (backends overridden) bumps the plans' generation: a repeat of a
    planned kind takes the full path again and runs the backend now registered under the name."""

    class Counting(TorchBackend):
        runs = 0

        def run(self, args):
            Counting.runs += 1
            return super().run(args)

    q = torch.randn(1, 3, 2, 8)
    (cos, sin), _ = _hf_tables(1, 3, 4)
    for _ in range(2):
        rope_ops.apply(q, None, None, cos_sin=(cos, sin), backend="torch")
    with registry.override({"torch": Counting()}):
        for _ in range(2):
            rope_ops.apply(q, None, None, cos_sin=(cos, sin), backend="torch")
    assert Counting.runs == 2
