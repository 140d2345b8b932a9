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
ROPE_CPU_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#if !defined(__clang__)
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

ROPE_CPU_DEFINE_KERNELS(avx512, Avx512Simd)

ROPE_CPU_TARGET_END
#endif  // ROPE_CPU_X86
