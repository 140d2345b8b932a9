// rope_ops Ascend C kernels: the kernel entry macros. Each file in kernels/ instantiates one entry
// (ascendc_library wants one kernel entry per source file); a variant with its own cos/sin source
// is one more file with ROPE_ENTRY_WITH_SOURCE.
#ifndef ROPE_OPS_ASCEND_ROPE_ENTRY_H
#define ROPE_OPS_ASCEND_ROPE_ENTRY_H

#include "rope_kernel.h"

#if defined(KERNEL_TASK_TYPE_DEFAULT)
#define ROPE_AIV_ONLY() KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY)
#else
#define ROPE_AIV_ONLY()
#endif

// One kernel entry: RopeKernel<T, INVERSE> with the cos/sin source SOURCE (see rope_kernel.h).
#define ROPE_ENTRY_WITH_SOURCE(NAME, T, INVERSE, SOURCE)                                          \
    extern "C" __global__ __aicore__ void NAME(GM_ADDR q, GM_ADDR k, GM_ADDR qOut, GM_ADDR kOut,   \
                                               GM_ADDR pos, GM_ADDR cos, GM_ADDR sin,              \
                                               GM_ADDR freq, GM_ADDR tiling)                       \
    {                                                                                              \
        ROPE_AIV_ONLY();                                                                           \
        rope_ops_ascend::RopeKernel<T, INVERSE, SOURCE> op;                                        \
        op.Init(q, k, qOut, kOut, pos, cos, sin, freq, tiling);                                    \
        op.Process();                                                                              \
    }

// The op's entries: positions -> table rows (or on the fly).
#define ROPE_ENTRY(NAME, T, INVERSE) \
    ROPE_ENTRY_WITH_SOURCE(NAME, T, INVERSE, rope_ops_ascend::PositionTableSource)

#endif  // ROPE_OPS_ASCEND_ROPE_ENTRY_H
