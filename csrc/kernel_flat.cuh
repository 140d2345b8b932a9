// Flat family (ROPE_FLAT, ROPE_LEAN): a block of 128 threads per token's q or k rows, read and
// written like a copy kernel's block.
//
// Needs 16-byte vectors (policy.h vectors_fit), each tensor's rows of a token contiguous (head
// stride D, or one head) and rows of VPR = D / V vectors with VPR a power of two <= 32, so that a
// row lies within one warp. Thread t owns vector c = t % VPR of rows t / VPR,
// t / VPR + 128 / VPR, ... (up to 8 vectors), so it loads one position and one cos/sin chunk.
// NeoX takes the other halves of its pairs from the lane R / 2V away by a shuffle; GPT-J pairs
// lie within a vector. Plain loads and stores.
//
// Why: a copy kernel reaches the driver copy's speed with ~4 KB per block and plain loads, and
// loses 3-6 % with ld.global.cs or 8-16 KB per block (H200, 2026-12-01); the heads family moves
// ~24 KB per block with evict-first loads. Measured against it (x a same-bytes copy, one
// process): W5 1.027 against 1.045, W4 forward 1.057 against 1.064, W2 2.91 us against 3.21
// (joint blocks); W1 (GQA: 2 KB k blocks) 1.086-1.137 against 1.058.
//
// Blocks (RopeFlatBlocks): separate (a block per token and tensor; k blocks follow q blocks
// token by token), joint (a token's q and k rows in one block: decode, where a block's start-up
// is paid per block) and split (a token's q-then-k vectors cut into blocks of 128 * U: calls of
// a few tokens, whose joint grid would leave most SMs idle).
//
// Lean kernel (ROPE_LEAN): the common case written with only the generality it needs: whole
// NeoX rows (R == D) of dense [tokens, H, D] tensors, H * VPR a whole number of warps, uniform
// positions, table rows (no rows on the fly). W4 forward 1.042-1.046 x copy against
// 1.053-1.057 for the flat kernel, backward 1.043-1.050 against 1.054-1.059, W5 a tie, outputs
// bit for bit equal (H200, 2026-12-01). It reads its row stride as blockDim.x at run time: the
// same source with the constant 128 ran W4's forward at 1.044-1.046 x copy instead of
// 1.027-1.030 (the two differ in SASS only in scheduling and in reading the block's q or k
// pointer by a uniform constant load; the cause is not known).
#pragma once

#include "angle_sources.cuh"

namespace rope_ops_cuda {
namespace {

constexpr int kFlatThreads = 128;
constexpr int kFlatMaxVectors = 8;  // vectors per thread: H * VPR <= 1024 per tensor

struct FlatShape {
  int vpr_log2;     // log2 of the vectors per row (D / V)
  int rot;          // rotary vectors per row: R / V
  int copy;         // 1: copy the pass-through vectors (out of place)
  int both;         // q and k present: even blocks do q, odd blocks k (separate blocks)
  int tok32;        // B * S and S fit in 31 bits: 32-bit token decomposition
  int tok_uniform;  // every tensor's token t starts at t * stride[1] (tokens_uniform)
  int pos_uniform;  // Angles::uniform: token t's angles need no (b, s) split
  int joint;        // one block per token for q and k together (joint or split blocks)
};

// A block's lifetime is short (2-16 KB of data), so whatever sits between its start and its data
// loads costs bandwidth: with uniform token strides (the common layouts) the data addresses need
// no division, and the position and cos/sin row are fetched after the data loads are issued.
// (H200: a 64-bit token division ahead of the loads cost 4 % on W1.)
template <typename T, bool NEOX, int BLOCKS, class Angles>
struct FlatThread {
  static constexpr int V = VecInfo<T>::kVec;
  static constexpr int NC = NEOX ? V : V / 2;  // cos/sin floats per vector
  static constexpr bool JOINT = BLOCKS != ROPE_FLAT_SEPARATE;
  // The block's vectors j: [0, nq) from src_a / dst_a, [nq, nv) from src_b / dst_b (the k rows
  // of a joint block; separate blocks have nq == nv). Split blocks take [j0, j0 + 128 * U).
  const T* src_a;
  const T* src_b;
  T* dst_a;
  T* dst_b;
  long long tok;
  int nq, nv;
  int c;     // this thread's vector within every row it visits
  int half;  // NeoX: lanes between the two halves of a pair (R / 2V)
  bool rot, active;
  typename Angles::Token pos;
  float cs[NC], sn[NC];

  // bid: the block (split blocks: the token; which part of it is the body's j0).
  ROPE_HD FlatThread(const RopeParams& p, const FlatShape& f, const long long bid, const int t) {
    constexpr bool joint = JOINT;
    const bool isq = joint || (f.both ? (bid & 1) == 0 : p.Hq > 0);
    tok = joint || !f.both ? bid : bid >> 1;
    nq = (int)(isq ? p.Hq : p.Hk) << f.vpr_log2;
    nv = joint ? nq + ((int)p.Hk << f.vpr_log2) : nq;
    c = t & ((1 << f.vpr_log2) - 1);
    half = f.rot >> 1;
    rot = c < f.rot;
    active = rot || f.copy != 0;
    long long b = 0, s = tok;
    if (!f.tok_uniform) split_token(p, f.tok32 != 0, tok, b, s);
    // token offset: tok * stride[1] when uniform (no division ahead of the loads)
    const auto at = [&](const int64_t* st) { return f.tok_uniform ? tok * st[1] : b * st[0] + s * st[1]; };
    src_a = static_cast<const T*>(isq ? p.q : p.k) + at(isq ? p.q_stride : p.k_stride);
    dst_a = static_cast<T*>(isq ? p.q_out : p.k_out) + at(isq ? p.q_out_stride : p.k_out_stride);
    src_b = src_a;
    dst_b = dst_a;
    if (joint) {
      src_b = static_cast<const T*>(p.k) + at(p.k_stride);
      dst_b = static_cast<T*>(p.k_out) + at(p.k_out_stride);
    }
    wait_for_previous_grid();  // the index math above overlaps the previous kernel's tail (PDL)
  }

  // The position (after the data loads: see above).
  ROPE_HD void load_pos(const RopeParams& p, const FlatShape& f) {
    if (!rot) {
      pos = typename Angles::Token{};
    } else if (f.pos_uniform) {
      pos = Angles::token_uniform(p, tok);
    } else {
      long long b, s;
      split_token(p, f.tok32 != 0, tok, b, s);
      pos = Angles::token(p, b, s);
    }
  }

  ROPE_HD bool has(const int j) const { return active && j < nv; }
  ROPE_HD uint4 load(const int j) const {
    return ld_data<HINT_PLAIN>(!JOINT || j < nq ? src_a + (long long)j * V
                                                : src_b + (long long)(j - nq) * V);
  }

  // After the data loads, so that they are in flight while the position arrives.
  ROPE_HD void load_cs(const RopeParams& p, const bool fly) {
    if (!rot) return;
    const int chunk = NEOX ? (c < half ? c : c - half) : c;
    Angles::template cos_sin<NC>(p, pos, (long long)chunk * NC, cs, sn, fly);
    if (NEOX && c < half) {  // first half: x' = x c - y s; second half: y' = y c + x s
#pragma unroll
      for (int i = 0; i < NC; ++i) sn[i] = -sn[i];
    }
  }

  // The lane holding the other halves of this lane's NeoX pairs (rows are whole in a warp).
  ROPE_HD int partner(const int lane) const { return c < half ? lane + half : lane - half; }

  // own: this thread's vector j; other: the partner lane's vector (NeoX only).
  ROPE_HD void finish(const int j, const uint4& own, const uint4& other) const {
    T* out = !JOINT || j < nq ? dst_a + (long long)j * V : dst_b + (long long)(j - nq) * V;
    if (!rot) {
      st_data<HINT_PLAIN>(out, own);
      return;
    }
    float x[V], o[V];
    unpack16<T>(own, x);
    if constexpr (NEOX) {
      float y[V];
      unpack16<T>(other, y);
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] = fmaf(x[i], cs[i], y[i] * sn[i]);
    } else {
#pragma unroll
      for (int i = 0; i < V / 2; ++i) {
        o[2 * i] = fmaf(x[2 * i], cs[i], -x[2 * i + 1] * sn[i]);
        o[2 * i + 1] = fmaf(x[2 * i + 1], cs[i], x[2 * i] * sn[i]);
      }
    }
    st_data<HINT_PLAIN>(out, pack16<T>(o));
  }
};

// Split blocks: block bid takes vectors [j0, j0 + 128 * U) of token bid / parts (q's then k's).
struct FlatSplit {
  FastDiv parts;  // blocks per token
  int parts_n;
};

ROPE_HD void split_block(const FlatSplit& s, const int U, const long long bid, long long& tok, int& j0) {
  tok = fast_div(s.parts, (uint32_t)bid);
  j0 = (int)(bid - tok * s.parts_n) * kFlatThreads * U;
}

template <typename T, bool NEOX, int U, int BLOCKS, class Angles>
__device__ __forceinline__ void flat_block_body(const RopeParams& p, const FlatShape& f,
                                                const int on_the_fly, const FlatSplit& split) {
  const int t = threadIdx.x;
  long long block = blockIdx.x;
  int j0 = 0;
  if constexpr (BLOCKS == ROPE_FLAT_SPLIT) split_block(split, U, blockIdx.x, block, j0);
  FlatThread<T, NEOX, BLOCKS, Angles> th(p, f, block, t);
  uint4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int j = j0 + t + u * kFlatThreads;
    v[u] = th.has(j) ? th.load(j) : make_uint4(0, 0, 0, 0);
  }
  th.load_pos(p, f);
  th.load_cs(p, on_the_fly != 0);
  const int lane = t & 31;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int j = j0 + t + u * kFlatThreads;
    if (j0 + (t & ~31) + u * kFlatThreads >= th.nv) break;  // warp-uniform: shuffles need every lane
    uint4 other = v[u];
    if constexpr (NEOX) {
      const int from = th.partner(lane);
      other.x = __shfl_sync(0xffffffffu, v[u].x, from);
      other.y = __shfl_sync(0xffffffffu, v[u].y, from);
      other.z = __shfl_sync(0xffffffffu, v[u].z, from);
      other.w = __shfl_sync(0xffffffffu, v[u].w, from);
    }
    if (th.has(j)) th.finish(j, v[u], other);
  }
}

template <typename T, bool NEOX, int U, int BLOCKS, class Angles>
__global__ void __launch_bounds__(kFlatThreads)
    rope_flat_kernel(const __grid_constant__ RopeParams p, const FlatShape f, const int on_the_fly) {
  flat_block_body<T, NEOX, U, BLOCKS, Angles>(p, f, on_the_fly, FlatSplit{});
}

template <typename T, bool NEOX, int U, class Angles>
__global__ void __launch_bounds__(kFlatThreads)
    rope_flat_split_kernel(const __grid_constant__ RopeParams p, const FlatShape f,
                           const int on_the_fly, const FlatSplit split) {
  flat_block_body<T, NEOX, U, ROPE_FLAT_SPLIT, Angles>(p, f, on_the_fly, split);
}

// ------------------------------------------------------------------------------------------------
// Lean kernel. One block of kLeanThreads per token's q or k rows; thread t owns vector
// c = t % VPR of rows t / VPR + u * kLeanThreads / VPR, so one position and one cos/sin chunk;
// the other halves of its pairs come from lane c ^ VPR / 2 by a shuffle.

constexpr int kLeanThreads = 128;

struct LeanShape {
  int vpr_log2;  // log2 of the vectors per row (D / V), 1..5
  int both;      // q and k present: even blocks do q, odd blocks k
};

// A lean block's rows: token tok's q rows (or k rows: even blocks q, odd blocks k when both).
struct LeanBlock {
  long long tok;
  const uint4* src;
  uint4* dst;
  int nv;  // vectors
};

ROPE_HD LeanBlock lean_block(const RopeParams& p, const LeanShape& f, const unsigned bid) {
  LeanBlock b;
  b.tok = f.both ? (long long)(bid >> 1) : (long long)bid;
  const bool isk = f.both ? (bid & 1) != 0 : p.Hq == 0;
  b.nv = (int)(isk ? p.Hk : p.Hq) << f.vpr_log2;
  b.src = static_cast<const uint4*>(isk ? p.k : p.q) + b.tok * b.nv;
  b.dst = static_cast<uint4*>(isk ? p.k_out : p.q_out) + b.tok * b.nv;
  return b;
}

// Thread t's cos/sin chunk: its column c = t % VPR takes the frequencies of c % (VPR / 2).
// half: VPR / 2 (the lane holding the other halves of the pairs is lane ^ half); first: c is in
// the first half of the row.
template <typename T, class Angles>
ROPE_HD void lean_angles(const RopeParams& p, const LeanShape& f, const long long tok, const int t,
                         int& half, bool& first, float* cs, float* sn) {
  constexpr int V = VecInfo<T>::kVec;
  half = 1 << (f.vpr_log2 - 1);
  const int c = t & ((2 * half) - 1);
  first = c < half;
  const typename Angles::Token pos = Angles::token(p, 0, tok);  // uniform: see lean_ok
  Angles::template cos_sin<V>(p, pos, (long long)(c & (half - 1)) * V, cs, sn);
}

// own: the thread's vector; other: lane ^ half's (the other halves of its pairs). x, y, r:
// scratch of V floats, declared by the caller where the rotation happens (ptxas schedules the
// kernel differently when they are this function's own).
template <typename T>
ROPE_HD uint4 lean_rotate(const uint4& own, const uint4& other, const float* cs, const float* sn,
                          const bool first, float* x, float* y, float* r) {
  constexpr int V = VecInfo<T>::kVec;
  unpack16<T>(own, x);
  unpack16<T>(other, y);
  // first half: x c - y s; second: x c + y s (as the flat kernel's negated sin: same bits)
#pragma unroll
  for (int i = 0; i < V; ++i) r[i] = first ? fmaf(x[i], cs[i], -y[i] * sn[i]) : fmaf(x[i], cs[i], y[i] * sn[i]);
  return pack16<T>(r);
}

template <typename T, int U, class Angles>
__global__ void __launch_bounds__(2 * kLeanThreads)
    rope_lean_kernel(const __grid_constant__ RopeParams p, const LeanShape f) {
  constexpr int V = VecInfo<T>::kVec;
  wait_for_previous_grid();
  const int nthreads = (int)blockDim.x;  // == kLeanThreads; see the top of this file
  const LeanBlock blk = lean_block(p, f, blockIdx.x);
  const int t = (int)threadIdx.x;
  const int warp_base = t & ~31;
  uint4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (warp_base + u * nthreads < blk.nv) v[u] = blk.src[t + u * nthreads];
  int half;
  bool first;
  float cs[V], sn[V];
  lean_angles<T, Angles>(p, f, blk.tok, t, half, first, cs, sn);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (warp_base + u * nthreads < blk.nv) {  // warp-uniform: the shuffles need every lane
      uint4 o;
      o.x = __shfl_xor_sync(0xffffffffu, v[u].x, half);
      o.y = __shfl_xor_sync(0xffffffffu, v[u].y, half);
      o.z = __shfl_xor_sync(0xffffffffu, v[u].z, half);
      o.w = __shfl_xor_sync(0xffffffffu, v[u].w, half);
      float x[V], y[V], r[V];
      blk.dst[t + u * nthreads] = lean_rotate<T>(v[u], o, cs, sn, first, x, y, r);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// host side

// log2 of the vectors per row, D / V (a power of two on the flat path).
inline int vectors_per_row_log2(const RopeParams& p, const int64_t V) {
  int vpr_log2 = 0;
  while ((V << vpr_log2) < p.D) ++vpr_log2;
  return vpr_log2;
}

inline bool flat_tensor_ok(const int64_t* st, int64_t H, int64_t D) { return H <= 1 || st[2] == D; }

// Whether the flat kernel can take p (already known to suit 16-byte vectors): see the top.
inline bool flat_ok(const RopeParams& p, int64_t V) {
  if (p.D % V != 0) return false;
  const int64_t vpr = p.D / V;
  if (vpr > 32 || (vpr & (vpr - 1)) != 0) return false;
  if ((p.Hq > p.Hk ? p.Hq : p.Hk) * vpr > (int64_t)kFlatThreads * kFlatMaxVectors) return false;
  if (p.Hq > 0 && (!flat_tensor_ok(p.q_stride, p.Hq, p.D) || !flat_tensor_ok(p.q_out_stride, p.Hq, p.D)))
    return false;
  if (p.Hk > 0 && (!flat_tensor_ok(p.k_stride, p.Hk, p.D) || !flat_tensor_ok(p.k_out_stride, p.Hk, p.D)))
    return false;
  return p.B * p.S * 2 <= 0x7fffffffLL;  // blocks
}

// A flat launch: the kernel's shape, its blocks and the vectors per thread (before rounding up
// to an instantiated U).
struct FlatPlan {
  FlatShape f;
  FlatSplit split;
  int64_t blocks;
  int vectors_per_thread;
};

template <class Angles>
FlatPlan plan_flat(const RopeParams& p, const int64_t V, const int blocks_kind, const int split_vectors) {
  const int64_t tokens = p.B * p.S;
  const bool both = p.Hq > 0 && p.Hk > 0;
  const int vpr_log2 = vectors_per_row_log2(p, V);
  const bool joint = blocks_kind != ROPE_FLAT_SEPARATE;
  FlatPlan plan;
  plan.f = {vpr_log2,
            (int)(p.R / V),
            p.copy_passthrough ? 1 : 0,
            both ? 1 : 0,
            (tokens <= 0x7fffffffLL && p.S <= 0x7fffffffLL) ? 1 : 0,
            tokens_uniform(p) ? 1 : 0,
            Angles::uniform(p) ? 1 : 0,
            joint ? 1 : 0};
  const int64_t total = (p.Hq + p.Hk) << vpr_log2;  // a token's vectors, q and k
  const int64_t most = joint ? total : (p.Hq > p.Hk ? p.Hq : p.Hk) << vpr_log2;  // per block
  plan.split = {};
  if (blocks_kind == ROPE_FLAT_SPLIT) {
    const int64_t per_block = (int64_t)kFlatThreads * split_vectors;
    const int64_t parts = (total + per_block - 1) / per_block;
    plan.split = {make_fast_div((uint32_t)parts), (int)parts};
    plan.blocks = tokens * parts;
    plan.vectors_per_thread = split_vectors;
  } else {
    plan.blocks = tokens * (both && !joint ? 2 : 1);
    plan.vectors_per_thread = (int)((most + kFlatThreads - 1) / kFlatThreads);
  }
  return plan;
}

// Whether flat blocks of this kind fit the call (beyond flat_ok): joint blocks hold all of a
// token's vectors; split blocks 1, 2 or 4 vectors per thread, blocks within 31 bits.
inline bool flat_blocks_fit(const RopeParams& p, const int64_t V, const int blocks_kind,
                            const int split_vectors) {
  const int64_t total = (p.Hq + p.Hk) * (p.D / V);
  if (blocks_kind == ROPE_FLAT_SEPARATE) return true;
  if (blocks_kind == ROPE_FLAT_JOINT)
    return p.Hq > 0 && p.Hk > 0 && total <= (int64_t)kFlatThreads * kFlatMaxVectors;
  if (blocks_kind != ROPE_FLAT_SPLIT || !(split_vectors == 1 || split_vectors == 2 || split_vectors == 4))
    return false;
  const int64_t per_block = (int64_t)kFlatThreads * split_vectors;
  return p.B * p.S * ((total + per_block - 1) / per_block) <= 0x7fffffffLL;
}

// Whether the lean kernel can take p, already known to suit the flat kernel (flat_ok: D / V a
// power of two <= 32, head stride D, at most kFlatMaxVectors vectors per thread of kFlatThreads,
// blocks within 31 bits; NeoX halves of whole vectors, so D / V >= 2). See the top of the file.
static_assert(kLeanThreads == kFlatThreads, "lean_ok relies on flat_ok's vectors-per-thread bound");
template <class Angles>
bool lean_ok(const RopeParams& p, const int64_t V) {
  if (p.interleaved || p.R != p.D) return false;
  const int64_t vpr = p.D / V;
  // whole warps of vectors: a warp loads, shuffles and stores all or nothing
  if ((p.Hq * vpr) % 32 != 0 || (p.Hk * vpr) % 32 != 0) return false;
  // token t's rows of a tensor at t * H * D (flat_ok: heads at stride D)
  const auto dense = [&](const int64_t* st, const int64_t H) {
    return (p.S <= 1 || st[1] == H * p.D) && (p.B <= 1 || st[0] == p.S * H * p.D);
  };
  if (p.Hq > 0 && (!dense(p.q_stride, p.Hq) || !dense(p.q_out_stride, p.Hq))) return false;
  if (p.Hk > 0 && (!dense(p.k_stride, p.Hk) || !dense(p.k_out_stride, p.Hk))) return false;
  return Angles::uniform(p);
}

inline LeanShape plan_lean(const RopeParams& p, const int64_t V) {
  return {vectors_per_row_log2(p, V), (p.Hq > 0 && p.Hk > 0) ? 1 : 0};
}

}  // namespace
}  // namespace rope_ops_cuda
