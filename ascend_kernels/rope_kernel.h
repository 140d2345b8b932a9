// rope_ops Ascend C kernels: RotaryEmbedding (forward) and RotaryEmbeddingGrad (inverse rotation),
// and the cos/sin stage shared with the fused prologue (prologue_kernel.h).
//
// One kernel class for both: the gradient of a rotation is the rotation by minus the angle, so
// RotaryEmbeddingGrad is RotaryEmbedding with the sign of sin flipped (INVERSE).
//
// Per call (see rope_tiling.h for the tiling):
//   q, k      [B, S, H, D] strided (any layout), stride 1 on D; k optional (kHeads == 0)
//   qOut, kOut same shapes, their own strides; equal to q, k when in place
//   pos, cos, sin, freq  the angle source's inputs (below)
//
// Math, in float32 whatever T is (fp16/bf16 are cast on load and rounded once with CAST_RINT on
// store): with full-width rows C (cos of each element's pair), S' (sin with the sign of the
// element's role) and R(x) (each element replaced by its partner),
//   y = x * C + R(x) * S'
// neox (pairs i, i + r/2): C = [c, c], S' = [-s, s], R(x) = [x2, x1]
// gptj (pairs 2i, 2i + 1): C = c repeated twice, S' = (-s, s) interleaved, R(x) swaps neighbours
// which gives x' = x*c - y*s and y' = y*c + x*s; INVERSE negates S'. R and the expansions of c, s
// are vector Gathers with offset tables built once per core.
//
// Each core walks its tokens in tiles, and each tile goes through two stages, kept apart so that
// a variant plugs into one of them instead of being a second kernel:
//   1. cos/sin stage (RotationStage::Fill): a cos/sin source fills the tile's compact rows, m*cos
//      and m*sin of every frequency for each token, as float32; the stage expands them to full
//      width C and S' once per tile. The source is a template parameter:
//        PositionTableSource  positions -> rows of [P, r/2] tables (row-strided, fp32/fp16/bf16),
//                             rows outside [0, P) computed on the fly or NaN;
//        TokenRowsSource      caller cos/sin given per token [B, S, r/2] (any strides);
//        MRopeSource          three positions per token, each frequency's row by its axis.
//      The kernel entries (rope_entry.h) pick the source from the tiling's angleKind.
//   2. rotate stage (RotateHead), for every head of q and of k, reusing C and S': load the rotary
//      dims of the tile's rows as float32 (LoadHead), rotate (RotationStage::Rotate), round and
//      store (StoreHead); the pass-through dims [r, D) are copied apart (CopyTail), or left alone
//      in place. The prologue (prologue_kernel.h) runs the same two stages on whole heads, with
//      the RMSNorm as one step between load and rotate.
#ifndef ROPE_OPS_ASCEND_ROPE_KERNEL_H
#define ROPE_OPS_ASCEND_ROPE_KERNEL_H

#include "kernel_operator.h"
#define ROPE_KERNEL_SIDE
#include "rope_tiling.h"
#include "rope_math.h"

namespace rope_ops_ascend {

using namespace AscendC;

constexpr int32_t BUFFER_NUM = 2;  // double buffering of the row queues
constexpr int64_t BLOCK_FLOATS = ROPE_BLOCK_BYTES / sizeof(float);

__aicore__ inline float FloatOfBits(int64_t bits)
{
    union { int32_t i; float f; } u;
    u.i = (int32_t)bits;
    return u.f;
}

// Fences between the scalar unit and the vector unit on UB data.
__aicore__ inline void VectorDoneBeforeScalar()
{
    event_t e = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::V_S));
    SetFlag<HardEvent::V_S>(e);
    WaitFlag<HardEvent::V_S>(e);
}

__aicore__ inline void ScalarDoneBeforeVector()
{
    event_t e = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::S_V));
    SetFlag<HardEvent::S_V>(e);
    WaitFlag<HardEvent::S_V>(e);
}

// ---------------------------------------------------------------------------------------------
// Row copies between GM and UB.

// `len` rows of `elems` elements, `stride` elements apart in GM, into consecutive UB rows of
// `padElems` (32-byte multiple). Whole 32-byte blocks everywhere: DataCopy with block strides;
// otherwise DataCopyPad (each row lands 32-byte padded, then skips to the next UB row).
template <typename T>
__aicore__ inline void CopyRowsIn(const LocalTensor<T>& dst, const GlobalTensor<T>& src, int64_t len,
                                  int64_t elems, int64_t stride, int64_t padElems)
{
    const int64_t rowBytes = elems * (int64_t)sizeof(T);
    const int64_t gapBytes = len > 1 ? (stride - elems) * (int64_t)sizeof(T) : 0;
    if (rowBytes % ROPE_BLOCK_BYTES == 0 && gapBytes % ROPE_BLOCK_BYTES == 0 && padElems == elems &&
        rowBytes / ROPE_BLOCK_BYTES <= 65535 && gapBytes / ROPE_BLOCK_BYTES <= 65535 &&
        ((uint64_t)src.GetPhyAddr()) % ROPE_BLOCK_BYTES == 0) {
        DataCopyParams p{(uint16_t)len, (uint16_t)(rowBytes / ROPE_BLOCK_BYTES),
                         (uint16_t)(gapBytes / ROPE_BLOCK_BYTES), 0};
        DataCopy(dst, src, p);
    } else {
        const int64_t landed = (rowBytes + ROPE_BLOCK_BYTES - 1) / ROPE_BLOCK_BYTES * ROPE_BLOCK_BYTES;
        const int64_t skip = (padElems * (int64_t)sizeof(T) - landed) / ROPE_BLOCK_BYTES;
        DataCopyExtParams p{(uint16_t)len, (uint32_t)rowBytes, (uint32_t)gapBytes, (uint32_t)skip, 0};
        DataCopyPadExtParams<T> noPad{};  // isPad = false: pad bytes are never stored
        DataCopyPad(dst, src, p, noPad);
    }
}

// The first `elems` elements of `len` UB rows of `padElems` to GM rows `stride` elements apart.
template <typename T>
__aicore__ inline void CopyRowsOut(const GlobalTensor<T>& dst, const LocalTensor<T>& src, int64_t len,
                                   int64_t elems, int64_t stride, int64_t padElems)
{
    const int64_t rowBytes = elems * (int64_t)sizeof(T);
    const int64_t gapBytes = len > 1 ? (stride - elems) * (int64_t)sizeof(T) : 0;
    if (rowBytes % ROPE_BLOCK_BYTES == 0 && gapBytes % ROPE_BLOCK_BYTES == 0 && padElems == elems &&
        rowBytes / ROPE_BLOCK_BYTES <= 65535 && gapBytes / ROPE_BLOCK_BYTES <= 65535 &&
        ((uint64_t)dst.GetPhyAddr()) % ROPE_BLOCK_BYTES == 0) {
        DataCopyParams p{(uint16_t)len, (uint16_t)(rowBytes / ROPE_BLOCK_BYTES), 0,
                         (uint16_t)(gapBytes / ROPE_BLOCK_BYTES)};
        DataCopy(dst, src, p);
    } else {
        const int64_t landed = (rowBytes + ROPE_BLOCK_BYTES - 1) / ROPE_BLOCK_BYTES * ROPE_BLOCK_BYTES;
        const int64_t skip = (padElems * (int64_t)sizeof(T) - landed) / ROPE_BLOCK_BYTES;
        DataCopyExtParams p{(uint16_t)len, (uint32_t)rowBytes, (uint32_t)skip, (uint32_t)gapBytes, 0};
        DataCopyPad(dst, src, p);
    }
}

// Token (b, s) of row `row`.
__aicore__ inline void TokenOf(const RopeTiling& tl, int64_t row, int64_t& b, int64_t& s)
{
    b = row / tl.seq;
    s = row - b * tl.seq;
}

// Rows row .. end-1 in tiles cross batch entries: (b, s) of `row` and how many rows from it
// stay inside entry b (one strided copy each).
__aicore__ inline int64_t Segment(const RopeTiling& tl, int64_t row, int64_t end, int64_t& b, int64_t& s)
{
    TokenOf(tl, row, b, s);
    return tl.seq - s < end - row ? tl.seq - s : end - row;
}

// ---------------------------------------------------------------------------------------------
// Cos/sin sources. A source is a class with
//   Init(pos, cos, sin, freq, tiling, pipe)  once per core: the kernel's pos/cos/sin/freq
//                                      arguments, whatever they hold for this source, the tiling,
//                                      and the pipe for its own UB buffers (counted in
//                                      rope_angle_row_bytes);
//   Fill(cs, sinBase, row0, n)         for the tokens row0 .. row0+n-1 of a tile, m*cos and m*sin
//                                      of frequency i < r/2 into cs[t * halfPad + i] and
//                                      cs[sinBase + t * halfPad + i], t < n, as float32.
// Fill never reads outside its GM inputs and writes no other part of cs. It may write cs by
// DataCopyPad (MTE2, ordered by the stage's queue events), by vector instructions (a Cast of
// 16-bit rows, a Gather) or by the scalar unit; scalar writes it fences itself (V_S before the
// first, S_V after the last), since the vector unit may still read cs for the previous tile.

// What the sources share: positions, on-the-fly rows, the cast of 16-bit rows.
class SourceBase {
protected:
    __aicore__ inline void InitBase(GM_ADDR pos, GM_ADDR freq, const RopeTiling* tl)
    {
        tl_ = tl;
        if (tl->posMode == ROPE_POS_INT32) pos32Gm_.SetGlobalBuffer((__gm__ int32_t*)pos);
        if (tl->posMode == ROPE_POS_INT64) pos64Gm_.SetGlobalBuffer((__gm__ int64_t*)pos);
        if (tl->hasFreq) freqGm_.SetGlobalBuffer((__gm__ int64_t*)freq);
        attnFactor_ = FloatOfBits(tl->attnFactorBits);
    }

    // Position of token (b, s) on axis `axis` (mRoPE's t, h, w; 0 otherwise).
    __aicore__ inline int64_t Position(int64_t axis, int64_t b, int64_t s) const
    {
        const RopeTiling& tl = *tl_;
        int64_t at = axis * tl.posStrideA + b * tl.posStrideB + s * tl.posStrideS;
        if (tl.posMode == ROPE_POS_INT32) return pos32Gm_.GetValue(at);
        if (tl.posMode == ROPE_POS_INT64) return pos64Gm_.GetValue(at);
        return tl.posOffset + s;  // |posOffset| < 2^62 (rope_ops' limit): no overflow
    }

    __aicore__ inline bool InTable(int64_t p) const { return p >= 0 && p < tl_->tableRows; }

    // m*cos, m*sin of frequency i at position p outside the table, by the scalar unit: from
    // freq_turns (rope_math.h), or NaN for caller tables.
    __aicore__ inline void OffTable(int64_t p, int64_t i, float& c, float& s) const
    {
        if (tl_->hasFreq) {
            rope_sincos_turns(rope_turns_top(p, freqGm_.GetValue(i)), attnFactor_, &c, &s);
        } else {
            union { uint32_t u; float f; } nan;
            nan.u = 0x7fc00000u;
            c = s = nan.f;
        }
    }

    // cos/sin rows of 16-bit tables to float32: `count` elements of each table.
    template <typename TT>
    __aicore__ inline void CastRows(const LocalTensor<float>& dst, int64_t dstSinAt, const LocalTensor<TT>& src,
                                    int64_t srcSinAt, int64_t count)
    {
        Cast(dst, src, RoundMode::CAST_NONE, (int32_t)count);
        Cast(dst[dstSinAt], src[srcSinAt], RoundMode::CAST_NONE, (int32_t)count);
    }

    const RopeTiling* tl_ = nullptr;
    GlobalTensor<int32_t> pos32Gm_;
    GlobalTensor<int64_t> pos64Gm_, freqGm_;
    float attnFactor_ = 1.0f;
};

// Positions -> rows of cos/sin tables [P, r/2] (rows cosStrideR / sinStrideR elements apart;
// float32, float16 or bfloat16); positions outside [0, P) never touch the tables.
class PositionTableSource : public SourceBase {
public:
    __aicore__ inline PositionTableSource() {}

    __aicore__ inline void Init(GM_ADDR pos, GM_ADDR cos, GM_ADDR sin, GM_ADDR freq, const RopeTiling* tl,
                                TPipe* pipe)
    {
        InitBase(pos, freq, tl);
        cos_ = cos;
        sin_ = sin;
        if (tl->tableDtype != ROPE_TABLE_FP32)
            pipe->InitBuffer(stage_, 1, 2 * tl->tileRows * tl->halfPad * 2);
    }

    __aicore__ inline void Fill(LocalTensor<float>& cs, int64_t sinBase, int64_t row0, int64_t n)
    {
        if (tl_->tableDtype == ROPE_TABLE_FP32) {
            LoadRows<float>(cs, sinBase, row0, n);
        } else if (tl_->tableDtype == ROPE_TABLE_FP16) {
            FillLow<half>(cs, sinBase, row0, n);
        } else {
            FillLow<bfloat16_t>(cs, sinBase, row0, n);
        }
        bool scalarWritten = false;
        for (int64_t t = 0; t < n; ++t) {
            int64_t b, s;
            TokenOf(*tl_, row0 + t, b, s);
            int64_t p = Position(0, b, s);
            if (InTable(p)) continue;
            if (!scalarWritten) {
                VectorDoneBeforeScalar();
                scalarWritten = true;
            }
            for (int64_t i = 0; i < tl_->halfDim; ++i) {
                float c, sn;
                OffTable(p, i, c, sn);
                cs.SetValue(t * tl_->halfPad + i, c);
                cs.SetValue(sinBase + t * tl_->halfPad + i, sn);
            }
        }
        if (scalarWritten) ScalarDoneBeforeVector();
    }

private:
    // In-table rows of the tile by DataCopyPad, one row of r/2 elements each (lands 32-byte padded
    // at halfPad elements), cos at dst[t * halfPad], sin at dst[sinAt + t * halfPad].
    template <typename TT>
    __aicore__ inline void LoadRows(const LocalTensor<TT>& dst, int64_t sinAt, int64_t row0, int64_t n)
    {
        const RopeTiling& tl = *tl_;
        GlobalTensor<TT> cosGm, sinGm;
        cosGm.SetGlobalBuffer((__gm__ TT*)cos_);
        sinGm.SetGlobalBuffer((__gm__ TT*)sin_);
        DataCopyExtParams row{1, (uint32_t)(tl.halfDim * sizeof(TT)), 0, 0, 0};
        DataCopyPadExtParams<TT> noPad{};
        for (int64_t t = 0; t < n; ++t) {
            int64_t b, s;
            TokenOf(tl, row0 + t, b, s);
            int64_t p = Position(0, b, s);
            if (!InTable(p)) continue;
            DataCopyPad(dst[t * tl.halfPad], cosGm[p * tl.cosStrideR], row, noPad);
            DataCopyPad(dst[sinAt + t * tl.halfPad], sinGm[p * tl.sinStrideR], row, noPad);
        }
    }

    template <typename TT>
    __aicore__ inline void FillLow(LocalTensor<float>& cs, int64_t sinBase, int64_t row0, int64_t n)
    {
        int64_t stageSin = tl_->tileRows * tl_->halfPad;
        LocalTensor<TT> stage = stage_.AllocTensor<TT>();
        LoadRows<TT>(stage, stageSin, row0, n);
        stage_.EnQue(stage);
        stage = stage_.DeQue<TT>();
        // Rows of tokens outside the table are cast from whatever the stage holds; Fill writes
        // them afterwards.
        CastRows<TT>(cs, sinBase, stage, stageSin, n * tl_->halfPad);
        stage_.FreeTensor(stage);
    }

    GM_ADDR cos_ = nullptr;
    GM_ADDR sin_ = nullptr;
    TQue<QuePosition::VECIN, 1> stage_;
};

// Caller cos/sin per token: row (b, s) of each table at b * strideB + s * strideR (any strides,
// 0 where broadcast); no positions. One DataCopyPad per run of tokens inside one batch entry
// where the rows can be one strided copy, else one per token.
class TokenRowsSource : public SourceBase {
public:
    __aicore__ inline TokenRowsSource() {}

    __aicore__ inline void Init(GM_ADDR pos, GM_ADDR cos, GM_ADDR sin, GM_ADDR freq, const RopeTiling* tl,
                                TPipe* pipe)
    {
        InitBase(pos, freq, tl);
        cos_ = cos;
        sin_ = sin;
        if (tl->tableDtype != ROPE_TABLE_FP32)
            pipe->InitBuffer(stage_, 1, 2 * tl->tileRows * tl->halfPad * 2);
    }

    __aicore__ inline void Fill(LocalTensor<float>& cs, int64_t sinBase, int64_t row0, int64_t n)
    {
        if (tl_->tableDtype == ROPE_TABLE_FP32) {
            LoadRows<float>(cs, sinBase, row0, n);
        } else if (tl_->tableDtype == ROPE_TABLE_FP16) {
            FillLow<half>(cs, sinBase, row0, n);
        } else {
            FillLow<bfloat16_t>(cs, sinBase, row0, n);
        }
    }

private:
    template <typename TT>
    __aicore__ inline void LoadTable(const LocalTensor<TT>& dst, const GlobalTensor<TT>& table, int64_t strideB,
                                     int64_t strideR, int64_t row0, int64_t n)
    {
        const RopeTiling& tl = *tl_;
        const int64_t rowBytes = tl.halfDim * (int64_t)sizeof(TT);
        const int64_t gap = (strideR - tl.halfDim) * (int64_t)sizeof(TT);
        const bool strided = strideR >= tl.halfDim && gap <= ROPE_MAX_STRIDE;
        DataCopyPadExtParams<TT> noPad{};
        for (int64_t row = row0, b, s, len; row < row0 + n; row += len) {
            len = Segment(tl, row, row0 + n, b, s);
            if (strided) {
                DataCopyExtParams rows{(uint16_t)len, (uint32_t)rowBytes, (uint32_t)(len > 1 ? gap : 0), 0, 0};
                DataCopyPad(dst[(row - row0) * tl.halfPad], table[b * strideB + s * strideR], rows, noPad);
                continue;
            }
            DataCopyExtParams one{1, (uint32_t)rowBytes, 0, 0, 0};
            for (int64_t i = 0; i < len; ++i)
                DataCopyPad(dst[(row - row0 + i) * tl.halfPad], table[b * strideB + (s + i) * strideR], one, noPad);
        }
    }

    template <typename TT>
    __aicore__ inline void LoadRows(const LocalTensor<TT>& dst, int64_t sinAt, int64_t row0, int64_t n)
    {
        GlobalTensor<TT> cosGm, sinGm;
        cosGm.SetGlobalBuffer((__gm__ TT*)cos_);
        sinGm.SetGlobalBuffer((__gm__ TT*)sin_);
        LoadTable<TT>(dst, cosGm, tl_->cosStrideB, tl_->cosStrideR, row0, n);
        LoadTable<TT>(dst[sinAt], sinGm, tl_->sinStrideB, tl_->sinStrideR, row0, n);
    }

    template <typename TT>
    __aicore__ inline void FillLow(LocalTensor<float>& cs, int64_t sinBase, int64_t row0, int64_t n)
    {
        int64_t stageSin = tl_->tileRows * tl_->halfPad;
        LocalTensor<TT> stage = stage_.AllocTensor<TT>();
        LoadRows<TT>(stage, stageSin, row0, n);
        stage_.EnQue(stage);
        stage = stage_.DeQue<TT>();
        CastRows<TT>(cs, sinBase, stage, stageSin, n * tl_->halfPad);
        stage_.FreeTensor(stage);
    }

    GM_ADDR cos_ = nullptr;
    GM_ADDR sin_ = nullptr;
    TQue<QuePosition::VECIN, 1> stage_;
};

// mRoPE: three positions per token (t, h, w: pos[axis, b, s]); frequency i takes the row of the
// position of its axis (AxisOf: chunked or interleaved sections). The rows of each axis's
// position (only axes that own frequencies) land in a [token, axis] stage (float32: cast from
// 16-bit tables; rows outside the table computed on the fly, only the frequencies of that axis),
// and one Gather per table picks each frequency's value from its axis's row.
class MRopeSource : public SourceBase {
public:
    __aicore__ inline MRopeSource() {}

    __aicore__ inline void Init(GM_ADDR pos, GM_ADDR cos, GM_ADDR sin, GM_ADDR freq, const RopeTiling* tl,
                                TPipe* pipe)
    {
        InitBase(pos, freq, tl);
        cos_ = cos;
        sin_ = sin;
        int64_t n = tl->tileRows, hp = tl->halfPad;
        pipe->InitBuffer(rows_, 1, 2 * 3 * n * hp * sizeof(float));
        pipe->InitBuffer(axisOff_, n * hp * sizeof(uint32_t));
        if (tl->tableDtype != ROPE_TABLE_FP32) pipe->InitBuffer(stage_, 1, 2 * 3 * n * hp * 2);
        // Offsets of frequency i of token t: its axis's row of that token; row t is row 0 plus t
        // tokens of 3 rows (padding columns read axis 0's row: inside the stage, never used).
        LocalTensor<uint32_t> off = axisOff_.Get<uint32_t>();
        for (int64_t i = 0; i < hp; ++i) {
            int64_t axis = i < tl->halfDim ? AxisOf(i) : 0;
            off.SetValue(i, (uint32_t)((axis * hp + i) * sizeof(float)));
        }
        ScalarDoneBeforeVector();
        LocalTensor<int32_t> offI = off.template ReinterpretCast<int32_t>();
        for (int64_t t = 1; t < n; ++t) Adds(offI[t * hp], offI, (int32_t)(t * 3 * hp * sizeof(float)), (int32_t)hp);
    }

    __aicore__ inline void Fill(LocalTensor<float>& cs, int64_t sinBase, int64_t row0, int64_t n)
    {
        const RopeTiling& tl = *tl_;
        int64_t rowsSin = 3 * tl.tileRows * tl.halfPad;
        LocalTensor<float> rows = rows_.AllocTensor<float>();
        if (tl.tableDtype == ROPE_TABLE_FP32) {
            LoadAxisRows<float>(rows, rowsSin, row0, n);
            rows_.EnQue(rows);
            rows = rows_.DeQue<float>();
        } else if (tl.tableDtype == ROPE_TABLE_FP16) {
            CastAxisRows<half>(rows, rowsSin, row0, n);
        } else {
            CastAxisRows<bfloat16_t>(rows, rowsSin, row0, n);
        }
        bool scalarWritten = false;
        for (int64_t t = 0; t < n; ++t) {
            int64_t b, s;
            TokenOf(tl, row0 + t, b, s);
            for (int64_t axis = 0; axis < 3; ++axis) {
                int64_t p = Position(axis, b, s);
                if (!AxisUsed(axis) || InTable(p)) continue;
                if (!scalarWritten) {
                    VectorDoneBeforeScalar();
                    scalarWritten = true;
                }
                int64_t at = (t * 3 + axis) * tl.halfPad;
                for (int64_t i = 0; i < tl.halfDim; ++i) {
                    if (AxisOf(i) != axis) continue;
                    float c, sn;
                    OffTable(p, i, c, sn);
                    rows.SetValue(at + i, c);
                    rows.SetValue(rowsSin + at + i, sn);
                }
            }
        }
        if (scalarWritten) ScalarDoneBeforeVector();
        LocalTensor<uint32_t> off = axisOff_.Get<uint32_t>();
        uint32_t count = (uint32_t)(n * tl.halfPad);
        Gather(cs, rows, off, (uint32_t)0, count);
        Gather(cs[sinBase], rows, off, (uint32_t)(rowsSin * sizeof(float)), count);
        rows_.FreeTensor(rows);
    }

private:
    // The position axis of frequency i (rope_ops._mrope.mrope_axes).
    __aicore__ inline int64_t AxisOf(int64_t i) const
    {
        const RopeTiling& tl = *tl_;
        if (!tl.mropeInterleaved) return i < tl.mropeT ? 0 : (i < tl.mropeT + tl.mropeH ? 1 : 2);
        if (i % 3 == 1 && i < 3 * tl.mropeH) return 1;
        if (i % 3 == 2 && i < 3 * tl.mropeW) return 2;
        return 0;
    }

    __aicore__ inline bool AxisUsed(int64_t axis) const
    {
        return (axis == 0 ? tl_->mropeT : axis == 1 ? tl_->mropeH : tl_->mropeW) > 0;
    }

    // In-table rows of each used axis: cos at dst[(t * 3 + axis) * halfPad], sin at sinAt + that.
    template <typename TT>
    __aicore__ inline void LoadAxisRows(const LocalTensor<TT>& dst, int64_t sinAt, int64_t row0, int64_t n)
    {
        const RopeTiling& tl = *tl_;
        GlobalTensor<TT> cosGm, sinGm;
        cosGm.SetGlobalBuffer((__gm__ TT*)cos_);
        sinGm.SetGlobalBuffer((__gm__ TT*)sin_);
        DataCopyExtParams row{1, (uint32_t)(tl.halfDim * sizeof(TT)), 0, 0, 0};
        DataCopyPadExtParams<TT> noPad{};
        for (int64_t t = 0; t < n; ++t) {
            int64_t b, s;
            TokenOf(tl, row0 + t, b, s);
            for (int64_t axis = 0; axis < 3; ++axis) {
                int64_t p = Position(axis, b, s);
                if (!AxisUsed(axis) || !InTable(p)) continue;
                int64_t at = (t * 3 + axis) * tl.halfPad;
                DataCopyPad(dst[at], cosGm[p * tl.cosStrideR], row, noPad);
                DataCopyPad(dst[sinAt + at], sinGm[p * tl.sinStrideR], row, noPad);
            }
        }
    }

    template <typename TT>
    __aicore__ inline void CastAxisRows(const LocalTensor<float>& rows, int64_t rowsSin, int64_t row0, int64_t n)
    {
        LocalTensor<TT> stage = stage_.AllocTensor<TT>();
        LoadAxisRows<TT>(stage, rowsSin, row0, n);
        stage_.EnQue(stage);
        stage = stage_.DeQue<TT>();
        CastRows<TT>(rows, rowsSin, stage, rowsSin, n * 3 * tl_->halfPad);
        stage_.FreeTensor(stage);
    }

    GM_ADDR cos_ = nullptr;
    GM_ADDR sin_ = nullptr;
    TQue<QuePosition::VECIN, 1> rows_;
    TQue<QuePosition::VECIN, 1> stage_;
    TBuf<TPosition::VECCALC> axisOff_;
};

// ---------------------------------------------------------------------------------------------
// The cos/sin stage and the rotation, shared by the rope and prologue kernels.

template <bool INVERSE, typename Source>
class RotationStage {
public:
    __aicore__ inline RotationStage() {}

    // Rows of rowPad elements. zeroAt < 0 (the rotation): columns [r, rowPad) are padding, never
    // stored. zeroAt >= 0 (the prologue rotates whole heads): they are the head's pass-through
    // dims and must come out exactly: C = 1, S' = -0 and their partner is the zero block at byte
    // zeroAt of the rotated buffer, so y = x * 1 + 0 * -0 = x for every x.
    __aicore__ inline void Init(TPipe* pipe, const RopeTiling* tl, GM_ADDR pos, GM_ADDR cos, GM_ADDR sin,
                                GM_ADDR freq, int64_t zeroAt)
    {
        tl_ = tl;
        int64_t n = tl->tileRows, full = n * tl->rowPad;
        source_.Init(pos, cos, sin, freq, tl, pipe);
        // Compact rows: [cos rows | a block of 1.0 | sin rows | a block of -0.0]; the tail columns'
        // expansion offsets point at the constants, so cos reads 1 and sin reads -0.
        sinBase_ = n * tl->halfPad + BLOCK_FLOATS;
        pipe->InitBuffer(csQueue_, 1, (2 * n * tl->halfPad + 2 * BLOCK_FLOATS) * sizeof(float));
        pipe->InitBuffer(cosBuf_, full * sizeof(float));
        pipe->InitBuffer(sinBuf_, full * sizeof(float));
        pipe->InitBuffer(expOffBuf_, full * sizeof(uint32_t));
        pipe->InitBuffer(signBuf_, full * sizeof(float));
        pipe->InitBuffer(rotOffBuf_, full * sizeof(uint32_t));
        pipe->InitBuffer(rotBuf_, full * sizeof(float));
        BuildTables(zeroAt);
    }

    // Stage 1 for tokens row0 .. row0+n-1: the source's compact rows, expanded to the full width
    // C and S' (sign of each element's role and INVERSE folded into S').
    __aicore__ inline void Fill(int64_t row0, int64_t n)
    {
        LocalTensor<float> cs = csQueue_.AllocTensor<float>();
        source_.Fill(cs, sinBase_, row0, n);
        csQueue_.EnQue(cs);
        cs = csQueue_.DeQue<float>();
        uint32_t count = (uint32_t)(n * tl_->rowPad);
        LocalTensor<float> cosFull = cosBuf_.Get<float>();
        LocalTensor<float> sinFull = sinBuf_.Get<float>();
        LocalTensor<uint32_t> expOff = expOffBuf_.Get<uint32_t>();
        Gather(cosFull, cs, expOff, (uint32_t)0, count);
        Gather(sinFull, cs, expOff, (uint32_t)(sinBase_ * sizeof(float)), count);
        Mul(sinFull, sinFull, signBuf_.Get<float>(), (int32_t)count);
        csQueue_.FreeTensor(cs);
    }

    // y = x * C + R(x) * S' on `count` float32 elements (whole rows of the tile); y != x.
    __aicore__ inline void Rotate(const LocalTensor<float>& x, const LocalTensor<float>& y, int32_t count)
    {
        LocalTensor<float> rot = rotBuf_.Get<float>();
        Gather(rot, x, rotOffBuf_.Get<uint32_t>(), (uint32_t)0, (uint32_t)count);
        Mul(rot, rot, sinBuf_.Get<float>(), count);
        Mul(y, x, cosBuf_.Get<float>(), count);
        Add(y, y, rot, count);
    }

private:
    // Offset and sign tables for a whole tile: row 0 by the scalar unit, the other rows by
    // vector adds (row t of an offset table is row 0 plus t rows of bytes); the prologue's
    // pass-through columns keep constant offsets (the constants, the zero block) in every row.
    __aicore__ inline void BuildTables(int64_t zeroAt)
    {
        const RopeTiling& tl = *tl_;
        int64_t n = tl.tileRows;
        if (n <= 0) return;
        int64_t w = tl.rowPad, r = tl.rotaryDim, h = tl.halfDim;
        LocalTensor<float> cs = csQueue_.AllocTensor<float>();
        cs.SetValue(n * tl.halfPad, 1.0f);  // the constant blocks (never written by a source)
        cs.SetValue(sinBase_ + n * tl.halfPad, -0.0f);
        for (int64_t i = 1; i < BLOCK_FLOATS; ++i) {
            cs.SetValue(n * tl.halfPad + i, 1.0f);
            cs.SetValue(sinBase_ + n * tl.halfPad + i, -0.0f);
        }
        csQueue_.FreeTensor(cs);
        LocalTensor<uint32_t> rotOff = rotOffBuf_.Get<uint32_t>();
        LocalTensor<uint32_t> expOff = expOffBuf_.Get<uint32_t>();
        LocalTensor<float> sign = signBuf_.Get<float>();
        const float neg = INVERSE ? 1.0f : -1.0f;
        const uint32_t ones = (uint32_t)(n * tl.halfPad * sizeof(float));
        for (int64_t j = 0; j < w; ++j) {
            // Padding columns of the rotation read their own row (never stored); the prologue's
            // pass-through columns read the constants.
            uint32_t partner = (uint32_t)(j * sizeof(float)), pair = zeroAt >= 0 ? ones : 0;
            float sg = 1.0f;
            if (j < r) {
                if (tl.interleaved) {
                    partner = (uint32_t)((j ^ 1) * sizeof(float));
                    pair = (uint32_t)((j >> 1) * sizeof(float));
                    sg = (j & 1) ? -neg : neg;
                } else {
                    partner = (uint32_t)((j < h ? j + h : j - h) * sizeof(float));
                    pair = (uint32_t)((j < h ? j : j - h) * sizeof(float));
                    sg = j < h ? neg : -neg;
                }
            } else if (zeroAt >= 0) {
                partner = (uint32_t)zeroAt;
            }
            rotOff.SetValue(j, partner);
            expOff.SetValue(j, pair);
            sign.SetValue(j, sg);
        }
        ScalarDoneBeforeVector();
        LocalTensor<int32_t> rotOffI = rotOff.template ReinterpretCast<int32_t>();
        LocalTensor<int32_t> expOffI = expOff.template ReinterpretCast<int32_t>();
        for (int64_t t = 1; t < n; ++t) {
            Adds(rotOffI[t * w], rotOffI, (int32_t)(t * w * sizeof(float)), (int32_t)w);
            Adds(expOffI[t * w], expOffI, (int32_t)(t * tl.halfPad * sizeof(float)), (int32_t)w);
            Adds(sign[t * w], sign, 0.0f, (int32_t)w);
        }
        if (zeroAt < 0 || r >= w || n == 1) return;
        VectorDoneBeforeScalar();
        for (int64_t t = 1; t < n; ++t) {
            for (int64_t j = r; j < w; ++j) {
                rotOff.SetValue(t * w + j, (uint32_t)zeroAt);
                expOff.SetValue(t * w + j, ones);
            }
        }
        ScalarDoneBeforeVector();
    }

    const RopeTiling* tl_ = nullptr;
    Source source_;
    int64_t sinBase_ = 0;
    TQue<QuePosition::VECIN, 1> csQueue_;
    TBuf<TPosition::VECCALC> cosBuf_, sinBuf_, expOffBuf_, signBuf_, rotOffBuf_, rotBuf_;
};

// ---------------------------------------------------------------------------------------------
// The rotation kernel.

template <typename T, bool INVERSE, typename CosSinSource = PositionTableSource>
class RopeKernel {
public:
    __aicore__ inline RopeKernel() {}

    __aicore__ inline void Init(GM_ADDR q, GM_ADDR k, GM_ADDR qOut, GM_ADDR kOut, GM_ADDR pos,
                                GM_ADDR cos, GM_ADDR sin, GM_ADDR freq, GM_ADDR tiling)
    {
        LoadTiling(tiling);
        qGm_.SetGlobalBuffer((__gm__ T*)q);
        qOutGm_.SetGlobalBuffer((__gm__ T*)qOut);
        if (tl_.kHeads > 0) {
            kGm_.SetGlobalBuffer((__gm__ T*)k);
            kOutGm_.SetGlobalBuffer((__gm__ T*)kOut);
        }
        int64_t idx = GetBlockIdx();
        if (idx < tl_.formerNum) {
            rowStart_ = idx * tl_.formerRows;
            rowCount_ = tl_.formerRows;
        } else {
            rowStart_ = tl_.formerNum * tl_.formerRows + (idx - tl_.formerNum) * tl_.tailRows;
            rowCount_ = tl_.tailRows;
        }
        if (tl_.tileRows <= 0) return;

        // UB: exactly tileRows * rope_row_bytes() + rope_fixed_bytes(), see rope_tiling.h.
        int64_t full = tl_.tileRows * tl_.rowPad;  // elements of one full-width tile buffer
        stage_.Init(&pipe_, &tl_, pos, cos, sin, freq, -1);
        pipe_.InitBuffer(inQueue_, BUFFER_NUM, full * sizeof(T));
        pipe_.InitBuffer(outQueue_, BUFFER_NUM, full * sizeof(T));
        if (tl_.tailPad > 0) pipe_.InitBuffer(tailQueue_, BUFFER_NUM, tl_.tileRows * tl_.tailPad * sizeof(T));
        if (sizeof(T) != sizeof(float)) {
            pipe_.InitBuffer(xfBuf_, full * sizeof(float));
            pipe_.InitBuffer(yfBuf_, full * sizeof(float));
        }
    }

    __aicore__ inline void Process()
    {
        if (rowCount_ <= 0 || tl_.tileRows <= 0) return;
        for (int64_t done = 0; done < rowCount_; done += tl_.tileRows) {
            int64_t n = rowCount_ - done < tl_.tileRows ? rowCount_ - done : tl_.tileRows;
            int64_t row0 = rowStart_ + done;
            stage_.Fill(row0, n);
            for (int64_t h = 0; h < tl_.qHeads; ++h) {
                RotateHead(qGm_, qOutGm_, tl_.qStrideB, tl_.qStrideS, tl_.qStrideH, tl_.qoStrideB,
                           tl_.qoStrideS, tl_.qoStrideH, h, row0, n);
            }
            for (int64_t h = 0; h < tl_.kHeads; ++h) {
                RotateHead(kGm_, kOutGm_, tl_.kStrideB, tl_.kStrideS, tl_.kStrideH, tl_.koStrideB,
                           tl_.koStrideS, tl_.koStrideH, h, row0, n);
            }
        }
    }

private:
    __aicore__ inline void LoadTiling(GM_ADDR tiling)
    {
        GlobalTensor<int64_t> tg;
        tg.SetGlobalBuffer((__gm__ int64_t*)tiling);
        int64_t* dst = reinterpret_cast<int64_t*>(&tl_);
        for (int32_t i = 0; i < ROPE_TILING_FIELDS; ++i) dst[i] = tg.GetValue(i);
    }

    // Rotary dims [0, r) of head h of tokens row0 .. row0+n-1 (and the pass-through tail).
    __aicore__ inline void RotateHead(GlobalTensor<T>& in, GlobalTensor<T>& out, int64_t sb,
                                      int64_t ss, int64_t sh, int64_t osb, int64_t oss, int64_t osh,
                                      int64_t h, int64_t row0, int64_t n)
    {
        LoadHead(in, sb, ss, sh, h, row0, n);
        if (tl_.tailPad > 0) CopyTail(in, out, sb, ss, sh, osb, oss, osh, h, row0, n);
        LocalTensor<T> x = inQueue_.DeQue<T>();
        LocalTensor<T> y = outQueue_.AllocTensor<T>();
        int32_t count = (int32_t)(n * tl_.rowPad);
        if constexpr (sizeof(T) == sizeof(float)) {
            stage_.Rotate(x.template ReinterpretCast<float>(), y.template ReinterpretCast<float>(), count);
        } else {
            LocalTensor<float> xf = xfBuf_.Get<float>();
            LocalTensor<float> yf = yfBuf_.Get<float>();
            Cast(xf, x, RoundMode::CAST_NONE, count);
            stage_.Rotate(xf, yf, count);
            Cast(y, yf, RoundMode::CAST_RINT, count);
        }
        inQueue_.FreeTensor(x);
        outQueue_.EnQue(y);
        StoreHead(out, osb, oss, osh, h, row0, n);
    }

    // Copy in the rotary dims of head h, one strided copy per run of rows inside one batch entry;
    // each row lands padded to rowPad elements (32 bytes) in UB. Enqueued on inQueue_.
    __aicore__ inline void LoadHead(GlobalTensor<T>& in, int64_t sb, int64_t ss, int64_t sh, int64_t h,
                                    int64_t row0, int64_t n)
    {
        LocalTensor<T> x = inQueue_.AllocTensor<T>();
        for (int64_t row = row0, b, s, len; row < row0 + n; row += len) {
            len = Segment(tl_, row, row0 + n, b, s);
            CopyRowsIn(x[(row - row0) * tl_.rowPad], in[b * sb + s * ss + h * sh], len, tl_.rotaryDim, ss,
                       tl_.rowPad);
        }
        inQueue_.EnQue(x);
    }

    // Copy out the y rows of outQueue_: only the r valid elements of each UB row reach GM.
    __aicore__ inline void StoreHead(GlobalTensor<T>& out, int64_t osb, int64_t oss, int64_t osh, int64_t h,
                                     int64_t row0, int64_t n)
    {
        LocalTensor<T> y = outQueue_.DeQue<T>();
        for (int64_t row = row0, b, s, len; row < row0 + n; row += len) {
            len = Segment(tl_, row, row0 + n, b, s);
            CopyRowsOut(out[b * osb + s * oss + h * osh], y[(row - row0) * tl_.rowPad], len, tl_.rotaryDim, oss,
                        tl_.rowPad);
        }
        outQueue_.FreeTensor(y);
    }

    // Pass-through dims [r, D) when not in place: GM -> UB -> GM through a VECIN/VECOUT bound queue.
    __aicore__ inline void CopyTail(GlobalTensor<T>& in, GlobalTensor<T>& out, int64_t sb, int64_t ss,
                                    int64_t sh, int64_t osb, int64_t oss, int64_t osh, int64_t h,
                                    int64_t row0, int64_t n)
    {
        LocalTensor<T> t = tailQueue_.AllocTensor<T>();
        for (int64_t row = row0, b, s, len; row < row0 + n; row += len) {
            len = Segment(tl_, row, row0 + n, b, s);
            CopyRowsIn(t[(row - row0) * tl_.tailPad], in[b * sb + s * ss + h * sh + tl_.rotaryDim], len, tl_.tailDim,
                       ss, tl_.tailPad);
        }
        tailQueue_.EnQue(t);
        t = tailQueue_.DeQue<T>();
        for (int64_t row = row0, b, s, len; row < row0 + n; row += len) {
            len = Segment(tl_, row, row0 + n, b, s);
            CopyRowsOut(out[b * osb + s * oss + h * osh + tl_.rotaryDim], t[(row - row0) * tl_.tailPad], len,
                        tl_.tailDim, oss, tl_.tailPad);
        }
        tailQueue_.FreeTensor(t);
    }

    TPipe pipe_;
    RopeTiling tl_;
    RotationStage<INVERSE, CosSinSource> stage_;
    TQue<QuePosition::VECIN, BUFFER_NUM> inQueue_;
    TQue<QuePosition::VECOUT, BUFFER_NUM> outQueue_;
    TQueBind<TPosition::VECIN, TPosition::VECOUT, BUFFER_NUM> tailQueue_;
    TBuf<TPosition::VECCALC> xfBuf_, yfBuf_;
    GlobalTensor<T> qGm_, kGm_, qOutGm_, kOutGm_;
    int64_t rowStart_ = 0, rowCount_ = 0;
};

// The angle source a launch uses, read from its tiling before the kernel is built.
__aicore__ inline int64_t AngleKindOf(GM_ADDR tiling)
{
    GlobalTensor<int64_t> tg;
    tg.SetGlobalBuffer((__gm__ int64_t*)tiling);
    return tg.GetValue(ROPE_TILING_INDEX(angleKind));
}

template <typename T, bool INVERSE, typename Source>
__aicore__ inline void RunRopeWith(GM_ADDR q, GM_ADDR k, GM_ADDR qOut, GM_ADDR kOut, GM_ADDR pos, GM_ADDR cos,
                                   GM_ADDR sin, GM_ADDR freq, GM_ADDR tiling)
{
    RopeKernel<T, INVERSE, Source> op;
    op.Init(q, k, qOut, kOut, pos, cos, sin, freq, tiling);
    op.Process();
}

// One launch of RotaryEmbedding(Grad) with the cos/sin source its tiling names.
template <typename T, bool INVERSE>
__aicore__ inline void RunRope(GM_ADDR q, GM_ADDR k, GM_ADDR qOut, GM_ADDR kOut, GM_ADDR pos, GM_ADDR cos,
                               GM_ADDR sin, GM_ADDR freq, GM_ADDR tiling)
{
    int64_t kind = AngleKindOf(tiling);
    if (kind == ROPE_ANGLES_TOKEN) {
        RunRopeWith<T, INVERSE, TokenRowsSource>(q, k, qOut, kOut, pos, cos, sin, freq, tiling);
    } else if (kind == ROPE_ANGLES_MROPE) {
        RunRopeWith<T, INVERSE, MRopeSource>(q, k, qOut, kOut, pos, cos, sin, freq, tiling);
    } else {
        RunRopeWith<T, INVERSE, PositionTableSource>(q, k, qOut, kOut, pos, cos, sin, freq, tiling);
    }
}

}  // namespace rope_ops_ascend

#endif  // ROPE_OPS_ASCEND_ROPE_KERNEL_H
