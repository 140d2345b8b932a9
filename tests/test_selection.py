"""Backend selection: ROPE_OPS_BACKEND (unset/auto, a name, a comma list), backend=, use_backend."""

import pytest
import torch

import rope_ops
from rope_ops import BackendError, _select, registry
from rope_ops.backend import Backend
from rope_ops_backends.torch_backend import TorchBackend


class Recording(TorchBackend):
    """A torch backend that counts its runs and refuses what it is told to."""

    def __init__(self, name, priority=0, devices=("cpu",), refuse=(), unavailable=None, auto=None,
                 joins_auto=True):
        self.name = name
        self.joins_auto = joins_auto
        self.priority = priority
        self.device_types = frozenset(devices)
        self.auto_device_types = None if auto is None else frozenset(auto)
        self.refuse = refuse
        self.unavailable = unavailable
        self.runs = 0

    def availability(self):
        return [self.unavailable] if self.unavailable else []

    def supports(self, call):
        reasons = Backend.supports(self, call)
        if call.dtype in self.refuse:
            reasons.append(f"refuses {call.dtype}")
        return reasons

    def run(self, args):
        self.runs += 1
        super().run(args)


@pytest.fixture
def fakes(monkeypatch):
    monkeypatch.delenv("ROPE_OPS_BACKEND", raising=False)
    backends = {
        "torch": Recording("torch", devices=("*",)),
        "fast": Recording("fast", priority=20, refuse=(torch.float64,)),
        "medium": Recording("medium", priority=10),
        "broken": Recording("broken", priority=30, unavailable="SDK missing"),
        "manual": Recording("manual", priority=50, auto=()),
    }
    with registry.override(backends):
        yield backends


def call(dtype=torch.float32, **kwargs):
    q = torch.randn(2, 3, 4, 8, dtype=dtype)
    return rope_ops.apply(q, q[:, :, :2].clone(), 0, **kwargs)


def test_auto_picks_highest_priority_that_accepts(fakes):
    call()
    assert fakes["fast"].runs == 1 and fakes["broken"].runs == 0 and fakes["manual"].runs == 0
    call(torch.float64)  # fast refuses float64, medium does not
    assert fakes["medium"].runs == 1


def test_torch_is_last_resort(fakes, monkeypatch):
    monkeypatch.setenv("ROPE_OPS_BACKEND", "auto")
    q = torch.randn(2, 3, 4, 8)
    assert rope_ops.select_backend(q, None, 0) == "fast"
    q_meta = torch.empty(2, 3, 4, 8, device="meta")
    assert rope_ops.select_backend(q_meta, None, 0) == "torch"  # no other backend runs on meta


def test_single_name_is_strict(fakes, monkeypatch):
    monkeypatch.setenv("ROPE_OPS_BACKEND", "medium")
    call()
    assert fakes["medium"].runs == 1 and fakes["fast"].runs == 0
    monkeypatch.setenv("ROPE_OPS_BACKEND", "fast")
    with pytest.raises(BackendError, match="refuses torch.float64"):
        call(torch.float64)
    monkeypatch.setenv("ROPE_OPS_BACKEND", "broken")
    with pytest.raises(BackendError, match="SDK missing"):
        call()


def test_unknown_name_fails_loudly(fakes, monkeypatch):
    monkeypatch.setenv("ROPE_OPS_BACKEND", "cudaa")
    with pytest.raises(BackendError, match="unknown backend.*cudaa"):
        call()


def test_comma_list_is_ordered_preference(fakes, monkeypatch):
    monkeypatch.setenv("ROPE_OPS_BACKEND", "broken, medium, fast")
    call()
    assert fakes["medium"].runs == 1
    call(torch.float64)
    assert fakes["medium"].runs == 2
    monkeypatch.setenv("ROPE_OPS_BACKEND", "broken,fast")
    with pytest.raises(BackendError) as info:
        call(torch.float64)
    assert "SDK missing" in str(info.value) and "refuses torch.float64" in str(info.value)


def test_per_call_argument_and_context_override_env(fakes, monkeypatch):
    monkeypatch.setenv("ROPE_OPS_BACKEND", "medium")
    call(backend="manual")
    assert fakes["manual"].runs == 1
    with rope_ops.use_backend("fast"):
        call()
        call(backend="torch")
    assert fakes["fast"].runs == 1 and fakes["torch"].runs == 1
    call()
    assert fakes["medium"].runs == 1


def test_decision_cached_per_kind_of_call(fakes, monkeypatch):
    calls = []
    original = _select.decide
    monkeypatch.setattr(_select, "decide", lambda *a: calls.append(a) or original(*a))
    for _ in range(5):
        call()
    call(torch.float64)
    assert len(calls) == 2


def test_error_lists_every_backend(fakes):
    q = torch.empty(2, 3, 4, 8, device="meta")
    with pytest.raises(BackendError) as info:
        rope_ops.apply(q, None, 0, backend="fast,medium,broken,manual")
    assert info.value.args[0].count("\n  ") >= 4


def test_real_registry_auto_on_cpu(monkeypatch):
    """On CPU tensors auto picks the C++ cpu backend where it is available, else torch."""
    monkeypatch.delenv("ROPE_OPS_BACKEND", raising=False)
    q = torch.randn(1, 2, 2, 8)
    cpu_ok = "cpu" in registry.names() and not registry.availability(registry.get("cpu"))
    assert rope_ops.select_backend(q, None, 0) == ("cpu" if cpu_ok else "torch")


def test_third_party_joins_auto_only_when_it_declares_it(fakes):
    """Built-ins win ties; a third-party backend of higher priority takes automatic selection
    only when it says so (joins_auto), otherwise it runs when named."""
    fakes["fast"].joins_auto = False
    fakes["medium"].joins_auto = False
    call()
    assert fakes["torch"].runs == 1 and fakes["fast"].runs == 0
    call(backend="fast")
    assert fakes["fast"].runs == 1
    fakes["medium"].joins_auto = True
    rope_ops.registry.reset()  # selection decisions are cached
    call()
    assert fakes["medium"].runs == 1


def test_backend_argument_of_the_wrong_type_is_a_rope_error(fakes):
    with pytest.raises(rope_ops.RopeError, match="backend"):
        call(backend=123)
    with pytest.raises(rope_ops.RopeError, match="backend"):
        call(backend=["torch"])


def test_plugin_whose_availability_raises_is_contained(fakes):
    """availability() raising is that backend's reason; auto and lists carry on to the next."""
    def boom():
        raise RuntimeError("driver exploded")

    fakes["fast"].availability = boom
    call()
    assert fakes["medium"].runs == 1
    call(backend="fast,torch")
    assert fakes["torch"].runs == 1
    with pytest.raises(BackendError, match="driver exploded"):
        call(backend="fast")


def test_environment_is_read_through_public_apis(monkeypatch):
    """The variable is read with os.environ on every call: set after import, changed between
    calls, and an undecodable byte gives a BackendError naming it, not a UnicodeDecodeError."""
    import os
    import subprocess
    import sys

    code = ("import os, torch, rope_ops\n"
            "q = torch.randn(1, 2, 2, 8)\n"
            "os.environ['ROPE_OPS_BACKEND'] = 'torch'\n"
            "print(rope_ops.select_backend(q, None, 0))\n"
            "os.environ['ROPE_OPS_BACKEND'] = 'no-such'\n"
            "try:\n    rope_ops.apply(q, None, 0)\nexcept rope_ops.BackendError as e:\n    print('error', 'no-such' in str(e))\n")
    env = {k: v for k, v in os.environ.items() if k != "ROPE_OPS_BACKEND"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.split() == ["torch", "error", "True"], out.stderr
    env_bytes = {k.encode(): v.encode() for k, v in env.items()}
    env_bytes[b"ROPE_OPS_BACKEND"] = b"torch\xff"
    code = ("import torch, rope_ops\nq = torch.randn(1, 2, 2, 8)\n"
            "try:\n    rope_ops.apply(q, None, 0)\nexcept rope_ops.BackendError as e:\n    print('backend error')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, env=env_bytes)
    assert out.stdout.decode().strip() == "backend error", out.stderr.decode()[-500:]


def test_prologue_calls_go_to_the_faster_kernels_or_to_what_can_take_them(monkeypatch):
    """On a CUDA device prologue calls go to Triton, whose kernels measured faster (training
    included); without Triton the CUDA backend takes every prologue call with position tables
    (caches of the input's dtype or float8 included). mRoPE and per-token tables go to Triton,
    with the CUDA backend's reason."""
    from rope_ops.backend import RopeCall
    from rope_ops_backends.cuda_backend import CudaBackend
    from rope_ops_backends.triton_backend import TritonBackend

    class Cuda(CudaBackend):
        def availability(self):
            return []

    class Triton(TritonBackend):
        def availability(self):
            return []

        def supports(self, call):
            return Backend.supports(self, call)

    monkeypatch.delenv("ROPE_OPS_BACKEND", raising=False)

    def call(angles="table", cache=None, needs_grad=False, dtype=torch.bfloat16, op="prologue"):
        return RopeCall("cuda", dtype, "thd", "neox", 128, 128, 32, 8, False, torch.int64,
                        False, needs_grad, True, angles, torch.float32, op, cache)

    with registry.override({"cuda": Cuda(), "triton": Triton(), "torch": TorchBackend()}):
        assert _select.select(call()).name == "triton"
        assert _select.select(call(cache=torch.float8_e4m3fn)).name == "triton"
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert _select.select(call(needs_grad=True, dtype=dtype)).name == "triton"
        assert _select.select(call(op="rope")).name == "cuda"  # apply: the CUDA kernels first
        assert _select.select(call(), "cuda").name == "cuda"  # named
        for angles in ("mrope", "token"):
            assert _select.select(call(angles)).name == "triton"
            assert any("prologue kernels read position tables only" in r
                       for r in Cuda().supports(call(angles)))
    with registry.override({"cuda": Cuda(), "torch": TorchBackend()}):  # no Triton
        for c in (call(), call(cache=torch.bfloat16), call(cache=torch.float8_e4m3fn),
                  call(needs_grad=True), call(needs_grad=True, dtype=torch.float32)):
            assert _select.select(c).name == "cuda"


def test_priority_for_ranks_per_call_and_a_raising_one_keeps_the_declared_priority(fakes):
    class PrefersHalf(Recording):
        def priority_for(self, call):
            return 40 if call.dtype == torch.float16 else 1

    class Raises(Recording):
        def priority_for(self, call):
            raise RuntimeError("plugin bug")

    fakes["half"] = PrefersHalf("half", priority=1)
    fakes["raises"] = Raises("raises", priority=15)
    with registry.override(fakes):
        call(torch.float16)
        assert fakes["half"].runs == 1
        call(torch.float32)  # half ranks 1 there; raises keeps 15; fast (20) wins
        assert fakes["fast"].runs == 1 and fakes["raises"].runs == 0


@pytest.mark.parametrize("interleaved", [False, True])
def test_the_call_says_whether_mrope_is_interleaved(fakes, interleaved):
    """Selection sees mRoPE's assignment (the CUDA backend ranks by it), eager and traced."""
    seen = []

    class Watching(Recording):
        def priority_for(self, call):
            seen.append(call)
            return self.priority

    fakes["watching"] = Watching("watching", priority=40)
    q, k = torch.randn(1, 6, 2, 16), torch.randn(1, 6, 1, 16)
    pos = torch.arange(6).expand(3, 1, 6)
    with registry.override(fakes):
        rope_ops.apply(q, k, pos, mrope_section=(2, 3, 3), mrope_interleaved=interleaved)
        rope_ops.apply(q, k, torch.arange(6).expand(1, 6))
        _select.clear_cache()  # the traced call's own selection, not the eager one's cached
        torch._dynamo.reset()
        compiled = torch.compile(lambda q, k, p: rope_ops.apply(q, k, p, mrope_section=(2, 3, 3),
                                                                 mrope_interleaved=interleaved),
                                 backend="eager", fullgraph=True)
        compiled(q, k, pos)
        torch._dynamo.reset()
    mrope = [c for c in seen if c.angles == "mrope"]
    assert len(mrope) >= 2 and all(c.mrope_interleaved == interleaved for c in mrope)
    assert all(not c.mrope_interleaved for c in seen if c.angles != "mrope")
    assert fakes["watching"].runs >= 3
