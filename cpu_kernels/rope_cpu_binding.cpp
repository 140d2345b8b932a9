// Torch binding of the rope_ops CPU kernels (a Python module, no dispatcher op: rope_ops' own
// ops call the backend's run() when traced).
//
// Each tensor of the caller's layout becomes a [B, S, H, D] strided view (layout codes as in
// _LAYOUT_CODES of the Python backend: 0 bshd, 1 sbhd, 2 bhsd, 3 thd); the call is split over
// threads by tokens (at::parallel_for) and each thread runs the kernel of the instruction set
// chosen once per process: AVX-512 or AVX2 where CPUID and the OS's saved register state say
// the CPU has them, the portable kernel otherwise (set_isa overrides, for tests).
// rope_ops validated the call already; the checks here are cheap guards against misuse of the
// module on its own (metadata only, never data).
#include <ATen/EmptyTensor.h>
#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

#include "rope_cpu.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Instruction sets.

// In order: each needs the features of the ones before it.
enum Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };
constexpr const char* kIsaNames[] = {"generic", "avx2", "avx512", "avx512_bf16"};

// The kernels of one instruction set (rope_cpu.h).
struct IsaKernels {
  void (*tokens)(const RopeCpuParams&, int64_t, int64_t);
  void (*prologue)(const RopeCpuPrologueParams&, int64_t, int64_t, float*);
  void (*prologue_backward)(const RopeCpuPrologueParams&, const RopeCpuPrologueGrads&, int64_t,
                            int64_t, float*, float* const*);
};
#define ROPE_CPU_KERNELS_OF(isa) \
  IsaKernels { rope_cpu_tokens_##isa, rope_cpu_prologue_##isa, rope_cpu_prologue_backward_##isa }

#if ROPE_CPU_X86
// Whether the OS saves the register state of XCR0 bits `mask` (XGETBV; needs OSXSAVE).
bool os_saves(uint64_t mask) {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return ((static_cast<uint64_t>(edx) << 32 | eax) & mask) == mask;
}

int detect_isa() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return kGeneric;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12),
             f16c = c & (1u << 29);
  if (!(osxsave && avx && fma && f16c) || !os_saves(0x6)) return kGeneric;  // XMM, YMM state
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return kGeneric;
  if (!(b & (1u << 5))) return kGeneric;  // AVX2
  const bool avx512 = (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 30)) &&
                      (b & (1u << 31));  // F, DQ, BW, VL
  if (!avx512 || !os_saves(0xe6)) return kAvx2;  // + opmask, ZMM state
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return kAvx512;
  return (a & (1u << 5)) ? kAvx512Bf16 : kAvx512;  // AVX512_BF16
}
#else
int detect_isa() { return kGeneric; }
#endif

const int kBestIsa = detect_isa();
std::atomic<int> g_isa{kBestIsa};

IsaKernels kernels_for(int isa) {
#if ROPE_CPU_X86
  if (isa == kAvx512Bf16) return ROPE_CPU_KERNELS_OF(avx512bf16);
  if (isa == kAvx512) return ROPE_CPU_KERNELS_OF(avx512);
  if (isa == kAvx2) return ROPE_CPU_KERNELS_OF(avx2);
#endif
  return ROPE_CPU_KERNELS_OF(generic);
}

IsaKernels current_kernels() { return kernels_for(g_isa.load(std::memory_order_relaxed)); }

std::vector<std::string> available_isas() {
  std::vector<std::string> names;
  for (int i = 0; i <= kBestIsa; ++i) names.emplace_back(kIsaNames[i]);
  return names;
}

std::string isa() { return kIsaNames[g_isa.load()]; }

// Use instruction set `name` from now on (tests, benchmarks); returns the previous one. Refuses
// one this CPU lacks.
std::string set_isa(const std::string& name) {
  for (int i = 0; i <= kBestIsa; ++i) {
    if (name == kIsaNames[i]) return kIsaNames[g_isa.exchange(i)];
  }
  TORCH_CHECK(false, "rope_ops_cpu: instruction set '", name, "' is not available on this CPU "
              "(available: ", c10::Join(", ", available_isas()), ")");
}

// ---------------------------------------------------------------------------------------------
// Tensors to RopeCpuParams.

// (batch, seq, head, dim) axes of each layout; -1: no batch axis (thd).
constexpr int kLayoutAxes[4][4] = {{0, 1, 2, 3}, {1, 0, 2, 3}, {0, 2, 1, 3}, {-1, 0, 1, 2}};

struct View4 {
  int64_t size[4];
  int64_t stride[4];
};

View4 view_bshd(const at::Tensor& t, int64_t layout, const char* name) {
  const int* axes = kLayoutAxes[layout];
  const int64_t rank = axes[0] < 0 ? 3 : 4;
  TORCH_CHECK(t.dim() == rank, "rope_ops_cpu: ", name, " must have ", rank,
              " dims for this layout, got ", t.dim());
  View4 v{};
  for (int i = 0; i < 4; ++i) {
    if (axes[i] < 0) {
      v.size[i] = 1;
      v.stride[i] = 0;
    } else {
      v.size[i] = t.size(axes[i]);
      v.stride[i] = t.stride(axes[i]);
    }
  }
  return v;
}

int dtype_code(at::ScalarType st) {
  switch (st) {
    case at::kFloat:
      return ROPE_CPU_F32;
    case at::kHalf:
      return ROPE_CPU_F16;
    case at::kBFloat16:
      return ROPE_CPU_BF16;
    default:
      TORCH_CHECK(false, "rope_ops_cpu: dtype ", st, " not supported (float32, float16, bfloat16)");
  }
  return -1;
}

void fill_tensor(RopeCpuTensor& dst, const at::Tensor& x, const at::Tensor& out, int64_t layout,
                 const at::Tensor& q, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "rope_ops_cpu: ", name,
              " and its output must be CPU tensors");
  TORCH_CHECK(x.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "rope_ops_cpu: ", name, " and its output must have q's dtype");
  const View4 vx = view_bshd(x, layout, name);
  const View4 vo = view_bshd(out, layout, name);
  for (int i = 0; i < 4; ++i) {
    TORCH_CHECK(vx.size[i] == vo.size[i], "rope_ops_cpu: the output of ", name,
                " has a different shape from it");
    dst.in_stride[i] = vx.stride[i];
    dst.out_stride[i] = vo.stride[i];
  }
  dst.heads = vx.size[2];
  dst.in = x.data_ptr();
  dst.out = out.data_ptr();
}

// The kernels keep a block's rows computed on the fly on the stack: at most this many pairs.
constexpr int64_t kMaxHalf = 4096;

// The angle source's tensors: positions (table, mRoPE), and cos/sin tables of any float dtype
// with stride 1 along frequencies (rows may be strided: the halves of one [P, r] cache).
void fill_angles(RopeCpuParams& p, const at::Tensor* pos, int64_t pos_offset, const at::Tensor& cos,
                 const at::Tensor& sin, const at::Tensor* freq_turns, const at::Tensor* mrope_axis,
                 double attention_factor, int64_t angles) {
  TORCH_CHECK(angles >= ROPE_CPU_ANGLES_TABLE && angles <= ROPE_CPU_ANGLES_MROPE,
              "rope_ops_cpu: angles code ", angles, " not in 0..2 (table, token, mrope)");
  p.angles = static_cast<int>(angles);
  const bool mrope = angles == ROPE_CPU_ANGLES_MROPE;
  if (pos != nullptr) {
    const at::Tensor& t = *pos;
    TORCH_CHECK(angles != ROPE_CPU_ANGLES_TOKEN, "rope_ops_cpu: per-token angles take no positions");
    TORCH_CHECK(t.device().is_cpu(), "rope_ops_cpu: pos must be a CPU tensor");
    TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong,
                "rope_ops_cpu: pos must be int32 or int64");
    p.pos = t.data_ptr();
    p.pos_kind = t.scalar_type() == at::kInt ? ROPE_CPU_POS_I32 : ROPE_CPU_POS_I64;
    const int64_t lead = mrope ? 1 : 0;  // mRoPE: the leading axis of 3 positions (t, h, w)
    if (mrope) {
      TORCH_CHECK(t.dim() >= 2 && t.size(0) == 3, "rope_ops_cpu: mRoPE positions must be [3, ...]");
      p.pos_stride_axis = t.stride(0);
    }
    if (t.dim() == lead + 1) {
      TORCH_CHECK(t.size(lead) == p.seq, "rope_ops_cpu: pos has ", t.size(lead),
                  " positions a row, expected ", p.seq);
      p.pos_stride_b = 0;
      p.pos_stride_s = t.stride(lead);
    } else {
      TORCH_CHECK(t.dim() == lead + 2 && t.size(lead) == p.batch && t.size(lead + 1) == p.seq,
                  "rope_ops_cpu: pos must be [S] or [B, S] (mRoPE: [3, S] or [3, B, S])");
      p.pos_stride_b = t.stride(lead);
      p.pos_stride_s = t.stride(lead + 1);
    }
  } else {
    TORCH_CHECK(!mrope, "rope_ops_cpu: mRoPE needs positions");
    p.pos_kind = ROPE_CPU_POS_OFFSET;
    p.pos_offset = pos_offset;
  }

  TORCH_CHECK(cos.scalar_type() == sin.scalar_type() && cos.sizes() == sin.sizes() &&
                  cos.device().is_cpu() && sin.device().is_cpu(),
              "rope_ops_cpu: cos and sin must be CPU tensors of one dtype and shape");
  p.table_dtype = dtype_code(cos.scalar_type());
  const int64_t rank = angles == ROPE_CPU_ANGLES_TOKEN ? 3 : 2;
  TORCH_CHECK(cos.dim() == rank && cos.size(rank - 1) == p.half,
              "rope_ops_cpu: cos/sin must be ", rank == 3 ? "[B, S, " : "[P, ", "rotary_dim/2]");
  TORCH_CHECK(p.half == 1 || (cos.stride(rank - 1) == 1 && sin.stride(rank - 1) == 1),
              "rope_ops_cpu: cos/sin must have stride 1 along frequencies");
  if (rank == 3) {
    TORCH_CHECK((cos.size(0) == p.batch || cos.size(0) == 1) && cos.size(1) == p.seq,
                "rope_ops_cpu: per-token cos/sin must be [B, S, rotary_dim/2]");
    for (int i = 0; i < 2; ++i) {
      p.cos_stride[i] = cos.size(i) == 1 ? 0 : cos.stride(i);
      p.sin_stride[i] = sin.size(i) == 1 ? 0 : sin.stride(i);
    }
  } else {
    p.table_rows = cos.size(0);
    p.cos_stride[0] = cos.stride(0);
    p.sin_stride[0] = sin.stride(0);
  }
  p.cos = cos.data_ptr();
  p.sin = sin.data_ptr();
  if (freq_turns != nullptr) {
    const at::Tensor& f = *freq_turns;
    TORCH_CHECK(f.scalar_type() == at::kLong && f.is_contiguous() && f.numel() == p.half &&
                    f.device().is_cpu(),
                "rope_ops_cpu: freq_turns must be a contiguous int64 CPU tensor [rotary_dim/2]");
    p.freq_turns = f.data_ptr<int64_t>();
  }
  if (mrope) {
    TORCH_CHECK(mrope_axis != nullptr && mrope_axis->scalar_type() == at::kLong &&
                    mrope_axis->is_contiguous() && mrope_axis->numel() == p.half &&
                    mrope_axis->device().is_cpu(),
                "rope_ops_cpu: mRoPE needs mrope_axis, a contiguous int64 CPU tensor [rotary_dim/2]");
    const int64_t* axis = mrope_axis->data_ptr<int64_t>();
    for (int64_t i = 0; i < p.half; ++i) {
      TORCH_CHECK(axis[i] >= 0 && axis[i] < 3, "rope_ops_cpu: mrope_axis values must be 0, 1 or 2");
    }
    p.mrope_axis = axis;
  }
  p.attention_factor = attention_factor;
}

RopeCpuParams make_params(const at::Tensor& q, const at::Tensor* k, const at::Tensor& q_out,
                          const at::Tensor* k_out, const at::Tensor* pos, int64_t pos_offset,
                          const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor* freq_turns, double attention_factor, int64_t layout,
                          int64_t rotary_dim, bool interleaved, bool inverse, bool inplace,
                          int64_t angles = ROPE_CPU_ANGLES_TABLE,
                          const at::Tensor* mrope_axis = nullptr) {
  TORCH_CHECK(layout >= 0 && layout <= 3, "rope_ops_cpu: layout code ", layout,
              " not in 0..3 (bshd, sbhd, bhsd, thd)");
  RopeCpuParams p;
  p.dtype = dtype_code(q.scalar_type());
  fill_tensor(p.q, q, q_out, layout, q, "q");
  const View4 vq = view_bshd(q, layout, "q");
  p.batch = vq.size[0];
  p.seq = vq.size[1];
  p.head_dim = vq.size[3];
  if (k != nullptr) {
    TORCH_CHECK(k_out != nullptr, "rope_ops_cpu: k given without k_out");
    fill_tensor(p.k, *k, *k_out, layout, q, "k");
    const View4 vk = view_bshd(*k, layout, "k");
    TORCH_CHECK(vk.size[0] == p.batch && vk.size[1] == p.seq && vk.size[3] == p.head_dim,
                "rope_ops_cpu: k must match q in batch, seq and head_dim");
  }
  TORCH_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= p.head_dim,
              "rope_ops_cpu: rotary_dim must be even in (0, head_dim], got ", rotary_dim);
  p.half = rotary_dim / 2;
  TORCH_CHECK(p.half <= kMaxHalf, "rope_ops_cpu: rotary_dim ", rotary_dim, " above ", 2 * kMaxHalf);
  p.interleaved = interleaved;
  p.inverse = inverse;
  p.copy_passthrough = !inplace && rotary_dim < p.head_dim;
  p.contiguous_dim = p.q.in_stride[3] == 1 && p.q.out_stride[3] == 1 &&
                     (k == nullptr || (p.k.in_stride[3] == 1 && p.k.out_stride[3] == 1));
  fill_angles(p, pos, pos_offset, cos, sin, freq_turns, mrope_axis, attention_factor, angles);
  return p;
}

// ---------------------------------------------------------------------------------------------
// Running.

// Elements of q and k per parallel chunk at least: below this, waking a thread costs more than
// the work it would take.
constexpr int64_t kGrainElements = 1 << 15;
// Calls this large release the GIL while they run.
constexpr int64_t kReleaseGilElements = 1 << 15;

void run(const RopeCpuParams& p) {
  const int64_t tokens = p.batch * p.seq;
  if (tokens == 0 || p.head_dim == 0) return;
  const int64_t per_token = (p.q.heads + p.k.heads) * p.head_dim;
  if (per_token == 0) return;
  const auto kernel = current_kernels().tokens;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / per_token);
  auto body = [&]() {
    at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) { kernel(p, begin, end); });
  };
  if (tokens * per_token >= kReleaseGilElements && PyGILState_Check()) {
    pybind11::gil_scoped_release no_gil;
    body();
  } else {
    body();
  }
}

const at::Tensor* opt_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? &*t : nullptr;
}

// An uninitialised tensor with the strides at::empty_like(t) gives: t's own when t is
// non-overlapping and dense, else dense strides in t's dimension order. Straight from the CPU
// allocator (the dispatcher round trip of empty_like costs about a microsecond).
at::Tensor empty_like_cpu(const at::Tensor& t) {
  if (t.is_non_overlapping_and_dense()) {
    return at::Tensor(at::detail::empty_strided_cpu(t.sizes(), t.strides(), t.scalar_type()));
  }
  return at::Tensor(at::detail::empty_strided_cpu(
      t.sizes(), at::infer_dense_strides(t.sizes(), t.strides()), t.scalar_type()));
}

// The module's entry: writes into q_out / k_out and returns None; or, out of place with q_out
// None, allocates the outputs (like empty_like) and returns (q_out, k_out).
py::object rope(const at::Tensor& q, const std::optional<at::Tensor>& k,
                const std::optional<at::Tensor>& q_out, const std::optional<at::Tensor>& k_out,
                const std::optional<at::Tensor>& pos, int64_t pos_offset, const at::Tensor& cos,
                const at::Tensor& sin, const std::optional<at::Tensor>& freq_turns,
                double attention_factor, int64_t layout, int64_t rotary_dim, bool interleaved,
                bool inverse, bool inplace, int64_t angles = ROPE_CPU_ANGLES_TABLE,
                const std::optional<at::Tensor>& mrope_axis = std::nullopt) {
  const at::Tensor* kp = opt_ptr(k);
  if (q_out.has_value() && q_out->defined()) {
    run(make_params(q, kp, *q_out, opt_ptr(k_out), opt_ptr(pos), pos_offset, cos, sin,
                    opt_ptr(freq_turns), attention_factor, layout, rotary_dim, interleaved,
                    inverse, inplace, angles, opt_ptr(mrope_axis)));
    return py::none();
  }
  TORCH_CHECK(!inplace, "rope_ops_cpu: in place needs q_out (q itself)");
  TORCH_CHECK(q.device().is_cpu(), "rope_ops_cpu: q must be a CPU tensor");
  at::Tensor qo = empty_like_cpu(q);
  at::Tensor ko;
  if (kp != nullptr) ko = empty_like_cpu(*kp);
  run(make_params(q, kp, qo, kp != nullptr ? &ko : nullptr, opt_ptr(pos), pos_offset, cos, sin,
                  opt_ptr(freq_turns), attention_factor, layout, rotary_dim, interleaved, inverse,
                  false, angles, opt_ptr(mrope_axis)));
  if (kp == nullptr) return py::make_tuple(qo, py::none());
  return py::make_tuple(qo, ko);
}

// rope() for repeated out-of-place calls of one kind (rope_ops.apply's cached plans): tables and
// constants bound once, a call converts 4 arguments instead of 15.
struct BoundRope {
  at::Tensor cos, sin;
  std::optional<at::Tensor> freq_turns;
  double attention_factor;
  int64_t layout, rotary_dim;
  bool interleaved, inverse;

  py::object operator()(const at::Tensor& q, const std::optional<at::Tensor>& k,
                        const std::optional<at::Tensor>& pos, int64_t pos_offset) const {
    return rope(q, k, std::nullopt, std::nullopt, pos, pos_offset, cos, sin, freq_turns,
                attention_factor, layout, rotary_dim, interleaved, inverse, false);
  }
};

// The metadata of one tensor that rope_ops.apply's plan key reads.
struct TensorMeta {
  int64_t dim = 0;
  std::array<int64_t, 4> sizes{}, strides{};
  at::ScalarType dtype = at::kFloat;
  c10::Device device{c10::kCPU};
  bool with_strides = true;

  TensorMeta() = default;
  TensorMeta(const at::Tensor& t, bool with_strides_)
      : dim(t.dim()), dtype(t.scalar_type()), device(t.device()), with_strides(with_strides_) {
    TORCH_CHECK(dim <= 4, "rope_ops_cpu: GuardedRope takes tensors of at most 4 dims");
    for (int64_t i = 0; i < dim; ++i) {
      sizes[i] = t.size(i);
      strides[i] = t.stride(i);
    }
  }

  bool matches(const at::Tensor& t) const {
    if (t.dim() != dim || t.scalar_type() != dtype || t.device() != device) return false;
    for (int64_t i = 0; i < dim; ++i) {
      if (t.size(i) != sizes[i] || (with_strides && t.stride(i) != strides[i])) return false;
    }
    return true;
  }
};

// A plain torch.Tensor (not a subclass, which never takes apply's fast path), or null.
const at::Tensor* exact_tensor(py::handle obj) {
  return Py_TYPE(obj.ptr()) == reinterpret_cast<PyTypeObject*>(THPVariableClass)
             ? &THPVariable_Unpack(obj.ptr())
             : nullptr;
}

// A BoundRope that runs only calls whose (q, k, pos) have the metadata of the call it was made
// from (exact tensor types; q's and k's sizes, strides, dtype and device; pos's sizes, dtype and
// device, or an int offset) that need no gradient, and returns None for any other: what
// rope_ops.apply's plan key checks, without building the key.
struct GuardedRope {
  BoundRope bound;
  TensorMeta q_meta, k_meta, pos_meta;
  bool has_k, pos_is_int;

  GuardedRope(BoundRope b, py::handle q, py::handle k, py::handle pos) : bound(std::move(b)) {
    const at::Tensor* qt = exact_tensor(q);
    const at::Tensor* kt = k.is_none() ? nullptr : exact_tensor(k);
    TORCH_CHECK(qt != nullptr && (k.is_none() || kt != nullptr),
                "rope_ops_cpu: GuardedRope needs plain tensors q and k");
    q_meta = TensorMeta(*qt, true);
    has_k = kt != nullptr;
    if (has_k) k_meta = TensorMeta(*kt, true);
    pos_is_int = PyLong_CheckExact(pos.ptr());
    if (!pos_is_int) {
      const at::Tensor* pt = exact_tensor(pos);
      TORCH_CHECK(pt != nullptr, "rope_ops_cpu: GuardedRope needs pos as a tensor or an int");
      pos_meta = TensorMeta(*pt, false);
    }
  }

  py::object operator()(py::handle q, py::handle k, py::handle pos) const {
    const at::Tensor* qt = exact_tensor(q);
    if (qt == nullptr || !q_meta.matches(*qt)) return py::none();
    const at::Tensor* kt = nullptr;
    if (has_k) {
      kt = exact_tensor(k);
      if (kt == nullptr || !k_meta.matches(*kt)) return py::none();
    } else if (!k.is_none()) {
      return py::none();
    }
    if (at::GradMode::is_enabled() && (qt->requires_grad() || (kt && kt->requires_grad()))) {
      return py::none();
    }
    const std::optional<at::Tensor> k_opt = kt ? std::optional<at::Tensor>(*kt) : std::nullopt;
    if (pos_is_int) {
      if (!PyLong_CheckExact(pos.ptr())) return py::none();  // bool is not an exact int
      int overflow = 0;
      const long long offset = PyLong_AsLongLongAndOverflow(pos.ptr(), &overflow);
      // apply's own range (|offset| < 2^62), so that offset + token never overflows
      if (overflow != 0 || offset <= -(1LL << 62) || offset >= (1LL << 62)) return py::none();
      return bound(*qt, k_opt, std::nullopt, offset);
    }
    const at::Tensor* pt = exact_tensor(pos);
    if (pt == nullptr || !pos_meta.matches(*pt)) return py::none();
    return bound(*qt, k_opt, *pt, 0);
  }
};

// ---------------------------------------------------------------------------------------------
// The fused prologue: rope_ops.backend.PrologueArgs, read field by field.

template <class T>
T field(py::handle args, const char* name) {
  return args.attr(name).cast<T>();
}

std::optional<at::Tensor> optional_field(py::handle args, const char* name) {
  py::object value = args.attr(name);
  if (value.is_none()) return std::nullopt;
  return value.cast<at::Tensor>();
}

int64_t angles_code(const std::string& angles) {
  if (angles == "table") return ROPE_CPU_ANGLES_TABLE;
  if (angles == "token") return ROPE_CPU_ANGLES_TOKEN;
  if (angles == "mrope") return ROPE_CPU_ANGLES_MROPE;
  TORCH_CHECK(false, "rope_ops_cpu: angles '", angles, "' not in table, token, mrope");
  return -1;
}

bool stride1_last(const at::Tensor& t) { return t.size(-1) <= 1 || t.stride(-1) == 1; }

// (batch, token) strides of a tensor whose leading dims are [T] (thd) or [B, S].
void token_strides(const at::Tensor& t, bool thd, int64_t* out) {
  out[0] = thd ? 0 : t.stride(0);
  out[1] = thd ? t.stride(0) : t.stride(1);
}

// A [T, H, D] / [B, S, H, D] tensor of the call (an output or a gradient): its (batch, token,
// head) strides, after checking its metadata. `fp8`: float8 e4m3fn (q with q_scale), else
// qkv's dtype.
void heads_view(const at::Tensor& t, const at::Tensor& qkv, bool thd, int64_t heads, int64_t d,
                const char* name, int64_t* strides, bool fp8 = false) {
  const at::ScalarType dtype = fp8 ? at::ScalarType::Float8_e4m3fn : qkv.scalar_type();
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, "rope_ops_cpu: ", name,
              fp8 ? " must be a float8_e4m3fn CPU tensor (q_scale)"
                  : " must be a CPU tensor of qkv's dtype");
  std::vector<int64_t> expected(qkv.sizes().begin(), qkv.sizes().end() - 1);
  expected.push_back(heads);
  expected.push_back(d);
  TORCH_CHECK(t.sizes() == at::IntArrayRef(expected), "rope_ops_cpu: ", name, " must have shape ",
              at::IntArrayRef(expected), ", got ", t.sizes());
  TORCH_CHECK(stride1_last(t), "rope_ops_cpu: ", name, " needs stride 1 along head_dim");
  token_strides(t, thd, strides);
  strides[2] = t.stride(thd ? 1 : 2);
}

// A prologue call's parameters and the tensors they point into (kept alive for the call).
struct PrologueCall {
  RopeCpuPrologueParams p;
  at::Tensor qkv;
  at::Tensor weights[2];  // offset + weight, float32
  bool thd = false;
  int64_t tokens = 0, width = 0;
};

// What forward and backward share: qkv, the split, the norm weights, the angles.
PrologueCall read_prologue(py::handle args, const std::optional<at::Tensor>& mrope_axis) {
  PrologueCall call;
  RopeCpuPrologueParams& p = call.p;
  const at::Tensor qkv = field<at::Tensor>(args, "qkv");
  const std::string layout = field<std::string>(args, "layout");
  TORCH_CHECK(layout == "thd" || layout == "bshd", "rope_ops_cpu: the prologue's layout is thd or "
              "bshd, got ", layout);
  const bool thd = layout == "thd";
  TORCH_CHECK(qkv.device().is_cpu(), "rope_ops_cpu: qkv must be a CPU tensor");
  TORCH_CHECK(qkv.dim() == (thd ? 2 : 3), "rope_ops_cpu: qkv must be ", thd ? "[T, W]" : "[B, S, W]");
  p.rope.dtype = dtype_code(qkv.scalar_type());
  const int64_t hq = field<int64_t>(args, "num_q_heads"), hk = field<int64_t>(args, "num_kv_heads");
  const int64_t d = field<int64_t>(args, "head_dim");
  TORCH_CHECK(hq >= 1 && hk >= 1 && d >= 1 && qkv.size(-1) == (hq + 2 * hk) * d,
              "rope_ops_cpu: qkv's last dim must be (num_q_heads + 2 * num_kv_heads) * head_dim");
  TORCH_CHECK(stride1_last(qkv), "rope_ops_cpu: qkv needs stride 1 along its last dim");
  p.q_heads = hq;
  p.kv_heads = hk;
  p.rope.batch = thd ? 1 : qkv.size(0);
  p.rope.seq = qkv.size(thd ? 0 : 1);
  p.rope.head_dim = d;
  p.qkv = qkv.data_ptr();
  token_strides(qkv, thd, p.qkv_stride);

  if (field<bool>(args, "rotate")) {
    const int64_t rotary_dim = field<int64_t>(args, "rotary_dim");
    TORCH_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= d && rotary_dim / 2 <= kMaxHalf,
                "rope_ops_cpu: rotary_dim must be even in (0, min(head_dim, ", 2 * kMaxHalf, ")], got ",
                rotary_dim);
    p.rope.half = rotary_dim / 2;
    p.rope.interleaved = field<bool>(args, "interleaved");
    const std::optional<at::Tensor> pos = optional_field(args, "pos");
    const std::optional<at::Tensor> freq_turns = optional_field(args, "freq_turns");
    fill_angles(p.rope, opt_ptr(pos), field<int64_t>(args, "pos_offset"),
                field<at::Tensor>(args, "cos"), field<at::Tensor>(args, "sin"), opt_ptr(freq_turns),
                opt_ptr(mrope_axis), field<double>(args, "attention_factor"),
                angles_code(field<std::string>(args, "angles")));
  }

  const float offset = static_cast<float>(field<double>(args, "weight_offset"));
  const char* weight_names[2] = {"q_weight", "k_weight"};
  for (int i = 0; i < 2; ++i) {
    const std::optional<at::Tensor> w = optional_field(args, weight_names[i]);
    if (!w.has_value()) continue;
    TORCH_CHECK(w->device().is_cpu() && w->is_floating_point() && w->dim() == 1 && w->size(0) == d,
                "rope_ops_cpu: ", weight_names[i], " must be a floating-point CPU tensor [head_dim]");
    // offset + weight in float32, as torch computes it (the weight rounded to float32 first)
    at::Tensor combined = w->detach().to(at::kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous();
    float* values = combined.data_ptr<float>();
    for (int64_t j = 0; j < d; ++j) values[j] = offset + values[j];
    call.weights[i] = combined;
    p.weight[i] = values;
  }
  p.eps = static_cast<float>(field<double>(args, "eps"));
  call.qkv = qkv;
  call.thd = thd;
  call.tokens = p.rope.batch * p.rope.seq;
  call.width = qkv.size(-1);
  return call;
}

// Runs body(begin, end, work) over [0, n) in chunks of at least `grain`, each thread with its own
// scratch; without the GIL for calls of `elements` or more.
template <class Body>
void parallel_with_work(int64_t n, int64_t grain, int64_t head_dim, int64_t elements, Body body) {
  const size_t work_bytes =
      static_cast<size_t>(ROPE_CPU_PROLOGUE_WORK_ROWS * ((head_dim + 15) / 16 * 16)) * sizeof(float);
  auto run_all = [&]() {
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      std::unique_ptr<float, void (*)(void*)> work(
          static_cast<float*>(std::aligned_alloc(64, work_bytes)), std::free);
      TORCH_CHECK(work != nullptr, "rope_ops_cpu: out of memory for ", work_bytes, " bytes of scratch");
      body(begin, end, work.get());
    });
  };
  if (elements >= kReleaseGilElements && PyGILState_Check()) {
    pybind11::gil_scoped_release no_gil;
    run_all();
  } else {
    run_all();
  }
}

// The forward: writes args.q_out/k_out/v_out (or the q and k heads of qkv in place) and the cache.
void prologue(py::handle args, const std::optional<at::Tensor>& mrope_axis) {
  PrologueCall call = read_prologue(args, mrope_axis);
  RopeCpuPrologueParams& p = call.p;
  const at::Tensor& qkv = call.qkv;
  const int64_t hk = p.kv_heads, d = p.rope.head_dim;
  p.inplace = field<bool>(args, "inplace");
  // q_scale > 0: q out as float8 (the kernels divide by it in float32, as torch does)
  const double q_scale = field<double>(args, "q_scale");
  p.q_scale = static_cast<float>(q_scale);
  TORCH_CHECK(q_scale == 0.0 || (p.q_scale > 0.0f && std::isfinite(p.q_scale) && !p.inplace),
              "rope_ops_cpu: q_scale must be 0, or a finite float32 value > 0 out of place; got ",
              q_scale, p.inplace ? " in place" : "");
  std::optional<at::Tensor> outs[3];
  if (p.inplace) {
    p.qkv_out = qkv.data_ptr();
  } else {
    const char* names[3] = {"q_out", "k_out", "v_out"};
    const int64_t heads[3] = {p.q_heads, hk, hk};
    for (int i = 0; i < 3; ++i) {
      outs[i] = optional_field(args, names[i]);
      TORCH_CHECK(outs[i].has_value(), "rope_ops_cpu: out of place needs ", names[i]);
      heads_view(*outs[i], qkv, call.thd, heads[i], d, names[i], p.out_stride[i],
                 i == 0 && p.q_scale > 0.0f);
      p.out[i] = outs[i]->data_ptr();
    }
  }
  const std::optional<at::Tensor> k_cache = optional_field(args, "k_cache");
  std::optional<at::Tensor> v_cache, slots;
  if (k_cache.has_value()) {
    v_cache = optional_field(args, "v_cache");
    slots = optional_field(args, "slots");
    TORCH_CHECK(v_cache.has_value() && slots.has_value(), "rope_ops_cpu: k_cache needs v_cache and slots");
    const at::Tensor* caches[2] = {&*k_cache, &*v_cache};
    const bool fp8 = k_cache->scalar_type() == at::ScalarType::Float8_e4m3fn;
    for (int i = 0; i < 2; ++i) {
      const at::Tensor& c = *caches[i];
      TORCH_CHECK(c.device().is_cpu() && c.scalar_type() == k_cache->scalar_type() &&
                      (fp8 || c.scalar_type() == qkv.scalar_type()),
                  "rope_ops_cpu: the caches must be CPU tensors of qkv's dtype or both float8_e4m3fn");
      TORCH_CHECK(c.dim() == 3 && c.size(0) == k_cache->size(0) && c.size(1) == hk && c.size(2) == d &&
                      stride1_last(c),
                  "rope_ops_cpu: the caches must be [num_slots, num_kv_heads, head_dim] with stride 1 "
                  "along head_dim");
      p.cache[i] = c.data_ptr();
      p.cache_stride[i][0] = c.stride(0);
      p.cache_stride[i][1] = c.stride(1);
    }
    p.cache_dtype = fp8 ? ROPE_CPU_F8E4M3 : p.rope.dtype;
    p.num_slots = k_cache->size(0);
    const at::Tensor& sl = *slots;
    TORCH_CHECK(sl.device().is_cpu() && (sl.scalar_type() == at::kInt || sl.scalar_type() == at::kLong) &&
                    sl.sizes() == qkv.sizes().slice(0, qkv.dim() - 1),
                "rope_ops_cpu: slots must be an int32/int64 CPU tensor with one slot per token");
    p.slots = sl.data_ptr();
    p.slots_int64 = sl.scalar_type() == at::kLong;
    token_strides(sl, call.thd, p.slots_stride);
    p.cache_scale[0] = static_cast<float>(field<double>(args, "k_scale"));
    p.cache_scale[1] = static_cast<float>(field<double>(args, "v_scale"));
  }
  if (call.tokens == 0) return;
  const auto kernel = current_kernels().prologue;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / call.width);
  parallel_with_work(call.tokens, grain, d, call.tokens * call.width,
                     [&](int64_t begin, int64_t end, float* work) { kernel(p, begin, end, work); });
}

// The backward: (grad_qkv, grad of q_weight, grad of k_weight), the weight gradients float32
// [D] (None without that weight). Tokens go in chunks of a size set by the shape alone, each
// chunk summing its weight-gradient terms into its own row, and the rows are added in order (in
// float64): the result does not depend on the thread count.
py::tuple prologue_backward(py::handle args, const std::optional<at::Tensor>& grad_q,
                            const std::optional<at::Tensor>& grad_k,
                            const std::optional<at::Tensor>& grad_v,
                            const std::optional<at::Tensor>& mrope_axis) {
  PrologueCall call = read_prologue(args, mrope_axis);
  const RopeCpuPrologueParams& p = call.p;
  const int64_t d = p.rope.head_dim;
  RopeCpuPrologueGrads g;
  at::Tensor grad_qkv = at::Tensor(at::detail::empty_cpu(call.qkv.sizes(), call.qkv.scalar_type()));
  g.grad_qkv = grad_qkv.data_ptr();
  token_strides(grad_qkv, call.thd, g.grad_qkv_stride);
  const std::optional<at::Tensor>* grads[3] = {&grad_q, &grad_k, &grad_v};
  const char* names[3] = {"grad_q", "grad_k", "grad_v"};
  const int64_t heads[3] = {p.q_heads, p.kv_heads, p.kv_heads};
  for (int i = 0; i < 3; ++i) {
    const at::Tensor* t = opt_ptr(*grads[i]);
    if (t == nullptr) continue;
    heads_view(*t, call.qkv, call.thd, heads[i], d, names[i], g.grad_stride[i]);
    g.grad[i] = t->data_ptr();
  }
  const int64_t tokens = call.tokens;
  const int64_t chunk = std::max<int64_t>(1, kGrainElements / call.width);
  const int64_t chunks = tokens == 0 ? 0 : (tokens + chunk - 1) / chunk;
  at::Tensor partials[2];
  float* partial_rows[2] = {nullptr, nullptr};
  for (int i = 0; i < 2; ++i) {
    if (p.weight[i] == nullptr) continue;
    partials[i] = at::zeros({std::max<int64_t>(chunks, 1), d}, at::kFloat);
    partial_rows[i] = partials[i].data_ptr<float>();
  }
  const auto kernel = current_kernels().prologue_backward;
  parallel_with_work(chunks, 1, d, tokens * call.width, [&](int64_t first, int64_t last, float* work) {
    for (int64_t c = first; c < last; ++c) {
      float* rows[2] = {partial_rows[0] ? partial_rows[0] + c * d : nullptr,
                        partial_rows[1] ? partial_rows[1] + c * d : nullptr};
      kernel(p, g, c * chunk, std::min(tokens, (c + 1) * chunk), work, rows);
    }
  });
  py::object weight_grads[2] = {py::none(), py::none()};
  for (int i = 0; i < 2; ++i) {
    if (partial_rows[i] == nullptr) continue;
    at::Tensor total = at::empty({d}, at::kFloat);
    float* out = total.data_ptr<float>();
    for (int64_t j = 0; j < d; ++j) {
      double sum = 0.0;
      for (int64_t c = 0; c < chunks; ++c) sum += partial_rows[i][c * d + j];
      out[j] = static_cast<float>(sum);
    }
    weight_grads[i] = py::cast(total);
  }
  return py::make_tuple(grad_qkv, weight_grads[0], weight_grads[1]);
}

}  // namespace

#ifndef TORCH_EXTENSION_NAME  // defined by torch.utils.cpp_extension
#define TORCH_EXTENSION_NAME rope_ops_cpu_ext
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope", &rope,
        "rope(q, k, q_out, k_out, pos, pos_offset, cos, sin, freq_turns, attention_factor, "
        "layout, rotary_dim, interleaved, inverse, inplace, angles=0, mrope_axis=None) -> "
        "None | (q_out, k_out); angles: 0 table, 1 per token, 2 mRoPE (mrope_axis: each "
        "frequency's position axis)");
  m.def("isa", &isa, "the instruction set the kernels run with now");
  m.def("set_isa", &set_isa, "set_isa(name) -> previous name: run the kernels with instruction "
        "set name (one of available_isas())");
  m.def("available_isas", &available_isas, "instruction sets this CPU can run, best last");
  m.def("prologue", &prologue, py::arg("args"), py::arg("mrope_axis") = std::nullopt,
        "prologue(args: PrologueArgs, mrope_axis=None) -> None: the fused prologue's forward, "
        "writing args.q_out/k_out/v_out (or qkv in place) and the KV cache");
  m.def("prologue_backward", &prologue_backward, py::arg("args"), py::arg("grad_q"),
        py::arg("grad_k"), py::arg("grad_v"), py::arg("mrope_axis") = std::nullopt,
        "prologue_backward(args, grad_q, grad_k, grad_v, mrope_axis=None) -> (grad_qkv, "
        "grad_q_weight, grad_k_weight): weight gradients float32 [D] or None");
  py::class_<BoundRope>(m, "BoundRope")
      .def(py::init([](at::Tensor cos, at::Tensor sin, std::optional<at::Tensor> freq_turns,
                       double attention_factor, int64_t layout, int64_t rotary_dim,
                       bool interleaved, bool inverse) {
             return BoundRope{std::move(cos), std::move(sin), std::move(freq_turns),
                              attention_factor, layout, rotary_dim, interleaved, inverse};
           }),
           "BoundRope(cos, sin, freq_turns, attention_factor, layout, rotary_dim, interleaved, "
           "inverse)")
      .def("__call__", &BoundRope::operator(),
           "(q, k, pos, pos_offset) -> (q_out, k_out): rope(...) out of place")
      .def(
          "guarded",
          [](const BoundRope& b, py::handle q, py::handle k, py::handle pos) {
            return GuardedRope(b, q, k, pos);
          },
          "guarded(q, k, pos) -> GuardedRope: this launcher for calls with the metadata of "
          "(q, k, pos) only");
  py::class_<GuardedRope>(m, "GuardedRope")
      .def("__call__", &GuardedRope::operator(),
           "(q, k, pos) -> (q_out, k_out), or None when the call's metadata differ from the "
           "guarded call's or it needs a gradient");
}
