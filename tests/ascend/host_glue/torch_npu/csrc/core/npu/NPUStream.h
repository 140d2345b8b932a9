// Test-only stand-in for torch_npu's NPUStream.h: what ascend_kernels/rope_host.cpp uses of it, so
// the shipped host glue compiles and runs on the CPU (tests/ascend/host_glue).
#pragma once
#include <c10/core/Device.h>

namespace c10_npu {

struct NPUStream {
    int64_t id() const { return 0; }
    void* stream(bool) const { return nullptr; }
};

inline NPUStream getCurrentNPUStream(c10::DeviceIndex = -1) { return NPUStream{}; }

}  // namespace c10_npu
