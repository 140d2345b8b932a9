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
// Where a token's angles come from (KernelArgs.angles): its position's table row; its own row of
// per-token tables; or, mRoPE, each frequency from the row of one of its three positions.
enum RopeCpuAngles : int { ROPE_CPU_ANGLES_TABLE = 0, ROPE_CPU_ANGLES_TOKEN = 1, ROPE_CPU_ANGLES_MROPE = 2 };

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

  // Positions: token (b, s) has position pos_offset + s, or pos[b * pos_stride_b + s * pos_stride_s]
  // (mRoPE: axis a's position at pos[a * pos_stride_axis + b * pos_stride_b + s * pos_stride_s]).
  int pos_kind = ROPE_CPU_POS_OFFSET;
  const void* pos = nullptr;
  int64_t pos_stride_axis = 0, pos_stride_b = 0, pos_stride_s = 0;
  int64_t pos_offset = 0;

  // The angle source. cos/sin hold m*cos and m*sin (float32, float16 or bfloat16: table_dtype),
  // stride 1 along frequencies. Table and mRoPE: rows [table_rows, half], row p at p * stride[0];
  // rows outside [0, table_rows) are computed from freq_turns (fixed-point turns per position),
  // or are NaN when freq_turns is null (caller tables). Per token: token (b, s)'s row at
  // b * stride[0] + s * stride[1].
  int angles = ROPE_CPU_ANGLES_TABLE;
  int table_dtype = ROPE_CPU_F32;
  const void* cos = nullptr;
  const void* sin = nullptr;
  int64_t cos_stride[2] = {0, 0}, sin_stride[2] = {0, 0};
  int64_t table_rows = 0;
  const int64_t* freq_turns = nullptr;
  const int64_t* mrope_axis = nullptr;  // mRoPE: the position axis (0, 1, 2) of each frequency
  double attention_factor = 1.0;

  bool interleaved = false;  // gptj pairs (2i, 2i+1); neox pairs (i, i + half)
  bool inverse = false;      // rotate by minus the angle (the backward)
  bool copy_passthrough = false;  // out of place: copy dims [2*half, head_dim) to the outputs
  bool contiguous_dim = false;    // every tensor has stride 1 on head_dim (the vector path)
};

// The fused prologue (rope_ops.qkv_prologue): one call, validated by the binding. Each token's
// QKV row holds q_heads, then kv_heads k and kv_heads v heads of head_dim elements (stride 1).
constexpr int ROPE_CPU_F8E4M3 = 3;  // a KV cache of float8 e4m3fn (cache_dtype only)

constexpr int64_t ROPE_CPU_PROLOGUE_WORK_ROWS = 9;

struct RopeCpuPrologueParams {
  // dtype, batch, seq, head_dim, the angle source and interleaved; half = rotary_dim / 2, 0 when
  // not rotating (then the angle source is unused).
  RopeCpuParams rope;
  int64_t q_heads = 0, kv_heads = 0;
  const void* qkv = nullptr;
  void* qkv_out = nullptr;             // qkv itself when in place (q and k heads written there)
  int64_t qkv_stride[2] = {0, 0};      // (batch, token) element strides of the rows
  bool inplace = false;
  // Out of place: q, k, v as [B, S, H, D] with (batch, token, head) strides, stride 1 on D.
  void* out[3] = {nullptr, nullptr, nullptr};
  int64_t out_stride[3][3] = {{0, 0, 0}, {0, 0, 0}, {0, 0, 0}};
  // > 0 (out of place only): q (out[0]) is float8 e4m3fn holding q / q_scale; 0: the data dtype.
  float q_scale = 0.0f;
  // RMSNorm: weight_offset + weight as float32 [D] for q and k heads; null: no norm.
  const float* weight[2] = {nullptr, nullptr};
  float eps = 0.0f;
  // KV cache (k_cache null: none): [num_slots, kv_heads, D] with (slot, head) strides, of dtype
  // `dtype` or ROPE_CPU_F8E4M3 (holding value / scale). Token (b, s) goes to slot
  // slots[b * slots_stride[0] + s * slots_stride[1]]; slots outside [0, num_slots) are skipped.
  int cache_dtype = ROPE_CPU_F32;
  void* cache[2] = {nullptr, nullptr};  // k, v
  int64_t cache_stride[2][2] = {{0, 0}, {0, 0}};
  int64_t num_slots = 0;
  const void* slots = nullptr;
  bool slots_int64 = false;
  int64_t slots_stride[2] = {0, 0};
  float cache_scale[2] = {1.0f, 1.0f};
};

// The prologue's backward: output gradients (null: zero) as [B, S, H, D] with (batch, token,
// head) strides and stride 1 on D, in the data dtype; grad_qkv rows with (batch, token) strides.
struct RopeCpuPrologueGrads {
  const void* grad[3] = {nullptr, nullptr, nullptr};  // q, k, v
  int64_t grad_stride[3][3] = {{0, 0, 0}, {0, 0, 0}, {0, 0, 0}};
  void* grad_qkv = nullptr;
  int64_t grad_qkv_stride[2] = {0, 0};
};

// Rotate tokens [begin, end) of the flattened (batch, seq) range. One per instruction set; the
// AVX2 and AVX-512 ones exist on x86-64 only and may run only where the CPU has those features.
// The AVX512_BF16 one differs from the AVX-512 one only in how it rounds bfloat16 outputs.
//
// The prologue's forward over tokens [begin, end); its backward over tokens [begin, end), adding
// the weights' gradient terms into the float32 rows weight_grad[0] (q) and weight_grad[1] (k) of
// D floats (null where that weight is null). `work`: the calling thread's scratch of
// ROPE_CPU_PROLOGUE_WORK_ROWS rows of D floats rounded up to 16, 64-byte aligned.
#define ROPE_CPU_TOKENS_FN(isa) \
  void rope_cpu_tokens_##isa(const RopeCpuParams& p, int64_t begin, int64_t end)
#define ROPE_CPU_PROLOGUE_FN(isa)                                                            \
  void rope_cpu_prologue_##isa(const RopeCpuPrologueParams& p, int64_t begin, int64_t end, \
                               float* work)
#define ROPE_CPU_PROLOGUE_BACKWARD_FN(isa)                                              \
  void rope_cpu_prologue_backward_##isa(const RopeCpuPrologueParams& p,                 \
                                        const RopeCpuPrologueGrads& g, int64_t begin,    \
                                        int64_t end, float* work, float* const weight_grad[2])
#define ROPE_CPU_DECLARE_KERNELS(isa) \
  ROPE_CPU_TOKENS_FN(isa);            \
  ROPE_CPU_PROLOGUE_FN(isa);          \
  ROPE_CPU_PROLOGUE_BACKWARD_FN(isa);

// Defines the entry points of `isa` in its translation unit, after rope_cpu_kernel.h and
// rope_cpu_prologue.h: the kernels of namespace ROPE_CPU_ISA_NS with its traits class V.
#define ROPE_CPU_DEFINE_KERNELS(isa, V)                                                       \
  ROPE_CPU_TOKENS_FN(isa) { ROPE_CPU_ISA_NS::run_tokens<ROPE_CPU_ISA_NS::V>(p, begin, end); } \
  ROPE_CPU_PROLOGUE_FN(isa) {                                                                 \
    ROPE_CPU_ISA_NS::run_prologue<ROPE_CPU_ISA_NS::V>(p, begin, end, work);                   \
  }                                                                                           \
  ROPE_CPU_PROLOGUE_BACKWARD_FN(isa) {                                                        \
    ROPE_CPU_ISA_NS::run_prologue_backward<ROPE_CPU_ISA_NS::V>(p, g, begin, end, work,        \
                                                               weight_grad);                  \
  }

ROPE_CPU_DECLARE_KERNELS(generic)
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ROPE_CPU_X86 1
ROPE_CPU_DECLARE_KERNELS(avx2)
ROPE_CPU_DECLARE_KERNELS(avx512)
ROPE_CPU_DECLARE_KERNELS(avx512bf16)

// Every function between ROPE_CPU_TARGET_BEGIN("avx2,fma,...") and ROPE_CPU_TARGET_END,
// templates instantiated there included, is compiled for those extensions; the rest of the
// extension for the baseline.
#define ROPE_CPU_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define ROPE_CPU_TARGET_BEGIN(features) \
  ROPE_CPU_PRAGMA(clang attribute push(__attribute__((target(features))), apply_to = function))
#define ROPE_CPU_TARGET_END ROPE_CPU_PRAGMA(clang attribute pop)
#else
#define ROPE_CPU_TARGET_BEGIN(features) \
  ROPE_CPU_PRAGMA(GCC push_options) ROPE_CPU_PRAGMA(GCC target(features))
#define ROPE_CPU_TARGET_END ROPE_CPU_PRAGMA(GCC pop_options)
#endif
#endif
