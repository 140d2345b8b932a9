// The rope_ops CPU kernel, written once against a SIMD traits class V and compiled by each
// instruction-set translation unit (rope_cpu_generic.cpp, rope_cpu_avx2.cpp, rope_cpu_avx512.cpp)
// inside its own namespace ROPE_CPU_ISA_NS, all of it with internal linkage: no inline function
// is shared between code built for different targets (a linker that kept the AVX-512 copy of a
// shared inline function would run it on every CPU).
//
// The includer includes <cstdint> and rope_cpu.h first (before any target pragma), defines
// ROPE_CPU_ISA_NS, then defines its traits class V after this header and instantiates
// run_tokens<V>. V provides, for W float32 lanes of type V::F:
//   load(const T*), store(T*, F)           T = float, RopeBf16, RopeF16; W elements
//   load_n(const T*, n), store_n(T*, F, n) the first n < W elements only (never touches others)
//   set1, add, mul, fmadd(a, b, c) = a*b + c, fmsub(a, b, c) = a*b - c
//   sum16(a) (W = 16) or sum16(lo, hi) (W = 8): the sum of 16 lanes l, added as (l, l + 8), then
//     (l, l + 4), (l, l + 2), (l, l + 1): one order for every W
//   dup_pairs(const float* c) = {c0, c0, c1, c1, ...} from W/2 floats; dup_pairs_n(c, m): m < W/2
//   swap_pairs(v) = {v1, v0, v3, v2, ...}
//   to_float(T), from_float<T>(float), fmadd_s, fmsub_s: the same operations on one element,
//     from ScalarOps below.
//
// The two stages of a block of tokens:
//   angle source: each token -> pointers to its cos/sin row: its position's table row, a row
//     computed on the fly, its own per-token row, or (mRoPE) a row gathered frequency by
//     frequency from three positions; variants of the angles plug in here only.
//   load/rotate/store: every head of q and k rotated by its token's row, in float32, rounded to
//     the storage type once.
// Arithmetic: x' = x*c - y*s and y' = y*c + x*s, each with one rounding of the difference/sum
// of x*c and the rounded product y*s (x*s): one fused multiply-add where V has it. With
// ``inverse`` the sine is negated (exactly). The strided path rounds exactly as the vector path.

#ifndef ROPE_CPU_ISA_NS
#error "define ROPE_CPU_ISA_NS before including rope_cpu_kernel.h"
#endif

namespace ROPE_CPU_ISA_NS {
namespace {

// Tokens whose rows one block holds, and the scratch for rows computed on the fly (on the
// stack of the calling thread: at most kScratchFloats / (2 * half) tokens a block).
constexpr int64_t kMaxBlockTokens = 16;
constexpr int64_t kScratchFloats = 8192;

// ---------------------------------------------------------------------------------------------
// Scalar conversions shared by every traits class.

inline float bits_to_float(uint32_t bits) {
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  __builtin_memcpy(&bits, &f, sizeof bits);
  return bits;
}

inline float bf16_to_float(RopeBf16 h) { return bits_to_float(static_cast<uint32_t>(h.bits) << 16); }

// Round to nearest even; NaN stays NaN (quiet).
inline RopeBf16 float_to_bf16(float f) {
  const uint32_t bits = float_to_bits(f);
  if (f != f) return RopeBf16{static_cast<uint16_t>((bits >> 16) | 0x40u)};
  return RopeBf16{static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16)};
}

// The one-element operations of a traits class (V derives from ScalarOps<H>), given the
// target's own: H::f16_to_float(RopeF16), H::float_to_f16(float) and H::fma(x, y, z).
template <class H>
struct ScalarOps {
  static float to_float(float x) { return x; }
  static float to_float(RopeBf16 x) { return bf16_to_float(x); }
  static float to_float(RopeF16 x) { return H::f16_to_float(x); }
  template <class T>
  static T from_float(float x) {
    return narrow(x, static_cast<T*>(nullptr));
  }
  static float fmadd_s(float a, float b, float c) { return H::fma(a, b, c); }
  static float fmsub_s(float a, float b, float c) { return H::fma(a, b, -c); }

 private:
  // from_float<T>, chosen by overloading on T*
  static float narrow(float x, float*) { return x; }
  static RopeBf16 narrow(float x, RopeBf16*) { return float_to_bf16(x); }
  static RopeF16 narrow(float x, RopeF16*) { return H::float_to_f16(x); }
};

// ---------------------------------------------------------------------------------------------
// Angle source: each token of a block gets pointers to its rows of half cos and half sin values
// (float32), pointing into a float32 table or into scratch where they had to be made: converted
// from float16/bfloat16, computed on the fly, or gathered (mRoPE).

struct Block {
  int64_t count;  // tokens in this block
  int64_t b[kMaxBlockTokens], s[kMaxBlockTokens];
  const float* cos[kMaxBlockTokens];  // each token's row of half floats
  const float* sin[kMaxBlockTokens];
};

template <class T>
struct IsFloat32 {
  static constexpr bool value = false;
};
template <>
struct IsFloat32<float> {
  static constexpr bool value = true;
};

inline int64_t position_at(const RopeCpuParams& p, int64_t axis, int64_t b, int64_t s) {
  const int64_t index = axis * p.pos_stride_axis + b * p.pos_stride_b + s * p.pos_stride_s;
  switch (p.pos_kind) {
    case ROPE_CPU_POS_I32:
      return static_cast<const int32_t*>(p.pos)[index];
    case ROPE_CPU_POS_I64:
      return static_cast<const int64_t*>(p.pos)[index];
    default:
      return p.pos_offset + s;
  }
}

inline bool in_table(const RopeCpuParams& p, int64_t pos) {
  return static_cast<uint64_t>(pos) < static_cast<uint64_t>(p.table_rows);
}

// m*cos and m*sin of the angle `turns` (a 64-bit fraction of a turn): reduced exactly in integers
// to the nearest quarter turn plus |x| <= pi/4, then Taylor series in float64 (truncation below
// 1e-10) and one rounding to float32.
inline void cos_sin_of_turns(uint64_t turns, double factor, float* c, float* s) {
  constexpr double kRadiansPerUnit = 6.283185307179586476925 / 18446744073709551616.0;  // 2pi/2^64
  constexpr uint64_t kEighthTurn = uint64_t{1} << 61;
  const uint64_t biased = turns + kEighthTurn;
  const uint64_t quadrant = biased >> 62;  // nearest quarter turn
  const int64_t rest = static_cast<int64_t>(biased & ((uint64_t{1} << 62) - 1)) -
                       static_cast<int64_t>(kEighthTurn);
  const double x = static_cast<double>(rest) * kRadiansPerUnit;
  const double x2 = x * x;
  const double sin_x =
      x * (1.0 + x2 * (-1.0 / 6 + x2 * (1.0 / 120 + x2 * (-1.0 / 5040 + x2 * (1.0 / 362880 +
                                                                 x2 * (-1.0 / 39916800))))));
  const double cos_x =
      1.0 + x2 * (-1.0 / 2 + x2 * (1.0 / 24 + x2 * (-1.0 / 720 + x2 * (1.0 / 40320 +
                                                        x2 * (-1.0 / 3628800 + x2 / 479001600)))));
  // the angle is quadrant quarter turns plus x
  const double cos_a = quadrant == 0 ? cos_x : quadrant == 1 ? -sin_x : quadrant == 2 ? -cos_x : sin_x;
  const double sin_a = quadrant == 0 ? sin_x : quadrant == 1 ? cos_x : quadrant == 2 ? -sin_x : -cos_x;
  *c = static_cast<float>(factor * cos_a);
  *s = static_cast<float>(factor * sin_a);
}

// The row of a position outside the table: exact from fixed-point turns (the wrapping product
// position * freq_turns[i] is the angle as a fraction of a turn), or NaN with caller tables.
inline void row_outside_table(const RopeCpuParams& p, int64_t pos, float* c, float* s) {
  if (p.freq_turns == nullptr) {
    for (int64_t i = 0; i < p.half; ++i) c[i] = s[i] = __builtin_nanf("");
    return;
  }
  const uint64_t position = static_cast<uint64_t>(pos);
  for (int64_t i = 0; i < p.half; ++i) {
    cos_sin_of_turns(position * static_cast<uint64_t>(p.freq_turns[i]), p.attention_factor,
                     c + i, s + i);
  }
}

// Point at a float32 row, or convert a float16/bfloat16 one into scratch. A float32 row is only
// read when its token is rotated: prefetch it now, so that the rows of a block's tokens (random
// positions: decode) load while the tokens before them are rotated.
template <class V, class Tab>
inline void take_row(const Tab* cos_row, const Tab* sin_row, int64_t half, float* c, float* s,
                     const float** cos_out, const float** sin_out) {
  if constexpr (IsFloat32<Tab>::value) {
    constexpr int64_t kFloatsPerLine = 16;
    for (int64_t i = 0; i < half; i += kFloatsPerLine) {
      __builtin_prefetch(cos_row + i);
      __builtin_prefetch(sin_row + i);
    }
    *cos_out = cos_row;
    *sin_out = sin_row;
  } else {
    for (int64_t i = 0; i < half; ++i) {
      c[i] = V::to_float(cos_row[i]);
      s[i] = V::to_float(sin_row[i]);
    }
    *cos_out = c;
    *sin_out = s;
  }
}

// An angle source's row of token j of blk, from the tables cos and sin: points blk.cos[j] and
// blk.sin[j] at it, made in the token's scratch rows c and s (half floats each) where needed.
template <class Tab>
using RowFn = void (*)(const RopeCpuParams& p, const Tab* cos, const Tab* sin, Block& blk,
                       int64_t j, float* c, float* s);

template <class Tab, RowFn<Tab> row>
void block_angles(const RopeCpuParams& p, Block& blk, float* scratch) {
  const Tab* cos = static_cast<const Tab*>(p.cos);
  const Tab* sin = static_cast<const Tab*>(p.sin);
  for (int64_t j = 0; j < blk.count; ++j) {
    float* c = scratch + 2 * j * p.half;
    row(p, cos, sin, blk, j, c, c + p.half);
  }
}

// Table rows by position; never reads outside the table.
template <class V, class Tab>
void table_row(const RopeCpuParams& p, const Tab* cos, const Tab* sin, Block& blk, int64_t j,
               float* c, float* s) {
  const int64_t pos = position_at(p, 0, blk.b[j], blk.s[j]);
  if (in_table(p, pos)) {
    take_row<V>(cos + pos * p.cos_stride[0], sin + pos * p.sin_stride[0], p.half, c, s,
                &blk.cos[j], &blk.sin[j]);
  } else {
    row_outside_table(p, pos, c, s);
    blk.cos[j] = c;
    blk.sin[j] = s;
  }
}

// Per-token rows: token (b, s)'s own row, no positions.
template <class V, class Tab>
void token_row(const RopeCpuParams& p, const Tab* cos, const Tab* sin, Block& blk, int64_t j,
               float* c, float* s) {
  const int64_t* cs = p.cos_stride;
  const int64_t* ss = p.sin_stride;
  take_row<V>(cos + blk.b[j] * cs[0] + blk.s[j] * cs[1], sin + blk.b[j] * ss[0] + blk.s[j] * ss[1],
              p.half, c, s, &blk.cos[j], &blk.sin[j]);
}

// mRoPE: frequency i of a token takes the row of its position on axis mrope_axis[i], one value
// at a time (rows outside the table on the fly, or NaN).
template <class V, class Tab>
void mrope_row(const RopeCpuParams& p, const Tab* cos, const Tab* sin, Block& blk, int64_t j,
               float* c, float* s) {
  int64_t pos[3];
  for (int64_t axis = 0; axis < 3; ++axis) pos[axis] = position_at(p, axis, blk.b[j], blk.s[j]);
  for (int64_t i = 0; i < p.half; ++i) {
    const int64_t at = pos[p.mrope_axis[i]];
    if (in_table(p, at)) {
      c[i] = V::to_float(cos[at * p.cos_stride[0] + i]);
      s[i] = V::to_float(sin[at * p.sin_stride[0] + i]);
    } else if (p.freq_turns != nullptr) {
      cos_sin_of_turns(static_cast<uint64_t>(at) * static_cast<uint64_t>(p.freq_turns[i]),
                       p.attention_factor, c + i, s + i);
    } else {
      c[i] = s[i] = __builtin_nanf("");
    }
  }
  blk.cos[j] = c;
  blk.sin[j] = s;
}

// ---------------------------------------------------------------------------------------------
// Load / rotate / store: one head's rotary dims (stride 1 on head_dim).

// What the rotations read: a row of elements of type T, as float32 vectors. (The prologue reads
// rows it normalises on the fly through a source of its own with the same two functions.)
template <class V, class T>
struct RowSource {
  const T* row;
  typename V::F load(int64_t i) const { return V::load(row + i); }
  typename V::F load_n(int64_t i, int n) const { return V::load_n(row + i, n); }
};

// neox: pairs (i, i + half) of `in` (a source, as RowSource) into out. kHalf > 0: half known
// at compile time.
template <class V, class Src, class Out, int kHalf>
inline void rotate_neox(const Src& in, Out* out, const float* c, const float* s, int64_t half_rt,
                        typename V::F sign) {
  const int64_t half = kHalf > 0 ? kHalf : half_rt;
  int64_t i = 0;
  for (; i + V::W <= half; i += V::W) {
    const auto x = in.load(i), y = in.load(half + i);
    const auto cv = V::load(c + i), sv = V::mul(V::load(s + i), sign);
    V::store(out + i, V::fmsub(x, cv, V::mul(y, sv)));
    V::store(out + half + i, V::fmadd(y, cv, V::mul(x, sv)));
  }
  if ((kHalf == 0 || kHalf % V::W != 0) && i < half) {
    const int n = static_cast<int>(half - i);
    const auto x = in.load_n(i, n), y = in.load_n(half + i, n);
    const auto cv = V::load_n(c + i, n), sv = V::mul(V::load_n(s + i, n), sign);
    V::store_n(out + i, V::fmsub(x, cv, V::mul(y, sv)), n);
    V::store_n(out + half + i, V::fmadd(y, cv, V::mul(x, sv)), n);
  }
}

// gptj: pairs (2i, 2i + 1), rotated as v*c + swap(v)*(-s, +s, ...): the same roundings as neox.
template <class V, class Src, class Out, int kHalf>
inline void rotate_gptj(const Src& in, Out* out, const float* c, const float* s, int64_t half_rt,
                        typename V::F alternating_sign) {
  const int64_t n_rot = 2 * (kHalf > 0 ? kHalf : half_rt);
  int64_t j = 0;
  for (; j + V::W <= n_rot; j += V::W) {
    const auto v = in.load(j);
    const auto cv = V::dup_pairs(c + j / 2);
    const auto sv = V::mul(V::dup_pairs(s + j / 2), alternating_sign);
    V::store(out + j, V::fmadd(v, cv, V::mul(V::swap_pairs(v), sv)));
  }
  if ((kHalf == 0 || (2 * kHalf) % V::W != 0) && j < n_rot) {
    const int n = static_cast<int>(n_rot - j);  // even
    const auto v = in.load_n(j, n);
    const auto cv = V::dup_pairs_n(c + j / 2, n / 2);
    const auto sv = V::mul(V::dup_pairs_n(s + j / 2, n / 2), alternating_sign);
    V::store_n(out + j, V::fmadd(v, cv, V::mul(V::swap_pairs(v), sv)), n);
  }
}

// The sine's signs of rotate_neox (all +1, or -1 for the inverse) or rotate_gptj (-1, +1, ...
// alternating, negated for the inverse).
template <class V, bool kGptj>
inline typename V::F sine_signs(bool inverse) {
  const float sign = inverse ? -1.0f : 1.0f;
  if constexpr (kGptj) {
    float lanes[V::W];
    for (int l = 0; l < V::W; ++l) lanes[l] = (l % 2 == 0) ? -sign : sign;
    return V::load(lanes);
  } else {
    return V::set1(sign);
  }
}

// Every head of one tensor (q or k) for the tokens of a block, in the order that walks memory
// forward: tokens outer when heads are closer together than tokens (bshd, sbhd, thd), heads
// outer otherwise (bhsd: each head's rows of the block's tokens are adjacent).
template <class V, class T, bool kGptj, int kHalf>
void rotate_tensor(const RopeCpuParams& p, const RopeCpuTensor& t, const Block& blk) {
  const T* in = static_cast<const T*>(t.in);
  T* out = static_cast<T*>(t.out);
  const int64_t* is = t.in_stride;
  const int64_t* os = t.out_stride;
  const int64_t half = kHalf > 0 ? kHalf : p.half;
  const int64_t n_rot = 2 * half;
  const int64_t n_tail = p.copy_passthrough ? p.head_dim - n_rot : 0;
  const typename V::F sign_v = sine_signs<V, kGptj>(p.inverse);
  auto row = [&](int64_t j, int64_t h) {
    const T* x = in + blk.b[j] * is[0] + blk.s[j] * is[1] + h * is[2];
    T* y = out + blk.b[j] * os[0] + blk.s[j] * os[1] + h * os[2];
    if constexpr (kGptj) {
      rotate_gptj<V, RowSource<V, T>, T, kHalf>({x}, y, blk.cos[j], blk.sin[j], half, sign_v);
    } else {
      rotate_neox<V, RowSource<V, T>, T, kHalf>({x}, y, blk.cos[j], blk.sin[j], half, sign_v);
    }
    if (n_tail > 0) __builtin_memcpy(y + n_rot, x + n_rot, n_tail * sizeof(T));
  };
  const int64_t heads = t.heads;
  const bool tokens_outer = (is[2] < 0 ? -is[2] : is[2]) <= (is[1] < 0 ? -is[1] : is[1]);
  if (tokens_outer) {
    for (int64_t j = 0; j < blk.count; ++j)
      for (int64_t h = 0; h < heads; ++h) row(j, h);
  } else {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < blk.count; ++j) row(j, h);
  }
}

template <class V, class T, bool kGptj, int kHalf>
void rotate_block(const RopeCpuParams& p, const Block& blk) {
  if (p.q.heads > 0) rotate_tensor<V, T, kGptj, kHalf>(p, p.q, blk);
  if (p.k.heads > 0) rotate_tensor<V, T, kGptj, kHalf>(p, p.k, blk);
}

// Any strides on head_dim (a correct path, not a fast one): one element at a time, rounded
// exactly as the vector path rounds.
template <class V, class T>
void rotate_tensor_strided(const RopeCpuParams& p, const RopeCpuTensor& t, const Block& blk) {
  const T* in = static_cast<const T*>(t.in);
  T* out = static_cast<T*>(t.out);
  const int64_t* is = t.in_stride;
  const int64_t* os = t.out_stride;
  const int64_t half = p.half;
  const float sign = p.inverse ? -1.0f : 1.0f;
  for (int64_t j = 0; j < blk.count; ++j) {
    for (int64_t h = 0; h < t.heads; ++h) {
      const T* x = in + blk.b[j] * is[0] + blk.s[j] * is[1] + h * is[2];
      T* y = out + blk.b[j] * os[0] + blk.s[j] * os[1] + h * os[2];
      for (int64_t i = 0; i < half; ++i) {
        const int64_t ia = p.interleaved ? 2 * i : i;
        const int64_t ib = p.interleaved ? 2 * i + 1 : i + half;
        const float a = V::to_float(x[ia * is[3]]), b = V::to_float(x[ib * is[3]]);
        const float c = blk.cos[j][i], s = blk.sin[j][i] * sign;
        const float a_out = V::fmsub_s(a, c, b * s);
        const float b_out = V::fmadd_s(b, c, a * s);
        y[ia * os[3]] = V::template from_float<T>(a_out);
        y[ib * os[3]] = V::template from_float<T>(b_out);
      }
      if (p.copy_passthrough) {
        for (int64_t d = 2 * half; d < p.head_dim; ++d) y[d * os[3]] = x[d * is[3]];
      }
    }
  }
}

template <class V, class T>
void rotate_block_strided(const RopeCpuParams& p, const Block& blk) {
  if (p.q.heads > 0) rotate_tensor_strided<V, T>(p, p.q, blk);
  if (p.k.heads > 0) rotate_tensor_strided<V, T>(p, p.k, blk);
}

// ---------------------------------------------------------------------------------------------
// Choosing the instantiation, and the loop over blocks.

using BlockFn = void (*)(const RopeCpuParams&, const Block&);

// Compile-time pair counts for the common head sizes (64, 128, 256 with full rotary; partial
// rotary of 64 or 128 dims): loops without a remainder, fully unrolled where short.
template <class V, class T, bool kGptj>
BlockFn pick_half(int64_t half) {
  switch (half) {
    case 32:
      return rotate_block<V, T, kGptj, 32>;
    case 64:
      return rotate_block<V, T, kGptj, 64>;
    case 128:
      return rotate_block<V, T, kGptj, 128>;
    default:
      return rotate_block<V, T, kGptj, 0>;
  }
}

template <class V, class T>
BlockFn pick_for_type(const RopeCpuParams& p) {
  if (!p.contiguous_dim) return rotate_block_strided<V, T>;
  return p.interleaved ? pick_half<V, T, true>(p.half) : pick_half<V, T, false>(p.half);
}

using AngleFn = void (*)(const RopeCpuParams&, Block&, float*);

template <class V, class Tab>
AngleFn pick_angles_for_table(int angles) {
  switch (angles) {
    case ROPE_CPU_ANGLES_TOKEN:
      return block_angles<Tab, token_row<V, Tab>>;
    case ROPE_CPU_ANGLES_MROPE:
      return block_angles<Tab, mrope_row<V, Tab>>;
    default:
      return block_angles<Tab, table_row<V, Tab>>;
  }
}

template <class V>
AngleFn pick_angles(const RopeCpuParams& p) {
  return p.table_dtype == ROPE_CPU_BF16  ? pick_angles_for_table<V, RopeBf16>(p.angles)
         : p.table_dtype == ROPE_CPU_F16 ? pick_angles_for_table<V, RopeF16>(p.angles)
                                         : pick_angles_for_table<V, float>(p.angles);
}

// The next `count` tokens from (b, s) on into blk; (b, s) moves past them.
inline void next_block(Block& blk, int64_t count, int64_t seq, int64_t& b, int64_t& s) {
  blk.count = count;
  for (int64_t j = 0; j < count; ++j) {
    blk.b[j] = b;
    blk.s[j] = s;
    if (++s == seq) {
      s = 0;
      ++b;
    }
  }
}

template <class V>
void run_tokens(const RopeCpuParams& p, int64_t begin, int64_t end) {
  const BlockFn rotate = p.dtype == ROPE_CPU_BF16  ? pick_for_type<V, RopeBf16>(p)
                         : p.dtype == ROPE_CPU_F16 ? pick_for_type<V, RopeF16>(p)
                                                   : pick_for_type<V, float>(p);
  const AngleFn angles = pick_angles<V>(p);
  alignas(64) float scratch[kScratchFloats];
  int64_t per_block = kScratchFloats / (2 * p.half);  // the binding keeps half <= kScratchFloats/2
  if (per_block > kMaxBlockTokens) per_block = kMaxBlockTokens;
  Block blk;
  int64_t b = begin / p.seq, s = begin - (begin / p.seq) * p.seq;
  for (int64_t t0 = begin; t0 < end; t0 += per_block) {
    next_block(blk, end - t0 < per_block ? end - t0 : per_block, p.seq, b, s);
    angles(p, blk, scratch);
    rotate(p, blk);
  }
}

}  // namespace
}  // namespace ROPE_CPU_ISA_NS
