// The C API of rope.h (rope_launch, rope_choose, ...) over dispatch.h, for the translation unit
// that includes it after defining, in namespace rope_ops_cuda,
//   Executor make_executor(cudaStream_t stream, bool pdl);
// rope_launch.cu's executor launches the kernels; the tests' host emulation (tests/csrc/) runs
// every would-be thread on the CPU. rope_kernel_arch is each one's own. It defines the
// functions: include it in one translation unit only.
#pragma once

#include "dispatch.h"

extern "C" int rope_choose(const RopeParams* p, const RopeDevice* dev, RopeConfig* out) {
  if (!rope_ops_cuda::params_ok(*p)) return -1;
  *out = rope_ops_cuda::choose(*p, *dev);
  return 0;
}

extern "C" int rope_candidates(const RopeParams* p, const RopeDevice* dev, RopeConfig* out,
                               int capacity) {
  if (!rope_ops_cuda::params_ok(*p)) return -1;
  int n = 0;
  rope_ops_cuda::list_candidates(*p, *dev, [&](const RopeConfig& c) {
    if (n < capacity) out[n] = c;
    ++n;
  });
  return n;
}

extern "C" int rope_config_label(const RopeConfig* c, char* buf, int size) {
  return rope_ops_cuda::config_label(*c, buf, size);
}

extern "C" int rope_parse_label(const char* label, RopeConfig* out) {
  return rope_ops_cuda::parse_label(label, *out) ? 0 : -1;
}

extern "C" int rope_config_fits(const RopeParams* p, const RopeDevice* dev, const RopeConfig* c) {
  return rope_ops_cuda::config_fits(*p, *dev, *c) ? 1 : 0;
}

extern "C" cudaError_t rope_launch_config(const RopeParams* p, const RopeDevice* dev,
                                          const RopeConfig* c, cudaStream_t stream) {
  if (!rope_ops_cuda::config_fits(*p, *dev, *c)) return cudaErrorInvalidValue;
  auto exec = rope_ops_cuda::make_executor(stream, c->pdl != 0);
  return rope_ops_cuda::run_config(*p, *dev, *c, exec);
}

extern "C" cudaError_t rope_launch(const RopeParams* p, const RopeDevice* dev, cudaStream_t stream) {
  if (!rope_ops_cuda::params_ok(*p)) return cudaErrorInvalidValue;
  const RopeConfig c = rope_ops_cuda::choose(*p, *dev);
  auto exec = rope_ops_cuda::make_executor(stream, c.pdl != 0);
  return rope_ops_cuda::run_config(*p, *dev, c, exec);
}
