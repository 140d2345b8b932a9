// rope_ops CUDA kernels: the launches and the C API of rope.h. The kernels are in kernel_*.cuh,
// which kernel runs a call in policy.h. Needs only the CUDA runtime headers, so CI compiles it
// with plain nvcc (csrc/check_compile.sh). Do not compile with --use_fast_math.
#include "dispatch.h"

namespace rope_ops_cuda {
namespace {

// Launches `kernel` on `stream`; with pdl, with programmatic stream serialization (sm_90+: the
// grid may be scheduled before the previous kernel in the stream has finished; the kernels wait
// for it in wait_for_previous_grid before touching memory).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), int64_t blocks, int threads, bool pdl,
                          cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)blocks);
  cfg.blockDim = dim3((unsigned)threads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, args...);
  return err != cudaSuccess ? err : cudaGetLastError();
}

// The executor of dispatch.h that launches the kernels.
struct Launcher {
  cudaStream_t stream;
  bool pdl;

  template <typename T, bool NEOX, int SCHED, int ST, int HINT, class A, int VB>
  cudaError_t heads(const RopeParams& p, const HeadsPlan& f, const bool fly) {
    return launch_kernel(rope_heads_kernel<T, NEOX, SCHED, ST, HINT, A, VB>, f.blocks, f.threads, pdl,
                         stream, p, (int)f.CR, (int)f.CT, (int)f.hl, (long long)f.total, fly ? 1 : 0);
  }

  template <typename T, bool NEOX, int U, int BLOCKS, class A>
  cudaError_t flat(const RopeParams& p, const FlatPlan& f, const bool fly) {
    if constexpr (BLOCKS == ROPE_FLAT_SPLIT)
      return launch_kernel(rope_flat_split_kernel<T, NEOX, U, A>, f.blocks, kFlatThreads, pdl, stream,
                           p, f.f, fly ? 1 : 0, f.split);
    else
      return launch_kernel(rope_flat_kernel<T, NEOX, U, BLOCKS, A>, f.blocks, kFlatThreads, pdl,
                           stream, p, f.f, fly ? 1 : 0);
  }

  template <typename T, int U, class A>
  cudaError_t lean(const RopeParams& p, const LeanShape& f, const int64_t blocks) {
    return launch_kernel(rope_lean_kernel<T, U, A>, blocks, kLeanThreads, pdl, stream, p, f);
  }

  template <typename T, bool NEOX, class A>
  cudaError_t rows(const RopeParams& p, const RowsPlan& f, const bool fly) {
    return launch_kernel(rope_rows_kernel<T, NEOX, A>, f.blocks, kRowsThreads, pdl, stream, p, f.f,
                         fly ? 1 : 0);
  }

  template <typename T, bool NEOX, class A>
  cudaError_t generic(const RopeParams& p, const GenericPlan& f) {
    return launch_kernel(rope_generic_kernel<T, NEOX, A>, f.blocks, kGenericThreads, pdl, stream, p,
                         (long long)f.per_head, (long long)f.total);
  }
};

}  // namespace
}  // namespace rope_ops_cuda

using namespace rope_ops_cuda;

extern "C" int rope_choose(const RopeParams* p, const RopeDevice* dev, RopeConfig* out) {
  if (!params_ok(*p)) return -1;
  *out = choose(*p, *dev);
  return 0;
}

extern "C" int rope_candidates(const RopeParams* p, const RopeDevice* dev, RopeConfig* out,
                               int capacity) {
  if (!params_ok(*p)) return -1;
  int n = 0;
  list_candidates(*p, *dev, [&](const RopeConfig& c) {
    if (n < capacity) out[n] = c;
    ++n;
  });
  return n;
}

extern "C" int rope_config_label(const RopeConfig* c, char* buf, int size) {
  return config_label(*c, buf, size);
}

extern "C" int rope_parse_label(const char* label, RopeConfig* out) {
  return parse_label(label, *out) ? 0 : -1;
}

extern "C" int rope_config_fits(const RopeParams* p, const RopeDevice* dev, const RopeConfig* c) {
  return config_fits(*p, *dev, *c) ? 1 : 0;
}

extern "C" cudaError_t rope_launch_config(const RopeParams* p, const RopeDevice* dev,
                                          const RopeConfig* c, cudaStream_t stream) {
  if (!config_fits(*p, *dev, *c)) return cudaErrorInvalidValue;
  Launcher launcher{stream, c->pdl != 0};
  return run_config(*p, *dev, *c, launcher);
}

extern "C" cudaError_t rope_launch(const RopeParams* p, const RopeDevice* dev, cudaStream_t stream) {
  if (!params_ok(*p)) return cudaErrorInvalidValue;
  const RopeConfig c = choose(*p, *dev);
  Launcher launcher{stream, c.pdl != 0};
  return run_config(*p, *dev, c, launcher);
}

extern "C" int rope_kernel_arch(void) {
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, rope_generic_kernel<float, true, TableAngles>) != cudaSuccess) {
    cudaGetLastError();  // clear it: the caller only wants to know
    return 0;
  }
  return attr.binaryVersion;
}
