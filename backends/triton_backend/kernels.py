"""The Triton RoPE kernel: one launch rotates q and k, any layout through strides.

A program owns a block of BLOCK_T tokens and either all their heads (the token walk) or one
chunk of them (the head grid, for calls too small to fill the GPU with token blocks; see the
launch policy in __init__.py). Its work comes in stages, each a jit helper:

1. angles (``_angles``): the cos/sin of the program's tokens, float32 ``[BLOCK_T, piece]`` per
   rotary piece. The constexpr ANGLES selects where they come from: ANGLES_POSITIONS, a
   position per token (a tensor, or offset + index) and its row of the cos/sin table;
   ANGLES_TOKEN, the caller's row of cos/sin for the token itself (no positions);
   ANGLES_MROPE, three positions per token (t, h, w) and for each frequency the row of the
   position of its axis. Rows outside the table are computed on the fly from the fixed-point
   frequencies (NaN with caller tables).
2. load (``_load_chunk``): the rotary pairs of a chunk of heads, and out of place the
   pass-through dims, in the input dtype.
3. rotate and store (``_rotate_store_chunk``): float32 math, rounded once at the store.

The fused prologue (prologue_kernels.py) reuses stages 1 and 2's helpers and the stores.

Tiles must be powers of two (tl.arange), head dims often are not (80, 96): the rotary pairs of
a head are covered by at most two power-of-two pieces ([0, ROT_A) and [ROT_A, ROT_A + ROT_B),
the last one masked at R/2) and the pass-through dims [R, D) by at most three, so a head of 80
or 96 dims wastes no lanes, where one padded tile of 128 would idle a quarter to a third of them.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # accurate sin/cos on the GPU (tl.sin/tl.cos may lower to the approximate instructions)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - very old triton
    libdevice = None

TWO_PI_OVER_2_32 = tl.constexpr(6.283185307179586 / 4294967296.0)

# ANGLES kinds (the constexpr of the same name).
ANGLES_POSITIONS = tl.constexpr(0)  # position -> cos/sin table row (on the fly outside it)
ANGLES_TOKEN = tl.constexpr(1)  # the token's own row of per-token cos/sin
ANGLES_MROPE = tl.constexpr(2)  # per frequency, the table row of its axis' position


# ---------------------------------------------------------------------------------------------
# Stage 1: angles.


@triton.jit
def _positions(pos_ptr, b, sq, tmask, sp_b, sp_s, pos_offset, HAS_POS: tl.constexpr):
    """int64 [BLOCK_T] positions of the tokens (b, sq): read from pos, or offset + sq."""
    if HAS_POS:
        return tl.load(pos_ptr + b * sp_b + sq * sp_s, mask=tmask, other=0).to(tl.int64)
    return sq + pos_offset


@triton.jit
def _table_rows(p, cos_ptr, sin_ptr, turns_ptr, n_rows, sc_row, ss_row, attn_factor,
                OFF: tl.constexpr, W: tl.constexpr, HALF: tl.constexpr,
                HAS_TURNS: tl.constexpr, LIBDEVICE: tl.constexpr):
    """(c, s) [BLOCK_T, W] float32 of frequencies [OFF, OFF + W) at positions p ([BLOCK_T, 1]:
    one per token, or [BLOCK_T, W]: one per frequency): table rows (any row strides,
    float32/float16/bfloat16), or for positions outside [0, n_rows) computed on the fly (NaN
    without freq_turns)."""
    i = OFF + tl.arange(0, W)
    inside = (p >= 0) & (p < n_rows)
    m = inside
    if OFF + W > HALF:
        m = m & (i < HALF)[None, :]
    c = tl.load(cos_ptr + (p * sc_row + i[None, :]), mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + (p * ss_row + i[None, :]), mask=m, other=0.0).to(tl.float32)
    if HAS_TURNS:
        # Only a program with a token outside the table computes rows on the fly (a uniform
        # branch): the int64 product and libdevice sin/cos cost ~90 instructions per value,
        # which on every program would sit on the decode latency path and take issue slots
        # from the loads of prefill programs.
        if tl.max(tl.where(inside, 0, 1)) > 0:
            # Exact fixed-point angle: wrapping int64 product, top 32 bits = signed turns * 2^32.
            f = tl.load(turns_ptr + i, mask=i < HALF, other=0)
            top = (p * f[None, :]) >> 32
            angle = top.to(tl.float32) * TWO_PI_OVER_2_32
            if LIBDEVICE:
                cf = libdevice.cos(angle)
                sf = libdevice.sin(angle)
            else:  # the interpreter has no libdevice
                cf = tl.cos(angle)
                sf = tl.sin(angle)
            c = tl.where(inside, c, cf * attn_factor)
            s = tl.where(inside, s, sf * attn_factor)
    else:
        c = tl.where(inside, c, float("nan"))
        s = tl.where(inside, s, float("nan"))
    return c, s


@triton.jit
def _token_rows(cos_ptr, sin_ptr, b, sq, tmask, sc_b, sc_s, ss_b, ss_s, OFF: tl.constexpr,
                W: tl.constexpr, HALF: tl.constexpr):
    """(c, s) [BLOCK_T, W] float32: frequencies [OFF, OFF + W) of the tokens' own rows of
    per-token cos/sin ([B, S, R/2] through strides, 0 where broadcast)."""
    i = OFF + tl.arange(0, W)
    m = tmask[:, None]
    if OFF + W > HALF:
        m = m & (i < HALF)[None, :]
    c = tl.load(cos_ptr + ((b * sc_b + sq * sc_s)[:, None] + i[None, :]), mask=m,
                other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + ((b * ss_b + sq * ss_s)[:, None] + i[None, :]), mask=m,
                other=0.0).to(tl.float32)
    return c, s


@triton.jit
def _mrope_positions(p0, p1, p2, OFF: tl.constexpr, W: tl.constexpr, HALF: tl.constexpr,
                     S1: tl.constexpr, S2: tl.constexpr, INTERLEAVED: tl.constexpr):
    """int64 [BLOCK_T, W]: for frequencies [OFF, OFF + W), the position of the axis each follows
    (rope_ops._mrope.mrope_axes from the section sizes: chunked [0]*S0 + [1]*S1 + [2]*S2;
    interleaved axis 1 where i % 3 == 1 and i < 3 S1, axis 2 where i % 3 == 2 and i < 3 S2)."""
    i = OFF + tl.arange(0, W)
    if INTERLEAVED:
        axis = tl.where((i % 3 == 1) & (i < 3 * S1), 1, tl.where((i % 3 == 2) & (i < 3 * S2), 2, 0))
    else:
        S0: tl.constexpr = HALF - S1 - S2
        axis = tl.where(i < S0, 0, tl.where(i < S0 + S1, 1, 2))
    a = axis[None, :]
    return tl.where(a == 0, p0[:, None], tl.where(a == 1, p1[:, None], p2[:, None]))


@triton.jit
def _angles(pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq, tmask, sp_a, sp_b, sp_s, pos_offset,
            n_rows, sc_b, sc_row, ss_b, ss_row, attn_factor, ANGLES: tl.constexpr,
            HALF: tl.constexpr, ROT_A: tl.constexpr, ROT_B: tl.constexpr, HAS_POS: tl.constexpr,
            HAS_TURNS: tl.constexpr, MROPE_S1: tl.constexpr, MROPE_S2: tl.constexpr,
            MROPE_INTERLEAVED: tl.constexpr, LIBDEVICE: tl.constexpr, INVERSE: tl.constexpr):
    """(ca, sa, cb, sb): cos and sin of rotary pieces A and B ([BLOCK_T, ROT_A] and
    [BLOCK_T, ROT_B]; B is A again when there is no piece B), sin negated for the inverse.

    Strides: positions (sp_a: mRoPE's axis, sp_b, sp_s); table rows sc_row / ss_row, or for
    per-token cos/sin the (batch, token) strides (sc_b, sc_row) / (ss_b, ss_row)."""
    tl.static_assert((ANGLES == ANGLES_POSITIONS) or (ANGLES == ANGLES_TOKEN)
                     or (ANGLES == ANGLES_MROPE), "unknown ANGLES kind")
    if ANGLES == ANGLES_TOKEN:
        ca, sa = _token_rows(cos_ptr, sin_ptr, b, sq, tmask, sc_b, sc_row, ss_b, ss_row, 0, ROT_A,
                             HALF)
        if ROT_B > 0:
            cb, sb = _token_rows(cos_ptr, sin_ptr, b, sq, tmask, sc_b, sc_row, ss_b, ss_row,
                                 ROT_A, ROT_B, HALF)
        else:
            cb, sb = ca, sa
    elif ANGLES == ANGLES_MROPE:
        row = b * sp_b + sq * sp_s
        p0 = tl.load(pos_ptr + row, mask=tmask, other=0).to(tl.int64)
        p1 = tl.load(pos_ptr + (row + sp_a), mask=tmask, other=0).to(tl.int64)
        p2 = tl.load(pos_ptr + (row + 2 * sp_a), mask=tmask, other=0).to(tl.int64)
        pa = _mrope_positions(p0, p1, p2, 0, ROT_A, HALF, MROPE_S1, MROPE_S2, MROPE_INTERLEAVED)
        ca, sa = _table_rows(pa, cos_ptr, sin_ptr, turns_ptr, n_rows, sc_row, ss_row, attn_factor,
                             0, ROT_A, HALF, HAS_TURNS, LIBDEVICE)
        if ROT_B > 0:
            pb = _mrope_positions(p0, p1, p2, ROT_A, ROT_B, HALF, MROPE_S1, MROPE_S2,
                                  MROPE_INTERLEAVED)
            cb, sb = _table_rows(pb, cos_ptr, sin_ptr, turns_ptr, n_rows, sc_row, ss_row,
                                 attn_factor, ROT_A, ROT_B, HALF, HAS_TURNS, LIBDEVICE)
        else:
            cb, sb = ca, sa
    else:
        p = _positions(pos_ptr, b, sq, tmask, sp_b, sp_s, pos_offset, HAS_POS)[:, None]
        ca, sa = _table_rows(p, cos_ptr, sin_ptr, turns_ptr, n_rows, sc_row, ss_row, attn_factor,
                             0, ROT_A, HALF, HAS_TURNS, LIBDEVICE)
        if ROT_B > 0:
            cb, sb = _table_rows(p, cos_ptr, sin_ptr, turns_ptr, n_rows, sc_row, ss_row,
                                 attn_factor, ROT_A, ROT_B, HALF, HAS_TURNS, LIBDEVICE)
        else:
            cb, sb = ca, sa
    if INVERSE:
        sa = -sa
        sb = -sb
    return ca, sa, cb, sb


# ---------------------------------------------------------------------------------------------
# Stage 2: load.


@triton.jit
def _offsets(row, h, s_h, d, s_d, D_CONTIG: tl.constexpr):
    """int64 [BLOCK_T, BH, ND] element offsets: token rows x heads x dims."""
    hd = h.to(tl.int64) * s_h
    if D_CONTIG:
        dd = d
    else:
        dd = d.to(tl.int64) * s_d
    return row[:, None, None] + hd[None, :, None] + dd[None, None, :]


@triton.jit
def _load_pairs(ptr, row, tmask, h0, n_heads, s_h, s_d, OFF: tl.constexpr, W: tl.constexpr,
                HALF: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                INTERLEAVED: tl.constexpr, D_CONTIG: tl.constexpr):
    """(x, y) [BLOCK_T, BH, W]: pairs [OFF, OFF + W) of heads [h0, h0 + BH), input dtype."""
    h = h0 + tl.arange(0, BH)
    m = tmask[:, None, None] & (h < n_heads)[None, :, None]
    if INTERLEAVED:  # pair i is dims (2i, 2i + 1): one contiguous span, split in registers
        d = 2 * OFF + tl.arange(0, 2 * W)
        if OFF + W > HALF:
            m = m & (d < 2 * HALF)[None, None, :]
        xy = tl.load(ptr + _offsets(row, h, s_h, d, s_d, D_CONTIG), mask=m, other=0.0)
        x, y = tl.split(tl.reshape(xy, [BT, BH, W, 2]))
    else:  # pair i is dims (i, i + R/2)
        i = OFF + tl.arange(0, W)
        if OFF + W > HALF:
            m = m & (i < HALF)[None, None, :]
        off = _offsets(row, h, s_h, i, s_d, D_CONTIG)
        x = tl.load(ptr + off, mask=m, other=0.0)
        if D_CONTIG:
            y = tl.load(ptr + off + HALF, mask=m, other=0.0)
        else:
            y = tl.load(ptr + off + HALF * s_d, mask=m, other=0.0)
    return x, y


@triton.jit
def _load_dims(ptr, row, tmask, h0, n_heads, s_h, s_d, OFF: tl.constexpr, W: tl.constexpr,
               END: tl.constexpr, BH: tl.constexpr, D_CONTIG: tl.constexpr):
    """Dims [OFF, min(OFF + W, END)) of heads [h0, h0 + BH), [BLOCK_T, BH, W], zero where
    masked."""
    h = h0 + tl.arange(0, BH)
    d = OFF + tl.arange(0, W)
    m = tmask[:, None, None] & (h < n_heads)[None, :, None]
    if OFF + W > END:
        m = m & (d < END)[None, None, :]
    return tl.load(ptr + _offsets(row, h, s_h, d, s_d, D_CONTIG), mask=m, other=0.0)


@triton.jit
def _load_chunk(ptr, row, tmask, h0, n_heads, s_h, s_d, BT: tl.constexpr, BH: tl.constexpr,
                HALF: tl.constexpr, ROT_A: tl.constexpr, ROT_B: tl.constexpr,
                ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, PASS_A: tl.constexpr,
                PASS_B: tl.constexpr, PASS_C: tl.constexpr, INTERLEAVED: tl.constexpr,
                D_CONTIG: tl.constexpr):
    """Everything the program reads of heads [h0, h0 + BH), zero where masked: the pairs of
    rotary pieces A and B, and the pass-through pieces. Without rotary dims (ROT_A 0: the
    prologue without rotation) every dim is a pass-through piece. A piece that is absent repeats
    one that is present."""
    if ROT_A > 0:
        xa, ya = _load_pairs(ptr, row, tmask, h0, n_heads, s_h, s_d, 0, ROT_A, HALF, BT, BH,
                             INTERLEAVED, D_CONTIG)
        xb, yb, pa = xa, ya, xa
        if ROT_B > 0:
            xb, yb = _load_pairs(ptr, row, tmask, h0, n_heads, s_h, s_d, ROT_A, ROT_B, HALF, BT,
                                 BH, INTERLEAVED, D_CONTIG)
    if PASS_A > 0:
        pa = _load_dims(ptr, row, tmask, h0, n_heads, s_h, s_d, ROTARY_DIM, PASS_A, HEAD_DIM,
                        BH, D_CONTIG)
    if ROT_A == 0:
        xa, ya, xb, yb = pa, pa, pa, pa
    pb, pc = pa, pa
    if PASS_B > 0:
        pb = _load_dims(ptr, row, tmask, h0, n_heads, s_h, s_d, ROTARY_DIM + PASS_A, PASS_B,
                        HEAD_DIM, BH, D_CONTIG)
    if PASS_C > 0:
        pc = _load_dims(ptr, row, tmask, h0, n_heads, s_h, s_d, ROTARY_DIM + PASS_A + PASS_B,
                        PASS_C, HEAD_DIM, BH, D_CONTIG)
    return xa, ya, xb, yb, pa, pb, pc


# ---------------------------------------------------------------------------------------------
# Stage 3: rotate and store.


@triton.jit
def _rotate_pairs(x, y, c, s):
    """x' = x c - y s, y' = y c + x s in float32; c, s [BLOCK_T, W] over [BLOCK_T, BH, W]."""
    c3 = c[:, None, :]
    s3 = s[:, None, :]
    xf = x.to(tl.float32)
    yf = y.to(tl.float32)
    return xf * c3 - yf * s3, yf * c3 + xf * s3


@triton.jit
def _store_pairs(xo, yo, ptr, row, tmask, h0, n_heads, s_h, s_d, OFF: tl.constexpr,
                 W: tl.constexpr, HALF: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                 INTERLEAVED: tl.constexpr, D_CONTIG: tl.constexpr):
    """Store pairs (x, y) [BLOCK_T, BH, W] where _load_pairs read them, rounded once to the
    output dtype; tmask [BLOCK_T] says which token rows are written."""
    xo = xo.to(ptr.dtype.element_ty)
    yo = yo.to(ptr.dtype.element_ty)
    h = h0 + tl.arange(0, BH)
    m = tmask[:, None, None] & (h < n_heads)[None, :, None]
    if INTERLEAVED:
        d = 2 * OFF + tl.arange(0, 2 * W)
        if OFF + W > HALF:
            m = m & (d < 2 * HALF)[None, None, :]
        xy = tl.reshape(tl.join(xo, yo), [BT, BH, 2 * W])
        tl.store(ptr + _offsets(row, h, s_h, d, s_d, D_CONTIG), xy, mask=m)
    else:
        i = OFF + tl.arange(0, W)
        if OFF + W > HALF:
            m = m & (i < HALF)[None, None, :]
        off = _offsets(row, h, s_h, i, s_d, D_CONTIG)
        tl.store(ptr + off, xo, mask=m)
        if D_CONTIG:
            tl.store(ptr + off + HALF, yo, mask=m)
        else:
            tl.store(ptr + off + HALF * s_d, yo, mask=m)


@triton.jit
def _store_dims(v, ptr, row, tmask, h0, n_heads, s_h, s_d, OFF: tl.constexpr, W: tl.constexpr,
                END: tl.constexpr, BH: tl.constexpr, D_CONTIG: tl.constexpr):
    h = h0 + tl.arange(0, BH)
    d = OFF + tl.arange(0, W)
    m = tmask[:, None, None] & (h < n_heads)[None, :, None]
    if OFF + W > END:
        m = m & (d < END)[None, None, :]
    tl.store(ptr + _offsets(row, h, s_h, d, s_d, D_CONTIG), v, mask=m)


@triton.jit
def _store_pass(pa, pb, pc, ptr, row, tmask, h0, n_heads, s_h, s_d, BH: tl.constexpr,
                ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, PASS_A: tl.constexpr,
                PASS_B: tl.constexpr, PASS_C: tl.constexpr, D_CONTIG: tl.constexpr):
    """Store _load_chunk's pass-through pieces where it read them."""
    if PASS_A > 0:
        _store_dims(pa, ptr, row, tmask, h0, n_heads, s_h, s_d, ROTARY_DIM, PASS_A, HEAD_DIM, BH,
                    D_CONTIG)
    if PASS_B > 0:
        _store_dims(pb, ptr, row, tmask, h0, n_heads, s_h, s_d, ROTARY_DIM + PASS_A, PASS_B,
                    HEAD_DIM, BH, D_CONTIG)
    if PASS_C > 0:
        _store_dims(pc, ptr, row, tmask, h0, n_heads, s_h, s_d, ROTARY_DIM + PASS_A + PASS_B,
                    PASS_C, HEAD_DIM, BH, D_CONTIG)


@triton.jit
def _store_chunk(xa, ya, xb, yb, pa, pb, pc, ptr, row, tmask, h0, n_heads, s_h, s_d,
                 BT: tl.constexpr, BH: tl.constexpr, HALF: tl.constexpr, ROT_A: tl.constexpr,
                 ROT_B: tl.constexpr, ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr,
                 PASS_A: tl.constexpr, PASS_B: tl.constexpr, PASS_C: tl.constexpr,
                 INTERLEAVED: tl.constexpr, D_CONTIG: tl.constexpr):
    """Store _load_chunk's pieces as given where it read them, rounded once to the output
    dtype; tmask [BLOCK_T] says which token rows are written."""
    if ROT_A > 0:
        _store_pairs(xa, ya, ptr, row, tmask, h0, n_heads, s_h, s_d, 0, ROT_A, HALF, BT, BH,
                     INTERLEAVED, D_CONTIG)
    if ROT_B > 0:
        _store_pairs(xb, yb, ptr, row, tmask, h0, n_heads, s_h, s_d, ROT_A, ROT_B, HALF, BT, BH,
                     INTERLEAVED, D_CONTIG)
    _store_pass(pa, pb, pc, ptr, row, tmask, h0, n_heads, s_h, s_d, BH, ROTARY_DIM, HEAD_DIM,
                PASS_A, PASS_B, PASS_C, D_CONTIG)


@triton.jit
def _rotate_store_pairs(x, y, c, s, ptr, row, tmask, h0, n_heads, s_h, s_d, OFF: tl.constexpr,
                        W: tl.constexpr, HALF: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                        INTERLEAVED: tl.constexpr, D_CONTIG: tl.constexpr):
    """x' = x c - y s, y' = y c + x s in float32, stored rounded once to the output dtype."""
    xo, yo = _rotate_pairs(x, y, c, s)
    _store_pairs(xo, yo, ptr, row, tmask, h0, n_heads, s_h, s_d, OFF, W, HALF, BT, BH,
                 INTERLEAVED, D_CONTIG)


@triton.jit
def _rotate_store_chunk(xa, ya, xb, yb, pa, pb, pc, ca, sa, cb, sb, ptr, row, tmask, h0,
                        n_heads, s_h, s_d, BT: tl.constexpr, BH: tl.constexpr,
                        HALF: tl.constexpr, ROT_A: tl.constexpr, ROT_B: tl.constexpr,
                        ROTARY_DIM: tl.constexpr,
                        HEAD_DIM: tl.constexpr, PASS_A: tl.constexpr, PASS_B: tl.constexpr,
                        PASS_C: tl.constexpr, INTERLEAVED: tl.constexpr, D_CONTIG: tl.constexpr):
    """Store what _load_chunk loaded: the rotary pieces rotated, the pass-through ones as read.
    Each piece is rotated just before its store (rotating both first costs registers: 96 -> 126
    for GPT-J D 112 on sm_90)."""
    _rotate_store_pairs(xa, ya, ca, sa, ptr, row, tmask, h0, n_heads, s_h, s_d, 0, ROT_A, HALF,
                        BT, BH, INTERLEAVED, D_CONTIG)
    if ROT_B > 0:
        _rotate_store_pairs(xb, yb, cb, sb, ptr, row, tmask, h0, n_heads, s_h, s_d, ROT_A, ROT_B,
                            HALF, BT, BH, INTERLEAVED, D_CONTIG)
    _store_pass(pa, pb, pc, ptr, row, tmask, h0, n_heads, s_h, s_d, BH, ROTARY_DIM, HEAD_DIM,
                PASS_A, PASS_B, PASS_C, D_CONTIG)


# ---------------------------------------------------------------------------------------------
# The kernel.


@triton.jit
def _tokens(block, n_tokens, seq_len, BLOCK_T: tl.constexpr, TOK_SPLIT: tl.constexpr):
    """(b, s, mask) [BLOCK_T] of token block ``block`` of the flattened B*S tokens."""
    t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < n_tokens
    if TOK_SPLIT == 1:  # one sequence: no integer division before the loads
        b = (t * 0).to(tl.int64)
        sq = t.to(tl.int64)
    elif TOK_SPLIT == 2:  # sequences of one token
        b = t.to(tl.int64)
        sq = (t * 0).to(tl.int64)
    else:
        b = (t // seq_len).to(tl.int64)
        sq = (t % seq_len).to(tl.int64)
    return b, sq, tmask


@triton.jit
def _load_nth(ci: tl.constexpr, NQC: tl.constexpr, q_ptr, row_q, sq_h, sq_d, k_ptr, row_k, sk_h,
              sk_d, tmask, HQ: tl.constexpr, HK: tl.constexpr, BT: tl.constexpr,
              BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HALF: tl.constexpr,
              ROT_A: tl.constexpr, ROT_B: tl.constexpr, ROTARY_DIM: tl.constexpr,
              HEAD_DIM: tl.constexpr, PASS_A: tl.constexpr, PASS_B: tl.constexpr,
              PASS_C: tl.constexpr, INTERLEAVED: tl.constexpr, D_CONTIG: tl.constexpr):
    """Chunk ci of the token walk: the q chunks first, then the k chunks."""
    if ci < NQC:
        chunk = _load_chunk(q_ptr, row_q, tmask, ci * BLOCK_HQ, HQ, sq_h, sq_d, BT, BLOCK_HQ,
                            HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                            INTERLEAVED, D_CONTIG)
    else:
        chunk = _load_chunk(k_ptr, row_k, tmask, (ci - NQC) * BLOCK_HK, HK, sk_h, sk_d, BT,
                            BLOCK_HK, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B,
                            PASS_C, INTERLEAVED, D_CONTIG)
    return chunk


@triton.jit
def _one_chunk(in_ptr, out_ptr, row_in, row_out, h0, n_heads, si_h, si_d, so_h, so_d,
               pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq, tmask, sp_a, sp_b, sp_s, pos_offset,
               n_rows, sc_b, sc_row, ss_b, ss_row, attn_factor, BT: tl.constexpr,
               BH: tl.constexpr, HALF: tl.constexpr, ROT_A: tl.constexpr, ROT_B: tl.constexpr,
               ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr, PASS_A: tl.constexpr,
               PASS_B: tl.constexpr, PASS_C: tl.constexpr, INTERLEAVED: tl.constexpr,
               INVERSE: tl.constexpr, ANGLES: tl.constexpr, HAS_POS: tl.constexpr,
               HAS_TURNS: tl.constexpr, MROPE_S1: tl.constexpr, MROPE_S2: tl.constexpr,
               MROPE_INTERLEAVED: tl.constexpr, LIBDEVICE: tl.constexpr,
               D_CONTIG: tl.constexpr):
    """A whole program of the head grid: its chunk's loads go out before the position's."""
    xa, ya, xb, yb, pa, pb, pc = _load_chunk(
        in_ptr, row_in, tmask, h0, n_heads, si_h, si_d, BT, BH, HALF, ROT_A, ROT_B, ROTARY_DIM,
        HEAD_DIM, PASS_A, PASS_B, PASS_C, INTERLEAVED, D_CONTIG)
    ca, sa, cb, sb = _angles(pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq, tmask, sp_a, sp_b,
                             sp_s, pos_offset, n_rows, sc_b, sc_row, ss_b, ss_row, attn_factor,
                             ANGLES, HALF, ROT_A, ROT_B, HAS_POS, HAS_TURNS, MROPE_S1, MROPE_S2,
                             MROPE_INTERLEAVED, LIBDEVICE, INVERSE)
    _rotate_store_chunk(xa, ya, xb, yb, pa, pb, pc, ca, sa, cb, sb, out_ptr, row_out, tmask, h0,
                        n_heads, so_h, so_d, BT, BH, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM,
                        PASS_A, PASS_B, PASS_C, INTERLEAVED, D_CONTIG)


@triton.jit(do_not_specialize=["n_tokens", "seq_len", "pos_offset", "n_rows"])
def rope_kernel(
    # the data: q and k, where they go, their [B, S, H, D] strides
    q_ptr, k_ptr, qo_ptr, ko_ptr, n_tokens, seq_len,
    sq_b, sq_s, sq_h, sq_d,
    sk_b, sk_s, sk_h, sk_d,
    sqo_b, sqo_s, sqo_h, sqo_d,
    sko_b, sko_s, sko_h, sko_d,
    # the angle source: positions (mRoPE: [3, B, S]), cos/sin table rows or per-token rows,
    # fixed-point turns (see _angles)
    pos_ptr, cos_ptr, sin_ptr, turns_ptr, pos_offset, attn_factor, n_rows, sp_b, sp_s,
    sc_row, ss_row, sp_a, sc_b, ss_b,
    # what the call is
    HQ: tl.constexpr, HK: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
    INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr, D_CONTIG: tl.constexpr,
    TOK_SPLIT: tl.constexpr,
    ANGLES: tl.constexpr, HAS_POS: tl.constexpr, HAS_TURNS: tl.constexpr,
    MROPE_S1: tl.constexpr, MROPE_S2: tl.constexpr, MROPE_INTERLEAVED: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    # its pieces: pairs [0, ROT_A) and [ROT_A, ROT_A + ROT_B); pass-through dims from ROTARY_DIM
    ROT_A: tl.constexpr, ROT_B: tl.constexpr, PASS_A: tl.constexpr, PASS_B: tl.constexpr,
    PASS_C: tl.constexpr,
    # the launch configuration (the policy's choice)
    HEAD_GRID: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    HALF: tl.constexpr = ROTARY_DIM // 2
    NQC: tl.constexpr = (HQ + BLOCK_HQ - 1) // BLOCK_HQ
    NKC: tl.constexpr = (HK + BLOCK_HK - 1) // BLOCK_HK
    NC: tl.constexpr = NQC + NKC

    pid = tl.program_id(0)
    if HEAD_GRID:
        # One program per (token block, head chunk), the chunk fastest (adjacent programs touch
        # adjacent memory); a flat 1-D grid, so no grid-dimension limit on the token count.
        ci = pid % NC
        pid = pid // NC
    b, sq, tmask = _tokens(pid, n_tokens, seq_len, BLOCK_T, TOK_SPLIT)
    row_q = b * sq_b + sq * sq_s
    row_qo = b * sqo_b + sq * sqo_s
    row_k = b * sk_b + sq * sk_s
    row_ko = b * sko_b + sq * sko_s

    if HEAD_GRID:
        if ci < NQC:
            _one_chunk(q_ptr, qo_ptr, row_q, row_qo, ci * BLOCK_HQ, HQ, sq_h, sq_d, sqo_h, sqo_d,
                       pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq, tmask, sp_a, sp_b, sp_s,
                       pos_offset, n_rows, sc_b, sc_row, ss_b, ss_row, attn_factor, BLOCK_T,
                       BLOCK_HQ, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                       INTERLEAVED, INVERSE, ANGLES, HAS_POS, HAS_TURNS, MROPE_S1, MROPE_S2,
                       MROPE_INTERLEAVED, LIBDEVICE, D_CONTIG)
        else:
            _one_chunk(k_ptr, ko_ptr, row_k, row_ko, (ci - NQC) * BLOCK_HK, HK, sk_h, sk_d,
                       sko_h, sko_d, pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq, tmask, sp_a,
                       sp_b, sp_s, pos_offset, n_rows, sc_b, sc_row, ss_b, ss_row, attn_factor,
                       BLOCK_T, BLOCK_HK, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B,
                       PASS_C, INTERLEAVED, INVERSE, ANGLES, HAS_POS, HAS_TURNS, MROPE_S1,
                       MROPE_S2, MROPE_INTERLEAVED, LIBDEVICE, D_CONTIG)
        return

    # Token walk: chunk 0 is loaded before the angles, so its latency overlaps the
    # position -> table row chain; then chunk c + 1 is loaded before chunk c is rotated and
    # stored (two chunks in flight). Chunks never overlap, so this is safe in place.
    xa, ya, xb, yb, pa, pb, pc = _load_nth(
        0, NQC, q_ptr, row_q, sq_h, sq_d, k_ptr, row_k, sk_h, sk_d, tmask, HQ, HK, BLOCK_T,
        BLOCK_HQ, BLOCK_HK, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
        INTERLEAVED, D_CONTIG)
    ca, sa, cb, sb = _angles(pos_ptr, cos_ptr, sin_ptr, turns_ptr, b, sq, tmask, sp_a, sp_b,
                             sp_s, pos_offset, n_rows, sc_b, sc_row, ss_b, ss_row, attn_factor,
                             ANGLES, HALF, ROT_A, ROT_B, HAS_POS, HAS_TURNS, MROPE_S1, MROPE_S2,
                             MROPE_INTERLEAVED, LIBDEVICE, INVERSE)
    for ci in tl.static_range(NC):
        if ci + 1 < NC:
            nxa, nya, nxb, nyb, npa, npb, npc = _load_nth(
                ci + 1, NQC, q_ptr, row_q, sq_h, sq_d, k_ptr, row_k, sk_h, sk_d, tmask, HQ, HK,
                BLOCK_T, BLOCK_HQ, BLOCK_HK, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A,
                PASS_B, PASS_C, INTERLEAVED, D_CONTIG)
        if ci < NQC:
            _rotate_store_chunk(xa, ya, xb, yb, pa, pb, pc, ca, sa, cb, sb, qo_ptr, row_qo,
                                tmask, ci * BLOCK_HQ, HQ, sqo_h, sqo_d, BLOCK_T, BLOCK_HQ, HALF,
                                ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A, PASS_B, PASS_C,
                                INTERLEAVED, D_CONTIG)
        else:
            _rotate_store_chunk(xa, ya, xb, yb, pa, pb, pc, ca, sa, cb, sb, ko_ptr, row_ko,
                                tmask, (ci - NQC) * BLOCK_HK, HK, sko_h, sko_d, BLOCK_T,
                                BLOCK_HK, HALF, ROT_A, ROT_B, ROTARY_DIM, HEAD_DIM, PASS_A,
                                PASS_B, PASS_C, INTERLEAVED, D_CONTIG)
        if ci + 1 < NC:
            xa, ya, xb, yb, pa, pb, pc = nxa, nya, nxb, nyb, npa, npb, npc
