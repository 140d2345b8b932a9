// rope_ops CUDA kernels: the C launch API of the fused attention prologue (rope_ops.qkv_prologue:
// QKV split + per-head RMSNorm + RoPE + KV-cache write), CUDA runtime headers only.
//
// Input qkv [B, S, W] (thd: B = 1) with stride 1 along W = (Hq + 2 Hk) * D, any token strides;
// its heads are q (Hq), k (Hk), v (Hk). Per q and k head: RMSNorm with float32 statistics,
// x * (1 / sqrt(mean(x^2) + eps)) * (weight_offset + w) where that head kind's weight is given,
// then the rotation of rope.h (RopeParams' angle fields; R == 0: no rotation). float32 math, one
// rounding to the output dtype; a float8 e4m3 cache (and q, with q_scale) holds value / scale
// rounded once, saturated to +-448 (NaN stays NaN). The backward gives grad_qkv and the weights'
// gradients: per-block partial sums, then added up in a fixed order (deterministic).
#pragma once

#include <stdint.h>
#include <cuda_runtime_api.h>

#include "rope.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct RopePrologueParams {
  // Angles, sizes and dtype: rope.B, rope.S (tokens), rope.D, rope.R (0: no rotation),
  // rope.interleaved, rope.dtype, positions and tables as for rope_launch; rope.inverse is set by
  // the backward. The data fields of rope (q, k, their strides, Hq, Hk) are not read.
  RopeParams rope;
  const void* qkv;
  int64_t qkv_stride_b, qkv_stride_s;  // element strides of the [B, S] tokens
  int64_t Hq, Hk;
  // Forward outputs q, k, v: (b, s, h) element strides, stride 1 along D. In place: q and k
  // rows are written into qkv (out ignored) and v is untouched.
  int inplace;
  void* out[3];
  int64_t out_stride[3][3];
  // > 0 (out of place only): out[0] is float8 e4m3 holding q / q_scale, rounded as the float8
  // cache is; 0: q of qkv's dtype.
  float q_scale;
  // RMSNorm weights: contiguous [D], 16-byte aligned, float32 or (weights_like_qkv) qkv's dtype;
  // null: that norm off.
  const void* q_weight;
  const void* k_weight;
  int weights_like_qkv;
  float eps, weight_offset;
  // KV cache (forward, optional): [num_slots, Hk, D] with (slot, head) element strides and
  // stride 1 along D; slot(b, s) outside [0, num_slots) is skipped. Same dtype as qkv, or float8
  // e4m3 (cache_fp8) holding value / scale.
  void* k_cache;
  void* v_cache;
  int64_t k_cache_stride[2], v_cache_stride[2];
  int64_t num_slots;
  const void* slots;
  int slots_kind;  // ROPE_POS_I32 or ROPE_POS_I64
  int64_t slots_stride_b, slots_stride_s;
  int cache_fp8;
  float k_scale, v_scale;
  // Backward: output gradients of q, k, v ((b, s, h) strides, stride 1 along D; null: zero),
  // grad_qkv like qkv, and the weights' partial gradients [blocks, D] float32
  // (rope_prologue_backward_blocks rows; null where that weight is null).
  const void* grad[3];
  int64_t grad_stride[3][3];
  void* grad_qkv;
  int64_t grad_qkv_stride_b, grad_qkv_stride_s;
  float* q_weight_partials;
  float* k_weight_partials;
  // The weights' gradients [D] float32, the partial rows added up by a second launch (null: left
  // as partial sums, where that weight's partials are given).
  float* q_weight_grad;
  float* k_weight_grad;
} RopePrologueParams;

// 1 when the prologue kernels can take the call (vectors or single elements, head rows of at
// most 128 units per group of lanes), else 0: the caller computes it otherwise.
int rope_prologue_fits(const RopePrologueParams* p);

// Rows of the backward's partial weight-gradient buffers (its blocks) on this device; 0 when
// the kernels cannot take the call.
int64_t rope_prologue_backward_blocks(const RopePrologueParams* p, const RopeDevice* dev);

// Forward / backward on `stream`. cudaErrorNotSupported: the kernels cannot take the call;
// cudaErrorInvalidValue: inconsistent parameters; cudaSuccess with no tokens.
cudaError_t rope_prologue_launch(const RopePrologueParams* p, const RopeDevice* dev,
                                 cudaStream_t stream);
cudaError_t rope_prologue_backward_launch(const RopePrologueParams* p, const RopeDevice* dev,
                                          cudaStream_t stream);

#ifdef __cplusplus
}
#endif
