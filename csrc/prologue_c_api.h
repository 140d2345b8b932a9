// The C API of prologue.h over kernel_prologue.cuh's dispatch, for the translation unit that
// includes it after defining, in namespace rope_ops_cuda,
//   Executor make_executor(cudaStream_t stream, bool pdl);
// whose executor has prologue<T, NEOX, VB, U, Angles>(p, plan) and prologue_backward<...>(p, plan)
// (rope_launch.cu launches them; the tests' host emulation runs them on the CPU). It defines the
// functions: include it in one translation unit only.
#pragma once

#include "kernel_prologue.cuh"

extern "C" int rope_prologue_fits(const RopePrologueParams* p) {
  rope_ops_cuda::ProloguePlan plan;
  const RopeDevice dev{132, 9, 0, 0};  // the plan's fit does not depend on the device
  return rope_ops_cuda::prologue_params_ok(*p) && rope_ops_cuda::plan_prologue(*p, dev, false, plan) ? 1 : 0;
}

extern "C" int64_t rope_prologue_backward_blocks(const RopePrologueParams* p, const RopeDevice* dev) {
  rope_ops_cuda::ProloguePlan plan;
  if (!rope_ops_cuda::prologue_params_ok(*p) || !rope_ops_cuda::plan_prologue(*p, *dev, true, plan)) return 0;
  return plan.blocks;
}

extern "C" cudaError_t rope_prologue_launch(const RopePrologueParams* p, const RopeDevice* dev,
                                            cudaStream_t stream) {
  auto exec = rope_ops_cuda::make_executor(stream, dev->pdl != 0);
  return rope_ops_cuda::run_prologue(*p, *dev, false, exec);
}

extern "C" cudaError_t rope_prologue_backward_launch(const RopePrologueParams* p, const RopeDevice* dev,
                                                     cudaStream_t stream) {
  auto exec = rope_ops_cuda::make_executor(stream, dev->pdl != 0);
  return rope_ops_cuda::run_prologue(*p, *dev, true, exec);
}
