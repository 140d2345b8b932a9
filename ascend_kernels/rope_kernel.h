// rope_ops Ascend C kernels: RotaryEmbedding (forward) and RotaryEmbeddingGrad (inverse rotation).
//
// One kernel class for both: the gradient of a rotation is the rotation by minus the angle, so
// RotaryEmbeddingGrad is RotaryEmbedding with the sign of sin flipped (INVERSE).
//
// Per call (see rope_tiling.h for the tiling):
//   q, k      [B, S, H, D] strided (any layout), stride 1 on D; k optional (kHeads == 0)
//   qOut, kOut same shapes, their own strides; equal to q, k when in place
//   pos       int32/int64 positions [B, S] (strided, 0 strides where shared), or none (offset + s)
//   cos, sin  float32 tables [P, r/2]; rows outside [0, P) are never read
//   freq      int64 [r/2] fixed-point turns, or none (then rows outside the table are NaN)
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
//   1. cos/sin stage (CosSinStage): a cos/sin source fills the tile's compact rows, m*cos and
//      m*sin of every frequency for each token; the kernel expands them to full width C and S'
//      once per tile. The source is a template parameter; PositionTableSource (the only one so
//      far) maps positions to table rows, or computes rows outside the table on the fly from
//      freq_turns (rope_math.h), or writes NaN. Caller cos/sin given per token, or mRoPE's
//      positions per axis and frequency section, are each one more source class.
//   2. rotate stage (RotateHead), for every head of q and of k, reusing C and S': load the rotary
//      dims of the tile's rows as float32 (LoadHead), rotate (RotateRows), round and store
//      (StoreHead); the pass-through dims [r, D) are copied apart (CopyTail), or left alone in
//      place. A prologue (the fused QKV split + per-head RMSNorm) is one step on the float rows
//      between LoadHead and RotateRows.
#ifndef ROPE_OPS_ASCEND_ROPE_KERNEL_H
#define ROPE_OPS_ASCEND_ROPE_KERNEL_H

#include "kernel_operator.h"
#define ROPE_KERNEL_SIDE
#include "rope_tiling.h"
#include "rope_math.h"

namespace rope_ops_ascend {

using namespace AscendC;

constexpr int32_t BUFFER_NUM = 2;  // double buffering of the x / y / tail queues

// ---------------------------------------------------------------------------------------------
// Cos/sin sources. A source is a class with
//   Init(pos, cos, sin, freq, tiling)  once per core: the kernel's pos/cos/sin/freq arguments,
//                                      whatever they hold for this source, and the tiling;
//   Fill(cs, sinBase, row0, n)         for the tokens row0 .. row0+n-1 of a tile, m*cos and m*sin
//                                      of frequency i < r/2 into cs[t * halfPad + i] and
//                                      cs[sinBase + t * halfPad + i], t < n.
// Fill never reads outside its GM inputs. It may write cs by DataCopyPad (MTE2, ordered by the
// csQueue events) or by the scalar unit; scalar writes it fences itself (V_S before the first,
// S_V after the last), since the vector unit may still read cs for the previous tile.

// Positions -> cos/sin table rows; positions outside [0, P) never touch the table: computed from
// freq_turns by the scalar unit (rope_math.h, any int64 position), or NaN without freq_turns.
class PositionTableSource {
public:
    __aicore__ inline PositionTableSource() {}

    __aicore__ inline void Init(GM_ADDR pos, GM_ADDR cos, GM_ADDR sin, GM_ADDR freq, const RopeTiling* tl)
    {
        tl_ = tl;
        if (tl->posMode == ROPE_POS_INT32) pos32Gm_.SetGlobalBuffer((__gm__ int32_t*)pos);
        if (tl->posMode == ROPE_POS_INT64) pos64Gm_.SetGlobalBuffer((__gm__ int64_t*)pos);
        cosGm_.SetGlobalBuffer((__gm__ float*)cos);
        sinGm_.SetGlobalBuffer((__gm__ float*)sin);
        if (tl->hasFreq) freqGm_.SetGlobalBuffer((__gm__ int64_t*)freq);
        union { int32_t i; float f; } bits;
        bits.i = (int32_t)tl->attnFactorBits;
        attnFactor_ = bits.f;
    }

    __aicore__ inline void Fill(LocalTensor<float>& cs, int64_t sinBase, int64_t row0, int64_t n)
    {
        const RopeTiling& tl = *tl_;
        DataCopyExtParams rowCopy{1, (uint32_t)(tl.halfDim * sizeof(float)), 0, 0, 0};
        DataCopyPadExtParams<float> noPad{};
        bool scalarWritten = false;
        for (int64_t t = 0; t < n; ++t) {
            int64_t row = row0 + t;
            int64_t b = row / tl.seq, s = row - b * tl.seq;
            int64_t p = Position(b, s);
            if (p >= 0 && p < tl.tableRows) {
                DataCopyPad(cs[t * tl.halfPad], cosGm_[p * tl.halfDim], rowCopy, noPad);
                DataCopyPad(cs[sinBase + t * tl.halfPad], sinGm_[p * tl.halfDim], rowCopy, noPad);
                continue;
            }
            if (!scalarWritten) {
                event_t vs = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::V_S));
                SetFlag<HardEvent::V_S>(vs);
                WaitFlag<HardEvent::V_S>(vs);
                scalarWritten = true;
            }
            RowOffTable(cs, t * tl.halfPad, sinBase + t * tl.halfPad, p);
        }
        if (scalarWritten) {
            event_t sv = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::S_V));
            SetFlag<HardEvent::S_V>(sv);
            WaitFlag<HardEvent::S_V>(sv);
        }
    }

private:
    __aicore__ inline int64_t Position(int64_t b, int64_t s)
    {
        const RopeTiling& tl = *tl_;
        if (tl.posMode == ROPE_POS_INT32) return pos32Gm_.GetValue(b * tl.posStrideB + s * tl.posStrideS);
        if (tl.posMode == ROPE_POS_INT64) return pos64Gm_.GetValue(b * tl.posStrideB + s * tl.posStrideS);
        return tl.posOffset + s;  // |posOffset| < 2^62 (rope_ops' limit): no overflow
    }

    // The row of a position outside the table, by the scalar unit.
    __aicore__ inline void RowOffTable(LocalTensor<float>& cs, int64_t cosAt, int64_t sinAt, int64_t p)
    {
        for (int64_t i = 0; i < tl_->halfDim; ++i) {
            float c, sn;
            if (tl_->hasFreq) {
                rope_sincos_turns(rope_turns_top(p, freqGm_.GetValue(i)), attnFactor_, &c, &sn);
            } else {
                union { uint32_t u; float f; } nan;
                nan.u = 0x7fc00000u;
                c = sn = nan.f;
            }
            cs.SetValue(cosAt + i, c);
            cs.SetValue(sinAt + i, sn);
        }
    }

    const RopeTiling* tl_ = nullptr;
    GlobalTensor<int32_t> pos32Gm_;
    GlobalTensor<int64_t> pos64Gm_, freqGm_;
    GlobalTensor<float> cosGm_, sinGm_;
    float attnFactor_ = 1.0f;
};

// ---------------------------------------------------------------------------------------------
// The kernel.

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
        source_.Init(pos, cos, sin, freq, &tl_);

        int64_t idx = GetBlockIdx();
        if (idx < tl_.formerNum) {
            rowStart_ = idx * tl_.formerRows;
            rowCount_ = tl_.formerRows;
        } else {
            rowStart_ = tl_.formerNum * tl_.formerRows + (idx - tl_.formerNum) * tl_.tailRows;
            rowCount_ = tl_.tailRows;
        }

        // UB: exactly rope_row_bytes() * tileRows, see rope_tiling.h.
        int64_t n = tl_.tileRows;
        int64_t full = n * tl_.rotPad;  // elements of one full-width tile buffer
        // cos/sin stage
        pipe_.InitBuffer(csQueue_, 1, 2 * n * tl_.halfPad * sizeof(float));
        pipe_.InitBuffer(cosBuf_, full * sizeof(float));
        pipe_.InitBuffer(sinBuf_, full * sizeof(float));
        pipe_.InitBuffer(expOffBuf_, full * sizeof(uint32_t));
        pipe_.InitBuffer(signBuf_, full * sizeof(float));
        // rotate stage
        pipe_.InitBuffer(inQueue_, BUFFER_NUM, full * sizeof(T));
        pipe_.InitBuffer(outQueue_, BUFFER_NUM, full * sizeof(T));
        if (tl_.tailPad > 0) pipe_.InitBuffer(tailQueue_, BUFFER_NUM, n * tl_.tailPad * sizeof(T));
        pipe_.InitBuffer(rotOffBuf_, full * sizeof(uint32_t));
        pipe_.InitBuffer(rotBuf_, full * sizeof(float));
        if (sizeof(T) != sizeof(float)) {
            pipe_.InitBuffer(xfBuf_, full * sizeof(float));
            pipe_.InitBuffer(yfBuf_, full * sizeof(float));
        }
        BuildTables();
    }

    __aicore__ inline void Process()
    {
        if (rowCount_ <= 0 || tl_.tileRows <= 0) return;
        for (int64_t done = 0; done < rowCount_; done += tl_.tileRows) {
            int64_t n = rowCount_ - done < tl_.tileRows ? rowCount_ - done : tl_.tileRows;
            int64_t row0 = rowStart_ + done;
            CosSinStage(row0, n);
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

    // Offset and sign tables for a whole tile: row 0 by the scalar unit, the other rows by
    // vector adds (row t of an offset table is row 0 plus t rows of bytes).
    __aicore__ inline void BuildTables()
    {
        int64_t n = tl_.tileRows;
        if (n <= 0) return;
        int64_t w = tl_.rotPad, r = tl_.rotaryDim, h = tl_.halfDim;
        LocalTensor<uint32_t> rotOff = rotOffBuf_.Get<uint32_t>();
        LocalTensor<uint32_t> expOff = expOffBuf_.Get<uint32_t>();
        LocalTensor<float> sign = signBuf_.Get<float>();
        const float neg = INVERSE ? 1.0f : -1.0f;
        for (int64_t j = 0; j < w; ++j) {
            int64_t partner = j, pair = 0;
            float sg = 1.0f;
            if (j < r) {
                if (tl_.interleaved) {
                    partner = j ^ 1;
                    pair = j >> 1;
                    sg = (j & 1) ? -neg : neg;
                } else {
                    partner = j < h ? j + h : j - h;
                    pair = j < h ? j : j - h;
                    sg = j < h ? neg : -neg;
                }
            }
            rotOff.SetValue(j, (uint32_t)(partner * sizeof(float)));
            expOff.SetValue(j, (uint32_t)(pair * sizeof(float)));
            sign.SetValue(j, sg);
        }
        event_t sv = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::S_V));
        SetFlag<HardEvent::S_V>(sv);
        WaitFlag<HardEvent::S_V>(sv);
        LocalTensor<int32_t> rotOffI = rotOff.template ReinterpretCast<int32_t>();
        LocalTensor<int32_t> expOffI = expOff.template ReinterpretCast<int32_t>();
        for (int64_t t = 1; t < n; ++t) {
            Adds(rotOffI[t * w], rotOffI, (int32_t)(t * w * sizeof(float)), (int32_t)w);
            Adds(expOffI[t * w], expOffI, (int32_t)(t * tl_.halfPad * sizeof(float)), (int32_t)w);
            Adds(sign[t * w], sign, 0.0f, (int32_t)w);
        }
    }

    // Rows row .. end-1 in tiles cross batch entries: (b, s) of `row` and how many rows from it
    // stay inside entry b (one strided copy each).
    __aicore__ inline int64_t Segment(int64_t row, int64_t end, int64_t& b, int64_t& s) const
    {
        b = row / tl_.seq;
        s = row - b * tl_.seq;
        return tl_.seq - s < end - row ? tl_.seq - s : end - row;
    }

    // ---- stage 1: cos/sin of the tile ----------------------------------------------------------

    // The source's compact rows of tokens row0 .. row0+n-1, expanded to the full width C and S'
    // in cosBuf_/sinBuf_ (sign of each element's role and INVERSE folded into S').
    __aicore__ inline void CosSinStage(int64_t row0, int64_t n)
    {
        LocalTensor<float> cs = csQueue_.AllocTensor<float>();
        int64_t sinBase = tl_.tileRows * tl_.halfPad;
        source_.Fill(cs, sinBase, row0, n);
        csQueue_.EnQue(cs);
        cs = csQueue_.DeQue<float>();
        int32_t count = (int32_t)(n * tl_.rotPad);
        LocalTensor<float> cosFull = cosBuf_.Get<float>();
        LocalTensor<float> sinFull = sinBuf_.Get<float>();
        LocalTensor<uint32_t> expOff = expOffBuf_.Get<uint32_t>();
        Gather(cosFull, cs, expOff, (uint32_t)0, (uint32_t)count);
        Gather(sinFull, cs, expOff, (uint32_t)(sinBase * sizeof(float)), (uint32_t)count);
        Mul(sinFull, sinFull, signBuf_.Get<float>(), count);
        csQueue_.FreeTensor(cs);
    }

    // ---- stage 2: rotate each head ---------------------------------------------------------------

    // `len` rows of `elems` elements, `stride` elements apart in GM, into consecutive UB rows of
    // `padElems` (32-byte multiple). Whole 32-byte blocks everywhere: DataCopy with block strides;
    // otherwise DataCopyPad (each row padded to 32 bytes in UB).
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
            DataCopyExtParams p{(uint16_t)len, (uint32_t)rowBytes, (uint32_t)gapBytes, 0, 0};
            DataCopyPadExtParams<T> noPad{};  // isPad = false: pad bytes are never stored
            DataCopyPad(dst, src, p, noPad);
        }
    }

    // The first `elems` elements of `len` UB rows of `padElems` to GM rows `stride` elements apart.
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
            DataCopyExtParams p{(uint16_t)len, (uint32_t)rowBytes, 0, (uint32_t)gapBytes, 0};
            DataCopyPad(dst, src, p);
        }
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
        int32_t count = (int32_t)(n * tl_.rotPad);
        if constexpr (sizeof(T) == sizeof(float)) {
            RotateRows(x.template ReinterpretCast<float>(), y.template ReinterpretCast<float>(), count);
        } else {
            LocalTensor<float> xf = xfBuf_.Get<float>();
            LocalTensor<float> yf = yfBuf_.Get<float>();
            Cast(xf, x, RoundMode::CAST_NONE, count);
            RotateRows(xf, yf, count);
            Cast(y, yf, RoundMode::CAST_RINT, count);
        }
        inQueue_.FreeTensor(x);
        outQueue_.EnQue(y);
        StoreHead(out, osb, oss, osh, h, row0, n);
    }

    // Copy in the rotary dims of head h, one strided copy per run of rows inside one batch entry;
    // each row lands padded to rotPad elements (32 bytes) in UB. Enqueued on inQueue_.
    __aicore__ inline void LoadHead(GlobalTensor<T>& in, int64_t sb, int64_t ss, int64_t sh, int64_t h,
                                    int64_t row0, int64_t n)
    {
        LocalTensor<T> x = inQueue_.AllocTensor<T>();
        for (int64_t row = row0, b, s, len; row < row0 + n; row += len) {
            len = Segment(row, row0 + n, b, s);
            CopyRowsIn(x[(row - row0) * tl_.rotPad], in[b * sb + s * ss + h * sh], len, tl_.rotaryDim, ss,
                       tl_.rotPad);
        }
        inQueue_.EnQue(x);
    }

    // y = x * C + R(x) * S' on `count` float32 elements (whole padded rows of the tile).
    __aicore__ inline void RotateRows(const LocalTensor<float>& xf, const LocalTensor<float>& yf, int32_t count)
    {
        LocalTensor<float> rot = rotBuf_.Get<float>();
        Gather(rot, xf, rotOffBuf_.Get<uint32_t>(), (uint32_t)0, (uint32_t)count);
        Mul(rot, rot, sinBuf_.Get<float>(), count);
        Mul(yf, xf, cosBuf_.Get<float>(), count);
        Add(yf, yf, rot, count);
    }

    // Copy out the y rows of outQueue_: only the r valid elements of each UB row reach GM.
    __aicore__ inline void StoreHead(GlobalTensor<T>& out, int64_t osb, int64_t oss, int64_t osh, int64_t h,
                                     int64_t row0, int64_t n)
    {
        LocalTensor<T> y = outQueue_.DeQue<T>();
        for (int64_t row = row0, b, s, len; row < row0 + n; row += len) {
            len = Segment(row, row0 + n, b, s);
            CopyRowsOut(out[b * osb + s * oss + h * osh], y[(row - row0) * tl_.rotPad], len, tl_.rotaryDim, oss,
                        tl_.rotPad);
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
            len = Segment(row, row0 + n, b, s);
            CopyRowsIn(t[(row - row0) * tl_.tailPad], in[b * sb + s * ss + h * sh + tl_.rotaryDim], len, tl_.tailDim,
                       ss, tl_.tailPad);
        }
        tailQueue_.EnQue(t);
        t = tailQueue_.DeQue<T>();
        for (int64_t row = row0, b, s, len; row < row0 + n; row += len) {
            len = Segment(row, row0 + n, b, s);
            CopyRowsOut(out[b * osb + s * oss + h * osh + tl_.rotaryDim], t[(row - row0) * tl_.tailPad], len,
                        tl_.tailDim, oss, tl_.tailPad);
        }
        tailQueue_.FreeTensor(t);
    }

    TPipe pipe_;
    TQue<QuePosition::VECIN, BUFFER_NUM> inQueue_;
    TQue<QuePosition::VECOUT, BUFFER_NUM> outQueue_;
    TQueBind<TPosition::VECIN, TPosition::VECOUT, BUFFER_NUM> tailQueue_;
    TQue<QuePosition::VECIN, 1> csQueue_;
    TBuf<TPosition::VECCALC> cosBuf_, sinBuf_, rotOffBuf_, expOffBuf_, signBuf_, rotBuf_, xfBuf_, yfBuf_;
    GlobalTensor<T> qGm_, kGm_, qOutGm_, kOutGm_;
    CosSinSource source_;
    RopeTiling tl_;
    int64_t rowStart_ = 0, rowCount_ = 0;
};

}  // namespace rope_ops_ascend

#endif  // ROPE_OPS_ASCEND_ROPE_KERNEL_H
