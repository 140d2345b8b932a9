"""The shipped host glue (ascend_kernels/rope_host.cpp) on the CPU, test-only.

``load()`` builds host_glue_test.cpp (rope_host.cpp compiled unchanged against this directory's
stand-ins for torch_npu's NPUStream.h and OpCommand.h, its impls registered for CPU tensors too,
aclrtlaunch_* recording their launches) with rope_ops' extension builder and registers the real
``torch.ops.rope_ops_ascend`` ops in this process. ``kernel_ops(glue, sim)`` gives AscendBackend
ops that call those real ops, then check every recorded launch against what the Python side
predicts (kernel, block count, GM pointers, the tiling struct byte for byte against
backends/ascend_backend/tiling.py) and run it in the CPU emulation of the kernels (cpu_sim).
"""

from __future__ import annotations

import ctypes
import struct
from pathlib import Path

import torch

from rope_ops_backends._build import build_extension
from rope_ops_backends._paths import source_dir
from rope_ops_backends.ascend_backend import KernelOps
from rope_ops_backends.ascend_backend import tiling as tl

from .. import fakes
from ..cpu_sim import rope_sim

HERE = Path(__file__).resolve().parent
KERNELS = source_dir("ascend_kernels")
KERNEL_IDS = {"rotary_embedding": rope_sim.ROPE, "rotary_embedding_grad": rope_sim.ROPE_GRAD,
              "qkv_prologue": rope_sim.PROLOGUE, "qkv_prologue_grad": rope_sim.PROLOGUE_GRAD}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_LOADED: list = []


class HostGlue:
    """The built library: the registered ops and the launches they recorded."""

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        self.lib.rope_host_launch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                                              ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_void_p),
                                              ctypes.c_int]
        ns = torch.ops.rope_ops_ascend
        self.ops = KernelOps(ns.rotary_embedding.default, ns.rotary_embedding_grad.default,
                             ns.qkv_prologue.default, ns.qkv_prologue_grad.default)

    def take(self) -> list[tuple[str, int, list[int]]]:
        """(kernel entry name, block count, GM pointers with the tiling's last) of each launch
        since the last call, oldest first."""
        out = []
        for i in range(self.lib.rope_host_launch_count()):
            name, block_dim, args = ctypes.create_string_buffer(128), ctypes.c_uint32(), (ctypes.c_void_p * 32)()
            n = self.lib.rope_host_launch(i, name, 128, ctypes.byref(block_dim), args, 32)
            out.append((name.value.decode(), block_dim.value, [args[j] or 0 for j in range(n)]))
        self.lib.rope_host_clear()
        return out


def load() -> HostGlue:
    """Build (once, cached by rope_ops' extension builder) and load the host glue."""
    if not _LOADED:
        stubs = sorted(HERE.glob("torch_npu/**/*.h"))
        module = build_extension("rope_ops_ascend_host_glue_test", [HERE / "host_glue_test.cpp"],
                                 headers=[KERNELS / "rope_host.cpp", KERNELS / "rope_tiling.h", *stubs],
                                 extra_cflags=[f"-I{HERE}", f"-I{KERNELS}"],
                                 message="rope_ops tests: building ascend_kernels/rope_host.cpp for the CPU")
        _LOADED.append(HostGlue(module.__file__))
    return _LOADED[0]


def replay(glue: HostGlue, sim, plan: fakes.Launch, launched: list) -> None:
    """Check the launches the last op call recorded against ``plan`` and run them in ``sim``."""
    records = glue.take()
    expected = tl.compute_tiling(plan.params, plan.ub_size, plan.core_num)
    if not expected["blockDim"]:
        assert records == [], records
        return
    assert len(records) == 1, records
    name, block_dim, ptrs = records[0]
    kernel, dtype = name.removeprefix("rope_ops_").rsplit("_", 1)
    assert (KERNEL_IDS[kernel], DTYPES[dtype]) == (plan.kernel, plan.dtype), name
    assert ptrs[:-1] == [0 if t is None else t.data_ptr() for t in plan.tensors], f"{name}: GM pointers"
    packed = ctypes.string_at(ptrs[-1], 8 * len(tl.FIELDS))
    tiling = dict(zip(tl.FIELDS, struct.unpack(f"<{len(tl.FIELDS)}q", packed)))
    assert tiling == expected, {k: (tiling[k], expected[k]) for k in tl.FIELDS if tiling[k] != expected[k]}
    assert block_dim == tiling["blockDim"]
    launched.append((name, tiling))
    sim.run(plan.kernel, plan.dtype, plan.tensors, tiling, packed)


def kernel_ops(glue: HostGlue, sim, launched: list | None = None) -> KernelOps:
    """AscendBackend kernel ops running the real rope_ops_ascend ops (rope_host.cpp), each launch
    checked against the Python mirror and run in the CPU emulation."""
    launched = [] if launched is None else launched

    def through(op, plan_of):
        def call(*args):
            glue.take()
            op(*args)
            replay(glue, sim, plan_of(*args), launched)
        return call

    return KernelOps(through(glue.ops.rotary_embedding, lambda *a: fakes.rope_launch(False, *a)),
                     through(glue.ops.rotary_embedding_grad, lambda *a: fakes.rope_launch(True, *a)),
                     through(glue.ops.qkv_prologue, fakes.prologue_launch),
                     through(glue.ops.qkv_prologue_grad, fakes.prologue_grad_launch))


def use(backend, launched: list | None = None) -> None:
    """Make ``backend``'s kernel tier run the real host glue and the emulated kernels."""
    env = backend._probe()
    env.kernel_ops = kernel_ops(load(), fakes.load_sim(), launched)
    env.kernel_status = "loaded (rope_host.cpp on the CPU, kernels in the CPU simulation)"
