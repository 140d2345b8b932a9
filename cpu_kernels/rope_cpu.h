// The rope_ops CPU kernels: what the binding (rope_cpu_binding.cpp) hands to the kernels of
// one instruction set (rope_cpu_generic.cpp, rope_cpu_avx2.cpp, rope_cpu_avx512.cpp).
//
// Plain C++ only (no torch types): the instruction-set translation units are compiled for
// different targets and must share no inline code with the rest of the extension.
#pragma once

#include <cstdint>

// Element types as stored in memory; the kernels convert them to float32 and back.
struct RopeBf16 {
  uint16_t bits;
};
struct RopeF16 {
  uint16_t bits;
};

enum RopeCpuDtype : int { ROPE_CPU_F32 = 0, ROPE_CPU_F16 = 1, ROPE_CPU_BF16 = 2 };
enum RopeCpuPosKind : int { ROPE_CPU_POS_OFFSET = 0, ROPE_CPU_POS_I32 = 1, ROPE_CPU_POS_I64 = 2 };

// One tensor as a [B, S, H, D] strided view (element strides; the batch stride is 0 for thd).
struct RopeCpuTensor {
  const void* in = nullptr;
  void* out = nullptr;  // == in when in place
  int64_t heads = 0;    // 0: this tensor is absent (k None)
  int64_t in_stride[4] = {0, 0, 0, 0};
  int64_t out_stride[4] = {0, 0, 0, 0};
};

// One call, validated by the binding.
struct RopeCpuParams {
  int dtype = ROPE_CPU_F32;
  int64_t batch = 0, seq = 0, head_dim = 0;
  int64_t half = 0;  // rotary_dim / 2: pairs per head
  RopeCpuTensor q, k;

  // Positions: token (b, s) has position pos_offset + s, or pos[b * pos_stride_b + s * pos_stride_s].
  int pos_kind = ROPE_CPU_POS_OFFSET;
  const void* pos = nullptr;
  int64_t pos_stride_b = 0, pos_stride_s = 0;
  int64_t pos_offset = 0;

  // The angle source: float32 tables [table_rows, half] of m*cos and m*sin; rows outside
  // [0, table_rows) are computed from freq_turns (fixed-point turns per position), or are NaN
  // when freq_turns is null (caller tables).
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t table_rows = 0;
  const int64_t* freq_turns = nullptr;
  double attention_factor = 1.0;

  bool interleaved = false;  // gptj pairs (2i, 2i+1); neox pairs (i, i + half)
  bool inverse = false;      // rotate by minus the angle (the backward)
  bool copy_passthrough = false;  // out of place: copy dims [2*half, head_dim) to the outputs
  bool contiguous_dim = false;    // every tensor has stride 1 on head_dim (the vector path)
};

// Rotate tokens [begin, end) of the flattened (batch, seq) range. One per instruction set; the
// AVX2 and AVX-512 ones exist on x86-64 only and may run only where the CPU has those features.
void rope_cpu_tokens_generic(const RopeCpuParams& p, int64_t begin, int64_t end);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ROPE_CPU_X86 1
void rope_cpu_tokens_avx2(const RopeCpuParams& p, int64_t begin, int64_t end);
void rope_cpu_tokens_avx512(const RopeCpuParams& p, int64_t begin, int64_t end);
#endif
