// The torch side of the CUDA backend: KernelArgs (rope_ops/backend.py) to RopeParams, outputs,
// the bound launchers of rope_ops.apply's plans (BoundRope, its guard, its autograd), and the
// module's Python functions. Written once for a Platform (where tensors live, how outputs are
// allocated, which stream): rope_binding.cpp's CudaPlatform builds the extension; the tests'
// host emulation (tests/csrc/) builds the same code for CPU tensors.
//
// A Platform provides:
//   static bool on_device(const at::Tensor&);               a tensor the kernels can read
//   struct Scope { RopeDevice dev; cudaStream_t stream; Scope(const at::Tensor& q); };
//                                                           device guard, properties, stream
//   static at::Tensor empty_strided(sizes, strides, dtype, device);
//   static at::Tensor empty_bytes(int64_t n, device);
//   static constexpr c10::DispatchKey kKey;                 of tensors made over a storage
#pragma once

#include <ATen/ExpandUtils.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "rope.h"

namespace rope_torch {

using at::Tensor;
using OptTensor = std::optional<at::Tensor>;

// KernelArgs' first fields, in order: C++ reads them by index (the backend checks the names).
// Fields appended later belong to variants this backend does not declare (supports() refuses
// their calls), so they are not read.
constexpr const char* kKernelArgsFields[] = {
    "q", "k", "q_out", "k_out", "pos", "pos_offset", "cos", "sin", "freq_turns",
    "attention_factor", "layout", "rotary_dim", "interleaved", "inverse", "inplace", "angles",
    "mrope_section", "mrope_interleaved"};
constexpr int kNumKernelArgsFields = 18;

// (batch, seq, head, dim) axes of each layout; -1: no batch axis (thd). Codes: bshd 0, sbhd 1,
// bhsd 2, thd 3.
constexpr int kLayoutDims[4][4] = {
    {0, 1, 2, 3},   // bshd
    {1, 0, 2, 3},   // sbhd
    {0, 2, 1, 3},   // bhsd
    {-1, 0, 1, 2},  // thd
};
constexpr const char* kLayoutNames[4] = {"bshd", "sbhd", "bhsd", "thd"};

// One call, as KernelArgs carries it (undefined tensors for None).
struct Call {
  Tensor q, k, q_out, k_out, pos;
  int64_t pos_offset = 0;
  Tensor cos, sin, freq_turns;
  double attention_factor = 1.0;
  int layout = 0;
  int64_t rotary_dim = 0;
  bool interleaved = false, inverse = false, inplace = false;
  int angle_kind = ROPE_ANGLES_TABLE;  // RopeAngleKind
  int64_t mrope_section[3] = {0, 0, 0};
  bool mrope_interleaved = false;
};

inline Tensor tensor_or_none(PyObject* obj, const char* name) {
  if (obj == Py_None) return Tensor();
  TORCH_CHECK(THPVariable_Check(obj), "rope_ops_cuda: KernelArgs.", name, " must be a tensor or None");
  return THPVariable_Unpack(obj);
}

inline int layout_code(PyObject* obj) {
  for (int i = 0; i < 4; ++i) {
    if (PyUnicode_Check(obj) && PyUnicode_CompareWithASCIIString(obj, kLayoutNames[i]) == 0) return i;
  }
  TORCH_CHECK(false, "rope_ops_cuda: KernelArgs.layout must be one of bshd, sbhd, bhsd, thd");
  return -1;
}

inline bool flag(PyObject* obj) {
  const int v = PyObject_IsTrue(obj);
  if (v < 0) throw py::error_already_set();
  return v != 0;
}

inline int64_t integer(PyObject* obj, const char* name) {
  const long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    TORCH_CHECK(false, "rope_ops_cuda: KernelArgs.", name, " must be an int");
  }
  return v;
}

// KernelArgs.angles (angle_sources.cuh: one source each).
inline int angle_kind(PyObject* obj) {
  const struct { const char* name; int kind; } kinds[] = {
      {"table", ROPE_ANGLES_TABLE}, {"token", ROPE_ANGLES_TOKEN}, {"mrope", ROPE_ANGLES_MROPE}};
  for (const auto& k : kinds) {
    if (PyUnicode_Check(obj) && PyUnicode_CompareWithASCIIString(obj, k.name) == 0) return k.kind;
  }
  TORCH_CHECK(false, "rope_ops_cuda: KernelArgs.angles must be one of table, token, mrope");
  return -1;
}

// KernelArgs (a tuple: a NamedTuple) to a Call.
inline Call read_kernel_args(py::handle args) {
  PyObject* t = args.ptr();
  TORCH_CHECK(PyTuple_Check(t) && PyTuple_GET_SIZE(t) >= kNumKernelArgsFields,
              "rope_ops_cuda: expected a rope_ops.backend.KernelArgs");
  const auto item = [&](int i) { return PyTuple_GET_ITEM(t, i); };
  Call c;
  c.q = tensor_or_none(item(0), "q");
  TORCH_CHECK(c.q.defined(), "rope_ops_cuda: KernelArgs.q is None");
  c.k = tensor_or_none(item(1), "k");
  c.q_out = tensor_or_none(item(2), "q_out");
  c.k_out = tensor_or_none(item(3), "k_out");
  c.pos = tensor_or_none(item(4), "pos");
  c.pos_offset = integer(item(5), "pos_offset");
  c.cos = tensor_or_none(item(6), "cos");
  c.sin = tensor_or_none(item(7), "sin");
  c.freq_turns = tensor_or_none(item(8), "freq_turns");
  c.attention_factor = PyFloat_AsDouble(item(9));
  if (c.attention_factor == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  c.layout = layout_code(item(10));
  c.rotary_dim = integer(item(11), "rotary_dim");
  c.interleaved = flag(item(12));
  c.inverse = flag(item(13));
  c.inplace = flag(item(14));
  c.angle_kind = angle_kind(item(15));
  if (c.angle_kind == ROPE_ANGLES_MROPE) {
    PyObject* section = item(16);
    TORCH_CHECK((PyTuple_Check(section) || PyList_Check(section)) && PySequence_Fast_GET_SIZE(section) == 3,
                "rope_ops_cuda: KernelArgs.mrope_section must be three ints for angles 'mrope'");
    for (int i = 0; i < 3; ++i)
      c.mrope_section[i] = integer(PySequence_Fast_GET_ITEM(section, i), "mrope_section");
    c.mrope_interleaved = flag(item(17));
  }
  return c;
}

// ------------------------------------------------------------------------------------------------
// RopeParams of a call

struct Canon {
  int64_t B, S, H, D;
  int64_t stride[4];
};

inline Canon canon(const Tensor& t, int layout, const char* name) {
  const int* dims = kLayoutDims[layout];
  const int64_t rank = dims[0] < 0 ? 3 : 4;
  TORCH_CHECK(t.dim() == rank, "rope_ops_cuda: ", name, " must have ", rank,
              " dims for layout ", kLayoutNames[layout], ", got ", t.dim());
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

inline int dtype_code(at::ScalarType st) {
  switch (st) {
    case at::kFloat:
      return ROPE_F32;
    case at::kHalf:
      return ROPE_F16;
    case at::kBFloat16:
      return ROPE_BF16;
    default:
      TORCH_CHECK(false, "rope_ops_cuda: dtype ", st, " not supported (float32, float16, bfloat16)");
  }
  return -1;
}

inline void check_same(const Tensor& a, const Tensor& b, const Canon& ca, const Canon& cb,
                       const char* name) {
  TORCH_CHECK(b.device() == a.device() && b.scalar_type() == a.scalar_type(),
              "rope_ops_cuda: ", name, " must have its input's dtype and device");
  TORCH_CHECK(ca.B == cb.B && ca.S == cb.S && ca.H == cb.H && ca.D == cb.D,
              "rope_ops_cuda: ", name, " has a different shape from its input");
}

// The tensor part of RopeParams: dtype, pointers, canonical [B, S, H, D] sizes and strides of q,
// q_out and (defined) k, k_out, checked to agree.
inline void fill_tensors(RopeParams& p, const Tensor& q, const Tensor& k, const Tensor& q_out,
                         const Tensor& k_out, int layout) {
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
  if (k.defined()) {
    TORCH_CHECK(k_out.defined(), "rope_ops_cuda: k given without k_out");
    const Canon ck = canon(k, layout, "k");
    const Canon cko = canon(k_out, layout, "k_out");
    check_same(k, k_out, ck, cko, "k_out");
    TORCH_CHECK(k.device() == q.device() && k.scalar_type() == q.scalar_type(),
                "rope_ops_cuda: k must have q's dtype and device");
    TORCH_CHECK(ck.B == cq.B && ck.S == cq.S && ck.D == cq.D,
                "rope_ops_cuda: k must match q in batch, seq and head_dim");
    p.k = k.data_ptr();
    p.k_out = k_out.data_ptr();
    for (int i = 0; i < 4; ++i) {
      p.k_stride[i] = ck.stride[i];
      p.k_out_stride[i] = cko.stride[i];
    }
    p.Hk = ck.H;
  }
}

// The caller's cos/sin per token (angles "token"): [B, S, R/2] or [S, R/2] (broadcast over the
// batch; thd: [T, R/2] or [1, T, R/2]), any (b, s) strides, stride 1 along frequencies.
inline void fill_token_angles(RopeParams& p, const Call& c) {
  const Tensor& cos = c.cos;
  const Tensor& sin = c.sin;
  const int64_t half = c.rotary_dim / 2;
  TORCH_CHECK(cos.defined() && sin.defined() && cos.scalar_type() == sin.scalar_type() &&
                  cos.device() == c.q.device() && sin.device() == c.q.device(),
              "rope_ops_cuda: per-token cos/sin must be tensors of one dtype on q's device");
  p.token_dtype = dtype_code(cos.scalar_type());
  const auto view = [&](const Tensor& t, const char* name) {
    TORCH_CHECK((t.dim() == 2 || t.dim() == 3) && t.size(-1) == half,
                "rope_ops_cuda: per-token ", name, " must be [B, S, rotary_dim/2] or [S, rotary_dim/2], got ",
                t.sizes());
    TORCH_CHECK(half == 1 || t.stride(-1) == 1, "rope_ops_cuda: per-token ", name,
                " must have stride 1 along frequencies");
    const Tensor v = t.dim() == 3 ? t : t.unsqueeze(0);
    TORCH_CHECK((v.size(0) == p.B || v.size(0) == 1) && v.size(1) == p.S, "rope_ops_cuda: per-token ",
                name, " of shape ", t.sizes(), " does not match ", p.B, " x ", p.S, " tokens");
    return v;
  };
  const Tensor vc = view(cos, "cos");
  const Tensor vs = view(sin, "sin");
  p.token_cos = vc.data_ptr();
  p.token_sin = vs.data_ptr();
  // a size-1 axis is broadcast: stride 0, so that no row past the tensor is addressed
  p.token_cos_stride_b = vc.size(0) == 1 ? 0 : vc.stride(0);
  p.token_cos_stride_s = vc.size(1) == 1 ? 0 : vc.stride(1);
  p.token_sin_stride_b = vs.size(0) == 1 ? 0 : vs.stride(0);
  p.token_sin_stride_s = vs.size(1) == 1 ? 0 : vs.stride(1);
}

// Positions: [S] or [B, S] (table), [3, S] or [3, B, S] (mRoPE; thd: [T] and [3, T]); int32 or
// int64 on q's device.
inline void fill_positions(RopeParams& p, const Call& c) {
  const Tensor& pos = c.pos;
  const bool mrope = c.angle_kind == ROPE_ANGLES_MROPE;
  if (!pos.defined()) {
    TORCH_CHECK(!mrope, "rope_ops_cuda: angles 'mrope' needs positions [3, B, S], [3, S] or [3, T]");
    p.pos_kind = ROPE_POS_OFFSET;
    p.pos_offset = c.pos_offset;
    return;
  }
  TORCH_CHECK(pos.device() == c.q.device(), "rope_ops_cuda: pos must be on q's device");
  TORCH_CHECK(pos.scalar_type() == at::kInt || pos.scalar_type() == at::kLong,
              "rope_ops_cuda: pos must be int32 or int64");
  p.pos = pos.data_ptr();
  p.pos_kind = pos.scalar_type() == at::kInt ? ROPE_POS_I32 : ROPE_POS_I64;
  Tensor bs = pos;  // the [S] or [B, S] positions (of one axis for mRoPE)
  if (mrope) {
    TORCH_CHECK((pos.dim() == 2 || pos.dim() == 3) && pos.size(0) == 3,
                "rope_ops_cuda: mRoPE positions must be [3, B, S], [3, S] or [3, T], got ", pos.sizes());
    p.pos_stride_axis = pos.stride(0);
    bs = pos.select(0, 0);
  }
  if (bs.dim() == 1) {
    TORCH_CHECK(bs.size(0) == p.S || p.S == 0, "rope_ops_cuda: pos has ", bs.size(0),
                " entries per axis, expected ", p.S);
    p.pos_stride_b = 0;
    p.pos_stride_s = bs.stride(0);
  } else {
    TORCH_CHECK(bs.dim() == 2 && bs.size(0) == p.B && bs.size(1) == p.S,
                "rope_ops_cuda: pos must be [S] or [B, S]");
    p.pos_stride_b = bs.stride(0);
    p.pos_stride_s = bs.stride(1);
  }
}

// Whether the table source reads cos and sin where they are: stride 1 along frequencies and one
// positive row stride for both (the two halves of one [P, R] cos|sin cache qualify).
inline bool rows_in_place(const Tensor& cos, const Tensor& sin) {
  const auto unit = [](const Tensor& t) { return t.size(1) <= 1 || t.stride(1) == 1; };
  return unit(cos) && unit(sin) && (cos.size(0) <= 1 || (cos.stride(0) > 0 && cos.stride(0) == sin.stride(0)));
}

// The rest of RopeParams: rotation and the angle source's fields: positions (on q's device) and
// tables (float32, read in place: see rows_in_place), or the per-token cos/sin.
inline void fill_angles(RopeParams& p, const Call& c) {
  const Tensor& q = c.q;
  TORCH_CHECK(c.rotary_dim > 0 && c.rotary_dim % 2 == 0 && c.rotary_dim <= p.D,
              "rope_ops_cuda: rotary_dim must be even in (0, head_dim], got ", c.rotary_dim);
  p.R = c.rotary_dim;
  p.interleaved = c.interleaved ? 1 : 0;
  p.inverse = c.inverse ? 1 : 0;
  p.copy_passthrough = c.inplace ? 0 : 1;
  p.angle_kind = c.angle_kind;
  p.attention_factor = static_cast<float>(c.attention_factor);
  if (c.angle_kind == ROPE_ANGLES_TOKEN) {
    fill_token_angles(p, c);
    return;
  }
  if (c.angle_kind == ROPE_ANGLES_MROPE) {
    const int64_t* sec = c.mrope_section;
    TORCH_CHECK(sec[0] >= 0 && sec[1] >= 0 && sec[2] >= 0 && sec[0] + sec[1] + sec[2] == c.rotary_dim / 2,
                "rope_ops_cuda: mrope_section must be three counts >= 0 summing to rotary_dim/2");
    for (int i = 0; i < 3; ++i) p.mrope_section[i] = (int)sec[i];
    p.mrope_interleaved = c.mrope_interleaved ? 1 : 0;
  }
  fill_positions(p, c);
  const Tensor& cos = c.cos;
  const Tensor& sin = c.sin;
  TORCH_CHECK(cos.defined() && sin.defined() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.dim() == 2 && sin.sizes() == cos.sizes() &&
                  cos.size(1) == c.rotary_dim / 2 && rows_in_place(cos, sin) &&
                  cos.device() == q.device() && sin.device() == q.device(),
              "rope_ops_cuda: cos/sin must be float32 [P, rotary_dim/2] on q's device, stride 1 "
              "along frequencies and one row stride");
  p.cos_table = cos.data_ptr<float>();
  p.sin_table = sin.data_ptr<float>();
  p.table_rows = cos.size(0);
  p.table_row_stride = cos.size(0) > 1 ? cos.stride(0) : c.rotary_dim / 2;
  if (c.freq_turns.defined()) {
    const Tensor& f = c.freq_turns;
    TORCH_CHECK(f.scalar_type() == at::kLong && f.is_contiguous() && f.numel() == c.rotary_dim / 2 &&
                    f.device() == q.device(),
                "rope_ops_cuda: freq_turns must be contiguous int64 [rotary_dim/2] on q's device");
    p.freq_turns = f.data_ptr<int64_t>();
  }
}

// Tables the table source cannot read in place (see rows_in_place) are copied for the call.
inline void contiguous_tables(Call& c) {
  if (c.angle_kind == ROPE_ANGLES_TOKEN) return;  // per-token rows: read with their own strides
  if (!c.cos.defined() || !c.sin.defined() || c.cos.dim() != 2 || c.sin.sizes() != c.cos.sizes()) return;
  if (!rows_in_place(c.cos, c.sin)) {
    c.cos = c.cos.contiguous();
    c.sin = c.sin.contiguous();
  }
}

// ------------------------------------------------------------------------------------------------
// Outputs

// The strides at::empty_like(t) gives t: t's own when t is non-overlapping and dense, else dense
// strides in t's dimension order.
inline std::vector<int64_t> like_strides(const Tensor& t) {
  if (t.is_non_overlapping_and_dense()) return t.strides().vec();
  return at::infer_dense_strides(t.sizes(), t.strides());
}

// Outputs of calls up to this many bytes (q_out + k_out) share one allocation: a decode step's
// host time is dominated by its two trips through the caching allocator (~2.3 us each on the
// slowest hosts measured). Larger calls are GPU-bound and keep separate allocations.
constexpr int64_t kPairedOutputBytes = 8 << 20;

// (q_out, k_out) like empty_like(q), empty_like(k) (k may be undefined), made without the
// dispatcher; small pairs as two tensors over one storage (k_out's data 256-byte aligned after
// q_out's).
template <class Platform>
std::pair<Tensor, Tensor> empty_outputs(const Tensor& q, const Tensor& k) {
  const auto like = [](const Tensor& t) {
    return Platform::empty_strided(t.sizes(), like_strides(t), t.scalar_type(), t.device());
  };
  if (!k.defined()) return {like(q), Tensor()};
  if (k.numel() == 0 || q.numel() == 0 || (q.numel() + k.numel()) * q.element_size() > kPairedOutputBytes)
    return {like(q), like(k)};
  const int64_t elem = q.element_size();
  const int64_t q_elems = (q.numel() * elem + 255) / 256 * 256 / elem;  // k_out's storage offset
  const Tensor buf = Platform::empty_bytes((q_elems + k.numel()) * elem, q.device());
  const auto view = [&](const Tensor& t, int64_t offset) {
    Tensor v = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(buf.storage()), c10::DispatchKeySet(Platform::kKey), q.dtype());
    v.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), like_strides(t), offset);
    return v;
  };
  return {view(q, 0), view(k, q_elems)};
}

// ------------------------------------------------------------------------------------------------
// Runs

// The angle fields of p from c. Tables the kernels cannot read in place are copied and
// positions moved to q's device in c, which holds them until the launch is queued (the allocator
// reuses memory in stream order).
template <class Platform>
void prepare_angles(RopeParams& p, Call& c) {
  contiguous_tables(c);
  if (c.pos.defined() && !Platform::on_device(c.pos)) c.pos = c.pos.to(c.q.device(), /*non_blocking=*/true);
  fill_angles(p, c);
}

// RopeParams of a call whose outputs are set (q_out, k_out, or q and k in place).
template <class Platform>
RopeParams params_of(Call& c) {
  RopeParams p{};
  fill_tensors(p, c.q, c.k, c.q_out, c.k_out, c.layout);
  prepare_angles<Platform>(p, c);
  return p;
}

// Launches the call (outputs set) on q's device's current stream: the policy's choice, or
// `config` when given.
template <class Platform>
void launch(Call& c, const RopeConfig* config = nullptr) {
  TORCH_CHECK(Platform::on_device(c.q), "rope_ops_cuda: q is not on a device this backend runs on");
  const typename Platform::Scope scope(c.q);
  const RopeParams p = params_of<Platform>(c);
  const cudaError_t err = config == nullptr ? rope_launch(&p, &scope.dev, scope.stream)
                                            : rope_launch_config(&p, &scope.dev, config, scope.stream);
  TORCH_CHECK(err != cudaErrorInvalidValue || config == nullptr,
              "rope_ops_cuda: this kernel configuration cannot take the call");
  TORCH_CHECK(err == cudaSuccess, "rope_ops_cuda: kernel launch failed: ", cudaGetErrorString(err));
}

// CudaBackend.run: writes into q_out / k_out (or in place) and returns None; out of place with
// q_out None, allocates the outputs and returns (q_out, k_out).
template <class Platform>
py::object run(py::handle args) {
  Call c = read_kernel_args(args);
  TORCH_CHECK(Platform::on_device(c.q), "rope_ops_cuda: q is not on a device this backend runs on");
  if (c.inplace) {
    c.q_out = c.q;
    c.k_out = c.k;
  } else if (!c.q_out.defined()) {
    std::tie(c.q_out, c.k_out) = empty_outputs<Platform>(c.q, c.k);
    launch<Platform>(c);
    return py::make_tuple(c.q_out, c.k.defined() ? py::cast(c.k_out) : py::none());
  }
  launch<Platform>(c);
  return py::none();
}

// Labels of every configuration that can take the call (out of place without outputs: with
// those run() would allocate, whose strides and alignment the choice reads).
template <class Platform>
std::vector<std::string> candidates(py::handle args) {
  Call c = read_kernel_args(args);
  TORCH_CHECK(Platform::on_device(c.q), "rope_ops_cuda: q is not on a device this backend runs on");
  if (c.inplace) {
    c.q_out = c.q;
    c.k_out = c.k;
  } else if (!c.q_out.defined()) {
    std::tie(c.q_out, c.k_out) = empty_outputs<Platform>(c.q, c.k);
  }
  const typename Platform::Scope scope(c.q);
  const RopeParams p = params_of<Platform>(c);
  RopeConfig configs[128];
  const int n = rope_candidates(&p, &scope.dev, configs, 128);
  TORCH_CHECK(n >= 0, "rope_ops_cuda: inconsistent call");
  std::vector<std::string> labels;
  for (int i = 0; i < n && i < 128; ++i) {
    char buf[64];
    rope_config_label(&configs[i], buf, sizeof buf);
    labels.emplace_back(buf);
  }
  return labels;
}

template <class Platform>
void run_with(py::handle args, const std::string& label) {
  Call c = read_kernel_args(args);
  RopeConfig config;
  TORCH_CHECK(rope_parse_label(label.c_str(), &config) == 0, "rope_ops_cuda: unknown kernel "
              "configuration '", label, "' (kernel_candidates lists them)");
  if (c.inplace) {
    c.q_out = c.q;
    c.k_out = c.k;
  }
  TORCH_CHECK(c.q_out.defined(), "rope_ops_cuda: run_with needs the outputs in KernelArgs");
  launch<Platform>(c, &config);
}

// ------------------------------------------------------------------------------------------------
// Bound launchers (rope_ops.apply's cached plans)

// A call kind's constants: tables, frequencies, layout, rotation.
struct Bound : torch::CustomClassHolder {
  Tensor cos, sin, freq_turns;
  double attention_factor = 1.0;
  int layout = 0;
  int64_t rotary_dim = 0;
  bool interleaved = false;
};

// Out of place with bound constants: (q_out, k_out), k_out undefined without k.
template <class Platform>
std::pair<Tensor, Tensor> rotate_bound(const Bound& b, bool inverse, const Tensor& q,
                                       const Tensor& k, const Tensor& pos, int64_t pos_offset) {
  Call c;
  c.q = q;
  c.k = k;
  c.pos = pos;
  c.pos_offset = pos_offset;
  c.cos = b.cos;
  c.sin = b.sin;
  c.freq_turns = b.freq_turns;
  c.attention_factor = b.attention_factor;
  c.layout = b.layout;
  c.rotary_dim = b.rotary_dim;
  c.interleaved = b.interleaved;
  c.inverse = inverse;
  std::tie(c.q_out, c.k_out) = empty_outputs<Platform>(q, k);
  launch<Platform>(c);
  return {c.q_out, c.k_out};
}

inline py::object pair_or_single(const Tensor& q_out, const Tensor& k_out) {
  return py::make_tuple(q_out, k_out.defined() ? py::cast(k_out) : py::none());
}

// Output gradients as the kernels take them fastest (stride 1 on head_dim); undefined stays so.
inline Tensor last_dim_contiguous(const Tensor& g) {
  return g.defined() && g.stride(-1) != 1 ? g.contiguous() : g;
}

// The rotation recorded by autograd: its backward is the rotation the other way (itself
// recorded when the backward builds a graph, create_graph=True). Positions are saved, so
// changing them in place before the backward raises. Outputs: (q_out, k_out), or q_out alone.
template <class Platform>
struct RopeFunction : torch::autograd::Function<RopeFunction<Platform>> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const Tensor& q, const OptTensor& k,
                                                const OptTensor& pos, int64_t pos_offset,
                                                const c10::intrusive_ptr<Bound>& bound, bool inverse) {
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined
    if (pos.has_value()) ctx->save_for_backward({*pos});
    ctx->saved_data["bound"] = c10::IValue::make_capsule(bound);
    ctx->saved_data["pos_offset"] = pos_offset;
    ctx->saved_data["inverse"] = inverse;
    const Tensor kt = k.has_value() ? *k : Tensor();
    const auto out = rotate_bound<Platform>(*bound, inverse, q, kt, pos.value_or(Tensor()), pos_offset);
    if (!kt.defined()) return {out.first};
    return {out.first, out.second};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const OptTensor pos = saved.empty() ? OptTensor() : OptTensor(saved[0]);
    const auto bound = c10::static_intrusive_pointer_cast<Bound>(ctx->saved_data["bound"].toCapsule());
    const int64_t pos_offset = ctx->saved_data["pos_offset"].toInt();
    const bool inverse = !ctx->saved_data["inverse"].toBool();
    const Tensor gq = last_dim_contiguous(grads[0]);
    const Tensor gk = grads.size() > 1 ? last_dim_contiguous(grads[1]) : Tensor();
    // q's and k's gradients in one launch; one of them alone in the first slot
    const Tensor& first = gq.defined() ? gq : gk;
    const Tensor second = gq.defined() ? gk : Tensor();
    Tensor r1, r2;
    if (first.defined()) {
      if (at::GradMode::is_enabled()) {
        const auto out = RopeFunction::apply(first, second.defined() ? OptTensor(second) : OptTensor(),
                                             pos, pos_offset, bound, inverse);
        r1 = out[0];
        if (out.size() > 1) r2 = out[1];
      } else {
        std::tie(r1, r2) = rotate_bound<Platform>(*bound, inverse, first, second,
                                                  pos.value_or(Tensor()), pos_offset);
      }
    }
    const Tensor grad_q = gq.defined() ? r1 : Tensor();
    const Tensor grad_k = gq.defined() ? r2 : r1;
    return {grad_q, grad_k, Tensor(), Tensor(), Tensor(), Tensor()};
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
  TensorMeta(const Tensor& t, bool with_strides_)
      : dim(t.dim()), dtype(t.scalar_type()), device(t.device()), with_strides(with_strides_) {
    TORCH_CHECK(dim <= 4, "rope_ops_cuda: GuardedRope takes tensors of at most 4 dims");
    for (int64_t i = 0; i < dim; ++i) {
      sizes[i] = t.size(i);
      strides[i] = t.stride(i);
    }
  }

  bool matches(const Tensor& t) const {
    if (t.dim() != dim || t.scalar_type() != dtype || t.device() != device) return false;
    for (int64_t i = 0; i < dim; ++i) {
      if (t.size(i) != sizes[i] || (with_strides && t.stride(i) != strides[i])) return false;
    }
    return true;
  }
};

// A plain torch.Tensor (not a subclass: those never take rope_ops.apply's fast path), or null.
// (THPVariable_CheckExact would also take torch.nn.Parameter.)
inline const Tensor* exact_tensor(py::handle obj) {
  return Py_TYPE(obj.ptr()) == reinterpret_cast<PyTypeObject*>(THPVariableClass)
             ? &THPVariable_Unpack(obj.ptr())
             : nullptr;
}

// rope_ops.apply's plan of one call kind, out of place: the tables and constants bound once, a
// call converts 4 arguments instead of a KernelArgs. Forward (inverse false) or backward.
template <class Platform>
struct BoundRope {
  c10::intrusive_ptr<Bound> bound;
  bool inverse;

  py::object operator()(const Tensor& q, const OptTensor& k, const OptTensor& pos, int64_t pos_offset) const {
    const auto out = rotate_bound<Platform>(*bound, inverse, q, k.value_or(Tensor()),
                                            pos.value_or(Tensor()), pos_offset);
    return pair_or_single(out.first, out.second);
  }

  // The same call recorded by autograd (RopeFunction): the plan of calls that need a gradient.
  py::object with_grad(const Tensor& q, const OptTensor& k, const OptTensor& pos, int64_t pos_offset) const {
    const auto out = RopeFunction<Platform>::apply(q, k, pos, pos_offset, bound, inverse);
    return pair_or_single(out[0], out.size() > 1 ? out[1] : Tensor());
  }
};

// A BoundRope that runs only for calls whose (q, k, pos) have the metadata of the call it was
// made from, and returns None otherwise: rope_ops.apply's guard for repeats of a call kind.
// It checks in C++ what the plan key checks in Python (exact tensor types, q's and k's sizes,
// strides, dtype and device, pos's sizes, dtype and device or an int offset, no gradient needed),
// so a repeat skips building and hashing the key. Only plans made without gradients get one.
template <class Platform>
struct GuardedRope {
  BoundRope<Platform> bound;
  TensorMeta q_meta, k_meta, pos_meta;
  bool has_k, pos_is_int;

  GuardedRope(BoundRope<Platform> b, py::handle q, py::handle k, py::handle pos) : bound(std::move(b)) {
    const Tensor* qt = exact_tensor(q);
    const Tensor* kt = k.is_none() ? nullptr : exact_tensor(k);
    TORCH_CHECK(qt != nullptr && (k.is_none() || kt != nullptr),
                "rope_ops_cuda: GuardedRope needs plain tensors q and k");
    q_meta = TensorMeta(*qt, true);
    has_k = kt != nullptr;
    if (has_k) k_meta = TensorMeta(*kt, true);
    pos_is_int = PyLong_CheckExact(pos.ptr());
    if (!pos_is_int) {
      const Tensor* pt = exact_tensor(pos);
      TORCH_CHECK(pt != nullptr, "rope_ops_cuda: GuardedRope needs pos as a tensor or an int");
      pos_meta = TensorMeta(*pt, false);
    }
  }

  py::object operator()(py::handle q, py::handle k, py::handle pos) const {
    const Tensor* qt = exact_tensor(q);
    if (qt == nullptr || !q_meta.matches(*qt)) return py::none();
    const Tensor* kt = nullptr;
    if (has_k) {
      kt = exact_tensor(k);
      if (kt == nullptr || !k_meta.matches(*kt)) return py::none();
    } else if (!k.is_none()) {
      return py::none();
    }
    if (at::GradMode::is_enabled() && (qt->requires_grad() || (kt && kt->requires_grad()))) {
      return py::none();
    }
    const OptTensor k_opt = kt ? OptTensor(*kt) : std::nullopt;
    if (pos_is_int) {
      if (!PyLong_CheckExact(pos.ptr())) return py::none();  // bool is not an exact int
      int overflow = 0;
      const long long offset = PyLong_AsLongLongAndOverflow(pos.ptr(), &overflow);
      // apply's own range (|offset| < 2^62) so that offset + token never overflows
      if (overflow != 0 || offset <= -(1LL << 62) || offset >= (1LL << 62)) return py::none();
      return bound(*qt, k_opt, std::nullopt, offset);
    }
    const Tensor* pt = exact_tensor(pos);
    if (pt == nullptr || !pos_meta.matches(*pt)) return py::none();
    return bound(*qt, k_opt, *pt, 0);
  }
};

// ------------------------------------------------------------------------------------------------
// The module

template <class Platform>
void define_module(py::module_& m) {
  m.def("run", &run<Platform>,
        "run(args: KernelArgs) -> None | (q_out, k_out): CudaBackend.run (outputs allocated and "
        "returned when args.q_out is None out of place)");
  m.def("candidates", &candidates<Platform>,
        "candidates(args: KernelArgs) -> list[str]: every kernel configuration that can take the "
        "call, the policy's choice first (benchmark tooling, not API)");
  m.def("run_with", &run_with<Platform>,
        "run_with(args: KernelArgs, candidate: str): run with that configuration, outputs given "
        "(benchmark tooling, not API)");
  m.attr("kernel_args_fields") = py::cast(std::vector<std::string>(
      kKernelArgsFields, kKernelArgsFields + kNumKernelArgsFields));
  using Bound_ = BoundRope<Platform>;
  using Guarded = GuardedRope<Platform>;
  py::class_<Bound_>(m, "BoundRope")
      .def(py::init([](Tensor cos, Tensor sin, OptTensor freq_turns, double attention_factor,
                       const std::string& layout, int64_t rotary_dim, bool interleaved, bool inverse) {
             auto b = c10::make_intrusive<Bound>();
             b->cos = cos.contiguous();
             b->sin = sin.contiguous();
             b->freq_turns = freq_turns.value_or(Tensor());
             b->attention_factor = attention_factor;
             b->layout = -1;
             for (int i = 0; i < 4; ++i)
               if (layout == kLayoutNames[i]) b->layout = i;
             TORCH_CHECK(b->layout >= 0, "rope_ops_cuda: unknown layout ", layout);
             b->rotary_dim = rotary_dim;
             b->interleaved = interleaved;
             return Bound_{std::move(b), inverse};
           }),
           "BoundRope(cos, sin, freq_turns, attention_factor, layout, rotary_dim, interleaved, "
           "inverse)")
      .def("__call__", &Bound_::operator(),
           "(q, k, pos, pos_offset) -> (q_out, k_out): out of place, no autograd")
      .def("with_grad", &Bound_::with_grad,
           "(q, k, pos, pos_offset) -> (q_out, k_out): out of place, recorded by autograd (its "
           "backward is the rotation the other way)")
      .def(
          "guarded",
          [](const Bound_& b, py::handle q, py::handle k, py::handle pos) {
            return Guarded(b, q, k, pos);
          },
          "guarded(q, k, pos) -> GuardedRope: this launcher for calls with the metadata of "
          "(q, k, pos) only");
  py::class_<Guarded>(m, "GuardedRope")
      .def("__call__", &Guarded::operator(),
           "(q, k, pos) -> (q_out, k_out), or None when the call's metadata differ from the "
           "guarded call's or it needs a gradient");
}

}  // namespace rope_torch
