"""Documented limits of ``torch_npu.npu_rotary_mul`` (aclnnRotaryPositionEmbedding on Atlas A2/A3),
checked in Python before calling it, so that tier 2 never hits CANN's tiling error 561002.

Ported from the facts in the project's research notes (§1.1, §1.7: the op-plugin documentation of
npu_rotary_mul, and the "skip" rule of CANN's rotate-half tiling for BNSD inputs). The thresholds
are empirical and may change between CANN releases; they are deliberately conservative.
Pure integer arithmetic: no torch, no torch_npu.

Shapes are 4-D, as npu_rotary_mul sees them: ``x`` is (d0, d1, d2, D) in layout "BSND" (B, S, N, D)
or "BNSD" (B, N, S, D); ``cos`` is the shape of r1/r2 (full width D).
"""

from __future__ import annotations

MAX_D = 896  # D < 896
MAX_BN = 1000  # B < 1000 and N < 1000 (half); B*N < 1000 (interleave)
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}

# SoCs whose npu_rotary_mul goes to aclnnRotaryPositionEmbedding (half and interleave). Older
# chips (910A "Ascend910"/"Ascend910A..", 310P) go to the aclop RotaryMul path: half mode only.
ACLNN_SOC_PREFIXES = ("Ascend910B", "Ascend910_93", "Ascend910C", "Ascend950")


def soc_uses_aclnn(soc_name: str | None) -> bool:
    """True when unknown (we cannot tell): the aclnn limits are the stricter ones anyway."""
    if not soc_name:
        return True
    return soc_name.startswith(ACLNN_SOC_PREFIXES)


def bnsd_skip(b: int, n: int, s: int, d: int, elem_size: int, core_num: int) -> bool:
    """CANN's BNSD "skip" rule (rotate-half tiling): True where the fused op refuses a BNSD input.

    It refuses when D/2 is 32-byte aligned and B*N > 8*S, or when D/2 is unaligned, D < 80 and
    2*B*N > ceil(S / cores).
    """
    half_aligned = (d // 2) * elem_size % 32 == 0
    if half_aligned:
        return b * n > 8 * s
    s_per_core = -(-s // max(core_num, 1))
    return 2 * b * n > s_per_core and d < 80


def rotary_mul_reasons(x_shape: tuple[int, int, int, int], cos_shape: tuple[int, int, int, int], *,
                       layout: str, mode: str, dtype: str, core_num: int = 40,
                       soc_name: str | None = None) -> list[str]:
    """Why npu_rotary_mul cannot take this call; empty: it can."""
    reasons = []
    if dtype not in DTYPE_SIZES:
        reasons.append(f"npu_rotary_mul: dtype {dtype} not in float32/float16/bfloat16")
        return reasons
    if layout not in ("BSND", "BNSD"):
        reasons.append(f"npu_rotary_mul: layout {layout} not handled here")
        return reasons
    if len(x_shape) != 4 or len(cos_shape) != 4:
        reasons.append("npu_rotary_mul: needs 4-D x and cos")
        return reasons
    if min(x_shape) == 0:
        reasons.append("npu_rotary_mul: empty tensor")
        return reasons
    if layout == "BSND":
        b, s, n, d = x_shape
    else:
        b, n, s, d = x_shape
    if cos_shape[3] != d:
        reasons.append(f"npu_rotary_mul: cos last dim {cos_shape[3]} != D {d}")
    if d % 2 != 0:
        reasons.append(f"npu_rotary_mul: D={d} is odd")
    if d >= MAX_D:
        reasons.append(f"npu_rotary_mul: D={d} >= {MAX_D}")
    # Allowed broadcast forms of cos: "S-only", "B and S", "full".
    if layout == "BSND":
        s_only, bs, full = (1, s, 1, d), (b, s, 1, d), (b, s, n, d)
    else:
        s_only, bs, full = (1, 1, s, d), (b, 1, s, d), (b, n, s, d)
    cos_shape = tuple(cos_shape)
    if mode == "half":
        if b >= MAX_BN or n >= MAX_BN:
            reasons.append(f"npu_rotary_mul half: B={b} and N={n} must be < {MAX_BN}")
        if cos_shape not in (s_only, bs, full):
            reasons.append(f"npu_rotary_mul half: cos shape {cos_shape} not in {s_only}, {bs}, {full}")
        if layout == "BNSD":
            elem = DTYPE_SIZES[dtype]
            if bnsd_skip(b, n, s, d, elem, core_num):
                reasons.append("npu_rotary_mul half: BNSD input refused by CANN's skip rule "
                               f"(B*N={b * n}, S={s}, D={d}: error 561002)")
            if d * elem % 32 != 0:
                reasons.append(f"npu_rotary_mul half: BNSD with D={d} not 32-byte aligned (slow path)")
    elif mode == "interleave":
        if not soc_uses_aclnn(soc_name):
            reasons.append(f"npu_rotary_mul interleave: not on {soc_name} (aclop path: half only)")
        if b * n >= MAX_BN:
            reasons.append(f"npu_rotary_mul interleave: B*N={b * n} must be < {MAX_BN}")
        if cos_shape != s_only:
            reasons.append(f"npu_rotary_mul interleave: cos must broadcast over B and N: {s_only}, got {cos_shape}")
    else:
        reasons.append(f"npu_rotary_mul: mode {mode!r} not used by rope_ops")
    return reasons
