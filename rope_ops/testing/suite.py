"""The conformance suite every rope_ops backend must pass.

Use it from a test module of yours::

    from rope_ops.testing import RopeConformance

    class TestMyBackend(RopeConformance):
        backend = "mybackend"          # its entry-point name

or run it as shipped: ``pytest --pyargs rope_ops.testing --rope-backend NAME``.

Every test calls ``rope_ops.apply(..., backend=NAME)``, so the backend is reached through the real
public path (validation, selection, autograd, torch.compile registration). A case the backend
refuses is skipped with the backend's own reasons; ``test_takes_basic_calls`` makes sure a backend
cannot pass by refusing everything.
"""

from __future__ import annotations

import os

import pytest
import torch

import rope_ops
from rope_ops import BackendError, RopeError
from rope_ops import registry

from .._reference import rope_reference
from .cases import Case, Inputs, make_inputs, standard_cases
from .checks import assert_bitwise_equal, assert_rope_close, run_or_skip_refusal
from .suite_compile import CompileTests
from .suite_prologue import PrologueTests
from .suite_training import TrainingTests
from .suite_variants import VariantTests

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_CASES = standard_cases()
_DEVICE_PREFERENCE = ("cuda", "npu", "xpu", "mps", "cpu")


def _device_available(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    module = getattr(torch, device_type, None)
    try:
        return bool(module is not None and module.is_available())
    except Exception:  # a half-installed device runtime is simply not available
        return False


def _dtype_id(dtype) -> str:
    return str(dtype).replace("torch.", "")


class RopeConformance(TrainingTests, CompileTests, VariantTests, PrologueTests):
    """Subclass and set ``backend`` (or pass --rope-backend / ROPE_OPS_TEST_BACKEND)."""

    backend: str | None = None
    # test name -> reason, for tests a backend opts out of (shown as skips).
    exclusions: dict[str, str] = {}

    # -- fixtures -------------------------------------------------------------------------

    @pytest.fixture
    def backend_name(self, request) -> str:
        name = (self.backend or request.config.getoption("--rope-backend", default=None)
                or os.environ.get("ROPE_OPS_TEST_BACKEND") or "torch")
        if request.node.originalname in self.exclusions:
            pytest.skip(f"excluded by {type(self).__name__}: {self.exclusions[request.node.originalname]}")
        return name

    @pytest.fixture
    def backend_obj(self, backend_name):
        try:
            obj = registry.get(backend_name)
        except BackendError as error:
            pytest.fail(f"backend {backend_name!r} cannot be loaded: {error}")
        why = obj.availability()
        if why:
            pytest.skip(f"backend {backend_name!r} unavailable here: {'; '.join(why)}")
        return obj

    @pytest.fixture
    def device(self, backend_obj, request) -> torch.device:
        forced = request.config.getoption("--rope-device", default=None) or os.environ.get("ROPE_OPS_TEST_DEVICE")
        if forced:
            return torch.device(forced)
        types = backend_obj.device_types
        for device_type in _DEVICE_PREFERENCE:
            if ("*" in types or device_type in types) and _device_available(device_type):
                return torch.device(device_type)
        pytest.skip(f"none of the backend's devices {sorted(types)} is available here")

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _apply(backend_name, inputs: Inputs, q=None, k=None, **extra):
        kwargs = {**inputs.kwargs, **extra}
        return run_or_skip_refusal(rope_ops.apply, inputs.q if q is None else q,
                                   inputs.k if k is None else k, inputs.pos, backend=backend_name,
                                   **kwargs)

    @staticmethod
    def _expect_caller_range_error(case: Case, inputs: Inputs) -> bool:
        """Caller tables with positions outside them, known on the host: SPEC wants RopeError."""
        if not case.caller_tables:
            return False
        rows = case.table_positions
        if isinstance(inputs.pos, int):
            return inputs.pos < 0 or inputs.pos + case.seq > rows
        return inputs.pos.device.type == "cpu" and bool(((inputs.pos < 0) | (inputs.pos >= rows)).any())

    # -- forward ---------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
    @pytest.mark.parametrize("case", _CASES, ids=lambda c: c.name)
    def test_forward(self, backend_name, backend_obj, device, case: Case, dtype):
        inputs = make_inputs(case, dtype, device, seed=1)
        q_before = inputs.q.clone()
        k_before = None if inputs.k is None else inputs.k.clone()
        base_before = None if inputs.base_tensor is None else inputs.base_tensor.clone()
        if self._expect_caller_range_error(case, inputs):
            with pytest.raises(RopeError):
                self._apply(backend_name, inputs)
            assert_bitwise_equal(inputs.q, q_before, "q after a refused call")
            return
        q_out, k_out = self._apply(backend_name, inputs)
        assert (k_out is None) == (inputs.k is None)
        if case.inplace:
            assert q_out is inputs.q and (k_out is inputs.k), "in place must return the inputs"
        assert q_out.dtype == dtype and q_out.device == inputs.q.device
        assert_rope_close(q_out, inputs.reference(q_before, case), q_before,
                          rotary_dim=inputs.rotary_dim, style=case.style, what="q_out")
        if inputs.k is not None:
            assert_rope_close(k_out, inputs.reference(k_before, case), k_before,
                              rotary_dim=inputs.rotary_dim, style=case.style, what="k_out")
        if not case.inplace:
            assert_bitwise_equal(inputs.q, q_before, "q (out of place must not write its inputs)")
            if inputs.k is not None:
                assert_bitwise_equal(inputs.k, k_before, "k (out of place must not write its inputs)")
        if base_before is not None:
            # Only q's and k's heads may change; v (and everything else) is untouched.
            axis = {"bshd": 2, "sbhd": 2, "bhsd": 1, "thd": 1}[case.layout]
            start = case.q_heads + (case.k_heads or 0)
            v_now = inputs.base_tensor.narrow(axis, start, inputs.base_tensor.shape[axis] - start)
            v_before = base_before.narrow(axis, start, base_before.shape[axis] - start)
            assert_bitwise_equal(v_now, v_before, "v part of packed QKV")

    # -- backward --------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
    @pytest.mark.parametrize("case", [c for c in _CASES if not c.caller_tables or c.pos_low >= 0],
                             ids=lambda c: c.name)
    def test_backward(self, backend_name, backend_obj, device, case: Case, dtype):
        if not backend_obj.supports_backward:
            pytest.skip("backend has no backward")
        inputs = make_inputs(case, dtype, device, seed=2)
        if self._expect_caller_range_error(case, inputs):
            pytest.skip("positions outside caller tables raise (tested in test_forward)")
        leaf_q = inputs.q.detach().clone().requires_grad_(True)
        leaf_k = None if inputs.k is None else inputs.k.detach().clone().requires_grad_(True)
        # In place needs non-leaf inputs; out of place works on the leaves directly.
        q_in = leaf_q.clone() if case.inplace else leaf_q
        k_in = None if leaf_k is None else (leaf_k.clone() if case.inplace else leaf_k)
        q_out, k_out = self._apply(backend_name, inputs, q=q_in, k=k_in)
        gen = torch.Generator().manual_seed(3)
        grad_q = torch.randn(q_out.shape, generator=gen).to(dtype).to(device)
        grad_k = None if k_out is None else torch.randn(k_out.shape, generator=gen).to(dtype).to(device)
        outputs = [q_out] + ([k_out] if k_out is not None else [])
        grads = [grad_q] + ([grad_k] if grad_k is not None else [])
        torch.autograd.backward(outputs, grads)
        assert_rope_close(leaf_q.grad, inputs.reference(grad_q, case, inverse=True), grad_q,
                          rotary_dim=inputs.rotary_dim, style=case.style, what="dq")
        if leaf_k is not None:
            assert_rope_close(leaf_k.grad, inputs.reference(grad_k, case, inverse=True), grad_k,
                              rotary_dim=inputs.rotary_dim, style=case.style, what="dk")
        # The public RotaryEmbeddingGrad gives the same gradients.
        kwargs = {key: v for key, v in inputs.kwargs.items() if key != "inplace"}
        gq, gk = rope_ops.apply_grad(grad_q, grad_k, inputs.pos, backend=backend_name, **kwargs)
        assert_rope_close(gq, inputs.reference(grad_q, case, inverse=True), grad_q,
                          rotary_dim=inputs.rotary_dim, style=case.style, what="apply_grad dq")

    def test_gradcheck_float64(self, backend_name, backend_obj, device):
        if torch.float64 not in backend_obj.dtypes or not backend_obj.supports_backward:
            pytest.skip("backend has no float64 or no backward")
        gen = torch.Generator().manual_seed(4)
        q = torch.randn(2, 3, 2, 8, generator=gen, dtype=torch.float64).to(device).requires_grad_(True)
        k = torch.randn(2, 3, 1, 8, generator=gen, dtype=torch.float64).to(device).requires_grad_(True)
        pos = torch.tensor([[0, 5, 100], [7, 1, 3]], device=device)
        rope = rope_ops.RotaryEmbedding(8, rotary_dim=6, max_position=50)
        assert torch.autograd.gradcheck(
            lambda a, b: rope_ops.apply(a, b, pos, rope=rope, backend=backend_name), (q, k))

    # -- edges -----------------------------------------------------------------------------

    def test_takes_basic_calls(self, backend_name, backend_obj, device):
        """The backend must accept plain calls in every dtype it declares."""
        for dtype in sorted(backend_obj.dtypes, key=str):
            q = torch.randn(1, 4, 2, 64).to(dtype).to(device)
            rope_ops.apply(q, q.clone(), 0, backend=backend_name)  # raises if refused

    @pytest.mark.parametrize("layout", ["bshd", "thd"])
    def test_zero_tokens(self, backend_name, backend_obj, device, layout):
        shape = (2, 0, 4, 64) if layout == "bshd" else (0, 4, 64)
        q = torch.randn(shape, device=device)
        k = torch.randn(shape[:-2] + (1, 64), device=device)
        pos = torch.zeros(shape[:-2], dtype=torch.int64, device=device)
        q_out, k_out = rope_ops.apply(q, k, pos, layout=layout, backend=backend_name)
        assert q_out.shape == q.shape and k_out.shape == k.shape

    def test_deterministic(self, backend_name, backend_obj, device):
        inputs = make_inputs(Case("det", pos_high=5000), torch.bfloat16, device, seed=5)
        first = self._apply(backend_name, inputs)
        second = self._apply(backend_name, inputs)
        assert_bitwise_equal(first[0], second[0], "two runs, q")
        assert_bitwise_equal(first[1], second[1], "two runs, k")

    def test_refused_call_raises_backend_error(self, backend_name, backend_obj, device):
        """A call the backend refuses, forced, raises BackendError naming the reasons."""
        call = rope_ops.backend.RopeCall("no-such-device", torch.float32, "bshd", "neox", 64, 64, 4, 2,
                                         False, torch.int64, False, False, True)
        reasons = backend_obj.supports(call)
        if "*" in backend_obj.device_types:
            assert reasons == [] or isinstance(reasons, list)
        else:
            assert reasons and all(isinstance(r, str) and r for r in reasons)

    # -- bad input -------------------------------------------------------------------------

    @pytest.mark.parametrize("bad", [
        "int_dtype", "dtype_mismatch", "device_mismatch", "head_dim_mismatch", "leading_mismatch",
        "rank", "odd_rotary", "zero_rotary", "big_rotary", "float_pos", "pos_shape", "style",
        "layout", "rope_type", "missing_key", "base", "overlap_inplace", "table_dtype",
        "caller_out_of_range", "pos_device"])
    def test_bad_input(self, backend_name, backend_obj, device, bad):
        q = torch.randn(2, 5, 4, 64, device=device)
        k = torch.randn(2, 5, 2, 64, device=device)
        pos = torch.arange(5, device=device)
        kwargs: dict = {}
        if bad == "int_dtype":
            q = q.to(torch.int32)
        elif bad == "dtype_mismatch":
            k = k.to(torch.float16)
        elif bad == "device_mismatch":
            k = torch.empty(2, 5, 2, 64, device="meta")
        elif bad == "head_dim_mismatch":
            k = k[..., :32]
        elif bad == "leading_mismatch":
            k = k[:, :4]
        elif bad == "rank":
            kwargs["layout"] = "thd"
        elif bad == "odd_rotary":
            kwargs["rotary_dim"] = 31
        elif bad == "zero_rotary":
            kwargs["rotary_dim"] = 0
        elif bad == "big_rotary":
            kwargs["rotary_dim"] = 66
        elif bad == "float_pos":
            pos = pos.float()
        elif bad == "pos_shape":
            pos = torch.arange(6, device=device)
        elif bad == "style":
            kwargs["style"] = "rotate_half"
        elif bad == "layout":
            kwargs["layout"] = "bsdh"
        elif bad == "rope_type":
            kwargs["scaling"] = {"rope_type": "magic", "factor": 2.0}
        elif bad == "missing_key":
            kwargs["scaling"] = {"rope_type": "llama3", "factor": 8.0}
        elif bad == "base":
            kwargs["base"] = -1.0
        elif bad == "overlap_inplace":
            k = q[:, :, 1:3]
            kwargs["inplace"] = True
        elif bad == "table_dtype":
            kwargs["cos_sin"] = (torch.ones(8, 32, device=device, dtype=torch.int32),
                                 torch.zeros(8, 32, device=device, dtype=torch.int32))
        elif bad == "caller_out_of_range":
            kwargs["cos_sin"] = (torch.ones(3, 32, device=device), torch.zeros(3, 32, device=device))
            pos = 0  # positions 0..4, table of 3 rows: known on the host
        elif bad == "pos_device":
            pos = torch.arange(5, device="meta")
        q_before = q.clone() if q.device.type != "meta" else None
        k_before = k.clone() if k.device.type != "meta" else None
        with pytest.raises(RopeError) as info:
            rope_ops.apply(q, k, pos, backend=backend_name, **kwargs)
        assert str(info.value), "the error must say what was wrong"
        if q_before is not None:
            assert_bitwise_equal(q, q_before, "q after a bad call")
        if k_before is not None:
            assert_bitwise_equal(k, k_before, "k after a bad call")

    # -- repeated calls --------------------------------------------------------------------

    def test_repeats_follow_each_call(self, backend_name, backend_obj, device):
        """Repeats of one call kind (same keyword arguments) whose tensors change between calls.

        apply caches what it derives from a call's metadata, and runs repeats of its last call
        kind through the backend's guard where the backend has one (Backend.bind): every change
        of shape, strides, dtype, k, positions or gradient need must still be honoured, and bad
        input still refused, whatever came before.
        """
        dtypes = [d for d in (torch.bfloat16, torch.float32, torch.float16, torch.float64)
                  if d in backend_obj.dtypes]
        dtype = dtypes[0]
        rope = rope_ops.RotaryEmbedding(64, max_position=64)
        gen = torch.Generator().manual_seed(11)

        def rand(*shape, dt=dtype):
            return torch.randn(*shape, generator=gen).to(dt).to(device)

        pos = torch.randint(0, 64, (2, 6), generator=gen).to(device)
        pos7 = torch.randint(0, 64, (2, 7), generator=gen).to(device)
        qkv = rand(2, 6, 8, 64)
        calls = [
            ("first", rand(2, 6, 4, 64), rand(2, 6, 2, 64), pos),
            ("repeat", rand(2, 6, 4, 64), rand(2, 6, 2, 64), pos),
            ("more tokens", rand(2, 7, 4, 64), rand(2, 7, 2, 64), pos7),
            ("more q heads", rand(2, 6, 5, 64), rand(2, 6, 2, 64), pos),
            ("packed views", qkv[:, :, :4], qkv[:, :, 4:6], pos),
            ("repeat after views", rand(2, 6, 4, 64), rand(2, 6, 2, 64), pos),
            ("no k", rand(2, 6, 4, 64), None, pos),
            ("int offset", rand(2, 6, 4, 64), rand(2, 6, 2, 64), 5),
            ("another int offset", rand(2, 6, 4, 64), rand(2, 6, 2, 64), 40),
            ("int32 positions", rand(2, 6, 4, 64), rand(2, 6, 2, 64), pos.int()),
            ("positions [S]", rand(2, 6, 4, 64), rand(2, 6, 2, 64), pos[1]),
            ("positions as a strided view", rand(2, 6, 4, 64), rand(2, 6, 2, 64), pos7[:, :6]),
            *[(f"dtype {d}", rand(2, 6, 4, 64, dt=d), rand(2, 6, 2, 64, dt=d), pos) for d in dtypes[1:]],
            ("a Parameter (tensor subclass)", torch.nn.Parameter(rand(2, 6, 4, 64), requires_grad=False),
             rand(2, 6, 2, 64), pos),
            ("last repeat", rand(2, 6, 4, 64), rand(2, 6, 2, 64), pos),
        ]
        for label, q, k, p in calls:
            q_before = q.detach().clone()
            k_before = None if k is None else k.clone()
            q_out, k_out = rope_ops.apply(q, k, p, rope=rope, backend=backend_name)
            assert (k_out is None) == (k is None), label
            assert q_out.dtype == q.dtype and q_out.shape == q.shape, label
            for out, x in ((q_out, q_before), (k_out, k_before)):
                if x is not None:
                    ref = rope_reference(x, p, layout="bshd", rotary_dim=64, style="neox",
                                         inv_freq=rope.inv_freq)
                    assert_rope_close(out, ref, x, rotary_dim=64, style="neox", what=label)
            assert_bitwise_equal(q.detach(), q_before, f"{label}: q after the call")

        q, k = rand(2, 6, 4, 64), rand(2, 6, 2, 64)
        rope_ops.apply(q, k, pos, rope=rope, backend=backend_name)
        if backend_obj.supports_backward:
            # the same metadata needing a gradient: recorded by autograd; without grad mode: not
            q_grad = q.clone().requires_grad_()
            q_out, _ = rope_ops.apply(q_grad, k, pos, rope=rope, backend=backend_name)
            assert q_out.grad_fn is not None, "a repeat that needs a gradient lost it"
            with torch.no_grad():
                q_out, _ = rope_ops.apply(q_grad, k, pos, rope=rope, backend=backend_name)
            assert q_out.grad_fn is None
            rope_ops.apply(q, k, pos, rope=rope, backend=backend_name)
        bad = [("bool positions", k, True), ("offset beyond 2**62", k, 2**63),
               ("float positions", k, pos.float()), ("positions of another shape", k, pos7)]
        if len(dtypes) > 1:
            bad.append(("k of another dtype", k.to(dtypes[1]), pos))
        for label, k_bad, p in bad:
            with pytest.raises(RopeError):
                rope_ops.apply(q, k_bad, p, rope=rope, backend=backend_name)
            rope_ops.apply(q, k, pos, rope=rope, backend=backend_name)  # the good kind again

    # -- random cases ----------------------------------------------------------------------

    def test_random_cases(self, backend_name, backend_obj, device):
        hypothesis = pytest.importorskip("hypothesis")
        st = hypothesis.strategies

        @hypothesis.settings(max_examples=int(os.environ.get("ROPE_OPS_TEST_EXAMPLES", "25")),
                             deadline=None, derandomize=True, database=None,
                             suppress_health_check=list(hypothesis.HealthCheck))
        @hypothesis.given(
            layout=st.sampled_from(["bshd", "sbhd", "bhsd", "thd"]),
            style=st.sampled_from(["neox", "gptj"]),
            dtype=st.sampled_from(sorted(backend_obj.dtypes & set(DTYPES), key=str)),
            batch=st.integers(1, 3), seq=st.integers(1, 17), q_heads=st.integers(1, 6),
            k_heads=st.one_of(st.none(), st.integers(1, 3)), half=st.integers(1, 40),
            extra=st.integers(0, 9), pos_high=st.sampled_from([4, 60, 5000, 1 << 20]),
            inplace=st.booleans(), packed=st.booleans())
        def run(layout, style, dtype, batch, seq, q_heads, k_heads, half, extra, pos_high, inplace, packed):
            head_dim = 2 * half + extra
            case = Case("random", layout=layout, style=style, batch=1 if layout == "thd" else batch,
                        seq=seq, q_heads=q_heads, k_heads=k_heads, head_dim=head_dim,
                        rotary_dim=2 * half, pos_kind="t" if layout == "thd" else "bs",
                        pos_high=pos_high, pos_low=max(0, pos_high - 6000), table_positions=32,
                        inplace=inplace, packed_qkv=packed)
            inputs = make_inputs(case, dtype, device, seed=seq * 31 + half)
            q_before = inputs.q.clone()
            k_before = None if inputs.k is None else inputs.k.clone()
            try:
                q_out, k_out = rope_ops.apply(inputs.q, inputs.k, inputs.pos, backend=backend_name,
                                              **inputs.kwargs)
            except BackendError as error:
                if error.refusals is None:
                    raise
                hypothesis.reject()
            assert_rope_close(q_out, inputs.reference(q_before, case), q_before,
                              rotary_dim=inputs.rotary_dim, style=style, what="q_out")
            if k_before is not None:
                assert_rope_close(k_out, inputs.reference(k_before, case), k_before,
                                  rotary_dim=inputs.rotary_dim, style=style, what="k_out")

        run()
