// The CUDA backend's extension module: rope_torch.h on CUDA tensors (the kernels' C API in
// rope.h, launched on the current stream of q's device). Built by rope_ops_backends.cuda_backend
// through backends/_build.py. rope_ops validated every call already; the checks here guard
// against misuse of the module on its own (they never look at data and never synchronize).
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <mutex>

#include "prologue_torch.h"
#include "rope_torch.h"

namespace {

// What the kernel choice reads of a device, once per device: multiprocessors, compute capability,
// L2 size, and whether programmatic dependent launch is possible (sm_90 and kernels built for it).
RopeDevice device_properties(int device) {
  static std::array<RopeDevice, 64> known{};
  static std::array<std::atomic<bool>, 64> ready{};
  static std::mutex lock;
  if (device >= 0 && device < 64 && ready[device].load(std::memory_order_acquire)) return known[device];
  RopeDevice d{};
  int l2 = 0;
  TORCH_CHECK(cudaDeviceGetAttribute(&d.num_sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
                  cudaDeviceGetAttribute(&d.cc_major, cudaDevAttrComputeCapabilityMajor, device) ==
                      cudaSuccess &&
                  cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) == cudaSuccess,
              "rope_ops_cuda: cannot read the properties of device ", device);
  d.l2_bytes = l2;
  d.pdl = d.cc_major >= 9 && rope_kernel_arch() >= 90 ? 1 : 0;  // q's device is current here
  if (device >= 0 && device < 64) {
    std::lock_guard<std::mutex> hold(lock);
    known[device] = d;
    ready[device].store(true, std::memory_order_release);
  }
  return d;
}

struct CudaPlatform {
  static constexpr c10::DispatchKey kKey = c10::DispatchKey::CUDA;

  static bool on_device(const at::Tensor& t) { return t.is_cuda(); }

  // q's device made current (a guard only when it is not: the usual case costs nothing), its
  // properties and current stream.
  struct Scope {
    std::optional<c10::cuda::CUDAGuard> guard;
    RopeDevice dev;
    cudaStream_t stream;

    explicit Scope(const at::Tensor& q) {
      const int device = q.get_device();
      if (device != c10::cuda::current_device()) guard.emplace(q.device());
      dev = device_properties(device);
      stream = c10::cuda::getCurrentCUDAStream(device).stream();
    }
  };

  // Straight from the CUDA caching allocator: the dispatcher round trip of empty_like costs
  // ~2-3 us per output on slow host CPUs.
  static at::Tensor empty_strided(at::IntArrayRef sizes, at::IntArrayRef strides,
                                  at::ScalarType dtype, at::Device device) {
    return at::detail::empty_strided_cuda(sizes, strides, dtype, device);
  }

  static at::Tensor empty_bytes(int64_t n, at::Device device) {
    return at::detail::empty_cuda({n}, at::kByte, device, std::nullopt);
  }
};

}  // namespace

#ifndef TORCH_EXTENSION_NAME  // defined by torch.utils.cpp_extension; for the syntax check only
#define TORCH_EXTENSION_NAME rope_ops_cuda_ext
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  rope_torch::define_module<CudaPlatform>(m);
  rope_torch::define_prologue<CudaPlatform>(m);
}
