// The x86 targets' own one-element operations, for ScalarOps (rope_cpu_kernel.h): float16
// conversions by F16C, fused multiply-add by FMA. Shared by rope_cpu_avx2.cpp and the AVX-512
// traits; included inside each translation unit's namespace, under its target pragma (which
// enables F16C and FMA), after rope_cpu_kernel.h.

struct X86Scalar {
  static float f16_to_float(RopeF16 h) { return _cvtsh_ss(h.bits); }
  static RopeF16 float_to_f16(float f) {
    return RopeF16{static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT))};
  }
  static float fma(float x, float y, float z) { return __builtin_fmaf(x, y, z); }
};
