// rope_ops Ascend C kernels: the tiling struct shared by the host glue and the kernels, and the
// host-side tiling computation.
//
// The struct is plain data: int64 fields only, no padding, so the host writes it as bytes into a
// device buffer and the kernel reads it field by field. backends/ascend_backend/tiling.py mirrors
// compute_rope_tiling() line by line in Python (pure integer arithmetic) and the tests check that
// both give identical structs (tests/test_ascend_tiling.py compiles this header with g++).
//
// One struct serves three kernels (field `op`): the rotation (RotaryEmbedding and its grad,
// rope_kernel.h) and the fused prologue's forward and backward (prologue_kernel.h).
//
// Work decomposition:
//   * a "row" is one token: (b, s) with row = b * seq + s (thd: batch = 1, seq = T);
//   * rows are split over the vector cores: the first formerNum cores take formerRows rows, the
//     others tailRows = formerRows - 1 (or all take tailRows when rows divide evenly);
//   * each core walks its rows in tiles of at most tileRows rows; per tile the cos/sin stage fills
//     the rows' cos/sin once into UB, reused for every head of q and of k.
//   * UB rows are padded to 32 bytes: rowPad elements per head row (the rotation: the rotary
//     dims [0, r) only, rotPad; the prologue: the whole head, D rounded up), halfPad floats for one
//     cos (or sin) row, tailPad elements of T for the rotation's pass-through dims [r, D).
#ifndef ROPE_OPS_ASCEND_ROPE_TILING_H
#define ROPE_OPS_ASCEND_ROPE_TILING_H

#include <stddef.h>
#include <stdint.h>

#define ROPE_TILING_VERSION 2
#define ROPE_UB_RESERVE 2048          /* bytes of UB left to the framework */
#define ROPE_BLOCK_BYTES 32           /* UB block: DataCopy granule and vector operand alignment */
#define ROPE_MAX_BLOCK_COUNT 4095     /* DataCopyPad blockCount limit */
#define ROPE_MAX_BLOCK_LEN 2097151    /* DataCopyPad blockLen limit, bytes */
#define ROPE_MAX_STRIDE 4294967295LL  /* DataCopyPad GM-side stride field (uint32, bytes) */
#define ROPE_MAX_TILE_ROWS 4095
#define ROPE_MAX_VEC_BYTES 65280       /* one vector instruction: 255 repeats of 256 bytes */

enum RopeTilingStatus {
    ROPE_TILING_OK = 0,
    ROPE_TILING_BAD_PARAMS = 1,     // dtype size, rotary_dim, head counts, op, angle source
    ROPE_TILING_BAD_STRIDES = 2,    // a stride that DataCopyPad cannot express
    ROPE_TILING_UB_TOO_SMALL = 3,   // not even one row fits in UB
    ROPE_TILING_BLOCK_LIMIT = 4,    // a row longer than DataCopyPad's blockLen limit
};

// Kernels.
enum RopeOp { ROPE_OP_ROTATE = 0, ROPE_OP_PROLOGUE = 1, ROPE_OP_PROLOGUE_GRAD = 2 };
// Where the angles come from (the cos/sin sources of rope_kernel.h).
enum RopeAngleKind { ROPE_ANGLES_TABLE = 0, ROPE_ANGLES_TOKEN = 1, ROPE_ANGLES_MROPE = 2 };
// Position (and slot) sources.
enum RopePosMode { ROPE_POS_OFFSET = 0, ROPE_POS_INT32 = 1, ROPE_POS_INT64 = 2 };
// Element type of the cos/sin tables (converted to float32 in UB).
enum RopeTableDtype { ROPE_TABLE_FP32 = 0, ROPE_TABLE_FP16 = 1, ROPE_TABLE_BF16 = 2 };

typedef struct RopeTiling {
    // ---- inputs: filled by the caller (host glue or tiling.py) ----
    int64_t version;
    int64_t op;             // RopeOp
    int64_t batch;          // B (1 for thd)
    int64_t seq;            // S (T for thd)
    int64_t qHeads;
    int64_t kHeads;         // 0: no k (the prologue: k and v heads each)
    int64_t headDim;        // D
    int64_t rotaryDim;      // r, even, 0 < r <= D
    int64_t elemSize;       // 2 (fp16, bf16) or 4 (fp32)
    int64_t interleaved;    // 1: gptj pairs (2i, 2i+1); 0: neox pairs (i, i + r/2)
    int64_t inverse;        // 1: rotate by minus the angle (RotaryEmbeddingGrad, the prologue's grad)
    int64_t inplace;        // 1: outputs are the inputs (the rotation writes only the rotary dims)
    // Strides in elements; the head_dim axis has stride 1. Inputs q/k and outputs qo/ko: the
    // rotation's q, k, q_out, k_out; the prologue's q and k heads of qkv and q_out, k_out; the
    // prologue grad's grad_q, grad_k and the q and k heads of grad_qkv.
    int64_t qStrideB, qStrideS, qStrideH;
    int64_t kStrideB, kStrideS, kStrideH;
    int64_t qoStrideB, qoStrideS, qoStrideH;
    int64_t koStrideB, koStrideS, koStrideH;
    // ---- the cos/sin stage ----
    int64_t rotate;         // 0: no rotation (a prologue that only normalises): no cos/sin stage
    int64_t angleKind;      // RopeAngleKind
    int64_t posMode;        // RopePosMode (mRoPE: int32/int64 only)
    int64_t posStrideA, posStrideB, posStrideS;  // elements; A: mRoPE's axis; 0 where shared
    int64_t posOffset;      // ROPE_POS_OFFSET: position of token (b, s) is posOffset + s
    int64_t tableRows;      // P: rows of cos/sin (table, mRoPE); 0 for per-token tables
    int64_t tableDtype;     // RopeTableDtype of cos and sin
    // Row strides of cos and sin in elements (stride 1 along frequencies): R is a position's row
    // (table, mRoPE) or a token's (per-token: row (b, s) at b * strideB + s * strideR).
    int64_t cosStrideB, cosStrideR, sinStrideB, sinStrideR;
    int64_t hasFreq;        // 1: freq_turns given, rows outside [0, P) computed on the fly; 0: NaN
    int64_t attnFactorBits; // float32 bits of the attention factor m (on-the-fly rows)
    int64_t mropeT, mropeH, mropeW;  // mRoPE section: frequencies of each axis (sum r/2)
    int64_t mropeInterleaved;        // 1: Qwen3-VL's interleaved map, 0: chunked
    // ---- the prologue ----
    int64_t vStrideB, vStrideS, vStrideH;        // v heads of qkv (grad: grad_v)
    int64_t voStrideB, voStrideS, voStrideH;     // v_out (grad: the v heads of grad_qkv)
    int64_t xqStrideB, xqStrideS, xqStrideH;     // grad: the forward input's q heads
    int64_t xkStrideB, xkStrideS, xkStrideH;     // grad: the forward input's k heads
    int64_t hasQWeight, hasKWeight;  // RMSNorm of the q (k) heads with a float32 weight [D]
    int64_t epsBits, weightOffsetBits;  // float32 bits of eps and of the weight offset
    int64_t hasGradQ, hasGradK, hasGradV;  // grad: 0 where that output gradient is zero
    int64_t hasCache;       // forward: write k and v at their slots of the caches
    int64_t numSlots;
    int64_t kcStrideS, kcStrideH, vcStrideS, vcStrideH;  // caches [numSlots, Hk, D]
    int64_t slotMode;       // ROPE_POS_INT32 / ROPE_POS_INT64
    int64_t slotStrideB, slotStrideS;
    // ---- outputs: filled by compute_rope_tiling ----
    int64_t halfDim;        // r / 2
    int64_t rotPad;         // r rounded up to a 32-byte block of T
    int64_t halfPad;        // r / 2 rounded up to a 32-byte block of the table dtype
    int64_t tailDim;        // D - r
    int64_t tailPad;        // the rotation: tailDim rounded up to a block of T; 0 when not copied
    int64_t rowPad;         // UB elements of one head row: rotPad (rotation), D rounded up (prologue)
    int64_t totalRows;      // B * S
    int64_t blockDim;       // cores used
    int64_t formerNum;      // cores taking formerRows rows
    int64_t formerRows;
    int64_t tailRows;
    int64_t tileRows;       // rows per UB pass
    int64_t rowBytes;       // UB bytes per tile row, all buffers together
    int64_t fixedBytes;     // UB bytes independent of the tile size
    int64_t ubBytes;        // UB bytes allocated by the kernel: tileRows * rowBytes + fixedBytes
    int64_t ubSize;         // UB size the tiling was computed for (run-time input)
} RopeTiling;

#define ROPE_TILING_FIELDS ((int)(sizeof(RopeTiling) / sizeof(int64_t)))
// Index of a field in the struct as int64 words (the kernel entries read angleKind first).
#define ROPE_TILING_INDEX(FIELD) ((int)(offsetof(RopeTiling, FIELD) / sizeof(int64_t)))

#endif  // ROPE_OPS_ASCEND_ROPE_TILING_H

#if !defined(ROPE_KERNEL_SIDE) && !defined(ROPE_OPS_ASCEND_ROPE_TILING_HOST)
#define ROPE_OPS_ASCEND_ROPE_TILING_HOST
// ------------------------------------------------------------------------------------------
// Host side.

static inline int64_t rope_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t rope_round_up(int64_t a, int64_t b) { return rope_ceil_div(a, b) * b; }

// One strided row copy (blockCount rows of len elements, `stride` elements apart) is expressible
// with DataCopyPad when rows do not overlap and the gap fits the uint32 stride field.
static inline int rope_stride_ok(int64_t stride, int64_t len, int64_t elemSize, int64_t seq) {
    if (seq <= 1) return 1;  // a segment then holds one row: the stride is never used
    if (stride < len) return 0;
    return (stride - len) * elemSize <= ROPE_MAX_STRIDE;
}

// The cos/sin stage's UB bytes per tile row (rope_kernel.h: RotationStage and the sources).
static inline int64_t rope_angle_row_bytes(const RopeTiling* t) {
    if (!t->rotate) return 0;
    int64_t w = t->rowPad, hp = t->halfPad;
    int64_t low = t->tableDtype != ROPE_TABLE_FP32;
    // compact cos and sin rows (float), C and S', expansion offsets, pair signs, partner
    // offsets, the gathered partners
    int64_t bytes = 2 * hp * 4 + 4 * w * 4 + 2 * w * 4;
    if (t->angleKind == ROPE_ANGLES_MROPE) {
        // a row per axis (float), the axis offsets, and the rows as read for 16-bit tables
        bytes += 2 * 3 * hp * 4 + hp * 4 + (low ? 2 * 3 * hp * 2 : 0);
    } else if (low) {
        bytes += 2 * hp * 2;  // 16-bit rows as read, cast to float into the compact rows
    }
    return bytes;
}

// UB bytes per tile row, as allocated by the kernels (rope_kernel.h, prologue_kernel.h).
static inline int64_t rope_row_bytes(const RopeTiling* t) {
    int64_t es = t->elemSize, w = t->rowPad;
    int64_t bytes = rope_angle_row_bytes(t);
    if (t->op == ROPE_OP_ROTATE) {
        // x in and y out (double-buffered, T), the tail (double-buffered, T), x and y in float
        // for fp16/bf16
        return bytes + 2 * 2 * w * es + 2 * t->tailPad * es + (es == 4 ? 0 : 2 * w * 4);
    }
    int64_t weights = t->hasQWeight + t->hasKWeight;
    // in, out and the copy queue (double-buffered, T); the float head rows
    bytes += 3 * 2 * w * es + w * 4;
    if (t->op == ROPE_OP_PROLOGUE) {
        if (es == 2 && t->rotate) bytes += w * 4;  // rotated rows before the cast
    } else if (t->rotate) {
        bytes += w * 4;  // the rotated gradient
    }
    if (weights > 0) {
        // the weight tables, row broadcast offsets, products, 1/rms broadcast, the statistics
        // and ones (a block per row); the grad: x in float and the weight-gradient sums
        bytes += weights * w * 4 + 3 * w * 4 + 2 * ROPE_BLOCK_BYTES;
        if (t->op == ROPE_OP_PROLOGUE_GRAD) bytes += w * 4 + weights * w * 4;
    }
    return bytes;
}

// UB bytes of the kernels that do not scale with the tile.
static inline int64_t rope_fixed_bytes(const RopeTiling* t) {
    int64_t bytes = t->rotate ? 2 * ROPE_BLOCK_BYTES : 0;  // constant blocks of the compact rows
    if (t->op != ROPE_OP_ROTATE) {
        bytes += ROPE_BLOCK_BYTES;  // the zero block after the float head rows
        if (t->hasQWeight + t->hasKWeight > 0) bytes += t->rowPad * 4;  // ReduceSum's work area
    }
    return bytes;
}

// Fills the output fields of t from its input fields. Returns a RopeTilingStatus.
static inline int compute_rope_tiling(RopeTiling* t, int64_t ubSize, int64_t coreNum) {
    t->version = ROPE_TILING_VERSION;
    t->ubSize = ubSize;
    if (t->op < ROPE_OP_ROTATE || t->op > ROPE_OP_PROLOGUE_GRAD) return ROPE_TILING_BAD_PARAMS;
    if (t->elemSize != 2 && t->elemSize != 4) return ROPE_TILING_BAD_PARAMS;
    // rotaryDim: even, in (0, D]; unused without rotation (a prologue may then pass D, odd or not).
    if (t->rotaryDim < 0 || t->rotaryDim > t->headDim || (t->rotate && (t->rotaryDim == 0 || t->rotaryDim % 2 != 0)))
        return ROPE_TILING_BAD_PARAMS;
    if (t->batch < 0 || t->seq < 0 || t->qHeads < 1 || t->kHeads < 0 || coreNum < 1)
        return ROPE_TILING_BAD_PARAMS;
    if (t->op != ROPE_OP_ROTATE && t->kHeads < 1) return ROPE_TILING_BAD_PARAMS;
    if (t->op == ROPE_OP_ROTATE && !t->rotate) return ROPE_TILING_BAD_PARAMS;
    if (t->tableRows < 0 || t->angleKind < ROPE_ANGLES_TABLE || t->angleKind > ROPE_ANGLES_MROPE ||
        t->tableDtype < ROPE_TABLE_FP32 || t->tableDtype > ROPE_TABLE_BF16)
        return ROPE_TILING_BAD_PARAMS;
    if (t->angleKind == ROPE_ANGLES_MROPE &&
        (t->mropeT < 0 || t->mropeH < 0 || t->mropeW < 0 || t->mropeT + t->mropeH + t->mropeW != t->rotaryDim / 2 ||
         t->posMode == ROPE_POS_OFFSET))
        return ROPE_TILING_BAD_PARAMS;
    int64_t perBlock = ROPE_BLOCK_BYTES / t->elemSize;
    t->halfDim = t->rotaryDim / 2;
    t->rotPad = rope_round_up(t->rotaryDim, perBlock);
    t->halfPad = rope_round_up(t->halfDim, t->tableDtype == ROPE_TABLE_FP32 ? 8 : 16);
    t->tailDim = t->headDim - t->rotaryDim;
    if (t->op == ROPE_OP_ROTATE) {
        t->tailPad = (t->tailDim > 0 && !t->inplace) ? rope_round_up(t->tailDim, perBlock) : 0;
        t->rowPad = t->rotPad;
    } else {
        t->tailPad = 0;  // the prologue moves whole heads
        t->rowPad = rope_round_up(t->headDim, perBlock);
    }
    // One DataCopyPad block per row: the rotary dims and the tail (rotation), the head (prologue).
    if (t->op == ROPE_OP_ROTATE ? (t->rotaryDim * t->elemSize > ROPE_MAX_BLOCK_LEN ||
                                   t->tailDim * t->elemSize > ROPE_MAX_BLOCK_LEN)
                                : t->headDim * t->elemSize > ROPE_MAX_BLOCK_LEN)
        return ROPE_TILING_BLOCK_LIMIT;
    // Every GM stride must be non-negative; row strides must describe non-overlapping rows.
    if (t->op == ROPE_OP_ROTATE) {
        int64_t lens[2] = {t->rotaryDim, t->tailPad > 0 ? t->tailDim : 0};
        for (int i = 0; i < 2; ++i) {
            if (lens[i] == 0) continue;
            if (!rope_stride_ok(t->qStrideS, lens[i], t->elemSize, t->seq)) return ROPE_TILING_BAD_STRIDES;
            if (!rope_stride_ok(t->qoStrideS, lens[i], t->elemSize, t->seq)) return ROPE_TILING_BAD_STRIDES;
            if (t->kHeads > 0) {
                if (!rope_stride_ok(t->kStrideS, lens[i], t->elemSize, t->seq)) return ROPE_TILING_BAD_STRIDES;
                if (!rope_stride_ok(t->koStrideS, lens[i], t->elemSize, t->seq)) return ROPE_TILING_BAD_STRIDES;
            }
        }
    } else {
        // Whole heads: every strided input and output (a zero stride where it is not read).
        int64_t rows[9] = {t->qStrideS, t->kStrideS, t->vStrideS, t->qoStrideS, t->koStrideS, t->voStrideS,
                           t->xqStrideS, t->xkStrideS, 0};
        int used[9] = {1, 1, 1, 1, 1, !t->inplace || t->op == ROPE_OP_PROLOGUE_GRAD,
                       t->op == ROPE_OP_PROLOGUE_GRAD && t->hasQWeight,
                       t->op == ROPE_OP_PROLOGUE_GRAD && t->hasKWeight, 0};
        if (t->op == ROPE_OP_PROLOGUE_GRAD) {
            used[0] = (int)t->hasGradQ;
            used[1] = (int)t->hasGradK;
            used[2] = (int)t->hasGradV;
        }
        for (int i = 0; i < 9; ++i)
            if (used[i] && !rope_stride_ok(rows[i], t->headDim, t->elemSize, t->seq)) return ROPE_TILING_BAD_STRIDES;
        if (t->vStrideB < 0 || t->vStrideH < 0 || t->voStrideB < 0 || t->voStrideH < 0 || t->xqStrideB < 0 ||
            t->xqStrideH < 0 || t->xkStrideB < 0 || t->xkStrideH < 0 || t->kcStrideS < 0 || t->kcStrideH < 0 ||
            t->vcStrideS < 0 || t->vcStrideH < 0 || t->slotStrideB < 0 || t->slotStrideS < 0 || t->numSlots < 0)
            return ROPE_TILING_BAD_STRIDES;
    }
    if (t->qStrideB < 0 || t->qStrideH < 0 || t->qoStrideB < 0 || t->qoStrideH < 0 ||
        t->kStrideB < 0 || t->kStrideH < 0 || t->koStrideB < 0 || t->koStrideH < 0 ||
        t->posStrideA < 0 || t->posStrideB < 0 || t->posStrideS < 0 ||
        t->cosStrideB < 0 || t->cosStrideR < 0 || t->sinStrideB < 0 || t->sinStrideR < 0)
        return ROPE_TILING_BAD_STRIDES;
    t->totalRows = t->batch * t->seq;
    t->rowBytes = rope_row_bytes(t);
    t->fixedBytes = rope_fixed_bytes(t);
    if (t->totalRows == 0) {
        t->blockDim = 0; t->formerNum = 0; t->formerRows = 0; t->tailRows = 0;
        t->tileRows = 0; t->ubBytes = 0;
        return ROPE_TILING_OK;
    }
    t->blockDim = t->totalRows < coreNum ? t->totalRows : coreNum;
    t->tailRows = t->totalRows / t->blockDim;
    t->formerNum = t->totalRows % t->blockDim;
    t->formerRows = t->tailRows + (t->formerNum > 0 ? 1 : 0);
    int64_t avail = ubSize - ROPE_UB_RESERVE - t->fixedBytes;
    int64_t fit = avail > 0 ? avail / t->rowBytes : 0;
    if (fit < 1) return ROPE_TILING_UB_TOO_SMALL;
    int64_t tile = fit;
    if (tile > t->formerRows) tile = t->formerRows;
    if (tile > ROPE_MAX_TILE_ROWS) tile = ROPE_MAX_TILE_ROWS;
    // Every vector instruction covers a whole tile (tileRows * rowPad floats, or the mRoPE
    // source's tileRows * 3 * halfPad): keep it within 255 repeats, whether or not the count API
    // would split it.
    int64_t widest = t->rowPad;
    if (t->rotate && t->angleKind == ROPE_ANGLES_MROPE && 3 * t->halfPad > widest) widest = 3 * t->halfPad;
    int64_t vecRows = ROPE_MAX_VEC_BYTES / (widest * 4);
    if (vecRows < 1) return ROPE_TILING_UB_TOO_SMALL;
    if (tile > vecRows) tile = vecRows;
    t->tileRows = tile;
    t->ubBytes = tile * t->rowBytes + t->fixedBytes;
    return ROPE_TILING_OK;
}

#endif  // host side
