"""The fused prologue's kernels (rope_ops.qkv_prologue): QKV split + per-head RMSNorm + RoPE
(+ KV-cache write), and its backward.

A program owns BLOCK_T tokens of the projection's output (one row of qkv per token: Hq q heads,
Hk k heads, Hk v heads, each HEAD_DIM contiguous elements) and walks their heads in chunks
(``prologue_kernel``'s token walk), or owns one chunk (its head grid, for calls too small to
fill the GPU with token blocks). A chunk holds whole heads: the norm's sum of squares is a
``tl.sum`` over the head's pieces in registers. The angles of the program's tokens are computed
once (kernels._angles, every ANGLES kind) and reused for all their heads, as are the norm
weights, loaded once per program.

A head is held as the rope kernel's pieces (kernels.py): its rotary pairs in at most two
power-of-two pieces and the other dims in at most three; without rotation every dim is a
"pass-through" piece (ROTARY_DIM 0). Everything is float32 from the load on and rounded once at
each store (q, k out of place or into qkv, v copied exactly, the cache in its dtype, float8 as
value / scale; out of place, q too may be float8, q / q_scale rounded as the cache is).

The backward (``prologue_backward_kernel``) recomputes each head's statistics from the saved
input, rotates the output gradients back (the transpose: minus the angle), and writes the input
gradient of every head (v's is grad_v) into one new grad_qkv. Its programs walk token blocks
pid, pid + programs, ... (a runtime loop, software-pipelined by triton with STAGES > 1: the next
block's reads copied asynchronously into shared memory while one is computed). The norm weights'
gradients are accumulated in the chunks' shape ([BLOCK_T, BH, W] per piece: a multiply-add per
element, no reduction across lanes or warps per chunk), summed over tokens and heads once per
program into rows of a float32 [programs, HEAD_DIM] buffer, which ``weight_grad_kernel`` adds up:
deterministic, no atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import _angles, _load_chunk, _rotate_pairs, _store_chunk, _tokens

# CACHE kinds (the constexpr of the same name).
CACHE_NONE = tl.constexpr(0)
CACHE_SAME = tl.constexpr(1)  # the cache has qkv's dtype: the values as stored in k / v
CACHE_SCALED = tl.constexpr(2)  # float8: value / scale, rounded once
# As CACHE_SCALED, for the interpreter: its float32 -> e4m3 conversion drops the carry of a
# mantissa that rounds up (1.96 -> 1.0), so values are rounded onto the e4m3 grid first (exactly,
# in float32) and its conversion has nothing left to round.
CACHE_SCALED_GRID = tl.constexpr(3)
E4M3_MIN_EXPONENT = tl.constexpr(-6)
E4M3_MANTISSA_BITS = tl.constexpr(3)
E4M3_MAX = tl.constexpr(448.0)
RINT_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (y + it) - it rounds |y| < 2^22 to even


# ---------------------------------------------------------------------------------------------
# Heads as pieces.


@triton.jit
def _zero_head(BT: tl.constexpr, BH: tl.constexpr, ROT_A: tl.constexpr, ROT_B: tl.constexpr,
               PASS_A: tl.constexpr, PASS_B: tl.constexpr, PASS_C: tl.constexpr):
    """Float32 zeros shaped as _load_chunk's pieces (a gradient that is None)."""
    z = tl.zeros([BT, BH, 1], tl.float32)
    xa, xb, pa, pb, pc = z, z, z, z, z
    if ROT_A > 0:
        xa = tl.zeros([BT, BH, ROT_A], tl.float32)
    if ROT_B > 0:
        xb = tl.zeros([BT, BH, ROT_B], tl.float32)
    if PASS_A > 0:
        pa = tl.zeros([BT, BH, PASS_A], tl.float32)
    if PASS_B > 0:
        pb = tl.zeros([BT, BH, PASS_B], tl.float32)
    if PASS_C > 0:
        pc = tl.zeros([BT, BH, PASS_C], tl.float32)
    return xa, xa, xb, xb, pa, pb, pc


@triton.jit
def _f32(x):
    return x.to(tl.float32)


@triton.jit
def _pair_dims(OFF: tl.constexpr, W: tl.constexpr, HALF: tl.constexpr,
               INTERLEAVED: tl.constexpr):
    """The head dims of pairs [OFF, OFF + W): (x dims, y dims, mask of pairs < HALF)."""
    i = OFF + tl.arange(0, W)
    if INTERLEAVED:
        dx = 2 * i
        dy = 2 * i + 1
    else:
        dx = i
        dy = i + HALF
    return dx, dy, i < HALF


@triton.jit
def _weights(w_ptr, s_w, w_offset, HALF: tl.constexpr, ROT_A: tl.constexpr,
             ROT_B: tl.constexpr, ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr,
             PASS_A: tl.constexpr, PASS_B: tl.constexpr, PASS_C: tl.constexpr,
             INTERLEAVED: tl.constexpr):
    """float32 (w_offset + weight) [W] for each of _load_chunk's pieces (0 where masked)."""
    if PASS_A > 0:
        d = ROTARY_DIM + tl.arange(0, PASS_A)
        wpa = tl.load(w_ptr + d * s_w, mask=d < HEAD_DIM, other=0.0).to(tl.float32) + w_offset
    if ROT_A > 0:
        dx, dy, m = _pair_dims(0, ROT_A, HALF, INTERLEAVED)
        wxa = tl.load(w_ptr + dx * s_w, mask=m, other=0.0).to(tl.float32) + w_offset
        wya = tl.load(w_ptr + dy * s_w, mask=m, other=0.0).to(tl.float32) + w_offset
    else:
        wxa, wya = wpa, wpa
    if PASS_A == 0:
        wpa = wxa
    wxb, wyb, wpb, wpc = wxa, wya, wpa, wpa
    if ROT_B > 0:
        dx, dy, m = _pair_dims(ROT_A, ROT_B, HALF, INTERLEAVED)
        wxb = tl.load(w_ptr + dx * s_w, mask=m, other=0.0).to(tl.float32) + w_offset
        wyb = tl.load(w_ptr + dy * s_w, mask=m, other=0.0).to(tl.float32) + w_offset
    if PASS_B > 0:
        d = ROTARY_DIM + PASS_A + tl.arange(0, PASS_B)
        wpb = tl.load(w_ptr + d * s_w, mask=d < HEAD_DIM, other=0.0).to(tl.float32) + w_offset
    if PASS_C > 0:
        d = ROTARY_DIM + PASS_A + PASS_B + tl.arange(0, PASS_C)
        wpc = tl.load(w_ptr + d * s_w, mask=d < HEAD_DIM, other=0.0).to(tl.float32) + w_offset
    return wxa, wya, wxb, wyb, wpa, wpb, wpc


@triton.jit
def _sum_last(x):
    return tl.sum(x, axis=2)


@triton.jit
def _head_sum(xa, ya, xb, yb, pa, pb, pc, ROT_A: tl.constexpr, ROT_B: tl.constexpr,
              PASS_A: tl.constexpr, PASS_B: tl.constexpr, PASS_C: tl.constexpr):
    """[BLOCK_T, BH] float32: the sum over a head's dims of pieces (masked lanes hold 0)."""
    if ROT_A > 0:
        total = _sum_last(xa) + _sum_last(ya)
        if PASS_A > 0:
            total += _sum_last(pa)
    else:
        total = _sum_last(pa)
    if ROT_B > 0:
        total += _sum_last(xb) + _sum_last(yb)
    if PASS_B > 0:
        total += _sum_last(pb)
    if PASS_C > 0:
        total += _sum_last(pc)
    return total


@triton.jit
def _rstd(xa, ya, xb, yb, pa, pb, pc, eps, HEAD_DIM: tl.constexpr, ROT_A: tl.constexpr,
          ROT_B: tl.constexpr, PASS_A: tl.constexpr, PASS_B: tl.constexpr,
          PASS_C: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) per (token, head), float32 pieces in, correctly rounded steps."""
    ss = _head_sum(xa * xa, ya * ya, xb * xb, yb * yb, pa * pa, pb * pb, pc * pc, ROT_A, ROT_B,
                   PASS_A, PASS_B, PASS_C)
    mean = tl.div_rn(ss, tl.full(ss.shape, HEAD_DIM, tl.float32))
    root = tl.sqrt_rn(mean + eps)
    return tl.div_rn(tl.full(ss.shape, 1.0, tl.float32), root)


@triton.jit
def _scaled(x, rstd, w):
    """x * rstd * w: x [BLOCK_T, BH, W], rstd [BLOCK_T, BH], w [W]."""
    return x * rstd[:, :, None] * w[None, None, :]


@triton.jit
def _divided(x, scale, CACHE: tl.constexpr):
    """x / scale, correctly rounded (the cache holds value / scale), within +-448 (NaN stays
    NaN); for CACHE_SCALED_GRID rounded to the nearest e4m3 value (ties to even) as well."""
    y = tl.div_rn(x.to(tl.float32), tl.zeros(x.shape, tl.float32) + scale)
    # saturate (SPEC): the conversion alone may give NaN past the largest finite e4m3
    y = tl.clamp(y, -E4M3_MAX, E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    if CACHE == CACHE_SCALED_GRID:
        exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        exponent = tl.maximum(exponent, E4M3_MIN_EXPONENT) - E4M3_MANTISSA_BITS
        ulp = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
        r = ((y / ulp + RINT_MAGIC) - RINT_MAGIC) * ulp  # y / ulp, * ulp: exact (powers of 2)
        y = tl.where(r == 0.0, y * 0.0, r)  # a value rounded to zero keeps its sign
    return y


# ---------------------------------------------------------------------------------------------
# Forward.


@triton.jit
def _store_cache(xa, ya, xb, yb, pa, pb, pc, c_ptr, row_c, cmask, h0, n_heads, sc_h, c_scale,
                 CACHE: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, HALF: tl.constexpr,
                 ROT_A: tl.constexpr, ROT_B: tl.constexpr, ROTARY_DIM: tl.constexpr,
                 HEAD_DIM: tl.constexpr, PASS_A: tl.constexpr, PASS_B: tl.constexpr,
                 PASS_C: tl.constexpr, INTERLEAVED: tl.constexpr):
    """A chunk of k or v heads written to the cache at its tokens' slots (cmask): the values as
    stored in k / v, or value / scale (float8)."""
    if CACHE == CACHE_SAME:
        _store_chunk(xa, ya, xb, yb, pa, pb, pc, c_ptr, row_c, cmask, h0, n_heads, sc_h, 1, BT,
                     BH, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                     INTERLEAVED, True)
    elif CACHE != CACHE_NONE:
        _store_chunk(_divided(xa, c_scale, CACHE), _divided(ya, c_scale, CACHE),
                     _divided(xb, c_scale, CACHE), _divided(yb, c_scale, CACHE),
                     _divided(pa, c_scale, CACHE), _divided(pb, c_scale, CACHE),
                     _divided(pc, c_scale, CACHE), c_ptr, row_c, cmask, h0, n_heads, sc_h, 1, BT,
                     BH, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                     INTERLEAVED, True)


@triton.jit
def _finish_qk(xa, ya, xb, yb, pa, pb, pc, ca, sa, cb, sb, w_ptr, s_w, w_offset, eps, out_ptr,
               row_out, so_h, tmask, h0, n_heads, c_ptr, row_c, sc_h, cmask, c_scale, o_scale,
               NORM: tl.constexpr, ROTATE: tl.constexpr, CACHE: tl.constexpr,
               OUT: tl.constexpr, BT: tl.constexpr,
               BH: tl.constexpr, HALF: tl.constexpr, ROT_A: tl.constexpr, ROT_B: tl.constexpr,
               ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, PASS_A: tl.constexpr,
               PASS_B: tl.constexpr, PASS_C: tl.constexpr, INTERLEAVED: tl.constexpr):
    """A chunk of q or k heads: normalised (NORM; the weights loaded for each chunk: L1 hits),
    rotated (ROTATE), stored (OUT: a CACHE kind, CACHE_NONE in the output's dtype, float8 as
    value / o_scale rounded as the cache), and written to the cache at its tokens' slots (k,
    CACHE)."""
    if NORM:
        wxa, wya, wxb, wyb, wpa, wpb, wpc = _weights(w_ptr, s_w, w_offset, HALF, ROT_A, ROT_B,
                                                     ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B,
                                                     PASS_C, INTERLEAVED)
        xa, ya, xb, yb = _f32(xa), _f32(ya), _f32(xb), _f32(yb)
        pa, pb, pc = _f32(pa), _f32(pb), _f32(pc)
        rstd = _rstd(xa, ya, xb, yb, pa, pb, pc, eps, HEAD_DIM, ROT_A, ROT_B, PASS_A, PASS_B,
                     PASS_C)
        if ROT_A > 0:
            xa = _scaled(xa, rstd, wxa)
            ya = _scaled(ya, rstd, wya)
        if ROT_B > 0:
            xb = _scaled(xb, rstd, wxb)
            yb = _scaled(yb, rstd, wyb)
        if PASS_A > 0:
            pa = _scaled(pa, rstd, wpa)
        if PASS_B > 0:
            pb = _scaled(pb, rstd, wpb)
        if PASS_C > 0:
            pc = _scaled(pc, rstd, wpc)
    if ROTATE:
        xa, ya = _rotate_pairs(xa, ya, ca, sa)
        if ROT_B > 0:
            xb, yb = _rotate_pairs(xb, yb, cb, sb)
    if OUT == CACHE_NONE:
        _store_chunk(xa, ya, xb, yb, pa, pb, pc, out_ptr, row_out, tmask, h0, n_heads, so_h, 1,
                     BT, BH, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                     INTERLEAVED, True)
    else:
        _store_chunk(_divided(xa, o_scale, OUT), _divided(ya, o_scale, OUT),
                     _divided(xb, o_scale, OUT), _divided(yb, o_scale, OUT),
                     _divided(pa, o_scale, OUT), _divided(pb, o_scale, OUT),
                     _divided(pc, o_scale, OUT), out_ptr, row_out, tmask, h0, n_heads, so_h, 1,
                     BT, BH, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                     INTERLEAVED, True)
    _store_cache(xa, ya, xb, yb, pa, pb, pc, c_ptr, row_c, cmask, h0, n_heads, sc_h, c_scale,
                 CACHE, BT, BH, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                 INTERLEAVED)


@triton.jit
def _finish_v(xa, ya, xb, yb, pa, pb, pc, out_ptr, row_out, so_h, tmask, h0, n_heads, c_ptr,
              row_c, sc_h, cmask, c_scale, STORE_V: tl.constexpr, CACHE: tl.constexpr,
              BT: tl.constexpr, BH: tl.constexpr, HALF: tl.constexpr, ROT_A: tl.constexpr,
              ROT_B: tl.constexpr, ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr,
              PASS_A: tl.constexpr, PASS_B: tl.constexpr, PASS_C: tl.constexpr,
              INTERLEAVED: tl.constexpr):
    """A chunk of v heads: copied as read (STORE_V), and written to the cache."""
    if STORE_V:
        _store_chunk(xa, ya, xb, yb, pa, pb, pc, out_ptr, row_out, tmask, h0, n_heads, so_h, 1,
                     BT, BH, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                     INTERLEAVED, True)
    _store_cache(xa, ya, xb, yb, pa, pb, pc, c_ptr, row_c, cmask, h0, n_heads, sc_h, c_scale,
                 CACHE, BT, BH, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                 INTERLEAVED)


@triton.jit
def _load_group(ci: tl.constexpr, NQC: tl.constexpr, NKC: tl.constexpr, x_ptr, row_x, tmask,
                HQ: tl.constexpr, HK: tl.constexpr, BT: tl.constexpr, BLOCK_HQ: tl.constexpr,
                BLOCK_HK: tl.constexpr, HALF: tl.constexpr, ROT_A: tl.constexpr,
                ROT_B: tl.constexpr, ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr,
                PASS_A: tl.constexpr, PASS_B: tl.constexpr, PASS_C: tl.constexpr,
                INTERLEAVED: tl.constexpr):
    """Chunk ci of the walk: q chunks, then k chunks, then v chunks (heads of one qkv row)."""
    if ci < NQC:
        chunk = _load_chunk(x_ptr, row_x, tmask, ci * BLOCK_HQ, HQ, HEAD_DIM, 1, BT, BLOCK_HQ,
                            HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                            INTERLEAVED, True)
    elif ci < NQC + NKC:
        chunk = _load_chunk(x_ptr + HQ * HEAD_DIM, row_x, tmask, (ci - NQC) * BLOCK_HK, HK,
                            HEAD_DIM, 1, BT, BLOCK_HK, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM,
                            PASS_A, PASS_B, PASS_C, INTERLEAVED, True)
    else:
        chunk = _load_chunk(x_ptr + (HQ + HK) * HEAD_DIM, row_x, tmask,
                            (ci - NQC - NKC) * BLOCK_HK, HK, HEAD_DIM, 1, BT, BLOCK_HK, HALF,
                            ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                            INTERLEAVED, True)
    return chunk


@triton.jit(do_not_specialize=["n_tokens", "seq_len", "pos_offset", "n_rows", "n_slots"])
def prologue_kernel(
    # the data: qkv rows and where q, k, v go (out of place, or views of qkv in place)
    x_ptr, qo_ptr, ko_ptr, vo_ptr, n_tokens, seq_len, sx_b, sx_s,
    sqo_b, sqo_s, sqo_h, sko_b, sko_s, sko_h, svo_b, svo_s, svo_h,
    # the norm: weights [HEAD_DIM] (any float dtype), eps, weight offset
    qw_ptr, kw_ptr, s_qw, s_kw, eps, w_offset,
    # the cache: [n_slots, HK, HEAD_DIM] each, a slot per token, scales (float8)
    kc_ptr, vc_ptr, slot_ptr, n_slots, skc_n, skc_h, svc_n, svc_h, ssl_b, ssl_s, k_scale,
    v_scale,
    # float8 q (Q_FP8): q_out holds q / q_scale
    q_scale,
    # the angle source, as rope_kernel's
    pos_ptr, cos_ptr, sin_ptr, turns_ptr, pos_offset, attn_factor, n_rows, sp_b, sp_s,
    sc_row, ss_row, sp_a, sc_b, ss_b,
    # what the call is
    HQ: tl.constexpr, HK: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, TOK_SPLIT: tl.constexpr, ROTATE: tl.constexpr,
    ANGLES: tl.constexpr, HAS_POS: tl.constexpr, HAS_TURNS: tl.constexpr,
    MROPE_S1: tl.constexpr, MROPE_S2: tl.constexpr, MROPE_INTERLEAVED: tl.constexpr,
    LIBDEVICE: tl.constexpr, Q_NORM: tl.constexpr, K_NORM: tl.constexpr, STORE_V: tl.constexpr,
    CACHE: tl.constexpr,
    # q's store: CACHE_NONE (q_out's dtype) or a float8 CACHE kind, rounded as the cache is
    Q_FP8: tl.constexpr,
    # pieces (ROTARY_DIM 0 without rotation: all dims pass-through pieces)
    ROT_A: tl.constexpr, ROT_B: tl.constexpr, PASS_A: tl.constexpr, PASS_B: tl.constexpr,
    PASS_C: tl.constexpr,
    # the launch configuration
    HEAD_GRID: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    HALF: tl.constexpr = ROTARY_DIM // 2
    NQC: tl.constexpr = (HQ + BLOCK_HQ - 1) // BLOCK_HQ
    NKC: tl.constexpr = (HK + BLOCK_HK - 1) // BLOCK_HK
    NVC: tl.constexpr = NKC if (STORE_V or CACHE != CACHE_NONE) else 0
    NC: tl.constexpr = NQC + NKC + NVC

    pid = tl.program_id(0)
    if HEAD_GRID:
        ci = pid % NC
        pid = pid // NC
    b, sq, tmask = _tokens(pid, n_tokens, seq_len, BLOCK_T, TOK_SPLIT)
    row_x = b * sx_b + sq * sx_s
    row_qo = b * sqo_b + sq * sqo_s
    row_ko = b * sko_b + sq * sko_s
    row_vo = b * svo_b + sq * svo_s
    if CACHE != CACHE_NONE:
        # Slots outside [0, n_slots) are skipped: never a write outside the cache.
        slot = tl.load(slot_ptr + (b * ssl_b + sq * ssl_s), mask=tmask, other=-1).to(tl.int64)
        cmask = tmask & (slot >= 0) & (slot < n_slots)
        slot = tl.where(cmask, slot, 0)
        row_kc = slot * skc_n
        row_vc = slot * svc_n
    else:
        cmask, row_kc, row_vc = tmask, row_x, row_x

    if HEAD_GRID:
        if ci < NQC:
            _grid_qk(0, x_ptr, row_x, qo_ptr, row_qo, sqo_h, tmask, ci * BLOCK_HQ, HQ, qw_ptr,
                     s_qw, w_offset, eps, kc_ptr, row_kc, skc_h, cmask, k_scale, q_scale,
                     pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq, sp_a, sp_b, sp_s, pos_offset,
                     n_rows, sc_b, sc_row, ss_b, ss_row, attn_factor, Q_NORM, ROTATE, CACHE_NONE,
                     Q_FP8, ANGLES, HAS_POS, HAS_TURNS, MROPE_S1, MROPE_S2, MROPE_INTERLEAVED,
                     LIBDEVICE, BLOCK_T, BLOCK_HQ, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM,
                     PASS_A, PASS_B, PASS_C, INTERLEAVED)
        elif ci < NQC + NKC:
            _grid_qk(HQ * HEAD_DIM, x_ptr, row_x, ko_ptr, row_ko, sko_h, tmask,
                     (ci - NQC) * BLOCK_HK, HK, kw_ptr, s_kw, w_offset, eps, kc_ptr, row_kc,
                     skc_h, cmask, k_scale, q_scale, pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq,
                     sp_a, sp_b, sp_s, pos_offset, n_rows, sc_b, sc_row, ss_b, ss_row,
                     attn_factor, K_NORM, ROTATE, CACHE, CACHE_NONE, ANGLES, HAS_POS, HAS_TURNS,
                     MROPE_S1, MROPE_S2, MROPE_INTERLEAVED, LIBDEVICE, BLOCK_T, BLOCK_HK, HALF,
                     ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C, INTERLEAVED)
        else:
            h0 = (ci - NQC - NKC) * BLOCK_HK
            xa, ya, xb, yb, pa, pb, pc = _load_chunk(
                x_ptr + (HQ + HK) * HEAD_DIM, row_x, tmask, h0, HK, HEAD_DIM, 1, BLOCK_T,
                BLOCK_HK, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                INTERLEAVED, True)
            _finish_v(xa, ya, xb, yb, pa, pb, pc, vo_ptr, row_vo, svo_h, tmask, h0, HK, vc_ptr,
                      row_vc, svc_h, cmask, v_scale, STORE_V, CACHE, BLOCK_T, BLOCK_HK, HALF,
                      ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C, INTERLEAVED)
        return

    # Token walk: as rope_kernel's (chunk 0 loaded before the angles, chunk c + 1 before chunk
    # c is finished; chunks never overlap, so this is safe in place). The angles are computed
    # once for all the tokens' heads; the weights are loaded for each chunk (_finish_qk; L1
    # hits: keeping them in registers for the whole walk costs ~25 registers per thread at
    # D 128).
    xa, ya, xb, yb, pa, pb, pc = _load_group(
        0, NQC, NKC, x_ptr, row_x, tmask, HQ, HK, BLOCK_T, BLOCK_HQ, BLOCK_HK, HALF, ROT_A,
        ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C, INTERLEAVED)
    ca, sa, cb, sb = eps, eps, eps, eps  # unused without rotation
    if ROTATE:
        ca, sa, cb, sb = _angles(pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq, tmask, sp_a, sp_b,
                                 sp_s, pos_offset, n_rows, sc_b, sc_row, ss_b, ss_row,
                                 attn_factor, ANGLES, HALF, ROT_A, ROT_B, HAS_POS, HAS_TURNS,
                                 MROPE_S1, MROPE_S2, MROPE_INTERLEAVED, LIBDEVICE, False)
    for ci in tl.static_range(NC):
        if ci + 1 < NC:
            nxa, nya, nxb, nyb, npa, npb, npc = _load_group(
                ci + 1, NQC, NKC, x_ptr, row_x, tmask, HQ, HK, BLOCK_T, BLOCK_HQ, BLOCK_HK, HALF,
                ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C, INTERLEAVED)
        if ci < NQC:
            _finish_qk(xa, ya, xb, yb, pa, pb, pc, ca, sa, cb, sb, qw_ptr, s_qw, w_offset, eps,
                       qo_ptr, row_qo, sqo_h, tmask, ci * BLOCK_HQ, HQ, kc_ptr, row_kc, skc_h,
                       cmask, k_scale, q_scale, Q_NORM, ROTATE, CACHE_NONE, Q_FP8, BLOCK_T,
                       BLOCK_HQ, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                       INTERLEAVED)
        elif ci < NQC + NKC:
            _finish_qk(xa, ya, xb, yb, pa, pb, pc, ca, sa, cb, sb, kw_ptr, s_kw, w_offset, eps,
                       ko_ptr, row_ko, sko_h, tmask, (ci - NQC) * BLOCK_HK, HK, kc_ptr, row_kc,
                       skc_h, cmask, k_scale, q_scale, K_NORM, ROTATE, CACHE, CACHE_NONE,
                       BLOCK_T, BLOCK_HK, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A,
                       PASS_B, PASS_C, INTERLEAVED)
        else:
            _finish_v(xa, ya, xb, yb, pa, pb, pc, vo_ptr, row_vo, svo_h, tmask,
                      (ci - NQC - NKC) * BLOCK_HK, HK, vc_ptr, row_vc, svc_h, cmask, v_scale,
                      STORE_V, CACHE, BLOCK_T, BLOCK_HK, HALF, ROT_A, ROT_B, ROTARY_DIM,
                      HEAD_DIM, PASS_A, PASS_B, PASS_C, INTERLEAVED)
        if ci + 1 < NC:
            xa, ya, xb, yb, pa, pb, pc = nxa, nya, nxb, nyb, npa, npb, npc


@triton.jit
def _grid_qk(head_offset: tl.constexpr, x_ptr, row_x, out_ptr, row_out, so_h, tmask, h0,
             n_heads, w_ptr, s_w, w_offset, eps, c_ptr, row_c, sc_h, cmask, c_scale, o_scale,
             pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq, sp_a, sp_b, sp_s, pos_offset, n_rows,
             sc_b, sc_row, ss_b, ss_row, attn_factor, NORM: tl.constexpr, ROTATE: tl.constexpr,
             CACHE: tl.constexpr, OUT: tl.constexpr, ANGLES: tl.constexpr, HAS_POS: tl.constexpr,
             HAS_TURNS: tl.constexpr, MROPE_S1: tl.constexpr, MROPE_S2: tl.constexpr,
             MROPE_INTERLEAVED: tl.constexpr, LIBDEVICE: tl.constexpr, BT: tl.constexpr,
             BH: tl.constexpr, HALF: tl.constexpr, ROT_A: tl.constexpr, ROT_B: tl.constexpr,
             ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, PASS_A: tl.constexpr,
             PASS_B: tl.constexpr, PASS_C: tl.constexpr, INTERLEAVED: tl.constexpr):
    """A head-grid program of q or k heads: its chunk's loads go out before the angles'."""
    xa, ya, xb, yb, pa, pb, pc = _load_chunk(
        x_ptr + head_offset, row_x, tmask, h0, n_heads, HEAD_DIM, 1, BT, BH, HALF, ROT_A, ROT_B,
        ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C, INTERLEAVED, True)
    ca, sa, cb, sb = eps, eps, eps, eps
    if ROTATE:
        ca, sa, cb, sb = _angles(pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq, tmask, sp_a, sp_b,
                                 sp_s, pos_offset, n_rows, sc_b, sc_row, ss_b, ss_row,
                                 attn_factor, ANGLES, HALF, ROT_A, ROT_B, HAS_POS, HAS_TURNS,
                                 MROPE_S1, MROPE_S2, MROPE_INTERLEAVED, LIBDEVICE, False)
    _finish_qk(xa, ya, xb, yb, pa, pb, pc, ca, sa, cb, sb, w_ptr, s_w, w_offset, eps, out_ptr,
               row_out, so_h, tmask, h0, n_heads, c_ptr, row_c, sc_h, cmask, c_scale, o_scale,
               NORM, ROTATE, CACHE, OUT, BT, BH, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A,
               PASS_B, PASS_C, INTERLEAVED)


# ---------------------------------------------------------------------------------------------
# Backward.


@triton.jit
def _bwd_load(ci: tl.constexpr, NQC: tl.constexpr, NKC: tl.constexpr, x_ptr, row_x, tmask,
              gq_ptr, row_gq, sgq_h, sgq_d, gk_ptr, row_gk, sgk_h, sgk_d, gv_ptr, row_gv, sgv_h,
              sgv_d, HQ: tl.constexpr, HK: tl.constexpr, Q_NORM: tl.constexpr,
              K_NORM: tl.constexpr, HAS_GQ: tl.constexpr, HAS_GK: tl.constexpr,
              HAS_GV: tl.constexpr, G_CONTIG: tl.constexpr, BT: tl.constexpr,
              BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HALF: tl.constexpr,
              ROT_A: tl.constexpr, ROT_B: tl.constexpr, ROTARY_DIM: tl.constexpr,
              HEAD_DIM: tl.constexpr, PASS_A: tl.constexpr, PASS_B: tl.constexpr,
              PASS_C: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Chunk ci's reads, in their dtypes: (output gradient pieces, input pieces); q chunks, then
    k, then v (no input: its gradient is grad_v). A gradient that is None is float32 zeros; an
    input that is not read (no gradient, no norm, v) repeats the gradient's pieces, unused."""
    if ci < NQC:
        h0 = ci * BLOCK_HQ
        BH: tl.constexpr = BLOCK_HQ
        HAS_G: tl.constexpr = HAS_GQ
        NORM: tl.constexpr = Q_NORM
        g_ptr, row_g, sg_h, sg_d, n_heads, xh_ptr = gq_ptr, row_gq, sgq_h, sgq_d, HQ, x_ptr
    elif ci < NQC + NKC:
        h0 = (ci - NQC) * BLOCK_HK
        BH: tl.constexpr = BLOCK_HK
        HAS_G: tl.constexpr = HAS_GK
        NORM: tl.constexpr = K_NORM
        g_ptr, row_g, sg_h, sg_d, n_heads = gk_ptr, row_gk, sgk_h, sgk_d, HK
        xh_ptr = x_ptr + HQ * HEAD_DIM
    else:
        h0 = (ci - NQC - NKC) * BLOCK_HK
        BH: tl.constexpr = BLOCK_HK
        HAS_G: tl.constexpr = HAS_GV
        NORM: tl.constexpr = False
        g_ptr, row_g, sg_h, sg_d, n_heads, xh_ptr = gv_ptr, row_gv, sgv_h, sgv_d, HK, x_ptr
    gxa, gya, gxb, gyb, gpa, gpb, gpc = _zero_head(BT, BH, ROT_A, ROT_B, PASS_A, PASS_B, PASS_C)
    if HAS_G:
        gxa, gya, gxb, gyb, gpa, gpb, gpc = _load_chunk(
            g_ptr, row_g, tmask, h0, n_heads, sg_h, sg_d, BT, BH, HALF, ROT_A, ROT_B, ROTARY_DIM,
            HEAD_DIM, PASS_A, PASS_B, PASS_C, INTERLEAVED, G_CONTIG)
    xa, ya, xb, yb, pa, pb, pc = gxa, gya, gxb, gyb, gpa, gpb, gpc
    if HAS_G and NORM:
        xa, ya, xb, yb, pa, pb, pc = _load_chunk(
            xh_ptr, row_x, tmask, h0, n_heads, HEAD_DIM, 1, BT, BH, HALF, ROT_A, ROT_B,
            ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C, INTERLEAVED, True)
    return gxa, gya, gxb, gyb, gpa, gpb, gpc, xa, ya, xb, yb, pa, pb, pc


@triton.jit
def _backward_qk(gxa, gya, gxb, gyb, gpa, gpb, gpc, xa, ya, xb, yb, pa, pb, pc, dx_ptr, row_dx,
                 tmask, h0, n_heads, ca, sa, cb, sb, w_ptr, s_w, w_offset, eps,
                 axa, aya, axb, ayb, apa, apb, apc, NORM: tl.constexpr, HAS_G: tl.constexpr,
                 ROTATE: tl.constexpr, BT: tl.constexpr,
                 BH: tl.constexpr, HALF: tl.constexpr, ROT_A: tl.constexpr, ROT_B: tl.constexpr,
                 ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, PASS_A: tl.constexpr,
                 PASS_B: tl.constexpr, PASS_C: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Input gradient of a chunk of q or k heads (its reads from _bwd_load), stored into
    grad_qkv; returns the weight gradient accumulators (a*, [BLOCK_T, BH, W] float32, the
    chunk's shape: summed over tokens and heads once, at the end) plus g * normalised x."""
    if HAS_G:
        gxa, gya, gxb, gyb = _f32(gxa), _f32(gya), _f32(gxb), _f32(gyb)
        gpa, gpb, gpc = _f32(gpa), _f32(gpb), _f32(gpc)
        if ROTATE:  # the rotation's transpose: ca, sa, cb, sb are the inverse angles
            gxa, gya = _rotate_pairs(gxa, gya, ca, sa)
            if ROT_B > 0:
                gxb, gyb = _rotate_pairs(gxb, gyb, cb, sb)
        if NORM:  # loaded per chunk (L1 hits), as in the forward
            wxa, wya, wxb, wyb, wpa, wpb, wpc = _weights(w_ptr, s_w, w_offset, HALF, ROT_A,
                                                         ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A,
                                                         PASS_B, PASS_C, INTERLEAVED)
            xa, ya, xb, yb = _f32(xa), _f32(ya), _f32(xb), _f32(yb)
            pa, pb, pc = _f32(pa), _f32(pb), _f32(pc)
            rstd = _rstd(xa, ya, xb, yb, pa, pb, pc, eps, HEAD_DIM, ROT_A, ROT_B, PASS_A,
                         PASS_B, PASS_C)
            r3 = rstd[:, :, None]
            # n = x rstd; the weight's gradient sums g n; with gn = g (offset + w),
            # dx = rstd (gn - n mean(gn n)).
            xa, ya, xb, yb = xa * r3, ya * r3, xb * r3, yb * r3
            pa, pb, pc = pa * r3, pb * r3, pc * r3
            if ROT_A > 0:
                axa += gxa * xa
                aya += gya * ya
                gxa = gxa * wxa[None, None, :]
                gya = gya * wya[None, None, :]
            if ROT_B > 0:
                axb += gxb * xb
                ayb += gyb * yb
                gxb = gxb * wxb[None, None, :]
                gyb = gyb * wyb[None, None, :]
            if PASS_A > 0:
                apa += gpa * pa
                gpa = gpa * wpa[None, None, :]
            if PASS_B > 0:
                apb += gpb * pb
                gpb = gpb * wpb[None, None, :]
            if PASS_C > 0:
                apc += gpc * pc
                gpc = gpc * wpc[None, None, :]
            dot = _head_sum(gxa * xa, gya * ya, gxb * xb, gyb * yb, gpa * pa, gpb * pb, gpc * pc,
                            ROT_A, ROT_B, PASS_A, PASS_B, PASS_C)
            mean = tl.div_rn(dot, tl.full(dot.shape, HEAD_DIM, tl.float32))[:, :, None]
            gxa, gya = r3 * (gxa - xa * mean), r3 * (gya - ya * mean)
            gxb, gyb = r3 * (gxb - xb * mean), r3 * (gyb - yb * mean)
            gpa, gpb, gpc = r3 * (gpa - pa * mean), r3 * (gpb - pb * mean), r3 * (gpc - pc * mean)
    _store_chunk(gxa, gya, gxb, gyb, gpa, gpb, gpc, dx_ptr, row_dx, tmask, h0, n_heads, HEAD_DIM,
                 1, BT, BH, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                 INTERLEAVED, True)
    return axa, aya, axb, ayb, apa, apb, apc


@triton.jit
def _total(a):
    """[W]: an accumulator [BLOCK_T, BH, W] summed over its tokens and heads."""
    return tl.sum(tl.sum(a, axis=1), axis=0)


@triton.jit
def _store_weight_grads(ptr, axa, aya, axb, ayb, apa, apb, apc, HALF: tl.constexpr,
                        ROT_A: tl.constexpr, ROT_B: tl.constexpr, ROTARY_DIM: tl.constexpr,
                        HEAD_DIM: tl.constexpr, PASS_A: tl.constexpr, PASS_B: tl.constexpr,
                        PASS_C: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The program's row of weight-gradient partial sums (the accumulators [BLOCK_T, BH, W]
    summed over their tokens and heads), each piece at its head dims."""
    if ROT_A > 0:
        dx, dy, m = _pair_dims(0, ROT_A, HALF, INTERLEAVED)
        tl.store(ptr + dx, _total(axa), mask=m)
        tl.store(ptr + dy, _total(aya), mask=m)
    if ROT_B > 0:
        dx, dy, m = _pair_dims(ROT_A, ROT_B, HALF, INTERLEAVED)
        tl.store(ptr + dx, _total(axb), mask=m)
        tl.store(ptr + dy, _total(ayb), mask=m)
    if PASS_A > 0:
        d = ROTARY_DIM + tl.arange(0, PASS_A)
        tl.store(ptr + d, _total(apa), mask=d < HEAD_DIM)
    if PASS_B > 0:
        d = ROTARY_DIM + PASS_A + tl.arange(0, PASS_B)
        tl.store(ptr + d, _total(apb), mask=d < HEAD_DIM)
    if PASS_C > 0:
        d = ROTARY_DIM + PASS_A + PASS_B + tl.arange(0, PASS_C)
        tl.store(ptr + d, _total(apc), mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=["n_tokens", "seq_len", "pos_offset", "n_rows"])
def prologue_backward_kernel(
    # the data: the forward's input, grad_qkv (contiguous rows), output gradients [B, S, H, D]
    x_ptr, dx_ptr, gq_ptr, gk_ptr, gv_ptr, n_tokens, seq_len, sx_b, sx_s, sdx_b, sdx_s,
    sgq_b, sgq_s, sgq_h, sgq_d, sgk_b, sgk_s, sgk_h, sgk_d, sgv_b, sgv_s, sgv_h, sgv_d,
    # the norm, and the weight gradients' partial sums [programs, HEAD_DIM] float32
    qw_ptr, kw_ptr, s_qw, s_kw, eps, w_offset, dqw_ptr, dkw_ptr,
    # the angle source, as rope_kernel's
    pos_ptr, cos_ptr, sin_ptr, turns_ptr, pos_offset, attn_factor, n_rows, sp_b, sp_s,
    sc_row, ss_row, sp_a, sc_b, ss_b,
    # what the call is
    HQ: tl.constexpr, HK: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, TOK_SPLIT: tl.constexpr, ROTATE: tl.constexpr,
    ANGLES: tl.constexpr, HAS_POS: tl.constexpr, HAS_TURNS: tl.constexpr,
    MROPE_S1: tl.constexpr, MROPE_S2: tl.constexpr, MROPE_INTERLEAVED: tl.constexpr,
    LIBDEVICE: tl.constexpr, Q_NORM: tl.constexpr, K_NORM: tl.constexpr,
    HAS_GQ: tl.constexpr, HAS_GK: tl.constexpr, HAS_GV: tl.constexpr, G_CONTIG: tl.constexpr,
    ROT_A: tl.constexpr, ROT_B: tl.constexpr, PASS_A: tl.constexpr, PASS_B: tl.constexpr,
    PASS_C: tl.constexpr,
    # the launch configuration: a token walk over token blocks pid, pid + programs, ...;
    # STAGES > 1: the token block loop software-pipelined by triton (the next blocks' reads
    # copied asynchronously into shared memory, STAGES - 1 blocks ahead)
    BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    STAGES: tl.constexpr,
):
    HALF: tl.constexpr = ROTARY_DIM // 2
    NQC: tl.constexpr = (HQ + BLOCK_HQ - 1) // BLOCK_HQ
    NKC: tl.constexpr = (HK + BLOCK_HK - 1) // BLOCK_HK
    NC: tl.constexpr = NQC + 2 * NKC

    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    n_blocks = tl.cdiv(n_tokens, BLOCK_T)
    # The weights' gradient sums in the chunks' shape: adding a chunk's g * n is a
    # multiply-add per element, no reduction across heads (lanes and warps) per chunk.
    qa = _zero_head(BLOCK_T, BLOCK_HQ, ROT_A, ROT_B, PASS_A, PASS_B, PASS_C)
    ka = _zero_head(BLOCK_T, BLOCK_HK, ROT_A, ROT_B, PASS_A, PASS_B, PASS_C)
    for blk in tl.range(pid, n_blocks, n_programs, num_stages=STAGES):
        b, sq, tmask = _tokens(blk, n_tokens, seq_len, BLOCK_T, TOK_SPLIT)
        row_x = b * sx_b + sq * sx_s
        row_dx = b * sdx_b + sq * sdx_s
        row_gq = b * sgq_b + sq * sgq_s
        row_gk = b * sgk_b + sq * sgk_s
        row_gv = b * sgv_b + sq * sgv_s
        # chunk 0's reads go out before the angles' (their latency overlaps the position ->
        # row chain)
        cur = _bwd_load(0, NQC, NKC, x_ptr, row_x, tmask, gq_ptr, row_gq, sgq_h, sgq_d, gk_ptr,
                        row_gk, sgk_h, sgk_d, gv_ptr, row_gv, sgv_h, sgv_d, HQ, HK, Q_NORM,
                        K_NORM, HAS_GQ, HAS_GK, HAS_GV, G_CONTIG, BLOCK_T, BLOCK_HQ, BLOCK_HK,
                        HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                        INTERLEAVED)
        ca, sa, cb, sb = eps, eps, eps, eps
        if ROTATE:
            ca, sa, cb, sb = _angles(pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq, tmask, sp_a,
                                     sp_b, sp_s, pos_offset, n_rows, sc_b, sc_row, ss_b, ss_row,
                                     attn_factor, ANGLES, HALF, ROT_A, ROT_B, HAS_POS, HAS_TURNS,
                                     MROPE_S1, MROPE_S2, MROPE_INTERLEAVED, LIBDEVICE, True)
        for ci in tl.static_range(NC):
            if ci > 0:
                cur = _bwd_load(ci, NQC, NKC, x_ptr, row_x, tmask, gq_ptr, row_gq, sgq_h, sgq_d,
                                gk_ptr, row_gk, sgk_h, sgk_d, gv_ptr, row_gv, sgv_h, sgv_d, HQ,
                                HK, Q_NORM, K_NORM, HAS_GQ, HAS_GK, HAS_GV, G_CONTIG, BLOCK_T,
                                BLOCK_HQ, BLOCK_HK, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM,
                                PASS_A, PASS_B, PASS_C, INTERLEAVED)
            if ci < NQC:
                qa = _backward_qk(
                    cur[0], cur[1], cur[2], cur[3], cur[4], cur[5], cur[6], cur[7], cur[8],
                    cur[9], cur[10], cur[11], cur[12], cur[13], dx_ptr, row_dx, tmask,
                    ci * BLOCK_HQ, HQ, ca, sa, cb, sb, qw_ptr, s_qw, w_offset, eps, qa[0], qa[1],
                    qa[2], qa[3], qa[4], qa[5], qa[6], Q_NORM, HAS_GQ, ROTATE, BLOCK_T, BLOCK_HQ,
                    HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                    INTERLEAVED)
            elif ci < NQC + NKC:
                ka = _backward_qk(
                    cur[0], cur[1], cur[2], cur[3], cur[4], cur[5], cur[6], cur[7], cur[8],
                    cur[9], cur[10], cur[11], cur[12], cur[13], dx_ptr + HQ * HEAD_DIM, row_dx,
                    tmask, (ci - NQC) * BLOCK_HK, HK, ca, sa, cb, sb, kw_ptr, s_kw, w_offset,
                    eps, ka[0], ka[1], ka[2], ka[3], ka[4], ka[5], ka[6], K_NORM, HAS_GK, ROTATE,
                    BLOCK_T, BLOCK_HK, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B,
                    PASS_C, INTERLEAVED)
            else:  # grad_v as given (zeros when None)
                _store_chunk(cur[0], cur[1], cur[2], cur[3], cur[4], cur[5], cur[6],
                             dx_ptr + (HQ + HK) * HEAD_DIM, row_dx, tmask,
                             (ci - NQC - NKC) * BLOCK_HK, HK, HEAD_DIM, 1, BLOCK_T, BLOCK_HK,
                             HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                             INTERLEAVED, True)
    if Q_NORM:
        _store_weight_grads(dqw_ptr + pid * HEAD_DIM, qa[0], qa[1], qa[2], qa[3], qa[4], qa[5],
                            qa[6], HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B,
                            PASS_C, INTERLEAVED)
    if K_NORM:
        _store_weight_grads(dkw_ptr + pid * HEAD_DIM, ka[0], ka[1], ka[2], ka[3], ka[4], ka[5],
                            ka[6], HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B,
                            PASS_C, INTERLEAVED)


@triton.jit
def weight_grad_kernel(q_partials, k_partials, q_grad, k_grad, rows, HEAD_DIM: tl.constexpr,
                       HAS_Q: tl.constexpr, HAS_K: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    """The norm weights' gradients: the backward's [rows, HEAD_DIM] partial sums added up per
    column, in a fixed order (deterministic). Program (column block, weight: 0 q, 1 k)."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    if tl.program_id(1) == 0:
        on, src, dst = HAS_Q, q_partials, q_grad
    else:
        on, src, dst = HAS_K, k_partials, k_grad
    if on:
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for r0 in range(0, rows, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            m = (r[:, None] < rows) & (cols[None, :] < HEAD_DIM)
            acc += tl.load(src + r[:, None] * HEAD_DIM + cols[None, :], mask=m, other=0.0)
        tl.store(dst + cols, tl.sum(acc, axis=0), mask=cols < HEAD_DIM)
