// The AVX-512 kernel (F, BW, VL, DQ): 16 float lanes, masked loads and stores for partial
// vectors. Compiled for that target by a pragma, so the extension builds for the baseline and
// the binding runs this only where the CPU has the features (rope_cpu_binding.cpp checks CPUID
// and the OS's saved register state).
#include <cstdint>

#include "rope_cpu.h"

#if ROPE_CPU_X86
#include <immintrin.h>

// Everything below, and nothing above but the standard headers, is built for AVX-512 (the
// traits header is included inside this file's own namespace).
#if defined(__clang__)
#pragma clang attribute push(                                                              \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
    apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
// GCC 12 reports the deliberately undefined pass-through operand of its own AVX-512 intrinsics
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define ROPE_CPU_ISA_NS rope_cpu_avx512
#include "rope_cpu_kernel.h"
#include "rope_cpu_prologue.h"

namespace rope_cpu_avx512 {
namespace {

#include "rope_cpu_avx512_simd.h"

}  // namespace
}  // namespace rope_cpu_avx512

void rope_cpu_tokens_avx512(const RopeCpuParams& p, int64_t begin, int64_t end) {
  rope_cpu_avx512::run_tokens<rope_cpu_avx512::Avx512Simd>(p, begin, end);
}

void rope_cpu_prologue_avx512(const RopeCpuPrologueParams& p, int64_t begin, int64_t end,
    float* work) {
  rope_cpu_avx512::run_prologue<rope_cpu_avx512::Avx512Simd>(p, begin, end, work);
}

void rope_cpu_prologue_backward_avx512(const RopeCpuPrologueParams& p,
    const RopeCpuPrologueGrads& g, int64_t begin, int64_t end, float* work, float* const weight_grad[2]) {
  rope_cpu_avx512::run_prologue_backward<rope_cpu_avx512::Avx512Simd>(p, g, begin, end, work, weight_grad);
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // ROPE_CPU_X86
