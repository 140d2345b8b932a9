// rope_ops: the shipped Ascend C kernels (ascend_kernels/kernels/*.cpp) compiled for the CPU against
// the emulated kernel_operator.h, with a C interface for the tests (ctypes). Build (rope_sim.py):
//   g++ -std=c++17 -O1 -ffp-contract=off -fPIC -shared -I tests/ascend/cpu_sim -I ascend_kernels
//       tests/ascend/cpu_sim/sim_main.cpp -o librope_sim.so
#include "kernel_operator.h"
#include "kernels/rotary_embedding_fp32.cpp"
#include "kernels/rotary_embedding_fp16.cpp"
#include "kernels/rotary_embedding_bf16.cpp"
#include "kernels/rotary_embedding_grad_fp32.cpp"
#include "kernels/rotary_embedding_grad_fp16.cpp"
#include "kernels/rotary_embedding_grad_bf16.cpp"
#include "kernels/qkv_prologue_fp32.cpp"
#include "kernels/qkv_prologue_fp16.cpp"
#include "kernels/qkv_prologue_bf16.cpp"
#include "kernels/qkv_prologue_grad_fp32.cpp"
#include "kernels/qkv_prologue_grad_fp16.cpp"
#include "kernels/qkv_prologue_grad_bf16.cpp"

#undef ROPE_KERNEL_SIDE
#include "rope_tiling.h"  // again, now with the host tiling

namespace {

typedef void (*RopeEntry)(GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR);
typedef void (*PrologueEntry)(GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR,
                              GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR);
typedef void (*PrologueGradEntry)(GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR,
                                  GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR);

const RopeEntry kRope[2][3] = {
    {rope_ops_rotary_embedding_fp32, rope_ops_rotary_embedding_fp16, rope_ops_rotary_embedding_bf16},
    {rope_ops_rotary_embedding_grad_fp32, rope_ops_rotary_embedding_grad_fp16, rope_ops_rotary_embedding_grad_bf16}};
const PrologueEntry kPrologue[3] = {rope_ops_qkv_prologue_fp32, rope_ops_qkv_prologue_fp16,
                                    rope_ops_qkv_prologue_bf16};
const PrologueGradEntry kPrologueGrad[3] = {rope_ops_qkv_prologue_grad_fp32, rope_ops_qkv_prologue_grad_fp16,
                                            rope_ops_qkv_prologue_grad_bf16};

// Entry arguments per kernel: 9 (rope), 16 (prologue), 17 (prologue grad).
void run_entry(int kernel, int dtype, GM_ADDR* a) {
    switch (kernel) {
        case 0:
        case 1:
            kRope[kernel][dtype](a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8]);
            break;
        case 2:
            kPrologue[dtype](a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13],
                             a[14], a[15]);
            break;
        default:
            kPrologueGrad[dtype](a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12],
                                 a[13], a[14], a[15], a[16]);
    }
}

}  // namespace

extern "C" {

int rope_sim_fields() { return ROPE_TILING_FIELDS; }

int rope_sim_tiling(RopeTiling* t, int64_t ubSize, int64_t coreNum) { return compute_rope_tiling(t, ubSize, coreNum); }

int rope_sim_sincos(int32_t top, float m, float* c, float* s) { rope_sincos_turns(top, m, c, s); return 0; }

// kernel: 0 RotaryEmbedding, 1 its grad, 2 the prologue, 3 its grad. dtype: 0 fp32, 1 fp16,
// 2 bf16. args: the entry's GM pointers (some null), the tiling last. regions: nRegions
// (pointer, bytes) pairs, the only memory the kernel may touch. stats out (8 int64): peak UB
// bytes, DataCopyPad calls, vector calls, scalar UB writes, DataCopy calls; per-region read/write
// bytes are written to regionStats (2 per region).
int rope_sim_launch(int kernel, int dtype, void** args, int64_t numBlocks, int64_t ubSize, void** regions,
                    const int64_t* regionBytes, int nRegions, int64_t* stats, int64_t* regionStats,
                    char* err, int errLen) {
    rope_sim::State& s = rope_sim::st();
    s.regions.clear();
    for (int i = 0; i < nRegions; ++i)
        s.regions.push_back({(uintptr_t)regions[i], (uintptr_t)regions[i] + (uintptr_t)regionBytes[i], 0, 0});
    s.ubPeak = 0; s.dataCopyPadCalls = 0; s.dataCopyCalls = 0; s.vectorCalls = 0; s.scalarUbWrites = 0;
    try {
        for (int64_t b = 0; b < numBlocks; ++b) {
            rope_sim::reset_core(b, numBlocks, (size_t)ubSize);
            run_entry(kernel, dtype, reinterpret_cast<GM_ADDR*>(args));
        }
    } catch (const std::exception& e) {
        std::snprintf(err, errLen, "core %lld: %s", (long long)s.blockIdx, e.what());
        return 1;
    }
    stats[0] = (int64_t)s.ubPeak; stats[1] = s.dataCopyPadCalls; stats[2] = s.vectorCalls; stats[3] = s.scalarUbWrites;
    stats[4] = s.dataCopyCalls;
    for (int i = 0; i < nRegions; ++i) { regionStats[2 * i] = s.regions[i].readBytes; regionStats[2 * i + 1] = s.regions[i].writeBytes; }
    return 0;
}

}  // extern "C"
