// The torch side of the fused prologue (prologue.h): PrologueArgs (rope_ops/backend.py) to
// RopePrologueParams, the forward and the backward on a Platform (rope_torch.h), and their module
// functions. A call the kernels cannot take (head rows of more than 128 units, outputs without
// stride 1 on head_dim) returns False / None: CudaBackend then runs rope_ops' torch ops.
#pragma once

#include <cmath>

#include "prologue.h"
#include "rope_torch.h"

namespace rope_torch {

// One prologue call, as PrologueArgs carries it (undefined tensors for None).
struct PrologueCall {
  Tensor qkv, q_out, k_out, v_out, pos, cos, sin, freq_turns, q_weight, k_weight, k_cache, v_cache, slots;
  int64_t pos_offset = 0, hq = 0, hk = 0, head_dim = 0, rotary_dim = 0;
  double attention_factor = 1.0, eps = 0.0, weight_offset = 0.0, k_scale = 1.0, v_scale = 1.0;
  double q_scale = 0.0;  // > 0: q_out is float8_e4m3fn of q / q_scale
  bool thd = true, interleaved = false, rotate = false, inplace = false;
};

inline double real_field(const py::handle& args, const char* name) {
  const double v = PyFloat_AsDouble(args.attr(name).ptr());
  if (v == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

inline Tensor tensor_field(const py::handle& args, const char* name) {
  const py::object o = args.attr(name);
  return tensor_or_none(o.ptr(), name);
}

inline PrologueCall read_prologue_args(py::handle args) {
  PrologueCall c;
  const py::object angles = args.attr("angles");
  TORCH_CHECK(PyUnicode_Check(angles.ptr()) && PyUnicode_CompareWithASCIIString(angles.ptr(), "table") == 0,
              "rope_ops_cuda: the prologue kernels take PrologueArgs.angles 'table' only");
  c.qkv = tensor_field(args, "qkv");
  TORCH_CHECK(c.qkv.defined(), "rope_ops_cuda: PrologueArgs.qkv is None");
  c.q_out = tensor_field(args, "q_out");
  c.k_out = tensor_field(args, "k_out");
  c.v_out = tensor_field(args, "v_out");
  c.pos = tensor_field(args, "pos");
  c.pos_offset = integer(args.attr("pos_offset").ptr(), "pos_offset");
  c.cos = tensor_field(args, "cos");
  c.sin = tensor_field(args, "sin");
  c.freq_turns = tensor_field(args, "freq_turns");
  c.attention_factor = real_field(args, "attention_factor");
  const py::object layout = args.attr("layout");
  c.thd = PyUnicode_Check(layout.ptr()) && PyUnicode_CompareWithASCIIString(layout.ptr(), "thd") == 0;
  TORCH_CHECK(c.thd || (PyUnicode_Check(layout.ptr()) &&
                        PyUnicode_CompareWithASCIIString(layout.ptr(), "bshd") == 0),
              "rope_ops_cuda: PrologueArgs.layout must be thd or bshd");
  c.hq = integer(args.attr("num_q_heads").ptr(), "num_q_heads");
  c.hk = integer(args.attr("num_kv_heads").ptr(), "num_kv_heads");
  c.head_dim = integer(args.attr("head_dim").ptr(), "head_dim");
  c.rotary_dim = integer(args.attr("rotary_dim").ptr(), "rotary_dim");
  c.interleaved = flag(args.attr("interleaved").ptr());
  c.rotate = flag(args.attr("rotate").ptr());
  c.q_weight = tensor_field(args, "q_weight");
  c.k_weight = tensor_field(args, "k_weight");
  c.eps = real_field(args, "eps");
  c.weight_offset = real_field(args, "weight_offset");
  c.inplace = flag(args.attr("inplace").ptr());
  c.k_cache = tensor_field(args, "k_cache");
  c.v_cache = tensor_field(args, "v_cache");
  c.slots = tensor_field(args, "slots");
  c.k_scale = real_field(args, "k_scale");
  c.v_scale = real_field(args, "v_scale");
  c.q_scale = real_field(args, "q_scale");
  return c;
}

// (b, s, h) element strides of a [T, H, D] (thd) or [B, S, H, D] tensor of the call's tokens and
// `heads` heads; false when it does not have stride 1 along D (the kernels need it).
inline bool head_strides(const Tensor& t, const PrologueCall& c, const RopeParams& r, int64_t heads,
                         const char* name, int64_t* out, bool fp8 = false) {
  const int64_t rank = c.thd ? 3 : 4;
  TORCH_CHECK(t.dim() == rank && t.size(-1) == c.head_dim && t.size(-2) == heads &&
                  (c.thd ? t.size(0) == r.S : t.size(0) == r.B && t.size(1) == r.S),
              "rope_ops_cuda: ", name, " has shape ", t.sizes(), ", expected the tokens of qkv x ",
              heads, " heads x ", c.head_dim);
  TORCH_CHECK(t.device() == c.qkv.device() &&
                  t.scalar_type() == (fp8 ? at::kFloat8_e4m3fn : c.qkv.scalar_type()),
              "rope_ops_cuda: ", name, " must have ", fp8 ? "float8_e4m3fn (q_scale > 0)" : "qkv's dtype",
              " and qkv's device");
  out[0] = c.thd ? 0 : t.stride(0);
  out[1] = t.stride(rank - 3);
  out[2] = t.stride(rank - 2);
  return c.head_dim == 1 || t.stride(-1) == 1;
}

// The norm weights as the kernels read them: contiguous, 16-byte aligned, both float32 or both
// of qkv's dtype (as given where they already are: no conversion launch per call).
inline void kernel_weights(PrologueCall& c, RopePrologueParams& p) {
  Tensor* ws[2] = {&c.q_weight, &c.k_weight};
  bool like_qkv = true;
  for (Tensor* w : ws) {
    if (!w->defined()) continue;
    TORCH_CHECK(w->dim() == 1 && w->size(0) == c.head_dim && w->device() == c.qkv.device() &&
                    at::isFloatingType(w->scalar_type()),
                "rope_ops_cuda: a norm weight must be a floating-point [head_dim] tensor on qkv's device");
    like_qkv = like_qkv && w->scalar_type() == c.qkv.scalar_type();
  }
  const at::ScalarType want = like_qkv ? c.qkv.scalar_type() : at::kFloat;
  for (Tensor* w : ws) {
    if (!w->defined()) continue;
    if (w->scalar_type() != want || !w->is_contiguous()) *w = w->to(want).contiguous();
    if (reinterpret_cast<uintptr_t>(w->data_ptr()) % 16 != 0) *w = w->clone();
  }
  p.q_weight = c.q_weight.defined() ? c.q_weight.data_ptr() : nullptr;
  p.k_weight = c.k_weight.defined() ? c.k_weight.data_ptr() : nullptr;
  p.weights_like_qkv = like_qkv ? 1 : 0;
}

// The fields both directions share: sizes, qkv, angles (rope.inverse for the backward), weights.
// Tables made contiguous, positions and slots moved to qkv's device, weights converted: c holds
// them until the launch is queued.
template <class Platform>
RopePrologueParams prologue_common(PrologueCall& c, bool backward) {
  const Tensor& qkv = c.qkv;
  TORCH_CHECK(Platform::on_device(qkv), "rope_ops_cuda: qkv is not on a device this backend runs on");
  TORCH_CHECK(qkv.dim() == (c.thd ? 2 : 3), "rope_ops_cuda: qkv must be [T, W] (thd) or [B, S, W] (bshd)");
  TORCH_CHECK(c.hq >= 1 && c.hk >= 1 && c.head_dim >= 1 && qkv.size(-1) == (c.hq + 2 * c.hk) * c.head_dim,
              "rope_ops_cuda: qkv's last dim is not (num_q_heads + 2 * num_kv_heads) * head_dim");
  TORCH_CHECK(qkv.stride(-1) == 1 || qkv.size(-1) == 1, "rope_ops_cuda: qkv needs stride 1 along its last dim");
  RopePrologueParams p{};
  RopeParams& r = p.rope;
  r.dtype = dtype_code(qkv.scalar_type());
  r.B = c.thd ? 1 : qkv.size(0);
  r.S = qkv.size(c.thd ? 0 : 1);
  r.D = c.head_dim;
  p.Hq = c.hq;
  p.Hk = c.hk;
  p.qkv = qkv.data_ptr();
  p.qkv_stride_b = c.thd ? 0 : qkv.stride(0);
  p.qkv_stride_s = qkv.stride(c.thd ? 0 : 1);
  if (c.rotate) {
    Call rc;
    rc.q = qkv;
    rc.pos = c.pos;
    rc.pos_offset = c.pos_offset;
    rc.cos = c.cos;
    rc.sin = c.sin;
    rc.freq_turns = c.freq_turns;
    rc.attention_factor = c.attention_factor;
    rc.rotary_dim = c.rotary_dim;
    rc.interleaved = c.interleaved;
    rc.inverse = backward;
    prepare_angles<Platform>(r, rc);
    c.cos = rc.cos;
    c.sin = rc.sin;
    c.pos = rc.pos;
  } else {
    r.R = 0;
    r.pos_kind = ROPE_POS_OFFSET;
  }
  kernel_weights(c, p);
  p.eps = static_cast<float>(c.eps);
  p.weight_offset = static_cast<float>(c.weight_offset);
  return p;
}

// The cache fields of the forward.
template <class Platform>
void prologue_cache(RopePrologueParams& p, PrologueCall& c) {
  if (!c.k_cache.defined()) return;
  TORCH_CHECK(c.v_cache.defined() && c.slots.defined(), "rope_ops_cuda: k_cache needs v_cache and slots");
  const bool fp8 = c.k_cache.scalar_type() == at::kFloat8_e4m3fn;
  for (const Tensor* t : {&c.k_cache, &c.v_cache}) {
    TORCH_CHECK(t->dim() == 3 && t->size(1) == c.hk && t->size(2) == c.head_dim &&
                    t->size(0) == c.k_cache.size(0) && t->device() == c.qkv.device() &&
                    t->scalar_type() == c.k_cache.scalar_type() && (t->stride(2) == 1 || c.head_dim == 1),
                "rope_ops_cuda: caches must be [num_slots, num_kv_heads, head_dim] with stride 1 along "
                "head_dim, on qkv's device, of one dtype");
    TORCH_CHECK(fp8 || t->scalar_type() == c.qkv.scalar_type(),
                "rope_ops_cuda: a cache must have qkv's dtype or float8_e4m3fn");
  }
  const RopeParams& r = p.rope;
  const Tensor& slots = c.slots;
  TORCH_CHECK(slots.scalar_type() == at::kInt || slots.scalar_type() == at::kLong,
              "rope_ops_cuda: slots must be int32 or int64");
  TORCH_CHECK(c.thd ? (slots.dim() == 1 && slots.size(0) == r.S)
                    : (slots.dim() == 2 && slots.size(0) == r.B && slots.size(1) == r.S),
              "rope_ops_cuda: slots must hold one slot per token ([T] or [B, S])");
  if (!Platform::on_device(slots)) c.slots = slots.to(c.qkv.device(), /*non_blocking=*/true);
  p.k_cache = c.k_cache.data_ptr();
  p.v_cache = c.v_cache.data_ptr();
  p.k_cache_stride[0] = c.k_cache.stride(0);
  p.k_cache_stride[1] = c.k_cache.stride(1);
  p.v_cache_stride[0] = c.v_cache.stride(0);
  p.v_cache_stride[1] = c.v_cache.stride(1);
  p.num_slots = c.k_cache.size(0);
  p.slots = c.slots.data_ptr();
  p.slots_kind = c.slots.scalar_type() == at::kInt ? ROPE_POS_I32 : ROPE_POS_I64;
  p.slots_stride_b = c.thd ? 0 : c.slots.stride(0);
  p.slots_stride_s = c.slots.stride(c.thd ? 0 : 1);
  p.cache_fp8 = fp8 ? 1 : 0;
  p.k_scale = static_cast<float>(c.k_scale);
  p.v_scale = static_cast<float>(c.v_scale);
}

// CudaBackend.run_prologue: True when the kernel ran, False when it cannot take the call.
template <class Platform>
bool prologue_forward(py::handle args) {
  PrologueCall c = read_prologue_args(args);
  const float q_scale = static_cast<float>(c.q_scale);
  TORCH_CHECK(c.q_scale == 0.0 || (q_scale > 0.f && std::isfinite(q_scale) && !c.inplace),
              "rope_ops_cuda: q_scale must be 0 or a positive finite float32, out of place only (got ",
              c.q_scale, c.inplace ? ", in place)" : ")");
  RopePrologueParams p = prologue_common<Platform>(c, false);
  p.inplace = c.inplace ? 1 : 0;
  p.q_scale = q_scale;
  if (!c.inplace) {
    TORCH_CHECK(c.q_out.defined() && c.k_out.defined() && c.v_out.defined(),
                "rope_ops_cuda: an out-of-place prologue needs q_out, k_out and v_out");
    const Tensor* outs[3] = {&c.q_out, &c.k_out, &c.v_out};
    const int64_t heads[3] = {c.hq, c.hk, c.hk};
    const char* names[3] = {"q_out", "k_out", "v_out"};
    for (int t = 0; t < 3; ++t) {
      if (!head_strides(*outs[t], c, p.rope, heads[t], names[t], p.out_stride[t], t == 0 && q_scale > 0.f))
        return false;
      p.out[t] = outs[t]->data_ptr();
    }
  }
  prologue_cache<Platform>(p, c);
  if (p.rope.B * p.rope.S == 0) return true;
  if (!rope_prologue_fits(&p)) return false;
  const typename Platform::Scope scope(c.qkv);
  const cudaError_t err = rope_prologue_launch(&p, &scope.dev, scope.stream);
  TORCH_CHECK(err == cudaSuccess, "rope_ops_cuda: prologue launch failed: ", cudaGetErrorString(err));
  return true;
}

// CudaBackend.run_prologue_backward: (grad_qkv, grad of q_weight or None, grad of k_weight or
// None), the weights' gradients float32 [D]; None when the kernels cannot take the call.
template <class Platform>
py::object prologue_backward(py::handle args, const OptTensor& grad_q, const OptTensor& grad_k,
                             const OptTensor& grad_v) {
  PrologueCall c = read_prologue_args(args);
  RopePrologueParams p = prologue_common<Platform>(c, true);
  const Tensor& qkv = c.qkv;
  Tensor grads[3];
  const OptTensor* given[3] = {&grad_q, &grad_k, &grad_v};
  const int64_t heads[3] = {c.hq, c.hk, c.hk};
  const char* names[3] = {"grad_q", "grad_k", "grad_v"};
  for (int t = 0; t < 3; ++t) {
    if (!given[t]->has_value() || !(*given[t])->defined()) continue;
    grads[t] = **given[t];
    if (grads[t].scalar_type() != qkv.scalar_type()) grads[t] = grads[t].to(qkv.scalar_type());
    if (c.head_dim > 1 && grads[t].stride(-1) != 1) grads[t] = grads[t].contiguous();
    head_strides(grads[t], c, p.rope, heads[t], names[t], p.grad_stride[t]);
    p.grad[t] = grads[t].data_ptr();
  }
  const typename Platform::Scope scope(qkv);
  std::vector<int64_t> dense(qkv.dim(), 1);  // grad_qkv: contiguous, qkv's sizes
  for (int64_t i = qkv.dim() - 2; i >= 0; --i) dense[i] = dense[i + 1] * std::max<int64_t>(qkv.size(i + 1), 1);
  const Tensor grad_qkv = Platform::empty_strided(qkv.sizes(), dense, qkv.scalar_type(), qkv.device());
  p.grad_qkv = grad_qkv.data_ptr();
  p.grad_qkv_stride_b = c.thd ? 0 : grad_qkv.stride(0);
  p.grad_qkv_stride_s = grad_qkv.stride(c.thd ? 0 : 1);
  if (p.rope.B * p.rope.S == 0) return py::none();
  const int64_t blocks = rope_prologue_backward_blocks(&p, &scope.dev);
  if (blocks == 0) return py::none();
  const auto partials = [&](const Tensor& w) {
    return w.defined() ? Platform::empty_strided({blocks, c.head_dim}, {c.head_dim, 1}, at::kFloat, qkv.device())
                       : Tensor();
  };
  const Tensor q_partials = partials(c.q_weight), k_partials = partials(c.k_weight);
  const auto grad_of = [&](const Tensor& w) {
    return w.defined() ? Platform::empty_strided({c.head_dim}, {1}, at::kFloat, qkv.device()) : Tensor();
  };
  const Tensor q_grad = grad_of(c.q_weight), k_grad = grad_of(c.k_weight);
  const auto ptr = [](const Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
  p.q_weight_partials = ptr(q_partials);
  p.k_weight_partials = ptr(k_partials);
  p.q_weight_grad = ptr(q_grad);  // the partial rows added up in a fixed order: the same bits every run
  p.k_weight_grad = ptr(k_grad);
  const cudaError_t err = rope_prologue_backward_launch(&p, &scope.dev, scope.stream);
  TORCH_CHECK(err == cudaSuccess, "rope_ops_cuda: prologue backward launch failed: ", cudaGetErrorString(err));
  const auto grad_or_none = [](const Tensor& t) { return t.defined() ? py::cast(t) : py::none(); };
  return py::make_tuple(grad_qkv, grad_or_none(q_grad), grad_or_none(k_grad));
}

template <class Platform>
void define_prologue(py::module_& m) {
  m.def("prologue", &prologue_forward<Platform>,
        "prologue(args: PrologueArgs) -> bool: CudaBackend.run_prologue; False when the kernels "
        "cannot take the call (nothing written)");
  m.def("prologue_backward", &prologue_backward<Platform>, py::arg("args"), py::arg("grad_q"),
        py::arg("grad_k"), py::arg("grad_v"),
        "prologue_backward(args, grad_q, grad_k, grad_v) -> (grad_qkv, grad_q_weight, "
        "grad_k_weight) or None when the kernels cannot take the call");
}

}  // namespace rope_torch
