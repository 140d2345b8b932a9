// Torch binding of the rope_ops CUDA kernels: the ops rope_ops_cuda::rope and
// rope_ops_cuda::set_tuning. Compiled only where a CUDA build of torch exists (by
// rope_ops_backends.cuda_backend through torch.utils.cpp_extension.load).
//
// The binding turns each tensor of the caller's layout into a canonical [B, S, H, D] view
// (sizes and element strides; layout codes as in _LAYOUT_CODES of the Python backend:
// 0 bshd, 1 sbhd, 2 bhsd, 3 thd), fills a RopeParams and launches on the current stream.
// rope_ops validated the call already; the checks here are cheap guards against misuse of the op
// on its own (they never look at data and never synchronize).
#include <ATen/ExpandUtils.h>
#include <ATen/core/grad_mode.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <cuda_runtime_api.h>

#include <array>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "rope_kernels.h"

namespace {

// (batch, seq, head, dim) axes of each layout; -1: no batch axis (thd).
constexpr int kLayoutDims[4][4] = {
    {0, 1, 2, 3},   // bshd
    {1, 0, 2, 3},   // sbhd
    {0, 2, 1, 3},   // bhsd
    {-1, 0, 1, 2},  // thd
};

struct Canon {
  int64_t B, S, H, D;
  int64_t stride[4];
};

Canon canon(const at::Tensor& t, int64_t layout, const char* name) {
  const int* dims = kLayoutDims[layout];
  const int64_t rank = dims[0] < 0 ? 3 : 4;
  TORCH_CHECK(t.dim() == rank, "rope_ops_cuda::rope: ", name, " must have ", rank,
              " dims for this layout, got ", t.dim());
  Canon c;
  if (dims[0] < 0) {
    c.B = 1;
    c.stride[0] = 0;
  } else {
    c.B = t.size(dims[0]);
    c.stride[0] = t.stride(dims[0]);
  }
  c.S = t.size(dims[1]);
  c.stride[1] = t.stride(dims[1]);
  c.H = t.size(dims[2]);
  c.stride[2] = t.stride(dims[2]);
  c.D = t.size(dims[3]);
  c.stride[3] = t.stride(dims[3]);
  return c;
}

int dtype_code(at::ScalarType st) {
  switch (st) {
    case at::kFloat:
      return ROPE_F32;
    case at::kHalf:
      return ROPE_F16;
    case at::kBFloat16:
      return ROPE_BF16;
    default:
      TORCH_CHECK(false, "rope_ops_cuda::rope: dtype ", st,
                  " not supported (float32, float16, bfloat16)");
  }
  return -1;
}

void check_same(const at::Tensor& a, const at::Tensor& b, const Canon& ca, const Canon& cb,
                const char* name) {
  TORCH_CHECK(b.device() == a.device() && b.scalar_type() == a.scalar_type(),
              "rope_ops_cuda::rope: ", name, " must have q's dtype and device");
  TORCH_CHECK(ca.B == cb.B && ca.S == cb.S && ca.H == cb.H && ca.D == cb.D,
              "rope_ops_cuda::rope: ", name, " has a different shape from its input");
}

// Multiprocessor count and compute capability of a device, read once per device.
RopeDevice device_info(int device) {
  static std::array<RopeDevice, 64> cache{};  // num_sms 0: not yet known
  RopeDevice info = device >= 0 && device < 64 ? cache[device] : RopeDevice{0, 0};
  if (info.num_sms == 0) {
    TORCH_CHECK(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, device) ==
                        cudaSuccess &&
                    cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor,
                                           device) == cudaSuccess,
                "rope_ops_cuda::rope: cannot read the properties of device ", device);
    if (device >= 0 && device < 64) cache[device] = info;
  }
  return info;
}

// Fills the tensor part of RopeParams (dtype, pointers, canonical [B, S, H, D] sizes and
// strides of q, q_out and, when given, k and k_out), checking that they agree.
void fill_tensors(RopeParams& p, const at::Tensor& q, const at::Tensor* k, const at::Tensor& q_out,
                  const at::Tensor* k_out, int64_t layout) {
  p.dtype = dtype_code(q.scalar_type());
  const Canon cq = canon(q, layout, "q");
  const Canon cqo = canon(q_out, layout, "q_out");
  check_same(q, q_out, cq, cqo, "q_out");
  p.q = q.data_ptr();
  p.q_out = q_out.data_ptr();
  for (int i = 0; i < 4; ++i) {
    p.q_stride[i] = cq.stride[i];
    p.q_out_stride[i] = cqo.stride[i];
  }
  p.B = cq.B;
  p.S = cq.S;
  p.Hq = cq.H;
  p.D = cq.D;

  const bool has_k = k != nullptr && k->defined();
  if (has_k) {
    TORCH_CHECK(k_out != nullptr && k_out->defined(), "rope_ops_cuda::rope: k given without k_out");
    const Canon ck = canon(*k, layout, "k");
    const Canon cko = canon(*k_out, layout, "k_out");
    check_same(*k, *k_out, ck, cko, "k_out");
    TORCH_CHECK(k->device() == q.device() && k->scalar_type() == q.scalar_type(),
                "rope_ops_cuda::rope: k must have q's dtype and device");
    TORCH_CHECK(ck.B == cq.B && ck.S == cq.S && ck.D == cq.D,
                "rope_ops_cuda::rope: k must match q in batch, seq and head_dim");
    p.k = k->data_ptr();
    p.k_out = k_out->data_ptr();
    for (int i = 0; i < 4; ++i) {
      p.k_stride[i] = ck.stride[i];
      p.k_out_stride[i] = cko.stride[i];
    }
    p.Hk = ck.H;
  }
}

// Fills RopeParams from the tensors and launches on the current stream of q's device.
// k and k_out may be undefined tensors (no k).
void rope_core(const at::Tensor& q, const at::Tensor* k, const at::Tensor& q_out,
               const at::Tensor* k_out, const at::Tensor* pos, int64_t pos_offset,
               const at::Tensor& cos, const at::Tensor& sin, const at::Tensor* freq_turns,
               double attention_factor, int64_t layout, int64_t rotary_dim, bool interleaved,
               bool inverse, bool inplace) {
  TORCH_CHECK(layout >= 0 && layout <= 3, "rope_ops_cuda::rope: layout code ", layout,
              " not in 0..3 (bshd, sbhd, bhsd, thd)");
  TORCH_CHECK(q.is_cuda(), "rope_ops_cuda::rope: q must be a CUDA tensor");
  const int device = q.get_device();
  // No device switch when q is on the current device (the usual case): the guard is only built
  // when needed.
  std::optional<c10::cuda::CUDAGuard> guard;
  if (device != c10::cuda::current_device()) guard.emplace(q.device());

  RopeParams p{};
  fill_tensors(p, q, k, q_out, k_out, layout);

  TORCH_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= p.D,
              "rope_ops_cuda::rope: rotary_dim must be even in (0, head_dim], got ", rotary_dim);
  p.R = rotary_dim;
  p.interleaved = interleaved ? 1 : 0;
  p.inverse = inverse ? 1 : 0;
  p.copy_passthrough = inplace ? 0 : 1;

  if (pos != nullptr && pos->defined()) {
    const at::Tensor& t = *pos;
    TORCH_CHECK(t.device() == q.device(), "rope_ops_cuda::rope: pos must be on q's device");
    TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong,
                "rope_ops_cuda::rope: pos must be int32 or int64");
    p.pos = t.data_ptr();
    p.pos_kind = t.scalar_type() == at::kInt ? ROPE_POS_I32 : ROPE_POS_I64;
    if (t.dim() == 1) {
      TORCH_CHECK(t.size(0) == p.S || p.S == 0, "rope_ops_cuda::rope: pos has ", t.size(0),
                  " entries, expected ", p.S);
      p.pos_stride_b = 0;
      p.pos_stride_s = t.stride(0);
    } else {
      TORCH_CHECK(t.dim() == 2 && t.size(0) == p.B && t.size(1) == p.S,
                  "rope_ops_cuda::rope: pos must be [S] or [B, S]");
      p.pos_stride_b = t.stride(0);
      p.pos_stride_s = t.stride(1);
    }
  } else {
    p.pos_kind = ROPE_POS_OFFSET;
    p.pos_offset = pos_offset;
  }

  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  sin.sizes() == cos.sizes() && cos.size(1) == rotary_dim / 2 &&
                  cos.device() == q.device() && sin.device() == q.device(),
              "rope_ops_cuda::rope: cos/sin must be contiguous float32 [P, rotary_dim/2] on q's "
              "device");
  p.cos_table = cos.data_ptr<float>();
  p.sin_table = sin.data_ptr<float>();
  p.table_rows = cos.size(0);
  if (freq_turns != nullptr && freq_turns->defined()) {
    const at::Tensor& f = *freq_turns;
    TORCH_CHECK(f.scalar_type() == at::kLong && f.is_contiguous() && f.numel() == rotary_dim / 2 &&
                    f.device() == q.device(),
                "rope_ops_cuda::rope: freq_turns must be contiguous int64 [rotary_dim/2] on q's "
                "device");
    p.freq_turns = f.data_ptr<int64_t>();
  }
  p.attention_factor = static_cast<float>(attention_factor);

  const RopeDevice info = device_info(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const cudaError_t err = rope_launch(&p, &info, stream);
  TORCH_CHECK(err == cudaSuccess, "rope_ops_cuda::rope: kernel launch failed: ",
              cudaGetErrorString(err));
}

const at::Tensor* opt_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? &*t : nullptr;
}

// The dispatcher op (torch.compile, torch.ops users): writes into q_out / k_out.
void rope_cuda(const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& q_out,
               const std::optional<at::Tensor>& k_out, const std::optional<at::Tensor>& pos,
               int64_t pos_offset, const at::Tensor& cos, const at::Tensor& sin,
               const std::optional<at::Tensor>& freq_turns, double attention_factor,
               int64_t layout, int64_t rotary_dim, bool interleaved, bool inverse, bool inplace) {
  rope_core(q, opt_ptr(k), q_out, opt_ptr(k_out), opt_ptr(pos), pos_offset, cos, sin,
            opt_ptr(freq_turns), attention_factor, layout, rotary_dim, interleaved, inverse,
            inplace);
}

// The strides at::empty_like(t) gives t: t's own when t is non-overlapping and dense, else dense
// strides in t's dimension order.
std::vector<int64_t> like_strides(const at::Tensor& t) {
  if (t.is_non_overlapping_and_dense()) return t.strides().vec();
  return at::infer_dense_strides(t.sizes(), t.strides());
}

// An uninitialised tensor like t (like_strides), straight from the CUDA caching allocator: the
// dispatcher round trip of empty_like costs ~2-3 us per output on slow host CPUs.
at::Tensor empty_like_cuda(const at::Tensor& t) {
  return at::detail::empty_strided_cuda(t.sizes(), like_strides(t), t.scalar_type(), t.device());
}

// Outputs of calls up to this many bytes (q_out + k_out) share one allocation: a decode step's
// host time is dominated by its two trips through the caching allocator (~2.3 us each on the
// slowest hosts measured). Larger calls are GPU-bound and keep separate allocations.
constexpr int64_t kPairedOutputBytes = 8 << 20;

// (q_out, k_out) like empty_like_cuda(q), empty_like_cuda(k), as two tensors over one storage
// (k_out's data 256-byte aligned after q_out's), made without the dispatcher.
std::pair<at::Tensor, at::Tensor> empty_pair_cuda(const at::Tensor& q, const at::Tensor& k) {
  const int64_t elem = q.element_size();
  const int64_t q_elems = (q.numel() * elem + 255) / 256 * 256 / elem;  // k_out's storage offset
  const at::Tensor buf = at::detail::empty_cuda({(q_elems + k.numel()) * elem}, at::kByte,
                                                q.device(), std::nullopt);
  auto view = [&](const at::Tensor& like, int64_t offset) {
    at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(buf.storage()), c10::DispatchKeySet(c10::DispatchKey::CUDA), q.dtype());
    t.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like_strides(like), offset);
    return t;
  };
  return {view(q, 0), view(k, q_elems)};
}

// The eager entry (pybind11, no dispatcher): same arguments, but q_out may be None (out of
// place): then the outputs are allocated here (as empty_like: same layout as the inputs; for
// small calls over one storage, see kPairedOutputBytes) and returned as (q_out, k_out);
// otherwise it writes into the given outputs and returns None.
// Not traceable: CudaBackend.run uses the op under torch.compile.
py::object rope_eager(const at::Tensor& q, const std::optional<at::Tensor>& k,
                      const std::optional<at::Tensor>& q_out,
                      const std::optional<at::Tensor>& k_out, const std::optional<at::Tensor>& pos,
                      int64_t pos_offset, const at::Tensor& cos, const at::Tensor& sin,
                      const std::optional<at::Tensor>& freq_turns, double attention_factor,
                      int64_t layout, int64_t rotary_dim, bool interleaved, bool inverse,
                      bool inplace) {
  const at::Tensor* kp = opt_ptr(k);
  if (q_out.has_value() && q_out->defined()) {
    rope_core(q, kp, *q_out, opt_ptr(k_out), opt_ptr(pos), pos_offset, cos, sin,
              opt_ptr(freq_turns), attention_factor, layout, rotary_dim, interleaved, inverse,
              inplace);
    return py::none();
  }
  TORCH_CHECK(!inplace, "rope_ops_cuda: in place needs q_out (q itself)");
  TORCH_CHECK(q.is_cuda(), "rope_ops_cuda::rope: q must be a CUDA tensor");
  at::Tensor qo, ko;
  if (kp != nullptr && kp->numel() > 0 && q.numel() > 0 &&
      (q.numel() + kp->numel()) * q.element_size() <= kPairedOutputBytes &&
      kp->scalar_type() == q.scalar_type() && kp->device() == q.device()) {
    std::tie(qo, ko) = empty_pair_cuda(q, *kp);
  } else {
    qo = empty_like_cuda(q);
    if (kp != nullptr) ko = empty_like_cuda(*kp);
  }
  rope_core(q, kp, qo, kp != nullptr ? &ko : nullptr, opt_ptr(pos), pos_offset, cos, sin,
            opt_ptr(freq_turns), attention_factor, layout, rotary_dim, interleaved, inverse,
            inplace);
  if (kp == nullptr) return py::make_tuple(qo, py::none());
  return py::make_tuple(qo, ko);
}

// rope_eager for repeated out-of-place calls of one kind (rope_ops.apply's cached plans: the
// forward of inference calls, forward and backward (inverse) of autograd calls): the tables and
// constants are bound once, a call converts 4 arguments instead of 15. rope_ops.apply keys its
// plans by the positions' device, so pos is on q's device (rope_core checks it).
struct BoundRope {
  at::Tensor cos, sin;
  std::optional<at::Tensor> freq_turns;
  double attention_factor;
  int64_t layout, rotary_dim;
  bool interleaved, inverse;

  py::object operator()(const at::Tensor& q, const std::optional<at::Tensor>& k,
                        const std::optional<at::Tensor>& pos, int64_t pos_offset) const {
    return rope_eager(q, k, std::nullopt, std::nullopt, pos, pos_offset, cos, sin, freq_turns,
                      attention_factor, layout, rotary_dim, interleaved, inverse, false);
  }
};

// The metadata of one tensor that rope_ops.apply's plan key reads (sizes, dtype, device; strides
// for q and k, whose layout the plan depends on).
struct TensorMeta {
  int64_t dim = 0;
  std::array<int64_t, 4> sizes{}, strides{};
  at::ScalarType dtype = at::kFloat;
  c10::Device device{c10::kCPU};
  bool with_strides = true;

  TensorMeta() = default;
  TensorMeta(const at::Tensor& t, bool with_strides_)
      : dim(t.dim()), dtype(t.scalar_type()), device(t.device()), with_strides(with_strides_) {
    TORCH_CHECK(dim <= 4, "rope_ops_cuda: GuardedRope takes tensors of at most 4 dims");
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

// A plain torch.Tensor (not a subclass: those never take rope_ops.apply's fast path), or null.
// (THPVariable_CheckExact would also take torch.nn.Parameter.)
const at::Tensor* exact_tensor(py::handle obj) {
  return Py_TYPE(obj.ptr()) == reinterpret_cast<PyTypeObject*>(THPVariableClass)
             ? &THPVariable_Unpack(obj.ptr())
             : nullptr;
}

// A BoundRope that runs only for calls whose (q, k, pos) have the metadata of the call it was
// made from, and returns None otherwise: rope_ops.apply's guard for repeats of a call kind.
// It checks in C++ what the plan key checks in Python (exact tensor types, q's and k's sizes,
// strides, dtype and device, pos's sizes, dtype and device or an int offset, no gradient needed),
// so a repeat skips building and hashing the key. Only plans made without gradients get one.
struct GuardedRope {
  BoundRope bound;
  TensorMeta q_meta, k_meta, pos_meta;
  bool has_k, pos_is_int;

  GuardedRope(BoundRope b, py::handle q, py::handle k, py::handle pos) : bound(std::move(b)) {
    const at::Tensor* qt = exact_tensor(q);
    const at::Tensor* kt = k.is_none() ? nullptr : exact_tensor(k);
    TORCH_CHECK(qt != nullptr && (k.is_none() || kt != nullptr),
                "rope_ops_cuda: GuardedRope needs plain tensors q and k");
    q_meta = TensorMeta(*qt, true);
    has_k = kt != nullptr;
    if (has_k) k_meta = TensorMeta(*kt, true);
    pos_is_int = PyLong_CheckExact(pos.ptr());
    if (!pos_is_int) {
      const at::Tensor* pt = exact_tensor(pos);
      TORCH_CHECK(pt != nullptr, "rope_ops_cuda: GuardedRope needs pos as a tensor or an int");
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
      // apply's own range (|offset| < 2^62) so that offset + token never overflows
      if (overflow != 0 || offset <= -(1LL << 62) || offset >= (1LL << 62)) return py::none();
      return bound(*qt, k_opt, std::nullopt, offset);
    }
    const at::Tensor* pt = exact_tensor(pos);
    if (pt == nullptr || !pos_meta.matches(*pt)) return py::none();
    return bound(*qt, k_opt, *pt, 0);
  }
};

// Meta / fake implementation: the op only writes into q_out / k_out, which already exist.
void rope_meta(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
               const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t,
               const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, double,
               int64_t, int64_t, bool, bool, bool) {}

void set_tuning(int64_t max_heads_per_thread, int64_t min_threads_per_sm) {
  rope_set_tuning(static_cast<int>(max_heads_per_thread), static_cast<int>(min_threads_per_sm));
}

void set_config(int64_t variant, int64_t max_heads_per_thread, int64_t min_threads_per_sm) {
  rope_set_config(static_cast<int>(variant), static_cast<int>(max_heads_per_thread),
                  static_cast<int>(min_threads_per_sm));
}

void set_launch(int64_t block_threads, int64_t rows_on_the_fly, int64_t pdl) {
  rope_set_launch(static_cast<int>(block_threads), static_cast<int>(rows_on_the_fly),
                  static_cast<int>(pdl));
}

void set_flat_lean(int64_t lean) { rope_set_flat_lean(static_cast<int>(lean)); }

int64_t num_variants() { return rope_num_variants(); }
int64_t last_variant() { return rope_last_variant(); }

int64_t pick_path(const at::Tensor& q, const std::optional<at::Tensor>& k, const at::Tensor& q_out,
                  const std::optional<at::Tensor>& k_out, int64_t layout, int64_t rotary_dim,
                  bool interleaved, bool inplace, const at::Tensor& cos) {
  // Which kernel a call with these tensors would take (1 fast, 2 generic); for the GPU check.
  RopeParams p{};
  fill_tensors(p, q, opt_ptr(k), q_out, opt_ptr(k_out), layout);
  p.R = rotary_dim;
  p.interleaved = interleaved ? 1 : 0;
  p.copy_passthrough = inplace ? 0 : 1;
  p.cos_table = cos.data_ptr<float>();
  p.sin_table = cos.data_ptr<float>();
  p.table_rows = cos.size(0);
  return rope_pick_path(&p);
}

}  // namespace

TORCH_LIBRARY(rope_ops_cuda, m) {
  m.def(
      "rope(Tensor q, Tensor? k, Tensor(a!) q_out, Tensor(b!)? k_out, Tensor? pos, int pos_offset, "
      "Tensor cos, Tensor sin, Tensor? freq_turns, float attention_factor, int layout, "
      "int rotary_dim, bool interleaved, bool inverse, bool inplace) -> ()");
  m.def("set_tuning(int max_heads_per_thread, int min_threads_per_sm) -> ()");
  m.def("set_config(int variant, int max_heads_per_thread, int min_threads_per_sm) -> ()");
  m.def("set_launch(int block_threads, int rows_on_the_fly, int pdl) -> ()");
  m.def("set_flat_lean(int lean) -> ()");
  m.def("num_variants() -> int");
  m.def("last_variant() -> int");
  m.def(
      "pick_path(Tensor q, Tensor? k, Tensor q_out, Tensor? k_out, int layout, int rotary_dim, "
      "bool interleaved, bool inplace, Tensor cos) -> int");
  m.impl("set_tuning", &set_tuning);
  m.impl("set_config", &set_config);
  m.impl("set_launch", &set_launch);
  m.impl("set_flat_lean", &set_flat_lean);
  m.impl("num_variants", &num_variants);
  m.impl("last_variant", &last_variant);
}

TORCH_LIBRARY_IMPL(rope_ops_cuda, CUDA, m) {
  m.impl("rope", &rope_cuda);
  m.impl("pick_path", &pick_path);
}

TORCH_LIBRARY_IMPL(rope_ops_cuda, Meta, m) { m.impl("rope", &rope_meta); }

#ifndef TORCH_EXTENSION_NAME  // defined by torch.utils.cpp_extension; for the syntax check only
#define TORCH_EXTENSION_NAME rope_ops_cuda_ext
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope", &rope_eager,
        "rope(q, k, q_out, k_out, pos, pos_offset, cos, sin, freq_turns, attention_factor, "
        "layout, rotary_dim, interleaved, inverse, inplace) -> None | (q_out, k_out)");
  m.def("variant_name", [](int v) { return std::string(rope_variant_name(v)); });
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
