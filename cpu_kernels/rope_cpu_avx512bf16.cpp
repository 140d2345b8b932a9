// The AVX-512 kernel for CPUs that also have AVX512_BF16: bfloat16 outputs rounded by one
// instruction (VCVTNEPS2BF16, round to nearest even, NaN made quiet: the same bits as the integer
// rounding) instead of ten. That instruction flushes float32 subnormal inputs to zero, so a
// vector holding one is rounded the exact integer way instead. Everything else is the AVX-512
// kernel's.
#include <cstdint>

#include "rope_cpu.h"

#if ROPE_CPU_X86
#include <immintrin.h>

// Everything below, and nothing above but the standard headers, is built for AVX-512 with
// AVX512_BF16 (the traits header is included inside this file's own namespace).
ROPE_CPU_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#if !defined(__clang__)
// GCC 12 reports the deliberately undefined pass-through operand of its own AVX-512 intrinsics
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define ROPE_CPU_ISA_NS rope_cpu_avx512bf16
#include "rope_cpu_kernel.h"
#include "rope_cpu_prologue.h"

namespace rope_cpu_avx512bf16 {
namespace {

#include "rope_cpu_avx512_simd.h"

struct Avx512Bf16Simd : Avx512Simd {
  using Avx512Simd::store;
  using Avx512Simd::store_n;

  static constexpr int kDenormal = 0x20;  // VFPCLASSPS category: subnormal

  static void store(RopeBf16* p, F a) {
    if (__builtin_expect(_mm512_fpclass_ps_mask(a, kDenormal) != 0, 0)) {
      Avx512Simd::store(p, a);
      return;
    }
    const __m256bh rounded = _mm512_cvtneps_pbh(a);
    __builtin_memcpy(p, &rounded, sizeof rounded);
  }
  static void store_n(RopeBf16* p, F a, int n) {
    if (__builtin_expect((_mm512_fpclass_ps_mask(a, kDenormal) & first(n)) != 0, 0)) {
      Avx512Simd::store_n(p, a, n);
      return;
    }
    const __m256bh rounded = _mm512_cvtneps_pbh(a);
    __m256i bits;
    __builtin_memcpy(&bits, &rounded, sizeof bits);
    _mm256_mask_storeu_epi16(p, first(n), bits);
  }
};

}  // namespace
}  // namespace rope_cpu_avx512bf16

ROPE_CPU_DEFINE_KERNELS(avx512bf16, Avx512Bf16Simd)

ROPE_CPU_TARGET_END
#endif  // ROPE_CPU_X86
