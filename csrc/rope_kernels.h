// rope_ops CUDA kernels: a small launch API that needs only the CUDA runtime headers.
//
// Everything is described by raw pointers, sizes and element strides of a canonical
// [B, S, H, D] view (the torch binding does the layout permutation). q and k share B, S, D and
// the dtype; their head counts may differ (GQA / MQA) and k may be absent (k == nullptr, Hk == 0).
//
// Math (SPEC.md): pairs (i, i + r/2) for neox or (2i, 2i + 1) for gptj,
//   x' = x*c - y*s,  y' = y*c + x*s   with s negated when inverse != 0 (the backward),
// float32 arithmetic, one rounding to the output dtype. c, s come from the float32 tables
// cos/sin [table_rows, r/2] for positions in [0, table_rows); other positions are computed on the
// fly from freq_turns (fixed-point turns, see rope_ops/backend.py) or, without freq_turns, give NaN.
// Nothing outside the tables is ever read, whatever the position values.
#pragma once

#include <stdint.h>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

enum RopeDType { ROPE_F32 = 0, ROPE_F16 = 1, ROPE_BF16 = 2 };
enum RopePosKind { ROPE_POS_OFFSET = 0, ROPE_POS_I32 = 1, ROPE_POS_I64 = 2 };

typedef struct RopeParams {
  // Data: element strides of the canonical [B, S, H, D] view, order (b, s, h, d).
  const void* q;
  void* q_out;
  int64_t q_stride[4];
  int64_t q_out_stride[4];
  const void* k;  // may be null (then Hk must be 0)
  void* k_out;
  int64_t k_stride[4];
  int64_t k_out_stride[4];
  int64_t B, S;  // tokens = B * S
  int64_t Hq, Hk;
  int64_t D;  // head_dim
  int64_t R;  // rotary_dim: even, 0 < R <= D
  int dtype;  // RopeDType, same for q, k and outputs
  int interleaved;  // 0: neox pairs (i, i + R/2); 1: gptj pairs (2i, 2i + 1)
  int inverse;  // rotate by minus the angle
  int copy_passthrough;  // 1: write dims [R, D) of the outputs (out of place); 0: touch only [0, R)
  // Positions: pos_kind ROPE_POS_OFFSET means pos(b, s) = pos_offset + s.
  const void* pos;
  int pos_kind;  // RopePosKind
  int64_t pos_stride_b, pos_stride_s;  // element strides (0 allowed)
  int64_t pos_offset;
  // Tables: contiguous float32 [table_rows, R/2].
  const float* cos_table;
  const float* sin_table;
  int64_t table_rows;
  const int64_t* freq_turns;  // [R/2] or null (caller tables: out-of-table rows are NaN)
  float attention_factor;  // m, applied to on-the-fly rows only (tables already hold m*cos)
} RopeParams;

// Which kernel rope_launch would pick, for tests and notes: 0 nothing to do, 1 vectorized fast
// path, 2 generic (scalar, any strides).
int rope_pick_path(const RopeParams* p);

// What the launch needs to know about the device: the multiprocessor count (sizes the grid) and
// the compute capability major (programmatic dependent launch needs >= 9).
typedef struct RopeDevice {
  int num_sms;
  int cc_major;
} RopeDevice;

// Launch on `stream`. Returns the launch error, cudaErrorInvalidValue for inconsistent
// parameters, cudaSuccess when there is nothing to do.
cudaError_t rope_launch(const RopeParams* p, const RopeDevice* dev, cudaStream_t stream);

// Grid tuning (process-wide, not thread-safe; for benchmarks): the fast path gives each thread up
// to max_heads_per_thread heads (default 8) while keeping >= min_threads_per_sm threads per SM
// (default 4096). Values < 1 leave a knob unchanged. Defaults per call class: kDefaultConfig.
void rope_set_tuning(int max_heads_per_thread, int min_threads_per_sm);

// Force a fast-path kernel variant (0 .. rope_num_variants()-1) and grid knobs for every call
// (benchmarks, tests); -1 (or any value out of range, < 1 for the knobs) restores the per-class
// defaults of kDefaultConfig in rope_kernels.cu. rope_last_variant(): the variant the last
// fast-path launch used (-1: one head per thread, the ROUNDS/1 kernel).
void rope_set_config(int variant, int max_heads_per_thread, int min_threads_per_sm);
// Launch knobs for every call (benchmarks, tests); a negative value restores the default:
// block_threads (32..256; default per call class), rows_on_the_fly (1: compute every cos/sin row
// from freq_turns instead of reading the table; default per call class), pdl (programmatic
// dependent launch on sm_90+; default 1).
void rope_set_launch(int block_threads, int rows_on_the_fly, int pdl);
// Flat path's blocks (benchmarks, tests): 0 = one per token and tensor; 1 = one per token for q
// and k together where they fit (kFlatThreads * kFlatMaxVectors vectors); -1 (default) = joint
// for decode-sized calls only.
void rope_set_flat_blocks(int joint);
// Flat path's lean kernel (benchmarks, tests): 0 = never; -1 (default) = where it can take the
// call (whole NeoX rows, dense [tokens, H, D] tensors, uniform positions) and the call is not
// decode-sized; 1 = wherever it can take the call. rope_last_variant reports it as 8.
void rope_set_flat_lean(int lean);
int rope_num_variants(void);
const char* rope_variant_name(int variant);
int rope_last_variant(void);

#ifdef __cplusplus
}
#endif
