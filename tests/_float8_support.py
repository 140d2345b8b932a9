"""The float8 (e4m3) KV-cache check shared by the backends' prologue tests: SPEC's rounding of
value / scale, bit for bit, on the backend's device (CPU tensors for the cpu and torch backends
and Triton's interpreter)."""

from __future__ import annotations

import torch

import rope_ops

FP8 = getattr(torch, "float8_e4m3fn", None)


def float8_saturating(x: torch.Tensor) -> torch.Tensor:
    """SPEC's float8 cache rounding: nearest e4m3 value (ties to even), saturating at +-448
    (infinities too), NaN stays NaN. torch's own conversion saturates from 2.13 on; 2.11 gives
    NaN past 448, so the clamp makes this reference independent of the torch version."""
    return x.clamp(-448.0, 448.0).to(FP8)


def float8_test_values(gen: torch.Generator) -> torch.Tensor:
    """8 * 16 * 64 bfloat16 values of random bits, led by e4m3's hard cases: ties, the
    saturation threshold, subnormals, signed zeros, infinities, NaN."""
    bits = torch.randint(0, 1 << 16, (8 * 16 * 64,), generator=gen, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.bfloat16).clone()
    special = torch.tensor([448, 464, 472, 479.9, 480, -480, 2**-9, 2**-10, 3 * 2**-11, 0.0, -0.0,
                            float("inf"), float("-inf"), float("nan"), 1 + 2**-4, 1 + 3 * 2**-4,
                            -(2**-12), 15 * 2**-10, 1000.0, -1000.0])
    values[: special.numel()] = special.to(torch.bfloat16)
    return values


def check_float8_cache(backend_name: str, device: str = "cpu", nan: bool = True) -> None:
    """v / scale rounded to e4m3 bit for bit as float8_saturating rounds it (scales of powers of
    two keep the division exact): ties to even, subnormals, saturation, and NaN unless ``nan`` is
    False (then NaN inputs are not compared)."""
    gen = torch.Generator().manual_seed(6)
    values = float8_test_values(gen)
    tokens, d = 16, 64
    for scale in (1.0, 2.0**-6, 2.0**9):
        for v in values.reshape(8, tokens, d):
            qkv = torch.cat([torch.randn(tokens, 2 * d, generator=gen).bfloat16(), v], -1).to(device)
            k_cache = torch.zeros(tokens, 1, d, dtype=FP8, device=device)
            v_cache = torch.zeros(tokens, 1, d, dtype=FP8, device=device)
            with torch.inference_mode():
                rope_ops.qkv_prologue(qkv, None, num_q_heads=1, num_kv_heads=1, head_dim=d, rotate=False,
                                      kv_cache=(k_cache, v_cache), slots=torch.arange(tokens, device=device),
                                      cache_scales=(1.0, scale), backend=backend_name)
            got = v_cache[:, 0].cpu()
            want = float8_saturating(v.float() / scale)
            is_nan = torch.isnan(v.float())
            if nan:
                assert torch.equal(torch.isnan(got.float()), is_nan), f"scale {scale}: NaN"
            assert torch.equal(got.view(torch.uint8)[~is_nan], want.view(torch.uint8)[~is_nan]), \
                f"scale {scale}"


def check_float8_q(backend_name: str, label: str = "") -> None:
    """qkv_prologue(q_scale=...)'s float8 q, bit for bit against the torch backend's _float8_of
    of value / q_scale: ties to even, subnormals, saturation at +-448 (infinities too), NaN stays
    NaN. Neither norm nor rotation, so that q's float32 values are qkv's own."""
    from rope_ops.backend import _float8_of

    gen = torch.Generator().manual_seed(16)
    values = float8_test_values(gen)
    tokens, d = 16, 64
    for q_scale in (1.0, 2.0**-6, 2.0**9, 0.3):
        for q in values.reshape(8, tokens, d):
            qkv = torch.cat([q, torch.randn(tokens, 2 * d, generator=gen).bfloat16()], -1)
            with torch.inference_mode():
                got, _, _ = rope_ops.qkv_prologue(qkv, None, num_q_heads=1, num_kv_heads=1, head_dim=d,
                                                  rotate=False, q_scale=q_scale, backend=backend_name)
            want = _float8_of(q.float(), q_scale)
            is_nan = torch.isnan(q.float())
            assert torch.equal(torch.isnan(got[:, 0].float()), is_nan), f"{label} q_scale {q_scale}: NaN"
            assert torch.equal(got[:, 0].view(torch.uint8)[~is_nan], want.view(torch.uint8)[~is_nan]), \
                f"{label} q_scale {q_scale}"
