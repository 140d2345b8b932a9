"""The CUDA backend's fused prologue kernels (csrc/kernel_prologue.cuh) on the CPU: the extension's
prologue functions (csrc/prologue_torch.h) built over the host emulation, run through
tools/gpu_cuda_check.py's prologue cases (the same the GPU check runs) against the float64
reference and rope_ops' float32 torch ops: every dtype, NeoX and GPT-J, partial rotary, odd head
dims, strided rows, in place, norms on and off with and without the weight offset, caches of the
input's dtype and float8 with random and invalid slots, float8 saturation and NaN, a float8 q
(q_scale), the backward with the weights' gradients (deterministic), also with blocks that walk
several tokens. A float8 q also bit for bit against the torch backend's float8 of the float32 q,
e4m3's rounding cases, and the binding's refusals."""

from __future__ import annotations

import pytest
import torch
from _cuda_tools import emulation_c_api, ext, kernels_run, load_tool  # noqa: F401  (ext: fixture)
from _float8_support import FP8, check_float8_q

from rope_ops import registry
import rope_ops
from rope_ops.backend import _float8_of
from rope_ops_backends.cuda_backend import CudaBackend
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
            for vec in ("v16", "v1") for units in ("u1", "u4")} | {"prologue_weight_grad"}


def test_prologue_cases_match_the_reference(ext, check_tool):
    c_api = emulation_c_api()
    c_api.rope_emulated_reset()
    rn = check_tool.Runner(ext, "cpu")
    check_tool.prologue_cases(rn)
    assert not rn.failures, "\n".join(rn.failures[:20])
    assert rn.count > 45
    if FP8 is not None:  # the float8 q cases among them
        assert rn.count > 51
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


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _emulated_cuda(ext):
    from test_cuda_conformance_emulated import CpuEmulatedCudaBackend

    return registry.override({"cuda": CpuEmulatedCudaBackend(ext), "torch": TorchBackend()})


@pytest.mark.skipif(FP8 is None, reason="no float8 in this torch")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("D,R", [(128, 128), (96, 24), (17, 10)], ids=["vectors", "partial", "single"])
def test_float8_q_is_float8_of_the_float32_q(ext, dtype, style, D, R):
    """q_scale through rope_ops.qkv_prologue (CudaBackend declares prologue_q_dtypes): q is the
    torch backend's float8 of the kernels' own float32 q, bit for bit, where their float32 math is
    the same: a float32 qkv with norms (the call without q_scale has the same plan), a half
    precision qkv without them (elementwise math, whatever the vector width). k, v and a float8
    cache are bit for bit those of the call without q_scale."""
    assert FP8 in CudaBackend.prologue_q_dtypes
    gen = torch.Generator().manual_seed(D + R)
    T, hq, hk = 9, 4, 2
    qkv = torch.randn(T, (hq + 2 * hk) * D, generator=gen).to(dtype)
    pos = torch.randint(0, 4096, (T,), generator=gen)
    norms = dtype == torch.float32
    w = torch.rand(D, generator=gen) + 0.5
    api = dict(num_q_heads=hq, num_kv_heads=hk, head_dim=D, rotary_dim=R, style=style,
               q_norm=w if norms else None, k_norm=w if norms else None, backend="cuda")
    c_api = emulation_c_api()

    def caches():
        return tuple(torch.zeros(2 * T, hk, D, dtype=FP8) for _ in range(2))

    slots = torch.randperm(2 * T, generator=gen)[:T]
    slots[::3] = -1
    with _emulated_cuda(ext), torch.inference_mode():
        for q_scale in (0.25, 0.004, 1 / 3):
            c_api.rope_emulated_reset()
            kv8 = caches()
            q8, k, v = rope_ops.qkv_prologue(qkv, pos, q_scale=q_scale, kv_cache=kv8, slots=slots,
                                             cache_scales=(0.5, 2.0), **api)
            assert {n for n in kernels_run(c_api) if n.startswith("prologue<")}, "the kernels did not run"
            kv = caches()
            _, k_plain, v_plain = rope_ops.qkv_prologue(qkv, pos, kv_cache=kv, slots=slots,
                                                        cache_scales=(0.5, 2.0), **api)
            q32, _, _ = rope_ops.qkv_prologue(qkv.float(), pos, **api)
            assert q8.dtype == FP8 and q8.shape == q32.shape and q8.is_contiguous()
            assert torch.equal(q8.view(torch.uint8), _float8_of(q32, q_scale).view(torch.uint8)), q_scale
            if q_scale < 0.01:
                assert (q8.float().abs() == 448.0).any(), "no value saturated at this scale"
            assert torch.equal(_bits(k), _bits(k_plain)) and torch.equal(_bits(v), _bits(v_plain))
            for a, b in zip(kv8, kv):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "cache beside a float8 q"


@pytest.mark.skipif(FP8 is None, reason="no float8 in this torch")
def test_float8_q_rounding(ext):
    """The float8 q's rounding, bit for bit (check_float8_q). The emulation runs
    __nv_cvt_float_to_fp8's host path; sm_89+ devices convert with cvt.rn.satfinite."""
    with _emulated_cuda(ext):
        check_float8_q("cuda")


@pytest.mark.skipif(FP8 is None, reason="no float8 in this torch")
def test_float8_q_falls_back_where_the_kernels_cannot(ext):
    """A head row the kernels cannot take (300 single elements) with q_scale: rope_ops' torch ops
    write the float8 q, the same bits as the torch backend's."""
    c_api = emulation_c_api()
    qkv = torch.randn(5, 4 * 300)
    api = dict(num_q_heads=2, num_kv_heads=1, head_dim=300, q_scale=0.05)
    with _emulated_cuda(ext), torch.inference_mode():
        c_api.rope_emulated_reset()
        got = rope_ops.qkv_prologue(qkv, torch.arange(5), backend="cuda", **api)
        assert not {n for n in kernels_run(c_api) if n.startswith("prologue")}
        want = rope_ops.qkv_prologue(qkv, torch.arange(5), backend="torch", **api)
    assert got[0].dtype == FP8 and torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


@pytest.mark.skipif(FP8 is None, reason="no float8 in this torch")
def test_module_refuses_inconsistent_float8_q(ext, check_tool):
    """The binding's own guards (rope_ops validates first; these catch misuse of the module): a
    clear error, nothing written."""
    args, _, _ = check_tool.prologue_call(check_tool.Runner(ext, "cpu"), torch.Generator().manual_seed(3),
                                          dtype=torch.bfloat16, style="neox", thd=True, D=64, r=64,
                                          Hq=2, Hk=1, T=4, q_scale=0.5)
    plain_q = torch.zeros(args.q_out.shape, dtype=torch.bfloat16)
    bad = [
        (dict(q_out=plain_q), "q_out must have float8_e4m3fn"),
        (dict(q_scale=0.0), "q_out must have qkv's dtype"),
        (dict(q_scale=-1.0), "q_scale must be"),
        (dict(q_scale=float("nan")), "q_scale must be"),
        (dict(q_scale=float("inf")), "q_scale must be"),
        (dict(q_scale=1e-60), "q_scale must be"),  # 0 in float32
        (dict(inplace=True), "q_scale must be"),
    ]
    for change, message in bad:
        call = args._replace(**change)
        before = call.q_out.clone() if call.q_out is not None else None
        qkv_before = call.qkv.clone()
        with pytest.raises(RuntimeError, match=message):
            ext.prologue(call)
        assert torch.equal(_bits(call.qkv), _bits(qkv_before)), message
        if before is not None:
            assert torch.equal(_bits(call.q_out), _bits(before)), message
    assert ext.prologue(args)  # the consistent call runs
