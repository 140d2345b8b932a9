// rope_ops Ascend C kernels: the kernel entry macro. Each file in kernels/ instantiates one entry
// (ascendc_library wants one kernel entry per source file).
#ifndef ROPE_OPS_ASCEND_ROPE_ENTRY_H
#define ROPE_OPS_ASCEND_ROPE_ENTRY_H

#include "rope_kernel.h"

#if defined(KERNEL_TASK_TYPE_DEFAULT)
#define ROPE_AIV_ONLY() KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY)
#else
#define ROPE_AIV_ONLY()
#endif

#define ROPE_ENTRY(NAME, T, INVERSE)                                                              \
    extern "C" __global__ __aicore__ void NAME(GM_ADDR q, GM_ADDR k, GM_ADDR qOut, GM_ADDR kOut,   \
                                               GM_ADDR pos, GM_ADDR cos, GM_ADDR sin,              \
                                               GM_ADDR freq, GM_ADDR tiling)                       \
    {                                                                                              \
        ROPE_AIV_ONLY();                                                                           \
        rope_ops_ascend::RopeKernel<T, INVERSE> op;                                                \
        op.Init(q, k, qOut, kOut, pos, cos, sin, freq, tiling);                                    \
        op.Process();                                                                              \
    }

#endif  // ROPE_OPS_ASCEND_ROPE_ENTRY_H
