// Standalone GPU timing of the fused prologue's CUDA kernels (csrc/kernel_prologue.cuh), without
// torch: the prologue timing cases of tools/gpu_triton_check.py (Qwen3-8B-like bf16 prefill, in
// place, training forward + backward, 256-token decodes with a bf16 / float8 cache write), each
// in one CUDA graph against a same-bytes copy kernel, and a hash of every output (q, k, v or qkv
// in place, grad_qkv, the weight-gradient partials and sums, the cache): two builds whose hashes
// match give the same bits. tools/prologue_variants.sh builds it against variants of csrc/
// (stage counts, launch bounds, another revision) and runs them in one process each, back to
// back, for comparisons within one run.
//
//   nvcc -gencode=arch=compute_90,code=sm_90 -O3 -std=c++17 --expt-relaxed-constexpr -Icsrc \
//        tools/prologue_kernel_timing.cu -o /tmp/prologue_timing && /tmp/prologue_timing
//
// PT_CASE=<name> runs one case. -DPT_NO_WEIGHT_GRAD builds against sources without the
// weight-gradient kernel (the partial rows are then the backward's last output).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>
#include <algorithm>
#include "kernel_prologue.cuh"

namespace rope_ops_cuda {
namespace {
// The launches of rope_launch.cu's Launcher (with programmatic dependent launch), for the
// prologue kernels alone: this file compiles kernel_prologue.cuh only.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, int threads, int smem, cudaStream_t st, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid; cfg.blockDim = dim3((unsigned)threads); cfg.dynamicSmemBytes = (size_t)smem; cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr; cfg.numAttrs = 1;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, args...);
  return e != cudaSuccess ? e : cudaGetLastError();
}
struct Launcher {
  cudaStream_t stream;
  template <typename T, bool NEOX, int VB, int U, class A>
  cudaError_t prologue(const RopePrologueParams& p, const ProloguePlan& plan) {
    return launch(rope_prologue_kernel<T, NEOX, VB, U, A>, dim3((unsigned)plan.blocks, (unsigned)plan.splits),
              kPrologueThreads, plan.smem_bytes, stream, p, plan.sh);
  }
  template <typename T, bool NEOX, int VB, int U, class A>
  cudaError_t prologue_backward(const RopePrologueParams& p, const ProloguePlan& plan) {
    return launch(rope_prologue_backward_kernel<T, NEOX, VB, U, A>, dim3((unsigned)plan.blocks), kPrologueThreads,
              plan.smem_bytes, stream, p, plan.sh);
  }
#ifndef PT_NO_WEIGHT_GRAD
  cudaError_t prologue_weight_grads(const RopePrologueParams& p, int64_t rows) {
    return launch(rope_prologue_weight_grad_kernel, dim3((unsigned)((p.rope.D + kWeightGradCols - 1) / kWeightGradCols), 2),
                  kWeightGradCols * kWeightGradRowLanes, 0, stream, p, rows);
  }
#endif
};
}  // namespace
}  // namespace rope_ops_cuda
using namespace rope_ops_cuda;

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)

__global__ void fill_bf16(__nv_bfloat16* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed; h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    float u = ((h & 0xffffff) / 16777216.0f) * 2.f - 1.f;
    x[i] = __float2bfloat16_rn(u * 1.7f);
  }
}
__global__ void copy_kernel(const uint4* __restrict__ a, uint4* __restrict__ b, size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (; i + stride < n; i += 2 * stride) { uint4 x = a[i], y = a[i + stride]; b[i] = x; b[i + stride] = y; }
  if (i < n) b[i] = a[i];
}

static uint64_t fnv(const void* d, size_t n, uint64_t h = 1469598103934665603ull) {
  const unsigned char* c = (const unsigned char*)d;
  for (size_t i = 0; i < n; ++i) { h ^= c[i]; h *= 1099511628211ull; }
  return h;
}
static uint64_t dev_hash(const void* p, size_t n, uint64_t h) {
  std::vector<unsigned char> v(n);
  CK(cudaMemcpy(v.data(), p, n, cudaMemcpyDeviceToHost));
  return fnv(v.data(), n, h);
}

template <class F>
static float graph_us(cudaStream_t st, int calls, F&& f) {
  cudaGraph_t g; cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (int c = 0; c < calls; ++c) f(c);
  CK(cudaStreamEndCapture(st, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  CK(cudaGraphLaunch(ge, st)); CK(cudaStreamSynchronize(st));
  float best = 1e30f;
  for (int r = 0; r < 7; ++r) {
    cudaEventRecord(a, st); CK(cudaGraphLaunch(ge, st)); cudaEventRecord(b, st); CK(cudaEventSynchronize(b));
    float ms; cudaEventElapsedTime(&ms, a, b); best = std::min(best, ms * 1000.f / calls);
  }
  cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
  return best;
}

struct Case { const char* name; int B, S; bool inplace; int cache; bool backward; };

int main() {
  cudaStream_t st; CK(cudaStreamCreate(&st));
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  RopeDevice dev{sms, 9, 0, 1};
  const int Hq = 32, Hk = 8, D = 128, H = Hq + 2 * Hk, TR = 32768, SLOTS = 65536;
  // tables, weights
  std::vector<float> hc((size_t)TR * 64), hs((size_t)TR * 64);
  for (int p = 0; p < TR; ++p) for (int i = 0; i < 64; ++i) { double a = p * pow(500000.0, -i / 64.0); hc[p * 64 + i] = cos(a); hs[p * 64 + i] = sin(a); }
  float *cosd, *sind, *qw, *kw; CK(cudaMalloc(&cosd, hc.size() * 4)); CK(cudaMalloc(&sind, hs.size() * 4));
  CK(cudaMemcpy(cosd, hc.data(), hc.size() * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(sind, hs.data(), hs.size() * 4, cudaMemcpyHostToDevice));
  std::vector<float> hw(D); for (int i = 0; i < D; ++i) hw[i] = 1.0f + 0.3f * sinf(i * 1.3f);
  CK(cudaMalloc(&qw, D * 4)); CK(cudaMalloc(&kw, D * 4));
  CK(cudaMemcpy(qw, hw.data(), D * 4, cudaMemcpyHostToDevice)); for (auto& w : hw) w = 2.f - w;
  CK(cudaMemcpy(kw, hw.data(), D * 4, cudaMemcpyHostToDevice));
  __nv_bfloat16 *kc, *vc; CK(cudaMalloc(&kc, (size_t)SLOTS * Hk * D * 2)); CK(cudaMalloc(&vc, (size_t)SLOTS * Hk * D * 2));
  uint8_t *kc8, *vc8; CK(cudaMalloc(&kc8, (size_t)SLOTS * Hk * D)); CK(cudaMalloc(&vc8, (size_t)SLOTS * Hk * D));
  CK(cudaMemset(kc, 0, (size_t)SLOTS * Hk * D * 2)); CK(cudaMemset(vc, 0, (size_t)SLOTS * Hk * D * 2));
  CK(cudaMemset(kc8, 0, (size_t)SLOTS * Hk * D)); CK(cudaMemset(vc8, 0, (size_t)SLOTS * Hk * D));
  Case cases[] = {{"prefill", 1, 16384, false, 0, false}, {"prefill-inplace", 1, 16384, true, 0, false},
                  {"train-fwd+bwd", 2, 4096, false, 0, true}, {"decode-bf16", 1, 256, false, 1, false},
                  {"decode-fp8", 1, 256, false, 2, false}};
  const char* only = getenv("PT_CASE");
  for (const Case& cs : cases) {
    if (only && strcmp(only, cs.name) != 0) continue;
    const size_t T = (size_t)cs.B * cs.S, row = (size_t)H * D;
    size_t set_bytes = T * row * 2 * (cs.backward ? 5 : 2);
    int nsets = (int)std::max<size_t>(2, std::min<size_t>(40, (size_t)(400e6 / set_bytes) + 1));
    struct Set { __nv_bfloat16 *qkv, *q, *k, *v, *gq, *gk, *gv, *gqkv; int64_t* pos; int64_t* slots; };
    std::vector<Set> sets(nsets);
    std::vector<int64_t> hp(T), hsl(T);
    for (int si = 0; si < nsets; ++si) {
      Set& s = sets[si];
      CK(cudaMalloc(&s.qkv, T * row * 2)); fill_bf16<<<1024, 256>>>(s.qkv, T * row, 17 + si);
      CK(cudaMalloc(&s.q, T * Hq * D * 2)); CK(cudaMalloc(&s.k, T * Hk * D * 2)); CK(cudaMalloc(&s.v, T * Hk * D * 2));
      s.gq = s.gk = s.gv = s.gqkv = nullptr;
      if (cs.backward) {
        CK(cudaMalloc(&s.gq, T * Hq * D * 2)); fill_bf16<<<1024, 256>>>(s.gq, T * Hq * D, 99 + si);
        CK(cudaMalloc(&s.gk, T * Hk * D * 2)); fill_bf16<<<1024, 256>>>(s.gk, T * Hk * D, 199 + si);
        CK(cudaMalloc(&s.gv, T * Hk * D * 2)); fill_bf16<<<1024, 256>>>(s.gv, T * Hk * D, 299 + si);
        CK(cudaMalloc(&s.gqkv, T * row * 2));
      }
      for (size_t t = 0; t < T; ++t) { hp[t] = cs.cache ? (int64_t)((t * 7919 + si * 131) % 32768) : (int64_t)(t % 4096); hsl[t] = (int64_t)((t * 40503 + si * 977) % SLOTS); }
      CK(cudaMalloc(&s.pos, T * 8)); CK(cudaMemcpy(s.pos, hp.data(), T * 8, cudaMemcpyHostToDevice));
      CK(cudaMalloc(&s.slots, T * 8)); CK(cudaMemcpy(s.slots, hsl.data(), T * 8, cudaMemcpyHostToDevice));
    }
    auto params = [&](const Set& s) {
      RopePrologueParams p = {};
      RopeParams& r = p.rope;
      r.B = cs.B; r.S = cs.S; r.D = D; r.R = D; r.dtype = ROPE_BF16; r.interleaved = 0;
      r.pos = s.pos; r.pos_kind = ROPE_POS_I64; r.pos_stride_b = cs.S; r.pos_stride_s = 1;
      r.cos_table = cosd; r.sin_table = sind; r.table_rows = TR; r.table_row_stride = 64; r.attention_factor = 1.f;
      p.qkv = s.qkv; p.qkv_stride_b = (int64_t)cs.S * row; p.qkv_stride_s = row; p.Hq = Hq; p.Hk = Hk;
      p.inplace = cs.inplace;
      void* o[3] = {s.q, s.k, s.v}; int64_t hh[3] = {Hq, Hk, Hk};
      for (int t = 0; t < 3; ++t) { p.out[t] = o[t]; p.out_stride[t][0] = (int64_t)cs.S * hh[t] * D; p.out_stride[t][1] = hh[t] * D; p.out_stride[t][2] = D; }
      p.q_weight = qw; p.k_weight = kw; p.eps = 1e-6f; p.weight_offset = 0.f;
      if (cs.cache) {
        p.k_cache = cs.cache == 2 ? (void*)kc8 : (void*)kc; p.v_cache = cs.cache == 2 ? (void*)vc8 : (void*)vc;
        p.k_cache_stride[0] = p.v_cache_stride[0] = Hk * D; p.k_cache_stride[1] = p.v_cache_stride[1] = D;
        p.num_slots = SLOTS; p.slots = s.slots; p.slots_kind = ROPE_POS_I64; p.slots_stride_b = cs.S; p.slots_stride_s = 1;
        p.cache_fp8 = cs.cache == 2; p.k_scale = 0.5f; p.v_scale = 2.f;
      }
      return p;
    };
    float *qpart = nullptr, *kpart = nullptr, *qgrad = nullptr, *kgrad = nullptr;
    int64_t nblk = 0;
    if (cs.backward) {
      RopePrologueParams p = params(sets[0]);
      ProloguePlan plan; plan_prologue(p, dev, true, plan); nblk = plan.blocks;
      CK(cudaMalloc(&qpart, nblk * D * 4)); CK(cudaMalloc(&kpart, nblk * D * 4));
      CK(cudaMalloc(&qgrad, D * 4)); CK(cudaMalloc(&kgrad, D * 4));
    }
    auto call = [&](int c) {
      const Set& s = sets[c % nsets];
      RopePrologueParams p = params(s);
      Launcher ex{st};
      CK(run_prologue(p, dev, false, ex));
      if (cs.backward) {
        p.rope.inverse = 1;
        p.grad[0] = s.gq; p.grad[1] = s.gk; p.grad[2] = s.gv;
        int64_t hh[3] = {Hq, Hk, Hk};
        for (int t = 0; t < 3; ++t) { p.grad_stride[t][0] = (int64_t)cs.S * hh[t] * D; p.grad_stride[t][1] = hh[t] * D; p.grad_stride[t][2] = D; }
        p.grad_qkv = s.gqkv; p.grad_qkv_stride_b = (int64_t)cs.S * row; p.grad_qkv_stride_s = row;
        p.q_weight_partials = qpart; p.k_weight_partials = kpart;
#ifndef PT_NO_WEIGHT_GRAD
        p.q_weight_grad = qgrad; p.k_weight_grad = kgrad;
#endif
        CK(run_prologue(p, dev, true, ex));
      }
    };
    CK(cudaDeviceSynchronize());
    // correctness fingerprint: one call on set 0 (in place: on a fresh copy)
    call(0);
    CK(cudaDeviceSynchronize());
    uint64_t h = 1469598103934665603ull;
    const Set& s0 = sets[0];
    if (cs.inplace) h = dev_hash(s0.qkv, T * row * 2, h);
    else { h = dev_hash(s0.q, T * Hq * D * 2, h); h = dev_hash(s0.k, T * Hk * D * 2, h); h = dev_hash(s0.v, T * Hk * D * 2, h); }
    if (cs.backward) { h = dev_hash(s0.gqkv, T * row * 2, h); h = dev_hash(qpart, nblk * D * 4, h); h = dev_hash(kpart, nblk * D * 4, h); }
#ifndef PT_NO_WEIGHT_GRAD
    if (cs.backward) { h = dev_hash(qgrad, D * 4, h); h = dev_hash(kgrad, D * 4, h); }
#endif
    if (cs.cache) { h = dev_hash(cs.cache == 2 ? (void*)kc8 : (void*)kc, (size_t)SLOTS * Hk * D * (cs.cache == 2 ? 1 : 2), h); }
    const int calls = cs.cache ? 40 : 20;
    float us = graph_us(st, calls, call);
    // same-bytes copy
    // traffic that must move (read + written), copied as half read, half written
    size_t traffic = cs.inplace ? 2 * T * (Hq + Hk) * D * 2 : 2 * T * row * 2;
    if (cs.backward) traffic += T * (Hq + Hk) * D * 2 + 2 * T * row * 2;
    if (cs.cache) traffic += T * 2 * Hk * D * (cs.cache == 2 ? 1 : 2);
    size_t bytes = traffic / 2;
    size_t nvec = bytes / 16;
    uint4 *ca, *cb; CK(cudaMalloc(&ca, nvec * 16 * (cs.cache ? 40 : 2))); CK(cudaMalloc(&cb, nvec * 16 * (cs.cache ? 40 : 2)));
    float cus = graph_us(st, calls, [&](int c) {
      size_t off = (size_t)(c % (cs.cache ? 40 : 2)) * nvec;
      copy_kernel<<<(unsigned)std::min<size_t>((nvec + 511) / 512, 132 * 16), 256, 0, st>>>(ca + off, cb + off, nvec);
    });
    printf("%-18s us %8.2f  copy %8.2f  %%copy %6.1f  hash %016llx  blocks %lld\n", cs.name, us, cus, 100.f * cus / us,
           (unsigned long long)h, (long long)nblk);
    cudaFree(ca); cudaFree(cb);
    for (Set& s : sets) { cudaFree(s.qkv); cudaFree(s.q); cudaFree(s.k); cudaFree(s.v); cudaFree(s.pos); cudaFree(s.slots);
      if (s.gq) { cudaFree(s.gq); cudaFree(s.gk); cudaFree(s.gv); cudaFree(s.gqkv); } }
    if (qpart) { cudaFree(qpart); cudaFree(kpart); cudaFree(qgrad); cudaFree(kgrad); }
  }
  return 0;
}
