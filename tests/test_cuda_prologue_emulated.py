"""The CUDA backend's fused prologue kernels (csrc/kernel_prologue.cuh) on the CPU: the extension's
prologue functions (csrc/prologue_torch.h) built over the host emulation, run through
tools/gpu_cuda_check.py's prologue cases (the same the GPU check runs) against the float64
reference and rope_ops' float32 torch ops: every dtype, NeoX and GPT-J, partial rotary, odd head
dims, strided rows, in place, norms on and off with and without the weight offset, caches of the
input's dtype and float8 with random and invalid slots, float8 saturation and NaN, the backward
with the weights' gradients (deterministic), also with blocks that walk several tokens."""

from __future__ import annotations

import pytest
import torch
from _cuda_tools import emulation_c_api, ext, kernels_run, load_tool  # noqa: F401  (ext: fixture)

from rope_ops import registry
import rope_ops
from rope_ops_backends.torch_backend import TorchBackend


@pytest.fixture(scope="module")
def check_tool():
    return load_tool("gpu_cuda_check")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def every_prologue_kernel() -> set[str]:
    return {f"{kind}<{dtype},{style},{vec},{units}>"
            for kind in ("prologue", "prologue_backward")
            for dtype in ("float32", "float16", "bfloat16") for style in ("neox", "gptj")
            for vec in ("v16", "v1") for units in ("u1", "u4")}


def test_prologue_cases_match_the_reference(ext, check_tool):
    c_api = emulation_c_api()
    c_api.rope_emulated_reset()
    rn = check_tool.Runner(ext, "cpu")
    check_tool.prologue_cases(rn)
    assert not rn.failures, "\n".join(rn.failures[:20])
    assert rn.count > 45
    ran = {name for name in kernels_run(c_api) if name.startswith("prologue")}
    assert ran == every_prologue_kernel(), (sorted(every_prologue_kernel() - ran), sorted(ran - every_prologue_kernel()))


def test_backend_serves_the_prologue_and_falls_back(ext):
    """Through rope_ops.qkv_prologue: the CUDA backend (emulated) runs its kernels; a row its
    kernels cannot take runs rope_ops' torch ops, with the same results."""
    from test_cuda_conformance_emulated import CpuEmulatedCudaBackend

    backend = CpuEmulatedCudaBackend(ext)
    c_api = emulation_c_api()
    with registry.override({"cuda": backend, "torch": TorchBackend()}):
        for D, kernel in ((64, True), (300, False)):
            c_api.rope_emulated_reset()
            qkv = torch.randn(5, 4 * D)
            w = torch.rand(D) + 0.5
            got = rope_ops.qkv_prologue(qkv, torch.arange(5), num_q_heads=2, num_kv_heads=1, head_dim=D,
                                        q_norm=w, k_norm=w, backend="cuda")
            want = rope_ops.qkv_prologue(qkv, torch.arange(5), num_q_heads=2, num_kv_heads=1,
                                         head_dim=D, q_norm=w, k_norm=w, backend="torch")
            for g, t in zip(got, want):
                torch.testing.assert_close(g, t, rtol=1e-5, atol=1e-5)
            ran = {n for n in kernels_run(c_api) if n.startswith("prologue")}
            assert bool(ran) == kernel, ran


def test_timing_calls_run(ext, check_tool):
    """gpu_cuda_check --prologue-timing's calls (the GPU timing itself needs a GPU) on small
    versions of gpu_triton_check's prologue cases: the kernels take them and write the outputs."""
    import dataclasses

    tc = check_tool.load_triton_check()
    for pc in tc.PROLOGUE_CASES:
        if pc.angles != "table":
            continue
        small = dataclasses.replace(pc, T=8, hq=4, hk=2, D=64, R=0 if not pc.R else 32)
        inp = tc.PrologueInputs(small, 1, device="cpu")
        taken = []

        def forward(args):
            taken.append(ext.prologue(args))

        def backward(args, *grads):
            taken.append(ext.prologue_backward(args, *grads) is not None)

        for call in check_tool.prologue_timed_calls(small, inp, forward, backward):
            call()
        assert taken and all(taken), (pc.name, taken)
        args = inp.sets[0][0]
        if args.inplace:
            assert torch.isfinite(args.qkv.float()).all()
        else:
            assert torch.isfinite(args.q_out.float()).all()
