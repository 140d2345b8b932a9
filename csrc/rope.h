// rope_ops CUDA kernels: the C launch API (CUDA runtime headers only).
//
// A call is one RopeParams: raw pointers, sizes and element strides of a canonical [B, S, H, D]
// view of q, k and their outputs (the torch binding permutes the layout). q and k share B, S, D
// and the dtype; their head counts may differ (GQA / MQA) and k may be absent (Hk == 0).
//
// Math (SPEC.md): pairs (i, i + R/2) for neox or (2i, 2i + 1) for gptj,
//   x' = x*c - y*s,  y' = y*c + x*s   with s negated when inverse != 0 (the backward),
// float32 arithmetic, one rounding to the output dtype. c, s come from the float32 tables
// cos/sin [table_rows, R/2] for positions in [0, table_rows); other positions are computed on the
// fly from freq_turns (fixed-point turns, see rope_ops/backend.py) or, without freq_turns, are NaN.
// Nothing outside the tables is ever read, whatever the position values. mRoPE picks the position
// per frequency (three per token); per-token angles read the caller's row of each token instead
// (angle_kind).
//
// Which kernel runs is a RopeConfig: rope_choose() derives it from the call and the device alone
// (policy.h); rope_candidates() lists every configuration that can take the call, for the
// benchmark tooling to time (not API).
#pragma once

#include <stdint.h>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

enum RopeDType { ROPE_F32 = 0, ROPE_F16 = 1, ROPE_BF16 = 2 };
enum RopePosKind { ROPE_POS_OFFSET = 0, ROPE_POS_I32 = 1, ROPE_POS_I64 = 2 };
// Where a token's angles come from (angle_sources.cuh): TableAngles, TokenAngles, MropeAngles.
enum RopeAngleKind { ROPE_ANGLES_TABLE = 0, ROPE_ANGLES_TOKEN = 1, ROPE_ANGLES_MROPE = 2 };

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
  // Angle source (angle_sources.cuh; angle_kind below). Positions: ROPE_POS_OFFSET means
  // pos(b, s) = pos_offset + s.
  const void* pos;
  int pos_kind;  // RopePosKind
  int64_t pos_stride_b, pos_stride_s;  // element strides (0 allowed)
  int64_t pos_offset;
  // Tables: float32 [table_rows, R/2], stride 1 along frequencies, rows table_row_stride
  // elements apart in both (0: R/2, rows back to back). cos and sin may be the two halves of one
  // [table_rows, R] cos|sin cache (row stride R), read in place.
  const float* cos_table;
  const float* sin_table;
  int64_t table_rows;
  int64_t table_row_stride;
  const int64_t* freq_turns;  // [R/2] or null (caller tables: out-of-table rows are NaN)
  float attention_factor;  // m, applied to on-the-fly rows only (tables already hold m*cos)
  // RopeAngleKind; 0 (the table) for a zero-initialised RopeParams.
  int angle_kind;
  // ROPE_ANGLES_TOKEN: the caller's m*cos / m*sin of each token, [B, S, R/2] with element strides
  // (b, s) (0 to broadcast) and stride 1 along frequencies, of token_dtype (RopeDType). No
  // positions, no table: pos, cos_table, sin_table and freq_turns are unused.
  const void* token_cos;
  const void* token_sin;
  int token_dtype;
  int64_t token_cos_stride_b, token_cos_stride_s;
  int64_t token_sin_stride_b, token_sin_stride_s;
  // ROPE_ANGLES_MROPE: pos holds three positions per token (axes t, h, w), pos_stride_axis
  // elements apart (pos_kind I32 or I64); frequency i takes the position of the axis that
  // mrope_section (three counts summing to R/2) assigns it: chunked, or interleaved (Qwen3-VL:
  // h where i % 3 == 1 and i < 3 * section[1], w where i % 3 == 2 and i < 3 * section[2], else t).
  // Rows come from the table as for ROPE_ANGLES_TABLE.
  int64_t pos_stride_axis;
  int mrope_section[3];
  int mrope_interleaved;
} RopeParams;

// What the choice of kernel may depend on besides the call.
typedef struct RopeDevice {
  int num_sms;
  int cc_major;
  int64_t l2_bytes;
  int pdl;  // programmatic dependent launch: cc_major >= 9 and kernels built for sm_90+
} RopeDevice;

// Kernel families (csrc/kernel_*.cuh).
enum RopeFamily {
  ROPE_NOTHING = 0,  // no tokens or no heads
  ROPE_HEADS = 1,    // a thread rotates one 16-byte chunk of several heads of a token
  ROPE_FLAT = 2,     // a block per token's rows (or part of them); a warp holds whole rows
  ROPE_LEAN = 3,     // the flat family's common case: whole NeoX rows of dense tensors
  ROPE_ROWS = 4,     // in place: a thread per row's rotary chunk, consecutive rows
  ROPE_GENERIC = 5,  // any strides and alignment, one thread per pair
};
// ROPE_HEADS schedules: how a thread walks its heads (ignored at one head per thread).
enum RopeHeadsSchedule {
  ROPE_PIPE2_STREAM = 0,  // software-pipelined in stages of 2 heads, evict-first loads and stores
  ROPE_ROUNDS4_PLAIN = 1,  // rounds of 4 heads (loads, then math and stores), plain loads
};
// ROPE_FLAT blocks.
enum RopeFlatBlocks {
  ROPE_FLAT_SEPARATE = 0,  // a block per token and tensor (q blocks and k blocks)
  ROPE_FLAT_JOINT = 1,     // a block per token for q and k together
  ROPE_FLAT_SPLIT = 2,     // a token's q and k rows cut into blocks of 128 * vectors vectors
};

typedef struct RopeConfig {
  int family;            // RopeFamily
  int vector_bytes;      // ROPE_HEADS: 16, or 8 where rotary halves are whole 8-byte vectors only
  int schedule;          // ROPE_HEADS: RopeHeadsSchedule
  int heads_per_thread;  // ROPE_HEADS: 1 .. 16
  int block_threads;     // ROPE_HEADS: 64, 128 or 256
  int flat_blocks;       // ROPE_FLAT: RopeFlatBlocks
  int vectors;           // ROPE_FLAT split: 16-byte vectors per thread (1, 2 or 4)
  int rows_on_the_fly;   // 1: every cos/sin row from freq_turns (needs freq_turns; not ROPE_LEAN)
  int pdl;               // launch with programmatic dependent launch (needs RopeDevice.pdl)
} RopeConfig;

// The policy's configuration for this call on this device. Returns 0, or -1 for invalid params.
int rope_choose(const RopeParams* p, const RopeDevice* dev, RopeConfig* out);

// Every configuration that can take the call, the policy's choice first: up to `capacity`
// written to `out`; returns how many there are (-1: invalid params).
int rope_candidates(const RopeParams* p, const RopeDevice* dev, RopeConfig* out, int capacity);

// A configuration as a readable label ("heads/pipe2/u4/t256", "flat/joint", "lean+nopdl", ...),
// written with its terminating zero into buf when it fits; returns its length.
int rope_config_label(const RopeConfig* c, char* buf, int size);
// The configuration a label names. Returns 0, or -1 for a label that names none.
int rope_parse_label(const char* label, RopeConfig* out);

// Whether `c` can take the call (rope_candidates lists exactly those). 1 or 0.
int rope_config_fits(const RopeParams* p, const RopeDevice* dev, const RopeConfig* c);

// Launch on `stream` with the policy's choice. Returns the launch error, cudaErrorInvalidValue for
// inconsistent parameters, cudaSuccess when there is nothing to do.
cudaError_t rope_launch(const RopeParams* p, const RopeDevice* dev, cudaStream_t stream);

// Launch with the given configuration (benchmark tooling); cudaErrorInvalidValue when it cannot
// take the call.
cudaError_t rope_launch_config(const RopeParams* p, const RopeDevice* dev, const RopeConfig* c,
                               cudaStream_t stream);

// The compute capability the kernels were compiled for on the current device (e.g. 90), or 0
// when the device cannot run them: programmatic dependent launch needs sm_90 code.
int rope_kernel_arch(void);

#ifdef __cplusplus
}
#endif
