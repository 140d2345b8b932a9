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
//      The kernel entries (rope_entry.h) pick the source from the tiling's angleKind
//      (RunWithSource).
//   2. rotate stage (RotateHead), for every head of q and of k, reusing C and S': load the rotary
//      dims of the tile's rows as float32 (LoadHeadRows), rotate (RotationStage::Rotate), round and
//      store (StoreHeadRows); the pass-through dims [r, D) are copied apart (CopyTail), or left
//      alone in place. The prologue (prologue_kernel.h) runs the same two stages on whole heads,
//      with the RMSNorm as one step between load and rotate.
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

// How `len` rows of `elems` elements, `stride` elements apart in GM, travel to or from
// consecutive UB rows of `padElems` (32-byte multiple). Whole 32-byte blocks everywhere (GM address
// included): DataCopy with block strides; otherwise DataCopyPad (each row lands 32-byte padded,
// then skips ubSkipBlocks to the next UB row).
struct RowsCopy {
    int64_t rowBytes, gapBytes, ubSkipBlocks;
    bool wholeBlocks;
};

template <typename T>
__aicore__ inline RowsCopy PlanRowsCopy(uint64_t gmAddr, int64_t len, int64_t elems, int64_t stride, int64_t padElems)
{
    RowsCopy c;
    c.rowBytes = elems * (int64_t)sizeof(T);
    c.gapBytes = len > 1 ? (stride - elems) * (int64_t)sizeof(T) : 0;
    c.wholeBlocks = c.rowBytes % ROPE_BLOCK_BYTES == 0 && c.gapBytes % ROPE_BLOCK_BYTES == 0 && padElems == elems &&
                    c.rowBytes / ROPE_BLOCK_BYTES <= 65535 && c.gapBytes / ROPE_BLOCK_BYTES <= 65535 &&
                    gmAddr % ROPE_BLOCK_BYTES == 0;
    const int64_t landed = (c.rowBytes + ROPE_BLOCK_BYTES - 1) / ROPE_BLOCK_BYTES * ROPE_BLOCK_BYTES;
    c.ubSkipBlocks = (padElems * (int64_t)sizeof(T) - landed) / ROPE_BLOCK_BYTES;
    return c;
}

template <typename T>
__aicore__ inline void CopyRowsIn(const LocalTensor<T>& dst, const GlobalTensor<T>& src, int64_t len,
                                  int64_t elems, int64_t stride, int64_t padElems)
{
    RowsCopy c = PlanRowsCopy<T>((uint64_t)src.GetPhyAddr(), len, elems, stride, padElems);
    if (c.wholeBlocks) {
        DataCopyParams p{(uint16_t)len, (uint16_t)(c.rowBytes / ROPE_BLOCK_BYTES),
                         (uint16_t)(c.gapBytes / ROPE_BLOCK_BYTES), 0};
        DataCopy(dst, src, p);
    } else {
        DataCopyExtParams p{(uint16_t)len, (uint32_t)c.rowBytes, (uint32_t)c.gapBytes, (uint32_t)c.ubSkipBlocks, 0};
        DataCopyPadExtParams<T> noPad{};  // isPad = false: pad bytes are never stored
        DataCopyPad(dst, src, p, noPad);
    }
}

// The first `elems` elements of each UB row to GM.
template <typename T>
__aicore__ inline void CopyRowsOut(const GlobalTensor<T>& dst, const LocalTensor<T>& src, int64_t len,
                                   int64_t elems, int64_t stride, int64_t padElems)
{
    RowsCopy c = PlanRowsCopy<T>((uint64_t)dst.GetPhyAddr(), len, elems, stride, padElems);
    if (c.wholeBlocks) {
        DataCopyParams p{(uint16_t)len, (uint16_t)(c.rowBytes / ROPE_BLOCK_BYTES), 0,
                         (uint16_t)(c.gapBytes / ROPE_BLOCK_BYTES)};
        DataCopy(dst, src, p);
    } else {
        DataCopyExtParams p{(uint16_t)len, (uint32_t)c.rowBytes, (uint32_t)c.ubSkipBlocks, (uint32_t)c.gapBytes, 0};
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

// A [B, S, H, D] tensor in GM (stride 1 on D) and its strides.
template <typename T>
struct HeadsGm {
    GlobalTensor<T> gm;
    int64_t sb = 0, ss = 0, sh = 0;

    __aicore__ inline void Init(GM_ADDR addr, int64_t strideB, int64_t strideS, int64_t strideH)
    {
        gm.SetGlobalBuffer((__gm__ T*)addr);
        sb = strideB;
        ss = strideS;
        sh = strideH;
    }
};

// Columns [col, col + elems) of head h of the tokens row0 .. row0+n-1, GM <-> consecutive UB rows of
// `pad` elements: one strided copy per run of rows inside one batch entry.
template <typename T>
__aicore__ inline void LoadHeadRows(const LocalTensor<T>& dst, const HeadsGm<T>& src, const RopeTiling& tl,
                                    int64_t h, int64_t col, int64_t elems, int64_t pad, int64_t row0, int64_t n)
{
    for (int64_t row = row0, b, s, len; row < row0 + n; row += len) {
        len = Segment(tl, row, row0 + n, b, s);
        CopyRowsIn(dst[(row - row0) * pad], src.gm[b * src.sb + s * src.ss + h * src.sh + col], len, elems, src.ss,
                   pad);
    }
}

template <typename T>
__aicore__ inline void StoreHeadRows(const HeadsGm<T>& dst, const LocalTensor<T>& src, const RopeTiling& tl,
                                     int64_t h, int64_t col, int64_t elems, int64_t pad, int64_t row0, int64_t n)
{
    for (int64_t row = row0, b, s, len; row < row0 + n; row += len) {
        len = Segment(tl, row, row0 + n, b, s);
        CopyRowsOut(dst.gm[b * dst.sb + s * dst.ss + h * dst.sh + col], src[(row - row0) * pad], len, elems, dst.ss,
                    pad);
    }
}

// ---------------------------------------------------------------------------------------------
// Launch setup, shared by every kernel.

__aicore__ inline void LoadTilingFrom(GM_ADDR tiling, RopeTiling& tl)
{
    GlobalTensor<int64_t> tg;
    tg.SetGlobalBuffer((__gm__ int64_t*)tiling);
    int64_t* dst = reinterpret_cast<int64_t*>(&tl);
    for (int32_t i = 0; i < ROPE_TILING_FIELDS; ++i) dst[i] = tg.GetValue(i);
}

// (first row, row count) of this core.
__aicore__ inline void CoreRows(const RopeTiling& tl, int64_t& start, int64_t& count)
{
    int64_t idx = GetBlockIdx();
    if (idx < tl.formerNum) {
        start = idx * tl.formerRows;
        count = tl.formerRows;
    } else {
        start = tl.formerNum * tl.formerRows + (idx - tl.formerNum) * tl.tailRows;
        count = tl.tailRows;
    }
}

// The cos/sin stage's GM arguments, whatever the source reads of them (one declaration each:
// GM_ADDR may be a macro).
struct AngleGm {
    GM_ADDR pos;
    GM_ADDR cos;
    GM_ADDR sin;
    GM_ADDR freq;
};

// ---------------------------------------------------------------------------------------------
// Cos/sin sources. A source is a class with
//   Init(angles, tiling, pipe)         once per core: the kernel's pos/cos/sin/freq arguments
//                                      (AngleGm), whatever they hold for this source, the tiling,
//                                      and the pipe for its own UB buffers (counted in
//                                      rope_angle_row_bytes);
//   Fill(cs, sinBase, row0, n)         for the tokens row0 .. row0+n-1 of a tile, m*cos and m*sin
//                                      of frequency i < r/2 into cs[t * halfPad + i] and
//                                      cs[sinBase + t * halfPad + i], t < n, as float32.
// Fill never reads outside its GM inputs and writes no other part of cs. It may write cs by
// DataCopyPad (MTE2, ordered by the stage's queue events), by vector instructions (a Cast of
// 16-bit rows, a Gather) or by the scalar unit; scalar writes it fences itself (V_S before the
// first, S_V after the last), since the vector unit may still read cs for the previous tile.

// What the sources share: Init, positions, on-the-fly rows, the caller's tables and the cast of
// their 16-bit rows. Each source copies a tile's table rows with its own
//   LoadRows<TT>(dst, sinAt, row0, n)  in the table's dtype TT, ROWS_PER_TOKEN rows of halfPad
//                                      elements per token (cos from dst[0], sin from dst[sinAt]),
// which LoadFloatRows calls for the dtype of the tables. Fill here is for sources whose rows all
// come from the tables; the others define their own.
template <typename Source, int64_t ROWS_PER_TOKEN>
class SourceBase {
public:
    __aicore__ inline void Init(const AngleGm& gm, const RopeTiling* tl, TPipe* pipe)
    {
        tl_ = tl;
        if (tl->posMode == ROPE_POS_INT32) pos32Gm_.SetGlobalBuffer((__gm__ int32_t*)gm.pos);
        if (tl->posMode == ROPE_POS_INT64) pos64Gm_.SetGlobalBuffer((__gm__ int64_t*)gm.pos);
        if (tl->hasFreq) freqGm_.SetGlobalBuffer((__gm__ int64_t*)gm.freq);
        attnFactor_ = FloatOfBits(tl->attnFactorBits);
        cos_ = gm.cos;
        sin_ = gm.sin;
        stageSin_ = ROWS_PER_TOKEN * tl->tileRows * tl->halfPad;
        if (tl->tableDtype != ROPE_TABLE_FP32) pipe->InitBuffer(stage_, 1, 2 * stageSin_ * 2);
    }

    __aicore__ inline void Fill(LocalTensor<float>& cs, int64_t sinBase, int64_t row0, int64_t n)
    {
        LoadFloatRows(cs, sinBase, row0, n);
    }

protected:
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

    // The caller's cos and sin tables as elements of type TT.
    template <typename TT>
    __aicore__ inline void Tables(GlobalTensor<TT>& cosGm, GlobalTensor<TT>& sinGm) const
    {
        cosGm.SetGlobalBuffer((__gm__ TT*)cos_);
        sinGm.SetGlobalBuffer((__gm__ TT*)sin_);
    }

    // The tile's table rows (the source's LoadRows) as float32 at dst, sin rows from dst[sinAt]:
    // float32 rows copied straight in, 16-bit rows through the stage and a Cast. Rows the source
    // computes itself are cast from whatever the stage holds; it writes them afterwards.
    __aicore__ inline void LoadFloatRows(const LocalTensor<float>& dst, int64_t sinAt, int64_t row0, int64_t n)
    {
        if (tl_->tableDtype == ROPE_TABLE_FP32) {
            Self().template LoadRows<float>(dst, sinAt, row0, n);
        } else if (tl_->tableDtype == ROPE_TABLE_FP16) {
            CastRows<half>(dst, sinAt, row0, n);
        } else {
            CastRows<bfloat16_t>(dst, sinAt, row0, n);
        }
    }

    // For the sources of rows by position, ROWS_PER_TOKEN positions per token (the source's
    // axes: AxisUsed(axis), AxisOf(frequency)): the row of axis a of token t at
    // dst[(t * ROWS_PER_TOKEN + a) * halfPad], its sin row at sinAt + that.
    // In-table rows by DataCopyPad, r/2 elements each (lands 32-byte padded at halfPad elements).
    template <typename TT>
    __aicore__ inline void LoadPositionRows(const LocalTensor<TT>& dst, int64_t sinAt, int64_t row0, int64_t n)
    {
        const RopeTiling& tl = *tl_;
        GlobalTensor<TT> cosGm, sinGm;
        Tables(cosGm, sinGm);
        DataCopyExtParams row{1, (uint32_t)(tl.halfDim * sizeof(TT)), 0, 0, 0};
        DataCopyPadExtParams<TT> noPad{};
        for (int64_t t = 0; t < n; ++t) {
            int64_t b, s;
            TokenOf(tl, row0 + t, b, s);
            for (int64_t axis = 0; axis < ROWS_PER_TOKEN; ++axis) {
                int64_t p = Position(axis, b, s);
                if (!Self().AxisUsed(axis) || !InTable(p)) continue;
                int64_t at = (t * ROWS_PER_TOKEN + axis) * tl.halfPad;
                DataCopyPad(dst[at], cosGm[p * tl.cosStrideR], row, noPad);
                DataCopyPad(dst[sinAt + at], sinGm[p * tl.sinStrideR], row, noPad);
            }
        }
    }

    // The rows LoadPositionRows leaves out (positions outside the table), by the scalar unit: the
    // frequencies of each row's axis.
    __aicore__ inline void ComputeOffTableRows(const LocalTensor<float>& dst, int64_t sinAt, int64_t row0, int64_t n)
    {
        const RopeTiling& tl = *tl_;
        bool scalarWritten = false;
        for (int64_t t = 0; t < n; ++t) {
            int64_t b, s;
            TokenOf(tl, row0 + t, b, s);
            for (int64_t axis = 0; axis < ROWS_PER_TOKEN; ++axis) {
                int64_t p = Position(axis, b, s);
                if (!Self().AxisUsed(axis) || InTable(p)) continue;
                if (!scalarWritten) {
                    VectorDoneBeforeScalar();
                    scalarWritten = true;
                }
                int64_t at = (t * ROWS_PER_TOKEN + axis) * tl.halfPad;
                for (int64_t i = 0; i < tl.halfDim; ++i) {
                    if (Self().AxisOf(i) != axis) continue;
                    float c, sn;
                    OffTable(p, i, c, sn);
                    dst.SetValue(at + i, c);
                    dst.SetValue(sinAt + at + i, sn);
                }
            }
        }
        if (scalarWritten) ScalarDoneBeforeVector();
    }

    const RopeTiling* tl_ = nullptr;

private:
    __aicore__ inline Source& Self() { return *static_cast<Source*>(this); }

    template <typename TT>
    __aicore__ inline void CastRows(const LocalTensor<float>& dst, int64_t sinAt, int64_t row0, int64_t n)
    {
        LocalTensor<TT> stage = stage_.AllocTensor<TT>();
        Self().template LoadRows<TT>(stage, stageSin_, row0, n);
        stage_.EnQue(stage);
        stage = stage_.DeQue<TT>();
        int32_t count = (int32_t)(n * ROWS_PER_TOKEN * tl_->halfPad);
        Cast(dst, stage, RoundMode::CAST_NONE, count);
        Cast(dst[sinAt], stage[stageSin_], RoundMode::CAST_NONE, count);
        stage_.FreeTensor(stage);
    }

    GlobalTensor<int32_t> pos32Gm_;
    GlobalTensor<int64_t> pos64Gm_, freqGm_;
    float attnFactor_ = 1.0f;
    GM_ADDR cos_ = nullptr;
    GM_ADDR sin_ = nullptr;
    int64_t stageSin_ = 0;
    TQue<QuePosition::VECIN, 1> stage_;  // 16-bit rows before their cast
};

// Positions -> rows of cos/sin tables [P, r/2] (rows cosStrideR / sinStrideR elements apart;
// float32, float16 or bfloat16); positions outside [0, P) never touch the tables.
class PositionTableSource : public SourceBase<PositionTableSource, 1> {
    friend class SourceBase<PositionTableSource, 1>;

public:
    __aicore__ inline PositionTableSource() {}

    __aicore__ inline void Fill(LocalTensor<float>& cs, int64_t sinBase, int64_t row0, int64_t n)
    {
        LoadFloatRows(cs, sinBase, row0, n);
        ComputeOffTableRows(cs, sinBase, row0, n);
    }

private:
    // One position per token, for every frequency.
    __aicore__ inline bool AxisUsed(int64_t) const { return true; }
    __aicore__ inline int64_t AxisOf(int64_t) const { return 0; }

    template <typename TT>
    __aicore__ inline void LoadRows(const LocalTensor<TT>& dst, int64_t sinAt, int64_t row0, int64_t n)
    {
        LoadPositionRows<TT>(dst, sinAt, row0, n);
    }
};

// Caller cos/sin per token: row (b, s) of each table at b * strideB + s * strideR (any strides,
// 0 where broadcast); no positions. One DataCopyPad per run of tokens inside one batch entry
// where the rows can be one strided copy, else one per token.
class TokenRowsSource : public SourceBase<TokenRowsSource, 1> {
    friend class SourceBase<TokenRowsSource, 1>;

public:
    __aicore__ inline TokenRowsSource() {}

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
        Tables(cosGm, sinGm);
        LoadTable<TT>(dst, cosGm, tl_->cosStrideB, tl_->cosStrideR, row0, n);
        LoadTable<TT>(dst[sinAt], sinGm, tl_->sinStrideB, tl_->sinStrideR, row0, n);
    }
};

// mRoPE: three positions per token (t, h, w: pos[axis, b, s]); frequency i takes the row of the
// position of its axis (AxisOf: chunked or interleaved sections). The rows of each axis's
// position (only axes that own frequencies) land in a [token, axis] stage (float32: cast from
// 16-bit tables; rows outside the table computed on the fly, only the frequencies of that axis),
// and one Gather per table picks each frequency's value from its axis's row.
class MRopeSource : public SourceBase<MRopeSource, 3> {
    using Base = SourceBase<MRopeSource, 3>;
    friend Base;

public:
    __aicore__ inline MRopeSource() {}

    __aicore__ inline void Init(const AngleGm& gm, const RopeTiling* tl, TPipe* pipe)
    {
        Base::Init(gm, tl, pipe);
        int64_t n = tl->tileRows, hp = tl->halfPad;
        pipe->InitBuffer(rows_, 1, 2 * 3 * n * hp * sizeof(float));
        pipe->InitBuffer(axisOff_, n * hp * sizeof(uint32_t));
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
        LoadFloatRows(rows, rowsSin, row0, n);
        if (tl.tableDtype == ROPE_TABLE_FP32) {  // rows copied straight in: MTE2 before the Gather
            rows_.EnQue(rows);
            rows = rows_.DeQue<float>();
        }
        ComputeOffTableRows(rows, rowsSin, row0, n);
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

    template <typename TT>
    __aicore__ inline void LoadRows(const LocalTensor<TT>& dst, int64_t sinAt, int64_t row0, int64_t n)
    {
        LoadPositionRows<TT>(dst, sinAt, row0, n);
    }

    TQue<QuePosition::VECIN, 1> rows_;
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
    __aicore__ inline void Init(TPipe* pipe, const RopeTiling* tl, const AngleGm& angles, int64_t zeroAt)
    {
        tl_ = tl;
        int64_t n = tl->tileRows, full = n * tl->rowPad;
        source_.Init(angles, tl, pipe);
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

// The GM arguments of the rotation's entries.
struct RopeGm {
    GM_ADDR q;
    GM_ADDR k;
    GM_ADDR qOut;
    GM_ADDR kOut;
    AngleGm angles;
    GM_ADDR tiling;
};

template <typename T, bool INVERSE, typename CosSinSource = PositionTableSource>
class RopeKernel {
public:
    __aicore__ inline RopeKernel() {}

    __aicore__ inline void Init(const RopeGm& gm)
    {
        LoadTilingFrom(gm.tiling, tl_);
        q_.Init(gm.q, tl_.qStrideB, tl_.qStrideS, tl_.qStrideH);
        qOut_.Init(gm.qOut, tl_.qoStrideB, tl_.qoStrideS, tl_.qoStrideH);
        if (tl_.kHeads > 0) {
            k_.Init(gm.k, tl_.kStrideB, tl_.kStrideS, tl_.kStrideH);
            kOut_.Init(gm.kOut, tl_.koStrideB, tl_.koStrideS, tl_.koStrideH);
        }
        CoreRows(tl_, rowStart_, rowCount_);
        if (tl_.tileRows <= 0) return;

        // UB: exactly tileRows * rope_row_bytes() + rope_fixed_bytes(), see rope_tiling.h.
        int64_t full = tl_.tileRows * tl_.rowPad;  // elements of one full-width tile buffer
        stage_.Init(&pipe_, &tl_, gm.angles, -1);
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
            for (int64_t h = 0; h < tl_.qHeads; ++h) RotateHead(q_, qOut_, h, row0, n);
            for (int64_t h = 0; h < tl_.kHeads; ++h) RotateHead(k_, kOut_, h, row0, n);
        }
    }

private:
    // Rotary dims [0, r) of head h of tokens row0 .. row0+n-1 (and the pass-through tail).
    __aicore__ inline void RotateHead(const HeadsGm<T>& in, const HeadsGm<T>& out, int64_t h, int64_t row0, int64_t n)
    {
        // Each row lands padded to rowPad elements (32 bytes) in UB.
        LocalTensor<T> x = inQueue_.AllocTensor<T>();
        LoadHeadRows(x, in, tl_, h, 0, tl_.rotaryDim, tl_.rowPad, row0, n);
        inQueue_.EnQue(x);
        if (tl_.tailPad > 0) CopyTail(in, out, h, row0, n);
        x = inQueue_.DeQue<T>();
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
        // Only the r valid elements of each UB row reach GM.
        y = outQueue_.DeQue<T>();
        StoreHeadRows(out, y, tl_, h, 0, tl_.rotaryDim, tl_.rowPad, row0, n);
        outQueue_.FreeTensor(y);
    }

    // Pass-through dims [r, D) when not in place: GM -> UB -> GM through a VECIN/VECOUT bound queue.
    __aicore__ inline void CopyTail(const HeadsGm<T>& in, const HeadsGm<T>& out, int64_t h, int64_t row0, int64_t n)
    {
        LocalTensor<T> t = tailQueue_.AllocTensor<T>();
        LoadHeadRows(t, in, tl_, h, tl_.rotaryDim, tl_.tailDim, tl_.tailPad, row0, n);
        tailQueue_.EnQue(t);
        t = tailQueue_.DeQue<T>();
        StoreHeadRows(out, t, tl_, h, tl_.rotaryDim, tl_.tailDim, tl_.tailPad, row0, n);
        tailQueue_.FreeTensor(t);
    }

    TPipe pipe_;
    RopeTiling tl_;
    RotationStage<INVERSE, CosSinSource> stage_;
    TQue<QuePosition::VECIN, BUFFER_NUM> inQueue_;
    TQue<QuePosition::VECOUT, BUFFER_NUM> outQueue_;
    TQueBind<TPosition::VECIN, TPosition::VECOUT, BUFFER_NUM> tailQueue_;
    TBuf<TPosition::VECCALC> xfBuf_, yfBuf_;
    HeadsGm<T> q_, k_, qOut_, kOut_;
    int64_t rowStart_ = 0, rowCount_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Launches: one kernel instantiation per cos/sin source, picked at run time.

template <typename Kernel, typename Gm>
__aicore__ inline void RunKernel(const Gm& gm)
{
    Kernel op;
    op.Init(gm);
    op.Process();
}

// One launch with the cos/sin source the tiling names (a new source is one more branch here).
// Kernels::With<Source> is the kernel class; gm the entry's GM arguments, the tiling among them.
template <typename Kernels, typename Gm>
__aicore__ inline void RunWithSource(const Gm& gm)
{
    GlobalTensor<int64_t> tg;
    tg.SetGlobalBuffer((__gm__ int64_t*)gm.tiling);
    int64_t kind = tg.GetValue(ROPE_TILING_INDEX(angleKind));
    if (kind == ROPE_ANGLES_TOKEN) {
        RunKernel<typename Kernels::template With<TokenRowsSource>>(gm);
    } else if (kind == ROPE_ANGLES_MROPE) {
        RunKernel<typename Kernels::template With<MRopeSource>>(gm);
    } else {
        RunKernel<typename Kernels::template With<PositionTableSource>>(gm);
    }
}

// RotaryEmbedding (INVERSE false) or RotaryEmbeddingGrad (true) for element type T.
template <typename T, bool INVERSE>
struct RopeKernels {
    template <typename Source>
    using With = RopeKernel<T, INVERSE, Source>;
};

}  // namespace rope_ops_ascend

#endif  // ROPE_OPS_ASCEND_ROPE_KERNEL_H
