// rope_ops Ascend C kernels: the fused attention prologue (rope_ops.qkv_prologue) and its backward.
//
// Forward, per token row and head of the QKV projection's output (q heads, then k, then v):
//   q, k: load the whole head as float32; RMSNorm with float32 statistics where a weight is
//         given (x * 1/sqrt(mean(x^2) + eps) * (offset + w)); rotate (the cos/sin stage and the
//         rotation of rope_kernel.h, on whole heads: the pass-through dims come out exactly);
//         round once to T; store into q_out / k_out (or back into qkv in place) and, for k, into
//         the KV cache at the token's slot;
//   v:    copied to v_out (out of place) and into the cache.
// Cache slots outside [0, numSlots) (-1 included) are skipped: nothing is written outside a cache.
//
// Backward (grad_q, grad_k, grad_v -> grad_qkv, and the norm weights' gradients): per q/k head,
//   g' = the inverse rotation of the output gradient; without a weight dx = g'; with one
//   n = x * rstd, dw += g' * n, gn = g' * (offset + w), dx = rstd * (gn - n * mean(gn * n));
// v's gradient is copied; a missing output gradient is zero. Each core sums dw over its rows and
// heads in UB and writes one row of float32 partial sums [D]; the host adds the rows (a fixed
// order: deterministic).
//
// The RMSNorm is one step between the load and the rotation; the cos/sin stage is
// RotationStage<INVERSE, Source> with any of the three sources of rope_kernel.h.
#ifndef ROPE_OPS_ASCEND_PROLOGUE_KERNEL_H
#define ROPE_OPS_ASCEND_PROLOGUE_KERNEL_H

#include "rope_kernel.h"

namespace rope_ops_ascend {

// The GM arguments of the prologue's entries (one declaration each: GM_ADDR may be a macro).
struct PrologueGm {
    GM_ADDR q;
    GM_ADDR k;
    GM_ADDR v;
    GM_ADDR qOut;
    GM_ADDR kOut;
    GM_ADDR vOut;
    AngleGm angles;
    GM_ADDR qWeight;
    GM_ADDR kWeight;
    GM_ADDR kCache;
    GM_ADDR vCache;
    GM_ADDR slots;
    GM_ADDR tiling;
};

struct PrologueGradGm {
    GM_ADDR gradQ;
    GM_ADDR gradK;
    GM_ADDR gradV;
    GM_ADDR xq;  // the forward's input: q and k heads of qkv
    GM_ADDR xk;
    GM_ADDR dq;  // q, k and v heads of grad_qkv
    GM_ADDR dk;
    GM_ADDR dv;
    AngleGm angles;
    GM_ADDR qWeight;
    GM_ADDR kWeight;
    GM_ADDR dqWeight;  // float32 [cores, D]: each core's weight-gradient sums
    GM_ADDR dkWeight;
    GM_ADDR tiling;
};

__aicore__ inline void LoadDoneBeforeVector()
{
    event_t e = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::MTE2_V));
    SetFlag<HardEvent::MTE2_V>(e);
    WaitFlag<HardEvent::MTE2_V>(e);
}

__aicore__ inline void VectorDoneBeforeStore()
{
    event_t e = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::V_MTE3));
    SetFlag<HardEvent::V_MTE3>(e);
    WaitFlag<HardEvent::V_MTE3>(e);
}

// Row statistics of a tile's head rows (D valid columns of rowPad): each row's sum by ReduceSum
// into its own 32-byte block, vector math on the blocks, and a Gather that broadcasts row t's
// value over row t (offsets t * 32 bytes).
class RowStats {
public:
    __aicore__ inline RowStats() {}

    __aicore__ inline void Init(TPipe* pipe, const RopeTiling* tl)
    {
        tl_ = tl;
        int64_t n = tl->tileRows, full = n * tl->rowPad;
        pipe->InitBuffer(bcastOffBuf_, full * sizeof(uint32_t));
        pipe->InitBuffer(productBuf_, full * sizeof(float));
        pipe->InitBuffer(invRmsBuf_, full * sizeof(float));
        pipe->InitBuffer(statBuf_, n * ROPE_BLOCK_BYTES);
        pipe->InitBuffer(onesBuf_, n * ROPE_BLOCK_BYTES);
        pipe->InitBuffer(workBuf_, tl->rowPad * sizeof(float));
        LocalTensor<int32_t> off = bcastOffBuf_.Get<int32_t>();
        Duplicate(off, (int32_t)0, (int32_t)tl->rowPad);
        for (int64_t t = 1; t < n; ++t)
            Adds(off[t * tl->rowPad], off, (int32_t)(t * ROPE_BLOCK_BYTES), (int32_t)tl->rowPad);
        Duplicate(onesBuf_.Get<float>(), 1.0f, (int32_t)(n * BLOCK_FLOATS));
        invD_ = 1.0f / (float)tl->headDim;
        eps_ = FloatOfBits(tl->epsBits);
    }

    __aicore__ inline LocalTensor<float> Products() const { return productBuf_.Get<float>(); }
    __aicore__ inline LocalTensor<float> InvRmsRows() const { return invRmsBuf_.Get<float>(); }

    // 1 / sqrt(mean(x^2) + eps) of each of the n rows of x, broadcast over its row in InvRmsRows().
    __aicore__ inline void InvRms(const LocalTensor<float>& x, int64_t n)
    {
        int32_t count = (int32_t)(n * tl_->rowPad), blocks = (int32_t)(n * BLOCK_FLOATS);
        LocalTensor<float> sq = Products();
        LocalTensor<float> stat = statBuf_.Get<float>();
        Mul(sq, x, x, count);
        RowSums(sq, n);
        Muls(stat, stat, invD_, blocks);
        Adds(stat, stat, eps_, blocks);
        Sqrt(stat, stat, blocks);
        Div(stat, onesBuf_.Get<float>(), stat, blocks);
        Gather(InvRmsRows(), stat, bcastOffBuf_.Get<uint32_t>(), (uint32_t)0, (uint32_t)count);
    }

    // The mean of each of the n rows of src, broadcast over its row in dst (dst may be src).
    __aicore__ inline void RowMeans(const LocalTensor<float>& src, const LocalTensor<float>& dst, int64_t n)
    {
        LocalTensor<float> stat = statBuf_.Get<float>();
        RowSums(src, n);
        Muls(stat, stat, invD_, (int32_t)(n * BLOCK_FLOATS));
        Gather(dst, stat, bcastOffBuf_.Get<uint32_t>(), (uint32_t)0, (uint32_t)(n * tl_->rowPad));
    }

private:
    __aicore__ inline void RowSums(const LocalTensor<float>& src, int64_t n)
    {
        LocalTensor<float> stat = statBuf_.Get<float>();
        LocalTensor<float> work = workBuf_.Get<float>();
        for (int64_t t = 0; t < n; ++t)
            ReduceSum(stat[t * BLOCK_FLOATS], src[t * tl_->rowPad], work, (int32_t)tl_->headDim);
    }

    const RopeTiling* tl_ = nullptr;
    float invD_ = 1.0f, eps_ = 0.0f;
    TBuf<TPosition::VECCALC> bcastOffBuf_, productBuf_, invRmsBuf_, statBuf_, onesBuf_, workBuf_;
};

// What the forward and the backward share: tiling, row queues, head rows as float32, weights.
template <typename T>
class PrologueBase {
protected:
    __aicore__ inline void InitRows(TPipe& pipe, bool copyQueue)
    {
        int64_t full = tl_.tileRows * tl_.rowPad;
        pipe.InitBuffer(inQueue_, BUFFER_NUM, full * sizeof(T));
        pipe.InitBuffer(outQueue_, BUFFER_NUM, full * sizeof(T));
        if (copyQueue) pipe.InitBuffer(copyQueue_, BUFFER_NUM, full * sizeof(T));
        // Float head rows and, after them, the zero block the rotation's pass-through columns read.
        pipe.InitBuffer(rowsBuf_, (full + BLOCK_FLOATS) * sizeof(float));
        Duplicate(rowsBuf_.Get<float>()[full], 0.0f, (int32_t)BLOCK_FLOATS);
    }

    // offset + w, [D] float32 from GM, in every row of a [tileRows, rowPad] table.
    __aicore__ inline void InitWeight(TPipe& pipe, TBuf<TPosition::VECCALC>& buf, GM_ADDR weight)
    {
        int64_t w = tl_.rowPad;
        pipe.InitBuffer(buf, tl_.tileRows * w * sizeof(float));
        GlobalTensor<float> gm;
        gm.SetGlobalBuffer((__gm__ float*)weight);
        LocalTensor<float> table = buf.Get<float>();
        DataCopyExtParams row{1, (uint32_t)(tl_.headDim * sizeof(float)), 0, 0, 0};
        DataCopyPadExtParams<float> noPad{};
        DataCopyPad(table, gm, row, noPad);
        LoadDoneBeforeVector();
        Adds(table, table, FloatOfBits(tl_.weightOffsetBits), (int32_t)w);
        for (int64_t t = 1; t < tl_.tileRows; ++t) Muls(table[t * w], table, 1.0f, (int32_t)w);
    }

    // n rows of head h (D elements each, rows of rowPad) from GM into a queue tensor, enqueued.
    template <typename Q>
    __aicore__ inline void LoadRows(Q& queue, const HeadsGm<T>& gm, int64_t h, int64_t row0, int64_t n)
    {
        LocalTensor<T> x = queue.template AllocTensor<T>();
        LoadHeadRows(x, gm, tl_, h, 0, tl_.headDim, tl_.rowPad, row0, n);
        queue.EnQue(x);
    }

    __aicore__ inline void StoreRows(const HeadsGm<T>& gm, const LocalTensor<T>& y, int64_t h, int64_t row0,
                                     int64_t n)
    {
        StoreHeadRows(gm, y, tl_, h, 0, tl_.headDim, tl_.rowPad, row0, n);
    }

    // The loaded rows of head h as float32 (exactly: a widening cast, or a multiplication by 1).
    __aicore__ inline void LoadFloatRows(const LocalTensor<float>& dst, const HeadsGm<T>& gm, int64_t h, int64_t row0,
                                         int64_t n)
    {
        LoadRows(inQueue_, gm, h, row0, n);
        LocalTensor<T> x = inQueue_.template DeQue<T>();
        int32_t count = (int32_t)(n * tl_.rowPad);
        if constexpr (sizeof(T) == sizeof(float)) {
            Muls(dst, x.template ReinterpretCast<float>(), 1.0f, count);
        } else {
            Cast(dst, x, RoundMode::CAST_NONE, count);
        }
        inQueue_.FreeTensor(x);
    }

    // float32 rows rounded once to T into the out queue, then stored to GM.
    __aicore__ inline LocalTensor<T> RoundRows(const LocalTensor<float>& src, int64_t n)
    {
        LocalTensor<T> y = outQueue_.template AllocTensor<T>();
        int32_t count = (int32_t)(n * tl_.rowPad);
        if constexpr (sizeof(T) == sizeof(float)) {
            Muls(y.template ReinterpretCast<float>(), src, 1.0f, count);
        } else {
            Cast(y, src, RoundMode::CAST_RINT, count);
        }
        return y;
    }

    RopeTiling tl_;
    TQue<QuePosition::VECIN, BUFFER_NUM> inQueue_;
    TQue<QuePosition::VECOUT, BUFFER_NUM> outQueue_;
    TQueBind<TPosition::VECIN, TPosition::VECOUT, BUFFER_NUM> copyQueue_;  // heads moved unchanged
    TBuf<TPosition::VECCALC> rowsBuf_;  // float32 head rows + a zero block
    int64_t rowStart_ = 0, rowCount_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Forward.

template <typename T, typename Source>
class PrologueKernel : public PrologueBase<T> {
    using Base = PrologueBase<T>;
    using Base::tl_;

public:
    static constexpr int NO_CACHE = 0, K_CACHE = 1, V_CACHE = 2;  // where CopyHead/CacheRows write rows

    __aicore__ inline PrologueKernel() {}

    __aicore__ inline void Init(const PrologueGm& gm)
    {
        LoadTilingFrom(gm.tiling, tl_);
        CoreRows(tl_, this->rowStart_, this->rowCount_);
        q_.Init(gm.q, tl_.qStrideB, tl_.qStrideS, tl_.qStrideH);
        k_.Init(gm.k, tl_.kStrideB, tl_.kStrideS, tl_.kStrideH);
        v_.Init(gm.v, tl_.vStrideB, tl_.vStrideS, tl_.vStrideH);
        qOut_.Init(gm.qOut, tl_.qoStrideB, tl_.qoStrideS, tl_.qoStrideH);
        kOut_.Init(gm.kOut, tl_.koStrideB, tl_.koStrideS, tl_.koStrideH);
        if (!tl_.inplace) vOut_.Init(gm.vOut, tl_.voStrideB, tl_.voStrideS, tl_.voStrideH);
        if (tl_.hasCache) {
            kCacheGm_.SetGlobalBuffer((__gm__ T*)gm.kCache);
            vCacheGm_.SetGlobalBuffer((__gm__ T*)gm.vCache);
            if (tl_.slotMode == ROPE_POS_INT32) slot32Gm_.SetGlobalBuffer((__gm__ int32_t*)gm.slots);
            else slot64Gm_.SetGlobalBuffer((__gm__ int64_t*)gm.slots);
        }
        if (tl_.tileRows <= 0) return;

        // UB: exactly tileRows * rope_row_bytes() + rope_fixed_bytes(), see rope_tiling.h.
        int64_t full = tl_.tileRows * tl_.rowPad;
        if (tl_.rotate)
            stage_.Init(&pipe_, &tl_, gm.angles, full * (int64_t)sizeof(float));
        this->InitRows(pipe_, true);
        if (sizeof(T) != sizeof(float) && tl_.rotate) pipe_.InitBuffer(rotatedBuf_, full * sizeof(float));
        if (tl_.hasQWeight) this->InitWeight(pipe_, qWeightBuf_, gm.qWeight);
        if (tl_.hasKWeight) this->InitWeight(pipe_, kWeightBuf_, gm.kWeight);
        if (tl_.hasQWeight || tl_.hasKWeight) stats_.Init(&pipe_, &tl_);
    }

    __aicore__ inline void Process()
    {
        if (this->rowCount_ <= 0 || tl_.tileRows <= 0) return;
        const int kCache = tl_.hasCache ? K_CACHE : NO_CACHE;
        for (int64_t done = 0; done < this->rowCount_; done += tl_.tileRows) {
            int64_t n = this->rowCount_ - done < tl_.tileRows ? this->rowCount_ - done : tl_.tileRows;
            int64_t row0 = this->rowStart_ + done;
            if (tl_.rotate) stage_.Fill(row0, n);
            for (int64_t h = 0; h < tl_.qHeads; ++h) {
                if (tl_.hasQWeight || tl_.rotate) {
                    NormRotateHead(q_, qOut_, tl_.hasQWeight ? &qWeightBuf_ : nullptr, NO_CACHE, h, row0, n);
                } else if (!tl_.inplace) {
                    CopyHead(q_, qOut_, true, NO_CACHE, h, row0, n);
                }
            }
            for (int64_t h = 0; h < tl_.kHeads; ++h) {
                if (tl_.hasKWeight || tl_.rotate) {
                    NormRotateHead(k_, kOut_, tl_.hasKWeight ? &kWeightBuf_ : nullptr, kCache, h, row0, n);
                } else if (!tl_.inplace || tl_.hasCache) {
                    CopyHead(k_, kOut_, !tl_.inplace, kCache, h, row0, n);
                }
            }
            for (int64_t h = 0; h < tl_.kHeads && (!tl_.inplace || tl_.hasCache); ++h)
                CopyHead(v_, vOut_, !tl_.inplace, tl_.hasCache ? V_CACHE : NO_CACHE, h, row0, n);
        }
    }

private:
    // A q or k head: load, normalise (weight given), rotate (rotate), round, store (and cache k).
    __aicore__ inline void NormRotateHead(const HeadsGm<T>& in, const HeadsGm<T>& out,
                                          TBuf<TPosition::VECCALC>* weight, int cache, int64_t h, int64_t row0,
                                          int64_t n)
    {
        int32_t count = (int32_t)(n * tl_.rowPad);
        LocalTensor<float> x = this->rowsBuf_.template Get<float>();
        this->LoadFloatRows(x, in, h, row0, n);
        if (weight != nullptr) {
            stats_.InvRms(x, n);
            Mul(x, x, stats_.InvRmsRows(), count);
            Mul(x, x, weight->template Get<float>(), count);
        }
        LocalTensor<T> y;
        if (!tl_.rotate) {
            y = this->RoundRows(x, n);
        } else if constexpr (sizeof(T) == sizeof(float)) {
            y = this->outQueue_.template AllocTensor<T>();
            stage_.Rotate(x, y.template ReinterpretCast<float>(), count);
        } else {
            LocalTensor<float> rotated = rotatedBuf_.Get<float>();
            stage_.Rotate(x, rotated, count);
            y = this->RoundRows(rotated, n);
        }
        this->outQueue_.EnQue(y);
        y = this->outQueue_.template DeQue<T>();
        this->StoreRows(out, y, h, row0, n);
        if (cache != NO_CACHE) CacheRows(cache, y, h, row0, n);
        this->outQueue_.FreeTensor(y);
    }

    // A head moved unchanged: to its output (writeOut) and/or a cache.
    __aicore__ inline void CopyHead(const HeadsGm<T>& in, const HeadsGm<T>& out, bool writeOut, int cache, int64_t h,
                                    int64_t row0, int64_t n)
    {
        this->LoadRows(this->copyQueue_, in, h, row0, n);
        LocalTensor<T> rows = this->copyQueue_.template DeQue<T>();
        if (writeOut) this->StoreRows(out, rows, h, row0, n);
        if (cache != NO_CACHE) CacheRows(cache, rows, h, row0, n);
        this->copyQueue_.FreeTensor(rows);
    }

    // Row t of `rows` (head h of token row0 + t) to cache[slot, h] when 0 <= slot < numSlots.
    __aicore__ inline void CacheRows(int cache, const LocalTensor<T>& rows, int64_t h, int64_t row0, int64_t n)
    {
        const GlobalTensor<T>& gm = cache == K_CACHE ? kCacheGm_ : vCacheGm_;
        int64_t strideSlot = cache == K_CACHE ? tl_.kcStrideS : tl_.vcStrideS;
        int64_t strideH = cache == K_CACHE ? tl_.kcStrideH : tl_.vcStrideH;
        for (int64_t t = 0; t < n; ++t) {
            int64_t b, s;
            TokenOf(tl_, row0 + t, b, s);
            int64_t at = b * tl_.slotStrideB + s * tl_.slotStrideS;
            int64_t slot = tl_.slotMode == ROPE_POS_INT32 ? (int64_t)slot32Gm_.GetValue(at) : slot64Gm_.GetValue(at);
            if (slot < 0 || slot >= tl_.numSlots) continue;
            CopyRowsOut(gm[slot * strideSlot + h * strideH], rows[t * tl_.rowPad], 1, tl_.headDim, 0, tl_.rowPad);
        }
    }

    TPipe pipe_;
    RotationStage<false, Source> stage_;
    RowStats stats_;
    TBuf<TPosition::VECCALC> rotatedBuf_, qWeightBuf_, kWeightBuf_;
    HeadsGm<T> q_, k_, v_, qOut_, kOut_, vOut_;
    GlobalTensor<T> kCacheGm_, vCacheGm_;
    GlobalTensor<int32_t> slot32Gm_;
    GlobalTensor<int64_t> slot64Gm_;
};

// ---------------------------------------------------------------------------------------------
// Backward.

template <typename T, typename Source>
class PrologueGradKernel : public PrologueBase<T> {
    using Base = PrologueBase<T>;
    using Base::tl_;

public:
    __aicore__ inline PrologueGradKernel() {}

    __aicore__ inline void Init(const PrologueGradGm& gm)
    {
        LoadTilingFrom(gm.tiling, tl_);
        CoreRows(tl_, this->rowStart_, this->rowCount_);
        if (tl_.hasGradQ) gradQ_.Init(gm.gradQ, tl_.qStrideB, tl_.qStrideS, tl_.qStrideH);
        if (tl_.hasGradK) gradK_.Init(gm.gradK, tl_.kStrideB, tl_.kStrideS, tl_.kStrideH);
        if (tl_.hasGradV) gradV_.Init(gm.gradV, tl_.vStrideB, tl_.vStrideS, tl_.vStrideH);
        xq_.Init(gm.xq, tl_.xqStrideB, tl_.xqStrideS, tl_.xqStrideH);
        xk_.Init(gm.xk, tl_.xkStrideB, tl_.xkStrideS, tl_.xkStrideH);
        dq_.Init(gm.dq, tl_.qoStrideB, tl_.qoStrideS, tl_.qoStrideH);
        dk_.Init(gm.dk, tl_.koStrideB, tl_.koStrideS, tl_.koStrideH);
        dv_.Init(gm.dv, tl_.voStrideB, tl_.voStrideS, tl_.voStrideH);
        dqWeightGm_.SetGlobalBuffer((__gm__ float*)gm.dqWeight);
        dkWeightGm_.SetGlobalBuffer((__gm__ float*)gm.dkWeight);
        if (tl_.tileRows <= 0) return;

        // UB: exactly tileRows * rope_row_bytes() + rope_fixed_bytes(), see rope_tiling.h.
        int64_t full = tl_.tileRows * tl_.rowPad;
        if (tl_.rotate)
            stage_.Init(&pipe_, &tl_, gm.angles, full * (int64_t)sizeof(float));
        this->InitRows(pipe_, true);
        if (tl_.rotate) pipe_.InitBuffer(rotatedBuf_, full * sizeof(float));
        if (tl_.hasQWeight || tl_.hasKWeight) {
            pipe_.InitBuffer(xBuf_, full * sizeof(float));
            stats_.Init(&pipe_, &tl_);
        }
        if (tl_.hasQWeight) InitWeightAndSums(qWeightBuf_, qSumBuf_, gm.qWeight);
        if (tl_.hasKWeight) InitWeightAndSums(kWeightBuf_, kSumBuf_, gm.kWeight);
    }

    __aicore__ inline void Process()
    {
        if (this->rowCount_ <= 0 || tl_.tileRows <= 0) return;
        for (int64_t done = 0; done < this->rowCount_; done += tl_.tileRows) {
            int64_t n = this->rowCount_ - done < tl_.tileRows ? this->rowCount_ - done : tl_.tileRows;
            int64_t row0 = this->rowStart_ + done;
            if (tl_.rotate) stage_.Fill(row0, n);
            for (int64_t h = 0; h < tl_.qHeads; ++h)
                GradHead(gradQ_, tl_.hasGradQ != 0, xq_, dq_, tl_.hasQWeight != 0, qWeightBuf_, qSumBuf_, h, row0, n);
            for (int64_t h = 0; h < tl_.kHeads; ++h)
                GradHead(gradK_, tl_.hasGradK != 0, xk_, dk_, tl_.hasKWeight != 0, kWeightBuf_, kSumBuf_, h, row0, n);
            for (int64_t h = 0; h < tl_.kHeads; ++h) {
                if (tl_.hasGradV) {
                    CopyRows(gradV_, dv_, h, row0, n);
                } else {
                    ZeroHead(dv_, h, row0, n);
                }
            }
        }
        if (tl_.hasQWeight) StoreSums(qSumBuf_, dqWeightGm_);
        if (tl_.hasKWeight) StoreSums(kSumBuf_, dkWeightGm_);
    }

private:
    __aicore__ inline void InitWeightAndSums(TBuf<TPosition::VECCALC>& weight, TBuf<TPosition::VECCALC>& sums,
                                             GM_ADDR gm)
    {
        this->InitWeight(pipe_, weight, gm);
        pipe_.InitBuffer(sums, tl_.tileRows * tl_.rowPad * sizeof(float));
        Duplicate(sums.Get<float>(), 0.0f, (int32_t)(tl_.tileRows * tl_.rowPad));
    }

    // d qkv of one q or k head from its output gradient (zero when absent) and, with a weight,
    // the forward's input head x; the weight gradient's products are added to `sums`.
    __aicore__ inline void GradHead(const HeadsGm<T>& grad, bool hasGrad, const HeadsGm<T>& x, const HeadsGm<T>& out,
                                    bool weighted, TBuf<TPosition::VECCALC>& weight, TBuf<TPosition::VECCALC>& sums,
                                    int64_t h, int64_t row0, int64_t n)
    {
        if (!hasGrad) {
            ZeroHead(out, h, row0, n);
            return;
        }
        if (!weighted && !tl_.rotate) {
            CopyRows(grad, out, h, row0, n);
            return;
        }
        int32_t count = (int32_t)(n * tl_.rowPad);
        LocalTensor<float> g = this->rowsBuf_.template Get<float>();
        this->LoadFloatRows(g, grad, h, row0, n);
        if (tl_.rotate) {
            LocalTensor<float> rotated = rotatedBuf_.Get<float>();
            stage_.Rotate(g, rotated, count);  // the rotation's transpose: by minus the angle
            g = rotated;
        }
        if (weighted) {
            LocalTensor<float> xf = xBuf_.Get<float>();
            LocalTensor<float> prod = stats_.Products();
            this->LoadFloatRows(xf, x, h, row0, n);
            stats_.InvRms(xf, n);
            LocalTensor<float> invRms = stats_.InvRmsRows();
            Mul(xf, xf, invRms, count);                    // n = x * rstd
            Mul(prod, g, xf, count);
            Add(sums.Get<float>(), sums.Get<float>(), prod, count);  // dw += g * n
            Mul(g, g, weight.Get<float>(), count);         // gn = g * (offset + w)
            Mul(prod, g, xf, count);
            stats_.RowMeans(prod, prod, n);                // mean(gn * n) over each row
            Mul(prod, prod, xf, count);
            Sub(g, g, prod, count);
            Mul(g, g, invRms, count);                      // rstd * (gn - n * mean(gn * n))
        }
        LocalTensor<T> y = this->RoundRows(g, n);
        this->outQueue_.EnQue(y);
        y = this->outQueue_.template DeQue<T>();
        this->StoreRows(out, y, h, row0, n);
        this->outQueue_.FreeTensor(y);
    }

    // Head h moved unchanged from `in` to `out` through the bound queue.
    __aicore__ inline void CopyRows(const HeadsGm<T>& in, const HeadsGm<T>& out, int64_t h, int64_t row0, int64_t n)
    {
        this->LoadRows(this->copyQueue_, in, h, row0, n);
        LocalTensor<T> rows = this->copyQueue_.template DeQue<T>();
        this->StoreRows(out, rows, h, row0, n);
        this->copyQueue_.FreeTensor(rows);
    }

    __aicore__ inline void ZeroHead(const HeadsGm<T>& out, int64_t h, int64_t row0, int64_t n)
    {
        LocalTensor<T> y = this->outQueue_.template AllocTensor<T>();
        Duplicate(y, static_cast<T>(0.0f), (int32_t)(n * tl_.rowPad));
        this->outQueue_.EnQue(y);
        y = this->outQueue_.template DeQue<T>();
        this->StoreRows(out, y, h, row0, n);
        this->outQueue_.FreeTensor(y);
    }

    // This core's weight-gradient sums: the tile rows added in order, row blockIdx of the output.
    __aicore__ inline void StoreSums(TBuf<TPosition::VECCALC>& sums, const GlobalTensor<float>& gm)
    {
        LocalTensor<float> acc = sums.Get<float>();
        for (int64_t t = 1; t < tl_.tileRows; ++t) Add(acc, acc, acc[t * tl_.rowPad], (int32_t)tl_.rowPad);
        VectorDoneBeforeStore();
        DataCopyExtParams row{1, (uint32_t)(tl_.headDim * sizeof(float)), 0, 0, 0};
        DataCopyPad(gm[GetBlockIdx() * tl_.headDim], acc, row);
    }

    TPipe pipe_;
    RotationStage<true, Source> stage_;
    RowStats stats_;
    TBuf<TPosition::VECCALC> rotatedBuf_, xBuf_, qWeightBuf_, kWeightBuf_, qSumBuf_, kSumBuf_;
    HeadsGm<T> gradQ_, gradK_, gradV_, xq_, xk_, dq_, dk_, dv_;
    GlobalTensor<float> dqWeightGm_, dkWeightGm_;
};

// The fused prologue's forward and backward for element type T (RunWithSource, rope_kernel.h).
template <typename T>
struct PrologueKernels {
    template <typename Source>
    using With = PrologueKernel<T, Source>;
};

template <typename T>
struct PrologueGradKernels {
    template <typename Source>
    using With = PrologueGradKernel<T, Source>;
};

}  // namespace rope_ops_ascend

#endif  // ROPE_OPS_ASCEND_PROLOGUE_KERNEL_H
