// The shipped host glue (ascend_kernels/rope_host.cpp) compiled unchanged for the CPU, test-only:
// torch_npu's two headers are the stand-ins of this directory, the ops' impls are registered for
// CPU tensors as well, and every aclrtlaunch_* records its launch (kernel, block count, GM
// pointers, the tiling's address) instead of running on an NPU. tests/ascend/host_glue/__init__.py
// reads the records back, checks the tiling struct against the Python mirror and replays each
// launch in the CPU emulation of the kernels.
#include <torch/extension.h>

#include <cstdio>
#include <vector>

#include "rope_host.cpp"

namespace {

struct Launch {
    std::string kernel;
    uint32_t blockDim;
    std::vector<void*> args;  // the entry's GM pointers, the tiling last
};

std::vector<Launch>& launches() {
    static std::vector<Launch> all;
    return all;
}

uint32_t record(const char* kernel, uint32_t blockDim, std::vector<void*> args) {
    launches().push_back({kernel, blockDim, std::move(args)});
    return 0;
}

}  // namespace

#define RECORD_ROPE(NAME)                                                                         \
    extern "C" uint32_t aclrtlaunch_##NAME(uint32_t blockDim, void*, void* q, void* k, void* qOut, \
                                           void* kOut, void* pos, void* cos, void* sin, void* freq, \
                                           void* tiling) {                                         \
        return record(#NAME, blockDim, {q, k, qOut, kOut, pos, cos, sin, freq, tiling});          \
    }
RECORD_ROPE(rope_ops_rotary_embedding_fp32)
RECORD_ROPE(rope_ops_rotary_embedding_fp16)
RECORD_ROPE(rope_ops_rotary_embedding_bf16)
RECORD_ROPE(rope_ops_rotary_embedding_grad_fp32)
RECORD_ROPE(rope_ops_rotary_embedding_grad_fp16)
RECORD_ROPE(rope_ops_rotary_embedding_grad_bf16)

#define RECORD_PROLOGUE(NAME)                                                                          \
    extern "C" uint32_t aclrtlaunch_##NAME(uint32_t blockDim, void*, void* q, void* k, void* v,         \
                                           void* qOut, void* kOut, void* vOut, void* pos, void* cos,    \
                                           void* sin, void* freq, void* qWeight, void* kWeight,         \
                                           void* kCache, void* vCache, void* slots, void* tiling) {     \
        return record(#NAME, blockDim, {q, k, v, qOut, kOut, vOut, pos, cos, sin, freq, qWeight, kWeight, \
                                        kCache, vCache, slots, tiling});                                \
    }
RECORD_PROLOGUE(rope_ops_qkv_prologue_fp32)
RECORD_PROLOGUE(rope_ops_qkv_prologue_fp16)
RECORD_PROLOGUE(rope_ops_qkv_prologue_bf16)

#define RECORD_PROLOGUE_GRAD(NAME)                                                                        \
    extern "C" uint32_t aclrtlaunch_##NAME(uint32_t blockDim, void*, void* gradQ, void* gradK, void* gradV, \
                                           void* xq, void* xk, void* dq, void* dk, void* dv, void* pos,    \
                                           void* cos, void* sin, void* freq, void* qWeight, void* kWeight, \
                                           void* dqWeight, void* dkWeight, void* tiling) {                 \
        return record(#NAME, blockDim, {gradQ, gradK, gradV, xq, xk, dq, dk, dv, pos, cos, sin, freq,      \
                                        qWeight, kWeight, dqWeight, dkWeight, tiling});                    \
    }
RECORD_PROLOGUE_GRAD(rope_ops_qkv_prologue_grad_fp32)
RECORD_PROLOGUE_GRAD(rope_ops_qkv_prologue_grad_fp16)
RECORD_PROLOGUE_GRAD(rope_ops_qkv_prologue_grad_bf16)

// The NPU impls, for CPU tensors too.
TORCH_LIBRARY_IMPL(rope_ops_ascend, CPU, m) {
    m.impl("rotary_embedding", TORCH_FN(rotary_embedding_npu));
    m.impl("rotary_embedding_grad", TORCH_FN(rotary_embedding_grad_npu));
    m.impl("qkv_prologue", TORCH_FN(qkv_prologue_npu));
    m.impl("qkv_prologue_grad", TORCH_FN(qkv_prologue_grad_npu));
}

extern "C" {

int rope_host_launch_count() { return (int)launches().size(); }

// Launch i: its kernel's name into `name`, its block count, its pointers into args (at most
// maxArgs); returns the pointer count.
int rope_host_launch(int i, char* name, int nameLen, uint32_t* blockDim, void** args, int maxArgs) {
    const Launch& l = launches().at(i);
    std::snprintf(name, nameLen, "%s", l.kernel.c_str());
    *blockDim = l.blockDim;
    int n = (int)l.args.size() < maxArgs ? (int)l.args.size() : maxArgs;
    for (int j = 0; j < n; ++j) args[j] = l.args[j];
    return (int)l.args.size();
}

void rope_host_clear() { launches().clear(); }

}  // extern "C"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
