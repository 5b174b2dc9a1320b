// The bindings behind attn.torch (python/attn/torch.py): scaled_dot_product_attention and
// varlen attention forward and backward on torch tensors, returning torch tensors.
//
// In: CPU tensors read in place, whatever the layout: plain tensors through their attributes
// (torch_input), others through DLPack (convert.cpp's sdpa_input: no copy when the strides are
// non-negative). Out: tensors that take over the library's storage through DLPack (to_torch),
// never through NumPy. The backward reads the forward's saved `output` and `lse` in place too
// (SdpaSaved views).
//
// The options come as one tuple in a fixed order (make_options). Dropout is Philox, keyed by
// (seed, offset) that torch.py draws from torch's generator; nothing here draws from attn's.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <optional>
#include <stdexcept>
#include <string>

#include "attn/attn.hpp"
#include "attn/varlen.hpp"
#include "convert.hpp"
#include "torch_ops.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace attn::py {
namespace {

// torch's Tensor type and the dtypes attn takes in place, looked up once by _torch_init, which
// attn/torch.py calls as it is imported (under Python's import lock: a function-local static
// calling into Python could deadlock a second thread on the static's guard while the first
// waits for the GIL). The references are kept for the life of the process.
struct TorchTypes {
  PyTypeObject* tensor = nullptr;
  PyObject *f32 = nullptr, *f64 = nullptr, *f16 = nullptr, *bf16 = nullptr, *boolean = nullptr;
};
TorchTypes g_torch;

void torch_init(nb::handle torch) {
  if (g_torch.tensor != nullptr) return;
  auto keep = [&](const char* name) {
    nb::object o = torch.attr(name);
    return o.release().ptr();
  };
  g_torch = TorchTypes{reinterpret_cast<PyTypeObject*>(keep("Tensor")), keep("float32"), keep("float64"),
                       keep("float16"), keep("bfloat16"), keep("bool")};
}

const TorchTypes& torch_types() {
  if (g_torch.tensor == nullptr) throw std::runtime_error("attn.torch: the bindings were used before _torch_init");
  return g_torch;
}

// A CPU torch.Tensor read in place through its own attributes (dtype, shape, stride, data_ptr):
// ~1 us, where DLPack (__dlpack_device__, then __dlpack__) costs ~4.5 us a tensor, which a
// decoding loop pays for every layer and token (L = 1 against 128 keys, 12 heads: the whole
// forward took ~34 us through DLPack against ~14 us for the kernel). The caller holds the tensor
// for the call, so nothing else keeps it alive; attn only reads it, so whether it requires grad
// does not matter. Everything else (subclasses, other dtypes or devices, more than 4 dims, no
// elements) goes through sdpa_input on the detached tensor, which converts or raises the error
// naming `arg`.
Input torch_input(nb::handle obj, const char* arg) {
  const TorchTypes& tt = torch_types();
  if (Py_TYPE(obj.ptr()) == tt.tensor && nb::cast<bool>(obj.attr("is_cpu"))) {
    const nb::object dt = obj.attr("dtype");
    Input in;
    DType dtype = DType::kFloat32;
    bool known = true;
    if (dt.ptr() == tt.f32) {
      in.kind = Kind::kFloat32, dtype = DType::kFloat32;
    } else if (dt.ptr() == tt.bf16) {
      in.kind = Kind::kBFloat16, dtype = DType::kBFloat16;
    } else if (dt.ptr() == tt.f16) {
      in.kind = Kind::kFloat16, dtype = DType::kFloat16;
    } else if (dt.ptr() == tt.f64) {
      in.kind = Kind::kFloat64, dtype = DType::kFloat64;
    } else if (dt.ptr() == tt.boolean) {
      in.kind = Kind::kBool, dtype = DType::kInt8;  // one byte, 0 or 1, as sdpa_input reads it
    } else {
      known = false;
    }
    const nb::tuple shape = nb::borrow<nb::tuple>(obj.attr("shape"));
    const size_t nd = nb::len(shape);
    if (known && nd <= static_cast<size_t>(kMaxDims)) {
      const nb::tuple stride = nb::borrow<nb::tuple>(obj.attr("stride")());
      Shape sizes, strides;
      int64_t numel = 1;
      for (size_t i = 0; i < nd; ++i) {
        sizes.push_back(nb::cast<int64_t>(shape[i]));
        strides.push_back(nb::cast<int64_t>(stride[i]));
        numel *= sizes[i];
      }
      if (numel > 0) {
        // The kernels never write through input views, so dropping const is safe.
        in.view = TensorView(reinterpret_cast<void*>(nb::cast<uintptr_t>(obj.attr("data_ptr")())), dtype, sizes,
                             strides);
        return in;
      }
    }
  }
  return sdpa_input(nb::hasattr(obj, "detach") ? obj.attr("detach")() : nb::borrow(obj), arg, false);
}

// The options' inputs, kept alive while the options view them.
struct OptionInputs {
  std::optional<Input> mask, slopes, sinks;
};

// attn_mask (a tensor) into opt.attn_mask, read in place: bool masks select, others add.
void set_mask(OptionInputs& keep, SdpaOptions& opt, nb::handle attn_mask) {
  keep.mask = torch_input(attn_mask, "attn_mask");
  opt.attn_mask = keep.mask->kind == Kind::kBool ? AttnMask::boolean(keep.mask->view)
                                                 : AttnMask::additive(keep.mask->view);
}

// `o`: the options tuple torch.py builds, (dropout_p, is_causal, bottom_right, scale,
// enable_gqa, window_left, window_right, softcap, alibi_slopes, sinks, seed, offset, kernel,
// num_threads, allow_fp16_bf16_reduction), the custom ops' arguments in their schema's order.
SdpaOptions make_options(OptionInputs& keep, nb::handle attn_mask, const nb::tuple& o) {
  if (nb::len(o) != 15) throw nb::type_error("attn.torch: the options tuple must have 15 entries");
  SdpaOptions opt;
  if (!attn_mask.is_none()) set_mask(keep, opt, attn_mask);
  const double dropout_p = nb::cast<double>(o[0]);
  if (!(dropout_p >= 0.0 && dropout_p <= 1.0)) {
    throw nb::value_error(("dropout_p must be in [0, 1], got " + std::to_string(dropout_p)).c_str());
  }
  opt.dropout_p = static_cast<float>(dropout_p);
  opt.dropout_rng = DropoutRng::kPhilox;
  opt.is_causal = nb::cast<bool>(o[1]);
  opt.causal_alignment = nb::cast<bool>(o[2]) ? CausalAlignment::kBottomRight : CausalAlignment::kTopLeft;
  opt.scale = nb::cast<std::optional<double>>(o[3]);
  opt.enable_gqa = nb::cast<bool>(o[4]);
  opt.window_size = {nb::cast<int64_t>(o[5]), nb::cast<int64_t>(o[6])};
  opt.softcap = nb::cast<std::optional<double>>(o[7]);
  keep.slopes = head_param_arg(o[8], "alibi_slopes");
  keep.sinks = head_param_arg(o[9], "sinks");
  if (keep.slopes) opt.alibi_slopes = keep.slopes->view;
  if (keep.sinks) opt.sinks = keep.sinks->view;
  opt.dropout_seed = nb::cast<uint64_t>(o[10]);
  opt.dropout_offset = nb::cast<uint64_t>(o[11]);
  opt.kernel = nb::cast<std::string>(o[12]);
  const int num_threads = nb::cast<int>(o[13]);
  if (num_threads < 0) {
    throw nb::value_error(("num_threads must be >= 0, got " + std::to_string(num_threads)).c_str());
  }
  opt.num_threads = num_threads;
  opt.allow_fp16_bf16_reduction = nb::cast<bool>(o[14]);
  return opt;
}

struct Qkv {
  Input q, k, v;
};
Qkv qkv(nb::handle query, nb::handle key, nb::handle value) {
  Qkv in{torch_input(query, "query"), torch_input(key, "key"), torch_input(value, "value")};
  for (const Input* x : {&in.q, &in.k, &in.v}) {
    if (x->kind == Kind::kBool) {
      throw nb::type_error("query, key and value must be float32, float64, float16 or bfloat16 "
                           "tensors, got bool");
    }
  }
  return in;
}

nb::object maybe_torch(Tensor&& t) { return t.defined() ? to_torch(std::move(t)) : nb::none(); }

// The forward with the GIL released (other Python threads run meanwhile).
SdpaResult run_sdpa(const Qkv& in, const SdpaOptions& opt) {
  nb::gil_scoped_release release;
  return scaled_dot_product_attention(in.q.view, in.k.view, in.v.view, opt);
}

// (output, lse or None, weights or None, output_residual or None). need_lse: the backward reads
// it; a call with no backward to come may leave it out.
nb::tuple sdpa_forward(nb::handle query, nb::handle key, nb::handle value, nb::handle attn_mask,
                       const nb::tuple& options, bool need_weights, bool need_residual, bool need_lse) {
  const Qkv in = qkv(query, key, value);
  OptionInputs keep;
  SdpaOptions opt = make_options(keep, attn_mask, options);
  opt.need_lse = need_lse;
  opt.need_weights = need_weights;
  opt.need_output_residual = need_residual;
  SdpaResult r = run_sdpa(in, opt);
  return nb::make_tuple(to_torch(std::move(r.output)), maybe_torch(std::move(r.lse)),
                        maybe_torch(std::move(r.attn_weights)), maybe_torch(std::move(r.output_residual)));
}

// (grad_query, grad_key, grad_value, grad_sinks or None, grad_attn_mask or None)
nb::tuple sdpa_backward(nb::handle grad_output, nb::handle query, nb::handle key, nb::handle value,
                        nb::handle output, nb::handle lse, nb::handle residual,
                        nb::handle attn_mask, const nb::tuple& options, bool need_mask_grad) {
  const Qkv in = qkv(query, key, value);
  const Input dout = torch_input(grad_output, "grad_output");
  OptionInputs keep;
  SdpaOptions opt = make_options(keep, attn_mask, options);
  opt.need_attn_mask_grad = need_mask_grad;
  const Input saved_out = torch_input(output, "output"), saved_lse = torch_input(lse, "lse");
  std::optional<Input> saved_res;
  if (!residual.is_none()) saved_res = torch_input(residual, "output_residual");
  SdpaGrads g;
  {
    nb::gil_scoped_release release;
    g = scaled_dot_product_attention_backward(
        dout.view, in.q.view, in.k.view, in.v.view,
        SdpaSaved(saved_out.view, saved_lse.view, {}, saved_res ? saved_res->view : TensorView()), opt);
  }
  return nb::make_tuple(to_torch(std::move(g.grad_query)), to_torch(std::move(g.grad_key)),
                        to_torch(std::move(g.grad_value)), maybe_torch(std::move(g.grad_sinks)),
                        maybe_torch(std::move(g.grad_attn_mask)));
}

// (output, lse)
nb::tuple varlen_forward(nb::handle query, nb::handle key, nb::handle value, nb::handle cu_seq_q,
                         nb::handle cu_seq_k, int64_t max_q, int64_t max_k,
                         const nb::tuple& options) {
  const Qkv in = qkv(query, key, value);
  const Tensor cq = cu_seq_input(cu_seq_q, "cu_seq_q"), ck = cu_seq_input(cu_seq_k, "cu_seq_k");
  OptionInputs keep;
  SdpaOptions opt = make_options(keep, nb::none(), options);
  opt.need_lse = true;
  SdpaResult r;
  {
    nb::gil_scoped_release release;
    r = varlen_attn(in.q.view, in.k.view, in.v.view, cq, ck, max_q, max_k, opt);
  }
  return nb::make_tuple(to_torch(std::move(r.output)), to_torch(std::move(r.lse)));
}

nb::tuple varlen_backward(nb::handle grad_output, nb::handle query, nb::handle key,
                          nb::handle value, nb::handle output, nb::handle lse,
                          nb::handle cu_seq_q, nb::handle cu_seq_k, int64_t max_q, int64_t max_k,
                          const nb::tuple& options) {
  const Qkv in = qkv(query, key, value);
  const Input dout = torch_input(grad_output, "grad_output");
  const Tensor cq = cu_seq_input(cu_seq_q, "cu_seq_q"), ck = cu_seq_input(cu_seq_k, "cu_seq_k");
  OptionInputs keep;
  const SdpaOptions opt = make_options(keep, nb::none(), options);
  const Input saved_out = torch_input(output, "output"), saved_lse = torch_input(lse, "lse");
  SdpaGrads g;
  {
    nb::gil_scoped_release release;
    g = varlen_attn_backward(dout.view, in.q.view, in.k.view, in.v.view, cq, ck, max_q, max_k,
                             SdpaSaved(saved_out.view, saved_lse.view), opt);
  }
  return nb::make_tuple(to_torch(std::move(g.grad_query)), to_torch(std::move(g.grad_key)),
                        to_torch(std::move(g.grad_value)), maybe_torch(std::move(g.grad_sinks)));
}

// sdpa_plain's calls, for attn.torch.call_counts(): counted here, where the kernel runs, so the
// fast path takes no Python lock.
std::atomic<int64_t> plain_calls{0};

// The common eager call in one step, for attn.torch's fast path (torch.py's _plain): plain CPU
// tensors of one float dtype, a mask that is None or a plain CPU bool/float tensor not requiring
// grad, no dropout, nothing saved for a backward. Returns the output, or None when the call is
// not of that kind (the general path then checks, falls back or raises, naming the argument).
// Cold, after a model's other ops have evicted the caches, the general path's Python layers
// cost ~50 us a call (L = 1, 40 keys, 12 heads, 1 thread: ~180 us through them, ~90 us through
// this, PyTorch's own 72-75 us).
nb::object sdpa_plain(nb::handle query, nb::handle key, nb::handle value, nb::handle attn_mask, bool is_causal,
                      std::optional<double> scale, bool enable_gqa, int num_threads) {
  const TorchTypes& tt = torch_types();
  auto plain = [&](nb::handle t) {
    return Py_TYPE(t.ptr()) == tt.tensor && nb::cast<bool>(t.attr("is_cpu")) && !nb::cast<bool>(t.attr("is_nested"));
  };
  if (!plain(query) || !plain(key) || !plain(value) || num_threads < 0) return nb::none();
  const nb::object dt = query.attr("dtype");
  if (dt.ptr() != tt.f32 && dt.ptr() != tt.bf16 && dt.ptr() != tt.f16 && dt.ptr() != tt.f64) return nb::none();
  if (!key.attr("dtype").is(dt) || !value.attr("dtype").is(dt)) return nb::none();
  OptionInputs keep;
  SdpaOptions opt;
  if (!attn_mask.is_none()) {
    if (!plain(attn_mask) || nb::cast<bool>(attn_mask.attr("requires_grad"))) return nb::none();
    const nb::object mdt = attn_mask.attr("dtype");
    if (mdt.ptr() != tt.boolean && !nb::cast<bool>(mdt.attr("is_floating_point"))) return nb::none();
    set_mask(keep, opt, attn_mask);
  }
  const Qkv in = qkv(query, key, value);
  opt.is_causal = is_causal;
  opt.scale = scale;
  opt.enable_gqa = enable_gqa;
  opt.num_threads = num_threads;
  SdpaResult r = run_sdpa(in, opt);
  plain_calls.fetch_add(1, std::memory_order_relaxed);
  return to_torch(std::move(r.output));
}

// sdpa_plain's calls so far; reset: set them back to 0 after reading.
int64_t plain_count(bool reset) { return reset ? plain_calls.exchange(0) : plain_calls.load(); }

// For the zero-copy test: each argument's address as the kernels would read it (torch_input),
// and whether it had to be copied to get there.
nb::list input_addresses(nb::args tensors) {
  nb::list out;
  for (nb::handle t : tensors) {
    const Input in = torch_input(t, "tensor");
    out.append(nb::make_tuple(reinterpret_cast<uintptr_t>(in.view.raw_data()), in.copy.defined()));
  }
  return out;
}

}  // namespace

void bind_torch_ops(nb::module_& m) {
  m.def("_torch_init", &torch_init, "torch"_a, "Looks up torch's Tensor type and dtypes (attn.torch calls it once).");
  m.def("_input_addresses", &input_addresses,
        "(address the kernels read, copied?) for each tensor argument: the zero-copy test's probe.");
  m.def("_torch_sdpa_forward", &sdpa_forward, "query"_a, "key"_a, "value"_a, "attn_mask"_a.none(),
        "options"_a, "need_weights"_a, "need_residual"_a, "need_lse"_a = true,
        "attn.torch's forward: (output, lse or None, weights or None, output_residual or None) as torch "
        "tensors.");
  m.def("_torch_sdpa_plain", &sdpa_plain, "query"_a, "key"_a, "value"_a, "attn_mask"_a.none(), "is_causal"_a,
        "scale"_a.none(), "enable_gqa"_a, "num_threads"_a,
        "attn.torch's fast path: the output of a plain eager call, or None for the general path.");
  m.def("_torch_sdpa_plain_count", &plain_count, "reset"_a = false,
        "How many calls _torch_sdpa_plain ran (and set the count to 0 when reset).");
  m.def("_torch_sdpa_backward", &sdpa_backward, "grad_output"_a, "query"_a, "key"_a, "value"_a,
        "output"_a, "lse"_a, "residual"_a.none(), "attn_mask"_a.none(), "options"_a,
        "need_mask_grad"_a = false,
        "attn.torch's backward: (grad_query, grad_key, grad_value, grad_sinks or None, grad_attn_mask "
        "or None).");
  m.def("_torch_varlen_forward", &varlen_forward, "query"_a, "key"_a, "value"_a, "cu_seq_q"_a,
        "cu_seq_k"_a, "max_q"_a, "max_k"_a, "options"_a,
        "attn.torch's varlen forward: (output, lse) as torch tensors.");
  m.def("_torch_varlen_backward", &varlen_backward, "grad_output"_a, "query"_a, "key"_a,
        "value"_a, "output"_a, "lse"_a, "cu_seq_q"_a, "cu_seq_k"_a, "max_q"_a, "max_k"_a,
        "options"_a,
        "attn.torch's varlen backward: (grad_query, grad_key, grad_value, grad_sinks or None).");
}

}  // namespace attn::py
