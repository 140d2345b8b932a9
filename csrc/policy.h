// Which kernel runs a call: choose(), a pure function of the call (shape, dtype, strides,
// alignment) and the device (SM count, compute capability; RopeDevice). No state: the same call
// on the same device always gets the same configuration.
//
// The rules, in order (numbers: H200, 2026-12-01, NOTES.md):
//  1. 16-byte vectors must fit (aligned bases, strides and rotary halves in whole vectors); where
//     only 8-byte ones do (bf16 rotary halves of 24 bytes: GPT-NeoX-20B's rotary 24), the heads
//     family with 8-byte vectors; else the generic kernel (one thread per pair).
//  2. Decode-sized calls (fewer 16-byte chunks than 2048 per SM: less than one full wave of
//     threads at one chunk each) are latency-bound: the flat kernel, a block per token (q and k
//     together), data loads issued before the position -> cos/sin chain; when the tokens are too
//     few to give every SM a block, a token's vectors are split over several blocks.
//     W2: 2.91 us against 3.21 for the heads family.
//  3. In place with NeoX pairs and pass-through dims, rotary rows of at least 128 bytes: the rows
//     kernel (W3's shape with NeoX pairs: 20.61 us against 21.83). Otherwise in place: heads.
//  4. Out of place, NeoX, flat blocks of at least 8 KB on average (a block's fixed cost is paid per
//     block: W4 and W5 at 8-9 KB per block win with it, W1 at 5 KB (2 KB k blocks) loses):
//     the lean kernel where it can take the call, else the flat kernel.
//  5. Otherwise the heads family, with as many heads per thread as keep 2048 threads per SM
//     (up to 4; 6 with 64 or more heads per token, where more rows share a thread's fixed work;
//     GPT-J: up to 8 heads in rounds of 4 with plain loads, 4096 threads per SM).
// Rows on the fly (cos/sin from freq_turns instead of the table) are never chosen: they measured
// slower or within noise on every class. PDL is on wherever the device and build allow it.
// Angle sources built for the heads family and the generic kernel only (per-token cos/sin, mRoPE:
// angle_sources.cuh) get those families' configurations of the same rules
// (choose_heads_or_generic).
//
// candidates.h lists the alternatives for the benchmark tooling; its timings are what these
// thresholds are to be fitted to.
#pragma once

#include "kernel_flat.cuh"
#include "kernel_generic.cuh"
#include "kernel_heads.cuh"
#include "kernel_rows.cuh"

namespace rope_ops_cuda {
namespace {

constexpr int64_t kDecodeChunksPerSM = 2048;   // rule 2
constexpr int64_t kRowsMinRotaryBytes = 128;   // rule 3
constexpr int64_t kFlatMinBlockBytes = 8192;   // rule 4
constexpr int64_t kManyHeads = 64;             // rule 5

inline bool tensor_vectors_fit(const void* ptr, const int64_t* st, int64_t B, int64_t S, int64_t H,
                               int64_t V, int64_t vector_bytes) {
  if ((reinterpret_cast<uintptr_t>(ptr) & (vector_bytes - 1)) != 0 || st[3] != 1) return false;
  if (B > 1 && st[0] % V != 0) return false;
  if (S > 1 && st[1] % V != 0) return false;
  if (H > 1 && st[2] % V != 0) return false;
  return true;
}

inline int64_t elem_bytes(const RopeParams& p) { return p.dtype == ROPE_F32 ? 4 : 2; }

// What the families need of a call before any can take it, and what the rules read.
struct CallFacts {
  int64_t V;          // elements per 16-byte vector
  int64_t tokens, heads;
  int64_t chunks;     // the heads family's threads at one head per thread
  bool nothing;       // no tokens or no heads
  bool vectors;       // 16-byte vectors fit (the heads, flat, lean and rows families)
  bool vectors8;      // 8-byte vectors fit (the heads family)
  bool neox, in_place;
  bool decode;        // rule 2
};

inline bool params_ok(const RopeParams& p) {
  if (p.dtype < ROPE_F32 || p.dtype > ROPE_BF16) return false;
  if (p.B < 0 || p.S < 0 || p.Hq < 0 || p.Hk < 0) return false;
  if (p.R <= 0 || (p.R & 1) || p.R > p.D) return false;
  if (p.B == 0 || p.S == 0) return true;  // nothing to do; empty tensors may have null data
  if (p.Hq > 0 && (p.q == nullptr || p.q_out == nullptr)) return false;
  if (p.Hk > 0 && (p.k == nullptr || p.k_out == nullptr)) return false;
  if (p.pos_kind != ROPE_POS_OFFSET && p.pos == nullptr) return false;
  if (p.table_rows < 0 || p.table_row_stride < 0) return false;
  if (p.pos_kind < ROPE_POS_OFFSET || p.pos_kind > ROPE_POS_I64) return false;
  if (p.table_rows > 0 && (p.cos_table == nullptr || p.sin_table == nullptr)) return false;
  if (p.angle_kind == ROPE_ANGLES_TOKEN) {
    if (p.token_cos == nullptr || p.token_sin == nullptr) return false;
    if (p.token_dtype < ROPE_F32 || p.token_dtype > ROPE_BF16) return false;
  } else if (p.angle_kind == ROPE_ANGLES_MROPE) {
    if (p.pos_kind == ROPE_POS_OFFSET) return false;  // three positions per token, from a tensor
    const int* sec = p.mrope_section;
    if (sec[0] < 0 || sec[1] < 0 || sec[2] < 0 || (int64_t)sec[0] + sec[1] + sec[2] != p.R / 2) return false;
  } else if (p.angle_kind != ROPE_ANGLES_TABLE) {
    return false;
  }
  return true;
}

// Whether every tensor, the rotary halves (pairs, GPT-J) and the pass-through dims are whole
// vectors of `vector_bytes`, and the table reads suit them.
inline bool vectors_fit(const RopeParams& p, const int64_t vector_bytes) {
  const int64_t V = vector_bytes / elem_bytes(p);
  bool fit = p.interleaved ? p.R % V == 0 : (p.R / 2) % V == 0;
  if (p.copy_passthrough && p.D % V != 0) fit = false;
  if (p.Hq > 0 && (!tensor_vectors_fit(p.q, p.q_stride, p.B, p.S, p.Hq, V, vector_bytes) ||
                   !tensor_vectors_fit(p.q_out, p.q_out_stride, p.B, p.S, p.Hq, V, vector_bytes)))
    fit = false;
  if (p.Hk > 0 && (!tensor_vectors_fit(p.k, p.k_stride, p.B, p.S, p.Hk, V, vector_bytes) ||
                   !tensor_vectors_fit(p.k_out, p.k_out_stride, p.B, p.S, p.Hk, V, vector_bytes)))
    fit = false;
  return fit && with_angles(p, [&](auto angles) {
           return decltype(angles)::aligned(p, (int)(p.interleaved ? V / 2 : V));
         });
}

inline CallFacts facts_of(const RopeParams& p, const RopeDevice& dev) {
  CallFacts f{};
  f.V = 16 / elem_bytes(p);
  f.tokens = p.B * p.S;
  f.heads = p.Hq + p.Hk;
  f.nothing = f.tokens == 0 || f.heads == 0;
  f.neox = !p.interleaved;
  f.in_place = !p.copy_passthrough;
  f.vectors = vectors_fit(p, 16);
  f.vectors8 = vectors_fit(p, 8);
  const int64_t V = f.vectors || !f.vectors8 ? f.V : f.V / 2;  // the heads family's vectors
  const int64_t rotary_chunks = f.neox ? (p.R / 2) / V : p.R / V;
  const int64_t copy_chunks = (p.copy_passthrough && p.D > p.R) ? (p.D - p.R) / V : 0;
  f.chunks = f.tokens * f.heads * (rotary_chunks + copy_chunks);
  f.decode = f.chunks < (int64_t)dev.num_sms * kDecodeChunksPerSM;
  return f;
}

// The lean kernel's conditions (kernel_flat.cuh) for the call's angle source.
inline bool lean_fits(const RopeParams& p, const int64_t V) {
  return with_angles(p, [&](auto angles) { return lean_ok<decltype(angles)>(p, V); });
}

inline RopeConfig config_of(const int family, const RopeDevice& dev) {
  RopeConfig c{};
  c.family = family;
  c.vector_bytes = 16;
  c.pdl = dev.pdl;
  return c;
}

// The most heads per thread, up to `most`, that still give every SM `threads_per_sm` threads.
inline int heads_for_grid(const RopeParams& p, const CallFacts& f, const RopeDevice& dev,
                          const int most, const int64_t threads_per_sm) {
  const int64_t per_lane = f.chunks / f.heads;  // threads per head lane
  for (int u = most; u > 1; --u) {
    if ((f.heads + u - 1) / u * per_lane >= (int64_t)dev.num_sms * threads_per_sm) return u;
  }
  return 1;
}

// u heads per thread make ceil(heads / u) head lanes per token; the fewest heads per thread that
// make as many lanes names that launch (for 9 heads, 4 and 3 per thread are the same launch).
inline int canonical_heads(const int u, const int64_t heads) {
  const int64_t lanes = (heads + u - 1) / u;
  return (int)((heads + lanes - 1) / lanes);
}

inline RopeConfig heads_config(const RopeParams& p, const CallFacts& f, const RopeDevice& dev,
                               const int schedule, const int most, const int64_t threads_per_sm,
                               const int block_threads) {
  RopeConfig c = config_of(ROPE_HEADS, dev);
  c.schedule = schedule;
  c.heads_per_thread = canonical_heads(heads_for_grid(p, f, dev, most, threads_per_sm), f.heads);
  c.block_threads = block_threads;
  return c;
}

// Rule 2's blocks: q and k of a token together when they fit one block; split over several
// blocks, as few vectors per thread as give every SM a block, when the tokens are fewer.
inline RopeConfig decode_flat_config(const RopeParams& p, const CallFacts& f, const RopeDevice& dev) {
  RopeConfig c = config_of(ROPE_FLAT, dev);
  c.flat_blocks = flat_blocks_fit(p, f.V, ROPE_FLAT_JOINT, 0) ? ROPE_FLAT_JOINT : ROPE_FLAT_SEPARATE;
  if (f.tokens * 2 < dev.num_sms) {
    const int64_t vectors = f.heads * (p.D / f.V);  // a token's
    c.flat_blocks = ROPE_FLAT_SPLIT;
    c.vectors = 1;
    for (const int u : {4, 2}) {
      if (f.tokens * ((vectors + kFlatThreads * u - 1) / (kFlatThreads * u)) >= dev.num_sms) {
        c.vectors = u;
        break;
      }
    }
  }
  return c;
}

// Whether every family is built for the call's angle source (angle_sources.cuh); if not, only
// the heads family with 16-byte vectors and the generic kernel.
inline bool every_family(const RopeParams& p) {
  return with_angles(p, [](auto angles) { return decltype(angles)::kEveryFamily; });
}

// The rules for a source built for the heads family and the generic kernel only: rule 1 without
// the 8-byte heads kernels, rules 2-4 with the heads family's configurations. Not yet timed on
// a GPU.
inline RopeConfig choose_heads_or_generic(const RopeParams& p, const CallFacts& f, const RopeDevice& dev) {
  if (!f.vectors) return config_of(ROPE_GENERIC, dev);
  if (f.decode) return heads_config(p, f, dev, ROPE_PIPE2_STREAM, 2, 128, 256);
  if (f.in_place || f.neox) {
    if (f.neox && f.heads >= kManyHeads) return heads_config(p, f, dev, ROPE_PIPE2_STREAM, 6, 2048, 128);
    return heads_config(p, f, dev, ROPE_PIPE2_STREAM, 4, 2048, f.in_place ? 128 : 256);
  }
  return heads_config(p, f, dev, ROPE_ROUNDS4_PLAIN, 8, 4096, 128);
}

inline RopeConfig choose(const RopeParams& p, const RopeDevice& dev) {
  const CallFacts f = facts_of(p, dev);
  if (f.nothing) return config_of(ROPE_NOTHING, dev);
  if (!every_family(p)) return choose_heads_or_generic(p, f, dev);
  if (!f.vectors) {  // rule 1
    if (!f.vectors8) return config_of(ROPE_GENERIC, dev);
    RopeConfig c = f.decode ? heads_config(p, f, dev, ROPE_PIPE2_STREAM, 2, 128, 256)
                   : f.neox ? heads_config(p, f, dev, ROPE_PIPE2_STREAM, 4, 2048, 256)
                            : heads_config(p, f, dev, ROPE_ROUNDS4_PLAIN, 8, 4096, 128);
    c.vector_bytes = 8;
    return c;
  }
  if (f.decode) {  // rule 2
    if (flat_ok(p, f.V)) return decode_flat_config(p, f, dev);
    return heads_config(p, f, dev, ROPE_PIPE2_STREAM, 2, 128, 256);
  }
  if (f.in_place) {  // rule 3
    if (f.neox && p.R < p.D && p.R * elem_bytes(p) >= kRowsMinRotaryBytes && rows_fits(p, f.V))
      return config_of(ROPE_ROWS, dev);
    return heads_config(p, f, dev, ROPE_PIPE2_STREAM, 4, 2048, 128);
  }
  if (f.neox && flat_ok(p, f.V)) {  // rule 4
    const int64_t blocks_per_token = p.Hq > 0 && p.Hk > 0 ? 2 : 1;
    if (f.heads * p.D * elem_bytes(p) >= kFlatMinBlockBytes * blocks_per_token) {
      if (lean_fits(p, f.V)) return config_of(ROPE_LEAN, dev);
      RopeConfig c = config_of(ROPE_FLAT, dev);
      c.flat_blocks = ROPE_FLAT_SEPARATE;
      return c;
    }
  }
  if (f.neox) {  // rule 5
    if (f.heads >= kManyHeads) return heads_config(p, f, dev, ROPE_PIPE2_STREAM, 6, 2048, 128);
    return heads_config(p, f, dev, ROPE_PIPE2_STREAM, 4, 2048, 256);
  }
  return heads_config(p, f, dev, ROPE_ROUNDS4_PLAIN, 8, 4096, 128);
}

}  // namespace
}  // namespace rope_ops_cuda
