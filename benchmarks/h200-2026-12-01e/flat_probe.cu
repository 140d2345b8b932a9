// One-off probe kernels (H200, bf16, contiguous [tokens, H, 128] q and k, NeoX, full rotary).
// flat_copy: a plain copy written like ours (16-byte vectors, U per thread, optional PDL, load and
// store cache hints), to see whether a hand-written CUDA copy reaches the driver copy's speed.
// flat_rope: one block per (token, q or k): a token's heads are contiguous, so the block reads
// and writes one contiguous 4-16 KB range, like a copy's block; each thread owns vector c of
// 16 in every head it visits (so one position and one cos/sin chunk per thread), and takes the
// other half of its pairs from lane c ^ 8 by shuffles.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

__device__ __forceinline__ void pdl_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// LD: 0 ld.global.cs (what our kernels use), 1 plain ld.global, 2 ld.global.nc; ST: 0 plain, 1 st.cs
template <int LD>
__device__ __forceinline__ uint4 ld16(const uint4* p) {
  if constexpr (LD == 0) return __ldcs(p);
  else if constexpr (LD == 1) return *p;
  else return __ldg(p);
}

template <int U, int LD, int ST>
__global__ void __launch_bounds__(256) flat_copy(const uint4* __restrict__ src, uint4* __restrict__ dst, long long n) {
  pdl_wait();
  const long long base = (long long)blockIdx.x * blockDim.x * U + threadIdx.x;
  uint4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const long long i = base + (long long)u * blockDim.x;
    if (i < n) v[u] = ld16<LD>(src + i);
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const long long i = base + (long long)u * blockDim.x;
    if (i < n) {
      if constexpr (ST == 1) __stcs(dst + i, v[u]);
      else dst[i] = v[u];
    }
  }
}

__device__ __forceinline__ void unpack(const uint4& v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 h;
    memcpy(&h, &w[i], 4);
    const float2 t = __bfloat1622float2(h);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ uint4 pack(const float* f) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    memcpy(&w[i], &h, 4);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <int MAXU, int LD>
__global__ void __launch_bounds__(256) flat_rope(const uint4* __restrict__ q, const uint4* __restrict__ k,
                                                 uint4* __restrict__ qo, uint4* __restrict__ ko,
                                                 const long long* __restrict__ pos,
                                                 const float* __restrict__ cos_t,
                                                 const float* __restrict__ sin_t, int Hq, int Hk) {
  pdl_wait();
  const long long tok = blockIdx.x >> 1;
  const bool isk = blockIdx.x & 1;
  const int nv = (isk ? Hk : Hq) * 16;
  const uint4* src = (isk ? k : q) + tok * nv;
  uint4* dst = (isk ? ko : qo) + tok * nv;
  const int warp_base = threadIdx.x & ~31;
  uint4 v[MAXU];
#pragma unroll
  for (int u = 0; u < MAXU; ++u) {
    const int j = threadIdx.x + u * blockDim.x;
    if (warp_base + u * (int)blockDim.x < nv) v[u] = ld16<LD>(src + j);
  }
  const int c = threadIdx.x & 15;
  const bool first = c < 8;
  const long long p = __ldg(pos + tok);
  float cs[8], sn[8];
  const float4* cp = reinterpret_cast<const float4*>(cos_t + p * 64 + (c & 7) * 8);
  const float4* sp = reinterpret_cast<const float4*>(sin_t + p * 64 + (c & 7) * 8);
  const float4 c0 = __ldg(cp), c1 = __ldg(cp + 1), s0 = __ldg(sp), s1 = __ldg(sp + 1);
  cs[0] = c0.x; cs[1] = c0.y; cs[2] = c0.z; cs[3] = c0.w; cs[4] = c1.x; cs[5] = c1.y; cs[6] = c1.z; cs[7] = c1.w;
  sn[0] = s0.x; sn[1] = s0.y; sn[2] = s0.z; sn[3] = s0.w; sn[4] = s1.x; sn[5] = s1.y; sn[6] = s1.z; sn[7] = s1.w;
#pragma unroll
  for (int u = 0; u < MAXU; ++u) {
    if (warp_base + u * (int)blockDim.x < nv) {  // warp-uniform: the shuffles need every lane
      uint4 o;
      o.x = __shfl_xor_sync(0xffffffffu, v[u].x, 8);
      o.y = __shfl_xor_sync(0xffffffffu, v[u].y, 8);
      o.z = __shfl_xor_sync(0xffffffffu, v[u].z, 8);
      o.w = __shfl_xor_sync(0xffffffffu, v[u].w, 8);
      float x[8], y[8], r[8];
      unpack(v[u], x);
      unpack(o, y);
#pragma unroll
      for (int i = 0; i < 8; ++i) r[i] = first ? fmaf(x[i], cs[i], -y[i] * sn[i]) : fmaf(x[i], cs[i], y[i] * sn[i]);
      dst[threadIdx.x + u * blockDim.x] = pack(r);
    }
  }
}

static cudaError_t launch(const void* fn, long long blocks, int threads, int pdl, cudaStream_t st, void** args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)blocks);
  cfg.blockDim = dim3((unsigned)threads);
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelExC(&cfg, fn, args);
}

template <int U>
static const void* copy_fn(int ld, int st) {
  if (ld == 0) return st ? (const void*)flat_copy<U, 0, 1> : (const void*)flat_copy<U, 0, 0>;
  if (ld == 1) return st ? (const void*)flat_copy<U, 1, 1> : (const void*)flat_copy<U, 1, 0>;
  return st ? (const void*)flat_copy<U, 2, 1> : (const void*)flat_copy<U, 2, 0>;
}

extern "C" int probe_copy(const void* src, void* dst, long long nvec, int threads, int U, int pdl, int ld, int st,
                          void* stream) {
  long long n = nvec;
  void* args[] = {&src, &dst, &n};
  const long long blocks = (nvec + (long long)threads * U - 1) / ((long long)threads * U);
  const void* fn = U == 1 ? copy_fn<1>(ld, st) : U == 2 ? copy_fn<2>(ld, st) : U == 4 ? copy_fn<4>(ld, st)
                                                                              : copy_fn<8>(ld, st);
  return (int)launch(fn, blocks, threads, pdl, (cudaStream_t)stream, args);
}

template <int LD>
static const void* rope_fn(int u) {
  return u <= 1 ? (const void*)flat_rope<1, LD> : u <= 2 ? (const void*)flat_rope<2, LD>
       : u <= 4 ? (const void*)flat_rope<4, LD> : (const void*)flat_rope<8, LD>;
}

extern "C" int probe_rope(const void* q, const void* k, void* qo, void* ko, const void* pos, const void* cos_t,
                          const void* sin_t, long long tokens, int Hq, int Hk, int threads, int pdl, int ld,
                          void* stream) {
  void* args[] = {&q, &k, &qo, &ko, &pos, &cos_t, &sin_t, &Hq, &Hk};
  const int h = Hq > Hk ? Hq : Hk;
  const int u = (h * 16 + threads - 1) / threads;
  if (u > 8) return -1;
  const void* fn = ld == 0 ? rope_fn<0>(u) : rope_fn<1>(u);
  return (int)launch(fn, tokens * 2, threads, pdl, (cudaStream_t)stream, args);
}
