// Probe set for tools/kernel_probe.py: from the fifth session's probe kernel (1.03 x copy on W4's
// forward) to the library's flat path, one piece of generality at a time, so the piece that
// costs time shows. Includes the library source itself, so probes 0 and 1 are the library's
// own kernels and launch code. bf16 only; probes 2-5 only NeoX, full rotary, head_dim 128,
// contiguous [tokens, H, 128] (they return 1, "not applicable", otherwise).
#include "../../csrc/rope_kernels.cu"

#include "kernel_probe.h"
#include "library_params.h"

namespace flat_probe {  // named: nvcc's stubs trip over two anonymous namespaces
using namespace rope_ops_cuda;
using bf16 = __nv_bfloat16;
using probe_common::make_params;


// The probe kernels' pieces (bf16, head_dim 128, NeoX, full rotary): the thread's cos/sin chunk
// c & 7 of table row ps (no table bounds), and one vector rotated with the other halves of its
// pairs from lane c ^ 8 (a shuffle: every lane of the warp must call it) and stored at dst.
__device__ __forceinline__ void probe_cos_sin(const RopeParams& p, const long long ps, const int c,
                                              float* cs, float* sn) {
  const float4* cp = reinterpret_cast<const float4*>(p.cos_table + ps * 64 + (c & 7) * 8);
  const float4* sp = reinterpret_cast<const float4*>(p.sin_table + ps * 64 + (c & 7) * 8);
  const float4 c0 = __ldg(cp), c1 = __ldg(cp + 1), s0 = __ldg(sp), s1 = __ldg(sp + 1);
  cs[0] = c0.x; cs[1] = c0.y; cs[2] = c0.z; cs[3] = c0.w; cs[4] = c1.x; cs[5] = c1.y; cs[6] = c1.z; cs[7] = c1.w;
  sn[0] = s0.x; sn[1] = s0.y; sn[2] = s0.z; sn[3] = s0.w; sn[4] = s1.x; sn[5] = s1.y; sn[6] = s1.z; sn[7] = s1.w;
}

// BRANCH: the reverted flat kernel's if/else per half instead of a select.
template <bool BRANCH>
__device__ __forceinline__ void probe_rotate_store(const uint4& v, const bool first, const float* cs,
                                                   const float* sn, uint4* dst) {
  uint4 o;
  o.x = __shfl_xor_sync(0xffffffffu, v.x, 8);
  o.y = __shfl_xor_sync(0xffffffffu, v.y, 8);
  o.z = __shfl_xor_sync(0xffffffffu, v.z, 8);
  o.w = __shfl_xor_sync(0xffffffffu, v.w, 8);
  float x[8], y[8], r[8];
  unpack16<bf16>(v, x);
  unpack16<bf16>(o, y);
  if constexpr (BRANCH) {
    if (first) {
#pragma unroll
      for (int i = 0; i < 8; ++i) r[i] = fmaf(x[i], cs[i], -y[i] * sn[i]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) r[i] = fmaf(x[i], cs[i], y[i] * sn[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) r[i] = first ? fmaf(x[i], cs[i], -y[i] * sn[i]) : fmaf(x[i], cs[i], y[i] * sn[i]);
  }
  *dst = pack16<bf16>(r);
}

// The fifth session's probe kernel (benchmarks/h200-2026-12-01e/flat_probe.cu, flat_rope with
// plain loads, launched with 128 threads; LB = 256 is its launch bounds) with the library's
// pieces switched on one by one (MAXU 4..8): POS: load_position(p, b, s) with a 64-bit token
// decomposition; CS: load_cos_sin (table bounds, on-the-fly rows, inverse); BRANCH: the
// reverted flat kernel's if/else per half instead of a select; NC: data loads by ld.global.nc
// (what the fifth session's kernel really did: its `const __restrict__` pointers made its
// "plain" loads LDG.E.128.CONSTANT in SASS).
enum { POS = 1, CS = 2, BRANCH = 4, NC = 8 };
template <int MAXU, int STEP, int LB>
__global__ void __launch_bounds__(LB) step_kernel(const __grid_constant__ RopeParams p) {
  const long long tok = blockIdx.x >> 1;
  const bool isk = blockIdx.x & 1;
  long long b = 0, s = tok;
  if constexpr ((STEP & POS) != 0) {
    b = tok / p.S;
    s = tok - b * p.S;
  }
  wait_for_previous_grid();
  const int nv = (int)(isk ? p.Hk : p.Hq) * 16;
  const uint4* src = static_cast<const uint4*>(isk ? p.k : p.q) + tok * nv;
  uint4* dst = static_cast<uint4*>(isk ? p.k_out : p.q_out) + tok * nv;
  const int t = threadIdx.x;
  const int warp_base = t & ~31;
  uint4 v[MAXU];
#pragma unroll
  for (int u = 0; u < MAXU; ++u)
    if (warp_base + u * 128 < nv) v[u] = (STEP & NC) != 0 ? __ldg(src + t + u * 128) : src[t + u * 128];
  const int c = t & 15;
  const bool first = c < 8;
  long long ps;
  if constexpr ((STEP & POS) != 0) ps = load_position(p, b, s);
  else ps = __ldg(static_cast<const long long*>(p.pos) + tok);
  float cs[8], sn[8];
  if constexpr ((STEP & CS) != 0) load_cos_sin<8>(p, ps, (long long)(c & 7) * 8, cs, sn, false);
  else probe_cos_sin(p, ps, c, cs, sn);
#pragma unroll
  for (int u = 0; u < MAXU; ++u)
    if (warp_base + u * 128 < nv) probe_rotate_store<(STEP & BRANCH) != 0>(v[u], first, cs, sn, dst + t + u * 128);
}

// The sixth session's first probe 2 (1.029-1.031 x copy on W4's forward in five runs, against
// 1.042-1.046 for step 3 in the same processes; replaced by "steps with __launch_bounds__(256)"
// in f62cc2d): the fifth session's kernel on RopeParams, waiting first, indexed by threadIdx.x
// and a run-time blockDim.x (launched with 128 threads). LB: launch bounds; DIM: 1 = blockDim.x,
// 0 = the constant 128.
template <int MAXU, int LB, int DIM>
__global__ void __launch_bounds__(LB) sixth_probe_kernel(const __grid_constant__ RopeParams p) {
  wait_for_previous_grid();
  const int nthreads = DIM ? (int)blockDim.x : 128;
  const long long tok = blockIdx.x >> 1;
  const bool isk = blockIdx.x & 1;
  const int nv = (int)(isk ? p.Hk : p.Hq) * 16;
  const uint4* src = static_cast<const uint4*>(isk ? p.k : p.q) + tok * nv;
  uint4* dst = static_cast<uint4*>(isk ? p.k_out : p.q_out) + tok * nv;
  const int warp_base = threadIdx.x & ~31;
  uint4 v[MAXU];
#pragma unroll
  for (int u = 0; u < MAXU; ++u)
    if (warp_base + u * nthreads < nv) v[u] = src[threadIdx.x + u * nthreads];
  const int c = threadIdx.x & 15;
  const bool first = c < 8;
  const long long ps = __ldg(static_cast<const long long*>(p.pos) + tok);
  float cs[8], sn[8];
  probe_cos_sin(p, ps, c, cs, sn);
  // Written out, not probe_rotate_store: with the helper ptxas schedules this kernel
  // differently (cuobjdump), and this kernel's SASS is what was timed.
#pragma unroll
  for (int u = 0; u < MAXU; ++u) {
    if (warp_base + u * nthreads < nv) {
      uint4 o;
      o.x = __shfl_xor_sync(0xffffffffu, v[u].x, 8);
      o.y = __shfl_xor_sync(0xffffffffu, v[u].y, 8);
      o.z = __shfl_xor_sync(0xffffffffu, v[u].z, 8);
      o.w = __shfl_xor_sync(0xffffffffu, v[u].w, 8);
      float x[8], y[8], r[8];
      unpack16<bf16>(v[u], x);
      unpack16<bf16>(o, y);
#pragma unroll
      for (int i = 0; i < 8; ++i) r[i] = first ? fmaf(x[i], cs[i], -y[i] * sn[i]) : fmaf(x[i], cs[i], y[i] * sn[i]);
      dst[threadIdx.x + u * nthreads] = pack16<bf16>(r);
    }
  }
}

template <int LB, int DIM>
int launch_sixth(const RopeParams& p, int u, bool pdl, cudaStream_t st) {
  auto* k = u <= 4 ? sixth_probe_kernel<4, LB, DIM> : sixth_probe_kernel<8, LB, DIM>;
  return (int)launch_kernel(k, p.S * 2, 128, pdl, st, p);
}

template <int STEP, int LB = 128>
int launch_step(const RopeParams& p, int u, bool pdl, cudaStream_t st) {
  auto* k = u <= 4 ? step_kernel<4, STEP, LB> : step_kernel<8, STEP, LB>;
  return (int)launch_kernel(k, p.S * 2, 128, pdl, st, p);
}

// The library's flat kernel with the probe kernel's launch bounds (256; launched with 128
// threads, separate q and k blocks): the same registers, does ptxas schedule it differently?
template <bool NEOX, int U>
__global__ void __launch_bounds__(256)
    flat_lb256(const __grid_constant__ RopeParams p, const FlatShape f, const int on_the_fly) {
  flat_block_body<bf16, NEOX, U, false, kFlatHint>(p, f, on_the_fly);
}

// ... and with a register cap for more resident blocks: 10 blocks of 128 threads for U <= 4
// (<= 51 registers, 48 allocated), 8 for U = 8 (<= 64).
template <bool NEOX, int U>
__global__ void __launch_bounds__(128, U <= 4 ? 10 : 8)
    flat_capped(const __grid_constant__ RopeParams p, const FlatShape f, const int on_the_fly) {
  flat_block_body<bf16, NEOX, U, false, kFlatHint>(p, f, on_the_fly);
}

int launch_flat_bounds(const ProbeCall& c, const RopeParams& p, cudaStream_t st, bool capped) {
  if (rope_pick_path(&p) != 1 || !flat_ok(p, 8) || c.Hk == 0) return 1;
  rope_set_flat_blocks(0);  // separate q and k blocks
  const FlatPlan plan = plan_flat(p, 8, false);
  rope_set_flat_blocks(-1);
  const FlatShape& f = plan.f;
  const int u = plan.vectors_per_thread;
  auto* k = c.interleaved ? (u <= 4 ? flat_lb256<false, 4> : flat_lb256<false, 8>)
                          : (u <= 4 ? flat_lb256<true, 4> : flat_lb256<true, 8>);
  if (capped)
    k = c.interleaved ? (u <= 4 ? flat_capped<false, 4> : flat_capped<false, 8>)
                      : (u <= 4 ? flat_capped<true, 4> : flat_capped<true, 8>);
  return (int)launch_kernel(k, plan.blocks, kFlatThreads, c.pdl != 0, st, p, f, 0);
}

// The library's flat kernel (not the lean one) and launch, with a given data-load hint.
template <bool NEOX, int U, bool JOINT, int HINT>
__global__ void __launch_bounds__(kFlatThreads)
    flat_hint(const __grid_constant__ RopeParams p, const FlatShape f, const int on_the_fly) {
  flat_block_body<bf16, NEOX, U, JOINT, HINT>(p, f, on_the_fly);
}

template <bool NEOX, int HINT>
int launch_flat_hint_typed(const RopeParams& p, cudaStream_t st, bool pdl) {
  if (pick_path(&p) != 1) return 1;
  const FastPlan fp = plan_fast(p, 8, NEOX, 132);
  if (fp.cfg.variant != kFlatVariant || !flat_ok(p, 8)) return 1;
  const FlatPlan plan = plan_flat(p, 8, fp.small);
  const int u = plan.vectors_per_thread;
  auto* k = plan.f.joint ? (u <= 2   ? flat_hint<NEOX, 2, true, HINT>
                            : u <= 4 ? flat_hint<NEOX, 4, true, HINT>
                            : u <= 6 ? flat_hint<NEOX, 6, true, HINT>
                                     : flat_hint<NEOX, 8, true, HINT>)
                         : (u <= 1   ? flat_hint<NEOX, 1, false, HINT>
                            : u <= 2 ? flat_hint<NEOX, 2, false, HINT>
                            : u <= 4 ? flat_hint<NEOX, 4, false, HINT>
                                     : flat_hint<NEOX, 8, false, HINT>);
  return (int)launch_kernel(k, plan.blocks, kFlatThreads, pdl, st, p, plan.f, 0);
}

// The library's heads-per-thread kernel (its default variant's schedule, geometry from
// plan_fast) with ld.global.nc data loads instead of the variant's (ld.cs or plain; st.cs kept
// where the variant has it). Only where the library's default is a heads-per-thread kernel.
constexpr int nc_hint(int hint) { return hint == HINT_CS_ST ? HINT_NC_ST : HINT_NC; }

template <bool NEOX>
int launch_fast_nc_typed(const RopeParams& p, cudaStream_t st, bool pdl) {
  if (pick_path(&p) != 1) return 1;
  const FastPlan fp = plan_fast(p, 8, NEOX, 132);
  const int v = fp.cfg.variant;
  if (fp.hl >= p.Hq + p.Hk || v >= kFlatVariant) return 1;
  switch (v) {
#define NC_CASE(I)                                                                               \
  case I:                                                                                        \
    return (int)launch_kernel(                                                                   \
        rope_fast_kernel<bf16, NEOX, kVariants[I].sched, kVariants[I].stage, nc_hint(kVariants[I].hint)>, \
        fp.blocks, fp.threads, pdl, st, p, (int)fp.CR, (int)fp.CT, (int)fp.hl, (long long)fp.total, 0);
    NC_CASE(0)
    NC_CASE(1)
    NC_CASE(2)
    NC_CASE(3)
    NC_CASE(4)
    NC_CASE(5)
#undef NC_CASE
  }
  return 1;
}

// The rows kernel (variant 7, forced) with another data-load hint.
template <bool NEOX, int LD>
__global__ void __launch_bounds__(kRowsThreads)
    rows_probe(const __grid_constant__ RopeParams p, const RowsShape f, const int on_the_fly) {
  rows_thread<bf16, NEOX, LD>(p, f, blockIdx.x, threadIdx.x, on_the_fly != 0);
}

template <bool NEOX, int LD>
int launch_rows_probe_typed(const RopeParams& p, cudaStream_t st, bool pdl) {
  if (pick_path(&p) != 1 || !rows_ok(p, 8, NEOX)) return 1;
  const RowsPlan plan = plan_rows(p, 8, NEOX);
  return (int)launch_kernel(rows_probe<NEOX, LD>, plan.blocks, kRowsThreads, pdl, st, p, plan.f, 0);
}

const char* kNames[] = {
    "library default (rope_launch)",
    "library flat (variant 6; joint q+k blocks where they fit)",
    "probe kernel (5th session; steps with __launch_bounds__(256))",
    "steps: probe at 128 threads",
    "steps: + load_position, 64-bit token math",
    "steps: + load_cos_sin",
    "steps: + if/else per half",
    "library flat, separate q and k blocks (rope_set_flat_blocks(0))",
    "library flat, separate blocks, __launch_bounds__(256)",
    "library flat, separate blocks, __launch_bounds__(128, 10 or 8 blocks)",
    "library default, cos/sin rows computed on the fly (rope_set_launch rows_on_the_fly 1)",
    "library flat kernel where flat is the default, never the lean kernel (flat_hint instantiation)",
    "steps: probe at 128 threads, ld.global.nc data loads (the fifth session's real loads)",
    "library heads-per-thread where it is the default, ld.global.nc data loads",
    "library rows kernel (variant 7), ld.global.nc data loads",
    "sixth session's probe 2: 5th-session kernel on RopeParams, blockDim.x indexing, launch bounds 256",
    "  the same, launch bounds 128",
    "  the same, launch bounds 256, constant 128 instead of blockDim.x",
    "library flat kernel where flat is the default, never the lean kernel, ld.global.nc data loads",
};
}  // namespace flat_probe
using namespace flat_probe;

extern "C" int probe_count(void) { return (int)(sizeof(kNames) / sizeof(kNames[0])); }
extern "C" const char* probe_name(int i) { return i >= 0 && i < probe_count() ? kNames[i] : ""; }

extern "C" int probe_launch(int which, const ProbeCall* c, void* stream) {
  const RopeParams p = make_params(*c);
  cudaStream_t st = (cudaStream_t)stream;
  const RopeDevice dev = {132, 9};
  if (which <= 1 || which == 7 || which == 10) {
    rope_set_config(which == 1 || which == 7 ? kFlatVariant : -1, -1, -1);
    rope_set_launch(-1, which == 10 ? 1 : -1, c->pdl);
    rope_set_flat_blocks(which == 7 ? 0 : -1);
    const int rc = (int)rope_launch(&p, &dev, st);
    rope_set_config(-1, -1, -1);
    rope_set_launch(-1, -1, -1);
    rope_set_flat_blocks(-1);
    return rc;
  }
  if (which == 8 || which == 9) return launch_flat_bounds(*c, p, st, which == 9);
  const bool pdl = c->pdl != 0;
  if (which == 11)
    return c->interleaved ? launch_flat_hint_typed<false, HINT_PLAIN>(p, st, pdl)
                          : launch_flat_hint_typed<true, HINT_PLAIN>(p, st, pdl);
  if (which == 18)
    return c->interleaved ? launch_flat_hint_typed<false, HINT_NC>(p, st, pdl)
                          : launch_flat_hint_typed<true, HINT_NC>(p, st, pdl);
  if (which == 13)
    return c->interleaved ? launch_fast_nc_typed<false>(p, st, pdl) : launch_fast_nc_typed<true>(p, st, pdl);
  if (which == 14)
    return c->interleaved ? launch_rows_probe_typed<false, HINT_NC>(p, st, pdl)
                          : launch_rows_probe_typed<true, HINT_NC>(p, st, pdl);
  if (c->interleaved || c->R != 128 || c->D != 128 || c->inplace || c->inverse) return 1;
  const int h = c->Hq > c->Hk ? c->Hq : c->Hk;
  const int u = (h * 16 + 127) / 128;
  if (u > 8 || c->Hk == 0) return 1;
  switch (which) {
    case 2: return launch_step<0, 256>(p, u, c->pdl != 0, st);
    case 3: return launch_step<0>(p, u, c->pdl != 0, st);
    case 4: return launch_step<POS>(p, u, c->pdl != 0, st);
    case 5: return launch_step<POS | CS>(p, u, c->pdl != 0, st);
    case 6: return launch_step<POS | CS | BRANCH>(p, u, c->pdl != 0, st);
    case 12: return launch_step<NC>(p, u, c->pdl != 0, st);
    case 15: return launch_sixth<256, 1>(p, u, c->pdl != 0, st);
    case 16: return launch_sixth<128, 1>(p, u, c->pdl != 0, st);
    case 17: return launch_sixth<256, 0>(p, u, c->pdl != 0, st);
  }
  return -1;
}
