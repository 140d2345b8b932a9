// rope_ops CUDA kernels (see rope_kernels.h for the contract and NOTES.md for the design).
//
// Needs only the CUDA runtime headers, so CI compiles it with plain `nvcc -arch=sm_90 -c`.
// Do not compile with --use_fast_math: the on-the-fly rows rely on accurate sincospif.
#include "rope_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <string.h>
#ifdef ROPE_HOST_EMULATION
#include <new>
#endif

// Every per-thread function is __host__ __device__: the kernels are thin loops around them, and
// `-DROPE_HOST_EMULATION` adds rope_host_emulate(), which runs the very same per-thread code on
// the CPU over host pointers (tests/test_cuda_host_emulation.py uses it where no GPU exists).
#define ROPE_HD __host__ __device__ __forceinline__

namespace rope_ops_cuda {
namespace {

constexpr int kMaxThreads = 256;  // most threads per block (launch bounds of both kernels)

// ------------------------------------------------------------------------------------------------
// Tuning. DEFAULTS PER CALL CLASS: edit kDefaultConfig after `gpu_cuda_check.py --perf-only
// --sweep` (its "sweep winners" lines name the class and the winning knobs of each workload).
//   variant: index into kVariants (defined with the fast kernel below), used when a thread owns
//            several heads; one head per thread always runs the ROUNDS/1 kernel.
//   max_heads_per_thread, min_threads_per_sm: grid sizing (see launch_typed).
//   block_threads: threads per block (32..256, a multiple of 32).
//   rows_on_the_fly: 1 = compute every cos/sin row from freq_turns instead of reading the table
//            (when freq_turns is given): removes the dependent position -> table load from the
//            latency path of decode-sized calls, at ~8 sincospif per thread.
struct TuneConfig {
  int variant, max_heads_per_thread, min_threads_per_sm, block_threads, rows_on_the_fly;
};
// Index: many * 8 + small * 4 + inplace * 2 + neox. many = at least 64 heads per token (q + k);
// small = decode-sized (fewer than 2048 threads per SM at one head per thread); inplace = rotary
// dims only; neox = half-split pairs (gptj otherwise).
// W1: large/out/neox. W4, W5: many/large/out/neox. W2: small/out/neox. W3: large/in/gptj and
// large/out/gptj. Measured on the H200 (tools/gpu_cuda_check.py --sweep [--wide], 2026-12-01,
// PDL on, benchmarks/h200-2026-12-01b/):
// - large out neox {4, 4, 2048, 256}: W1 83.2-83.7 us; 5 or 6 heads per thread give 84.0-84.6.
// - many large out neox {4, 6, 2048, 128}: W4 133.96-134.0 us, W5 293.5 us, against 134.5-134.6
//   and 295.5 for {4, 4, 2048, 256} in the same runs (W4 has 64 heads, W5 72: six heads per
//   thread amortise a thread's index math and cos/sin loads over more rows).
// - small out neox {4, 2, 128, 256}: W2 3.09-3.12 us; blocks of 64-256 all give 3.05-3.11; rows
//   on the fly 3.49-3.86 us, slower than the table.
// - large in gptj: W3 in place 21.15 us with blocks of 128 against 21.63 with 256.
// - large out gptj: W3 out of place 67.6 us with blocks of 128 against 68.3 with 256.
// Variant 6 is the flat kernel (kFlatVariant below; a block per token's q or k; on whole NeoX
// rows of dense tensors its lean form, rope_lean_kernel, ninth session). Measured on the
// H200 with tools/kernel_probe.py (2026-12-01, benchmarks/h200-2026-12-01f/), against the rows
// above in the same runs: W2 2.91 us against 3.21 (joint q+k blocks), W5 1.027 x copy against
// 1.045, W4 1.057 against 1.064 (separate blocks); W1 1.086-1.137 against 1.058 and W3 in place
// 1.66 against 1.20, so those keep the heads-per-thread kernels.
// Variant 7 is the rows kernel (kRowsVariant; in place, the rotary vectors of consecutive rows).
// Measured with tools/kernel_probe.py (2026-12-01, benchmarks/h200-2026-12-01g/) against
// {4, 4, 2048, 128} in the same run: W3's shape in place with NeoX pairs 20.61 us against 21.83;
// W3 in place (GPT-J) 21.28 against 21.17, a tie, so GPT-J keeps the heads-per-thread kernel;
// whole rotary rows in place (W1's shape) 87.6 against 83.2, so the rows kernel is not the
// default there (kRowsDenseVariant).
// Rows on the fly for large out neox, tried in the eighth session (benchmarks/h200-2026-12-01h/):
// the probe (tools/kernel_probe.py, flat_steps.cu probe 10 against probe 0, one process) gave W1
// 1.041 x copy against 1.062 with the table, but the bench with it as the default gave 85.11 us,
// within the table's 84.44-85.14 us over the last two sessions' benches; so the table stays (as
// in the third session's bench: 84.65 against 84.06). The flat kernel's classes lose with it in
// the probe (W4 1.092 against 1.057, W5 1.032 against 1.026).
// Rows no workload measured copy their nearest measured neighbour.
TuneConfig kDefaultConfig[16] = {
    /* large out gptj */ {5, 8, 4096, 128, 0},
    /* large out neox */ {4, 4, 2048, 256, 0},
    /* large in  gptj */ {4, 4, 2048, 128, 0},
    /* large in  neox */ {7, 4, 2048, 128, 0},
    /* small out gptj */ {4, 2, 128, 256, 0},
    /* small out neox */ {6, 2, 128, 256, 0},
    /* small in  gptj */ {4, 2, 128, 256, 0},
    /* small in  neox */ {4, 2, 128, 256, 0},
    /* many large out gptj */ {5, 8, 4096, 128, 0},
    /* many large out neox */ {6, 6, 2048, 128, 0},
    /* many large in  gptj */ {4, 4, 2048, 128, 0},
    /* many large in  neox */ {7, 4, 2048, 128, 0},
    /* many small out gptj */ {4, 2, 128, 256, 0},
    /* many small out neox */ {6, 2, 128, 256, 0},
    /* many small in  gptj */ {4, 2, 128, 256, 0},
    /* many small in  neox */ {4, 2, 128, 256, 0},
};
// Programmatic dependent launch (sm_90+): launch with programmatic stream serialization, so the
// grid is scheduled while the previous kernel drains; every kernel waits (griddepcontrol.wait)
// for the previous grid's completion and memory flush before its first global load.
int g_pdl = 1;
// Process-wide overrides (benchmarks, tests; not thread-safe): -1 = use kDefaultConfig.
int g_variant = -1;
int g_max_heads_per_thread = -1;
int g_min_threads_per_sm = -1;
int g_block_threads = -1;
int g_rows_on_the_fly = -1;
int g_flat_joint = -1;  // flat path: 0 = separate q and k blocks, 1 = joint where they fit, -1 = auto
int g_flat_lean = -1;   // flat path's lean kernel: 0 = never, -1 = where it can take the call and
                        // the call is not decode-sized, 1 = wherever it can take the call (tests)
int g_last_variant = -2;  // variant of the last fast-path launch (-1: one head per thread)

TuneConfig effective_config(bool many, bool small, bool inplace, bool neox) {
  TuneConfig c =
      kDefaultConfig[(many ? 8 : 0) + (small ? 4 : 0) + (inplace ? 2 : 0) + (neox ? 1 : 0)];
  if (g_variant >= 0) c.variant = g_variant;
  if (g_max_heads_per_thread >= 1) c.max_heads_per_thread = g_max_heads_per_thread;
  if (g_min_threads_per_sm >= 1) c.min_threads_per_sm = g_min_threads_per_sm;
  if (g_block_threads >= 1) c.block_threads = g_block_threads;
  if (g_rows_on_the_fly >= 0) c.rows_on_the_fly = g_rows_on_the_fly;
  return c;
}

// First thing before a kernel's first global load: wait for the grid this one depends on (a
// no-op unless launched with programmatic stream serialization), then let the next grid launch:
// its own wait covers this grid's writes. The kernel parameters may be read before the wait.
ROPE_HD void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ------------------------------------------------------------------------------------------------
// dtype helpers

// Read-only (non-coherent) load on the device, plain load on the host.
template <typename T>
ROPE_HD T ldg_ro(const T* ptr) {
#ifdef __CUDA_ARCH__
  return __ldg(ptr);
#else
  return *ptr;
#endif
}

// Streaming (evict-first) load of data read exactly once, so that q/k traffic does not push the
// cos/sin rows and positions out of L2; a plain load on the host.
template <typename T>
ROPE_HD T ld_stream(const T* ptr) {
#ifdef __CUDA_ARCH__
  return __ldcs(ptr);
#else
  return *ptr;
#endif
}

template <typename T>
struct VecInfo {
  static constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte vector
};

template <typename To, typename From>
ROPE_HD To bit_cast_hd(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "size");
  To t;
  memcpy(&t, &f, sizeof(To));
  return t;
}

template <typename T>
ROPE_HD void unpack16(const uint4& v, float* f);

template <>
ROPE_HD void unpack16<float>(const uint4& v, float* f) {
  f[0] = bit_cast_hd<float>(v.x);
  f[1] = bit_cast_hd<float>(v.y);
  f[2] = bit_cast_hd<float>(v.z);
  f[3] = bit_cast_hd<float>(v.w);
}

template <>
ROPE_HD void unpack16<__half>(const uint4& v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __half22float2(bit_cast_hd<__half2>(w[i]));
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

template <>
ROPE_HD void unpack16<__nv_bfloat16>(const uint4& v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(bit_cast_hd<__nv_bfloat162>(w[i]));
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

template <typename T>
ROPE_HD uint4 pack16(const float* f);

template <>
ROPE_HD uint4 pack16<float>(const float* f) {
  return make_uint4(bit_cast_hd<uint32_t>(f[0]), bit_cast_hd<uint32_t>(f[1]),
                    bit_cast_hd<uint32_t>(f[2]), bit_cast_hd<uint32_t>(f[3]));
}

template <>
ROPE_HD uint4 pack16<__half>(const float* f) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = bit_cast_hd<uint32_t>(__floats2half2_rn(f[2 * i], f[2 * i + 1]));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <>
ROPE_HD uint4 pack16<__nv_bfloat16>(const float* f) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = bit_cast_hd<uint32_t>(__floats2bfloat162_rn(f[2 * i], f[2 * i + 1]));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

ROPE_HD float to_f32(float x) { return x; }
ROPE_HD float to_f32(__half x) { return __half2float(x); }
ROPE_HD float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
ROPE_HD T from_f32(float x);
template <>
ROPE_HD float from_f32<float>(float x) { return x; }
template <>
ROPE_HD __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <>
ROPE_HD __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// ------------------------------------------------------------------------------------------------
// positions and cos/sin

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

// ------------------------------------------------------------------------------------------------
// Fast path: stride 1 on head_dim, 16-byte aligned rows, rotary halves a multiple of 16 bytes.
//
// Thread g = ((token * HL) + lane) * CT + c owns chunk c of every head lane, lane + HL, ... of
// the token (q heads first, then k heads). Chunk c < CR is a rotary chunk: neox loads the 16-byte
// vectors at c*V and c*V + R/2 (V pairs), gptj the vector at c*V (V/2 adjacent pairs); its cos/sin
// floats are loaded once and reused for all of the thread's heads. Chunks CR <= c < CT copy
// pass-through vectors [R, D) (out of place only).
//
// Schedules (how a thread walks its heads; see kVariants for the run-time variants):
//   SCHED_ROUNDS: rounds of ST heads: ST heads' loads, then their math and stores (the original
//                 kernel; ST = 4, or ST = 1 for one head per thread);
//   SCHED_PIPE:   software pipelined in stages of ST heads: the loads of stage i+1 are issued
//                 before the stores of stage i, so a thread always has loads in flight.
// Cache hints (HINT): HINT_CS: q/k loads evict-first (ld.global.cs), plain stores; HINT_PLAIN:
// plain loads and stores; HINT_CS_ST: evict-first loads and stores (st.global.cs); HINT_NC:
// read-only-path loads (ld.global.nc), plain stores; HINT_NC_ST: ld.global.nc and st.global.cs.
// ld.global.nc is safe in every kernel here, in place included: each 16-byte vector is read once,
// by the one thread that later writes that vector's result, so the non-coherent path is never
// asked for a value this kernel has written.
enum { SCHED_ROUNDS = 0, SCHED_PIPE = 1 };
enum { HINT_CS = 0, HINT_PLAIN = 1, HINT_CS_ST = 2, HINT_NC = 3, HINT_NC_ST = 4 };

template <int HINT>
ROPE_HD uint4 ld_data(const void* ptr) {
  const uint4* p = reinterpret_cast<const uint4*>(ptr);
  if constexpr (HINT == HINT_PLAIN) {
    return *p;
  } else if constexpr (HINT == HINT_NC || HINT == HINT_NC_ST) {
    return ldg_ro(p);
  } else {
    return ld_stream(p);
  }
}

// Stores spelled out on the device: a plain `*p = v` came out of nvcc 13.0 as four 32-bit stores
// in the flat kernel (the heads-per-thread kernels got 16-byte ones), 3-4 % slower on the H200;
// __stwb (st.global.wb) gives 16-byte stores, but ptxas makes them STG.E.128.STRONG.SM. This is
// the plain weak 16-byte store (STG.E.128).
template <int HINT>
ROPE_HD void st_data(void* ptr, const uint4& v) {
  uint4* p = reinterpret_cast<uint4*>(ptr);
#ifdef __CUDA_ARCH__
  if constexpr (HINT == HINT_CS_ST || HINT == HINT_NC_ST) {
    __stcs(p, v);
  } else {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
  }
#else
  *p = v;
#endif
}

// Index decomposition of a thread id: 32-bit divisions when the whole grid fits in 31 bits
// (always in practice: 2^31 threads are > 64 GiB of bf16 data), 64-bit otherwise. A 64-bit
// division is a ~70-instruction subroutine in SASS, a 32-bit one ~20 instructions.
struct ThreadIdx {
  int c, lane;
  long long b, s;
};

// Token -> (b, s) of the canonical [B, S] view; use32 (the token and S fit in 31 bits): 32-bit
// division, ~20 SASS instructions instead of ~70.
ROPE_HD void split_token(const RopeParams& p, const bool use32, const long long tok, long long& b,
                         long long& s) {
  if (use32) {
    const uint32_t tk = (uint32_t)tok;
    const uint32_t bb = tk / (uint32_t)p.S;
    b = bb;
    s = tk - bb * (uint32_t)p.S;
  } else {
    b = tok / p.S;
    s = tok - b * p.S;
  }
}

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

template <typename T, bool NEOX, int ST, int HINT>
struct FastThread {
  static constexpr int V = VecInfo<T>::kVec;
  static constexpr int NC = NEOX ? V : V / 2;
  const RopeParams& p;
  long long Ht, half, HL;
  bool rot;
  const T* q_tok;
  T* qo_tok;
  const T* k_tok;
  T* ko_tok;
  float cs[NC], sn[NC];

  ROPE_HD FastThread(const RopeParams& pp, const int CR, const int CT, const int hl,
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
    long long pos = 0;
    if (rot) pos = load_position(p, ix.b, ix.s);
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
  long long pos_;
  int c_;
  bool on_the_fly;

  ROPE_HD void load_cs() {
    // frequencies [c*V, c*V + V) (neox) or [c*V/2, c*V/2 + V/2) (gptj) of this thread's chunk
    if (rot) load_cos_sin<NC>(p, pos_, (long long)c_ * NC, cs, sn, on_the_fly);
  }

  // Loads of heads h0, h0 + HL, ... (ST of them, those < Ht).
  ROPE_HD void load(const long long h0, uint4* va, uint4* vb) const {
#pragma unroll
    for (int u = 0; u < ST; ++u) {
      const long long h = h0 + (long long)u * HL;
      if (h < Ht) {
        const bool isq = h < p.Hq;
        const T* src = isq ? q_tok + h * p.q_stride[2] : k_tok + (h - p.Hq) * p.k_stride[2];
        va[u] = ld_data<HINT>(src);
        if (NEOX && rot) vb[u] = ld_data<HINT>(src + half);
      }
    }
  }

  ROPE_HD void store(const long long h0, const uint4* va, const uint4* vb) const {
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
          unpack16<T>(va[u], x);
          unpack16<T>(vb[u], y);
#pragma unroll
          for (int j = 0; j < V; ++j) {
            xo[j] = fmaf(x[j], cs[j], -y[j] * sn[j]);
            yo[j] = fmaf(y[j], cs[j], x[j] * sn[j]);
          }
          st_data<HINT>(dst, pack16<T>(xo));
          st_data<HINT>(dst + half, pack16<T>(yo));
        } else {
          float x[V], o[V];
          unpack16<T>(va[u], x);
#pragma unroll
          for (int j = 0; j < V / 2; ++j) {
            o[2 * j] = fmaf(x[2 * j], cs[j], -x[2 * j + 1] * sn[j]);
            o[2 * j + 1] = fmaf(x[2 * j + 1], cs[j], x[2 * j] * sn[j]);
          }
          st_data<HINT>(dst, pack16<T>(o));
        }
      }
    }
  }
};

template <typename T, bool NEOX, int SCHED, int ST, int HINT>
ROPE_HD void fast_thread(const RopeParams& p, const int CR, const int CT, const int HL,
                         const long long gid, const long long total, const bool fly) {
  int lane = 0;
  FastThread<T, NEOX, ST, HINT> th(p, CR, CT, HL, gid, total, fly, lane);
  const long long step = (long long)HL * ST;
  if constexpr (SCHED == SCHED_ROUNDS) {
    bool have_cs = false;
    for (long long h0 = lane; h0 < th.Ht; h0 += step) {
      uint4 va[ST], vb[ST];
      th.load(h0, va, vb);
      if (!have_cs) {
        th.load_cs();
        have_cs = true;
      }
      th.store(h0, va, vb);
    }
  } else {
    uint4 va[ST], vb[ST];
    long long h0 = lane;
    th.load(h0, va, vb);
    th.load_cs();
    for (; h0 < th.Ht; h0 += step) {
      uint4 na[ST], nb[ST];
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

// Run-time kernel variants of the fast path (several heads per thread); one head per thread
// always uses the ROUNDS/1/CS kernel. rope_set_config(variant, ...) forces one for benchmarks;
// otherwise default_config() below picks per call class.
struct VariantDesc {
  int sched, stage, hint;
  const char* name;
};
constexpr int kNumVariants = 6;
constexpr VariantDesc kVariants[kNumVariants] = {
    {SCHED_ROUNDS, 4, HINT_CS, "rounds4/ld.cs (original)"},
    {SCHED_PIPE, 2, HINT_CS, "pipe2/ld.cs"},
    {SCHED_PIPE, 4, HINT_CS, "pipe4/ld.cs"},
    {SCHED_PIPE, 2, HINT_PLAIN, "pipe2/plain"},
    {SCHED_PIPE, 2, HINT_CS_ST, "pipe2/ld.cs+st.cs"},
    {SCHED_ROUNDS, 4, HINT_PLAIN, "rounds4/plain"},
};

template <typename T, bool NEOX, int SCHED, int ST, int HINT>
__global__ void __launch_bounds__(kMaxThreads)
    rope_fast_kernel(const __grid_constant__ RopeParams p, const int CR, const int CT, const int HL,
                     const long long total, const int on_the_fly) {
  const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (gid < total) fast_thread<T, NEOX, SCHED, ST, HINT>(p, CR, CT, HL, gid, total, on_the_fly != 0);
}

// ------------------------------------------------------------------------------------------------
// Flat path: one block of kFlatThreads threads per (token, q or k). It needs each tensor's rows of
// a token to be contiguous (head stride D, or one head) and rows of VPR = D / V vectors with VPR
// a power of two <= 32, so that a row lies within one warp. The block then reads and writes the
// token's H * D contiguous elements like a copy kernel's block. Thread t owns vector
// c = t % VPR of rows t / VPR, t / VPR + kFlatThreads / VPR, ... (up to kFlatMaxVectors rows), so
// it loads one position and one cos/sin chunk. NeoX takes the other halves of its pairs from the
// lane R / (2V) away by a shuffle; GPT-J pairs lie within a vector. Plain loads and stores.
// Why (H200, benchmarks/h200-2026-12-01e/, tools/kernel_probe.py): a copy kernel reaches the
// driver copy's speed with ~4 KB per block and plain loads, and loses 3-6 % with ld.global.cs or
// 8-16 KB per block (the heads-per-thread kernels above move 24 KB per block with ld.global.cs).
constexpr int kFlatThreads = 128;
constexpr int kFlatMaxVectors = 8;          // vectors per thread: H * VPR <= 1024 per tensor
constexpr int kFlatVariant = kNumVariants;  // its rope_set_config / rope_last_variant code
static_assert(kFlatVariant == 6, "kDefaultConfig names the flat kernel as variant 6");
constexpr int kFlatFallbackVariant = 4;     // forced flat on a call it cannot take
// Data loads plain (LDG.E.128). ld.global.nc (HINT_NC) timed the same on the H200 (ninth
// session, tools/probes/flat_steps.cu probe 11 against probe 0: W4 forward 1.058 against 1.057 x
// copy, backward 1.056 against 1.058, W5 1.027 against 1.028, W2 2.90 us both).
constexpr int kFlatHint = HINT_PLAIN;

struct FlatShape {
  int vpr_log2;     // log2 of the vectors per row (D / V)
  int rot;          // rotary vectors per row: R / V
  int copy;         // 1: copy the pass-through vectors (out of place)
  int both;         // q and k present: even blocks do q, odd blocks k
  int tok32;        // B * S and S fit in 31 bits: 32-bit token decomposition
  int tok_uniform;  // every tensor's token t starts at t * stride[1] (B == 1 or stride[0] == S * stride[1])
  int pos_uniform;  // token t's position is at t * pos_stride_s (or is pos_offset + t)
  int joint;        // one block per token for q and k together (else one per token and tensor)
};

// A block's lifetime is short (2-16 KB of data), so whatever sits between its start and its data
// loads costs bandwidth: with uniform token strides (the common layouts) the data addresses need
// no division, and the position and cos/sin row are fetched after the data loads are issued.
// (H200, tools/kernel_probe.py: a 64-bit token division ahead of the loads cost 4 % on W1.)
// HINT: the data loads (kFlatHint in the library; probes try others).
template <typename T, bool NEOX, bool JOINT, int HINT>
struct FlatThread {
  static constexpr int V = VecInfo<T>::kVec;
  static constexpr int NC = NEOX ? V : V / 2;  // cos/sin floats per vector
  // The block's vectors j: [0, nq) from src_a / dst_a, [nq, nv) from src_b / dst_b (the k rows
  // of a joint block; separate blocks have nq == nv).
  const T* src_a;
  const T* src_b;
  T* dst_a;
  T* dst_b;
  long long tok;
  int nq, nv;
  int c;     // this thread's vector within every row it visits
  int half;  // NeoX: lanes between the two halves of a pair (R / 2V)
  bool rot, active;
  long long pos;
  float cs[NC], sn[NC];

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
      pos = 0;
    } else if (f.pos_uniform) {
      pos = p.pos_kind == ROPE_POS_OFFSET ? p.pos_offset + tok : load_position(p, 0, tok);
    } else {
      long long b, s;
      split_token(p, f.tok32 != 0, tok, b, s);
      pos = load_position(p, b, s);
    }
  }

  ROPE_HD bool has(const int j) const { return active && j < nv; }
  ROPE_HD uint4 load(const int j) const {
    return ld_data<HINT>(!JOINT || j < nq ? src_a + (long long)j * V
                                          : src_b + (long long)(j - nq) * V);
  }

  // After the data loads, so that they are in flight while the position arrives.
  ROPE_HD void load_cs(const RopeParams& p, const bool fly) {
    if (!rot) return;
    const int chunk = NEOX ? (c < half ? c : c - half) : c;
    load_cos_sin<NC>(p, pos, (long long)chunk * NC, cs, sn, fly);
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

template <typename T, bool NEOX, int U, bool JOINT, int HINT>
__device__ __forceinline__ void flat_block_body(const RopeParams& p, const FlatShape& f,
                                                const int on_the_fly) {
  const int t = threadIdx.x;
  FlatThread<T, NEOX, JOINT, HINT> th(p, f, blockIdx.x, t);
  uint4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int j = t + u * kFlatThreads;
    v[u] = th.has(j) ? th.load(j) : make_uint4(0, 0, 0, 0);
  }
  th.load_pos(p, f);
  th.load_cs(p, on_the_fly != 0);
  const int lane = t & 31;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int j = t + u * kFlatThreads;
    if ((t & ~31) + u * kFlatThreads >= th.nv) break;  // warp-uniform: shuffles need every lane
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

template <typename T, bool NEOX, int U, bool JOINT>
__global__ void __launch_bounds__(kFlatThreads)
    rope_flat_kernel(const __grid_constant__ RopeParams p, const FlatShape f, const int on_the_fly) {
  flat_block_body<T, NEOX, U, JOINT, kFlatHint>(p, f, on_the_fly);
}

// Whether the flat path can take p (already known to suit the fast path): see above.
inline bool flat_tensor_ok(const int64_t* st, int64_t H, int64_t D) { return H <= 1 || st[2] == D; }

// Token t of every tensor starts at t * stride[1] from its base (the flat and rows paths).
bool tokens_uniform(const RopeParams& p) {
  if (p.B == 1) return true;
  const auto same = [&](const int64_t* st) { return st[0] == p.S * st[1]; };
  if (p.Hq > 0 && (!same(p.q_stride) || !same(p.q_out_stride))) return false;
  if (p.Hk > 0 && (!same(p.k_stride) || !same(p.k_out_stride))) return false;
  return true;
}

bool flat_ok(const RopeParams& p, int64_t V) {
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
// to an instantiated U). `small`: a decode-sized call.
struct FlatPlan {
  FlatShape f;
  int64_t blocks;
  int vectors_per_thread;
};

// log2 of the vectors per row, D / V (a power of two on the flat path).
int vectors_per_row_log2(const RopeParams& p, const int64_t V) {
  int vpr_log2 = 0;
  while ((V << vpr_log2) < p.D) ++vpr_log2;
  return vpr_log2;
}

FlatPlan plan_flat(const RopeParams& p, const int64_t V, const bool small) {
  const int64_t tokens = p.B * p.S;
  const bool both = p.Hq > 0 && p.Hk > 0;
  const int vpr_log2 = vectors_per_row_log2(p, V);
  // Joint blocks (q and k of a token) where they fit: GQA's k rows alone make small blocks
  // (2 KB for 8 heads of 128), and a block's start-up is paid per block.
  // Measured (H200, 2026-12-01, benchmarks/h200-2026-12-01f/): joint blocks win on decode
  // (W2 2.91 us against 3.13 separate) and lose on prefill (W4 1.066 x copy against 1.057).
  const bool joint = both && (g_flat_joint > 0 || (g_flat_joint < 0 && small)) &&
                     ((p.Hq + p.Hk) << vpr_log2) <= (int64_t)kFlatThreads * kFlatMaxVectors;
  FlatPlan plan;
  plan.f = {vpr_log2,
            (int)(p.R / V),
            p.copy_passthrough ? 1 : 0,
            both ? 1 : 0,
            (tokens <= 0x7fffffffLL && p.S <= 0x7fffffffLL) ? 1 : 0,
            tokens_uniform(p) ? 1 : 0,
            (p.B == 1 || (p.pos_kind != ROPE_POS_OFFSET && p.pos_stride_b == p.S * p.pos_stride_s)) ? 1 : 0,
            joint ? 1 : 0};
  plan.blocks = tokens * (both && !joint ? 2 : 1);
  const int64_t most = joint ? (p.Hq + p.Hk) << vpr_log2  // vectors per block, at most
                             : (p.Hq > p.Hk ? p.Hq : p.Hk) << vpr_log2;
  plan.vectors_per_thread = (int)((most + kFlatThreads - 1) / kFlatThreads);
  return plan;
}

#ifdef ROPE_HOST_EMULATION
// The flat kernel on the host: warp by warp, every lane's loads before any lane's shuffle.
template <typename T, bool NEOX, bool JOINT>
void flat_emulate(const RopeParams& p, const FlatShape& f, const long long blocks, const bool fly) {
  for (long long bid = 0; bid < blocks; ++bid) {
    for (int w = 0; w < kFlatThreads; w += 32) {
      using Thread = FlatThread<T, NEOX, JOINT, kFlatHint>;
      Thread* th[32];
      alignas(Thread) unsigned char store[32][sizeof(Thread)];
      for (int l = 0; l < 32; ++l) {
        th[l] = new (store[l]) Thread(p, f, bid, w + l);
        th[l]->load_pos(p, f);
        th[l]->load_cs(p, fly);
      }
      for (int u = 0; u < kFlatMaxVectors; ++u) {
        uint4 v[32];
        for (int l = 0; l < 32; ++l) {
          const int j = w + l + u * kFlatThreads;
          v[l] = th[l]->has(j) ? th[l]->load(j) : make_uint4(0, 0, 0, 0);
        }
        for (int l = 0; l < 32; ++l) {
          const int j = w + l + u * kFlatThreads;
          if (th[l]->has(j)) th[l]->finish(j, v[l], NEOX ? v[th[l]->partner(l)] : v[l]);
        }
      }
    }
  }
}
#endif

// ------------------------------------------------------------------------------------------------
// Lean flat path (ninth session): the flat path's common case written as the sixth session's
// probe kernel was, with only the generality that case needs. Taken instead of the flat kernel
// when whole rows rotate (R == D) with NeoX pairs, every tensor is dense [tokens, H, D] (token
// t's rows of a tensor at t * H * D, so block addresses need no strides), positions are uniform
// (one per token, evenly spaced, or an offset with B == 1) and the call is not decode-sized
// (decode keeps the flat kernel's joint q + k blocks). One block of kLeanThreads per token's q
// or k rows; thread t owns vector c = t % VPR of rows t / VPR + u * kLeanThreads / VPR, so one
// position and one cos/sin chunk (load_cos_sin: table bounds, rows past the table, inverse);
// the other halves of its pairs come from lane c ^ VPR / 2 by a shuffle.
// Why (H200, 2026-12-01, tools/probes/flat_steps.cu, one process each; benchmarks/
// h200-2026-12-01i/): the probe kernel ran W4's forward at 1.027-1.030 x copy and W1 at
// 1.038-1.043 in four runs, against 1.052-1.057 and 1.055-1.068 for the library's kernels; the
// same source with the row stride a compile-time 128 instead of blockDim.x ran 1.044-1.046 and
// 1.059-1.062, which is why `nthreads` below is read at run time (the two differ in SASS only in
// scheduling and in reading the block's q or k pointer by a uniform constant load; the cause is
// not known: the flat kernel with its pointers picked without a register-indexed constant load
// timed as before). This kernel, against the flat kernel in the same processes: W4 forward
// 1.042-1.046 against 1.053-1.057, backward 1.043-1.050 against 1.054-1.059, W5 1.030-1.035
// against 1.033-1.036, outputs bit for bit equal. On W1 (GQA, its class keeps the heads-per-
// thread kernel) it lost: 1.067-1.071 against 1.055-1.063. Loading the position before the data
// (as the probe kernel does) timed the same on W4 (1.039 / 1.048 against 1.044 / 1.045).
constexpr int kLeanThreads = 128;
constexpr int kLeanVariant = kFlatVariant + 2;  // its rope_last_variant code (part of variant 6)

struct LeanShape {
  int vpr_log2;  // log2 of the vectors per row (D / V), 1..5
  int both;      // q and k present: even blocks do q, odd blocks k
};

template <typename T, int U>
__global__ void __launch_bounds__(2 * kLeanThreads)
    rope_lean_kernel(const __grid_constant__ RopeParams p, const LeanShape f) {
  constexpr int V = VecInfo<T>::kVec;
  wait_for_previous_grid();
  const int nthreads = (int)blockDim.x;  // == kLeanThreads; see above
  const long long tok = f.both ? (long long)(blockIdx.x >> 1) : (long long)blockIdx.x;
  const bool isk = f.both ? (blockIdx.x & 1) != 0 : p.Hq == 0;
  const int nv = (int)(isk ? p.Hk : p.Hq) << f.vpr_log2;
  const uint4* src = static_cast<const uint4*>(isk ? p.k : p.q) + tok * nv;
  uint4* dst = static_cast<uint4*>(isk ? p.k_out : p.q_out) + tok * nv;
  const int t = (int)threadIdx.x;
  const int warp_base = t & ~31;
  uint4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u)
    if (warp_base + u * nthreads < nv) v[u] = src[t + u * nthreads];
  const int half = 1 << (f.vpr_log2 - 1);
  const int c = t & ((2 * half) - 1);
  const bool first = c < half;
  const long long pos = load_position(p, 0, tok);
  float cs[V], sn[V];
  load_cos_sin<V>(p, pos, (long long)(c & (half - 1)) * V, cs, sn);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (warp_base + u * nthreads < nv) {  // warp-uniform: the shuffles need every lane
      uint4 o;
      o.x = __shfl_xor_sync(0xffffffffu, v[u].x, half);
      o.y = __shfl_xor_sync(0xffffffffu, v[u].y, half);
      o.z = __shfl_xor_sync(0xffffffffu, v[u].z, half);
      o.w = __shfl_xor_sync(0xffffffffu, v[u].w, half);
      float x[V], y[V], r[V];
      unpack16<T>(v[u], x);
      unpack16<T>(o, y);
      // first half: x c - y s; second: x c + y s (as the flat kernel's negated sin: same bits)
#pragma unroll
      for (int i = 0; i < V; ++i) r[i] = first ? fmaf(x[i], cs[i], -y[i] * sn[i]) : fmaf(x[i], cs[i], y[i] * sn[i]);
      dst[t + u * nthreads] = pack16<T>(r);
    }
  }
}

// Whether the lean path can take p, already known to suit the flat path (flat_ok: D / V a power
// of two <= 32, head stride D, at most kFlatMaxVectors vectors per thread of kFlatThreads, blocks
// within 31 bits; NeoX halves of whole vectors, so D / V >= 2). See above.
static_assert(kLeanThreads == kFlatThreads, "lean_ok relies on flat_ok's vectors-per-thread bound");
bool lean_ok(const RopeParams& p, const int64_t V, const bool small) {
  if (small || p.interleaved || p.R != p.D) return false;
  const int64_t vpr = p.D / V;
  // whole warps of vectors: a warp loads, shuffles and stores all or nothing
  if ((p.Hq * vpr) % 32 != 0 || (p.Hk * vpr) % 32 != 0) return false;
  // token t's rows of a tensor at t * H * D (flat_ok: heads at stride D)
  const auto dense = [&](const int64_t* st, const int64_t H) {
    return (p.S <= 1 || st[1] == H * p.D) && (p.B <= 1 || st[0] == p.S * H * p.D);
  };
  if (p.Hq > 0 && (!dense(p.q_stride, p.Hq) || !dense(p.q_out_stride, p.Hq))) return false;
  if (p.Hk > 0 && (!dense(p.k_stride, p.Hk) || !dense(p.k_out_stride, p.Hk))) return false;
  // one position per token at tok * pos_stride_s (or pos_offset + tok)
  return p.B <= 1 || (p.pos_kind != ROPE_POS_OFFSET && p.pos_stride_b == p.S * p.pos_stride_s);
}

LeanShape plan_lean(const RopeParams& p, const int64_t V) {
  return {vectors_per_row_log2(p, V), (p.Hq > 0 && p.Hk > 0) ? 1 : 0};
}

#ifdef ROPE_HOST_EMULATION
// The lean kernel on the host: block by block, warp by warp, all lanes' loads before any shuffle.
template <typename T>
void lean_emulate(const RopeParams& p, const LeanShape& f, const long long blocks) {
  constexpr int V = VecInfo<T>::kVec;
  for (long long bid = 0; bid < blocks; ++bid) {
    const long long tok = f.both ? bid >> 1 : bid;
    const bool isk = f.both ? (bid & 1) != 0 : p.Hq == 0;
    const int nv = (int)(isk ? p.Hk : p.Hq) << f.vpr_log2;
    const uint4* src = static_cast<const uint4*>(isk ? p.k : p.q) + tok * nv;
    uint4* dst = static_cast<uint4*>(isk ? p.k_out : p.q_out) + tok * nv;
    const int half = 1 << (f.vpr_log2 - 1);
    const long long pos = load_position(p, 0, tok);
    for (int base = 0; base < nv; base += 32) {  // one warp's vectors of one u
      uint4 v[32];
      for (int l = 0; l < 32 && base + l < nv; ++l) v[l] = src[base + l];
      for (int l = 0; l < 32 && base + l < nv; ++l) {
        const int c = (base + l) & (2 * half - 1);
        float cs[V], sn[V], x[V], y[V], r[V];
        load_cos_sin<V>(p, pos, (long long)(c & (half - 1)) * V, cs, sn);
        unpack16<T>(v[l], x);
        unpack16<T>(v[l ^ half], y);
        for (int i = 0; i < V; ++i)
          r[i] = c < half ? fmaf(x[i], cs[i], -y[i] * sn[i]) : fmaf(x[i], cs[i], y[i] * sn[i]);
        dst[base + l] = pack16<T>(r);
      }
    }
  }
}
#endif

// ------------------------------------------------------------------------------------------------
// Rows path: calls that write only the rotary dims (in place: copy_passthrough == 0). A row is
// one head of one token; the block's threads cover the rotary vectors of kRowsThreads / TPR
// consecutive rows (TPR threads per row, a power of two: R / V for GPT-J, R / 2V for NeoX, whose
// thread takes the vectors at c*V and c*V + R/2), q's rows first, then k's, so a warp's accesses
// are whole 16-byte vectors of consecutive rows and no lane idles on pass-through dims (the
// flat kernel's lanes span whole rows). One row per thread: its position load is issued first
// and the data loads next, so the position -> cos/sin chain runs under them; stores evict-first.
// Why (H200, 2026-12-01, tools/probes/strided_inplace.cu, W3's shape in place: 128 of every 512
// bytes of a row): the probe's form of this walk took 20.70 us against 21.14 for the heads-per-
// thread kernel (4 rows per thread 21.0, blocks of 128 threads 21.7; loading and storing the same
// bytes without rotating them 19.9 us, packed densely 17.1 us). This kernel, which also takes
// any strides, positions and dtype: 20.61 us against 21.83 with NeoX pairs (a thread moves 32
// bytes), 21.28 against 21.17 with GPT-J pairs (16 bytes: its index math weighs more).
constexpr int kRowsThreads = 256;
constexpr int kRowsVariant = kFlatVariant + 1;  // its rope_set_config / rope_last_variant code
constexpr int kRowsDenseVariant = 4;  // the in-place classes' choice on whole rotary rows
constexpr int kRowsLoadHint = HINT_PLAIN;

// n / d for n < 2^31 by a multiply-high and a shift (Granlund-Montgomery; exact for every such
// n), with mul and shift computed once on the host: a thread here moves only 16-32 bytes, so
// a ~20-instruction division per thread costs bandwidth (H200, W3 in place: 22.4 us with two of
// them, 21.3 with these; the probe form, contiguous rows only, 20.7).
struct FastDiv {
  uint32_t mul, shift;
};

inline FastDiv make_fast_div(const uint32_t d) {
  uint32_t l = 0;
  while ((uint64_t(1) << l) < d) ++l;  // l = ceil(log2 d)
  return {(uint32_t)(((uint64_t(1) << 32) * ((uint64_t(1) << l) - d)) / d + 1), l};
}

ROPE_HD uint32_t fast_div(const FastDiv& f, const uint32_t n) {
#ifdef __CUDA_ARCH__
  const uint32_t t = __umulhi(n, f.mul);
#else
  const uint32_t t = (uint32_t)(((uint64_t)n * f.mul) >> 32);
#endif
  return (t + n) >> f.shift;  // t <= n < 2^31: no overflow
}

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

// LD: the data loads' hint (kRowsLoadHint in the library; probes try others).
template <typename T, bool NEOX, int LD>
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
  const long long pos = load_position(p, b, s);
  const uint4 va = ld_data<LD>(src);
  uint4 vb = va;
  if (NEOX) vb = ld_data<LD>(src + half);
  float cs[NC], sn[NC];
  load_cos_sin<NC>(p, pos, (long long)c * NC, cs, sn, fly);
  // The same math as FastThread::store (bit-equal outputs across variants). Kept written out:
  // a shared rotate helper changed the SASS of 20 kernels, those of W1's default among them,
  // and none was left to re-time on the H200 when it was tried (2026-12-01).
  if constexpr (NEOX) {
    float x[V], y[V], xo[V], yo[V];
    unpack16<T>(va, x);
    unpack16<T>(vb, y);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      xo[j] = fmaf(x[j], cs[j], -y[j] * sn[j]);
      yo[j] = fmaf(y[j], cs[j], x[j] * sn[j]);
    }
    st_data<HINT_CS_ST>(dst, pack16<T>(xo));
    st_data<HINT_CS_ST>(dst + half, pack16<T>(yo));
  } else {
    float x[V], o[V];
    unpack16<T>(va, x);
#pragma unroll
    for (int j = 0; j < V / 2; ++j) {
      o[2 * j] = fmaf(x[2 * j], cs[j], -x[2 * j + 1] * sn[j]);
      o[2 * j + 1] = fmaf(x[2 * j + 1], cs[j], x[2 * j] * sn[j]);
    }
    st_data<HINT_CS_ST>(dst, pack16<T>(o));
  }
}

template <typename T, bool NEOX>
__global__ void __launch_bounds__(kRowsThreads)
    rope_rows_kernel(const __grid_constant__ RopeParams p, const RowsShape f, const int on_the_fly) {
  rows_thread<T, NEOX, kRowsLoadHint>(p, f, blockIdx.x, threadIdx.x, on_the_fly != 0);
}

// Whether the rows path can take p (already known to suit the fast path).
bool rows_ok(const RopeParams& p, const int64_t V, const bool neox) {
  if (p.copy_passthrough) return false;  // it never touches the pass-through dims
  const int64_t tpr = neox ? p.R / (2 * V) : p.R / V;
  return tpr >= 1 && tpr <= kRowsThreads && (tpr & (tpr - 1)) == 0;
}

struct RowsPlan {
  RowsShape f;
  int64_t blocks;
};

// The pitch between a tensor's consecutive rows when a token's rows are evenly spaced up to the
// next token's (with tokens_uniform: row r at r * pitch), else -1.
int64_t row_pitch(const int64_t* st, const int64_t H) {
  if (H <= 1) return st[1];
  return st[1] == H * st[2] ? st[2] : -1;
}

RowsPlan plan_rows(const RopeParams& p, const int64_t V, const bool neox) {
  const int64_t tpr = neox ? p.R / (2 * V) : p.R / V;
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

// ------------------------------------------------------------------------------------------------
// Generic path: any strides (including head_dim stride != 1), any even R, any D, no alignment.
// One item per pair (j < R/2) or per pass-through element; grid-stride loop, 64-bit indices.
template <typename T, bool NEOX>
ROPE_HD void generic_item(const RopeParams& p, const long long per_head, const long long gid) {
  const long long half = p.R >> 1;
  const long long Ht = p.Hq + p.Hk;
  {
    const long long j = gid % per_head;
    const long long t = gid / per_head;
    const long long h = t % Ht;
    const long long tok = t / Ht;
    const long long b = tok / p.S;
    const long long s = tok - b * p.S;
    const bool isq = h < p.Hq;
    const T* src;
    T* dst;
    long long sd, od;
    if (isq) {
      src = static_cast<const T*>(p.q) + b * p.q_stride[0] + s * p.q_stride[1] + h * p.q_stride[2];
      dst = static_cast<T*>(p.q_out) + b * p.q_out_stride[0] + s * p.q_out_stride[1] +
            h * p.q_out_stride[2];
      sd = p.q_stride[3];
      od = p.q_out_stride[3];
    } else {
      const long long hk = h - p.Hq;
      src = static_cast<const T*>(p.k) + b * p.k_stride[0] + s * p.k_stride[1] + hk * p.k_stride[2];
      dst = static_cast<T*>(p.k_out) + b * p.k_out_stride[0] + s * p.k_out_stride[1] +
            hk * p.k_out_stride[2];
      sd = p.k_stride[3];
      od = p.k_out_stride[3];
    }
    if (j < half) {
      const long long ia = NEOX ? j : 2 * j;
      const long long ib = NEOX ? j + half : 2 * j + 1;
      const float x = to_f32(src[ia * sd]);
      const float y = to_f32(src[ib * sd]);
      float c, sn;
      load_cos_sin<1>(p, load_position(p, b, s), j, &c, &sn);
      dst[ia * od] = from_f32<T>(fmaf(x, c, -y * sn));
      dst[ib * od] = from_f32<T>(fmaf(y, c, x * sn));
    } else {
      const long long d = p.R + (j - half);
      dst[d * od] = src[d * sd];
    }
  }
}

template <typename T, bool NEOX>
__global__ void __launch_bounds__(kMaxThreads)
    rope_generic_kernel(const __grid_constant__ RopeParams p, const long long per_head,
                        const long long total) {
  wait_for_previous_grid();
  for (long long gid = (long long)blockIdx.x * kMaxThreads + threadIdx.x; gid < total;
       gid += (long long)gridDim.x * kMaxThreads)
    generic_item<T, NEOX>(p, per_head, gid);
}

// ------------------------------------------------------------------------------------------------
// host side

inline bool aligned(const void* ptr, uintptr_t bytes) {
  return (reinterpret_cast<uintptr_t>(ptr) & (bytes - 1)) == 0;
}

inline bool fast_tensor_ok(const void* ptr, const int64_t* st, int64_t B, int64_t S, int64_t H,
                           int64_t V) {
  if (!aligned(ptr, 16) || st[3] != 1) return false;
  if (B > 1 && st[0] % V != 0) return false;
  if (S > 1 && st[1] % V != 0) return false;
  if (H > 1 && st[2] % V != 0) return false;
  return true;
}

inline int64_t elem_size(int dtype) { return dtype == ROPE_F32 ? 4 : 2; }

bool params_ok(const RopeParams* p) {
  if (p == nullptr) return false;
  if (p->dtype < ROPE_F32 || p->dtype > ROPE_BF16) return false;
  if (p->B < 0 || p->S < 0 || p->Hq < 0 || p->Hk < 0) return false;
  if (p->R <= 0 || (p->R & 1) || p->R > p->D) return false;
  if (p->B == 0 || p->S == 0) return true;  // nothing to do; empty tensors may have null data
  if (p->Hq > 0 && (p->q == nullptr || p->q_out == nullptr)) return false;
  if (p->Hk > 0 && (p->k == nullptr || p->k_out == nullptr)) return false;
  if (p->pos_kind != ROPE_POS_OFFSET && p->pos == nullptr) return false;
  if (p->table_rows < 0) return false;
  if (p->table_rows > 0 && (p->cos_table == nullptr || p->sin_table == nullptr)) return false;
  return true;
}

int pick_path(const RopeParams* p) {
  if (p->B == 0 || p->S == 0 || p->Hq + p->Hk == 0) return 0;
  const int64_t V = 16 / elem_size(p->dtype);
  const int64_t half = p->R / 2;
  if (p->interleaved ? (p->R % V != 0) : (half % V != 0)) return 2;
  if (p->copy_passthrough && p->D % V != 0) return 2;
  if (p->Hq > 0 && (!fast_tensor_ok(p->q, p->q_stride, p->B, p->S, p->Hq, V) ||
                    !fast_tensor_ok(p->q_out, p->q_out_stride, p->B, p->S, p->Hq, V)))
    return 2;
  if (p->Hk > 0 && (!fast_tensor_ok(p->k, p->k_stride, p->B, p->S, p->Hk, V) ||
                    !fast_tensor_ok(p->k_out, p->k_out_stride, p->B, p->S, p->Hk, V)))
    return 2;
  // cos/sin chunks: neox V floats (float4 loads), gptj V/2 floats (float4, or float2 for fp32).
  const uintptr_t tab_align = (!p->interleaved || V / 2 >= 4) ? 16 : 8;
  if (p->table_rows > 0 && (!aligned(p->cos_table, tab_align) || !aligned(p->sin_table, tab_align)))
    return 2;
  if (p->freq_turns != nullptr && !aligned(p->freq_turns, 16)) return 2;  // 16-byte loads of pairs
  return 1;
}

// Launches `kernel` on `stream`; with pdl, with programmatic stream serialization (sm_90+: the
// grid may be scheduled before the previous kernel in the stream has finished; the kernels wait
// for it in wait_for_previous_grid before touching memory).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), int64_t blocks, int threads, bool pdl,
                          cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)blocks);
  cfg.blockDim = dim3((unsigned)threads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// A fast-path call's class knobs and heads-per-thread geometry (the flat and rows kernels take
// their own shapes from plan_flat / plan_rows).
struct FastPlan {
  TuneConfig cfg;
  bool small;  // decode-sized: fewer than one full wave at one head per thread
  int64_t CR, CT, hl, total, blocks;
  int threads;
};

FastPlan plan_fast(const RopeParams& p, const int64_t V, const bool neox, const int sms) {
  FastPlan f;
  const int64_t tokens = p.B * p.S;
  const int64_t Ht = p.Hq + p.Hk;
  f.CR = neox ? (p.R / 2) / V : p.R / V;
  const int64_t CP = (p.copy_passthrough && p.D > p.R) ? (p.D - p.R) / V : 0;
  f.CT = f.CR + CP;
  // Call class and its knobs (kDefaultConfig), unless rope_set_config / rope_set_launch forced
  // some.
  f.small = tokens * f.CT * Ht < (int64_t)sms * 2048;
  f.cfg = effective_config(Ht >= 64, f.small, !p.copy_passthrough, neox);
  // The rows kernel is the default only where rows have pass-through dims: on whole rotary
  // rows in place it lost (H200, W1 in place: 86.4 us against 82.8 for variant 4).
  if (g_variant < 0 && f.cfg.variant == kRowsVariant && p.R == p.D) f.cfg.variant = kRowsDenseVariant;
  // Heads per thread: as many as possible (reuse of cos/sin, fewer index computations) while
  // keeping at least cfg.min_threads_per_sm threads per SM (decode-sized calls: few threads per
  // SM, so two heads each with the small-class rows).
  const int64_t per_lane = tokens * f.CT;
  const int64_t want = (int64_t)sms * f.cfg.min_threads_per_sm;
  f.hl = Ht;
  for (int64_t u = f.cfg.max_heads_per_thread; u >= 1; --u) {
    const int64_t cand = (Ht + u - 1) / u;
    if (cand * per_lane >= want || u == 1) {
      f.hl = cand;
      break;
    }
  }
  int threads = f.cfg.block_threads;
  f.threads = threads < 32 ? 32 : threads > kMaxThreads ? kMaxThreads : threads / 32 * 32;
  f.total = per_lane * f.hl;
  f.blocks = (f.total + f.threads - 1) / f.threads;
  return f;
}

template <typename T, bool NEOX>
cudaError_t launch_typed(const RopeParams& p, int path, const RopeDevice& dev, cudaStream_t stream,
                         bool emulate) {
  const int64_t Ht = p.Hq + p.Hk;
  const int sms = dev.num_sms > 0 ? dev.num_sms : 132;
  // PDL needs sm_90 and kernels compiled for it (the wait is compiled out below sm_90: the
  // Python backend turns PDL off when no build architecture is >= sm_90).
  const bool pdl = g_pdl != 0 && dev.cc_major >= 9;
  cudaError_t err = cudaSuccess;
  if (path == 1) {
    constexpr int V = VecInfo<T>::kVec;
    const FastPlan fp = plan_fast(p, V, NEOX, sms);
    const TuneConfig& cfg = fp.cfg;
    const bool small = fp.small;
    const int64_t CR = fp.CR, CT = fp.CT, hl = fp.hl, total = fp.total, blocks = fp.blocks;
    const int threads = fp.threads;
    if (CT > (1 << 30) || hl > (1 << 30) || blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
    const int fly = cfg.rows_on_the_fly != 0 ? 1 : 0;
    if (cfg.variant == kFlatVariant && flat_ok(p, V)) {
      g_last_variant = kFlatVariant;
      if (fly == 0 && g_flat_lean != 0 && g_flat_joint <= 0 && lean_ok(p, V, small && g_flat_lean < 0)) {
        g_last_variant = kLeanVariant;
        const LeanShape f = plan_lean(p, V);
        const int64_t lean_blocks = p.B * p.S * (f.both ? 2 : 1);
#ifdef ROPE_HOST_EMULATION
        if (emulate) {
          lean_emulate<T>(p, f, lean_blocks);
          return cudaSuccess;
        }
#endif
        const int64_t most = (p.Hq > p.Hk ? p.Hq : p.Hk) << f.vpr_log2;
        const int64_t u = (most + kLeanThreads - 1) / kLeanThreads;
        auto* kernel = u <= 1 ? rope_lean_kernel<T, 1>
                       : u <= 2 ? rope_lean_kernel<T, 2>
                       : u <= 4 ? rope_lean_kernel<T, 4>
                                : rope_lean_kernel<T, 8>;
        err = launch_kernel(kernel, lean_blocks, kLeanThreads, pdl, stream, p, f);
        return err != cudaSuccess ? err : cudaGetLastError();
      }
      const FlatPlan plan = plan_flat(p, V, small);
      const FlatShape& f = plan.f;
      const bool joint = f.joint != 0;
#ifdef ROPE_HOST_EMULATION
      if (emulate) {
        if (joint) flat_emulate<T, NEOX, true>(p, f, plan.blocks, fly != 0);
        else flat_emulate<T, NEOX, false>(p, f, plan.blocks, fly != 0);
        return cudaSuccess;
      }
#endif
      const int u = plan.vectors_per_thread;
      auto* kernel = joint ? (u <= 2   ? rope_flat_kernel<T, NEOX, 2, true>
                              : u <= 4 ? rope_flat_kernel<T, NEOX, 4, true>
                              : u <= 6 ? rope_flat_kernel<T, NEOX, 6, true>
                                       : rope_flat_kernel<T, NEOX, 8, true>)
                           : (u <= 1   ? rope_flat_kernel<T, NEOX, 1, false>
                              : u <= 2 ? rope_flat_kernel<T, NEOX, 2, false>
                              : u <= 4 ? rope_flat_kernel<T, NEOX, 4, false>
                                       : rope_flat_kernel<T, NEOX, 8, false>);
      err = launch_kernel(kernel, plan.blocks, kFlatThreads, pdl, stream, p, f, fly);
      return err != cudaSuccess ? err : cudaGetLastError();
    }
    if (cfg.variant == kRowsVariant && rows_ok(p, V, NEOX)) {
      const RowsPlan plan = plan_rows(p, V, NEOX);
      if (plan.blocks <= 0x7fffffffLL) {
        g_last_variant = kRowsVariant;
#ifdef ROPE_HOST_EMULATION
        if (emulate) {
          for (long long bid = 0; bid < plan.blocks; ++bid)
            for (int t = 0; t < kRowsThreads; ++t)
              rows_thread<T, NEOX, kRowsLoadHint>(p, plan.f, bid, t, fly != 0);
          return cudaSuccess;
        }
#endif
        err = launch_kernel(rope_rows_kernel<T, NEOX>, plan.blocks, kRowsThreads, pdl, stream, p,
                            plan.f, fly);
        return err != cudaSuccess ? err : cudaGetLastError();
      }
    }
    // One head per thread: the ROUNDS/1 kernel (fewest registers); else the configured variant
    // (a forced flat or rows variant that cannot take the call falls back to
    // kFlatFallbackVariant).
    const int v = hl >= Ht ? -1 : cfg.variant >= kFlatVariant ? kFlatFallbackVariant : cfg.variant;
    g_last_variant = v;
#ifdef ROPE_HOST_EMULATION
    if (emulate) {
      for (long long g = 0; g < total; ++g) {
        switch (v) {
#define ROPE_EMU_CASE(I)                                                                        \
  case I:                                                                                      \
    fast_thread<T, NEOX, kVariants[I].sched, kVariants[I].stage, kVariants[I].hint>(          \
        p, (int)CR, (int)CT, (int)hl, g, (long long)total, fly != 0);                          \
    break;
          ROPE_EMU_CASE(0)
          ROPE_EMU_CASE(1)
          ROPE_EMU_CASE(2)
          ROPE_EMU_CASE(3)
          ROPE_EMU_CASE(4)
          ROPE_EMU_CASE(5)
#undef ROPE_EMU_CASE
          default:
            fast_thread<T, NEOX, SCHED_ROUNDS, 1, HINT_CS>(p, (int)CR, (int)CT, (int)hl, g,
                                                           (long long)total, fly != 0);
        }
      }
      return cudaSuccess;
    }
#endif
    (void)emulate;
    switch (v) {
#define ROPE_LAUNCH_CASE(I)                                                                      \
  case I:                                                                                       \
    err = launch_kernel(                                                                        \
        rope_fast_kernel<T, NEOX, kVariants[I].sched, kVariants[I].stage, kVariants[I].hint>,   \
        blocks, threads, pdl, stream, p, (int)CR, (int)CT, (int)hl, (long long)total, fly);     \
    break;
      ROPE_LAUNCH_CASE(0)
      ROPE_LAUNCH_CASE(1)
      ROPE_LAUNCH_CASE(2)
      ROPE_LAUNCH_CASE(3)
      ROPE_LAUNCH_CASE(4)
      ROPE_LAUNCH_CASE(5)
#undef ROPE_LAUNCH_CASE
      default:
        err = launch_kernel(rope_fast_kernel<T, NEOX, SCHED_ROUNDS, 1, HINT_CS>, blocks, threads,
                            pdl, stream, p, (int)CR, (int)CT, (int)hl, (long long)total, fly);
    }
  } else {
    const int64_t per_head = p.R / 2 + ((p.copy_passthrough && p.D > p.R) ? p.D - p.R : 0);
    const int64_t total = p.B * p.S * Ht * per_head;
    int64_t blocks = (total + kMaxThreads - 1) / kMaxThreads;
    const int64_t cap = (int64_t)sms * 16;
    if (blocks > cap) blocks = cap;
#ifdef ROPE_HOST_EMULATION
    if (emulate) {
      for (long long g = 0; g < total; ++g) generic_item<T, NEOX>(p, (long long)per_head, g);
      return cudaSuccess;
    }
#endif
    err = launch_kernel(rope_generic_kernel<T, NEOX>, blocks, kMaxThreads, pdl, stream, p,
                        (long long)per_head, (long long)total);
  }
  return err != cudaSuccess ? err : cudaGetLastError();
}

template <typename T>
cudaError_t launch_style(const RopeParams& p, int path, const RopeDevice& dev, cudaStream_t stream,
                         bool emulate) {
  return p.interleaved ? launch_typed<T, false>(p, path, dev, stream, emulate)
                       : launch_typed<T, true>(p, path, dev, stream, emulate);
}

cudaError_t dispatch(const RopeParams* p, const RopeDevice& dev, cudaStream_t stream, bool emulate) {
  if (!params_ok(p)) return cudaErrorInvalidValue;
  const int path = pick_path(p);
  if (path == 0) return cudaSuccess;
  switch (p->dtype) {
    case ROPE_F32:
      return launch_style<float>(*p, path, dev, stream, emulate);
    case ROPE_F16:
      return launch_style<__half>(*p, path, dev, stream, emulate);
    default:
      return launch_style<__nv_bfloat16>(*p, path, dev, stream, emulate);
  }
}

}  // namespace
}  // namespace rope_ops_cuda

extern "C" int rope_pick_path(const RopeParams* p) {
  if (!rope_ops_cuda::params_ok(p)) return -1;
  return rope_ops_cuda::pick_path(p);
}

extern "C" cudaError_t rope_launch(const RopeParams* p, const RopeDevice* dev, cudaStream_t stream) {
  const RopeDevice none = {0, 0};
  return rope_ops_cuda::dispatch(p, dev != nullptr ? *dev : none, stream, false);
}

#ifdef ROPE_HOST_EMULATION
// Test hook: the same path choice, grid sizing and per-thread code, run serially on the CPU over
// host pointers (every gid of the would-be grid, in order). Returns 0 on success.
extern "C" int rope_host_emulate(const RopeParams* p, int num_sms) {
  const RopeDevice dev = {num_sms, 0};
  return (int)rope_ops_cuda::dispatch(p, dev, nullptr, true);
}

// Test hook: n / d the way the rows kernel divides (FastDiv), for n < 2^31.
extern "C" uint32_t rope_fast_div(uint32_t d, uint32_t n) {
  return rope_ops_cuda::fast_div(rope_ops_cuda::make_fast_div(d), n);
}
#endif

extern "C" void rope_set_tuning(int max_heads_per_thread, int min_threads_per_sm) {
  if (max_heads_per_thread >= 1) rope_ops_cuda::g_max_heads_per_thread = max_heads_per_thread;
  if (min_threads_per_sm >= 1) rope_ops_cuda::g_min_threads_per_sm = min_threads_per_sm;
}

extern "C" void rope_set_config(int variant, int max_heads_per_thread, int min_threads_per_sm) {
  rope_ops_cuda::g_variant =
      variant >= 0 && variant <= rope_ops_cuda::kRowsVariant ? variant : -1;
  rope_ops_cuda::g_max_heads_per_thread = max_heads_per_thread >= 1 ? max_heads_per_thread : -1;
  rope_ops_cuda::g_min_threads_per_sm = min_threads_per_sm >= 1 ? min_threads_per_sm : -1;
}

extern "C" void rope_set_launch(int block_threads, int rows_on_the_fly, int pdl) {
  rope_ops_cuda::g_block_threads = block_threads >= 1 ? block_threads : -1;
  rope_ops_cuda::g_rows_on_the_fly = rows_on_the_fly >= 0 ? (rows_on_the_fly != 0) : -1;
  rope_ops_cuda::g_pdl = pdl >= 0 ? (pdl != 0) : 1;
}

extern "C" void rope_set_flat_blocks(int joint) { rope_ops_cuda::g_flat_joint = joint; }
extern "C" void rope_set_flat_lean(int lean) { rope_ops_cuda::g_flat_lean = lean; }

extern "C" int rope_num_variants(void) { return rope_ops_cuda::kRowsVariant + 1; }

extern "C" const char* rope_variant_name(int variant) {
  if (variant == rope_ops_cuda::kFlatVariant) return "flat (a block per token's q or k)";
  if (variant == rope_ops_cuda::kRowsVariant) return "rows (the rotary vectors of consecutive rows; in place)";
  if (variant == rope_ops_cuda::kLeanVariant) return "lean flat (variant 6 on whole NeoX rows of dense tensors)";
  if (variant < 0 || variant >= rope_ops_cuda::kNumVariants) return "rounds1/ld.cs (one head per thread)";
  return rope_ops_cuda::kVariants[variant].name;
}

extern "C" int rope_last_variant(void) { return rope_ops_cuda::g_last_variant; }
