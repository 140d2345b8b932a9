// Rows family (ROPE_ROWS): calls that write only the rotary dims (in place). A row is one head of
// one token; a block's 256 threads cover the rotary vectors of 256 / TPR consecutive rows (TPR
// threads per row, a power of two: R / V for GPT-J, R / 2V for NeoX, whose thread takes the
// vectors at c*V and c*V + R/2), q's rows first, then k's, so a warp's accesses are whole
// 16-byte vectors of consecutive rows and no lane idles on pass-through dims (the flat family's
// lanes span whole rows, the heads family's walk several heads). One row per thread: index math
// (divisions by FastDiv; a row-pitch address when rows are evenly spaced), the position load,
// the data loads, so the position -> cos/sin chain runs under them; stores evict-first.
//
// Why (H200, 2026-12-01, W3's shape in place, where 128 of every 512 bytes of a row rotate): a
// kernel that only loads and stores those bytes takes 19.9 us (the same bytes packed densely:
// 17.1); this kernel with NeoX pairs 20.61 us against 21.83 for the heads family; with GPT-J
// pairs (a thread moves 16 bytes, so its index math weighs more) 21.28 against 21.17.
#pragma once

#include "angle_sources.cuh"

namespace rope_ops_cuda {
namespace {

constexpr int kRowsThreads = 256;

struct RowsShape {
  int tpr_log2;       // log2 of the threads per row
  int idx32;          // rows, tokens and S below 2^31: FastDiv divisions (else 64-bit ones)
  int uniform;        // every tensor's row r starts at r * pitch (B == 1 or batches back to back,
                      // tokens' rows back to back): no (b, s, h) split for the data addresses
  long long tiles_q;  // blocks over q's rows (the later blocks do k's)
  long long rows_q, rows_k;
  long long pitch[4];  // uniform: row pitch of q, q_out, k, k_out
  FastDiv div_hq, div_hk, div_s;
};

template <typename T, bool NEOX, class Angles>
ROPE_HD void rows_thread(const RopeParams& p, const RowsShape& f, const long long bid, const int t,
                         const bool fly) {
  constexpr int V = VecInfo<T>::kVec;
  constexpr int NC = NEOX ? V : V / 2;
  const bool isq = bid < f.tiles_q;
  const long long row = (isq ? bid : bid - f.tiles_q) * (kRowsThreads >> f.tpr_log2) + (t >> f.tpr_log2);
  const int c = t & ((1 << f.tpr_log2) - 1);
  if (row >= (isq ? f.rows_q : f.rows_k)) return;
  const long long H = isq ? p.Hq : p.Hk;
  long long tok, b = 0, s;
  if (f.idx32) tok = isq ? fast_div(f.div_hq, (uint32_t)row) : fast_div(f.div_hk, (uint32_t)row);
  else tok = row / H;
  s = tok;
  if (p.B > 1) {
    if (f.idx32) b = fast_div(f.div_s, (uint32_t)tok);
    else b = tok / p.S;
    s = tok - b * p.S;
  }
  const long long d0 = (long long)c * V;
  const T* src = static_cast<const T*>(isq ? p.q : p.k) + d0;
  T* dst = static_cast<T*>(isq ? p.q_out : p.k_out) + d0;
  if (f.uniform) {
    src += row * (isq ? f.pitch[0] : f.pitch[2]);  // (a computed index would copy f to the stack)
    dst += row * (isq ? f.pitch[1] : f.pitch[3]);
  } else {
    const long long h = row - tok * H;
    const int64_t* st = isq ? p.q_stride : p.k_stride;
    const int64_t* sto = isq ? p.q_out_stride : p.k_out_stride;
    src += b * st[0] + s * st[1] + h * st[2];
    dst += b * sto[0] + s * sto[1] + h * sto[2];
  }
  const long long half = p.R >> 1;
  wait_for_previous_grid();  // the index math above overlaps the previous kernel's tail (PDL)
  const typename Angles::Token pos = Angles::token(p, b, s);
  const uint4 va = ld_data<HINT_PLAIN>(src);
  uint4 vb = va;
  if (NEOX) vb = ld_data<HINT_PLAIN>(src + half);
  float cs[NC], sn[NC];
  Angles::template cos_sin<NC>(p, pos, (long long)c * NC, cs, sn, fly);
  // The same math as HeadsThread::store (bit-equal outputs across families).
  if constexpr (NEOX) {
    float x[V], y[V], xo[V], yo[V];
    unpack16<T>(va, x);
    unpack16<T>(vb, y);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      xo[j] = fmaf(x[j], cs[j], -y[j] * sn[j]);
      yo[j] = fmaf(y[j], cs[j], x[j] * sn[j]);
    }
    st_data<HINT_STREAM_ST>(dst, pack16<T>(xo));
    st_data<HINT_STREAM_ST>(dst + half, pack16<T>(yo));
  } else {
    float x[V], o[V];
    unpack16<T>(va, x);
#pragma unroll
    for (int j = 0; j < V / 2; ++j) {
      o[2 * j] = fmaf(x[2 * j], cs[j], -x[2 * j + 1] * sn[j]);
      o[2 * j + 1] = fmaf(x[2 * j + 1], cs[j], x[2 * j] * sn[j]);
    }
    st_data<HINT_STREAM_ST>(dst, pack16<T>(o));
  }
}

template <typename T, bool NEOX, class Angles>
__global__ void __launch_bounds__(kRowsThreads)
    rope_rows_kernel(const __grid_constant__ RopeParams p, const RowsShape f, const int on_the_fly) {
  rows_thread<T, NEOX, Angles>(p, f, blockIdx.x, threadIdx.x, on_the_fly != 0);
}

// ------------------------------------------------------------------------------------------------
// host side

inline int64_t rows_threads_per_row(const RopeParams& p, const int64_t V) {
  return p.interleaved ? p.R / V : p.R / (2 * V);
}

// The pitch between a tensor's consecutive rows when a token's rows are evenly spaced up to the
// next token's (with tokens_uniform: row r at r * pitch), else -1.
inline int64_t row_pitch(const int64_t* st, const int64_t H) {
  if (H <= 1) return st[1];
  return st[1] == H * st[2] ? st[2] : -1;
}

struct RowsPlan {
  RowsShape f;
  int64_t blocks;
};

inline RowsPlan plan_rows(const RopeParams& p, const int64_t V) {
  const int64_t tpr = rows_threads_per_row(p, V);
  int tpr_log2 = 0;
  while ((int64_t(1) << tpr_log2) < tpr) ++tpr_log2;
  const int64_t per_block = kRowsThreads >> tpr_log2;
  const int64_t tokens = p.B * p.S;
  RowsPlan plan;
  RowsShape& f = plan.f;
  f = {};
  f.tpr_log2 = tpr_log2;
  f.rows_q = tokens * p.Hq;
  f.rows_k = tokens * p.Hk;
  const int64_t most = f.rows_q > f.rows_k ? f.rows_q : f.rows_k;
  f.idx32 = (most < 0x7fffffffLL && tokens < 0x7fffffffLL && p.S < 0x7fffffffLL) ? 1 : 0;
  if (f.idx32) {
    f.div_hq = make_fast_div((uint32_t)(p.Hq > 0 ? p.Hq : 1));
    f.div_hk = make_fast_div((uint32_t)(p.Hk > 0 ? p.Hk : 1));
    f.div_s = make_fast_div((uint32_t)p.S);
  }
  f.pitch[0] = p.Hq > 0 ? row_pitch(p.q_stride, p.Hq) : 0;
  f.pitch[1] = p.Hq > 0 ? row_pitch(p.q_out_stride, p.Hq) : 0;
  f.pitch[2] = p.Hk > 0 ? row_pitch(p.k_stride, p.Hk) : 0;
  f.pitch[3] = p.Hk > 0 ? row_pitch(p.k_out_stride, p.Hk) : 0;
  f.uniform = tokens_uniform(p) && f.pitch[0] >= 0 && f.pitch[1] >= 0 && f.pitch[2] >= 0 &&
              f.pitch[3] >= 0;
  f.tiles_q = (f.rows_q + per_block - 1) / per_block;
  plan.blocks = f.tiles_q + (f.rows_k + per_block - 1) / per_block;
  return plan;
}

// Whether the rows kernel can take p (already known to suit 16-byte vectors): it never touches
// the pass-through dims, and a row's threads are a power of two.
inline bool rows_fits(const RopeParams& p, const int64_t V) {
  if (p.copy_passthrough) return false;
  const int64_t tpr = rows_threads_per_row(p, V);
  if (!(tpr >= 1 && tpr <= kRowsThreads && (tpr & (tpr - 1)) == 0)) return false;
  return plan_rows(p, V).blocks <= 0x7fffffffLL;
}

}  // namespace
}  // namespace rope_ops_cuda
