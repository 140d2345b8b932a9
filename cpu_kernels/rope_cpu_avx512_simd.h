// The AVX-512 traits (F, BW, VL, DQ: 16 float lanes, masked loads and stores for partial
// vectors) of rope_cpu_kernel.h, shared by rope_cpu_avx512.cpp and rope_cpu_avx512bf16.cpp.
// Included inside each one's namespace, under its target pragma, after rope_cpu_kernel.h.

#include "rope_cpu_x86_scalar.h"

struct Avx512Simd : ScalarOps<X86Scalar> {
  static constexpr int W = 16;
  using F = __m512;

  static __mmask16 first(int n) { return static_cast<__mmask16>((1u << n) - 1); }
  static F widen_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // Round to nearest even in integers; NaN lanes keep their top bits, made quiet.
  static __m256i to_bf16(F a) {
    const __m512i bits = _mm512_castps_si512(a);
    const __m512i high = _mm512_srli_epi32(bits, 16);
    const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __m512i quiet_nan = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
    const __mmask16 is_nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet_nan));
  }
  static __m256i to_f16(F a) {
    return _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }

  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const RopeBf16* p) {
    return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F load(const RopeF16* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
  static void store(RopeBf16* p, F a) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(a));
  }
  static void store(RopeF16* p, F a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_f16(a)); }

  // Masked: lanes from n on are neither read nor written (no fault past the end).
  static F load_n(const float* p, int n) { return _mm512_maskz_loadu_ps(first(n), p); }
  static F load_n(const RopeBf16* p, int n) { return widen_bf16(_mm256_maskz_loadu_epi16(first(n), p)); }
  static F load_n(const RopeF16* p, int n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first(n), p));
  }
  static void store_n(float* p, F a, int n) { _mm512_mask_storeu_ps(p, first(n), a); }
  static void store_n(RopeBf16* p, F a, int n) { _mm256_mask_storeu_epi16(p, first(n), to_bf16(a)); }
  static void store_n(RopeF16* p, F a, int n) { _mm256_mask_storeu_epi16(p, first(n), to_f16(a)); }

  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  // 16 lanes l as (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1)
  static float sum16(F v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
  }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fmsub(F a, F b, F c) { return _mm512_fmsub_ps(a, b, c); }
  static F dup_pairs_of(__m256 x) {
    const __m512i index = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    return _mm512_permutexvar_ps(index, _mm512_castps256_ps512(x));
  }
  static F dup_pairs(const float* c) { return dup_pairs_of(_mm256_loadu_ps(c)); }
  static F dup_pairs_n(const float* c, int m) {
    return dup_pairs_of(_mm256_maskz_loadu_ps(static_cast<__mmask8>((1u << m) - 1), c));
  }
  static F swap_pairs(F a) { return _mm512_permute_ps(a, 0xb1); }
};
