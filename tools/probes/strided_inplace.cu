// Probe set for tools/kernel_probe.py, W3 in place (GPT-J, head_dim 256, rotary_dim 64: 128 of
// every 512 bytes of a head row are read and written). Question: does any way of walking those
// bytes get below what the library's kernel takes (21.3 us against an 18 us target), or is the
// strided pattern's cost the memory system's? Every probe but the load/store-only ones (marked)
// computes the library's rotation bit for bit. The walk probes: bf16 GPT-J, rotary_dim 64,
// Hq == Hk, contiguous [tokens, H, D]; the library probes (14 on) take any in-place shape.
#include "../../csrc/rope_kernels.cu"

#include "kernel_probe.h"
#include "library_params.h"

namespace strided_probe {
using namespace rope_ops_cuda;
using bf16 = __nv_bfloat16;
using probe_common::make_params;

// Thread (row, chunk): a row is one head of one token (128 rotary bytes at pitch `pitch_vec`
// 16-byte vectors), chunk c = its 16-byte vector 0..7. A block of 256 threads covers 32 rows per
// step and U steps (U loads in flight per thread, then U stores).
enum { HINT_LD_PLAIN = 0, HINT_LD_CS = 1, HINT_ST_CS = 2, HINT_LD_NC = 4 };
struct Walk {
  uint4* q;
  uint4* k;
  const long long* pos;
  const float* cos_t;
  const float* sin_t;
  long long rows;       // rows per tensor (tokens * H)
  int heads;            // H (rows per token)
  int pitch_vec;        // row pitch in 16-byte vectors (32 for W3; 8 = dense)
  int tiles_per_tensor; // blocks' worth of rows per tensor
  int tiles;            // total tiles (q then k, or interleaved)
};

template <int HINT>
__device__ __forceinline__ uint4 ld(const uint4* p) {
  if constexpr ((HINT & HINT_LD_CS) != 0) return __ldcs(p);
  if constexpr ((HINT & HINT_LD_NC) != 0) return __ldg(p);
  return *p;
}
template <int HINT>
__device__ __forceinline__ void st(uint4* p, const uint4& v) {
  if constexpr ((HINT & HINT_ST_CS) != 0) {
    __stcs(p, v);
  } else {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
  }
}

// Loads of the U rows first, then their positions, then their cos/sin rows, then math and
// stores: no dependent load waits behind another row's (the first round of probes chained them).
template <int TB, int U, int HINT, bool ROTATE, bool QK_INTERLEAVED>
__device__ __forceinline__ void walk_tile(const Walk& w, int tile) {
  constexpr int kRowsPerStep = TB / 8;
  const bool isk = QK_INTERLEAVED ? (tile & 1) : tile >= w.tiles_per_tensor;
  const int t = QK_INTERLEAVED ? tile >> 1 : (isk ? tile - w.tiles_per_tensor : tile);
  uint4* base = isk ? w.k : w.q;
  const int c = threadIdx.x & 7;
  const int row0 = t * (kRowsPerStep * U) + (threadIdx.x >> 3);  // rows < 2^31 here
  uint4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int r = row0 + kRowsPerStep * u;
    if (r < w.rows) v[u] = ld<HINT>(base + (long long)r * w.pitch_vec + c);
  }
  float cs[U][4], sn[U][4];
  if constexpr (ROTATE) {
    long long ps[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int r = row0 + kRowsPerStep * u;
      ps[u] = r < w.rows ? __ldg(w.pos + r / w.heads) : 0;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float4 cv = __ldg(reinterpret_cast<const float4*>(w.cos_t + ps[u] * 32 + c * 4));
      const float4 sv = __ldg(reinterpret_cast<const float4*>(w.sin_t + ps[u] * 32 + c * 4));
      cs[u][0] = cv.x; cs[u][1] = cv.y; cs[u][2] = cv.z; cs[u][3] = cv.w;
      sn[u][0] = sv.x; sn[u][1] = sv.y; sn[u][2] = sv.z; sn[u][3] = sv.w;
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int r = row0 + kRowsPerStep * u;
    if (r >= w.rows) continue;
    uint4 o = v[u];
    if constexpr (ROTATE) {
      float x[8], y[8];
      unpack16<bf16>(v[u], x);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        y[2 * j] = fmaf(x[2 * j], cs[u][j], -x[2 * j + 1] * sn[u][j]);
        y[2 * j + 1] = fmaf(x[2 * j + 1], cs[u][j], x[2 * j] * sn[u][j]);
      }
      o = pack16<bf16>(y);
    }
    st<HINT>(base + (long long)r * w.pitch_vec + c, o);
  }
}

template <int TB, int U, int HINT, bool ROTATE, bool QK_INTERLEAVED, bool PERSISTENT>
__global__ void __launch_bounds__(TB) walk_kernel(const __grid_constant__ Walk w) {
  wait_for_previous_grid();
  if constexpr (PERSISTENT) {
    for (int tile = blockIdx.x; tile < w.tiles; tile += gridDim.x)
      walk_tile<TB, U, HINT, ROTATE, QK_INTERLEAVED>(w, tile);
  } else {
    walk_tile<TB, U, HINT, ROTATE, QK_INTERLEAVED>(w, blockIdx.x);
  }
}

// blocks_per_sm > 0: at most that many resident blocks per SM (held down with unused dynamic
// shared memory), to see whether fewer requests in flight help the strided pattern.
template <int TB, int U, int HINT, bool ROTATE, bool QK_INTERLEAVED = false, bool PERSISTENT = false>
int launch_walk(const ProbeCall& c, cudaStream_t st, bool dense = false, int blocks_per_sm = 0) {
  Walk w;
  w.q = (uint4*)c.q;
  w.k = (uint4*)c.k;
  w.pos = (const long long*)c.pos;
  w.cos_t = c.cos_t;
  w.sin_t = c.sin_t;
  w.heads = c.Hq;
  w.rows = c.tokens * c.Hq;
  // dense: the same number of 128-byte rows, packed (the first quarter of each tensor)
  w.pitch_vec = dense ? 8 : c.D / 8;
  w.tiles_per_tensor = (int)((w.rows + TB / 8 * U - 1) / (TB / 8 * U));
  w.tiles = 2 * w.tiles_per_tensor;
  auto* kernel = walk_kernel<TB, U, HINT, ROTATE, QK_INTERLEAVED, PERSISTENT>;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)(PERSISTENT ? 132 * 8 : w.tiles));
  cfg.blockDim = dim3(TB);
  cfg.stream = st;
  if (blocks_per_sm > 0) {
    cfg.dynamicSmemBytes = (228 * 1024) / blocks_per_sm - 2048;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)cfg.dynamicSmemBytes);
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = c.pdl ? 1 : 0;
  return (int)cudaLaunchKernelEx(&cfg, kernel, w);
}


const char* kNames[] = {
    "library default (rope_launch)",
    "walk 256 threads, U=1, plain",
    "walk 256, U=1, ld.cs + st.cs",
    "walk 256, U=1, st.cs",
    "walk 128, U=1, plain",
    "walk 256, U=2, plain",
    "walk 256, U=2, ld.cs + st.cs",
    "walk 256, U=1, plain, at most 3 blocks per SM",
    "walk 256, U=1, plain, at most 5 blocks per SM",
    "walk 256, U=1, plain, at most 6 blocks per SM",
    "walk 256, U=1, load/store only (DIFF expected)",
    "walk 256, U=1, load/store only, ld.cs + st.cs (DIFF expected)",
    "walk 256, U=1, load/store only, dense 128-byte pitch (same bytes; DIFF expected)",
    "walk 256, U=4, plain (hoisted cos/sin)",
    "library, variant 0 forced", "library, variant 1 forced", "library, variant 2 forced",
    "library, variant 3 forced", "library, variant 4 forced", "library, variant 5 forced",
    "library, one head per thread", "library, at most 2 heads per thread",
    "library, 256-thread blocks",
    "library, variant 6 (flat) forced", "library, variant 7 (rows) forced",
    "walk 256, U=1, ld.global.nc + st.cs",
    "walk 256, U=1, load/store only, ld.global.nc + st.cs (DIFF expected)",
    "walk 256, U=1, load/store only, ld.global.nc (DIFF expected)",
};
}  // namespace strided_probe
using namespace strided_probe;

extern "C" int probe_count(void) { return (int)(sizeof(kNames) / sizeof(kNames[0])); }
extern "C" const char* probe_name(int i) { return i >= 0 && i < probe_count() ? kNames[i] : ""; }

extern "C" int probe_launch(int which, const ProbeCall* c, void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  if (which == 0) {
    const RopeParams p = make_params(*c);
    const RopeDevice dev = {132, 9};
    rope_set_launch(-1, -1, c->pdl);
    const int rc = (int)rope_launch(&p, &dev, st);
    rope_set_launch(-1, -1, -1);
    return rc;
  }
  if (which >= 14 && which <= 24) {  // the library's kernels with one knob forced (any shape)
    const RopeParams p = make_params(*c);
    const RopeDevice dev = {132, 9};
    const int v = which <= 19 ? which - 14 : which >= 23 ? which - 17 : -1;
    rope_set_config(v, which == 20 ? 1 : which == 21 ? 2 : -1, -1);
    rope_set_launch(which == 22 ? 256 : -1, -1, c->pdl);
    const int rc = (int)rope_launch(&p, &dev, st);
    rope_set_config(-1, -1, -1);
    rope_set_launch(-1, -1, -1);
    return rc;
  }
  if (!c->interleaved || c->R != 64 || c->D % 8 != 0 || !c->inplace || c->inverse || c->Hq != c->Hk)
    return 1;
  switch (which) {
    case 1: return launch_walk<256, 1, HINT_LD_PLAIN, true>(*c, st);
    case 2: return launch_walk<256, 1, HINT_LD_CS | HINT_ST_CS, true>(*c, st);
    case 3: return launch_walk<256, 1, HINT_ST_CS, true>(*c, st);
    case 4: return launch_walk<128, 1, HINT_LD_PLAIN, true>(*c, st);
    case 5: return launch_walk<256, 2, HINT_LD_PLAIN, true>(*c, st);
    case 6: return launch_walk<256, 2, HINT_LD_CS | HINT_ST_CS, true>(*c, st);
    case 7: return launch_walk<256, 1, HINT_LD_PLAIN, true>(*c, st, false, 3);
    case 8: return launch_walk<256, 1, HINT_LD_PLAIN, true>(*c, st, false, 5);
    case 9: return launch_walk<256, 1, HINT_LD_PLAIN, true>(*c, st, false, 6);
    case 10: return launch_walk<256, 1, HINT_LD_PLAIN, false>(*c, st);
    case 11: return launch_walk<256, 1, HINT_LD_CS | HINT_ST_CS, false>(*c, st);
    case 12: return launch_walk<256, 1, HINT_LD_PLAIN, false>(*c, st, true);
    case 13: return launch_walk<256, 4, HINT_LD_PLAIN, true>(*c, st);
    case 25: return launch_walk<256, 1, HINT_LD_NC | HINT_ST_CS, true>(*c, st);
    case 26: return launch_walk<256, 1, HINT_LD_NC | HINT_ST_CS, false>(*c, st);
    case 27: return launch_walk<256, 1, HINT_LD_NC, false>(*c, st);
  }
  return -1;
}
