// The library's parameters for a probe call (bf16, contiguous [1, tokens, H, D] q and k, int64
// positions); for probe sources that include csrc/rope_kernels.cu before this header.
#pragma once
#include "kernel_probe.h"

namespace probe_common {
inline RopeParams make_params(const ProbeCall& c) {
  RopeParams p = {};
  p.q = c.q;
  p.k = c.k;
  p.q_out = c.inplace ? const_cast<void*>(c.q) : c.q_out;
  p.k_out = c.inplace ? const_cast<void*>(c.k) : c.k_out;
  const int64_t H[2] = {c.Hq, c.Hk};
  int64_t* st[4] = {p.q_stride, p.q_out_stride, p.k_stride, p.k_out_stride};
  for (int i = 0; i < 4; ++i) {  // contiguous [1, tokens, H, D]
    const int64_t h = H[i / 2];
    st[i][0] = c.tokens * h * c.D;
    st[i][1] = h * c.D;
    st[i][2] = c.D;
    st[i][3] = 1;
  }
  p.B = 1;
  p.S = c.tokens;
  p.Hq = c.Hq;
  p.Hk = c.Hk;
  p.D = c.D;
  p.R = c.R;
  p.dtype = ROPE_BF16;
  p.interleaved = c.interleaved;
  p.inverse = c.inverse;
  p.copy_passthrough = c.inplace ? 0 : 1;
  p.pos = c.pos;
  p.pos_kind = ROPE_POS_I64;
  p.pos_stride_b = 0;
  p.pos_stride_s = 1;
  p.cos_table = c.cos_t;
  p.sin_table = c.sin_t;
  p.table_rows = c.table_rows;
  p.freq_turns = c.freq_turns;
  p.attention_factor = 1.0f;
  return p;
}
}  // namespace probe_common
