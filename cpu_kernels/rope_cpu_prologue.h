// The fused prologue's kernels (rope_ops.qkv_prologue on the CPU), written once against the SIMD
// traits class V of rope_cpu_kernel.h and compiled by each instruction-set translation unit
// after that header, inside the same namespace and under the same rules (internal linkage, no
// inline code shared between targets).
//
// Forward, one pass per token over its QKV row, tokens in blocks whose angle rows come from
// rope_cpu_kernel.h's angle stage (one row per token, reused by all its heads):
//   q and k heads: loaded to float32, RMS-normalised where the head has a weight (float32
//     statistics over the head: x * rsqrt(mean(x^2) + eps) * (offset + weight)), rotated, and
//     rounded once to the output: a new [B, S, H, D] tensor or, in place, the head itself; with
//     q_scale, q's output holds float8 e4m3 of value / q_scale, rounded once from the float32
//     value as the float8 cache is;
//   v heads: copied (out of place);
//   KV cache: the rotated k and the v heads also go to the token's slot (slots outside
//     [0, num_slots) are skipped): the output's own bits in the data dtype, or float8 e4m3 of
//     value / scale rounded once (to nearest even, saturating at +-448) from the float32 value.
// Backward, per token: the output gradient rotated by minus the angle in float32, then the
// RMSNorm's backward (input gradient; the weight's gradient terms g*n added into the caller's
// float32 row, tokens and heads in order), v's gradient copied; absent gradients are zero.
//
// Sums over a head (the sum of squares, the backward's dot product) run in 32 float32 lanes,
// element i in lane i % 32 (four 8-lane or two 16-lane accumulators: short dependency chains),
// reduced by one fixed tree: 8-lane (AVX2) and 16-lane (AVX-512) kernels give the same bits.

#ifndef ROPE_CPU_ISA_NS
#error "define ROPE_CPU_ISA_NS and include rope_cpu_kernel.h before rope_cpu_prologue.h"
#endif

namespace ROPE_CPU_ISA_NS {
namespace {

// Floats of one scratch row of `work` (rows start 64-byte aligned; ROPE_CPU_PROLOGUE_WORK_ROWS
// rows).
inline int64_t work_row_floats(int64_t d) { return (d + 15) / 16 * 16; }
constexpr int64_t kPrologueGroupHeads = ROPE_CPU_PROLOGUE_WORK_ROWS - 1;
constexpr int64_t kBackwardGroupHeads = (ROPE_CPU_PROLOGUE_WORK_ROWS - 1) / 2;

constexpr int kSumLanes = 32;

// A compile-time index (an accumulator slot).
template <int A>
struct Slot {
  static constexpr int value = A;
};

template <int A, int N, class Fn>
inline void unroll(Fn& fn) {
  if constexpr (A < N) {
    fn(Slot<A>{});
    unroll<A + 1, N>(fn);
  }
}

// A float32 sum of products over one head in kSumLanes lanes (see the file comment): the
// elements [i, i + W) of each vector go to accumulator (i / W) % kVectors, a compile-time slot
// (for_each_vector), so that the accumulators stay in registers.
template <class V>
class LaneSum {
 public:
  static_assert(V::W == 8 || V::W == 16, "head sums are written for 8 or 16 lanes a vector");
  static constexpr int kVectors = kSumLanes / V::W;
  using F = typename V::F;

  LaneSum() {
    for (int a = 0; a < kVectors; ++a) acc_[a] = V::set1(0.0f);
  }
  // Adds a*b (lanes past the head hold zeros) into slot A.
  template <int A>
  void add(Slot<A>, F a, F b) {
    acc_[A] = V::fmadd(a, b, acc_[A]);
  }
  // Lanes (l, l + 16) first, then V::sum16's tree.
  float total() const {
    if constexpr (V::W == 16) {
      return V::sum16(V::add(acc_[0], acc_[1]));
    } else {
      return V::sum16(V::add(acc_[0], acc_[2]), V::add(acc_[1], acc_[3]));
    }
  }

 private:
  F acc_[kVectors];
};

// Calls step(i, n, slot) for the vectors of a head of d elements in order: i the first element,
// n its element count (W, or fewer for the last), slot its LaneSum accumulator.
template <class V, class Step>
inline void for_each_vector(int64_t d, Step step) {
  int64_t i = 0;
  for (; i + kSumLanes <= d; i += kSumLanes) {
    auto full = [&](auto slot) { step(i + decltype(slot)::value * V::W, V::W, slot); };
    unroll<0, LaneSum<V>::kVectors>(full);
  }
  if (i < d) {
    auto rest = [&](auto slot) {
      const int64_t at = i + decltype(slot)::value * V::W;
      if (at < d) step(at, d - at < V::W ? static_cast<int>(d - at) : V::W, slot);
    };
    unroll<0, LaneSum<V>::kVectors>(rest);
  }
}

template <class V, class P>
inline typename V::F load_some(const P* x, int n) {
  return n == V::W ? V::load(x) : V::load_n(x, n);
}

template <class V, class P>
inline void store_some(P* x, typename V::F v, int n) {
  if (n == V::W) {
    V::store(x, v);
  } else {
    V::store_n(x, v, n);
  }
}

// x[0, d) to float32 in `row`; returns rsqrt(mean(x^2) + eps), all in float32.
template <class V, class T>
inline float load_rstd(const T* x, int64_t d, float eps, float* row) {
  LaneSum<V> squares;
  for_each_vector<V>(d, [&](int64_t i, int n, auto slot) {
    const auto v = load_some<V>(x + i, n);
    squares.add(slot, v, v);
    store_some<V>(row + i, v, n);
  });
  const float mean = squares.total() / static_cast<float>(d);
  return 1.0f / __builtin_sqrtf(mean + eps);
}

// A normalised head as the rotations read it (rope_cpu_kernel.h's RowSource): element i is
// row[i] * rstd * weight[i] (weight: offset + weight), two roundings as torch's x * rstd * w.
template <class V>
struct NormedSource {
  const float* row;
  const float* weight;
  typename V::F rstd;
  typename V::F load(int64_t i) const { return V::mul(V::mul(V::load(row + i), rstd), V::load(weight + i)); }
  typename V::F load_n(int64_t i, int n) const {
    return V::mul(V::mul(V::load_n(row + i, n), rstd), V::load_n(weight + i, n));
  }
};

// y[begin, end) = the source's elements there, rounded once to Out.
template <class V, class Src, class Out>
inline void write_dims(const Src& x, Out* y, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + V::W <= end; i += V::W) V::store(y + i, x.load(i));
  if (i < end) V::store_n(y + i, x.load_n(i, static_cast<int>(end - i)), static_cast<int>(end - i));
}
// A plain row into its own type: the bits as they are. x and y never overlap.
template <class V, class T>
inline void write_dims(const RowSource<V, T>& x, T* y, int64_t begin, int64_t end) {
  __builtin_memcpy(y + begin, x.row + begin, (end - begin) * sizeof(T));
}

// y[0, n) = x[0, n) converted (rounded once where Out is narrower). x and y never overlap.
template <class V, class In, class Out>
inline void convert_row(const In* x, Out* y, int64_t n) {
  write_dims<V>(RowSource<V, In>{x}, y, 0, n);
}

// float32 -> float8 e4m3fn, round to nearest even, saturating as torch's conversion and the
// GPU's (satfinite) do: magnitudes that round past the largest finite value 448, infinities
// included, become +-448; NaN stays NaN. Below 2^-6: multiples of 2^-9 (subnormals).
inline uint8_t float_to_e4m3(float f) {
  const uint32_t bits = float_to_bits(f);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  constexpr uint32_t kInf = 0x7f800000u, k448 = 0x43e00000u, kMinNormal = 0x3c800000u;  // 2^-6
  uint8_t code;
  if (magnitude > kInf) {
    code = 0x7f;  // NaN
  } else if (magnitude >= k448) {
    code = 0x7e;  // 448
  } else if (magnitude < kMinNormal) {
    const float units = bits_to_float(magnitude) * 512.0f;           // exact: < 8
    code = static_cast<uint8_t>((units + 8388608.0f) - 8388608.0f);  // to nearest even
  } else {
    // keep 3 mantissa bits, to nearest even (a carry moves into the exponent, at most up to
    // 448), then rebias the exponent from 127 to 7
    const uint32_t rounded = magnitude + 0x7ffffu + ((magnitude >> 20) & 1u);
    code = static_cast<uint8_t>((rounded >> 20) - (120u << 3));
  }
  return static_cast<uint8_t>(code | sign);
}

inline void store_e4m3_row(const float* x, uint8_t* out, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_e4m3(x[i] / scale);
}

// The cache slot of token (b, s), or -1 (no cache, or a slot outside [0, num_slots)).
inline int64_t cache_slot(const RopeCpuPrologueParams& p, int64_t b, int64_t s) {
  if (p.cache[0] == nullptr) return -1;
  const int64_t index = b * p.slots_stride[0] + s * p.slots_stride[1];
  const int64_t slot = p.slots_int64 ? static_cast<const int64_t*>(p.slots)[index]
                                     : static_cast<const int32_t*>(p.slots)[index];
  return static_cast<uint64_t>(slot) < static_cast<uint64_t>(p.num_slots) ? slot : -1;
}

// The RMSNorm backward of one head, in two steps (so that a group's sums overlap):
// norm_backward_sums takes x's float32 row (`xn`), the output gradient after the inverse
// rotation (`g`), the weight (offset + weight) and rstd; it adds g*n (n = x * rstd) into
// weight_grad, leaves n in xn and g*w in g, and returns mean(g*w*n). norm_backward_store then
// writes rstd * (g*w - n * mean) to dx.
template <class V>
inline float norm_backward_sums(float* xn, float* g, const float* weight, float rstd, int64_t d,
                                float* weight_grad) {
  const auto r = V::set1(rstd);
  LaneSum<V> dot;
  for_each_vector<V>(d, [&](int64_t i, int m, auto slot) {
    const auto n = V::mul(load_some<V>(xn + i, m), r);
    const auto gv = load_some<V>(g + i, m);
    store_some<V>(weight_grad + i, V::fmadd(gv, n, load_some<V>(weight_grad + i, m)), m);
    const auto gw = V::mul(gv, load_some<V>(weight + i, m));
    dot.add(slot, gw, n);
    store_some<V>(xn + i, n, m);
    store_some<V>(g + i, gw, m);
  });
  return dot.total() / static_cast<float>(d);
}

template <class V, class T>
inline void norm_backward_store(const float* n, const float* gw, float mean, float rstd, int64_t d,
                                T* dx) {
  const auto m = V::set1(mean);
  const auto minus_r = V::set1(-rstd);
  // rstd * (gw - n * mean) as (n * mean - gw) * -rstd: one fused multiply-subtract, exact negation
  int64_t i = 0;
  for (; i + V::W <= d; i += V::W) {
    V::store(dx + i, V::mul(V::fmsub(V::load(n + i), m, V::load(gw + i)), minus_r));
  }
  if (i < d) {
    const int k = static_cast<int>(d - i);
    V::store_n(dx + i, V::mul(V::fmsub(V::load_n(n + i, k), m, V::load_n(gw + i, k)), minus_r), k);
  }
}

// The prologue for data type T, pair style and (kHalf > 0) a compile-time pair count.
template <class V, class T, bool kGptj, int kHalf>
struct PrologueKernel {
  using F = typename V::F;

  // Rotates the source x into y (half 0: no rotation); with `tail`, also writes dims
  // [2*half, D).
  template <class Src, class Out>
  static void rotate_row(const RopeCpuPrologueParams& p, const Src& x, Out* y, const float* c,
                         const float* s, F signs, bool tail) {
    const int64_t half = kHalf > 0 ? kHalf : p.rope.half;
    if (half > 0) {
      if constexpr (kGptj) {
        rotate_gptj<V, Src, Out, kHalf>(x, y, c, s, half, signs);
      } else {
        rotate_neox<V, Src, Out, kHalf>(x, y, c, s, half, signs);
      }
    }
    if (tail && 2 * half < p.rope.head_dim) write_dims<V>(x, y, 2 * half, p.rope.head_dim);
  }

  // The head from source x: rotated, rounded once into y (T elements; float8 e4m3 of value /
  // y_scale when y_scale > 0, a q head with q_scale); cache_row (null: none) gets it too, from
  // y's bits or (float8) from the float32 values. `inplace_plain`: y is x's own row, which keeps
  // its pass-through dims.
  template <class Src>
  static void finish_head(const RopeCpuPrologueParams& p, const Src& x, void* y, float y_scale,
                          const float* c, const float* s, F signs, void* cache_row, float scale,
                          float* rotated, bool inplace_plain) {
    const int64_t d = p.rope.head_dim;
    if (y_scale > 0.0f) {  // q heads only: never in place, never with a cache row
      rotate_row(p, x, rotated, c, s, signs, true);
      store_e4m3_row(rotated, static_cast<uint8_t*>(y), d, y_scale);
      return;
    }
    T* out = static_cast<T*>(y);
    if (cache_row != nullptr && p.cache_dtype == ROPE_CPU_F8E4M3) {
      rotate_row(p, x, rotated, c, s, signs, true);
      convert_row<V>(static_cast<const float*>(rotated), out, d);
      store_e4m3_row(rotated, static_cast<uint8_t*>(cache_row), d, scale);
      return;
    }
    rotate_row(p, x, out, c, s, signs, !inplace_plain);
    if (cache_row != nullptr) __builtin_memcpy(cache_row, out, d * sizeof(T));
  }

  // One q or k head x: normalised (weight non-null: `normed` holds x in float32, rstd its
  // statistic), rotated, rounded once into y (x itself in place; float8 with y_scale > 0, as
  // finish_head); cache_row (null: none) gets the result too.
  static void forward_head(const RopeCpuPrologueParams& p, const T* x, void* y, float y_scale,
                           const float* weight, const float* normed, float rstd, const float* c,
                           const float* s, F signs, void* cache_row, float scale, float* rotated) {
    if (weight != nullptr) {
      finish_head(p, NormedSource<V>{normed, weight, V::set1(rstd)}, y, y_scale, c, s, signs,
                  cache_row, scale, rotated, false);
    } else {
      finish_head(p, RowSource<V, T>{x}, y, y_scale, c, s, signs, cache_row, scale, rotated,
                  p.inplace);
    }
  }

  static void forward_v(const RopeCpuPrologueParams& p, const T* x, T* y, void* cache_row,
                        float scale, float* work) {
    const int64_t d = p.rope.head_dim;
    if (y != nullptr) __builtin_memcpy(y, x, d * sizeof(T));
    if (cache_row == nullptr) return;
    if (p.cache_dtype == ROPE_CPU_F8E4M3) {
      convert_row<V>(x, work, d);
      store_e4m3_row(work, static_cast<uint8_t*>(cache_row), d, scale);
    } else {
      __builtin_memcpy(cache_row, x, d * sizeof(T));
    }
  }

  // Head (b, s, h) of output `which`: T elements, or float8 bytes for q with q_scale.
  static void* out_head(const RopeCpuPrologueParams& p, int which, int64_t b, int64_t s, int64_t h) {
    const int64_t* st = p.out_stride[which];
    const int64_t at = b * st[0] + s * st[1] + h * st[2];
    if (which == 0 && p.q_scale > 0.0f) return static_cast<uint8_t*>(p.out[0]) + at;
    return static_cast<T*>(p.out[which]) + at;
  }

  static void* cache_head(const RopeCpuPrologueParams& p, int which, int64_t slot, int64_t h) {
    const int64_t element = p.cache_dtype == ROPE_CPU_F8E4M3 ? 1 : static_cast<int64_t>(sizeof(T));
    const int64_t* st = p.cache_stride[which];
    return static_cast<char*>(p.cache[which]) + (slot * st[0] + h * st[1]) * element;
  }

  // work: row 0 for a rotated head (float8 caches or q) or v in float32, rows 1.. for the group's
  // normalised heads.
  static void forward_block(const RopeCpuPrologueParams& p, const Block& blk, float* work) {
    const int64_t d = p.rope.head_dim, hq = p.q_heads, hk = p.kv_heads;
    const int64_t row_floats = work_row_floats(d);
    const F signs = sine_signs<V, kGptj>(false);
    for (int64_t j = 0; j < blk.count; ++j) {
      const int64_t b = blk.b[j], s = blk.s[j];
      const int64_t row_at = b * p.qkv_stride[0] + s * p.qkv_stride[1];
      const T* row = static_cast<const T*>(p.qkv) + row_at;
      T* row_out = p.inplace ? static_cast<T*>(p.qkv_out) + row_at : nullptr;
      const float* c = p.rope.half > 0 ? blk.cos[j] : nullptr;
      const float* sn = p.rope.half > 0 ? blk.sin[j] : nullptr;
      const int64_t slot = cache_slot(p, b, s);
      // q and k heads in groups: the group's norm statistics first (independent sums, whose
      // latency then overlaps), then each head finished
      for (int64_t h0 = 0; h0 < hq + hk; h0 += kPrologueGroupHeads) {
        const int64_t count = hq + hk - h0 < kPrologueGroupHeads ? hq + hk - h0 : kPrologueGroupHeads;
        float rstd[kPrologueGroupHeads] = {};
        for (int64_t g = 0; g < count; ++g) {
          const int64_t h = h0 + g;
          if (p.weight[h < hq ? 0 : 1] != nullptr) {
            rstd[g] = load_rstd<V>(row + h * d, d, p.eps, work + (g + 1) * row_floats);
          }
        }
        for (int64_t g = 0; g < count; ++g) {
          const int64_t h = h0 + g;
          const int which = h < hq ? 0 : 1;
          const int64_t head = h < hq ? h : h - hq;
          void* y = p.inplace ? row_out + h * d : out_head(p, which, b, s, head);
          void* cache_row = which == 1 && slot >= 0 ? cache_head(p, 0, slot, head) : nullptr;
          forward_head(p, row + h * d, y, which == 0 ? p.q_scale : 0.0f, p.weight[which],
                       work + (g + 1) * row_floats, rstd[g], c, sn, signs, cache_row,
                       p.cache_scale[0], work);
        }
      }
      for (int64_t h = 0; h < hk; ++h) {
        forward_v(p, row + (hq + hk + h) * d,
                  p.inplace ? nullptr : static_cast<T*>(out_head(p, 2, b, s, h)),
                  slot >= 0 ? cache_head(p, 1, slot, h) : nullptr, p.cache_scale[1], work);
      }
    }
  }

  // work: rows [1, 1 + kBackwardGroupHeads) for a group's x rows, the next as many for their
  // gradients.
  static void backward_block(const RopeCpuPrologueParams& p, const RopeCpuPrologueGrads& g,
                             const Block& blk, float* work, float* const weight_grad[2]) {
    const int64_t d = p.rope.head_dim, hq = p.q_heads, hk = p.kv_heads;
    const int64_t row_floats = work_row_floats(d);
    const F signs = sine_signs<V, kGptj>(true);  // the transpose: rotation by minus the angle
    for (int64_t j = 0; j < blk.count; ++j) {
      const int64_t b = blk.b[j], s = blk.s[j];
      const T* row = static_cast<const T*>(p.qkv) + b * p.qkv_stride[0] + s * p.qkv_stride[1];
      T* dx_row = static_cast<T*>(g.grad_qkv) + b * g.grad_qkv_stride[0] + s * g.grad_qkv_stride[1];
      const float* c = p.rope.half > 0 ? blk.cos[j] : nullptr;
      const float* sn = p.rope.half > 0 ? blk.sin[j] : nullptr;
      auto grad_head = [&](int which, int64_t head) -> const T* {
        if (g.grad[which] == nullptr) return nullptr;
        const int64_t* st = g.grad_stride[which];
        return static_cast<const T*>(g.grad[which]) + b * st[0] + s * st[1] + head * st[2];
      };
      // q and k heads in groups: heads without a norm at once; the normed ones' rotations and
      // statistics first, then their sums, then their gradients (independent chains overlap)
      for (int64_t h0 = 0; h0 < hq + hk; h0 += kBackwardGroupHeads) {
        const int64_t count = hq + hk - h0 < kBackwardGroupHeads ? hq + hk - h0 : kBackwardGroupHeads;
        float rstd[kBackwardGroupHeads] = {}, mean[kBackwardGroupHeads] = {};
        bool normed[kBackwardGroupHeads] = {};
        for (int64_t k = 0; k < count; ++k) {
          const int64_t h = h0 + k;
          const int which = h < hq ? 0 : 1;
          const T* gy = grad_head(which, which == 0 ? h : h - hq);
          T* dx = dx_row + h * d;
          if (gy == nullptr) {
            __builtin_memset(dx, 0, d * sizeof(T));
          } else if (p.weight[which] == nullptr) {
            rotate_row(p, RowSource<V, T>{gy}, dx, c, sn, signs, true);
          } else {
            normed[k] = true;
            float* xn = work + (1 + k) * row_floats;
            rotate_row(p, RowSource<V, T>{gy}, xn + kBackwardGroupHeads * row_floats, c, sn, signs, true);
            rstd[k] = load_rstd<V>(row + h * d, d, p.eps, xn);
          }
        }
        for (int64_t k = 0; k < count; ++k) {
          if (!normed[k]) continue;
          const int which = h0 + k < hq ? 0 : 1;
          float* xn = work + (1 + k) * row_floats;
          mean[k] = norm_backward_sums<V>(xn, xn + kBackwardGroupHeads * row_floats, p.weight[which],
                                          rstd[k], d, weight_grad[which]);
        }
        for (int64_t k = 0; k < count; ++k) {
          if (!normed[k]) continue;
          const float* xn = work + (1 + k) * row_floats;
          norm_backward_store<V>(xn, xn + kBackwardGroupHeads * row_floats, mean[k], rstd[k], d,
                                 dx_row + (h0 + k) * d);
        }
      }
      for (int64_t h = 0; h < hk; ++h) {
        const T* gy = grad_head(2, h);
        T* dx = dx_row + (hq + hk + h) * d;
        if (gy == nullptr) {
          __builtin_memset(dx, 0, d * sizeof(T));
        } else {
          __builtin_memcpy(dx, gy, d * sizeof(T));
        }
      }
    }
  }
};

using PrologueBlockFn = void (*)(const RopeCpuPrologueParams&, const Block&, float*);
using PrologueBackwardBlockFn = void (*)(const RopeCpuPrologueParams&, const RopeCpuPrologueGrads&,
                                         const Block&, float*, float* const*);

struct PrologueFns {
  PrologueBlockFn forward;
  PrologueBackwardBlockFn backward;
};

template <class V, class T, bool kGptj, int kHalf>
PrologueFns prologue_fns() {
  return {&PrologueKernel<V, T, kGptj, kHalf>::forward_block,
          &PrologueKernel<V, T, kGptj, kHalf>::backward_block};
}

// Compile-time pairs for head_dim 128 with full rotary (the common shape); any other at run time.
template <class V, class T>
PrologueFns prologue_fns_for_type(const RopeCpuPrologueParams& p) {
  const bool half64 = p.rope.half == 64;
  if (p.rope.interleaved) return half64 ? prologue_fns<V, T, true, 64>() : prologue_fns<V, T, true, 0>();
  return half64 ? prologue_fns<V, T, false, 64>() : prologue_fns<V, T, false, 0>();
}

template <class V>
PrologueFns pick_prologue(const RopeCpuPrologueParams& p) {
  return p.rope.dtype == ROPE_CPU_BF16  ? prologue_fns_for_type<V, RopeBf16>(p)
         : p.rope.dtype == ROPE_CPU_F16 ? prologue_fns_for_type<V, RopeF16>(p)
                                        : prologue_fns_for_type<V, float>(p);
}

// Tokens [begin, end) in blocks, each block's angle rows made first (when rotating).
template <class V, class Body>
void walk_blocks(const RopeCpuPrologueParams& p, int64_t begin, int64_t end, Body body) {
  const int64_t half = p.rope.half;
  const AngleFn angles = half > 0 ? pick_angles<V>(p.rope) : nullptr;
  alignas(64) float scratch[kScratchFloats];
  int64_t per_block = half > 0 ? kScratchFloats / (2 * half) : kMaxBlockTokens;
  if (per_block > kMaxBlockTokens) per_block = kMaxBlockTokens;
  const int64_t seq = p.rope.seq;
  int64_t b = begin / seq, s = begin - (begin / seq) * seq;
  Block blk;
  for (int64_t t0 = begin; t0 < end; t0 += per_block) {
    next_block(blk, end - t0 < per_block ? end - t0 : per_block, seq, b, s);
    if (angles != nullptr) angles(p.rope, blk, scratch);
    body(blk);
  }
}

template <class V>
void run_prologue(const RopeCpuPrologueParams& p, int64_t begin, int64_t end, float* work) {
  const PrologueBlockFn forward = pick_prologue<V>(p).forward;
  walk_blocks<V>(p, begin, end, [&](const Block& blk) { forward(p, blk, work); });
}

template <class V>
void run_prologue_backward(const RopeCpuPrologueParams& p, const RopeCpuPrologueGrads& g,
                           int64_t begin, int64_t end, float* work, float* const weight_grad[2]) {
  const PrologueBackwardBlockFn backward = pick_prologue<V>(p).backward;
  walk_blocks<V>(p, begin, end, [&](const Block& blk) { backward(p, g, blk, work, weight_grad); });
}

}  // namespace
}  // namespace ROPE_CPU_ISA_NS
