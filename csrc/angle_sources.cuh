// The position-to-angle stage: how a token's frequencies get their cos and sin.
//
// Every kernel family is a template on an angle source, a policy type with this interface
// (all static, __host__ __device__):
//
//   using Token = ...;                                   what the second call needs of a token
//   Token token(const RopeParams& p, b, s);              token (b, s) of the [B, S] view: its
//                                                        position load heads the longest chain,
//                                                        so families issue it early
//   Token token_uniform(const RopeParams& p, t);         token t when uniform(p): no (b, s)
//                                                        split (token(p, 0, t), cheapest first)
//   bool uniform(const RopeParams& p);                   host: token t's angles are at t
//   bool aligned(const RopeParams& p, int nc);           host: reads of nc values fit
//   template <int NC> void cos_sin(p, token, i0, c, s, on_the_fly)
//                                                        c[j], s[j] = m*cos, m*sin of frequency
//                                                        i0 + j (j < NC), s negated for inverse
//
// The families own everything else (which thread rotates what, loads, stores). A new source is
// one struct here, the RopeParams fields it reads, and its line in with_angles (below): caller
// cos/sin given per token would read cos[b * stride_b + s * stride_s + i] in cos_sin with
// Token = (b, s); mRoPE would keep three positions in Token and pick, per frequency, the one of
// the axis its section assigns.
#pragma once

#include "kernel_common.cuh"

namespace rope_ops_cuda {
namespace {

ROPE_HD int64_t load_position(const RopeParams& p, int64_t b, int64_t s) {
  if (p.pos_kind == ROPE_POS_I32) {
    return (int64_t)ldg_ro(static_cast<const int32_t*>(p.pos) + b * p.pos_stride_b + s * p.pos_stride_s);
  }
  if (p.pos_kind == ROPE_POS_I64) {
    return (int64_t)ldg_ro(static_cast<const long long*>(p.pos) + b * p.pos_stride_b +
                          s * p.pos_stride_s);
  }
  return p.pos_offset + s;
}

// m*cos and m*sin of frequency i at integer position pos, from fixed-point turns:
// turns64 = pos * freq_turns[i] (wrapping), its top 32 bits as a signed int32 are turns * 2^32,
// so the angle is pi * (top * 2^-31); sincospif does the reduction exactly.
ROPE_HD void cos_sin_on_the_fly(int64_t pos, unsigned long long ft, float m, float& c,
                                float& s) {
  const unsigned long long t = (unsigned long long)pos * ft;
  const int32_t top = (int32_t)(uint32_t)(t >> 32);
  sincospif((float)top * 4.656612873077392578125e-10f /* 2^-31 */, &s, &c);
  c *= m;
  s *= m;
}

// NC consecutive fixed-point frequencies [i0, i0 + NC) (16-byte loads when NC is even; i0 is
// then even, so the address is 16-byte aligned).
template <int NC>
ROPE_HD void load_freq_turns(const int64_t* freq_turns, int64_t i0, unsigned long long* f) {
  const long long* src = (const long long*)freq_turns + i0;
  if constexpr (NC % 2 == 0) {
#pragma unroll
    for (int j = 0; j < NC; j += 2) {
      const longlong2 v = ldg_ro(reinterpret_cast<const longlong2*>(src + j));
      f[j] = (unsigned long long)v.x;
      f[j + 1] = (unsigned long long)v.y;
    }
  } else {
#pragma unroll
    for (int j = 0; j < NC; ++j) f[j] = (unsigned long long)ldg_ro(src + j);
  }
}

// NC consecutive float32 values of cos and sin for frequencies [i0, i0 + NC) at position pos;
// sin negated for the inverse rotation. Table rows only for 0 <= pos < table_rows, and only
// when not computing every row (on_the_fly, which needs freq_turns).
template <int NC>
ROPE_HD void load_cos_sin(const RopeParams& p, int64_t pos, int64_t i0, float* c, float* s,
                          bool on_the_fly = false) {
  on_the_fly = on_the_fly && p.freq_turns != nullptr;
  if (!on_the_fly && pos >= 0 && pos < p.table_rows) {
    const int64_t off = pos * (p.R >> 1) + i0;
    if constexpr (NC % 4 == 0) {
#pragma unroll
      for (int j = 0; j < NC; j += 4) {
        const float4 cv = ldg_ro(reinterpret_cast<const float4*>(p.cos_table + off + j));
        const float4 sv = ldg_ro(reinterpret_cast<const float4*>(p.sin_table + off + j));
        c[j] = cv.x; c[j + 1] = cv.y; c[j + 2] = cv.z; c[j + 3] = cv.w;
        s[j] = sv.x; s[j + 1] = sv.y; s[j + 2] = sv.z; s[j + 3] = sv.w;
      }
    } else if constexpr (NC % 2 == 0) {
#pragma unroll
      for (int j = 0; j < NC; j += 2) {
        const float2 cv = ldg_ro(reinterpret_cast<const float2*>(p.cos_table + off + j));
        const float2 sv = ldg_ro(reinterpret_cast<const float2*>(p.sin_table + off + j));
        c[j] = cv.x; c[j + 1] = cv.y;
        s[j] = sv.x; s[j + 1] = sv.y;
      }
    } else {
#pragma unroll
      for (int j = 0; j < NC; ++j) {
        c[j] = ldg_ro(p.cos_table + off + j);
        s[j] = ldg_ro(p.sin_table + off + j);
      }
    }
  } else if (p.freq_turns != nullptr) {
    unsigned long long f[NC];
    load_freq_turns<NC>(p.freq_turns, i0, f);
#pragma unroll
    for (int j = 0; j < NC; ++j) cos_sin_on_the_fly(pos, f[j], p.attention_factor, c[j], s[j]);
  } else {
    const float nan = bit_cast_hd<float>(0x7fffffffu);
#pragma unroll
    for (int j = 0; j < NC; ++j) {
      c[j] = nan;
      s[j] = nan;
    }
  }
  if (p.inverse) {
#pragma unroll
    for (int j = 0; j < NC; ++j) s[j] = -s[j];
  }
}

// Positions (an int offset, or int32/int64 tensors with (b, s) strides) into the float32
// cos/sin table; rows outside [0, table_rows) from freq_turns, or NaN without them.
struct TableAngles {
  using Token = long long;  // the token's position

  static ROPE_HD Token token(const RopeParams& p, const long long b, const long long s) {
    return load_position(p, b, s);
  }

  // Token t's position is at t * pos_stride_s (or is pos_offset + t): see uniform().
  static ROPE_HD Token token_uniform(const RopeParams& p, const long long t) {
    return p.pos_kind == ROPE_POS_OFFSET ? p.pos_offset + t : load_position(p, 0, t);
  }

  static bool uniform(const RopeParams& p) {
    return p.B == 1 || (p.pos_kind != ROPE_POS_OFFSET && p.pos_stride_b == p.S * p.pos_stride_s);
  }

  // The table's rows are read in 16-byte pieces (NC floats at i0, a multiple of NC), freq_turns
  // in 16-byte pairs.
  static bool aligned(const RopeParams& p, const int nc) {
    const uintptr_t table_align = nc % 4 == 0 ? 16 : nc % 2 == 0 ? 8 : 4;
    const auto at = [](const void* ptr, uintptr_t a) { return (reinterpret_cast<uintptr_t>(ptr) & (a - 1)) == 0; };
    if (p.table_rows > 0 && (!at(p.cos_table, table_align) || !at(p.sin_table, table_align))) return false;
    return p.freq_turns == nullptr || at(p.freq_turns, 16);
  }

  template <int NC>
  static ROPE_HD void cos_sin(const RopeParams& p, const Token pos, const long long i0, float* c,
                              float* s, const bool on_the_fly = false) {
    load_cos_sin<NC>(p, pos, i0, c, s, on_the_fly);
  }
};

// f(Source{}) for the angle source of call p: what the policy and the dispatch instantiate.
template <class F>
decltype(auto) with_angles(const RopeParams& p, F&& f) {
  (void)p;  // one source so far: positions into the table
  return f(TableAngles{});
}

}  // namespace
}  // namespace rope_ops_cuda
