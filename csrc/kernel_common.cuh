// What every kernel family shares: 16-byte vectors of each dtype, data loads and stores, the
// grid dependency wait, index helpers.
//
// Every per-thread function is __host__ __device__: a kernel is a thin shell around per-thread
// code, so the tests' host emulation (tests/csrc/) runs the very same code on the CPU.
// Do not compile with --use_fast_math: the on-the-fly rows rely on accurate sincospif.
#pragma once

#include "rope.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <string.h>

#define ROPE_HD __host__ __device__ __forceinline__

namespace rope_ops_cuda {
namespace {

// First thing before a kernel's first global load: wait for the grid this one depends on (a
// no-op unless launched with programmatic stream serialization), then let the next grid launch:
// its own wait covers this grid's writes. The kernel parameters may be read before the wait.
ROPE_HD void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Read-only (non-coherent) load on the device, plain load on the host.
template <typename T>
ROPE_HD T ldg_ro(const T* ptr) {
#ifdef __CUDA_ARCH__
  return __ldg(ptr);
#else
  return *ptr;
#endif
}

// Streaming (evict-first) load of data read exactly once, so that q/k traffic does not push the
// cos/sin rows and positions out of L2; a plain load on the host.
template <typename T>
ROPE_HD T ld_stream(const T* ptr) {
#ifdef __CUDA_ARCH__
  return __ldcs(ptr);
#else
  return *ptr;
#endif
}

// The data vectors: 16 bytes (uint4), or 8 (uint2) where rotary halves are whole 8-byte vectors
// only (head_dim 96 with rotary 24 in bf16: halves of 24 bytes).
template <int VB>
struct Vec;
template <>
struct Vec<16> {
  using type = uint4;
};
template <>
struct Vec<8> {
  using type = uint2;
};

template <typename T, int VB = 16>
struct VecInfo {
  static constexpr int kVec = VB / sizeof(T);  // elements per vector
};

template <typename To, typename From>
ROPE_HD To bit_cast_hd(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "size");
  To t;
  memcpy(&t, &f, sizeof(To));
  return t;
}

template <typename T>
ROPE_HD void unpack16(const uint4& v, float* f);

template <>
ROPE_HD void unpack16<float>(const uint4& v, float* f) {
  f[0] = bit_cast_hd<float>(v.x);
  f[1] = bit_cast_hd<float>(v.y);
  f[2] = bit_cast_hd<float>(v.z);
  f[3] = bit_cast_hd<float>(v.w);
}

template <>
ROPE_HD void unpack16<__half>(const uint4& v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __half22float2(bit_cast_hd<__half2>(w[i]));
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

template <>
ROPE_HD void unpack16<__nv_bfloat16>(const uint4& v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(bit_cast_hd<__nv_bfloat162>(w[i]));
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

template <typename T>
ROPE_HD uint4 pack16(const float* f);

template <>
ROPE_HD uint4 pack16<float>(const float* f) {
  return make_uint4(bit_cast_hd<uint32_t>(f[0]), bit_cast_hd<uint32_t>(f[1]),
                    bit_cast_hd<uint32_t>(f[2]), bit_cast_hd<uint32_t>(f[3]));
}

template <>
ROPE_HD uint4 pack16<__half>(const float* f) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = bit_cast_hd<uint32_t>(__floats2half2_rn(f[2 * i], f[2 * i + 1]));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <>
ROPE_HD uint4 pack16<__nv_bfloat16>(const float* f) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = bit_cast_hd<uint32_t>(__floats2bfloat162_rn(f[2 * i], f[2 * i + 1]));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// 8-byte vectors: the first half of the 16-byte ones.
template <typename T>
ROPE_HD void unpack8(const uint2& v, float* f) {
  float g[8];
  unpack16<T>(make_uint4(v.x, v.y, 0, 0), g);
#pragma unroll
  for (int i = 0; i < 8 / (int)sizeof(T); ++i) f[i] = g[i];
}

template <typename T>
ROPE_HD uint2 pack8(const float* f) {
  float g[8] = {};
#pragma unroll
  for (int i = 0; i < 8 / (int)sizeof(T); ++i) g[i] = f[i];
  const uint4 v = pack16<T>(g);
  return make_uint2(v.x, v.y);
}

// unpack16 / pack16 or unpack8 / pack8, by vector type.
template <typename T>
ROPE_HD void unpack_vec(const uint4& v, float* f) { unpack16<T>(v, f); }
template <typename T>
ROPE_HD void unpack_vec(const uint2& v, float* f) { unpack8<T>(v, f); }
template <typename T, typename VT>
ROPE_HD VT pack_vec(const float* f) {
  if constexpr (sizeof(VT) == 16) return pack16<T>(f);
  else return pack8<T>(f);
}

ROPE_HD float to_f32(float x) { return x; }
ROPE_HD float to_f32(__half x) { return __half2float(x); }
ROPE_HD float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
ROPE_HD T from_f32(float x);
template <>
ROPE_HD float from_f32<float>(float x) { return x; }
template <>
ROPE_HD __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <>
ROPE_HD __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Data loads and stores of 16-byte vectors, by cache hint:
//   HINT_STREAM: evict-first loads (ld.global.cs), plain stores;
//   HINT_PLAIN: plain loads and stores;
//   HINT_STREAM_ST: evict-first loads and stores (st.global.cs).
enum { HINT_STREAM = 0, HINT_PLAIN = 1, HINT_STREAM_ST = 2 };

template <int HINT, typename VT = uint4>
ROPE_HD VT ld_data(const void* ptr) {
  const VT* p = reinterpret_cast<const VT*>(ptr);
  if constexpr (HINT == HINT_PLAIN) {
    return *p;
  } else {
    return ld_stream(p);
  }
}

// Stores spelled out on the device: a plain `*p = v` came out of nvcc 13.0 as four 32-bit stores
// in the flat kernel (the heads-per-thread kernels got 16-byte ones), 3-4 % slower on the H200;
// __stwb (st.global.wb) gives 16-byte stores, but ptxas makes them STG.E.128.STRONG.SM. This is
// the plain weak 16-byte store (STG.E.128).
template <int HINT>
ROPE_HD void st_data(void* ptr, const uint4& v) {
  uint4* p = reinterpret_cast<uint4*>(ptr);
#ifdef __CUDA_ARCH__
  if constexpr (HINT == HINT_STREAM_ST) {
    __stcs(p, v);
  } else {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
  }
#else
  *p = v;
#endif
}

template <int HINT>
ROPE_HD void st_data(void* ptr, const uint2& v) {
  uint2* p = reinterpret_cast<uint2*>(ptr);
#ifdef __CUDA_ARCH__
  if constexpr (HINT == HINT_STREAM_ST) {
    __stcs(p, v);
  } else {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
  }
#else
  *p = v;
#endif
}

// Token -> (b, s) of the canonical [B, S] view; use32 (the token and S fit in 31 bits): 32-bit
// division, ~20 SASS instructions instead of ~70.
ROPE_HD void split_token(const RopeParams& p, const bool use32, const long long tok, long long& b,
                         long long& s) {
  if (use32) {
    const uint32_t tk = (uint32_t)tok;
    const uint32_t bb = tk / (uint32_t)p.S;
    b = bb;
    s = tk - bb * (uint32_t)p.S;
  } else {
    b = tok / p.S;
    s = tok - b * p.S;
  }
}

// n / d for n < 2^31 by a multiply-high and a shift (Granlund-Montgomery; exact for every such
// n), with mul and shift computed once on the host: where a thread moves only 16-32 bytes, a
// ~20-instruction division per thread costs bandwidth (H200, W3 in place: 22.4 us with two of
// them in the rows kernel, 21.3 with these).
struct FastDiv {
  uint32_t mul, shift;
};

inline FastDiv make_fast_div(const uint32_t d) {
  uint32_t l = 0;
  while ((uint64_t(1) << l) < d) ++l;  // l = ceil(log2 d)
  return {(uint32_t)(((uint64_t(1) << 32) * ((uint64_t(1) << l) - d)) / d + 1), l};
}

ROPE_HD uint32_t fast_div(const FastDiv& f, const uint32_t n) {
#ifdef __CUDA_ARCH__
  const uint32_t t = __umulhi(n, f.mul);
#else
  const uint32_t t = (uint32_t)(((uint64_t)n * f.mul) >> 32);
#endif
  return (t + n) >> f.shift;  // t <= n < 2^31: no overflow
}

// Token t of every tensor starts at t * stride[1] from its base (B == 1, or batches back to back).
inline bool tokens_uniform(const RopeParams& p) {
  if (p.B == 1) return true;
  const auto same = [&](const int64_t* st) { return st[0] == p.S * st[1]; };
  if (p.Hq > 0 && (!same(p.q_stride) || !same(p.q_out_stride))) return false;
  if (p.Hk > 0 && (!same(p.k_stride) || !same(p.k_out_stride))) return false;
  return true;
}

}  // namespace
}  // namespace rope_ops_cuda
