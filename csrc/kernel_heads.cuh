// Heads family (ROPE_HEADS): a thread rotates one 16-byte chunk of several heads of one token.
//
// Needs 16-byte vectors (policy.h vectors_fit). Thread g = ((token * HL) + lane) * CT + c owns
// chunk c of heads lane, lane + HL, ... of the token (q heads first, then k heads). Chunk c < CR is
// a rotary chunk: neox loads the vectors at c*V and c*V + R/2 (V pairs), gptj the vector at c*V
// (V/2 adjacent pairs); its cos/sin floats are loaded once and reused for all of the thread's
// heads. Chunks CR <= c < CT copy pass-through vectors [R, D) (out of place only).
// Consecutive threads cover consecutive chunks of a head, so a warp reads whole 128-byte lines
// whatever the strides between heads and tokens: this family takes every layout.
//
// Why several heads per thread: a thread's fixed work (index math, the position -> cos/sin
// chain, the table loads) is amortised over its heads (W4 forward at 1, 2, 3, 6 heads per thread:
// 1.341, 1.143, 1.073, 1.058 x a same-bytes copy, H200, 2026-12-01), while fewer threads per SM
// keep fewer bytes in flight; the policy picks heads per thread to keep enough threads per SM.
//
// Schedules (SCHED, ST) and hints, one kernel each:
//   SCHED_PIPE, 2, HINT_STREAM_ST: software pipelined in stages of 2 heads (the loads of stage
//     i+1 issue before the stores of stage i), evict-first loads and stores. Large NeoX calls.
//   SCHED_ROUNDS, 4, HINT_PLAIN: rounds of 4 heads (loads, then math and stores), plain loads.
//     Large out-of-place GPT-J calls (W3: 67.6 us against 68.3 for the pipelined kernel).
//   SCHED_ROUNDS, 1, HINT_STREAM: one head per thread (fewest registers: 64 neox bf16).
#pragma once

#include "angle_sources.cuh"

namespace rope_ops_cuda {
namespace {

constexpr int kHeadsMaxThreads = 256;  // launch bounds
enum { SCHED_ROUNDS = 0, SCHED_PIPE = 1 };

// Index decomposition of a thread id: 32-bit divisions when the whole grid fits in 31 bits
// (always in practice: 2^31 threads are > 64 GiB of bf16 data), 64-bit otherwise. A 64-bit
// division is a ~70-instruction subroutine in SASS, a 32-bit one ~20 instructions.
struct ThreadIdx {
  int c, lane;
  long long b, s;
};

ROPE_HD ThreadIdx decompose(const RopeParams& p, const int CT, const int HL, const long long gid,
                            const long long total) {
  ThreadIdx r;
  if (total <= 0x7fffffffLL && p.S <= 0x7fffffffLL) {
    const uint32_t g = (uint32_t)gid;
    const uint32_t t = g / (uint32_t)CT;
    r.c = (int)(g - t * (uint32_t)CT);
    const uint32_t tok = t / (uint32_t)HL;
    r.lane = (int)(t - tok * (uint32_t)HL);
    split_token(p, true, tok, r.b, r.s);
  } else {
    r.c = (int)(gid % CT);
    const long long t = gid / CT;
    r.lane = (int)(t % HL);
    split_token(p, false, t / HL, r.b, r.s);
  }
  return r;
}

template <typename T, bool NEOX, int ST, int HINT, class Angles, int VB>
struct HeadsThread {
  using VT = typename Vec<VB>::type;
  static constexpr int V = VecInfo<T, VB>::kVec;
  static constexpr int NC = NEOX ? V : V / 2;
  const RopeParams& p;
  long long Ht, half, HL;
  bool rot;
  const T* q_tok;
  T* qo_tok;
  const T* k_tok;
  T* ko_tok;
  float cs[NC], sn[NC];

  ROPE_HD HeadsThread(const RopeParams& pp, const int CR, const int CT, const int hl,
                      const long long gid, const long long total, const bool fly, int& lane_out)
      : p(pp), on_the_fly(fly) {
    const ThreadIdx ix = decompose(p, CT, hl, gid, total);
    lane_out = ix.lane;
    HL = hl;
    Ht = p.Hq + p.Hk;
    rot = ix.c < CR;
    const long long d0 = rot ? (long long)ix.c * V : p.R + (long long)(ix.c - CR) * V;
    half = p.R >> 1;
    wait_for_previous_grid();  // index math above overlaps the previous kernel's tail (PDL)
    // The position heads the longest dependency chain (position -> cos/sin row): issue it first.
    typename Angles::Token pos{};
    if (rot) pos = Angles::token(p, ix.b, ix.s);
    q_tok = static_cast<const T*>(p.q) + ix.b * p.q_stride[0] + ix.s * p.q_stride[1] + d0;
    qo_tok = static_cast<T*>(p.q_out) + ix.b * p.q_out_stride[0] + ix.s * p.q_out_stride[1] + d0;
    k_tok = nullptr;
    ko_tok = nullptr;
    if (p.Hk > 0) {
      k_tok = static_cast<const T*>(p.k) + ix.b * p.k_stride[0] + ix.s * p.k_stride[1] + d0;
      ko_tok = static_cast<T*>(p.k_out) + ix.b * p.k_out_stride[0] + ix.s * p.k_out_stride[1] + d0;
    }
    pos_ = pos;
    c_ = ix.c;
  }
  typename Angles::Token pos_;
  int c_;
  bool on_the_fly;

  ROPE_HD void load_cs() {
    // frequencies [c*V, c*V + V) (neox) or [c*V/2, c*V/2 + V/2) (gptj) of this thread's chunk
    if (rot) Angles::template cos_sin<NC>(p, pos_, (long long)c_ * NC, cs, sn, on_the_fly);
  }

  // Loads of heads h0, h0 + HL, ... (ST of them, those < Ht).
  ROPE_HD void load(const long long h0, VT* va, VT* vb) const {
#pragma unroll
    for (int u = 0; u < ST; ++u) {
      const long long h = h0 + (long long)u * HL;
      if (h < Ht) {
        const bool isq = h < p.Hq;
        const T* src = isq ? q_tok + h * p.q_stride[2] : k_tok + (h - p.Hq) * p.k_stride[2];
        va[u] = ld_data<HINT, VT>(src);
        if (NEOX && rot) vb[u] = ld_data<HINT, VT>(src + half);
      }
    }
  }

  ROPE_HD void store(const long long h0, const VT* va, const VT* vb) const {
#pragma unroll
    for (int u = 0; u < ST; ++u) {
      const long long h = h0 + (long long)u * HL;
      if (h < Ht) {
        const bool isq = h < p.Hq;
        T* dst = isq ? qo_tok + h * p.q_out_stride[2] : ko_tok + (h - p.Hq) * p.k_out_stride[2];
        if (!rot) {
          st_data<HINT>(dst, va[u]);
        } else if (NEOX) {
          float x[V], y[V], xo[V], yo[V];
          unpack_vec<T>(va[u], x);
          unpack_vec<T>(vb[u], y);
#pragma unroll
          for (int j = 0; j < V; ++j) {
            xo[j] = fmaf(x[j], cs[j], -y[j] * sn[j]);
            yo[j] = fmaf(y[j], cs[j], x[j] * sn[j]);
          }
          st_data<HINT>(dst, pack_vec<T, VT>(xo));
          st_data<HINT>(dst + half, pack_vec<T, VT>(yo));
        } else {
          float x[V], o[V];
          unpack_vec<T>(va[u], x);
#pragma unroll
          for (int j = 0; j < V / 2; ++j) {
            o[2 * j] = fmaf(x[2 * j], cs[j], -x[2 * j + 1] * sn[j]);
            o[2 * j + 1] = fmaf(x[2 * j + 1], cs[j], x[2 * j] * sn[j]);
          }
          st_data<HINT>(dst, pack_vec<T, VT>(o));
        }
      }
    }
  }
};

// The whole of thread gid's work.
template <typename T, bool NEOX, int SCHED, int ST, int HINT, class Angles, int VB>
ROPE_HD void heads_thread(const RopeParams& p, const int CR, const int CT, const int HL,
                          const long long gid, const long long total, const bool fly) {
  using VT = typename Vec<VB>::type;
  int lane = 0;
  HeadsThread<T, NEOX, ST, HINT, Angles, VB> th(p, CR, CT, HL, gid, total, fly, lane);
  const long long step = (long long)HL * ST;
  if constexpr (SCHED == SCHED_ROUNDS) {
    bool have_cs = false;
    for (long long h0 = lane; h0 < th.Ht; h0 += step) {
      VT va[ST], vb[ST];
      th.load(h0, va, vb);
      if (!have_cs) {
        th.load_cs();
        have_cs = true;
      }
      th.store(h0, va, vb);
    }
  } else {
    VT va[ST], vb[ST];
    long long h0 = lane;
    th.load(h0, va, vb);
    th.load_cs();
    for (; h0 < th.Ht; h0 += step) {
      VT na[ST], nb[ST];
      if (h0 + step < th.Ht) th.load(h0 + step, na, nb);
      th.store(h0, va, vb);
#pragma unroll
      for (int u = 0; u < ST; ++u) {
        va[u] = na[u];
        vb[u] = nb[u];
      }
    }
  }
}

template <typename T, bool NEOX, int SCHED, int ST, int HINT, class Angles, int VB>
__global__ void __launch_bounds__(kHeadsMaxThreads)
    rope_heads_kernel(const __grid_constant__ RopeParams p, const int CR, const int CT, const int HL,
                      const long long total, const int on_the_fly) {
  const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (gid < total) heads_thread<T, NEOX, SCHED, ST, HINT, Angles, VB>(p, CR, CT, HL, gid, total, on_the_fly != 0);
}

// ------------------------------------------------------------------------------------------------
// host side

// A heads launch: chunks per head (rotary CR of CT), head lanes per token, threads and blocks.
struct HeadsPlan {
  int64_t CR, CT, hl, total, blocks;
  int threads;
};

inline HeadsPlan plan_heads(const RopeParams& p, const int64_t V, const bool neox,
                            const int heads_per_thread, const int block_threads) {
  HeadsPlan f;
  const int64_t Ht = p.Hq + p.Hk;
  f.CR = neox ? (p.R / 2) / V : p.R / V;
  const int64_t CP = (p.copy_passthrough && p.D > p.R) ? (p.D - p.R) / V : 0;
  f.CT = f.CR + CP;
  f.hl = (Ht + heads_per_thread - 1) / heads_per_thread;
  f.threads = block_threads;
  f.total = p.B * p.S * f.CT * f.hl;
  f.blocks = (f.total + f.threads - 1) / f.threads;
  return f;
}

// Whether a heads launch with this plan can run (beyond vectors_fit).
inline bool heads_fits(const HeadsPlan& f) {
  return f.CT <= (1 << 30) && f.hl <= (1 << 30) && f.blocks <= 0x7fffffffLL &&
         f.threads >= 32 && f.threads <= kHeadsMaxThreads && f.threads % 32 == 0;
}

}  // namespace
}  // namespace rope_ops_cuda
