"""Device routing with a pure-Python PrivateUse1 backend renamed "npu" (no torch_npu, no NPU).

In a subprocess (a PrivateUse1 backend can be renamed once per process): tensors on "npu:0" are
wrapper tensors (torch._C._acc.create_empty_tensor) over CPU storage. Checks that rope_ops'
selection routes npu tensors to the "ascend" backend when torch_npu imports (a fake module here),
and that without torch_npu auto selection falls back to "torch" while forcing "ascend" fails
loudly with AscendBackend's reasons.

Running the backend on these tensors end to end would need most of aten on the fake device;
tests/test_ascend_adapter.py runs AscendBackend.run and rope_ops.apply on CPU tensors instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = textwrap.dedent('''
    import sys, types, torch
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    class NpuModule:  # what torch.npu offers, as far as rope_ops looks
        def is_available(self): return True
        def device_count(self): return 1
        def current_device(self): return 0
        def get_device_name(self, i=0): return "Ascend910B2"
        def get_device_properties(self, i=0): return types.SimpleNamespace(vector_core_num=40)
        def _is_in_bad_fork(self): return False
        def manual_seed_all(self, seed): pass
        def is_initialized(self): return True

    _setup_privateuseone_for_python_backend("npu", backend_module=NpuModule())

    class NpuTensor(torch.Tensor):
        @staticmethod
        def __new__(cls, raw):
            res = torch._C._acc.create_empty_tensor(raw.shape, raw.dtype)
            res.__class__ = NpuTensor
            return res
        def __init__(self, raw):
            self.raw = raw
        __torch_function__ = torch._C._disabled_torch_function_impl

    @torch.library.impl("aten::empty_strided", "privateuseone")
    def empty_strided(size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
        return NpuTensor(torch.empty_strided(size, stride, dtype=dtype or torch.float32))

    @torch.library.impl("aten::empty.memory_format", "privateuseone")
    def empty_mf(size, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return NpuTensor(torch.empty(size, dtype=dtype or torch.float32))

    @torch.library.impl("aten::_copy_from", "privateuseone")
    def _copy_from(a, b, non_blocking=False):
        src = a.raw if isinstance(a, NpuTensor) else a
        (b.raw if isinstance(b, NpuTensor) else b).copy_(src)
        return b

    q = torch.randn(2, 5, 4, 32).to("npu")
    k = torch.randn(2, 5, 2, 32).to("npu")
    assert q.device.type == "npu" and q.is_npu
    import rope_ops
''')


def _run(body: str) -> str:
    code = PRELUDE + textwrap.dedent(body)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROPE_OPS_")}
    env.update(ROPE_OPS_BACKEND="auto", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=120)
    if out.returncode != 0 and "create_empty_tensor" in out.stderr and "has no attribute" in out.stderr:
        pytest.skip("this torch has no torch._C._acc python PrivateUse1 support")
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_npu_tensors_route_to_ascend_with_torch_npu():
    out = _run('''
        mod = types.ModuleType("torch_npu")
        mod.npu_rotary_mul = lambda *a, **k: None
        sys.modules["torch_npu"] = mod
        print("auto:", rope_ops.select_backend(q, k, 0))
        print("forced:", rope_ops.select_backend(q, k, 0, backend="ascend"))
        from rope_ops import registry
        print("tiers:", [t["tier"] for t in registry.get("ascend").tiers() if t["usable"]])
    ''')
    assert "auto: ascend" in out and "forced: ascend" in out
    assert "tiers: ['npu_rotary_mul', 'torch']" in out


def test_without_torch_npu_auto_falls_back_and_forced_fails_loudly():
    out = _run('''
        import importlib.util
        real = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name == "torch_npu" else real(name, *a)
        print("auto:", rope_ops.select_backend(q, k, 0))
        try:
            rope_ops.select_backend(q, k, 0, backend="ascend")
        except rope_ops.BackendError as e:
            print("forced error:", e)
    ''')
    assert "auto: torch" in out
    assert "forced error:" in out and "torch_npu is not installed" in out
