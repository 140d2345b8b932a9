"""The Triton RoPE kernel: q and k of one call in one launch.

Imported lazily by the backend (importing this module imports triton). See NOTES.md.

One program owns BLOCK_T consecutive tokens (flattened batch x seq). It loads each token's position
and cos/sin row once, then walks the q heads and the k heads in chunks of BLOCK_H heads (the chunk
loop is unrolled at compile time, and the next chunk is loaded before the current one is rotated
and stored, so two chunks are in flight per program). Every tensor is addressed through its
[B, S, H, D] strides, so all layouts and strided views (packed QKV) go through the same code.
With HEAD_GRID (decode) each program owns one (token block, head chunk) instead. Rows outside
the cos/sin table are computed on the fly only in programs that have such a token.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # programmatic dependent launch (sm_90+): only traced when PDL is set (never interpreted)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - old triton: the backend never sets PDL there
    gdc_launch_dependents = gdc_wait = None

try:  # accurate sin/cos on the GPU (tl.sin/tl.cos may lower to the approximate instructions)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - very old triton
    libdevice = None

TWO_PI_OVER_2_32 = tl.constexpr(6.283185307179586 / 4294967296.0)


@triton.jit
def _chunk_offsets(row_off, h, s_h, d, s_d, D_CONTIG: tl.constexpr):
    """[BT, BH, ND] element offsets: token rows x heads x dims."""
    hd = h.to(tl.int64) * s_h
    if D_CONTIG:
        dd = d
    else:
        dd = d.to(tl.int64) * s_d
    return row_off[:, None, None] + hd[None, :, None] + dd[None, None, :]


@triton.jit
def _load_chunk(ptr, row_off, tmask, h0, n_heads, s_h, s_d,
                BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
                INTERLEAVED: tl.constexpr, D_CONTIG: tl.constexpr, STREAM: tl.constexpr):
    """The rotary pairs (x, y) of heads [h0, h0 + BLOCK_H), [BT, BH, HALF_P] each, in the input
    dtype (converted to float32 when rotated, so a prefetched chunk holds half the registers)."""
    h = h0 + tl.arange(0, BLOCK_H)
    hmask = h < n_heads
    if INTERLEAVED:
        d = tl.arange(0, 2 * HALF_P)
        m = tmask[:, None, None] & hmask[None, :, None] & (d < 2 * HALF)[None, None, :]
        xy = tl.load(ptr + _chunk_offsets(row_off, h, s_h, d, s_d, D_CONTIG), mask=m, other=0.0,
                     cache_modifier=".cg" if STREAM else "")
        xy = tl.reshape(xy, [BLOCK_T, BLOCK_H, HALF_P, 2])
        x, y = tl.split(xy)
    else:
        i = tl.arange(0, HALF_P)
        m = tmask[:, None, None] & hmask[None, :, None] & (i < HALF)[None, None, :]
        off = _chunk_offsets(row_off, h, s_h, i, s_d, D_CONTIG)
        x = tl.load(ptr + off, mask=m, other=0.0,
                     cache_modifier=".cg" if STREAM else "")
        if D_CONTIG:
            y = tl.load(ptr + off + HALF, mask=m, other=0.0,
                     cache_modifier=".cg" if STREAM else "")
        else:
            y = tl.load(ptr + off + HALF * s_d, mask=m, other=0.0,
                     cache_modifier=".cg" if STREAM else "")
    return x, y


@triton.jit
def _rotate_store(x, y, c, s, out_ptr, row_off, tmask, h0, n_heads, s_h, s_d,
                  BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
                  INTERLEAVED: tl.constexpr, D_CONTIG: tl.constexpr, STREAM: tl.constexpr):
    """Rotate the pairs by (c, s) [BT, HALF_P] in float32 and store them rounded once."""
    c3 = c[:, None, :]
    s3 = s[:, None, :]
    x = x.to(tl.float32)
    y = y.to(tl.float32)
    xo = x * c3 - y * s3
    yo = y * c3 + x * s3
    h = h0 + tl.arange(0, BLOCK_H)
    hmask = h < n_heads
    dtype = out_ptr.dtype.element_ty
    if INTERLEAVED:
        d = tl.arange(0, 2 * HALF_P)
        m = tmask[:, None, None] & hmask[None, :, None] & (d < 2 * HALF)[None, None, :]
        xy = tl.reshape(tl.join(xo, yo), [BLOCK_T, BLOCK_H, 2 * HALF_P])
        tl.store(out_ptr + _chunk_offsets(row_off, h, s_h, d, s_d, D_CONTIG), xy.to(dtype), mask=m,
                 cache_modifier=".cs" if STREAM else "")
    else:
        i = tl.arange(0, HALF_P)
        m = tmask[:, None, None] & hmask[None, :, None] & (i < HALF)[None, None, :]
        off = _chunk_offsets(row_off, h, s_h, i, s_d, D_CONTIG)
        tl.store(out_ptr + off, xo.to(dtype), mask=m,
                 cache_modifier=".cs" if STREAM else "")
        if D_CONTIG:
            tl.store(out_ptr + off + HALF, yo.to(dtype), mask=m,
                 cache_modifier=".cs" if STREAM else "")
        else:
            tl.store(out_ptr + off + HALF * s_d, yo.to(dtype), mask=m,
                 cache_modifier=".cs" if STREAM else "")


@triton.jit
def _copy_pass(in_ptr, out_ptr, row_in, row_out, tmask, h0, n_heads, si_h, si_d, so_h, so_d,
               BLOCK_H: tl.constexpr, ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr,
               PASS_P: tl.constexpr, D_CONTIG: tl.constexpr):
    """Copy the pass-through dims [ROTARY_DIM, HEAD_DIM) of heads [h0, h0 + BLOCK_H).

    The tile spans the whole head (PASS_P = pow2 >= HEAD_DIM) with the rotary dims masked off,
    so it starts aligned and the mask edges fall on vector boundaries: 16-byte accesses.
    """
    h = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, PASS_P)
    dmask = (d >= ROTARY_DIM) & (d < HEAD_DIM)
    m = tmask[:, None, None] & (h < n_heads)[None, :, None] & dmask[None, None, :]
    v = tl.load(in_ptr + _chunk_offsets(row_in, h, si_h, d, si_d, D_CONTIG), mask=m)
    tl.store(out_ptr + _chunk_offsets(row_out, h, so_h, d, so_d, D_CONTIG), v, mask=m)


@triton.jit
def _load_nth(ci: tl.constexpr, NQC: tl.constexpr, q_ptr, row_q, sq_h, sq_d, HQ, k_ptr, row_k,
              sk_h, sk_d, HK, tmask, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
              HALF: tl.constexpr, HALF_P: tl.constexpr, INTERLEAVED: tl.constexpr,
              D_CONTIG: tl.constexpr, STREAM: tl.constexpr):
    """Chunk ci of the q chunks followed by the k chunks."""
    if ci < NQC:
        x, y = _load_chunk(q_ptr, row_q, tmask, ci * BLOCK_H, HQ, sq_h, sq_d,
                           BLOCK_T, BLOCK_H, HALF, HALF_P, INTERLEAVED, D_CONTIG, STREAM)
    else:
        x, y = _load_chunk(k_ptr, row_k, tmask, (ci - NQC) * BLOCK_H, HK, sk_h, sk_d,
                           BLOCK_T, BLOCK_H, HALF, HALF_P, INTERLEAVED, D_CONTIG, STREAM)
    return x, y


@triton.jit
def _cos_sin(pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq, tmask, sp_b, sp_s, pos_offset, n_rows,
             attn_factor, HALF: tl.constexpr, HALF_P: tl.constexpr, HAS_POS: tl.constexpr,
             HAS_TURNS: tl.constexpr, LIBDEVICE: tl.constexpr, INVERSE: tl.constexpr):
    """(c, s) [BT, HALF_P] float32 of the tokens (b, sq): table rows, or computed on the fly."""
    if HAS_POS:
        p = tl.load(pos_ptr + b * sp_b + sq * sp_s, mask=tmask, other=0).to(tl.int64)
    else:
        p = sq + pos_offset
    i = tl.arange(0, HALF_P)
    inside = (p >= 0) & (p < n_rows)
    tab = p[:, None] * HALF + i[None, :]
    tmask2 = inside[:, None] & (i < HALF)[None, :]
    c = tl.load(cos_ptr + tab, mask=tmask2, other=0.0)
    s = tl.load(sin_ptr + tab, mask=tmask2, other=0.0)
    if HAS_TURNS:
        # Rows outside the table are computed on the fly, but only by a program that has such a
        # token (a uniform branch): the int64 product and libdevice sin/cos cost ~90 instructions
        # per (token, i) per thread, which on every program would sit on the decode latency path
        # and take a large share of the issue slots of the prefill programs.
        if tl.max(tl.where(inside, 0, 1), axis=0) > 0:
            # Exact fixed-point angle: wrapping int64 product, top 32 bits = signed turns * 2^32.
            f = tl.load(turns_ptr + i, mask=i < HALF, other=0)
            top = (p[:, None] * f[None, :]) >> 32
            angle = top.to(tl.float32) * TWO_PI_OVER_2_32
            if LIBDEVICE:
                cf = libdevice.cos(angle)
                sf = libdevice.sin(angle)
            else:
                cf = tl.cos(angle)
                sf = tl.sin(angle)
            c = tl.where(inside[:, None], c, cf * attn_factor)
            s = tl.where(inside[:, None], s, sf * attn_factor)
    else:
        c = tl.where(inside[:, None], c, float("nan"))
        s = tl.where(inside[:, None], s, float("nan"))
    if INVERSE:
        s = -s
    return c, s


@triton.jit
def _one_chunk(in_ptr, out_ptr, row_in, row_out, h0, n_heads, si_h, si_d, so_h, so_d,
               pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq, tmask, sp_b, sp_s, pos_offset, n_rows,
               attn_factor, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
               HALF_P: tl.constexpr, ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr,
               PASS_P: tl.constexpr, INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,
               COPY_PASS: tl.constexpr, HAS_POS: tl.constexpr, HAS_TURNS: tl.constexpr,
               D_CONTIG: tl.constexpr, LIBDEVICE: tl.constexpr, STREAM: tl.constexpr):
    """A whole program of the head grid: one chunk, its loads issued before the position."""
    x, y = _load_chunk(in_ptr, row_in, tmask, h0, n_heads, si_h, si_d,
                       BLOCK_T, BLOCK_H, HALF, HALF_P, INTERLEAVED, D_CONTIG, STREAM)
    c, s = _cos_sin(pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq, tmask, sp_b, sp_s, pos_offset,
                    n_rows, attn_factor, HALF, HALF_P, HAS_POS, HAS_TURNS, LIBDEVICE, INVERSE)
    _rotate_store(x, y, c, s, out_ptr, row_out, tmask, h0, n_heads, so_h, so_d,
                  BLOCK_T, BLOCK_H, HALF, HALF_P, INTERLEAVED, D_CONTIG, STREAM)
    if COPY_PASS:
        _copy_pass(in_ptr, out_ptr, row_in, row_out, tmask, h0, n_heads, si_h, si_d, so_h, so_d,
                   BLOCK_H, ROTARY_DIM, HEAD_DIM, PASS_P, D_CONTIG)


@triton.jit(do_not_specialize=["n_tokens", "seq_len", "n_rows", "pos_offset"])
def rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cos_ptr, sin_ptr, turns_ptr,
    n_tokens, seq_len, n_rows, pos_offset, attn_factor,
    sq_b, sq_s, sq_h, sq_d,
    sk_b, sk_s, sk_h, sk_d,
    sqo_b, sqo_s, sqo_h, sqo_d,
    sko_b, sko_s, sko_h, sko_d,
    sp_b, sp_s,
    HQ: tl.constexpr, HK: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
    HALF_P: tl.constexpr, PASS_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr, COPY_PASS: tl.constexpr,
    HAS_POS: tl.constexpr, HAS_TURNS: tl.constexpr, D_CONTIG: tl.constexpr,
    LIBDEVICE: tl.constexpr, EARLY: tl.constexpr, HEAD_GRID: tl.constexpr,
    TOK_SPLIT: tl.constexpr, STREAM: tl.constexpr, PDL: tl.constexpr,
):
    HALF: tl.constexpr = ROTARY_DIM // 2
    NQC: tl.constexpr = (HQ + BLOCK_H - 1) // BLOCK_H
    NKC: tl.constexpr = (HK + BLOCK_H - 1) // BLOCK_H
    NC: tl.constexpr = NQC + NKC

    pid = tl.program_id(0)
    if HEAD_GRID:
        # One program per (token block, head chunk), the chunk fastest (adjacent programs touch
        # adjacent memory); a flat 1-D grid, so no grid-dimension limit on the token count.
        ci = pid % NC
        pid = pid // NC
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < n_tokens
    if TOK_SPLIT == 1:  # one sequence (thd, decode): no integer division before the loads
        b = (t * 0).to(tl.int64)
        sq = t.to(tl.int64)
    elif TOK_SPLIT == 2:  # sequences of one token
        b = t.to(tl.int64)
        sq = (t * 0).to(tl.int64)
    else:
        b = (t // seq_len).to(tl.int64)
        sq = (t % seq_len).to(tl.int64)
    row_q = b * sq_b + sq * sq_s
    row_qo = b * sqo_b + sq * sqo_s
    row_k = b * sk_b + sq * sk_s
    row_ko = b * sko_b + sq * sko_s

    if PDL:
        # Launched with programmatic stream serialization: wait for the previous kernel (its
        # writes become visible) before any global access, then let the next kernel launch (its
        # own wait covers this kernel's writes). Overlaps back-to-back launches (decode).
        gdc_wait()
        gdc_launch_dependents()

    if HEAD_GRID:
        if ci < NQC:
            _one_chunk(q_ptr, qo_ptr, row_q, row_qo, ci * BLOCK_H, HQ, sq_h, sq_d, sqo_h, sqo_d,
                       pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq, tmask, sp_b, sp_s,
                       pos_offset, n_rows, attn_factor, BLOCK_T, BLOCK_H, HALF, HALF_P,
                       ROTARY_DIM, HEAD_DIM, PASS_P, INTERLEAVED, INVERSE, COPY_PASS, HAS_POS,
                       HAS_TURNS, D_CONTIG, LIBDEVICE, STREAM)
        else:
            _one_chunk(k_ptr, ko_ptr, row_k, row_ko, (ci - NQC) * BLOCK_H, HK, sk_h, sk_d, sko_h,
                       sko_d, pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq, tmask, sp_b, sp_s,
                       pos_offset, n_rows, attn_factor, BLOCK_T, BLOCK_H, HALF, HALF_P,
                       ROTARY_DIM, HEAD_DIM, PASS_P, INTERLEAVED, INVERSE, COPY_PASS, HAS_POS,
                       HAS_TURNS, D_CONTIG, LIBDEVICE, STREAM)
        return

    # The first chunk (EARLY = 2: the first two) is loaded before the position, so its latency
    # overlaps the position -> cos/sin chain.
    x, y = _load_nth(0, NQC, q_ptr, row_q, sq_h, sq_d, HQ, k_ptr, row_k, sk_h, sk_d, HK, tmask,
                     BLOCK_T, BLOCK_H, HALF, HALF_P, INTERLEAVED, D_CONTIG, STREAM)
    if EARLY > 1 and NC > 1:
        xn, yn = _load_nth(1, NQC, q_ptr, row_q, sq_h, sq_d, HQ, k_ptr, row_k, sk_h, sk_d, HK,
                           tmask, BLOCK_T, BLOCK_H, HALF, HALF_P, INTERLEAVED, D_CONTIG, STREAM)

    c, s = _cos_sin(pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq, tmask, sp_b, sp_s, pos_offset,
                    n_rows, attn_factor, HALF, HALF_P, HAS_POS, HAS_TURNS, LIBDEVICE, INVERSE)

    for ci in tl.static_range(NC):
        # Prefetch chunk ci + 1 before rotating and storing chunk ci.
        if ci + 1 < NC and not (EARLY > 1 and ci == 0):
            xn, yn = _load_nth(ci + 1, NQC, q_ptr, row_q, sq_h, sq_d, HQ, k_ptr, row_k, sk_h,
                               sk_d, HK, tmask, BLOCK_T, BLOCK_H, HALF, HALF_P, INTERLEAVED,
                               D_CONTIG, STREAM)
        if ci < NQC:
            h0 = ci * BLOCK_H
            _rotate_store(x, y, c, s, qo_ptr, row_qo, tmask, h0, HQ, sqo_h, sqo_d,
                          BLOCK_T, BLOCK_H, HALF, HALF_P, INTERLEAVED, D_CONTIG, STREAM)
            if COPY_PASS:
                _copy_pass(q_ptr, qo_ptr, row_q, row_qo, tmask, h0, HQ, sq_h, sq_d, sqo_h, sqo_d,
                           BLOCK_H, ROTARY_DIM, HEAD_DIM, PASS_P, D_CONTIG)
        else:
            h0 = (ci - NQC) * BLOCK_H
            _rotate_store(x, y, c, s, ko_ptr, row_ko, tmask, h0, HK, sko_h, sko_d,
                          BLOCK_T, BLOCK_H, HALF, HALF_P, INTERLEAVED, D_CONTIG, STREAM)
            if COPY_PASS:
                _copy_pass(k_ptr, ko_ptr, row_k, row_ko, tmask, h0, HK, sk_h, sk_d, sko_h, sko_d,
                           BLOCK_H, ROTARY_DIM, HEAD_DIM, PASS_P, D_CONTIG)
        if ci + 1 < NC:
            x = xn
            y = yn
