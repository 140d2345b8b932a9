// rope_ops Ascend C kernels: the tiling struct shared by the host glue and the kernels, and the
// host-side tiling computation.
//
// The struct is plain data: int64 fields only, no padding, so the host writes it as bytes into a
// device buffer and the kernel reads it field by field. backends/ascend_backend/tiling.py mirrors
// compute_rope_tiling() line by line in Python (pure integer arithmetic) and the tests check that
// both give identical structs (tests/test_ascend_tiling.py compiles this header with g++).
//
// Work decomposition:
//   * a "row" is one token: (b, s) with row = b * seq + s (thd: batch = 1, seq = T);
//   * rows are split over the vector cores: the first formerNum cores take formerRows rows, the
//     others tailRows = formerRows - 1 (or all take tailRows when rows divide evenly);
//   * each core walks its rows in tiles of at most tileRows rows; per tile it loads the cos/sin
//     rows of those tokens once into UB and reuses them for every head of q and of k.
//   * UB rows are padded to 32 bytes: rotPad elements of T for the rotary dims [0, r), halfPad
//     floats for one cos (or sin) row, tailPad elements of T for the pass-through dims [r, D).
#ifndef ROPE_OPS_ASCEND_ROPE_TILING_H
#define ROPE_OPS_ASCEND_ROPE_TILING_H

#include <stdint.h>

#define ROPE_TILING_VERSION 1
#define ROPE_UB_RESERVE 2048          /* bytes of UB left to the framework */
#define ROPE_BLOCK_BYTES 32           /* UB block: DataCopy granule and vector operand alignment */
#define ROPE_MAX_BLOCK_COUNT 4095     /* DataCopyPad blockCount limit */
#define ROPE_MAX_BLOCK_LEN 2097151    /* DataCopyPad blockLen limit, bytes */
#define ROPE_MAX_STRIDE 4294967295LL  /* DataCopyPad GM-side stride field (uint32, bytes) */
#define ROPE_MAX_TILE_ROWS 4095
#define ROPE_MAX_VEC_BYTES 65280       /* one vector instruction: 255 repeats of 256 bytes */

enum RopeTilingStatus {
    ROPE_TILING_OK = 0,
    ROPE_TILING_BAD_PARAMS = 1,     // dtype size, rotary_dim, head counts
    ROPE_TILING_BAD_STRIDES = 2,    // a stride that DataCopyPad cannot express
    ROPE_TILING_UB_TOO_SMALL = 3,   // not even one row fits in UB
    ROPE_TILING_BLOCK_LIMIT = 4,    // a row longer than DataCopyPad's blockLen limit
};

// Position sources.
enum RopePosMode { ROPE_POS_OFFSET = 0, ROPE_POS_INT32 = 1, ROPE_POS_INT64 = 2 };

typedef struct RopeTiling {
    // ---- inputs: filled by the caller (host glue or tiling.py) ----
    int64_t version;
    int64_t batch;          // B (1 for thd)
    int64_t seq;            // S (T for thd)
    int64_t qHeads;
    int64_t kHeads;         // 0: no k
    int64_t headDim;        // D
    int64_t rotaryDim;      // r, even, 0 < r <= D
    int64_t elemSize;       // 2 (fp16, bf16) or 4 (fp32)
    int64_t interleaved;    // 1: gptj pairs (2i, 2i+1); 0: neox pairs (i, i + r/2)
    int64_t inverse;        // 1: rotate by minus the angle (RotaryEmbeddingGrad)
    int64_t inplace;        // 1: outputs are the inputs, write only the rotary dims
    // strides in elements; the head_dim axis has stride 1
    int64_t qStrideB, qStrideS, qStrideH;
    int64_t kStrideB, kStrideS, kStrideH;
    int64_t qoStrideB, qoStrideS, qoStrideH;
    int64_t koStrideB, koStrideS, koStrideH;
    int64_t posMode;        // RopePosMode
    int64_t posStrideB, posStrideS;   // elements; 0 where positions are shared
    int64_t posOffset;      // ROPE_POS_OFFSET: position of token (b, s) is posOffset + s
    int64_t tableRows;      // P: rows of the float32 cos/sin tables [P, r/2]
    int64_t hasFreq;        // 1: freq_turns given, rows outside [0, P) computed on the fly; 0: NaN
    int64_t attnFactorBits; // float32 bits of the attention factor m (on-the-fly rows)
    // ---- outputs: filled by compute_rope_tiling ----
    int64_t halfDim;        // r / 2
    int64_t rotPad;         // r rounded up to a 32-byte block of T
    int64_t halfPad;        // r / 2 rounded up to 8 floats
    int64_t tailDim;        // D - r
    int64_t tailPad;        // tailDim rounded up to a block of T; 0 when the tail is not copied
    int64_t totalRows;      // B * S
    int64_t blockDim;       // cores used
    int64_t formerNum;      // cores taking formerRows rows
    int64_t formerRows;
    int64_t tailRows;
    int64_t tileRows;       // rows per UB pass
    int64_t rowBytes;       // UB bytes per tile row, all buffers together
    int64_t ubBytes;        // UB bytes allocated by the kernel: tileRows * rowBytes
    int64_t ubSize;         // UB size the tiling was computed for (run-time input)
} RopeTiling;

#define ROPE_TILING_FIELDS ((int)(sizeof(RopeTiling) / sizeof(int64_t)))

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

// UB bytes per tile row, as allocated by RopeKernel::Init (see rope_kernel.h), by stage.
static inline int64_t rope_row_bytes(const RopeTiling* t) {
    int64_t es = t->elemSize;
    // cos/sin stage: the source's compact cos and sin rows (csQueue, float), their full-width
    // expansions C and S' (cosBuf, sinBuf), the expansion offsets and the pair signs.
    int64_t compact = 2 * t->halfPad * 4;
    int64_t expanded = 4 * t->rotPad * 4;
    // rotate stage: x in and y out (inQueue + outQueue, double-buffered, T), the tail
    // (tailQueue, double-buffered, T), the partner offsets and the rotated x (float), and x and y
    // in float for fp16/bf16.
    int64_t io = 2 * 2 * t->rotPad * es;
    int64_t tail = 2 * t->tailPad * es;
    int64_t rotate = 2 * t->rotPad * 4;
    int64_t cast = es == 4 ? 0 : 2 * t->rotPad * 4;
    return compact + expanded + io + tail + rotate + cast;
}

// Fills the output fields of t from its input fields. Returns a RopeTilingStatus.
static inline int compute_rope_tiling(RopeTiling* t, int64_t ubSize, int64_t coreNum) {
    t->version = ROPE_TILING_VERSION;
    t->ubSize = ubSize;
    if (t->elemSize != 2 && t->elemSize != 4) return ROPE_TILING_BAD_PARAMS;
    if (t->rotaryDim <= 0 || t->rotaryDim % 2 != 0 || t->rotaryDim > t->headDim)
        return ROPE_TILING_BAD_PARAMS;
    if (t->batch < 0 || t->seq < 0 || t->qHeads < 1 || t->kHeads < 0 || coreNum < 1)
        return ROPE_TILING_BAD_PARAMS;
    if (t->tableRows < 0) return ROPE_TILING_BAD_PARAMS;
    int64_t perBlock = ROPE_BLOCK_BYTES / t->elemSize;
    t->halfDim = t->rotaryDim / 2;
    t->rotPad = rope_round_up(t->rotaryDim, perBlock);
    t->halfPad = rope_round_up(t->halfDim, 8);
    t->tailDim = t->headDim - t->rotaryDim;
    t->tailPad = (t->tailDim > 0 && !t->inplace) ? rope_round_up(t->tailDim, perBlock) : 0;
    if (t->rotaryDim * t->elemSize > ROPE_MAX_BLOCK_LEN || t->tailDim * t->elemSize > ROPE_MAX_BLOCK_LEN)
        return ROPE_TILING_BLOCK_LIMIT;
    // Every GM stride must be non-negative; row strides must describe non-overlapping rows.
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
    if (t->qStrideB < 0 || t->qStrideH < 0 || t->qoStrideB < 0 || t->qoStrideH < 0 ||
        t->kStrideB < 0 || t->kStrideH < 0 || t->koStrideB < 0 || t->koStrideH < 0 ||
        t->posStrideB < 0 || t->posStrideS < 0)
        return ROPE_TILING_BAD_STRIDES;
    t->totalRows = t->batch * t->seq;
    if (t->totalRows == 0) {
        t->blockDim = 0; t->formerNum = 0; t->formerRows = 0; t->tailRows = 0;
        t->tileRows = 0; t->rowBytes = rope_row_bytes(t); t->ubBytes = 0;
        return ROPE_TILING_OK;
    }
    t->blockDim = t->totalRows < coreNum ? t->totalRows : coreNum;
    t->tailRows = t->totalRows / t->blockDim;
    t->formerNum = t->totalRows % t->blockDim;
    t->formerRows = t->tailRows + (t->formerNum > 0 ? 1 : 0);
    t->rowBytes = rope_row_bytes(t);
    int64_t avail = ubSize - ROPE_UB_RESERVE;
    int64_t fit = avail > 0 ? avail / t->rowBytes : 0;
    if (fit < 1) return ROPE_TILING_UB_TOO_SMALL;
    int64_t tile = fit;
    if (tile > t->formerRows) tile = t->formerRows;
    if (tile > ROPE_MAX_TILE_ROWS) tile = ROPE_MAX_TILE_ROWS;
    // Every vector instruction covers a whole tile (tileRows * rotPad floats): keep it within 255
    // repeats, whether or not the count API would split it.
    int64_t vecRows = ROPE_MAX_VEC_BYTES / (t->rotPad * 4);
    if (vecRows < 1) return ROPE_TILING_UB_TOO_SMALL;
    if (tile > vecRows) tile = vecRows;
    t->tileRows = tile;
    t->ubBytes = tile * t->rowBytes;
    return ROPE_TILING_OK;
}

#endif  // host side
