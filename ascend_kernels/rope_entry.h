// rope_ops Ascend C kernels: the kernel entry macros. Each file in kernels/ instantiates one entry
// (ascendc_library wants one kernel entry per source file). An entry reads the angle source from
// its tiling (angleKind) and runs the kernel with that cos/sin source (RunWithSource,
// rope_kernel.h), so a new source is one more branch there, not a new entry.
#ifndef ROPE_OPS_ASCEND_ROPE_ENTRY_H
#define ROPE_OPS_ASCEND_ROPE_ENTRY_H

#include "prologue_kernel.h"

#if defined(KERNEL_TASK_TYPE_DEFAULT)
#define ROPE_AIV_ONLY() KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY)
#else
#define ROPE_AIV_ONLY()
#endif

// RotaryEmbedding (INVERSE false) or RotaryEmbeddingGrad (true) for element type T.
#define ROPE_ENTRY(NAME, T, INVERSE)                                                                \
    extern "C" __global__ __aicore__ void NAME(GM_ADDR q, GM_ADDR k, GM_ADDR qOut, GM_ADDR kOut,   \
                                               GM_ADDR pos, GM_ADDR cos, GM_ADDR sin,              \
                                               GM_ADDR freq, GM_ADDR tiling)                       \
    {                                                                                              \
        ROPE_AIV_ONLY();                                                                           \
        rope_ops_ascend::RopeGm gm{q, k, qOut, kOut, {pos, cos, sin, freq}, tiling};               \
        rope_ops_ascend::RunWithSource<rope_ops_ascend::RopeKernels<T, INVERSE>>(gm);              \
    }

// The fused prologue's forward for element type T (prologue_kernel.h).
#define ROPE_PROLOGUE_ENTRY(NAME, T)                                                                \
    extern "C" __global__ __aicore__ void NAME(GM_ADDR q, GM_ADDR k, GM_ADDR v, GM_ADDR qOut,      \
                                               GM_ADDR kOut, GM_ADDR vOut, GM_ADDR pos, GM_ADDR cos,  \
                                               GM_ADDR sin, GM_ADDR freq, GM_ADDR qWeight,         \
                                               GM_ADDR kWeight, GM_ADDR kCache, GM_ADDR vCache,    \
                                               GM_ADDR slots, GM_ADDR tiling)                      \
    {                                                                                              \
        ROPE_AIV_ONLY();                                                                           \
        rope_ops_ascend::PrologueGm gm{q, k, v, qOut, kOut, vOut, {pos, cos, sin, freq},           \
                                       qWeight, kWeight, kCache, vCache, slots, tiling};           \
        rope_ops_ascend::RunWithSource<rope_ops_ascend::PrologueKernels<T>>(gm);                   \
    }

// The fused prologue's backward for element type T.
#define ROPE_PROLOGUE_GRAD_ENTRY(NAME, T)                                                           \
    extern "C" __global__ __aicore__ void NAME(GM_ADDR gradQ, GM_ADDR gradK, GM_ADDR gradV,        \
                                               GM_ADDR xq, GM_ADDR xk, GM_ADDR dq, GM_ADDR dk,     \
                                               GM_ADDR dv, GM_ADDR pos, GM_ADDR cos, GM_ADDR sin,  \
                                               GM_ADDR freq, GM_ADDR qWeight, GM_ADDR kWeight,     \
                                               GM_ADDR dqWeight, GM_ADDR dkWeight, GM_ADDR tiling) \
    {                                                                                              \
        ROPE_AIV_ONLY();                                                                           \
        rope_ops_ascend::PrologueGradGm gm{gradQ, gradK, gradV, xq, xk, dq, dk, dv,                \
                                           {pos, cos, sin, freq}, qWeight, kWeight, dqWeight,      \
                                           dkWeight, tiling};                                      \
        rope_ops_ascend::RunWithSource<rope_ops_ascend::PrologueGradKernels<T>>(gm);               \
    }

#endif  // ROPE_OPS_ASCEND_ROPE_ENTRY_H
