// A small CPU emulation of the Ascend C APIs that rope_kernel.h uses, so that the shipped kernel
// source compiles with g++ and runs on the host, one AI core after another. Written for rope_ops'
// tests from the documented semantics (no CANN code); it is stricter than the hardware where the
// hardware would silently misbehave:
//   * GM: every access is checked against the buffers the harness registered (out-of-bounds reads
//     of the cos/sin tables, or writes past an output, are errors); bytes read/written per buffer
//     are counted.
//   * UB: one arena of the run-time UB size per core, filled with 0xFF (NaN) so that padding or
//     uninitialised lanes that leak into outputs show up; TPipe::InitBuffer fails past the UB size;
//     every LocalTensor access is bounds-checked against its buffer; vector operands and DataCopy
//     UB addresses must be 32-byte aligned.
//   * DataCopy: length must be a multiple of 32 bytes (the hardware would round it down); with
//     DataCopyParams (lengths and strides in 32-byte blocks) the GM address must be 32-byte aligned.
//   * DataCopyPad: blockCount <= 4095, blockLen <= 2097151 and a multiple of sizeof(T); each block
//     lands 32-byte padded in UB (pad bytes 0xFF unless isPad); GM-side strides in bytes, UB-side
//     strides in 32-byte blocks; only blockLen bytes per block reach GM on copy-out.
//   * TQue: AllocTensor beyond the queue depth, EnQue/DeQue/FreeTensor out of order are errors.
//   * Cast: CAST_NONE for widening (exact), CAST_RINT (round to nearest even) for narrowing.
//   * Vector float arithmetic is float32 without fused multiply-add (build with -ffp-contract=off).
// Pipes run in program order, so synchronisation (SetFlag/WaitFlag, queue events) is not modelled:
// a missing barrier cannot be found here.
#ifndef ROPE_OPS_CPU_SIM_KERNEL_OPERATOR_H
#define ROPE_OPS_CPU_SIM_KERNEL_OPERATOR_H

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#define __aicore__
#define __global__
#define __gm__
#define GM_ADDR uint8_t*

// ---------------------------------------------------------------------------------------------
// Data types.

typedef _Float16 half;

struct bfloat16_t {
    uint16_t bits = 0;
    bfloat16_t() = default;
    explicit bfloat16_t(float f) {  // round to nearest even, NaN kept quiet
        uint32_t u;
        std::memcpy(&u, &f, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) { bits = (uint16_t)((u >> 16) | 0x40); return; }
        u += 0x7fffu + ((u >> 16) & 1u);
        bits = (uint16_t)(u >> 16);
    }
    explicit operator float() const {
        uint32_t u = (uint32_t)bits << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
};

namespace rope_sim {

struct SimError : std::runtime_error {
    explicit SimError(const std::string& m) : std::runtime_error(m) {}
};

struct GmRegion {
    uintptr_t begin, end;
    int64_t readBytes, writeBytes;
};

struct State {
    std::vector<GmRegion> regions;
    std::vector<uint8_t> ub;  // this core's unified buffer
    size_t ubUsed = 0;
    size_t ubPeak = 0;
    int64_t blockIdx = 0, blockNum = 1;
    int64_t dataCopyPadCalls = 0, dataCopyCalls = 0, vectorCalls = 0, scalarUbWrites = 0;
    void* pipe = nullptr;
};

inline State& st() {
    static State s;
    return s;
}

[[noreturn]] inline void fail(const std::string& m) { throw SimError(m); }

inline GmRegion& gm_region(const void* p, size_t bytes, const char* what) {
    uintptr_t a = (uintptr_t)p;
    for (auto& r : st().regions)
        if (a >= r.begin && a + bytes <= r.end) return r;
    fail(std::string("GM access outside every registered buffer: ") + what);
}
inline void gm_read(const void* p, size_t bytes, const char* what) { gm_region(p, bytes, what).readBytes += bytes; }
inline void gm_write(const void* p, size_t bytes, const char* what) { gm_region(p, bytes, what).writeBytes += bytes; }

// Reset a core: a fresh UB of ubSize bytes filled with 0xFF.
inline void reset_core(int64_t blockIdx, int64_t blockNum, size_t ubSize) {
    State& s = st();
    s.ub.assign(ubSize, 0xFF);
    s.ubUsed = 0;
    s.blockIdx = blockIdx;
    s.blockNum = blockNum;
}

}  // namespace rope_sim

namespace AscendC {

enum class TPosition { GM, A1, A2, B1, B2, C1, C2, CO1, CO2, VECIN, VECOUT, VECCALC, LCM, SPM, SHM, TSCM, MAX };
using QuePosition = TPosition;
enum class RoundMode { CAST_NONE, CAST_RINT, CAST_FLOOR, CAST_CEIL, CAST_ROUND, CAST_TRUNC, CAST_ODD };
enum class HardEvent { MTE2_MTE1, MTE1_MTE2, MTE1_M, M_MTE1, MTE2_V, V_MTE2, MTE3_V, V_MTE3, M_V, V_M, V_V,
                       MTE3_MTE1, MTE1_MTE3, MTE1_V, MTE2_M, M_MTE2, V_MTE1, M_FIX, FIX_M, MTE3_MTE2,
                       MTE2_MTE3, S_V, V_S, S_MTE2, MTE2_S, S_MTE3, MTE3_S, MTE2_FIX, FIX_MTE2, FIX_S,
                       M_S, FIX_MTE3 };
enum pipe_t { PIPE_S, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_ALL };
typedef int32_t event_t;

template <HardEvent E> inline void SetFlag(event_t) {}
template <HardEvent E> inline void WaitFlag(event_t) {}
template <pipe_t P> inline void PipeBarrier() {}

inline int64_t GetBlockIdx() { return rope_sim::st().blockIdx; }
inline int64_t GetBlockNum() { return rope_sim::st().blockNum; }

template <typename T> class LocalTensor {
public:
    LocalTensor() = default;
    LocalTensor(uint32_t bufBegin, uint32_t bufEnd, uint32_t off) : bufBegin_(bufBegin), bufEnd_(bufEnd), off_(off) {}

    LocalTensor operator[](int64_t i) const {
        int64_t off = (int64_t)off_ + i * (int64_t)sizeof(T);
        if (i < 0 || off > (int64_t)bufEnd_) rope_sim::fail("LocalTensor index outside its buffer");
        return LocalTensor(bufBegin_, bufEnd_, (uint32_t)off);
    }
    T GetValue(int64_t i) const { T v; std::memcpy(&v, at(i), sizeof(T)); return v; }
    void SetValue(int64_t i, T v) const { std::memcpy(at(i), &v, sizeof(T)); ++rope_sim::st().scalarUbWrites; }
    template <typename U> LocalTensor<U> ReinterpretCast() const { return LocalTensor<U>(bufBegin_, bufEnd_, off_); }
    uint32_t GetSize() const { return (bufEnd_ - off_) / sizeof(T); }

    // Emulator helpers.
    uint32_t offset() const { return off_; }
    uint32_t bufBegin() const { return bufBegin_; }
    uint32_t bufEnd() const { return bufEnd_; }
    uint8_t* bytes(int64_t byteOff, int64_t len) const {
        int64_t a = (int64_t)off_ + byteOff;
        if (byteOff < 0 || a + len > (int64_t)bufEnd_) rope_sim::fail("UB access outside the tensor's buffer");
        return rope_sim::st().ub.data() + a;
    }
    T* elems(int64_t count) const { return reinterpret_cast<T*>(bytes(0, count * (int64_t)sizeof(T))); }
    void check_aligned(const char* what) const {
        if (off_ % 32 != 0) rope_sim::fail(std::string(what) + ": UB operand not 32-byte aligned");
    }

private:
    uint8_t* at(int64_t i) const { return bytes(i * (int64_t)sizeof(T), sizeof(T)); }
    uint32_t bufBegin_ = 0, bufEnd_ = 0, off_ = 0;
};

template <typename T> class GlobalTensor {
public:
    void SetGlobalBuffer(__gm__ T* p, uint64_t = 0) { p_ = p; }
    GlobalTensor operator[](uint64_t i) const { GlobalTensor g; g.p_ = p_ + i; return g; }
    T GetValue(uint64_t i) const {
        rope_sim::gm_read(p_ + i, sizeof(T), "GlobalTensor::GetValue");
        T v; std::memcpy(&v, p_ + i, sizeof(T)); return v;
    }
    void SetValue(uint64_t i, T v) const {
        rope_sim::gm_write(p_ + i, sizeof(T), "GlobalTensor::SetValue");
        std::memcpy(p_ + i, &v, sizeof(T));
    }
    T* GetPhyAddr() const { return p_; }

private:
    T* p_ = nullptr;
};

class TPipe;
inline TPipe* GetTPipePtr() { return static_cast<TPipe*>(rope_sim::st().pipe); }

// A queue: `num` buffers of `len` bytes; states checked on every call.
template <TPosition POS, int32_t DEPTH> class TQue {
public:
    template <typename T> LocalTensor<T> AllocTensor() {
        for (size_t n = 0; n < state_.size(); ++n) {
            size_t i = (next_ + n) % state_.size();
            if (state_[i] == FREE) {
                state_[i] = ALLOCATED;
                next_ = i + 1;
                return LocalTensor<T>(begin_[i], begin_[i] + len_, begin_[i]);
            }
        }
        rope_sim::fail("TQue::AllocTensor: every buffer of the queue is in use");
    }
    template <typename T> void EnQue(const LocalTensor<T>& t) {
        size_t i = find(t, "EnQue");
        if (state_[i] != ALLOCATED) rope_sim::fail("TQue::EnQue of a tensor that is not freshly allocated");
        state_[i] = QUEUED;
        fifo_.push_back(i);
    }
    template <typename T> LocalTensor<T> DeQue() {
        if (fifo_.empty()) rope_sim::fail("TQue::DeQue on an empty queue");
        size_t i = fifo_.front();
        fifo_.erase(fifo_.begin());
        state_[i] = DEQUEUED;
        return LocalTensor<T>(begin_[i], begin_[i] + len_, begin_[i]);
    }
    template <typename T> void FreeTensor(const LocalTensor<T>& t) {
        size_t i = find(t, "FreeTensor");
        if (state_[i] == FREE || state_[i] == QUEUED) rope_sim::fail("TQue::FreeTensor of a tensor not owned");
        state_[i] = FREE;
    }
    void init(uint32_t first, int32_t num, uint32_t len) {
        if (num < 1 || num > DEPTH) rope_sim::fail("TPipe::InitBuffer: buffer count outside [1, queue depth]");
        len_ = len;
        for (int32_t i = 0; i < num; ++i) { begin_.push_back(first + i * len); state_.push_back(FREE); }
    }

private:
    enum S { FREE, ALLOCATED, QUEUED, DEQUEUED };
    template <typename T> size_t find(const LocalTensor<T>& t, const char* what) {
        for (size_t i = 0; i < begin_.size(); ++i)
            if (begin_[i] == t.offset()) return i;
        rope_sim::fail(std::string("TQue::") + what + " of a tensor from another queue");
    }
    std::vector<uint32_t> begin_;
    std::vector<S> state_;
    std::vector<size_t> fifo_;
    size_t next_ = 0;
    uint32_t len_ = 0;
};

template <TPosition SRC, TPosition DST, int32_t DEPTH> class TQueBind : public TQue<SRC, DEPTH> {};

template <TPosition POS> class TBuf {
public:
    template <typename T> LocalTensor<T> Get() const {
        if (len_ == 0) rope_sim::fail("TBuf::Get before InitBuffer");
        return LocalTensor<T>(begin_, begin_ + len_, begin_);
    }
    template <typename T> LocalTensor<T> Get(uint32_t count) const {
        if (count * sizeof(T) > len_) rope_sim::fail("TBuf::Get(len) larger than the buffer");
        return LocalTensor<T>(begin_, begin_ + count * sizeof(T), begin_);
    }
    void init(uint32_t first, uint32_t len) { begin_ = first; len_ = len; }

private:
    uint32_t begin_ = 0, len_ = 0;
};

class TPipe {
public:
    TPipe() { rope_sim::st().pipe = this; }
    ~TPipe() { if (rope_sim::st().pipe == this) rope_sim::st().pipe = nullptr; }
    template <TPosition POS, int32_t DEPTH> void InitBuffer(TQue<POS, DEPTH>& q, int32_t num, uint32_t len) {
        uint32_t l = round(len);
        q.init(take((size_t)l * num), num, l);
    }
    template <TPosition POS> void InitBuffer(TBuf<POS>& b, uint32_t len) { b.init(take(round(len)), round(len)); }
    event_t FetchEventID(HardEvent) { return 0; }

private:
    static uint32_t round(uint32_t len) { return (len + 31u) / 32u * 32u; }
    uint32_t take(size_t bytes) {
        rope_sim::State& s = rope_sim::st();
        if (s.ubUsed + bytes > s.ub.size())
            rope_sim::fail("TPipe::InitBuffer: unified buffer overflow (" + std::to_string(s.ubUsed + bytes) +
                           " > " + std::to_string(s.ub.size()) + " bytes)");
        uint32_t at = (uint32_t)s.ubUsed;
        s.ubUsed += bytes;
        if (s.ubUsed > s.ubPeak) s.ubPeak = s.ubUsed;
        return at;
    }
};

// ---------------------------------------------------------------------------------------------
// Data movement.

struct DataCopyExtParams {
    uint16_t blockCount = 1;
    uint32_t blockLen = 0;   // bytes
    uint32_t srcStride = 0;  // GM->UB: bytes between GM blocks; UB->GM: 32-byte blocks in UB
    uint32_t dstStride = 0;  // GM->UB: 32-byte blocks in UB; UB->GM: bytes between GM blocks
    uint32_t rsv = 0;
};

// DataCopy with block strides: all fields in 32-byte blocks (blockLen: the length of one block;
// strides: the gap between blocks, GM side and UB side).
struct DataCopyParams {
    uint16_t blockCount = 1;
    uint16_t blockLen = 0;
    uint16_t srcStride = 0;
    uint16_t dstStride = 0;
};

template <typename T> struct DataCopyPadExtParams {
    bool isPad = false;
    uint8_t leftPadding = 0;
    uint8_t rightPadding = 0;
    T paddingValue = T();
};

// DataCopy in its block-params form only (whole 32-byte blocks; the kernels use no element-count
// form). GM addresses are required to be 32-byte aligned here (stricter than may be needed).
template <typename T>
inline void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyParams& p) {
    dst.check_aligned("DataCopy(params) GM->UB");
    if ((uintptr_t)src.GetPhyAddr() % 32 != 0) rope_sim::fail("DataCopy(params): GM address not 32-byte aligned");
    ++rope_sim::st().dataCopyCalls;
    const uint8_t* g = reinterpret_cast<const uint8_t*>(src.GetPhyAddr());
    size_t len = (size_t)p.blockLen * 32;
    for (uint32_t i = 0; i < p.blockCount; ++i) {
        const uint8_t* from = g + (size_t)i * (len + (size_t)p.srcStride * 32);
        rope_sim::gm_read(from, len, "DataCopy(params) GM->UB");
        std::memcpy(dst.bytes((int64_t)i * (len + (size_t)p.dstStride * 32), len), from, len);
    }
}

template <typename T>
inline void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyParams& p) {
    src.check_aligned("DataCopy(params) UB->GM");
    if ((uintptr_t)dst.GetPhyAddr() % 32 != 0) rope_sim::fail("DataCopy(params): GM address not 32-byte aligned");
    ++rope_sim::st().dataCopyCalls;
    uint8_t* g = reinterpret_cast<uint8_t*>(dst.GetPhyAddr());
    size_t len = (size_t)p.blockLen * 32;
    for (uint32_t i = 0; i < p.blockCount; ++i) {
        uint8_t* to = g + (size_t)i * (len + (size_t)p.dstStride * 32);
        rope_sim::gm_write(to, len, "DataCopy(params) UB->GM");
        std::memcpy(to, src.bytes((int64_t)i * (len + (size_t)p.srcStride * 32), len), len);
    }
}

inline void check_pad_params(const DataCopyExtParams& p, size_t elem) {
    if (p.blockCount > 4095) rope_sim::fail("DataCopyPad: blockCount > 4095");
    if (p.blockLen > 2097151) rope_sim::fail("DataCopyPad: blockLen > 2097151 bytes");
    if (p.blockLen % elem != 0) rope_sim::fail("DataCopyPad: blockLen not a multiple of the element size");
    ++rope_sim::st().dataCopyPadCalls;
}

template <typename T>
inline void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyExtParams& p,
                        const DataCopyPadExtParams<T>& pad) {
    check_pad_params(p, sizeof(T));
    if (p.blockCount == 0 || p.blockLen == 0) return;
    dst.check_aligned("DataCopyPad GM->UB");
    size_t padded = (p.blockLen + 31u) / 32u * 32u;
    const uint8_t* g = reinterpret_cast<const uint8_t*>(src.GetPhyAddr());
    for (uint32_t i = 0; i < p.blockCount; ++i) {
        const uint8_t* from = g + (size_t)i * (p.blockLen + (size_t)p.srcStride);
        rope_sim::gm_read(from, p.blockLen, "DataCopyPad GM->UB");
        uint8_t* to = dst.bytes((int64_t)i * (padded + (size_t)p.dstStride * 32), padded);
        std::memcpy(to, from, p.blockLen);
        if (pad.isPad) {
            for (size_t b = p.blockLen; b + sizeof(T) <= padded; b += sizeof(T)) std::memcpy(to + b, &pad.paddingValue, sizeof(T));
        } else {
            std::memset(to + p.blockLen, 0xFF, padded - p.blockLen);
        }
    }
}

template <typename T>
inline void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyExtParams& p) {
    check_pad_params(p, sizeof(T));
    if (p.blockCount == 0 || p.blockLen == 0) return;
    src.check_aligned("DataCopyPad UB->GM");
    size_t padded = (p.blockLen + 31u) / 32u * 32u;
    uint8_t* g = reinterpret_cast<uint8_t*>(dst.GetPhyAddr());
    for (uint32_t i = 0; i < p.blockCount; ++i) {
        uint8_t* to = g + (size_t)i * (p.blockLen + (size_t)p.dstStride);
        rope_sim::gm_write(to, p.blockLen, "DataCopyPad UB->GM");
        std::memcpy(to, src.bytes((int64_t)i * (padded + (size_t)p.srcStride * 32), p.blockLen), p.blockLen);
    }
}

// ---------------------------------------------------------------------------------------------
// Vector instructions (count form).

namespace detail {
template <typename T> inline float to_f(T v) { return (float)v; }
inline float to_f(bfloat16_t v) { return (float)v; }
template <typename T> inline void vec_check(const LocalTensor<T>& t, int64_t count, const char* what) {
    t.check_aligned(what);
    if (count < 0) rope_sim::fail(std::string(what) + ": negative count");
    t.elems(count);  // bounds
}
template <typename T> inline T wrap_add(T a, T b) {
    if constexpr (std::is_integral<T>::value) {
        typedef typename std::make_unsigned<T>::type U;
        return (T)((U)a + (U)b);
    } else {
        return a + b;
    }
}
}  // namespace detail

template <typename T, typename C>
inline void Mul(const LocalTensor<T>& dst, const LocalTensor<T>& a, const LocalTensor<T>& b, C count) {
    detail::vec_check(dst, count, "Mul"); detail::vec_check(a, count, "Mul"); detail::vec_check(b, count, "Mul");
    ++rope_sim::st().vectorCalls;
    T *d = dst.elems(count), *x = a.elems(count), *y = b.elems(count);
    for (int64_t i = 0; i < (int64_t)count; ++i) d[i] = x[i] * y[i];
}

template <typename T, typename C>
inline void Add(const LocalTensor<T>& dst, const LocalTensor<T>& a, const LocalTensor<T>& b, C count) {
    detail::vec_check(dst, count, "Add"); detail::vec_check(a, count, "Add"); detail::vec_check(b, count, "Add");
    ++rope_sim::st().vectorCalls;
    T *d = dst.elems(count), *x = a.elems(count), *y = b.elems(count);
    for (int64_t i = 0; i < (int64_t)count; ++i) d[i] = detail::wrap_add(x[i], y[i]);
}

template <typename T, typename C>
inline void Sub(const LocalTensor<T>& dst, const LocalTensor<T>& a, const LocalTensor<T>& b, C count) {
    detail::vec_check(dst, count, "Sub"); detail::vec_check(a, count, "Sub"); detail::vec_check(b, count, "Sub");
    ++rope_sim::st().vectorCalls;
    T *d = dst.elems(count), *x = a.elems(count), *y = b.elems(count);
    for (int64_t i = 0; i < (int64_t)count; ++i) d[i] = x[i] - y[i];
}

template <typename T, typename S, typename C>
inline void Muls(const LocalTensor<T>& dst, const LocalTensor<T>& src, S scalar, C count) {
    detail::vec_check(dst, count, "Muls"); detail::vec_check(src, count, "Muls");
    ++rope_sim::st().vectorCalls;
    T *d = dst.elems(count), *x = src.elems(count);
    for (int64_t i = 0; i < (int64_t)count; ++i) d[i] = x[i] * (T)scalar;
}

template <typename T, typename S, typename C>
inline void Adds(const LocalTensor<T>& dst, const LocalTensor<T>& src, S scalar, C count) {
    detail::vec_check(dst, count, "Adds"); detail::vec_check(src, count, "Adds");
    ++rope_sim::st().vectorCalls;
    T *d = dst.elems(count), *x = src.elems(count);
    for (int64_t i = 0; i < (int64_t)count; ++i) d[i] = detail::wrap_add(x[i], (T)scalar);
}

template <typename T, typename S, typename C>
inline void Duplicate(const LocalTensor<T>& dst, S scalar, C count) {
    detail::vec_check(dst, count, "Duplicate");
    ++rope_sim::st().vectorCalls;
    T* d = dst.elems(count);
    for (int64_t i = 0; i < (int64_t)count; ++i) d[i] = (T)scalar;
}

template <typename T, typename C>
inline void Div(const LocalTensor<T>& dst, const LocalTensor<T>& a, const LocalTensor<T>& b, C count) {
    detail::vec_check(dst, count, "Div"); detail::vec_check(a, count, "Div"); detail::vec_check(b, count, "Div");
    ++rope_sim::st().vectorCalls;
    T *d = dst.elems(count), *x = a.elems(count), *y = b.elems(count);
    for (int64_t i = 0; i < (int64_t)count; ++i) d[i] = x[i] / y[i];
}

template <typename T, typename C>
inline void Sqrt(const LocalTensor<T>& dst, const LocalTensor<T>& src, C count) {
    detail::vec_check(dst, count, "Sqrt"); detail::vec_check(src, count, "Sqrt");
    ++rope_sim::st().vectorCalls;
    T *d = dst.elems(count), *x = src.elems(count);
    for (int64_t i = 0; i < (int64_t)count; ++i) d[i] = std::sqrt(x[i]);
}

// dst[0] = the sum of src[0 .. count): as documented for Atlas A2's count form, a binary tree
// inside each repeat of 256 bytes and the repeats' sums added in order. work must hold one value
// per repeat (rounded up to a block).
template <typename T>
inline void ReduceSum(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LocalTensor<T>& work,
                      int32_t count) {
    static_assert(std::is_same<T, float>::value, "the emulator implements float ReduceSum only");
    const int64_t perRepeat = 256 / (int64_t)sizeof(T);
    const int64_t repeats = (count + perRepeat - 1) / perRepeat;
    detail::vec_check(dst, 1, "ReduceSum"); detail::vec_check(src, count, "ReduceSum");
    detail::vec_check(work, (repeats + 7) / 8 * 8, "ReduceSum work");
    ++rope_sim::st().vectorCalls;
    const T* x = src.elems(count);
    T total = 0;
    for (int64_t r = 0; r < repeats; ++r) {
        T lane[64];
        for (int64_t i = 0; i < perRepeat; ++i) {
            int64_t at = r * perRepeat + i;
            lane[i] = at < count ? x[at] : T(0);
        }
        for (int64_t width = perRepeat / 2; width >= 1; width /= 2)
            for (int64_t i = 0; i < width; ++i) lane[i] = lane[2 * i] + lane[2 * i + 1];
        total = r == 0 ? lane[0] : total + lane[0];
    }
    *dst.elems(1) = total;
}

// dst[i] = element at byte srcBase + offsets[i] of src.
template <typename T>
inline void Gather(const LocalTensor<T>& dst, const LocalTensor<T>& src, const LocalTensor<uint32_t>& offsets,
                   uint32_t srcBase, uint32_t count) {
    detail::vec_check(dst, count, "Gather"); detail::vec_check(offsets, count, "Gather"); src.check_aligned("Gather");
    ++rope_sim::st().vectorCalls;
    if (dst.bufBegin() == src.bufBegin()) rope_sim::fail("Gather: destination and source share a buffer");
    T* d = dst.elems(count);
    const uint32_t* o = offsets.elems(count);
    for (uint32_t i = 0; i < count; ++i) {
        uint64_t byte = (uint64_t)srcBase + o[i];
        if (byte % sizeof(T) != 0) rope_sim::fail("Gather: offset not a multiple of the element size");
        std::memcpy(&d[i], src.bytes((int64_t)byte, sizeof(T)), sizeof(T));
    }
}

template <typename D, typename S, typename C>
inline void Cast(const LocalTensor<D>& dst, const LocalTensor<S>& src, RoundMode mode, C count) {
    detail::vec_check(dst, count, "Cast"); detail::vec_check(src, count, "Cast");
    ++rope_sim::st().vectorCalls;
    D* d = dst.elems(count);
    S* s = src.elems(count);
    constexpr bool widen = std::is_same<D, float>::value && !std::is_same<S, float>::value;
    constexpr bool narrow = std::is_same<S, float>::value && !std::is_same<D, float>::value;
    static_assert(widen || narrow, "the emulator implements float <-> half/bfloat16 casts only");
    if (widen && mode != RoundMode::CAST_NONE) rope_sim::fail("Cast: widening cast expects CAST_NONE");
    if (narrow && mode != RoundMode::CAST_RINT) rope_sim::fail("Cast: narrowing cast: the emulator implements CAST_RINT");
    for (int64_t i = 0; i < (int64_t)count; ++i) {
        if constexpr (widen) d[i] = detail::to_f(s[i]);
        else d[i] = D((float)s[i]);  // half: IEEE conversion, round to nearest even; bf16: RNE above
    }
}

}  // namespace AscendC

#endif  // ROPE_OPS_CPU_SIM_KERNEL_OPERATOR_H
