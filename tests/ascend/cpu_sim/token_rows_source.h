// A second cos/sin source for RopeKernel, test-only: it shows that a variant which changes where
// a token's cos/sin come from is one source class and no second kernel (rope_kernel.h, stage 1).
// It has the shape of the coming "caller cos/sin per token" variant: the kernel's cos and sin
// arguments are float32 [B*S, r/2] rows, row b*S + s for token (b, s); positions are not read.
// A tile's rows are consecutive tokens, so each table is one DataCopyPad of n rows, each row
// landing 32-byte padded at halfPad floats (exactly the compact layout the kernel expands).
#ifndef ROPE_OPS_TESTS_TOKEN_ROWS_SOURCE_H
#define ROPE_OPS_TESTS_TOKEN_ROWS_SOURCE_H

#include "rope_kernel.h"

namespace rope_sim_variants {

using namespace AscendC;

class TokenRowsSource {
public:
    __aicore__ inline void Init(GM_ADDR, GM_ADDR cos, GM_ADDR sin, GM_ADDR, const RopeTiling* tl)
    {
        tl_ = tl;
        cosGm_.SetGlobalBuffer((__gm__ float*)cos);
        sinGm_.SetGlobalBuffer((__gm__ float*)sin);
    }

    __aicore__ inline void Fill(LocalTensor<float>& cs, int64_t sinBase, int64_t row0, int64_t n)
    {
        DataCopyExtParams rows{(uint16_t)n, (uint32_t)(tl_->halfDim * sizeof(float)), 0, 0, 0};
        DataCopyPadExtParams<float> noPad{};
        DataCopyPad(cs, cosGm_[row0 * tl_->halfDim], rows, noPad);
        DataCopyPad(cs[sinBase], sinGm_[row0 * tl_->halfDim], rows, noPad);
    }

private:
    const RopeTiling* tl_ = nullptr;
    GlobalTensor<float> cosGm_, sinGm_;
};

}  // namespace rope_sim_variants

ROPE_ENTRY_WITH_SOURCE(rope_sim_token_rows_fp32, float, false, rope_sim_variants::TokenRowsSource)
ROPE_ENTRY_WITH_SOURCE(rope_sim_token_rows_fp16, half, false, rope_sim_variants::TokenRowsSource)
ROPE_ENTRY_WITH_SOURCE(rope_sim_token_rows_bf16, bfloat16_t, false, rope_sim_variants::TokenRowsSource)
ROPE_ENTRY_WITH_SOURCE(rope_sim_token_rows_grad_fp32, float, true, rope_sim_variants::TokenRowsSource)
ROPE_ENTRY_WITH_SOURCE(rope_sim_token_rows_grad_fp16, half, true, rope_sim_variants::TokenRowsSource)
ROPE_ENTRY_WITH_SOURCE(rope_sim_token_rows_grad_bf16, bfloat16_t, true, rope_sim_variants::TokenRowsSource)

#endif  // ROPE_OPS_TESTS_TOKEN_ROWS_SOURCE_H
