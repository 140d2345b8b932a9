// The AVX2 kernel (with FMA and F16C): 8 float lanes. Compiled for that target by a pragma, so
// the extension builds for the baseline and the binding runs this only where the CPU has the
// features (rope_cpu_binding.cpp checks CPUID and the OS's saved register state).
#include <cstdint>

#include "rope_cpu.h"

#if ROPE_CPU_X86
#include <immintrin.h>

// Everything below, and nothing above (no header of shared inline code), is built for AVX2.
ROPE_CPU_TARGET_BEGIN("avx2,fma,f16c")

#define ROPE_CPU_ISA_NS rope_cpu_avx2
#include "rope_cpu_kernel.h"
#include "rope_cpu_prologue.h"

namespace rope_cpu_avx2 {
namespace {

#include "rope_cpu_x86_scalar.h"

struct Avx2Simd : ScalarOps<X86Scalar> {
  static constexpr int W = 8;
  using F = __m256;

  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const RopeBf16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static F load(const RopeF16* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
  static void store(RopeBf16* p, F a) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(a));
  }
  static void store(RopeF16* p, F a) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // Round to nearest even in integers; NaN lanes keep their top bits, made quiet.
  static __m128i to_bf16(F a) {
    const __m256i bits = _mm256_castps_si256(a);
    const __m256i high = _mm256_srli_epi32(bits, 16);
    const __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i quiet_nan = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    const __m256 is_nan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
    const __m256i r = _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet_nan), is_nan));
    // every lane is <= 0xffff: the unsigned saturation of the pack is exact
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  // Partial vectors through a small buffer: never reads or writes past element n.
  template <class T>
  static F load_n(const T* p, int n) {
    T buf[W] = {};
    __builtin_memcpy(buf, p, n * sizeof(T));
    return load(buf);
  }
  template <class T>
  static void store_n(T* p, F a, int n) {
    T buf[W];
    store(buf, a);
    __builtin_memcpy(p, buf, n * sizeof(T));
  }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  // 8 lanes l as (l, l + 4), (l, l + 2), (l, l + 1)
  static float sum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
  }
  static float sum16(F lo, F hi) { return sum8(_mm256_add_ps(lo, hi)); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fmsub(F a, F b, F c) { return _mm256_fmsub_ps(a, b, c); }
  static F dup_pairs(const float* c) {
    const __m128 x = _mm_loadu_ps(c);
    return _mm256_set_m128(_mm_unpackhi_ps(x, x), _mm_unpacklo_ps(x, x));
  }
  static F dup_pairs_n(const float* c, int m) {
    float buf[W / 2] = {};
    __builtin_memcpy(buf, c, m * sizeof(float));
    return dup_pairs(buf);
  }
  static F swap_pairs(F a) { return _mm256_permute_ps(a, 0xb1); }
};

}  // namespace
}  // namespace rope_cpu_avx2

ROPE_CPU_DEFINE_KERNELS(avx2, Avx2Simd)

ROPE_CPU_TARGET_END
#endif  // ROPE_CPU_X86
