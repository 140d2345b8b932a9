// rope_ops CUDA kernels: the launches, and with them the C API of rope.h (rope_c_api.h). The
// kernels are in kernel_*.cuh, which kernel runs a call in policy.h. Needs only the CUDA runtime headers, so CI compiles it
// with plain nvcc (csrc/check_compile.sh). Do not compile with --use_fast_math.
#include "dispatch.h"
#include "kernel_prologue.cuh"

namespace rope_ops_cuda {
namespace {

// Launches `kernel` on `stream` over `grid` blocks with `smem` bytes of dynamic shared memory;
// with pdl, with programmatic stream serialization (sm_90+: the grid may be scheduled before the
// previous kernel in the stream has finished; the kernels wait for it in wait_for_previous_grid
// before touching memory).
template <typename... Params, typename... Args>
cudaError_t launch_kernel_grid(void (*kernel)(Params...), dim3 grid, int threads, int smem, bool pdl,
                               cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3((unsigned)threads);
  cfg.dynamicSmemBytes = (size_t)smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, args...);
  return err != cudaSuccess ? err : cudaGetLastError();
}

template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), int64_t blocks, int threads, bool pdl,
                          cudaStream_t stream, Args... args) {
  return launch_kernel_grid(kernel, dim3((unsigned)blocks), threads, 0, pdl, stream, args...);
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

  template <typename T, bool NEOX, int VB, int U, class A>
  cudaError_t prologue(const RopePrologueParams& p, const ProloguePlan& plan) {
    return launch_kernel_grid(rope_prologue_kernel<T, NEOX, VB, U, A>,
                              dim3((unsigned)plan.blocks, (unsigned)plan.splits), kPrologueThreads,
                              plan.smem_bytes, pdl, stream, p, plan.sh);
  }

  template <typename T, bool NEOX, int VB, int U, class A>
  cudaError_t prologue_backward(const RopePrologueParams& p, const ProloguePlan& plan) {
    return launch_kernel_grid(rope_prologue_backward_kernel<T, NEOX, VB, U, A>, dim3((unsigned)plan.blocks),
                              kPrologueThreads, plan.smem_bytes, pdl, stream, p, plan.sh);
  }

  cudaError_t prologue_weight_grads(const RopePrologueParams& p, int64_t rows) {
    const unsigned cols = (unsigned)((p.rope.D + kWeightGradCols - 1) / kWeightGradCols);
    return launch_kernel_grid(rope_prologue_weight_grad_kernel, dim3(cols, 2),
                              kWeightGradCols * kWeightGradRowLanes, 0, pdl, stream, p, rows);
  }
};

inline Launcher make_executor(cudaStream_t stream, bool pdl) { return Launcher{stream, pdl}; }

}  // namespace
}  // namespace rope_ops_cuda

#include "rope_c_api.h"
#include "prologue_c_api.h"

extern "C" int rope_kernel_arch(void) {
  using namespace rope_ops_cuda;
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, rope_generic_kernel<float, true, TableAngles>) != cudaSuccess) {
    cudaGetLastError();  // clear it: the caller only wants to know
    return 0;
  }
  return attr.binaryVersion;
}
