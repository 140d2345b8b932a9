// Generic family (ROPE_GENERIC): any strides (head_dim stride != 1 included), any even R, any D,
// no alignment. One item per pair (j < R/2) or per pass-through element, a grid-stride loop with
// 64-bit indices. Correct, not tuned: the policy sends here only what 16-byte vectors cannot
// take (odd rotary halves, misaligned or strided head_dim).
#pragma once

#include "angle_sources.cuh"

namespace rope_ops_cuda {
namespace {

constexpr int kGenericThreads = 256;

template <typename T, bool NEOX, class Angles>
ROPE_HD void generic_item(const RopeParams& p, const long long per_head, const long long gid) {
  const long long half = p.R >> 1;
  const long long Ht = p.Hq + p.Hk;
  {
    const long long j = gid % per_head;
    const long long t = gid / per_head;
    const long long h = t % Ht;
    const long long tok = t / Ht;
    const long long b = tok / p.S;
    const long long s = tok - b * p.S;
    const bool isq = h < p.Hq;
    const T* src;
    T* dst;
    long long sd, od;
    if (isq) {
      src = static_cast<const T*>(p.q) + b * p.q_stride[0] + s * p.q_stride[1] + h * p.q_stride[2];
      dst = static_cast<T*>(p.q_out) + b * p.q_out_stride[0] + s * p.q_out_stride[1] +
            h * p.q_out_stride[2];
      sd = p.q_stride[3];
      od = p.q_out_stride[3];
    } else {
      const long long hk = h - p.Hq;
      src = static_cast<const T*>(p.k) + b * p.k_stride[0] + s * p.k_stride[1] + hk * p.k_stride[2];
      dst = static_cast<T*>(p.k_out) + b * p.k_out_stride[0] + s * p.k_out_stride[1] +
            hk * p.k_out_stride[2];
      sd = p.k_stride[3];
      od = p.k_out_stride[3];
    }
    if (j < half) {
      const long long ia = NEOX ? j : 2 * j;
      const long long ib = NEOX ? j + half : 2 * j + 1;
      const float x = to_f32(src[ia * sd]);
      const float y = to_f32(src[ib * sd]);
      float c, sn;
      Angles::template cos_sin<1>(p, Angles::token(p, b, s), j, &c, &sn);
      dst[ia * od] = from_f32<T>(fmaf(x, c, -y * sn));
      dst[ib * od] = from_f32<T>(fmaf(y, c, x * sn));
    } else {
      const long long d = p.R + (j - half);
      dst[d * od] = src[d * sd];
    }
  }
}

template <typename T, bool NEOX, class Angles>
__global__ void __launch_bounds__(kGenericThreads)
    rope_generic_kernel(const __grid_constant__ RopeParams p, const long long per_head,
                        const long long total) {
  wait_for_previous_grid();
  for (long long gid = (long long)blockIdx.x * kGenericThreads + threadIdx.x; gid < total;
       gid += (long long)gridDim.x * kGenericThreads)
    generic_item<T, NEOX, Angles>(p, per_head, gid);
}

// ------------------------------------------------------------------------------------------------
// host side

struct GenericPlan {
  int64_t per_head, total, blocks;
};

// A grid-stride loop capped at 16 blocks per SM.
inline GenericPlan plan_generic(const RopeParams& p, const int sms) {
  GenericPlan g;
  g.per_head = p.R / 2 + ((p.copy_passthrough && p.D > p.R) ? p.D - p.R : 0);
  g.total = p.B * p.S * (p.Hq + p.Hk) * g.per_head;
  g.blocks = (g.total + kGenericThreads - 1) / kGenericThreads;
  const int64_t cap = (int64_t)sms * 16;
  if (g.blocks > cap) g.blocks = cap;
  return g;
}

}  // namespace
}  // namespace rope_ops_cuda
