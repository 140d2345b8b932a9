// The fused attention prologue (prologue.h): QKV split + per-head RMSNorm + rotation + KV-cache
// write, forward and backward. A flat-family kernel: a group of G lanes (a power of two <= 32,
// inside one warp) holds one head row, so a row's sum of squares is a shuffle reduction over the
// group (the backward's shared memory adds up the weights' gradients once per block).
//
// A row is cut into units: rotary units first (NeoX: the E-element vectors at i and R/2 + i, E
// pairs; GPT-J: 2 NP contiguous elements, NP pairs), then pass-through vectors of E elements.
// E = 16 / sizeof(T) (16-byte vectors) where every tensor, the rotary halves and the table reads
// allow it, else 1 (single elements: any head_dim, any even rotary_dim, any alignment). Lane l of
// a group owns units l, l + G, ... (up to U of them), the same units in every row it visits, so
// its cos/sin (and the token's position and cache slot) are loaded once per token and reused for
// all the token's rows. v rows are copied (and cached) through the same units.
//
// Forward grid: (tokens, splits), blocks of 128 threads; the 128 / G groups of a token's `splits`
// blocks walk its rows (q, then k, then v: one launch for all of them and the cache write).
// Backward: blocks walk tokens (a grid of at most 8 per SM), lanes keep their weight-gradient
// sums in registers, and each block writes one row of partial sums ([blocks, D]), which
// rope_prologue_weight_grad_kernel adds up in a fixed order (deterministic).
// With 16-byte vectors and one unit per lane (the common rows: up to 32 units), a lane's next
// rows are staged: copied asynchronously into its own ring in shared memory while it computes the
// current one (the backward's across its tokens), so more bytes are in flight per SM than its
// registers could hold. Staging changes no value: the same bits as loads into registers.
#pragma once

#include <float.h>

#include <cuda_fp8.h>

#include "angle_sources.cuh"
#include "prologue.h"

namespace rope_ops_cuda {
namespace {

constexpr int kPrologueThreads = 128;
constexpr int kPrologueMaxUnits = 128;  // per row: 32 lanes x 4 units
// Stages of a lane's ring of staged rows (0: loads straight into registers): rows STAGES - 1
// ahead are in flight while one is computed (tools/prologue_variants.sh times other counts).
// H100 (2026-12-07, bit-identical outputs; us for the prefill / in-place prefill / training step
// of the NOTES table, without the weight-gradient sums; loads into registers 151.9 / 134.9 /
// 222.5), forward / backward stages: 2 / 2 143.5 / 128.8 / 188.7; 2 / 3 143.6 / 128.6 / 192.1;
// 3 / 6 145.8 / 139.9 / 227.0; 4 / 4 161.4 / 151.6 / 234.7; 8 / 2 163.8 / 153.9 / 203.1. More
// forward stages than 2 cost more than they gain.
constexpr int kPrologueForwardStages = 2;
constexpr int kPrologueBackwardStages = 2;
// The backward's grid: at most this many token-walking blocks per SM (one row of weight-gradient
// partial sums each). Registers let 4 blocks of 128 threads run at once per SM on sm_90, so 8 is
// two waves: a block that finishes early gives its place to the next (tools/prologue_variants.sh
// times other counts).
constexpr int kPrologueBackwardBlocksPerSm = 8;

// Staged: 16-byte vectors and one unit per lane.
constexpr int prologue_stages(bool staged, bool backward) {
  return staged ? (backward ? kPrologueBackwardStages : kPrologueForwardStages) : 0;
}

// 16-byte vectors per unit: NeoX's at i and R/2 + i, GPT-J's pairs in one (pass-through: one).
constexpr int prologue_unit_vectors(bool neox) { return neox ? 2 : 1; }

// What a launch's lanes need to know of the call's shape (host-computed).
struct PrologueShape {
  int G;             // lanes per row
  int g_log2;
  int n_rot;         // rotary units per row (0: no rotation)
  int n_units;       // units per row
  int n_rows;        // rows per token walked: q, k (and v when written or cached)
  int group_stride;  // groups walking one token's rows
  int row_iters;     // rows per group: ceil(n_rows / group_stride)
};

// E elements of T from / to 16-byte vectors (VB 16) or single elements (VB sizeof(T)).
template <typename T, int VB>
struct Elems {
  static constexpr int E = VB / (int)sizeof(T);
  static ROPE_HD void load(const T* ptr, float* f) {
    if constexpr (VB == 16) unpack16<T>(ld_data<HINT_PLAIN>(ptr), f);
    else f[0] = to_f32(*ptr);
  }
  static ROPE_HD void store(T* ptr, const float* f) {
    if constexpr (VB == 16) st_data<HINT_PLAIN>(ptr, pack16<T>(f));
    else *ptr = from_f32<T>(f[0]);
  }
};

// 16-byte copies from global to shared memory that complete asynchronously (sm_80 and later:
// cp.async, cached in L2 only), so that bytes in flight hold no registers; elsewhere (older GPUs,
// the host emulation) a plain copy. A lane waits for its own copies only and reads only what it
// copied: no barrier.
ROPE_HD void copy16_async(uint4* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((unsigned)__cvta_generic_to_shared(dst)),
               "l"(src)
               : "memory");
#else
  *dst = *static_cast<const uint4*>(src);
#endif
}

ROPE_HD void async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of the lane's committed groups of copies are still in flight.
template <int N>
ROPE_HD void async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// A lane's ring: `stages` stages of `slots` 16-byte vectors, `step` vectors apart (on the GPU,
// shared memory with the block's threads adjacent in each slot: conflict-free; in the host
// emulation, the lane's own array with step 1).
struct LaneRing {
  uint4* base;
  int step;
  int slots;
  ROPE_HD uint4* stage(int i) const { return base + (int64_t)i * slots * step; }
};

// float8 e4m3 of x, saturating to +-448; NaN stays NaN (SPEC: float8 cache and q).
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

  // Vectors per unit (16-byte vectors): a ring stage's slots for one row of the lane's unit.
  static constexpr int V = prologue_unit_vectors(NEOX);

  // Copies unit u's vectors of `row` into a ring stage (16-byte vectors), slot at / E.
  static ROPE_HD void stage(uint4* slots, int step, const T* row, const PrologueShape& sh, int64_t R,
                            int u) {
    static_assert(VB == 16, "staged rows are 16-byte vectors");
    vectors(sh, R, u, [&](int64_t off, int at) { copy16_async(slots + (at / E) * step, row + off); });
  }

  // load() from the staged copies.
  static ROPE_HD void load_staged(const uint4* slots, int step, const PrologueShape& sh, int64_t R,
                                  int u, float* x) {
    vectors(sh, R, u, [&](int64_t, int at) { unpack16<T>(slots[(at / E) * step], x + at); });
  }

  static ROPE_HD float sum_sq(const PrologueShape& sh, int u, const float* x, float sum) {
    const int n = count(sh, u);
#pragma unroll
    for (int j = 0; j < W; ++j)
      if (j < n) sum = fmaf(x[j], x[j], sum);
    return sum;
  }

  static ROPE_HD void store(T* row, const PrologueShape& sh, int64_t R, int u, const float* x) {
    vectors(sh, R, u, [&](int64_t off, int at) { X::store(row + off, x + at); });
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

  // load(), and sum plus the sum of squares of the unit's elements.
  static ROPE_HD float load_sum_sq(const T* row, const PrologueShape& sh, int64_t R, int u, float* x,
                                   float sum) {
    load(row, sh, R, u, x);
    return sum_sq(sh, u, x, sum);
  }

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

// cos/sin of a lane's rotary units (lane, lane + G, ...) for token (b, s), from angle source A.
template <int U, int NP, class A>
ROPE_HD void load_lane_angles(const RopePrologueParams& p, const PrologueShape& sh, int lane,
                              int64_t b, int64_t s, float (&c)[U][NP], float (&sn)[U][NP]) {
  if (sh.n_rot == 0) return;
  const typename A::Token tok = A::token(p.rope, b, s);
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const int u = lane + k * sh.G;
    if (u < sh.n_rot) A::template cos_sin<NP>(p.rope, tok, (long long)u * NP, c[k], sn[k]);
  }
}

// Kind of row `row` of a token: 0 q, 1 k, 2 v; its head index within that kind.
ROPE_HD int row_kind(const RopePrologueParams& p, int row, int& head) {
  if (row < p.Hq) { head = row; return 0; }
  if (row < p.Hq + p.Hk) { head = row - (int)p.Hq; return 1; }
  head = row - (int)(p.Hq + p.Hk);
  return 2;
}

// One lane of the forward: a token's units l, l + G, ... of the rows its group walks, one row
// in registers at a time (further rows in flight are staged in shared memory, not held in
// registers: more rows in registers cost more occupancy than they gained. bf16 D 128, one unit
// per lane, H200 (2026-12-02), us per call for a 16384-token prefill / 256-token decode with a
// cache write: 1 row 126.2 / 5.02 (72 registers), 2 rows 158.1 / 6.08 (91), 4 rows 180.2 / 7.09
// (126), 6 rows 248.3 / 7.56 (168).)
template <typename T, bool NEOX, int VB, int U, class A>
struct PrologueLane {
  using Units = PrologueUnits<T, NEOX, VB>;
  static constexpr int NP = Units::NP, W = Units::W;

  int64_t b, s;
  int lane, group;   // lane in the group; the group's index among the token's groups
  int64_t slot;      // the token's cache slot, -1: none
  float c[U][NP], sn[U][NP];
  float x[U][W];
  int row;
  bool active;

  ROPE_HD PrologueLane(const RopePrologueParams& p, const PrologueShape& sh, int64_t token,
                       int first_group, int thread) {
    b = token / p.rope.S;
    s = token - b * p.rope.S;
    lane = thread & (sh.G - 1);
    group = first_group + (thread >> sh.g_log2);
  }

  ROPE_HD int unit(const PrologueShape& sh, int k) const { return lane + k * sh.G; }

  // The token's position -> cos/sin of the lane's rotary units, and its cache slot.
  ROPE_HD void load_token(const RopePrologueParams& p, const PrologueShape& sh) {
    slot = -1;
    if (p.k_cache != nullptr) {
      const int64_t at = b * p.slots_stride_b + s * p.slots_stride_s;
      const int64_t v = p.slots_kind == ROPE_POS_I32
                            ? (int64_t)ldg_ro(static_cast<const int32_t*>(p.slots) + at)
                            : (int64_t)ldg_ro(static_cast<const long long*>(p.slots) + at);
      if (v >= 0 && v < p.num_slots) slot = v;  // any other value: skip, never an address
    }
    load_lane_angles<U, NP, A>(p, sh, lane, b, s, c, sn);
  }

  // Loads row i * group_stride + group of the group's walk; returns the lane's part of its sum
  // of squares.
  ROPE_HD float load_row(const RopePrologueParams& p, const PrologueShape& sh, int i) {
    float part = 0.f;
    if (!begin_row(sh, i)) return part;
    const T* src = qkv_row(p, row);
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int u = unit(sh, k);
      if (u >= sh.n_units) continue;
      part = Units::load_sum_sq(src, sh, p.rope.R, u, x[k], part);
    }
    return part;
  }

  // Row i of the walk into row and active; whether it is one of the token's rows.
  ROPE_HD bool begin_row(const PrologueShape& sh, int i) {
    row = group + i * sh.group_stride;
    active = row < sh.n_rows;
    return active;
  }

  ROPE_HD const T* qkv_row(const RopePrologueParams& p, int r) const {
    return static_cast<const T*>(p.qkv) + b * p.qkv_stride_b + s * p.qkv_stride_s + (int64_t)r * p.rope.D;
  }

  // Staged rows (16-byte vectors, one unit per lane): copies row i of the walk into a ring stage.
  ROPE_HD void stage_row(const RopePrologueParams& p, const PrologueShape& sh, int i, uint4* slots,
                         int step) const {
    const int r = group + i * sh.group_stride, u = unit(sh, 0);
    if (r < sh.n_rows && u < sh.n_units) Units::stage(slots, step, qkv_row(p, r), sh, p.rope.R, u);
  }

  // load_row() from the stage that holds row i.
  ROPE_HD float load_staged_row(const RopePrologueParams& p, const PrologueShape& sh, int i,
                                const uint4* slots, int step) {
    const bool in_walk = begin_row(sh, i);
    const int u = unit(sh, 0);
    if (!in_walk || u >= sh.n_units) return 0.f;
    Units::load_staged(slots, step, sh, p.rope.R, u, x[0]);
    return Units::sum_sq(sh, u, x[0], 0.f);
  }

  // The loaded row's norm, rotation and stores; sum_sq: its sum of squares.
  ROPE_HD void finish_loaded_row(const RopePrologueParams& p, const PrologueShape& sh, float sum_sq) {
    if (active) finish_row(p, sh, row, x, sum_sq);
  }

  // Norm, rotation and stores of loaded row `r` (values v); `sum_sq` is its sum of squares.
  ROPE_HD void finish_row(const RopePrologueParams& p, const PrologueShape& sh, int r, float (&v)[U][W],
                          float sum_sq) {
    int head;
    const int kind = row_kind(p, r, head);
    const int64_t R = p.rope.R;
    if (kind < 2) {
      const void* w = kind == 0 ? p.q_weight : p.k_weight;
      if (w != nullptr) {
        const float rstd = 1.0f / sqrtf(sum_sq / (float)p.rope.D + p.eps);
#pragma unroll
        for (int k = 0; k < U; ++k) {
          const int u = unit(sh, k);
          if (u >= sh.n_units) continue;
          float wk[W];
          Units::weights(w, p.weights_like_qkv != 0, p.weight_offset, sh, R, u, wk);
#pragma unroll
          for (int j = 0; j < W; ++j) v[k][j] = v[k][j] * rstd * wk[j];
        }
      }
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (unit(sh, k) < sh.n_rot) Units::rotate(v[k], c[k], sn[k]);
    }
    // a float8 q: never in place (prologue_params_ok); its element strides are bytes
    if (kind == 0 && p.q_scale > 0.f) {
      uint8_t* dst = static_cast<uint8_t*>(p.out[0]) + b * p.out_stride[0][0] + s * p.out_stride[0][1] +
                     head * p.out_stride[0][2];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int u = unit(sh, k);
        if (u < sh.n_units) Units::store_e4m3_unit(dst, sh, R, u, v[k], p.q_scale);
      }
    } else if (kind < 2 || !p.inplace) {
      T* dst = p.inplace ? static_cast<T*>(const_cast<void*>(p.qkv)) + b * p.qkv_stride_b +
                               s * p.qkv_stride_s + (int64_t)r * p.rope.D
                         : static_cast<T*>(p.out[kind]) + b * p.out_stride[kind][0] +
                               s * p.out_stride[kind][1] + head * p.out_stride[kind][2];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int u = unit(sh, k);
        if (u < sh.n_units) Units::store(dst, sh, R, u, v[k]);
      }
    }
    if (kind > 0 && slot >= 0) {
      const int64_t* st = kind == 1 ? p.k_cache_stride : p.v_cache_stride;
      const int64_t at = slot * st[0] + head * st[1];
      void* cache = kind == 1 ? p.k_cache : p.v_cache;
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int u = unit(sh, k);
        if (u >= sh.n_units) continue;
        if (p.cache_fp8)
          Units::store_e4m3_unit(static_cast<uint8_t*>(cache) + at, sh, R, u, v[k],
                                 kind == 1 ? p.k_scale : p.v_scale);
        else
          Units::store(static_cast<T*>(cache) + at, sh, R, u, v[k]);
      }
    }
  }
};

// Shared memory of the prologue kernels: the lanes' rings, then (backward) the block's sums.
extern __shared__ uint4 prologue_smem[];

template <typename T, bool NEOX, int VB, int U, class A>
__global__ void __launch_bounds__(kPrologueThreads)
    rope_prologue_kernel(const RopePrologueParams p, const PrologueShape sh) {
  using Lane = PrologueLane<T, NEOX, VB, U, A>;
  constexpr int ST = prologue_stages(VB == 16 && U == 1, false);
  Lane lane(p, sh, blockIdx.x, blockIdx.y * (kPrologueThreads >> sh.g_log2), threadIdx.x);
  wait_for_previous_grid();
  if constexpr (ST == 0) {
    lane.load_token(p, sh);
    for (int i = 0; i < sh.row_iters; ++i) {  // the same count for every lane: shuffles stay uniform
      const float part = lane.load_row(p, sh, i);
      lane.finish_loaded_row(p, sh, group_sum(part, sh.G));
    }
  } else {
    // the first rows' copies issued before the token's position -> cos/sin chain
    const LaneRing ring{prologue_smem + threadIdx.x, kPrologueThreads, Lane::Units::V};
    for (int i = 0; i < ST - 1; ++i) {
      if (i < sh.row_iters) lane.stage_row(p, sh, i, ring.stage(i), ring.step);
      async_commit();
    }
    lane.load_token(p, sh);
    for (int i = 0; i < sh.row_iters; ++i) {
      const int ahead = i + ST - 1;
      if (ahead < sh.row_iters) lane.stage_row(p, sh, ahead, ring.stage(ahead % ST), ring.step);
      async_commit();
      async_wait<ST - 1>();  // row i's copies have landed
      const float part = lane.load_staged_row(p, sh, i, ring.stage(i % ST), ring.step);
      lane.finish_loaded_row(p, sh, group_sum(part, sh.G));
    }
  }
}

// One lane of the backward: like the forward's, over the tokens its block walks, with its
// weight-gradient sums.
template <typename T, bool NEOX, int VB, int U, class A>
struct PrologueGradLane {
  using Units = PrologueUnits<T, NEOX, VB>;
  static constexpr int NP = Units::NP, W = Units::W;

  int64_t b, s;
  int lane, group;
  float c[U][NP], sn[U][NP];
  float g[U][W], n[U][W];
  float q_sum[U][W], k_sum[U][W];  // this lane's sums of g * n, per weight element
  int row, kind, head;
  bool active, normed;
  float rstd;

  ROPE_HD PrologueGradLane(const PrologueShape& sh, int thread) {
    lane = thread & (sh.G - 1);
    group = thread >> sh.g_log2;
#pragma unroll
    for (int k = 0; k < U; ++k)
#pragma unroll
      for (int j = 0; j < W; ++j) q_sum[k][j] = k_sum[k][j] = 0.f;
  }

  ROPE_HD int unit(const PrologueShape& sh, int k) const { return lane + k * sh.G; }

  ROPE_HD void load_token(const RopePrologueParams& p, const PrologueShape& sh, int64_t token) {
    b = token / p.rope.S;
    s = token - b * p.rope.S;
    load_lane_angles<U, NP, A>(p, sh, lane, b, s, c, sn);
  }

  // Row r's output gradient (null: zero) and input, for the token (tb, ts).
  static ROPE_HD const T* grad_row(const RopePrologueParams& p, int kd, int h, int64_t tb, int64_t ts) {
    const T* g = static_cast<const T*>(p.grad[kd]);
    if (g != nullptr) g += tb * p.grad_stride[kd][0] + ts * p.grad_stride[kd][1] + h * p.grad_stride[kd][2];
    return g;
  }
  static ROPE_HD const T* input_row(const RopePrologueParams& p, int r, int64_t tb, int64_t ts) {
    return static_cast<const T*>(p.qkv) + tb * p.qkv_stride_b + ts * p.qkv_stride_s + (int64_t)r * p.rope.D;
  }
  // Whether rows of kind kd are normalised (their weight is given).
  static ROPE_HD bool normed_kind(const RopePrologueParams& p, int kd) {
    return kd < 2 && (kd == 0 ? p.q_weight : p.k_weight) != nullptr;
  }

  // Row i of the walk: row, active, kind and head (normed false until the caller sets it); false
  // past the token's rows.
  ROPE_HD bool begin_row(const RopePrologueParams& p, const PrologueShape& sh, int i) {
    row = group + i * sh.group_stride;
    active = row < sh.n_rows;
    normed = false;
    if (!active) return false;
    kind = row_kind(p, row, head);
    return true;
  }

  // Loads the output gradient of row i, rotated back (p.rope.inverse), and the input row where
  // it is normalised; returns the lane's part of the input's sum of squares.
  ROPE_HD float load_row(const RopePrologueParams& p, const PrologueShape& sh, int i) {
    float sum = 0.f;
    if (!begin_row(p, sh, i)) return sum;
    const int64_t R = p.rope.R;
    const T* gsrc = grad_row(p, kind, head, b, s);
    normed = normed_kind(p, kind);
    const T* xsrc = input_row(p, row, b, s);
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int u = unit(sh, k);
      if (u >= sh.n_units) continue;
      if (gsrc != nullptr) {
        Units::load(gsrc, sh, R, u, g[k]);
      } else {
#pragma unroll
        for (int j = 0; j < W; ++j) g[k][j] = 0.f;
      }
      if (kind < 2 && u < sh.n_rot) Units::rotate(g[k], c[k], sn[k]);
      if (normed) sum = Units::load_sum_sq(xsrc, sh, R, u, n[k], sum);
    }
    return sum;
  }

  // Staged rows (16-byte vectors, one unit per lane): copies row i's output gradient and, where
  // it is normalised, its input into a ring stage (slots: gradient vectors, then input vectors);
  // (pb, ps): the token of that row, ahead of the lane's. The addresses are grad_row's and
  // input_row's, written out: through those helpers nvcc emits different code for this kernel
  // (two more registers in float32), which the staging measurements did not time.
  ROPE_HD void stage_row(const RopePrologueParams& p, const PrologueShape& sh, int64_t pb, int64_t ps,
                         int i, uint4* slots, int step) const {
    const int r = group + i * sh.group_stride, u = unit(sh, 0);
    if (r >= sh.n_rows || u >= sh.n_units) return;
    int h;
    const int kd = row_kind(p, r, h);
    const int64_t R = p.rope.R;
    const T* gsrc = static_cast<const T*>(p.grad[kd]);
    if (gsrc != nullptr)
      Units::stage(slots, step,
                   gsrc + pb * p.grad_stride[kd][0] + ps * p.grad_stride[kd][1] + h * p.grad_stride[kd][2], sh,
                   R, u);
    if (kd < 2 && (kd == 0 ? p.q_weight : p.k_weight) != nullptr)
      Units::stage(slots + Units::V * step, step,
                   static_cast<const T*>(p.qkv) + pb * p.qkv_stride_b + ps * p.qkv_stride_s + (int64_t)r * p.rope.D,
                   sh, R, u);
  }

  // load_row() from the stage that holds row i.
  ROPE_HD float load_staged_row(const RopePrologueParams& p, const PrologueShape& sh, int i,
                                const uint4* slots, int step) {
    if (!begin_row(p, sh, i)) return 0.f;
    normed = normed_kind(p, kind);
    const int u = unit(sh, 0);
    if (u >= sh.n_units) return 0.f;
    const int64_t R = p.rope.R;
    if (p.grad[kind] != nullptr) {
      Units::load_staged(slots, step, sh, R, u, g[0]);
    } else {
#pragma unroll
      for (int j = 0; j < W; ++j) g[0][j] = 0.f;
    }
    if (kind < 2 && u < sh.n_rot) Units::rotate(g[0], c[0], sn[0]);
    if (!normed) return 0.f;
    Units::load_staged(slots + Units::V * step, step, sh, R, u, n[0]);
    return Units::sum_sq(sh, u, n[0], 0.f);
  }

  // n = x * rstd, the weight-gradient sums, g = g * (offset + w); returns the lane's part of
  // sum(g * n).
  ROPE_HD float norm_row(const RopePrologueParams& p, const PrologueShape& sh, float sum_sq) {
    float dot = 0.f;
    if (!active || !normed) return dot;
    rstd = 1.0f / sqrtf(sum_sq / (float)p.rope.D + p.eps);
    const void* w = kind == 0 ? p.q_weight : p.k_weight;
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int u = unit(sh, k);
      if (u >= sh.n_units) continue;
      float wk[W];
      Units::weights(w, p.weights_like_qkv != 0, p.weight_offset, sh, p.rope.R, u, wk);
      const int cnt = Units::count(sh, u);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        if (j >= cnt) continue;
        n[k][j] *= rstd;
        if (kind == 0) q_sum[k][j] = fmaf(g[k][j], n[k][j], q_sum[k][j]);
        else k_sum[k][j] = fmaf(g[k][j], n[k][j], k_sum[k][j]);
        g[k][j] *= wk[j];
        dot = fmaf(g[k][j], n[k][j], dot);
      }
    }
    return dot;
  }

  // grad_x = rstd * (g - n * mean(g * n)) (normalised rows) or g, into grad_qkv.
  ROPE_HD void finish_row(const RopePrologueParams& p, const PrologueShape& sh, float dot) {
    if (!active) return;
    const float mean = dot / (float)p.rope.D;
    T* dst = static_cast<T*>(p.grad_qkv) + b * p.grad_qkv_stride_b + s * p.grad_qkv_stride_s +
             (int64_t)row * p.rope.D;
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

  // The lane's sums of one weight (q's or k's) into its group's row of the block's [groups, D]
  // scratch. (One template per weight: selecting the array at run time would put it in local
  // memory.)
  template <bool Q>
  ROPE_HD void put_sums(const RopePrologueParams& p, const PrologueShape& sh, float* scratch) const {
    float* dst = scratch + (int64_t)group * p.rope.D;
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int u = unit(sh, k);
      if (u >= sh.n_units) continue;
      Units::vectors(sh, p.rope.R, u, [&](int64_t off, int at) {
#pragma unroll
        for (int j = 0; j < Units::E; ++j) dst[off + j] = Q ? q_sum[k][at + j] : k_sum[k][at + j];
      });
    }
  }
};

// The backward's staging, ST - 1 row iterations ahead of the lane's walk across its block's
// tokens (first, first + stride, ...): the next (token, row iteration) to stage, and its stage.
struct StagedWalk {
  int64_t token, b, s;
  int i = 0, stage = 0;

  ROPE_HD StagedWalk(const RopeParams& r, int64_t first) : token(first) { split(r); }

  ROPE_HD void split(const RopeParams& r) {
    b = token / r.S;
    s = token - b * r.S;
  }

  // Stages the next row iteration, if any, and commits one group of copies (empty or not: the
  // consumer's wait counts groups).
  template <int ST, class Lane>
  ROPE_HD void stage_next(const RopePrologueParams& p, const PrologueShape& sh, const Lane& lane,
                          const LaneRing& ring, int64_t tokens, int64_t stride) {
    if (token < tokens) {
      lane.stage_row(p, sh, b, s, i, ring.stage(stage), ring.step);
      if (++i == sh.row_iters) {
        i = 0;
        token += stride;
        split(p.rope);
      }
    }
    async_commit();
    stage = stage + 1 == ST ? 0 : stage + 1;
  }
};

// Thread t's share of a block's partial sums: element d (t, t + 128, ...) of the block's row,
// the groups' rows of the scratch added in order.
ROPE_HD void add_group_sums(const float* scratch, int groups, int64_t D, int thread, float* out_row) {
  for (int64_t d = thread; d < D; d += kPrologueThreads) {
    float total = 0.f;
    for (int gi = 0; gi < groups; ++gi) total += scratch[gi * D + d];
    out_row[d] = total;
  }
}

template <typename T, bool NEOX, int VB, int U, class A>
__global__ void __launch_bounds__(kPrologueThreads)
    rope_prologue_backward_kernel(const RopePrologueParams p, const PrologueShape sh) {
  using Lane = PrologueGradLane<T, NEOX, VB, U, A>;
  constexpr int ST = prologue_stages(VB == 16 && U == 1, true);
  float* scratch = reinterpret_cast<float*>(prologue_smem);  // [groups, D]: the block's sums, after the walk
  Lane lane(sh, threadIdx.x);
  wait_for_previous_grid();
  const int64_t tokens = p.rope.B * p.rope.S;
  if constexpr (ST == 0) {
    for (int64_t token = blockIdx.x; token < tokens; token += gridDim.x) {
      lane.load_token(p, sh, token);
      for (int i = 0; i < sh.row_iters; ++i) {
        const float sum_sq = group_sum(lane.load_row(p, sh, i), sh.G);
        const float dot = group_sum(lane.norm_row(p, sh, sum_sq), sh.G);
        lane.finish_row(p, sh, dot);
      }
    }
  } else {
    const LaneRing ring{prologue_smem + threadIdx.x, kPrologueThreads, 2 * Lane::Units::V};
    StagedWalk ahead(p.rope, blockIdx.x);
    for (int k = 0; k < ST - 1; ++k) ahead.stage_next<ST>(p, sh, lane, ring, tokens, gridDim.x);
    int stage = 0;
    for (int64_t token = blockIdx.x; token < tokens; token += gridDim.x) {
      lane.load_token(p, sh, token);
      for (int i = 0; i < sh.row_iters; ++i) {
        ahead.stage_next<ST>(p, sh, lane, ring, tokens, gridDim.x);
        async_wait<ST - 1>();  // row i's copies have landed
        const float sum_sq = group_sum(lane.load_staged_row(p, sh, i, ring.stage(stage), ring.step), sh.G);
        const float dot = group_sum(lane.norm_row(p, sh, sum_sq), sh.G);
        lane.finish_row(p, sh, dot);
        stage = stage + 1 == ST ? 0 : stage + 1;
      }
    }
    // No copy is in flight (none is staged past the walk); the rings become the scratch.
    __syncthreads();
  }
  const int groups = kPrologueThreads >> sh.g_log2;
  if (p.q_weight_partials != nullptr) {
    lane.template put_sums<true>(p, sh, scratch);
    __syncthreads();
    add_group_sums(scratch, groups, p.rope.D, threadIdx.x, p.q_weight_partials + blockIdx.x * p.rope.D);
    __syncthreads();
  }
  if (p.k_weight_partials != nullptr) {
    lane.template put_sums<false>(p, sh, scratch);
    __syncthreads();
    add_group_sums(scratch, groups, p.rope.D, threadIdx.x, p.k_weight_partials + blockIdx.x * p.rope.D);
  }
}

// The weights' gradients from the backward's [rows, D] partial sums: a block of 32 columns x 32
// row lanes per weight and 32 columns; row lane r adds rows r, r + 32, ... and the column's 32
// lane sums are added in order: the same bits every run, in two launches' time rather than a
// general reduction's.
constexpr int kWeightGradCols = 32;
constexpr int kWeightGradRowLanes = 32;

ROPE_HD float weight_grad_lane_sum(const float* partials, int64_t rows, int64_t D, int64_t d, int lane) {
  float sum = 0.f;
  for (int64_t i = lane; i < rows; i += kWeightGradRowLanes) sum += partials[i * D + d];
  return sum;
}

ROPE_HD float weight_grad_total(const float (&lanes)[kWeightGradRowLanes][kWeightGradCols + 1], int c) {
  float total = 0.f;
#pragma unroll
  for (int r = 0; r < kWeightGradRowLanes; ++r) total += lanes[r][c];
  return total;
}

// Grid (ceil(D / 32), 2): y 0 q's weight, 1 k's.
__global__ void __launch_bounds__(kWeightGradCols * kWeightGradRowLanes)
    rope_prologue_weight_grad_kernel(const RopePrologueParams p, int64_t rows) {
  __shared__ float lanes[kWeightGradRowLanes][kWeightGradCols + 1];
  const float* partials = blockIdx.y == 0 ? p.q_weight_partials : p.k_weight_partials;
  float* out = blockIdx.y == 0 ? p.q_weight_grad : p.k_weight_grad;
  wait_for_previous_grid();
  if (partials == nullptr || out == nullptr) return;  // the whole block
  const int c = threadIdx.x % kWeightGradCols, r = threadIdx.x / kWeightGradCols;
  const int64_t D = p.rope.D, d = (int64_t)blockIdx.x * kWeightGradCols + c;
  lanes[r][c] = d < D ? weight_grad_lane_sum(partials, rows, D, d, r) : 0.f;
  __syncthreads();
  if (r == 0 && d < D) out[d] = weight_grad_total(lanes, c);
}

// ------------------------------------------------------------------------------------------------
// Host: the launch plan and the dispatch to the kernel templates.

struct ProloguePlan {
  PrologueShape sh;
  bool vec16;         // 16-byte vectors (else single elements)
  int units_per_lane; // U: 1 or 4
  int64_t blocks;     // grid x: tokens (forward) or token-walking blocks (backward)
  int splits;         // grid y (forward)
  int smem_bytes;     // the lanes' rings; backward: at least [groups, D] floats
};

inline bool prologue_params_ok(const RopePrologueParams& p) {
  const RopeParams& r = p.rope;
  if (r.dtype < ROPE_F32 || r.dtype > ROPE_BF16) return false;
  if (r.B < 0 || r.S < 0 || p.Hq < 1 || p.Hk < 1 || r.D < 1) return false;
  if (r.R < 0 || (r.R & 1) || r.R > r.D) return false;
  if ((p.Hq + 2 * p.Hk) * r.D >= (int64_t(1) << 31)) return false;
  // q_scale: 0 (q of qkv's dtype), or a finite positive float32 for a float8 q out of place
  if (!(p.q_scale >= 0.f && p.q_scale <= FLT_MAX) || (p.q_scale > 0.f && p.inplace)) return false;
  if (r.angle_kind != ROPE_ANGLES_TABLE) return false;  // built for position tables only
  if (r.B == 0 || r.S == 0) return true;
  if (p.qkv == nullptr) return false;
  if (r.R > 0 && r.pos_kind != ROPE_POS_OFFSET && r.pos == nullptr) return false;
  if (r.R > 0 && (r.table_rows < 0 || r.table_row_stride < 0 ||
                  (r.table_rows > 0 && (r.cos_table == nullptr || r.sin_table == nullptr))))
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
      for (int t = 0; t < 3; ++t) {
        const int64_t oe = t == 0 && p.q_scale > 0.f ? 1 : elem;  // float8 q: E-byte vectors
        if (!fits(p.out[t], p.out_stride[t], 3, E * oe, oe)) return false;
      }
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

// Shared memory of the lanes' rings: stages x (gradient and) input vectors of a unit x threads.
inline int prologue_ring_bytes(const ProloguePlan& plan, const RopeParams& r, bool backward) {
  const int stages = prologue_stages(plan.vec16 && plan.units_per_lane == 1, backward);
  return stages * (backward ? 2 : 1) * prologue_unit_vectors(r.interleaved == 0) * kPrologueThreads * 16;
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
  if (!backward) {
    const bool v_rows = !p.inplace || p.k_cache != nullptr;
    sh.n_rows = (int)(p.Hq + p.Hk + (v_rows ? p.Hk : 0));
    // few tokens: a token's rows over several blocks, so that every SM gets some
    const int64_t most = (sh.n_rows + groups - 1) / groups;  // splits that give every group a row
    const int64_t wanted = tokens > 0 ? (4 * sms + tokens - 1) / tokens : 1;
    plan.splits = (int)(wanted < most ? wanted : most);
    if (plan.splits < 1) plan.splits = 1;
    sh.group_stride = (int)(groups * plan.splits);
    plan.blocks = tokens;
    plan.smem_bytes = prologue_ring_bytes(plan, r, false);
    if (tokens >= (int64_t(1) << 31)) return false;
  } else {
    sh.n_rows = (int)(p.Hq + 2 * p.Hk);
    sh.group_stride = (int)groups;
    plan.splits = 1;
    const int64_t most_blocks = kPrologueBackwardBlocksPerSm * sms;
    plan.blocks = tokens < most_blocks ? tokens : most_blocks;
    const int64_t sums = groups * r.D * (int64_t)sizeof(float);
    const int64_t ring = prologue_ring_bytes(plan, r, true);
    plan.smem_bytes = (int)(sums > ring ? sums : ring);
  }
  sh.row_iters = (int)((sh.n_rows + sh.group_stride - 1) / sh.group_stride);
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
  cudaError_t err;
  switch (p.rope.dtype) {
    case ROPE_F32:
      err = neox ? run_prologue_typed<float, true, A>(p, plan, backward, exec)
                 : run_prologue_typed<float, false, A>(p, plan, backward, exec);
      break;
    case ROPE_F16:
      err = neox ? run_prologue_typed<__half, true, A>(p, plan, backward, exec)
                 : run_prologue_typed<__half, false, A>(p, plan, backward, exec);
      break;
    default:
      err = neox ? run_prologue_typed<__nv_bfloat16, true, A>(p, plan, backward, exec)
                 : run_prologue_typed<__nv_bfloat16, false, A>(p, plan, backward, exec);
  }
  const bool sums = (p.q_weight_partials != nullptr && p.q_weight_grad != nullptr) ||
                    (p.k_weight_partials != nullptr && p.k_weight_grad != nullptr);
  if (err != cudaSuccess || !backward || !sums) return err;
  return exec.prologue_weight_grads(p, plan.blocks);
}

}  // namespace
}  // namespace rope_ops_cuda
