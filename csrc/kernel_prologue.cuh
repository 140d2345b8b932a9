// The fused attention prologue (prologue.h): QKV split + per-head RMSNorm + rotation + KV-cache
// write, forward and backward. A flat-family kernel: a group of G lanes (a power of two <= 32,
// inside one warp) holds one head row, so a row's sum of squares is a shuffle reduction over the
// group (the backward keeps its weight-gradient sums in shared memory).
//
// A row is cut into units: rotary units first (NeoX: the E-element vectors at i and R/2 + i, E
// pairs; GPT-J: 2 NP contiguous elements, NP pairs), then pass-through vectors of E elements.
// E = 16 / sizeof(T) (16-byte vectors) where every tensor, the rotary halves and the table reads
// allow it, else 1 (single elements: any head_dim, any even rotary_dim, any alignment). Lane l of
// a group owns units l, l + G, ... (up to U of them), the same units in every row. v rows are
// copied (and cached) through the same units.
//
// The rows of all tokens form one flattened walk (token-major: q heads, k heads, v heads where v
// is written or cached); every group takes one row of it. Its loads (the row, the position, the
// cache slot, the norm weights) are issued before anything waits on them, so the position ->
// cos/sin table chain overlaps the row's own load.
// Forward grid: one block (128 / G groups) per 128 / G rows, one row per group: no row loop; new
// blocks keep the loads in flight, and the grid spreads over every SM for decode-sized calls too.
// Backward: each block walks a run of consecutive chunks of 128 / G rows (a grid of at most
// kPrologueBackwardBlocksPerSm per SM), the next row's loads issued before this row's reductions
// wait; the weight-gradient sums live in shared memory, and each block writes one row of partial
// sums ([blocks, D], added up by the caller in a fixed order: deterministic).
#pragma once

#include <cuda_fp8.h>

#include "angle_sources.cuh"
#include "prologue.h"

namespace rope_ops_cuda {
namespace {

constexpr int kPrologueThreads = 128;
constexpr int kPrologueMaxUnits = 128;  // per row: 32 lanes x 4 units
constexpr int kPrologueBackwardBlocksPerSm = 8;

// What a launch's lanes need to know of the call's shape (host-computed).
struct PrologueShape {
  int G;             // lanes per row
  int g_log2;
  int n_rot;         // rotary units per row (0: no rotation)
  int n_units;       // units per row
  int n_rows;        // rows per token walked: q, k (and v when written or cached)
  int64_t total;     // rows walked: tokens * n_rows
};

// E elements of T from / to 16-byte vectors (VB 16) or single elements (VB sizeof(T)).
// V: a vector as loaded, converted by unpack (a load's wait falls on its first use).
template <typename T, int VB>
struct Elems {
  static constexpr int E = VB / (int)sizeof(T);
  using V = typename std::conditional<VB == 16, uint4, T>::type;
  static ROPE_HD V load_raw(const T* ptr) {
    if constexpr (VB == 16) return ld_data<HINT_PLAIN>(ptr);
    else return *ptr;
  }
  static ROPE_HD void unpack(const V& v, float* f) {
    if constexpr (VB == 16) unpack16<T>(v, f);
    else f[0] = to_f32(v);
  }
  static ROPE_HD void load(const T* ptr, float* f) { unpack(load_raw(ptr), f); }
  static ROPE_HD void store(T* ptr, const float* f) {
    if constexpr (VB == 16) st_data<HINT_PLAIN>(ptr, pack16<T>(f));
    else *ptr = from_f32<T>(f[0]);
  }
};

// float8 e4m3 of x, saturating to +-448; NaN stays NaN (SPEC: float8 cache).
ROPE_HD uint8_t e4m3_of(float x) {
  return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

// N values / scale as e4m3, one store of N bytes.
template <int N>
ROPE_HD void store_e4m3(uint8_t* ptr, const float* f, float scale) {
  uint8_t b[N];
#pragma unroll
  for (int j = 0; j < N; ++j) b[j] = e4m3_of(f[j] / scale);
  if constexpr (N == 8) *reinterpret_cast<uint2*>(ptr) = bit_cast_hd<uint2>(b);
  else if constexpr (N == 4) *reinterpret_cast<uint32_t*>(ptr) = bit_cast_hd<uint32_t>(b);
  else {
#pragma unroll
    for (int j = 0; j < N; ++j) ptr[j] = b[j];
  }
}

// N consecutive float32 weights (16-byte loads when N is a multiple of 4: the weights are
// 16-byte aligned and N-element pieces start at multiples of N).
template <int N>
ROPE_HD void load_weights(const float* w, float* out) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int j = 0; j < N; j += 4) {
      const float4 v = ldg_ro(reinterpret_cast<const float4*>(w + j));
      out[j] = v.x; out[j + 1] = v.y; out[j + 2] = v.z; out[j + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = ldg_ro(w + j);
  }
}

// A row's units: where their elements lie, and the per-unit math. Unit storage: W floats;
// NeoX rotary [a (NP), b (NP)], GPT-J rotary [x0, y0, x1, y1, ...], pass-through [E values].
template <typename T, bool NEOX, int VB>
struct PrologueUnits {
  using X = Elems<T, VB>;
  static constexpr int E = X::E;
  static constexpr int NP = NEOX ? E : (E >= 2 ? E / 2 : 1);  // pairs per rotary unit
  static constexpr int W = 2 * NP;
  static constexpr int NV = W / E;  // vectors per unit (a pass-through unit uses the first)

  // Calls f(element offset in the row, index in the unit's storage, elements) for each E-element
  // vector of unit u.
  template <class F>
  static ROPE_HD void vectors(const PrologueShape& sh, int64_t R, int u, F&& f) {
    if (u < sh.n_rot) {
      if constexpr (NEOX) {
        f((int64_t)u * NP, 0);
        f((R >> 1) + (int64_t)u * NP, NP);
      } else {
#pragma unroll
        for (int v = 0; v < W / E; ++v) f((int64_t)u * W + v * E, v * E);
      }
    } else {
      f(R + (int64_t)(u - sh.n_rot) * E, 0);
    }
  }

  static ROPE_HD void load(const T* row, const PrologueShape& sh, int64_t R, int u, float* x) {
    vectors(sh, R, u, [&](int64_t off, int at) { X::load(row + off, x + at); });
  }

  static ROPE_HD void store(T* row, const PrologueShape& sh, int64_t R, int u, const float* x) {
    vectors(sh, R, u, [&](int64_t off, int at) { X::store(row + off, x + at); });
  }

  // The unit's vectors as loaded (raw[at / E]), and converted.
  static ROPE_HD void load_raw(const T* row, const PrologueShape& sh, int64_t R, int u,
                               typename X::V* raw) {
    vectors(sh, R, u, [&](int64_t off, int at) { raw[at / E] = X::load_raw(row + off); });
  }
  static ROPE_HD void unpack(const typename X::V* raw, float* x) {
#pragma unroll
    for (int v = 0; v < NV; ++v) X::unpack(raw[v], x + v * E);
  }

  // acc[element] += a * b over the unit's elements (acc: a float row in shared memory).
  static ROPE_HD void add_to(float* acc, const PrologueShape& sh, int64_t R, int u, const float* a,
                             const float* b) {
    vectors(sh, R, u, [&](int64_t off, int at) {
      if constexpr (E % 4 == 0) {
#pragma unroll
        for (int j = 0; j < E; j += 4) {
          float4* d = reinterpret_cast<float4*>(acc + off + j);
          float4 t = *d;
          t.x = fmaf(a[at + j], b[at + j], t.x);
          t.y = fmaf(a[at + j + 1], b[at + j + 1], t.y);
          t.z = fmaf(a[at + j + 2], b[at + j + 2], t.z);
          t.w = fmaf(a[at + j + 3], b[at + j + 3], t.w);
          *d = t;
        }
      } else {
#pragma unroll
        for (int j = 0; j < E; ++j) acc[off + j] = fmaf(a[at + j], b[at + j], acc[off + j]);
      }
    });
  }

  static ROPE_HD void store_e4m3_unit(uint8_t* row, const PrologueShape& sh, int64_t R, int u,
                                      const float* x, float scale) {
    vectors(sh, R, u, [&](int64_t off, int at) { store_e4m3<E>(row + off, x + at, scale); });
  }

  // offset + w for the unit's elements; w float32, or of T (like_qkv: qkv's dtype, read as the
  // data is).
  static ROPE_HD void weights(const void* w, bool like_qkv, float offset, const PrologueShape& sh,
                              int64_t R, int u, float* out) {
    vectors(sh, R, u, [&](int64_t off, int at) {
      float t[E];
      if (like_qkv) X::load(static_cast<const T*>(w) + off, t);
      else load_weights<E>(static_cast<const float*>(w) + off, t);
#pragma unroll
      for (int j = 0; j < E; ++j) out[at + j] = offset + t[j];
    });
  }

  // Elements unit u holds.
  static ROPE_HD int count(const PrologueShape& sh, int u) { return u < sh.n_rot ? W : E; }

  // The rotation of a rotary unit by (c, s) (s already negated for the backward).
  static ROPE_HD void rotate(float* x, const float* c, const float* s) {
#pragma unroll
    for (int j = 0; j < NP; ++j) {
      const int ia = NEOX ? j : 2 * j;
      const int ib = NEOX ? NP + j : 2 * j + 1;
      const float a = x[ia], b = x[ib];
      x[ia] = fmaf(a, c[j], -b * s[j]);
      x[ib] = fmaf(b, c[j], a * s[j]);
    }
  }
};

// The sum of v over the G lanes of each group (G a power of two: xor partners stay in the group).
__device__ __forceinline__ float group_sum(float v, int G) {
  for (int off = G >> 1; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Kind of row `row` of a token: 0 q, 1 k, 2 v; its head index within that kind.
ROPE_HD int row_kind(const RopePrologueParams& p, int row, int& head) {
  if (row < p.Hq) { head = row; return 0; }
  if (row < p.Hq + p.Hk) { head = row - (int)p.Hq; return 1; }
  head = row - (int)(p.Hq + p.Hk);
  return 2;
}

// Where a group's row lies: row gid of the flattened [tokens, n_rows] walk (gid < total).
struct PrologueRow {
  int64_t b, s;
  int row, kind, head;
  bool active;

  ROPE_HD PrologueRow(const RopePrologueParams& p, const PrologueShape& sh, int64_t gid) {
    active = gid < sh.total;
    if (!active) gid = 0;  // an idle group of the last block: row 0 of token 0, never stored
    const int64_t token = gid / sh.n_rows;
    row = (int)(gid - token * sh.n_rows);
    b = token / p.rope.S;
    s = token - b * p.rope.S;
    kind = row_kind(p, row, head);
  }
};

// One lane of the forward: units l, l + G, ... of one row. Every group takes one row of the
// flattened [tokens, n_rows] walk, so a lane's loads are issued once, up front (the row, its
// norm weights, the position and the cache slot), before anything waits on the position: its
// table read and the weights' latency then overlap the row's. No row loop: a block is 128 / G
// rows, and new blocks keep the loads in flight (one row per lane: occupancy over rows in flight).
template <typename T, bool NEOX, int VB, int U, class A>
struct PrologueLane {
  using Units = PrologueUnits<T, NEOX, VB>;
  using X = typename Units::X;
  using V = typename X::V;
  static constexpr int NP = Units::NP, W = Units::W, NV = Units::NV;

  PrologueRow r;
  int lane;
  int64_t slot;  // the token's cache slot for k and v rows, -1: none
  V raw[U][NV];
  float x[U][W];
  float c[U][NP], sn[U][NP];

  ROPE_HD PrologueLane(const RopePrologueParams& p, const PrologueShape& sh, int64_t block, int thread)
      : r(p, sh, block * (kPrologueThreads >> sh.g_log2) + (thread >> sh.g_log2)) {
    lane = thread & (sh.G - 1);
  }

  ROPE_HD int unit(const PrologueShape& sh, int k) const { return lane + k * sh.G; }

  ROPE_HD bool normed(const RopePrologueParams& p) const {
    return r.kind < 2 && (r.kind == 0 ? p.q_weight : p.k_weight) != nullptr;
  }

  // Issues the lane's loads and applies the weights; returns the lane's part of the row's sum of
  // squares (the row's values in x, times the weights where normalised).
  ROPE_HD float load(const RopePrologueParams& p, const PrologueShape& sh) {
    float part = 0.f;
    if (!r.active) return part;
    const int64_t R = p.rope.R;
    const T* src = static_cast<const T*>(p.qkv) + r.b * p.qkv_stride_b + r.s * p.qkv_stride_s +
                   (int64_t)r.row * p.rope.D;
#pragma unroll
    for (int k = 0; k < U; ++k)
      if (unit(sh, k) < sh.n_units) Units::load_raw(src, sh, R, unit(sh, k), raw[k]);
    slot = -1;
    long long sv = -1;
    if (r.kind > 0 && p.k_cache != nullptr) {
      const int64_t at = r.b * p.slots_stride_b + r.s * p.slots_stride_s;
      sv = p.slots_kind == ROPE_POS_I32 ? (long long)ldg_ro(static_cast<const int32_t*>(p.slots) + at)
                                        : ldg_ro(static_cast<const long long*>(p.slots) + at);
    }
    const bool rotated = r.kind < 2 && sh.n_rot > 0;
    const typename A::Token tok = rotated ? A::token(p.rope, r.b, r.s) : typename A::Token();
    const bool nrm = normed(p);
    if (nrm) {
      const void* w = r.kind == 0 ? p.q_weight : p.k_weight;
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (unit(sh, k) < sh.n_units)
          Units::weights(w, p.weights_like_qkv != 0, p.weight_offset, sh, R, unit(sh, k), x[k]);
    }
    if (rotated) {
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (unit(sh, k) < sh.n_rot) A::template cos_sin<NP>(p.rope, tok, (long long)unit(sh, k) * NP, c[k], sn[k]);
    }
    if (sv >= 0 && sv < p.num_slots) slot = sv;  // any other value: skip, never an address
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int u = unit(sh, k);
      if (u >= sh.n_units) continue;
      float v[W];
      Units::unpack(raw[k], v);
      const int n = Units::count(sh, u);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        if (j >= n) continue;
        part = fmaf(v[j], v[j], part);
        x[k][j] = nrm ? v[j] * x[k][j] : v[j];
      }
    }
    return part;
  }

  // The row's norm (its weights already applied), rotation and stores; sum_sq: its sum of squares.
  ROPE_HD void finish(const RopePrologueParams& p, const PrologueShape& sh, float sum_sq) {
    if (!r.active) return;
    const int64_t R = p.rope.R;
    const int kind = r.kind, head = r.head;
    if (kind < 2) {
      if (normed(p)) {
        const float rstd = 1.0f / sqrtf(sum_sq / (float)p.rope.D + p.eps);
#pragma unroll
        for (int k = 0; k < U; ++k)
#pragma unroll
          for (int j = 0; j < W; ++j) x[k][j] *= rstd;
      }
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (unit(sh, k) < sh.n_rot) Units::rotate(x[k], c[k], sn[k]);
    }
    if (kind < 2 || !p.inplace) {
      T* dst = p.inplace ? static_cast<T*>(const_cast<void*>(p.qkv)) + r.b * p.qkv_stride_b +
                               r.s * p.qkv_stride_s + (int64_t)r.row * p.rope.D
                         : static_cast<T*>(p.out[kind]) + r.b * p.out_stride[kind][0] +
                               r.s * p.out_stride[kind][1] + head * p.out_stride[kind][2];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int u = unit(sh, k);
        if (u < sh.n_units) Units::store(dst, sh, R, u, x[k]);
      }
    }
    if (slot >= 0) {
      const int64_t* st = kind == 1 ? p.k_cache_stride : p.v_cache_stride;
      const int64_t at = slot * st[0] + head * st[1];
      void* cache = kind == 1 ? p.k_cache : p.v_cache;
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int u = unit(sh, k);
        if (u >= sh.n_units) continue;
        if (p.cache_fp8)
          Units::store_e4m3_unit(static_cast<uint8_t*>(cache) + at, sh, R, u, x[k],
                                 kind == 1 ? p.k_scale : p.v_scale);
        else
          Units::store(static_cast<T*>(cache) + at, sh, R, u, x[k]);
      }
    }
  }
};

template <typename T, bool NEOX, int VB, int U, class A>
__global__ void __launch_bounds__(kPrologueThreads)
    rope_prologue_kernel(const RopePrologueParams p, const PrologueShape sh) {
  PrologueLane<T, NEOX, VB, U, A> lane(p, sh, blockIdx.x, threadIdx.x);
  wait_for_previous_grid();
  // idle groups of the last block take part (0) so that the warp's shuffles stay uniform
  lane.finish(p, sh, group_sum(lane.load(p, sh), sh.G));
}

// One lane of the backward: the forward's lanes over the rows its block walks (consecutive chunks
// of 128 / G rows of the flattened walk). A row's gradient and input loads are issued (issue) a
// row ahead, before the previous row's reductions wait; its position and cos/sin (L1 hits: the
// token's rows are on this block) and its weights (read by every row of the block) are read when
// it is processed. The weight-gradient sums live in
// the block's shared memory ([2][groups, D]: q's, then k's; a lane's elements are its own, the
// same units in every row), not in registers: occupancy.
template <typename T, bool NEOX, int VB, int U, class A>
struct PrologueGradLane {
  using Units = PrologueUnits<T, NEOX, VB>;
  using V = typename Units::X::V;
  static constexpr int NP = Units::NP, W = Units::W, NV = Units::NV;

  PrologueRow r;
  int lane, group;
  bool normed, has_grad;
  float rstd;
  V graw[U][NV], xraw[U][NV];
  float g[U][W], n[U][W];

  ROPE_HD PrologueGradLane(const RopePrologueParams& p, const PrologueShape& sh, int64_t chunk, int thread)
      : r(p, sh, chunk * (kPrologueThreads >> sh.g_log2) + (thread >> sh.g_log2)) {
    lane = thread & (sh.G - 1);
    group = thread >> sh.g_log2;
  }

  ROPE_HD int unit(const PrologueShape& sh, int k) const { return lane + k * sh.G; }

  // Issues the loads of the row's output gradient and, where it is normalised, its input row.
  ROPE_HD void issue(const RopePrologueParams& p, const PrologueShape& sh) {
    normed = has_grad = false;
    if (!r.active) return;
    const int kind = r.kind;
    const int64_t R = p.rope.R;
    const T* gsrc = static_cast<const T*>(p.grad[kind]);
    has_grad = gsrc != nullptr;
    if (has_grad)
      gsrc += r.b * p.grad_stride[kind][0] + r.s * p.grad_stride[kind][1] + r.head * p.grad_stride[kind][2];
    normed = kind < 2 && (kind == 0 ? p.q_weight : p.k_weight) != nullptr;
    const T* xsrc = static_cast<const T*>(p.qkv) + r.b * p.qkv_stride_b + r.s * p.qkv_stride_s +
                    (int64_t)r.row * p.rope.D;
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int u = unit(sh, k);
      if (u >= sh.n_units) continue;
      if (has_grad) Units::load_raw(gsrc, sh, R, u, graw[k]);
      if (normed) Units::load_raw(xsrc, sh, R, u, xraw[k]);
    }
  }

  // The issued row's output gradient, rotated back (p.rope.inverse), and input; returns the
  // lane's part of the input's sum of squares.
  ROPE_HD float load(const RopePrologueParams& p, const PrologueShape& sh) {
    float sum = 0.f;
    if (!r.active) return sum;
    const int kind = r.kind;
    const bool rotated = kind < 2 && sh.n_rot > 0;
    float c[U][NP], sn[U][NP];
    if (rotated) {
      const typename A::Token tok = A::token(p.rope, r.b, r.s);
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (unit(sh, k) < sh.n_rot) A::template cos_sin<NP>(p.rope, tok, (long long)unit(sh, k) * NP, c[k], sn[k]);
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int u = unit(sh, k);
      if (u >= sh.n_units) continue;
      if (has_grad) {
        Units::unpack(graw[k], g[k]);
      } else {
#pragma unroll
        for (int j = 0; j < W; ++j) g[k][j] = 0.f;
      }
      if (rotated && u < sh.n_rot) Units::rotate(g[k], c[k], sn[k]);
      if (normed) {
        Units::unpack(xraw[k], n[k]);
        const int cnt = Units::count(sh, u);
#pragma unroll
        for (int j = 0; j < W; ++j)
          if (j < cnt) sum = fmaf(n[k][j], n[k][j], sum);
      }
    }
    return sum;
  }

  // n = x * rstd, the weight-gradient sums (into `sums`: the block's [2][groups, D]),
  // g = g * (offset + w); returns the lane's part of sum(g * n).
  ROPE_HD float norm_row(const RopePrologueParams& p, const PrologueShape& sh, float sum_sq, float* sums) {
    float dot = 0.f;
    if (!r.active || !normed) return dot;
    rstd = 1.0f / sqrtf(sum_sq / (float)p.rope.D + p.eps);
    const void* w = r.kind == 0 ? p.q_weight : p.k_weight;
    float* acc = sums + ((int64_t)r.kind * (kPrologueThreads >> sh.g_log2) + group) * p.rope.D;
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int u = unit(sh, k);
      if (u >= sh.n_units) continue;
      float wk[W];
      Units::weights(w, p.weights_like_qkv != 0, p.weight_offset, sh, p.rope.R, u, wk);
#pragma unroll
      for (int j = 0; j < W; ++j) n[k][j] *= rstd;
      Units::add_to(acc, sh, p.rope.R, u, g[k], n[k]);
      const int cnt = Units::count(sh, u);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        if (j >= cnt) continue;
        g[k][j] *= wk[j];
        dot = fmaf(g[k][j], n[k][j], dot);
      }
    }
    return dot;
  }

  // grad_x = rstd * (g - n * mean(g * n)) (normalised rows) or g, into grad_qkv.
  ROPE_HD void finish(const RopePrologueParams& p, const PrologueShape& sh, float dot) {
    if (!r.active) return;
    const float mean = dot / (float)p.rope.D;
    T* dst = static_cast<T*>(p.grad_qkv) + r.b * p.grad_qkv_stride_b + r.s * p.grad_qkv_stride_s +
             (int64_t)r.row * p.rope.D;
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int u = unit(sh, k);
      if (u >= sh.n_units) continue;
      if (normed) {
#pragma unroll
        for (int j = 0; j < W; ++j) g[k][j] = rstd * (g[k][j] - n[k][j] * mean);
      }
      Units::store(dst, sh, p.rope.R, u, g[k]);
    }
  }
};

// Thread t's share of a block's partial sums: element d (t, t + 128, ...) of the block's row,
// the groups' rows of `sums` added in order.
ROPE_HD void add_group_sums(const float* sums, int groups, int64_t D, int thread, float* out_row) {
  for (int64_t d = thread; d < D; d += kPrologueThreads) {
    float total = 0.f;
    for (int gi = 0; gi < groups; ++gi) total += sums[gi * D + d];
    out_row[d] = total;
  }
}

// The backward block's chunks [first, end): consecutive ones, so that a token's rows (its
// position and cos/sin row, L1 hits after the first) stay on one block.
ROPE_HD void prologue_block_chunks(const PrologueShape& sh, int64_t block, int64_t blocks,
                                   int64_t& first, int64_t& end) {
  const int64_t groups = kPrologueThreads >> sh.g_log2;
  const int64_t chunks = (sh.total + groups - 1) / groups;
  const int64_t per = (chunks + blocks - 1) / blocks;
  first = block * per;
  end = first + per < chunks ? first + per : chunks;
}

// U == 1: at most 128 registers (4 blocks per SM); with the next row's loads in flight the
// common kernels (fp16/bf16 NeoX vectors) would take 136, 3 blocks per SM.
template <typename T, bool NEOX, int VB, int U, class A>
__global__ void __launch_bounds__(kPrologueThreads, U == 1 ? 4 : 1)
    rope_prologue_backward_kernel(const RopePrologueParams p, const PrologueShape sh) {
  extern __shared__ float sums[];  // [2][groups, D]: the block's weight-gradient sums, q's then k's
  const int groups = kPrologueThreads >> sh.g_log2;
  const int64_t D = p.rope.D;
  for (int64_t i = threadIdx.x; i < 2 * groups * D; i += kPrologueThreads) sums[i] = 0.f;
  __syncthreads();
  wait_for_previous_grid();
  int64_t chunk, end;
  prologue_block_chunks(sh, blockIdx.x, gridDim.x, chunk, end);
  using Lane = PrologueGradLane<T, NEOX, VB, U, A>;
  const auto process = [&](Lane& lane) {
    const float sum_sq = group_sum(lane.load(p, sh), sh.G);
    lane.finish(p, sh, group_sum(lane.norm_row(p, sh, sum_sq, sums), sh.G));
  };
  if constexpr (U == 1) {
    // the next chunk's loads are issued before this one's reductions wait
    if (chunk < end) {
      Lane lane(p, sh, chunk, threadIdx.x);
      lane.issue(p, sh);
      for (;;) {
        const bool more = chunk + 1 < end;
        Lane next(p, sh, more ? chunk + 1 : chunk, threadIdx.x);
        if (more) next.issue(p, sh);
        process(lane);
        if (!more) break;
        lane = next;
        ++chunk;
      }
    }
  } else {
    // four units per lane already keep as many bytes in flight as the next row would add
    for (; chunk < end; ++chunk) {
      Lane lane(p, sh, chunk, threadIdx.x);
      lane.issue(p, sh);
      process(lane);
    }
  }
  __syncthreads();
  if (p.q_weight_partials != nullptr)
    add_group_sums(sums, groups, D, threadIdx.x, p.q_weight_partials + blockIdx.x * D);
  if (p.k_weight_partials != nullptr)
    add_group_sums(sums + groups * D, groups, D, threadIdx.x, p.k_weight_partials + blockIdx.x * D);
}

// ------------------------------------------------------------------------------------------------
// Host: the launch plan and the dispatch to the kernel templates.

struct ProloguePlan {
  PrologueShape sh;
  bool vec16;         // 16-byte vectors (else single elements)
  int units_per_lane; // U: 1 or 4
  int64_t blocks;     // grid: one row per group (forward), or row-walking blocks (backward)
  int smem_bytes;     // backward: [2][groups, D] floats
};

inline bool prologue_params_ok(const RopePrologueParams& p) {
  const RopeParams& r = p.rope;
  if (r.dtype < ROPE_F32 || r.dtype > ROPE_BF16) return false;
  if (r.B < 0 || r.S < 0 || p.Hq < 1 || p.Hk < 1 || r.D < 1) return false;
  if (r.R < 0 || (r.R & 1) || r.R > r.D) return false;
  if ((p.Hq + 2 * p.Hk) * r.D >= (int64_t(1) << 31)) return false;
  if (r.angle_kind != ROPE_ANGLES_TABLE) return false;  // built for position tables only
  if (r.B == 0 || r.S == 0) return true;
  if (p.qkv == nullptr) return false;
  if (r.R > 0 && r.pos_kind != ROPE_POS_OFFSET && r.pos == nullptr) return false;
  if (r.R > 0 && (r.table_rows < 0 || (r.table_rows > 0 && (r.cos_table == nullptr || r.sin_table == nullptr))))
    return false;
  if (p.k_cache != nullptr && (p.v_cache == nullptr || p.slots == nullptr || p.num_slots < 0 ||
                               (p.slots_kind != ROPE_POS_I32 && p.slots_kind != ROPE_POS_I64)))
    return false;
  return true;
}

inline bool aligned_to(const void* ptr, int64_t a) { return (reinterpret_cast<uintptr_t>(ptr) % a) == 0; }

// Whether 16-byte vectors fit every tensor the call reads and writes.
inline bool prologue_vectors_fit(const RopePrologueParams& p, bool backward) {
  const RopeParams& r = p.rope;
  const int64_t elem = r.dtype == ROPE_F32 ? 4 : 2;
  const int64_t E = 16 / elem;
  if (r.D % E != 0 || (r.interleaved ? r.R % E : (r.R / 2) % E) != 0) return false;
  const auto fits = [&](const void* ptr, const int64_t* strides, int n, int64_t a, int64_t el) {
    if (!aligned_to(ptr, a)) return false;
    for (int i = 0; i < n; ++i)
      if ((strides[i] * el) % a != 0) return false;
    return true;
  };
  const int64_t qkv_st[2] = {r.B > 1 ? p.qkv_stride_b : 0, r.S > 1 ? p.qkv_stride_s : 0};
  if (!fits(p.qkv, qkv_st, 2, 16, elem)) return false;
  if (!backward) {
    if (!p.inplace)
      for (int t = 0; t < 3; ++t)
        if (!fits(p.out[t], p.out_stride[t], 3, 16, elem)) return false;
    if (p.k_cache != nullptr) {
      const int64_t ce = p.cache_fp8 ? 1 : elem;
      if (!fits(p.k_cache, p.k_cache_stride, 2, E * ce, ce) || !fits(p.v_cache, p.v_cache_stride, 2, E * ce, ce))
        return false;
    }
  } else {
    const int64_t g_st[2] = {r.B > 1 ? p.grad_qkv_stride_b : 0, r.S > 1 ? p.grad_qkv_stride_s : 0};
    if (!fits(p.grad_qkv, g_st, 2, 16, elem)) return false;
    for (int t = 0; t < 3; ++t)
      if (p.grad[t] != nullptr && !fits(p.grad[t], p.grad_stride[t], 3, 16, elem)) return false;
  }
  const int np = r.interleaved ? (int)E / 2 : (int)E;
  return r.R == 0 || TableAngles::aligned(r, np);
}

// Units per row with E elements per vector; rotary units hold NP pairs.
inline int64_t prologue_units(const RopeParams& r, int64_t E, int64_t& n_rot) {
  const int64_t np = r.interleaved ? (E >= 2 ? E / 2 : 1) : E;
  n_rot = r.R / (2 * np);
  return n_rot + (r.D - r.R) / E;
}

inline bool plan_prologue(const RopePrologueParams& p, const RopeDevice& dev, bool backward,
                          ProloguePlan& plan) {
  const RopeParams& r = p.rope;
  const int64_t elem = r.dtype == ROPE_F32 ? 4 : 2;
  int64_t n_rot = 0, n_units = 0;
  plan.vec16 = prologue_vectors_fit(p, backward);
  if (plan.vec16) n_units = prologue_units(r, 16 / elem, n_rot);
  if (!plan.vec16 || n_units > kPrologueMaxUnits) {
    plan.vec16 = false;
    n_units = prologue_units(r, 1, n_rot);
  }
  if (n_units > kPrologueMaxUnits) return false;
  plan.units_per_lane = n_units <= 32 ? 1 : 4;
  const int64_t per_lane_groups = (n_units + plan.units_per_lane - 1) / plan.units_per_lane;
  int g_log2 = 0;
  while ((int64_t(1) << g_log2) < per_lane_groups) ++g_log2;
  PrologueShape& sh = plan.sh;
  sh.G = 1 << g_log2;
  sh.g_log2 = g_log2;
  sh.n_rot = (int)n_rot;
  sh.n_units = (int)n_units;
  const int64_t groups = kPrologueThreads >> g_log2;  // per block
  const int64_t tokens = r.B * r.S;
  const int64_t sms = dev.num_sms > 0 ? dev.num_sms : 132;
  // q, k and v rows; the forward skips v where it neither writes nor caches it
  const bool v_rows = backward || !p.inplace || p.k_cache != nullptr;
  sh.n_rows = (int)(p.Hq + p.Hk + (v_rows ? p.Hk : 0));
  sh.total = tokens * sh.n_rows;
  const int64_t chunks = (sh.total + groups - 1) / groups;  // blocks of one row per group
  if (chunks >= (int64_t(1) << 31)) return false;
  if (!backward) {
    plan.blocks = chunks;
    plan.smem_bytes = 0;
  } else {
    // enough blocks for every SM's resident slots, each adding up its run of chunks' weight
    // gradients into one row of partial sums; no block without chunks (prologue_block_chunks)
    const int64_t most = kPrologueBackwardBlocksPerSm * sms;
    const int64_t per = chunks > 0 ? (chunks + most - 1) / most : 1;
    plan.blocks = (chunks + per - 1) / per;
    plan.smem_bytes = (int)(2 * groups * r.D * (int64_t)sizeof(float));
  }
  return true;
}

template <typename T, bool NEOX, class A, class Exec>
cudaError_t run_prologue_typed(const RopePrologueParams& p, const ProloguePlan& plan, bool backward,
                               Exec& exec) {
  constexpr int VE = (int)sizeof(T);  // single elements
  if (plan.vec16) {
    if (plan.units_per_lane == 1)
      return backward ? exec.template prologue_backward<T, NEOX, 16, 1, A>(p, plan)
                      : exec.template prologue<T, NEOX, 16, 1, A>(p, plan);
    return backward ? exec.template prologue_backward<T, NEOX, 16, 4, A>(p, plan)
                    : exec.template prologue<T, NEOX, 16, 4, A>(p, plan);
  }
  if (plan.units_per_lane == 1)
    return backward ? exec.template prologue_backward<T, NEOX, VE, 1, A>(p, plan)
                    : exec.template prologue<T, NEOX, VE, 1, A>(p, plan);
  return backward ? exec.template prologue_backward<T, NEOX, VE, 4, A>(p, plan)
                  : exec.template prologue<T, NEOX, VE, 4, A>(p, plan);
}

// Plans and runs the forward or the backward on exec.
template <class Exec>
cudaError_t run_prologue(const RopePrologueParams& p, const RopeDevice& dev, bool backward, Exec& exec) {
  if (!prologue_params_ok(p)) return cudaErrorInvalidValue;
  if (p.rope.B * p.rope.S == 0) return cudaSuccess;
  ProloguePlan plan;
  if (!plan_prologue(p, dev, backward, plan)) return cudaErrorNotSupported;
  // Position tables only (prologue_params_ok): the other sources are not instantiated here.
  using A = TableAngles;
  const bool neox = p.rope.interleaved == 0;
  switch (p.rope.dtype) {
    case ROPE_F32:
      return neox ? run_prologue_typed<float, true, A>(p, plan, backward, exec)
                  : run_prologue_typed<float, false, A>(p, plan, backward, exec);
    case ROPE_F16:
      return neox ? run_prologue_typed<__half, true, A>(p, plan, backward, exec)
                  : run_prologue_typed<__half, false, A>(p, plan, backward, exec);
    default:
      return neox ? run_prologue_typed<__nv_bfloat16, true, A>(p, plan, backward, exec)
                  : run_prologue_typed<__nv_bfloat16, false, A>(p, plan, backward, exec);
  }
}

}  // namespace
}  // namespace rope_ops_cuda
