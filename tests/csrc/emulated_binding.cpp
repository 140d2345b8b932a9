// Test only: the CUDA backend's extension module (csrc/rope_torch.h) on CPU tensors, its kernels
// run by the host emulation (rope_emulation.cu, linked in). Everything between rope_ops and the
// kernels is the product's own code: KernelArgs reading, RopeParams, output allocation, the
// kernel choice and candidates, BoundRope, GuardedRope and the C++ autograd.
#include <ATen/EmptyTensor.h>

#include "prologue_torch.h"
#include "rope_torch.h"

namespace {

struct CpuPlatform {
  static constexpr c10::DispatchKey kKey = c10::DispatchKey::CPU;

  static bool on_device(const at::Tensor& t) { return t.is_cpu(); }

  // The choice is made for an H200's properties.
  struct Scope {
    RopeDevice dev{132, 9, 50 << 20, 1};
    cudaStream_t stream = nullptr;
    explicit Scope(const at::Tensor&) {}
  };

  static at::Tensor empty_strided(at::IntArrayRef sizes, at::IntArrayRef strides,
                                  at::ScalarType dtype, at::Device) {
    return at::detail::empty_strided_cpu(sizes, strides, dtype);
  }

  static at::Tensor empty_bytes(int64_t n, at::Device) {
    return at::detail::empty_cpu({n}, at::kByte, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  rope_torch::define_module<CpuPlatform>(m);
  rope_torch::define_prologue<CpuPlatform>(m);
}
