// From a RopeConfig to the kernel template that runs it, for an executor: rope_launch.cu's
// launches kernels on a stream; the tests' host emulation (tests/csrc/) runs every would-be
// thread of the same kernels serially on the CPU. An executor has, for each family,
//   template <...kernel template arguments...> cudaError_t family(const RopeParams&, plan, fly)
// (see Launcher in rope_launch.cu).
#pragma once

#include "candidates.h"

namespace rope_ops_cuda {
namespace {

template <typename T, bool NEOX, class Angles, int VB, class Exec>
cudaError_t run_heads(const RopeParams& p, const RopeConfig& c, Exec& exec) {
  const HeadsPlan plan = plan_heads(p, VecInfo<T, VB>::kVec, NEOX, c.heads_per_thread, c.block_threads);
  const bool fly = c.rows_on_the_fly != 0;
  if (plan.hl >= p.Hq + p.Hk)  // one head per thread: the kernel with the fewest registers
    return exec.template heads<T, NEOX, SCHED_ROUNDS, 1, HINT_STREAM, Angles, VB>(p, plan, fly);
  if (c.schedule == ROPE_ROUNDS4_PLAIN)
    return exec.template heads<T, NEOX, SCHED_ROUNDS, 4, HINT_PLAIN, Angles, VB>(p, plan, fly);
  return exec.template heads<T, NEOX, SCHED_PIPE, 2, HINT_STREAM_ST, Angles, VB>(p, plan, fly);
}

template <typename T, bool NEOX, class Angles, class Exec>
cudaError_t run_every_family(const RopeParams& p, const RopeDevice& dev, const RopeConfig& c, Exec& exec) {
  constexpr int V = VecInfo<T>::kVec;
  const bool fly = c.rows_on_the_fly != 0;
  switch (c.family) {
    case ROPE_HEADS:
      if (c.vector_bytes == 8) return run_heads<T, NEOX, Angles, 8>(p, c, exec);
      return run_heads<T, NEOX, Angles, 16>(p, c, exec);
    case ROPE_FLAT: {
      const FlatPlan plan = plan_flat<Angles>(p, V, c.flat_blocks, c.vectors);
      const int u = plan.vectors_per_thread;
      if (c.flat_blocks == ROPE_FLAT_SPLIT) {
        if (u == 1) return exec.template flat<T, NEOX, 1, ROPE_FLAT_SPLIT, Angles>(p, plan, fly);
        if (u == 2) return exec.template flat<T, NEOX, 2, ROPE_FLAT_SPLIT, Angles>(p, plan, fly);
        return exec.template flat<T, NEOX, 4, ROPE_FLAT_SPLIT, Angles>(p, plan, fly);
      }
      if (c.flat_blocks == ROPE_FLAT_JOINT) {
        if (u <= 2) return exec.template flat<T, NEOX, 2, ROPE_FLAT_JOINT, Angles>(p, plan, fly);
        if (u <= 4) return exec.template flat<T, NEOX, 4, ROPE_FLAT_JOINT, Angles>(p, plan, fly);
        if (u <= 6) return exec.template flat<T, NEOX, 6, ROPE_FLAT_JOINT, Angles>(p, plan, fly);
        return exec.template flat<T, NEOX, 8, ROPE_FLAT_JOINT, Angles>(p, plan, fly);
      }
      if (u <= 1) return exec.template flat<T, NEOX, 1, ROPE_FLAT_SEPARATE, Angles>(p, plan, fly);
      if (u <= 2) return exec.template flat<T, NEOX, 2, ROPE_FLAT_SEPARATE, Angles>(p, plan, fly);
      if (u <= 4) return exec.template flat<T, NEOX, 4, ROPE_FLAT_SEPARATE, Angles>(p, plan, fly);
      return exec.template flat<T, NEOX, 8, ROPE_FLAT_SEPARATE, Angles>(p, plan, fly);
    }
    case ROPE_LEAN: {
      if constexpr (NEOX) {
        const LeanShape f = plan_lean(p, V);
        const int64_t blocks = p.B * p.S * (f.both ? 2 : 1);
        const int64_t most = (p.Hq > p.Hk ? p.Hq : p.Hk) << f.vpr_log2;
        const int64_t u = (most + kLeanThreads - 1) / kLeanThreads;
        if (u <= 1) return exec.template lean<T, 1, Angles>(p, f, blocks);
        if (u <= 2) return exec.template lean<T, 2, Angles>(p, f, blocks);
        if (u <= 4) return exec.template lean<T, 4, Angles>(p, f, blocks);
        return exec.template lean<T, 8, Angles>(p, f, blocks);
      }
      return cudaErrorInvalidValue;
    }
    case ROPE_ROWS:
      return exec.template rows<T, NEOX, Angles>(p, plan_rows(p, V), fly);
    case ROPE_GENERIC:
      return exec.template generic<T, NEOX, Angles>(p, plan_generic(p, dev.num_sms > 0 ? dev.num_sms : 132));
    case ROPE_NOTHING:
      return cudaSuccess;
    default:
      return cudaErrorInvalidValue;
  }
}

template <typename T, bool NEOX, class Angles, class Exec>
cudaError_t run_typed(const RopeParams& p, const RopeDevice& dev, const RopeConfig& c, Exec& exec) {
  // Sources built for two families only (angle_sources.cuh): nothing else is instantiated.
  if constexpr (!Angles::kEveryFamily) {
    if (c.family == ROPE_HEADS && c.vector_bytes == 16) return run_heads<T, NEOX, Angles, 16>(p, c, exec);
    if (c.family == ROPE_GENERIC)
      return exec.template generic<T, NEOX, Angles>(p, plan_generic(p, dev.num_sms > 0 ? dev.num_sms : 132));
    return cudaErrorInvalidValue;
  } else {
    return run_every_family<T, NEOX, Angles>(p, dev, c, exec);
  }
}

template <typename T, class Angles, class Exec>
cudaError_t run_style(const RopeParams& p, const RopeDevice& dev, const RopeConfig& c, Exec& exec) {
  return p.interleaved ? run_typed<T, false, Angles>(p, dev, c, exec)
                       : run_typed<T, true, Angles>(p, dev, c, exec);
}

// Runs configuration c on exec; c must fit the call (choose()'s does, others: config_fits).
template <class Exec>
cudaError_t run_config(const RopeParams& p, const RopeDevice& dev, const RopeConfig& c, Exec& exec) {
  if (c.family == ROPE_NOTHING) return cudaSuccess;
  return with_angles(p, [&](auto angles) {
    using A = decltype(angles);
    switch (p.dtype) {
      case ROPE_F32:
        return run_style<float, A>(p, dev, c, exec);
      case ROPE_F16:
        return run_style<__half, A>(p, dev, c, exec);
      default:
        return run_style<__nv_bfloat16, A>(p, dev, c, exec);
    }
  });
}

}  // namespace
}  // namespace rope_ops_cuda
