// Test only: the C API of csrc/rope.h with every launch run on the CPU. The kernel choice,
// candidates and grid plans are csrc's own (dispatch.h, policy.h, candidates.h); an executor
// runs each would-be thread of the chosen kernel in turn over host pointers, through the same
// per-thread code as the device (the kernel headers' __host__ __device__ functions). Warps whose
// lanes exchange vectors by shuffles run phase by phase: every lane up to the shuffle, then the
// exchange, then every lane's rest, as a warp runs in lockstep.
//
// Built by tests/_cuda_tools.py with nvcc into a shared library; tests/csrc/emulated_binding.cpp
// links it under csrc/rope_torch.h, so the extension's own torch code runs on CPU tensors.
// What it cannot see: device-only behaviour (__ldg, real concurrency, the device's sincospif and
// conversion rounding, alignment faults, PDL), stream semantics.
#include <set>
#include <string>
#include <vector>

#include "dispatch.h"
#include "kernel_prologue.cuh"

namespace rope_ops_cuda {
namespace {

// The kernel instantiations run since the last rope_emulated_reset(), by name.
std::set<std::string> g_kernels_run;

template <typename T>
const char* dtype_name() {
  return sizeof(T) == 4 ? "float32" : std::is_same<T, __half>::value ? "float16" : "bfloat16";
}

// ",token" / ",mrope" for the angle sources other than the table.
template <class A>
std::string source_suffix() {
  return A::kEveryFamily ? std::string() : std::string(",") + A::kName;
}

template <typename T, bool NEOX>
void record(const char* family, const std::string& rest) {
  g_kernels_run.insert(std::string(family) + "<" + dtype_name<T>() + (NEOX ? ",neox" : ",gptj") + rest + ">");
}

// group_sum on 32 lanes' values: the same xor butterfly, every lane's partner read before any
// lane adds (as shuffles exchange).
void emulate_group_sum(float* v, int G) {
  for (int off = G >> 1; off > 0; off >>= 1) {
    float next[32];
    for (int l = 0; l < 32; ++l) next[l] = v[l] + v[l ^ off];
    for (int l = 0; l < 32; ++l) v[l] = next[l];
  }
}

template <typename T, bool NEOX, int VB, int U>
void record_prologue(const char* family) {
  record<T, NEOX>(family, std::string(VB == 16 ? ",v16" : ",v1") + ",u" + std::to_string(U));
}

// Each emulated lane's own ring of `stages` stages (none: unused) of `slots` vectors, step 1:
// the copies complete at once.
struct EmulatedRings {
  std::vector<uint4> data;
  int slots, per_lane;
  EmulatedRings(int lanes, int stages, int slots_)
      : data((size_t)lanes * (stages > 0 ? stages : 1) * slots_), slots(slots_),
        per_lane((stages > 0 ? stages : 1) * slots_) {}
  LaneRing of(int lane) { return LaneRing{data.data() + (size_t)lane * per_lane, 1, slots}; }
};

struct Emulator {
  template <typename T, bool NEOX, int SCHED, int ST, int HINT, class A, int VB>
  cudaError_t heads(const RopeParams& p, const HeadsPlan& f, const bool fly) {
    record<T, NEOX>(VB == 8 ? "heads8" : "heads",
                    std::string(",") + (SCHED == SCHED_PIPE ? "pipe" : "rounds") + std::to_string(ST) +
                        source_suffix<A>());
    for (long long g = 0; g < f.total; ++g)
      heads_thread<T, NEOX, SCHED, ST, HINT, A, VB>(p, (int)f.CR, (int)f.CT, (int)f.hl, g, f.total, fly);
    return cudaSuccess;
  }

  // flat_block_body, warp by warp.
  template <typename T, bool NEOX, int U, int BLOCKS, class A>
  cudaError_t flat(const RopeParams& p, const FlatPlan& plan, const bool fly) {
    using Thread = FlatThread<T, NEOX, BLOCKS, A>;
    record<T, NEOX>("flat", std::string(",") + std::to_string(U) +
                                (BLOCKS == ROPE_FLAT_SPLIT ? ",split" : BLOCKS == ROPE_FLAT_JOINT ? ",joint" : ",separate"));
    for (long long bid = 0; bid < plan.blocks; ++bid) {
      long long block = bid;
      int j0 = 0;
      if (BLOCKS == ROPE_FLAT_SPLIT) split_block(plan.split, U, bid, block, j0);
      for (int w = 0; w < kFlatThreads; w += 32) {
        std::vector<Thread> th;
        th.reserve(32);
        uint4 v[32][U];
        for (int l = 0; l < 32; ++l) {
          const int t = w + l;
          th.emplace_back(p, plan.f, block, t);
          for (int u = 0; u < U; ++u) {
            const int j = j0 + t + u * kFlatThreads;
            v[l][u] = th[l].has(j) ? th[l].load(j) : make_uint4(0, 0, 0, 0);
          }
          th[l].load_pos(p, plan.f);
          th[l].load_cs(p, fly);
        }
        for (int u = 0; u < U; ++u) {
          if (j0 + w + u * kFlatThreads >= th[0].nv) break;  // the warp leaves the loop together
          for (int l = 0; l < 32; ++l) {
            const int j = j0 + w + l + u * kFlatThreads;
            const uint4 other = NEOX ? v[th[l].partner(l)][u] : v[l][u];
            if (th[l].has(j)) th[l].finish(j, v[l][u], other);
          }
        }
      }
    }
    return cudaSuccess;
  }

  // rope_lean_kernel, warp by warp.
  template <typename T, int U, class A>
  cudaError_t lean(const RopeParams& p, const LeanShape& f, const int64_t blocks) {
    constexpr int V = VecInfo<T>::kVec;
    record<T, true>("lean", "," + std::to_string(U));
    const int nthreads = kLeanThreads;
    for (long long bid = 0; bid < blocks; ++bid) {
      const LeanBlock blk = lean_block(p, f, (unsigned)bid);
      for (int w = 0; w < nthreads; w += 32) {
        uint4 v[32][U];
        int half[32];
        bool first[32];
        float cs[32][V], sn[32][V];
        for (int l = 0; l < 32; ++l) {
          const int t = w + l;
          for (int u = 0; u < U; ++u)
            if (w + u * nthreads < blk.nv) v[l][u] = blk.src[t + u * nthreads];
          lean_angles<T, A>(p, f, blk.tok, t, half[l], first[l], cs[l], sn[l]);
        }
        for (int u = 0; u < U; ++u) {
          if (w + u * nthreads >= blk.nv) continue;
          uint4 out[32];
          for (int l = 0; l < 32; ++l) {
            float x[V], y[V], r[V];
            out[l] = lean_rotate<T>(v[l][u], v[l ^ half[l]][u], cs[l], sn[l], first[l], x, y, r);
          }
          for (int l = 0; l < 32; ++l) blk.dst[w + l + u * nthreads] = out[l];
        }
      }
    }
    return cudaSuccess;
  }

  template <typename T, bool NEOX, class A>
  cudaError_t rows(const RopeParams& p, const RowsPlan& plan, const bool fly) {
    record<T, NEOX>("rows", "");
    for (long long bid = 0; bid < plan.blocks; ++bid)
      for (int t = 0; t < kRowsThreads; ++t) rows_thread<T, NEOX, A>(p, plan.f, bid, t, fly);
    return cudaSuccess;
  }

  template <typename T, bool NEOX, class A>
  cudaError_t generic(const RopeParams& p, const GenericPlan& plan) {
    record<T, NEOX>("generic", source_suffix<A>());
    for (long long g = 0; g < plan.total; ++g) generic_item<T, NEOX, A>(p, (long long)plan.per_head, g);
    return cudaSuccess;
  }

  // rope_prologue_kernel, warp by warp, each row's loads, group sums, then stores; staged rows
  // through each lane's own ring (copies complete at once), in the kernel's order.
  template <typename T, bool NEOX, int VB, int U, class A>
  cudaError_t prologue(const RopePrologueParams& p, const ProloguePlan& plan) {
    using Lane = PrologueLane<T, NEOX, VB, U, A>;
    constexpr int ST = prologue_stages(VB == 16 && U == 1, false);
    record_prologue<T, NEOX, VB, U>("prologue");
    const PrologueShape& sh = plan.sh;
    const int groups = kPrologueThreads >> sh.g_log2;
    EmulatedRings rings(32, ST, Lane::Units::V);
    for (long long token = 0; token < plan.blocks; ++token)
      for (int y = 0; y < plan.splits; ++y)
        for (int w = 0; w < kPrologueThreads; w += 32) {
          std::vector<Lane> lanes;
          lanes.reserve(32);
          for (int l = 0; l < 32; ++l) {
            lanes.emplace_back(p, sh, token, y * groups, w + l);
            if constexpr (ST > 0)
              for (int i = 0; i < ST - 1 && i < sh.row_iters; ++i) lanes[l].stage_row(p, sh, i, rings.of(l).stage(i), 1);
            lanes[l].load_token(p, sh);
          }
          for (int i = 0; i < sh.row_iters; ++i) {
            float part[32];
            for (int l = 0; l < 32; ++l) {
              if constexpr (ST > 0) {
                const int ahead = i + ST - 1;
                if (ahead < sh.row_iters) lanes[l].stage_row(p, sh, ahead, rings.of(l).stage(ahead % ST), 1);
                part[l] = lanes[l].load_staged_row(p, sh, i, rings.of(l).stage(i % ST), 1);
              } else {
                part[l] = lanes[l].load_row(p, sh, i);
              }
            }
            emulate_group_sum(part, sh.G);
            for (int l = 0; l < 32; ++l) lanes[l].finish_loaded_row(p, sh, part[l]);
          }
        }
    return cudaSuccess;
  }

  // rope_prologue_backward_kernel: each block's lanes over its tokens, then its partial sums;
  // staged rows as in the forward, each lane's staging walk ahead of it as in the kernel.
  template <typename T, bool NEOX, int VB, int U, class A>
  cudaError_t prologue_backward(const RopePrologueParams& p, const ProloguePlan& plan) {
    using Lane = PrologueGradLane<T, NEOX, VB, U, A>;
    constexpr int ST = prologue_stages(VB == 16 && U == 1, true);
    record_prologue<T, NEOX, VB, U>("prologue_backward");
    const PrologueShape& sh = plan.sh;
    const int groups = kPrologueThreads >> sh.g_log2;
    const long long tokens = p.rope.B * p.rope.S;
    std::vector<float> scratch((size_t)groups * p.rope.D);
    EmulatedRings rings(kPrologueThreads, ST, 2 * Lane::Units::V);
    for (long long bid = 0; bid < plan.blocks; ++bid) {
      std::vector<Lane> lanes;
      std::vector<StagedWalk> walks;
      lanes.reserve(kPrologueThreads);
      for (int t = 0; t < kPrologueThreads; ++t) {
        lanes.emplace_back(sh, t);
        walks.emplace_back(p.rope, bid);
        if constexpr (ST > 0)
          for (int k = 0; k < ST - 1; ++k)
            walks[t].template stage_next<ST>(p, sh, lanes[t], rings.of(t), tokens, plan.blocks);
      }
      int stage = 0;
      for (long long token = bid; token < tokens; token += plan.blocks) {
        for (int w = 0; w < kPrologueThreads; w += 32) {
          Lane* warp = &lanes[w];
          for (int l = 0; l < 32; ++l) warp[l].load_token(p, sh, token);
          for (int i = 0; i < sh.row_iters; ++i) {
            float part[32];
            for (int l = 0; l < 32; ++l) {
              if constexpr (ST > 0) {
                walks[w + l].template stage_next<ST>(p, sh, warp[l], rings.of(w + l), tokens, plan.blocks);
                part[l] = warp[l].load_staged_row(p, sh, i, rings.of(w + l).stage((stage + i) % ST), 1);
              } else {
                part[l] = warp[l].load_row(p, sh, i);
              }
            }
            emulate_group_sum(part, sh.G);
            for (int l = 0; l < 32; ++l) part[l] = warp[l].norm_row(p, sh, part[l]);
            emulate_group_sum(part, sh.G);
            for (int l = 0; l < 32; ++l) warp[l].finish_row(p, sh, part[l]);
          }
        }
        if constexpr (ST > 0) stage = (stage + sh.row_iters) % ST;
      }
      if (p.q_weight_partials != nullptr) {
        for (int t = 0; t < kPrologueThreads; ++t) lanes[t].template put_sums<true>(p, sh, scratch.data());
        for (int t = 0; t < kPrologueThreads; ++t)
          add_group_sums(scratch.data(), groups, p.rope.D, t, p.q_weight_partials + bid * p.rope.D);
      }
      if (p.k_weight_partials != nullptr) {
        for (int t = 0; t < kPrologueThreads; ++t) lanes[t].template put_sums<false>(p, sh, scratch.data());
        for (int t = 0; t < kPrologueThreads; ++t)
          add_group_sums(scratch.data(), groups, p.rope.D, t, p.k_weight_partials + bid * p.rope.D);
      }
    }
    return cudaSuccess;
  }

  // rope_prologue_weight_grad_kernel: each column's 32 row lanes, then their sums in order.
  cudaError_t prologue_weight_grads(const RopePrologueParams& p, int64_t rows) {
    g_kernels_run.insert("prologue_weight_grad");
    const float* partials[2] = {p.q_weight_partials, p.k_weight_partials};
    float* out[2] = {p.q_weight_grad, p.k_weight_grad};
    float lanes[kWeightGradRowLanes][kWeightGradCols + 1];
    for (int w = 0; w < 2; ++w) {
      if (partials[w] == nullptr || out[w] == nullptr) continue;
      for (int64_t d0 = 0; d0 < p.rope.D; d0 += kWeightGradCols) {
        for (int r = 0; r < kWeightGradRowLanes; ++r)
          for (int c = 0; c < kWeightGradCols; ++c)
            lanes[r][c] = d0 + c < p.rope.D ? weight_grad_lane_sum(partials[w], rows, p.rope.D, d0 + c, r) : 0.f;
        for (int c = 0; c < kWeightGradCols && d0 + c < p.rope.D; ++c) out[w][d0 + c] = weight_grad_total(lanes, c);
      }
    }
    return cudaSuccess;
  }
};

inline Emulator make_executor(cudaStream_t, bool) { return Emulator{}; }

}  // namespace
}  // namespace rope_ops_cuda

#include "rope_c_api.h"
#include "prologue_c_api.h"

extern "C" int rope_kernel_arch(void) { return 90; }

// The kernel instantiations run since the last reset, one name a line, written into buf when
// they fit; returns the length of the whole list.
extern "C" int rope_emulated_kernels(char* buf, int size) {
  std::string all;
  for (const std::string& name : rope_ops_cuda::g_kernels_run) all += name + "\n";
  if ((int)all.size() < size) memcpy(buf, all.c_str(), all.size() + 1);
  return (int)all.size();
}

extern "C" void rope_emulated_reset(void) { rope_ops_cuda::g_kernels_run.clear(); }

// The rows kernel's division (FastDiv): n / d for n < 2^31.
extern "C" uint32_t rope_fast_div(uint32_t d, uint32_t n) {
  return rope_ops_cuda::fast_div(rope_ops_cuda::make_fast_div(d), n);
}
