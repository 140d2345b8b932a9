// The position-to-angle stage: how a token's frequencies get their cos and sin.
//
// Every kernel family is a template on an angle source, a policy type with this interface
// (all static, __host__ __device__):
//
//   kEveryFamily                                         whether every family is built for it;
//                                                        false: the heads family (16-byte
//                                                        vectors) and the generic kernel only
//                                                        (dispatch.h, policy.h)
//   kName                                                for the tests' kernel names
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
// The families own everything else (which thread rotates what, loads, stores). A source is one
// struct here, the RopeParams fields it reads, and its line in with_angles (below). Sources:
//   TableAngles  positions into the float32 table (angle_kind ROPE_ANGLES_TABLE): every family;
//   TokenAngles  the caller's cos/sin per token (ROPE_ANGLES_TOKEN);
//   MropeAngles  three positions per token, one per frequency by mrope_section
//                (ROPE_ANGLES_MROPE).
// The last two are built for the heads family and the generic kernel only: each source is a
// whole set of instantiations (dtypes x styles x schedules), and those two families take every
// call between them.
#pragma once

#include "kernel_common.cuh"

namespace rope_ops_cuda {
namespace {

// Position element i of the int32 or int64 positions.
ROPE_HD int64_t load_position_at(const RopeParams& p, int64_t i) {
  if (p.pos_kind == ROPE_POS_I32) return (int64_t)ldg_ro(static_cast<const int32_t*>(p.pos) + i);
  return (int64_t)ldg_ro(static_cast<const long long*>(p.pos) + i);
}

ROPE_HD int64_t load_position(const RopeParams& p, int64_t b, int64_t s) {
  if (p.pos_kind == ROPE_POS_OFFSET) return p.pos_offset + s;
  return load_position_at(p, b * p.pos_stride_b + s * p.pos_stride_s);
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

// Elements between the tables' rows (RopeParams.table_row_stride; 0 for rows back to back).
ROPE_HD int64_t table_row_stride(const RopeParams& p) {
  return p.table_row_stride != 0 ? p.table_row_stride : (p.R >> 1);
}

// NC consecutive float32 values of cos and sin for frequencies [i0, i0 + NC) at position pos;
// sin negated for the inverse rotation. Table rows only for 0 <= pos < table_rows, and only
// when not computing every row (on_the_fly, which needs freq_turns).
template <int NC>
ROPE_HD void load_cos_sin(const RopeParams& p, int64_t pos, int64_t i0, float* c, float* s,
                          bool on_the_fly = false) {
  on_the_fly = on_the_fly && p.freq_turns != nullptr;
  if (!on_the_fly && pos >= 0 && pos < p.table_rows) {
    const int64_t off = pos * table_row_stride(p) + i0;
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
  static constexpr bool kEveryFamily = true;
  static constexpr const char* kName = "table";
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
    if (p.table_rows > 0 && (!at(p.cos_table, table_align) || !at(p.sin_table, table_align) ||
                             (table_row_stride(p) * 4) % (int64_t)table_align != 0))
      return false;
    return p.freq_turns == nullptr || at(p.freq_turns, 16);
  }

  template <int NC>
  static ROPE_HD void cos_sin(const RopeParams& p, const Token pos, const long long i0, float* c,
                              float* s, const bool on_the_fly = false) {
    load_cos_sin<NC>(p, pos, i0, c, s, on_the_fly);
  }
};

// Value i of a caller table of dtype `dtype` (RopeDType) as float32. Half-precision values are
// loaded as their 16 bits and widened here (exact).
ROPE_HD float load_table_value(const void* table, const int dtype, const int64_t i) {
  if (dtype == ROPE_F32) return ldg_ro(static_cast<const float*>(table) + i);
  const uint32_t bits = ldg_ro(static_cast<const unsigned short*>(table) + i);
  if (dtype == ROPE_BF16) return bit_cast_hd<float>(bits << 16);
  return __half2float(bit_cast_hd<__half>((unsigned short)bits));
}

// Two 16-bit table values packed in a 32-bit word, as float32 (exact).
ROPE_HD void widen_pair(const uint32_t w, const int dtype, float* out) {
  if (dtype == ROPE_BF16) {
    out[0] = bit_cast_hd<float>(w << 16);
    out[1] = bit_cast_hd<float>(w & 0xffff0000u);
  } else {
    out[0] = __half2float(bit_cast_hd<__half>((unsigned short)(w & 0xffffu)));
    out[1] = __half2float(bit_cast_hd<__half>((unsigned short)(w >> 16)));
  }
}

// Values [i, i + NC) of a caller table as float32: 16-byte loads where the caller's row and
// dtype allow them (HF's per-token rows usually do), else one value at a time.
template <int NC>
ROPE_HD void load_table_values(const void* table, const int dtype, const int64_t i, float* out) {
  const int eb = dtype == ROPE_F32 ? 4 : 2;
  const bool vectors = (NC * eb) % 16 == 0 &&
                       ((reinterpret_cast<uintptr_t>(table) + (uintptr_t)(i * eb)) & 15) == 0;
  if (vectors) {
    const uint4* src = reinterpret_cast<const uint4*>(static_cast<const char*>(table) + i * eb);
    if (dtype == ROPE_F32) {
#pragma unroll
      for (int j = 0; j < NC / 4; ++j) {
        const uint4 w = ldg_ro(src + j);
        out[4 * j] = bit_cast_hd<float>(w.x);
        out[4 * j + 1] = bit_cast_hd<float>(w.y);
        out[4 * j + 2] = bit_cast_hd<float>(w.z);
        out[4 * j + 3] = bit_cast_hd<float>(w.w);
      }
    } else if constexpr (NC % 8 == 0) {
#pragma unroll
      for (int j = 0; j < NC / 8; ++j) {
        const uint4 w = ldg_ro(src + j);
        widen_pair(w.x, dtype, out + 8 * j);
        widen_pair(w.y, dtype, out + 8 * j + 2);
        widen_pair(w.z, dtype, out + 8 * j + 4);
        widen_pair(w.w, dtype, out + 8 * j + 6);
      }
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < NC; ++j) out[j] = load_table_value(table, dtype, i + j);
}

// The caller's cos/sin per token: token (b, s) reads row (b, s) of token_cos / token_sin, NC
// values at a time (their strides and alignment are the caller's: load_table_values).
struct TokenAngles {
  static constexpr bool kEveryFamily = false;
  static constexpr const char* kName = "token";
  struct Token {
    long long cos_row, sin_row;  // element offsets of the token's rows
  };

  static ROPE_HD Token token(const RopeParams& p, const long long b, const long long s) {
    return Token{b * p.token_cos_stride_b + s * p.token_cos_stride_s,
                 b * p.token_sin_stride_b + s * p.token_sin_stride_s};
  }

  static ROPE_HD Token token_uniform(const RopeParams& p, const long long t) { return token(p, 0, t); }

  static bool uniform(const RopeParams& p) {
    return p.B == 1 || (p.token_cos_stride_b == p.S * p.token_cos_stride_s &&
                        p.token_sin_stride_b == p.S * p.token_sin_stride_s);
  }

  static bool aligned(const RopeParams&, const int) { return true; }  // element loads

  template <int NC>
  static ROPE_HD void cos_sin(const RopeParams& p, const Token t, const long long i0, float* c,
                              float* s, const bool = false) {
    load_table_values<NC>(p.token_cos, p.token_dtype, t.cos_row + i0, c);
    load_table_values<NC>(p.token_sin, p.token_dtype, t.sin_row + i0, s);
    if (p.inverse) {
#pragma unroll
      for (int j = 0; j < NC; ++j) s[j] = -s[j];
    }
  }
};

// mRoPE: three positions per token (t, h, w); frequency i takes the one of the axis its section
// assigns (rope.h), then its row of the table exactly as TableAngles (on the fly or NaN outside).
struct MropeAngles {
  static constexpr bool kEveryFamily = false;
  static constexpr const char* kName = "mrope";
  struct Token {
    long long t, h, w;  // the positions of the three axes (named fields: an indexed array would
                        // live in local memory)
  };

  static ROPE_HD Token token(const RopeParams& p, const long long b, const long long s) {
    const long long at = b * p.pos_stride_b + s * p.pos_stride_s;
    return Token{load_position_at(p, at), load_position_at(p, at + p.pos_stride_axis),
                 load_position_at(p, at + 2 * p.pos_stride_axis)};
  }

  static ROPE_HD Token token_uniform(const RopeParams& p, const long long t) { return token(p, 0, t); }

  static bool uniform(const RopeParams& p) {
    return p.B == 1 || p.pos_stride_b == p.S * p.pos_stride_s;
  }

  static bool aligned(const RopeParams&, const int) { return true; }  // one frequency at a time

  // The position axis (0 t, 1 h, 2 w) of frequency i: rope_ops._mrope.mrope_axes.
  static ROPE_HD int axis_of(const RopeParams& p, const long long i) {
    if (p.mrope_interleaved) {
      if (i % 3 == 1 && i < 3LL * p.mrope_section[1]) return 1;
      if (i % 3 == 2 && i < 3LL * p.mrope_section[2]) return 2;
      return 0;
    }
    if (i < p.mrope_section[0]) return 0;
    return i < (long long)p.mrope_section[0] + p.mrope_section[1] ? 1 : 2;
  }

  // Whether NC values of a table row (and of freq_turns) starting at a multiple of NC can be
  // read as the vectors load_cos_sin<NC> uses.
  template <int NC>
  static ROPE_HD bool row_vectors_fit(const RopeParams& p) {
    const uintptr_t a = NC % 4 == 0 ? 16 : NC % 2 == 0 ? 8 : 4;
    const uintptr_t tables = reinterpret_cast<uintptr_t>(p.cos_table) | reinterpret_cast<uintptr_t>(p.sin_table) |
                             (uintptr_t)(table_row_stride(p) * 4);
    return (tables & (a - 1)) == 0 && (reinterpret_cast<uintptr_t>(p.freq_turns) & 15) == 0;
  }

  template <int NC>
  static ROPE_HD void cos_sin(const RopeParams& p, const Token t, const long long i0, float* c,
                              float* s, const bool on_the_fly = false) {
    // Chunked sections: a chunk of frequencies inside one section (every chunk, for sections
    // that are multiples of NC, as Qwen2-VL's 16/24/24) reads its row as vectors.
    if (NC > 1 && !p.mrope_interleaved && i0 % NC == 0) {
      const int axis = axis_of(p, i0);
      if (axis == axis_of(p, i0 + NC - 1) && row_vectors_fit<NC>(p)) {
        load_cos_sin<NC>(p, axis == 0 ? t.t : axis == 1 ? t.h : t.w, i0, c, s, on_the_fly);
        return;
      }
    }
#pragma unroll
    for (int j = 0; j < NC; ++j) {
      const int axis = axis_of(p, i0 + j);
      const long long pos = axis == 0 ? t.t : axis == 1 ? t.h : t.w;
      load_cos_sin<1>(p, pos, i0 + j, c + j, s + j, on_the_fly);
    }
  }
};

// f(Source{}) for the angle source of call p: what the policy and the dispatch instantiate.
template <class F>
auto with_angles(const RopeParams& p, F&& f) -> decltype(f(TableAngles{})) {
  if (p.angle_kind == ROPE_ANGLES_TOKEN) return f(TokenAngles{});
  if (p.angle_kind == ROPE_ANGLES_MROPE) return f(MropeAngles{});
  return f(TableAngles{});
}

}  // namespace
}  // namespace rope_ops_cuda
