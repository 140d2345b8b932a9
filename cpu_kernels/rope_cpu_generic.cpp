// The portable kernel: plain loops over 8 float lanes that the compiler vectorises for the
// build's baseline target (SSE2 on x86-64, NEON on aarch64). Runs on any CPU; on x86-64 the
// AVX2 and AVX-512 kernels take over where the CPU has them.
#include <cstdint>

#include "rope_cpu.h"

#define ROPE_CPU_ISA_NS rope_cpu_generic
#include "rope_cpu_kernel.h"
#include "rope_cpu_prologue.h"

namespace rope_cpu_generic {
namespace {

// The target's own one-element operations, for ScalarOps.
struct GenericScalar {
#if defined(__aarch64__)
  // The hardware conversions (exact, round to nearest even).
  static float f16_to_float(RopeF16 h) {
    __fp16 v;
    __builtin_memcpy(&v, &h.bits, sizeof v);
    return static_cast<float>(v);
  }
  static RopeF16 float_to_f16(float f) {
    const __fp16 v = static_cast<__fp16>(f);
    RopeF16 h;
    __builtin_memcpy(&h.bits, &v, sizeof v);
    return h;
  }
#else
  static float f16_to_float(RopeF16 h) {
    const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
    const uint32_t exponent = (h.bits >> 10) & 0x1fu;
    const uint32_t mantissa = h.bits & 0x3ffu;
    if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
      const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
      return bits_to_float(sign | float_to_bits(magnitude));
    }
    return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  }

  // Round to nearest even, subnormals and overflow to infinity included; NaN stays NaN (quiet).
  static RopeF16 float_to_f16(float f) {
    const uint32_t bits = float_to_bits(f);
    const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
    const uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return RopeF16{static_cast<uint16_t>(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu))};
    if (magnitude >= 0x477ff000u) return RopeF16{static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520
    if (magnitude < 0x38800000u) {  // below 2^-14: a multiple of 2^-24, rounded by the FPU
      const float units = bits_to_float(magnitude) * 16777216.0f;  // exact: < 2^10
      const float rounded = (units + 8388608.0f) - 8388608.0f;     // to nearest even integer
      return RopeF16{static_cast<uint16_t>(sign | static_cast<uint16_t>(rounded))};
    }
    const uint32_t rounded = magnitude + 0xfffu + ((magnitude >> 13) & 1u);
    return RopeF16{static_cast<uint16_t>(sign | ((rounded - (112u << 23)) >> 13))};
  }
#endif

  // x*y + z with one rounding where the target has a fused multiply-add, two otherwise (the
  // build turns implicit contraction off, so which one is explicit here).
  static float fma(float x, float y, float z) {
#if defined(__FP_FAST_FMAF)
    return __builtin_fmaf(x, y, z);
#else
    return x * y + z;
#endif
  }
};

struct GenericSimd : ScalarOps<GenericScalar> {
  static constexpr int W = 8;
  struct F {
    float v[W];
  };

  template <class T>
  static F load(const T* p) {
    F r;
    for (int l = 0; l < W; ++l) r.v[l] = to_float(p[l]);
    return r;
  }
  template <class T>
  static void store(T* p, F a) {
    for (int l = 0; l < W; ++l) p[l] = from_float<T>(a.v[l]);
  }
  template <class T>
  static F load_n(const T* p, int n) {
    F r;
    for (int l = 0; l < W; ++l) r.v[l] = l < n ? to_float(p[l]) : 0.0f;
    return r;
  }
  template <class T>
  static void store_n(T* p, F a, int n) {
    for (int l = 0; l < n; ++l) p[l] = from_float<T>(a.v[l]);
  }
  static F set1(float x) {
    F r;
    for (int l = 0; l < W; ++l) r.v[l] = x;
    return r;
  }
  static F add(F a, F b) {
    for (int l = 0; l < W; ++l) a.v[l] += b.v[l];
    return a;
  }
  static F mul(F a, F b) {
    for (int l = 0; l < W; ++l) a.v[l] *= b.v[l];
    return a;
  }
  static float sum16(F lo, F hi) {
    F a = add(lo, hi);
    for (int width = W / 2; width > 0; width /= 2) {
      for (int l = 0; l < width; ++l) a.v[l] += a.v[l + width];
    }
    return a.v[0];
  }
  static F fmadd(F a, F b, F c) {
    for (int l = 0; l < W; ++l) a.v[l] = fmadd_s(a.v[l], b.v[l], c.v[l]);
    return a;
  }
  static F fmsub(F a, F b, F c) {
    for (int l = 0; l < W; ++l) a.v[l] = fmsub_s(a.v[l], b.v[l], c.v[l]);
    return a;
  }
  static F dup_pairs(const float* c) {
    F r;
    for (int l = 0; l < W; ++l) r.v[l] = c[l / 2];
    return r;
  }
  static F dup_pairs_n(const float* c, int m) {
    F r;
    for (int l = 0; l < W; ++l) r.v[l] = l / 2 < m ? c[l / 2] : 0.0f;
    return r;
  }
  static F swap_pairs(F a) {
    F r;
    for (int l = 0; l < W; ++l) r.v[l] = a.v[l ^ 1];
    return r;
  }
};

}  // namespace
}  // namespace rope_cpu_generic

ROPE_CPU_DEFINE_KERNELS(generic, GenericSimd)
