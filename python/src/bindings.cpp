// The attn._attn extension module: scaled_dot_product_attention, the nn modules, the generator
// and safetensors I/O, with PyTorch's names and argument names. Docstrings live here; the type
// stubs are python/attn/__init__.pyi.
//
// Threads: the GIL is released around every kernel. attn's default generator (torch's global
// generator) is shared state, so every call that may draw from it (constructors, randn, and
// forwards with dropout) holds `rng_mutex` while drawing; the mutex is always taken after
// the GIL is released (or while holding it without releasing), so the two cannot deadlock.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <mutex>
#include <optional>

#include "attn/attn.hpp"
#include "convert.hpp"
#include "torch_ops.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace attn::py {
namespace {

std::mutex rng_mutex;

PyObject* format_error_type = nullptr;

// Runs f() without the GIL; holds the generator lock too when `draws` (f uses the generator).
template <typename F>
auto without_gil(bool draws, F&& f) {
  nb::gil_scoped_release release;
  std::unique_lock<std::mutex> lock(rng_mutex, std::defer_lock);
  if (draws) lock.lock();
  return f();
}

std::optional<Input> optional_input(const nb::handle& obj, const char* arg) {
  if (obj.is_none()) return std::nullopt;
  return float_input(obj, arg);
}

// ---- scaled_dot_product_attention -----------------------------------------------------------

// window_size: a pair (left, right) of Python ints; the values are checked by the library
// (below -1: ValueError).
WindowSize window_arg(nb::handle obj) {
  const auto bad = [&] {
    return nb::type_error(("window_size: expected a pair of ints (left, right), -1 = unbounded, got " +
                           nb::cast<std::string>(nb::repr(obj))).c_str());
  };
  if (!nb::isinstance<nb::tuple>(obj) && !nb::isinstance<nb::list>(obj)) throw bad();
  if (nb::len(obj) != 2) throw bad();
  WindowSize w;
  if (!nb::try_cast(obj[0], w.left) || !nb::try_cast(obj[1], w.right)) throw bad();
  return w;
}

// The binding behind attn.scaled_dot_product_attention (attn/__init__.py), in the inputs' dtype.
// `bf16_bits`: which arguments are bfloat16 bits in a uint16 array (bit 0 query, 1 key, 2 value,
// 3 attn_mask), as __init__.py passes ml_dtypes.bfloat16 arrays. A bfloat16 result comes back as
// its uint16 bits (NumPy has no bfloat16) for __init__.py to view as ml_dtypes.bfloat16.
// The variants (window_size, softcap, alibi_slopes, sinks) are SdpaOptions' last block; they
// reach every route below, the float64 reference included.
nb::object sdpa(nb::handle query, nb::handle key, nb::handle value, nb::handle attn_mask,
                double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa,
                std::optional<std::string> kernel, int bf16_bits, nb::handle window_size,
                std::optional<double> softcap, nb::handle alibi_slopes, nb::handle sinks) {
  const Input q = sdpa_input(query, "query", bf16_bits & 1), k = sdpa_input(key, "key", bf16_bits & 2),
              v = sdpa_input(value, "value", bf16_bits & 4);
  for (const Input* in : {&q, &k, &v}) {
    if (in->kind == Kind::kBool) {
      throw nb::type_error("query, key and value must be float32, float64, float16 or bfloat16 "
                           "arrays, got bool");
    }
  }
  std::optional<Input> mask;
  if (!attn_mask.is_none()) mask = sdpa_input(attn_mask, "attn_mask", bf16_bits & 8);
  SdpaOptions opt;
  if (mask) opt.attn_mask = mask->kind == Kind::kBool ? AttnMask::boolean(mask->view) : AttnMask::additive(mask->view);
  if (!(dropout_p >= 0.0 && dropout_p <= 1.0)) {
    throw nb::value_error(("dropout_p must be in [0, 1], got " + std::to_string(dropout_p)).c_str());
  }
  opt.dropout_p = static_cast<float>(dropout_p);
  opt.is_causal = is_causal;
  opt.scale = scale;
  opt.enable_gqa = enable_gqa;
  opt.kernel = kernel.value_or("");
  opt.window_size = window_arg(window_size);
  opt.softcap = softcap;
  const std::optional<Input> slopes = head_param_arg(alibi_slopes, "alibi_slopes");
  const std::optional<Input> sink_logits = head_param_arg(sinks, "sinks");
  if (slopes) opt.alibi_slopes = slopes->view;
  if (sink_logits) opt.sinks = sink_logits->view;
  const bool draws = opt.dropout_p > 0.0f;
  const bool f64 = q.kind == Kind::kFloat64 && k.kind == Kind::kFloat64 && v.kind == Kind::kFloat64;
  if (f64 && draws && (opt.kernel.empty() || opt.kernel == "reference")) {
    // float64 with PyTorch's dropout stream, which the library's float64 path refuses (its
    // reference draws the mask from a copy of the generator, so every call would drop the same
    // weights): run that reference and draw the same mask on the real generator to advance it
    // as torch would. The inputs are read as float64, never rounded.
    reference::SdpaResultF64 r = without_gil(draws, [&] {
      reference::SdpaResultF64 res = reference::scaled_dot_product_attention_f64(q.view, k.view, v.view, opt);
      if (opt.dropout_p < 1.0f) {  // p = 1 drops everything without drawing (F.dropout)
        Tensor noise = Tensor::empty(res.weights_shape);
        bernoulli_(noise, 1.0 - static_cast<double>(opt.dropout_p));
      }
      return res;
    });
    return to_numpy(std::move(r.output), r.output_shape);
  }
  // float32, bfloat16 and float16 on the chosen kernel (output in the input dtype); float64 on
  // the reference in float64.
  SdpaResult r = without_gil(draws, [&] { return scaled_dot_product_attention(q.view, k.view, v.view, opt); });
  return to_numpy(std::move(r.output));
}

nb::list sdpa_kernel_list() {
  nb::list out;
  for (const SdpaKernelInfo& info : sdpa_kernels()) {
    nb::dict d;
    d["name"] = info.name;
    d["family"] = info.family == SdpaBackend::kReference ? "reference" : "fused";
    nb::list dtypes;
    for (DType t : info.dtypes) dtypes.append(std::string(attn::dtype_name(t)));
    d["dtypes"] = dtypes;
    d["runs_on_this_cpu"] = info.runs_on_this_cpu;
    d["reason_if_not"] = info.reason_if_not;
    d["reduced_float32"] = info.reduced_float32;
    out.append(d);
  }
  return out;
}

// ---- varlen_attn ------------------------------------------------------------------------------

// query, key and value in their dtypes (bf16_bits: bit 0 query, 1 key, 2 value hold bfloat16
// bits); bool arrays raise TypeError. (What sdpa above reads inline: it can share this.)
struct QkvInputs {
  Input q, k, v;
};
QkvInputs qkv_inputs(nb::handle query, nb::handle key, nb::handle value, int bf16_bits) {
  QkvInputs in{sdpa_input(query, "query", bf16_bits & 1), sdpa_input(key, "key", bf16_bits & 2),
               sdpa_input(value, "value", bf16_bits & 4)};
  if (in.q.kind == Kind::kBool || in.k.kind == Kind::kBool || in.v.kind == Kind::kBool) {
    throw nb::type_error("query, key and value must be float32, float64, float16 or bfloat16 "
                         "arrays, got bool");
  }
  return in;
}

// The binding behind attn.varlen_attn (attn/__init__.py): output, or (output, lse) with need_lse.
// bf16_bits as for _scaled_dot_product_attention (bit 0 query, 1 key, 2 value). Dropout is
// Philox's, keyed by (dropout_seed, dropout_offset): it draws nothing from the generator.
nb::object varlen(nb::handle query, nb::handle key, nb::handle value, nb::handle cu_seq_q,
                  nb::handle cu_seq_k, int64_t max_q, int64_t max_k, bool is_causal,
                  const std::string& causal_alignment, std::optional<double> scale, bool enable_gqa,
                  std::pair<int64_t, int64_t> window_size, std::optional<double> softcap,
                  nb::handle alibi_slopes, nb::handle sinks, double dropout_p, uint64_t dropout_seed,
                  uint64_t dropout_offset, bool need_lse, std::optional<std::string> kernel,
                  int num_threads, int bf16_bits) {
  const QkvInputs in = qkv_inputs(query, key, value, bf16_bits);
  const Input &q = in.q, &k = in.k, &v = in.v;
  const Tensor cq = cu_seq_input(cu_seq_q, "cu_seq_q"), ck = cu_seq_input(cu_seq_k, "cu_seq_k");
  const std::optional<Input> slopes = head_param_arg(alibi_slopes, "alibi_slopes");
  const std::optional<Input> sink = head_param_arg(sinks, "sinks");
  SdpaOptions opt;
  opt.is_causal = is_causal;
  if (causal_alignment == "bottom_right") {
    opt.causal_alignment = CausalAlignment::kBottomRight;
  } else if (causal_alignment != "top_left") {
    throw nb::value_error(("causal_alignment must be 'top_left' or 'bottom_right', got '" +
                           causal_alignment + "'").c_str());
  }
  opt.scale = scale;
  opt.enable_gqa = enable_gqa;
  opt.window_size = {window_size.first, window_size.second};
  opt.softcap = softcap;
  if (slopes) opt.alibi_slopes = slopes->view;
  if (sink) opt.sinks = sink->view;
  if (!(dropout_p >= 0.0 && dropout_p <= 1.0)) {
    throw nb::value_error(("dropout_p must be in [0, 1], got " + std::to_string(dropout_p)).c_str());
  }
  opt.dropout_p = static_cast<float>(dropout_p);
  opt.dropout_rng = DropoutRng::kPhilox;
  opt.dropout_seed = dropout_seed;
  opt.dropout_offset = dropout_offset;
  opt.need_lse = need_lse;
  opt.kernel = kernel.value_or("");
  if (num_threads < 0) {
    throw nb::value_error(("num_threads must be >= 0 (0: OpenMP's default), got " +
                           std::to_string(num_threads)).c_str());
  }
  opt.num_threads = num_threads;
  SdpaResult r = without_gil(false, [&] {
    return varlen_attn(q.view, k.view, v.view, cq, ck, max_q, max_k, opt);
  });
  if (!need_lse) return to_numpy(std::move(r.output));
  return nb::make_tuple(to_numpy(std::move(r.output)), to_numpy(std::move(r.lse)));
}

// ---- modules ----------------------------------------------------------------------------------

nb::dict state_dict(nn::Module& m) {
  nb::dict d;
  for (auto& [name, t] : m.state_dict()) d[name.c_str()] = to_numpy(Tensor(*t));
  return d;
}

void load_state_dict(nn::Module& m, nb::handle sd, bool strict) {
  if (!nb::isinstance<nb::dict>(sd) && !nb::hasattr(sd, "items")) {
    throw nb::type_error("state_dict: expected a mapping of names to arrays");
  }
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (nb::handle item : sd.attr("items")()) {
    const std::string name = nb::cast<std::string>(item[0]);
    const Input in = float_input(item[1], ("state_dict['" + name + "']").c_str());
    tensors.emplace_back(name, in.view.contiguous());
  }
  nn::load_state_dict(m, tensors, strict);
}

template <typename M>
nb::object forward_x(const M& m, nb::handle x) {
  const Input in = float_input(x, "x");
  return to_numpy(without_gil(m.training(), [&] { return m.forward(in.view); }));
}

}  // namespace
}  // namespace attn::py

NB_MODULE(_attn, m) {
  using namespace attn;
  using namespace attn::py;
  m.doc() = "attn: transformer attention with PyTorch's semantics (C++ core).";

  format_error_type = PyErr_NewExceptionWithDoc(
      "attn.FormatError", "A malformed file (e.g. a safetensors header); a ValueError.",
      PyExc_ValueError, nullptr);
  m.attr("FormatError") = nb::handle(format_error_type);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const FormatError& e) {
      PyErr_SetString(format_error_type, e.what());
    } catch (const ShapeError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const attn::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const DTypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    } catch (const attn::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what());
    } catch (const IoError& e) {
      PyErr_SetString(PyExc_OSError, e.what());
    } catch (const Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  m.def("_scaled_dot_product_attention", &sdpa, "query"_a, "key"_a, "value"_a,
        "attn_mask"_a = nb::none(), "dropout_p"_a = 0.0, "is_causal"_a = false,
        "scale"_a = nb::none(), "enable_gqa"_a = false, "kernel"_a = nb::none(), "bf16_bits"_a = 0,
        "window_size"_a = nb::make_tuple(-1, -1), "softcap"_a = nb::none(),
        "alibi_slopes"_a = nb::none(), "sinks"_a = nb::none(),
        R"(The binding behind attn.scaled_dot_product_attention (see its docstring). bf16_bits
marks arguments holding bfloat16 bits as uint16 (bit 0 query, 1 key, 2 value, 3 attn_mask); a
bfloat16 result is returned as its uint16 bits.)");
  m.def("sdpa_kernels", &sdpa_kernel_list,
        R"(Every kernel behind scaled_dot_product_attention, highest priority first, as dicts:
name (what kernel= takes), family ("reference" or "fused"), dtypes (the element types it
computes, e.g. ["float32", "bfloat16", "float16"]), runs_on_this_cpu, and reason_if_not (the CPU
features this machine lacks; "" when it runs), and reduced_float32 (it also takes float32, at
set_float32_matmul_precision("high") or "medium" only).)");
  m.def(
      "set_float32_matmul_precision",
      [](const std::string& precision) { attn::set_float32_matmul_precision(precision); }, "precision"_a,
      R"(torch.set_float32_matmul_precision for attn's float32 attention: "highest" (float32
multiply-adds, the default), "high" (bf16x3: three bf16 terms per value, six cross products) or
"medium" (plain bf16 products). "high" and "medium" run on AMX-BF16 tiles where the CPU has them;
elsewhere float32 computes at "highest". ValueError for any other string.)");
  m.def(
      "get_float32_matmul_precision",
      [] { return std::string(attn::float32_matmul_precision_name(attn::get_float32_matmul_precision())); },
      R"(The level set_float32_matmul_precision set: "highest", "high" or "medium".)");

  m.def("_varlen_attn", &varlen, "query"_a, "key"_a, "value"_a, "cu_seq_q"_a, "cu_seq_k"_a,
        "max_q"_a, "max_k"_a, "is_causal"_a = false, "causal_alignment"_a = "top_left",
        "scale"_a = nb::none(), "enable_gqa"_a = false,
        "window_size"_a = std::pair<int64_t, int64_t>{-1, -1}, "softcap"_a = nb::none(),
        "alibi_slopes"_a = nb::none(), "sinks"_a = nb::none(), "dropout_p"_a = 0.0,
        "dropout_seed"_a = 0, "dropout_offset"_a = 0, "need_lse"_a = false,
        "kernel"_a = nb::none(), "num_threads"_a = 0, "bf16_bits"_a = 0,
        R"(The binding behind attn.varlen_attn (see its docstring). bf16_bits marks arguments
holding bfloat16 bits as uint16 (bit 0 query, 1 key, 2 value); a bfloat16 output is returned as
its uint16 bits.)");

  bind_torch_ops(m);

  m.def("cache_stats", [] {
    const CacheStats c = cache_stats();
    nb::dict d;
    d["limit_bytes"] = c.limit_bytes;
    d["cached_bytes"] = c.cached_bytes;
    d["cached_blocks"] = c.cached_blocks;
    d["hits"] = c.hits;
    d["misses"] = c.misses;
    return d;
  }, R"(The reuse cache of freed tensor blocks of 1 MiB or more (attn/memory.hpp), as a dict:
limit_bytes, cached_bytes, cached_blocks, and the hits and misses of large allocations so far.)");
  m.def("set_cache_limit", [](int64_t bytes) {
    if (bytes < 0) throw ValueError("set_cache_limit: bytes must be >= 0, got " + std::to_string(bytes));
    set_cache_limit(static_cast<std::size_t>(bytes));
  }, "bytes"_a, "How many bytes of freed tensor blocks may be kept for reuse (0 turns the cache off); frees the oldest beyond it.");
  m.def("empty_cache", [] { empty_cache(); },
        "Frees every kept tensor block (torch.cuda.empty_cache()'s name); the limit stays.");

  m.def("manual_seed", [](nb::handle seed) {
    // As torch.manual_seed: int(seed), in [-2^63, 2^64 - 1], a negative one taken modulo 2^64
    // (manual_seed(-1) seeds with 2^64 - 1, as PyTorch's does); outside that range ValueError.
    const nb::object n = nb::steal(PyNumber_Long(seed.ptr()));
    if (!n.is_valid()) throw nb::python_error();
    int overflow = 0;
    const long long s = PyLong_AsLongLongAndOverflow(n.ptr(), &overflow);
    uint64_t value = static_cast<uint64_t>(s);
    if (overflow > 0) {
      value = PyLong_AsUnsignedLongLong(n.ptr());
      if (PyErr_Occurred() != nullptr) PyErr_Clear(), overflow = -1;
    }
    if (overflow < 0) {
      throw nb::value_error(("manual_seed: seed must be in [-2**63, 2**64 - 1] (torch.manual_seed's range), got " +
                             nb::cast<std::string>(nb::str(n))).c_str());
    }
    std::lock_guard<std::mutex> lock(rng_mutex);
    manual_seed(value);
  }, "seed"_a, "torch.manual_seed: seeds attn's default generator (PyTorch's CPU generator, bit for bit); "
               "int(seed) in [-2**63, 2**64 - 1], a negative seed taken modulo 2**64 as PyTorch does.");
  m.def("rand", [](std::vector<int64_t> size) {
    std::lock_guard<std::mutex> lock(rng_mutex);
    return to_numpy(rand(Shape(std::span<const int64_t>(size))));
  }, "size"_a, "torch.rand(size) from attn's default generator, as float32 NumPy array.");
  m.def("randn", [](std::vector<int64_t> size) {
    std::lock_guard<std::mutex> lock(rng_mutex);
    return to_numpy(randn(Shape(std::span<const int64_t>(size))));
  }, "size"_a, "torch.randn(size) from attn's default generator, as float32 NumPy array.");

  m.def("load_file", [](const std::string& path) {
    Safetensors st;
    {
      nb::gil_scoped_release release;
      st = load_safetensors(path);
    }
    nb::dict d;
    for (auto& [name, t] : st.tensors) d[name.c_str()] = to_numpy(std::move(t));
    return d;
  }, "path"_a, R"(Reads a safetensors file into {name: float32 array} (F32; F64/F16/BF16 are
converted). Raises attn.FormatError (a ValueError) naming the file and the problem, OSError if
it cannot be read.)");
  m.def("load_metadata", [](const std::string& path) { return load_safetensors(path).metadata; },
        "path"_a, "The \"__metadata__\" of a safetensors file, as a dict of strings.");
  m.def("save_file", [](nb::dict tensors, const std::string& path,
                        std::optional<std::map<std::string, std::string>> metadata) {
    std::vector<Input> inputs;
    NamedViews views;
    inputs.reserve(tensors.size());
    for (auto [k, v] : tensors) {
      const std::string name = nb::cast<std::string>(k);
      inputs.push_back(float_input(v, ("tensors['" + name + "']").c_str()));
      views.emplace_back(name, inputs.back().view);
    }
    nb::gil_scoped_release release;
    save_safetensors(path, views, metadata.value_or(std::map<std::string, std::string>{}));
  }, "tensors"_a, "path"_a, "metadata"_a = nb::none(),
        R"(Writes {name: array} to a safetensors file as F32 (safetensors.numpy.save_file), atomically:
a temporary file in the same directory, then renamed.)");

  // Module base: what torch.nn.Module offers that attn's modules have.
  nb::class_<nn::Module>(m, "Module", "Base of attn's modules (torch.nn.Module's subset).")
      .def("train", [](nn::Module& self, bool mode) -> nn::Module& { self.train(mode); return self; },
           "mode"_a = true, nb::rv_policy::reference, "Training mode on or off (dropout); returns self.")
      .def("eval", [](nn::Module& self) -> nn::Module& { self.eval(); return self; },
           nb::rv_policy::reference, "eval(): train(False); returns self.")
      .def_prop_ro("training", &nn::Module::training)
      .def("state_dict", &state_dict,
           "{name: float32 array} (copies) with PyTorch's state_dict names and order.")
      .def("load_state_dict", &load_state_dict, "state_dict"_a, "strict"_a = true,
           "Copies arrays into parameters and buffers; shapes must match (ValueError), strict: "
           "missing or unexpected names raise ValueError. Nothing changes when it raises.")
      .def("named_parameters", [](nn::Module& self) {
        std::vector<std::pair<std::string, nb::object>> out;
        for (auto& [name, t] : self.named_parameters()) out.emplace_back(name, to_numpy(Tensor(*t)));
        return out;
      }, "[(name, float32 array)] of trainable tensors (copies), in registration order.")
      .def("num_parameters", &nn::Module::num_parameters)
      .def("save_safetensors", [](nn::Module& self, const std::string& path,
                                  std::optional<std::map<std::string, std::string>> metadata) {
        nb::gil_scoped_release release;
        nn::save_safetensors(self, path, metadata.value_or(std::map<std::string, std::string>{}));
      }, "path"_a, "metadata"_a = nb::none(), "state_dict() to a safetensors file (atomic write).")
      .def("load_safetensors", [](nn::Module& self, const std::string& path, bool strict) {
        nb::gil_scoped_release release;
        nn::load_safetensors(self, path, strict);
      }, "path"_a, "strict"_a = true,
           "Loads a safetensors state_dict (e.g. saved from PyTorch) into this module.");

  // Every constructor may draw from the default generator: each holds rng_mutex.
  nb::class_<nn::Linear, nn::Module>(m, "Linear", "torch.nn.Linear: y = x @ weight.T + bias.")
      .def("__init__", [](nn::Linear* self, int64_t in, int64_t out, bool bias) {
        std::lock_guard<std::mutex> lock(rng_mutex);
        new (self) nn::Linear(in, out, bias);
      }, "in_features"_a, "out_features"_a, "bias"_a = true)
      .def("forward", &forward_x<nn::Linear>, "x"_a)
      .def("__call__", &forward_x<nn::Linear>, "x"_a)
      .def_ro("in_features", &nn::Linear::in_features)
      .def_ro("out_features", &nn::Linear::out_features);

  nb::class_<nn::Dropout, nn::Module>(m, "Dropout", "torch.nn.Dropout (draws from the default generator).")
      .def("__init__", [](nn::Dropout* self, float p) { new (self) nn::Dropout(p); }, "p"_a = 0.5f)
      .def("forward", &forward_x<nn::Dropout>, "x"_a)
      .def("__call__", &forward_x<nn::Dropout>, "x"_a)
      .def_ro("p", &nn::Dropout::p);

  auto embed = [](const nn::Embedding& self, nb::handle ids) {
    Shape shape;
    const std::vector<int64_t> v = int_input(ids, "input", shape);
    nb::gil_scoped_release release;
    return self.forward(v, shape);
  };
  auto embed_np = [embed](const nn::Embedding& self, nb::handle ids) { return to_numpy(embed(self, ids)); };
  nb::class_<nn::Embedding, nn::Module>(m, "Embedding", "torch.nn.Embedding: rows of weight for integer ids.")
      .def("__init__", [](nn::Embedding* self, int64_t num, int64_t dim) {
        std::lock_guard<std::mutex> lock(rng_mutex);
        new (self) nn::Embedding(num, dim);
      }, "num_embeddings"_a, "embedding_dim"_a)
      .def("forward", embed_np, "input"_a)
      .def("__call__", embed_np, "input"_a)
      .def_ro("num_embeddings", &nn::Embedding::num_embeddings)
      .def_ro("embedding_dim", &nn::Embedding::embedding_dim);

  nb::class_<nn::SelfAttentionV1, nn::Module>(m, "SelfAttentionV1",
      "The chapter's SelfAttention_v1 (section 3.4.1): torch.rand weights, x @ W.")
      .def("__init__", [](nn::SelfAttentionV1* self, int64_t d_in, int64_t d_out) {
        std::lock_guard<std::mutex> lock(rng_mutex);
        new (self) nn::SelfAttentionV1(d_in, d_out);
      }, "d_in"_a, "d_out"_a)
      .def("forward", &forward_x<nn::SelfAttentionV1>, "x"_a)
      .def("__call__", &forward_x<nn::SelfAttentionV1>, "x"_a);

  nb::class_<nn::SelfAttentionV2, nn::Module>(m, "SelfAttentionV2",
      "The chapter's SelfAttention_v2 (section 3.4.2): nn.Linear projections.")
      .def("__init__", [](nn::SelfAttentionV2* self, int64_t d_in, int64_t d_out, bool qkv_bias) {
        std::lock_guard<std::mutex> lock(rng_mutex);
        new (self) nn::SelfAttentionV2(d_in, d_out, qkv_bias);
      }, "d_in"_a, "d_out"_a, "qkv_bias"_a = false)
      .def("forward", &forward_x<nn::SelfAttentionV2>, "x"_a)
      .def("__call__", &forward_x<nn::SelfAttentionV2>, "x"_a);

  nb::class_<nn::CausalAttention, nn::Module>(m, "CausalAttention",
      "The chapter's CausalAttention (section 3.5): (b, T, d_in) -> (b, T, d_out).")
      .def("__init__", [](nn::CausalAttention* self, int64_t d_in, int64_t d_out, int64_t ctx,
                          float dropout, bool qkv_bias) {
        std::lock_guard<std::mutex> lock(rng_mutex);
        new (self) nn::CausalAttention(d_in, d_out, ctx, dropout, qkv_bias);
      }, "d_in"_a, "d_out"_a, "context_length"_a, "dropout"_a, "qkv_bias"_a = false)
      .def("forward", &forward_x<nn::CausalAttention>, "x"_a)
      .def("__call__", &forward_x<nn::CausalAttention>, "x"_a);

  nb::class_<nn::MultiHeadAttentionWrapper, nn::Module>(m, "MultiHeadAttentionWrapper",
      "The chapter's MultiHeadAttentionWrapper (section 3.6.1): heads concatenated.")
      .def("__init__", [](nn::MultiHeadAttentionWrapper* self, int64_t d_in, int64_t d_out,
                          int64_t ctx, float dropout, int64_t num_heads, bool qkv_bias) {
        std::lock_guard<std::mutex> lock(rng_mutex);
        new (self) nn::MultiHeadAttentionWrapper(d_in, d_out, ctx, dropout, num_heads, qkv_bias);
      }, "d_in"_a, "d_out"_a, "context_length"_a, "dropout"_a, "num_heads"_a, "qkv_bias"_a = false)
      .def("forward", &forward_x<nn::MultiHeadAttentionWrapper>, "x"_a)
      .def("__call__", &forward_x<nn::MultiHeadAttentionWrapper>, "x"_a);

  nb::class_<nn::MultiHeadAttention, nn::Module>(m, "MultiHeadAttention",
      "The chapter's MultiHeadAttention (section 3.6.2): split heads, causal, out_proj.")
      .def("__init__", [](nn::MultiHeadAttention* self, int64_t d_in, int64_t d_out, int64_t ctx,
                          float dropout, int64_t num_heads, bool qkv_bias) {
        std::lock_guard<std::mutex> lock(rng_mutex);
        new (self) nn::MultiHeadAttention(d_in, d_out, ctx, dropout, num_heads, qkv_bias);
      }, "d_in"_a, "d_out"_a, "context_length"_a, "dropout"_a, "num_heads"_a, "qkv_bias"_a = false)
      .def("forward", &forward_x<nn::MultiHeadAttention>, "x"_a)
      .def("__call__", &forward_x<nn::MultiHeadAttention>, "x"_a);

  auto mha_forward = [](const nn::MultiheadAttention& self, nb::handle query, nb::handle key,
                        nb::handle value, nb::handle key_padding_mask, bool need_weights,
                        nb::handle attn_mask, bool average_attn_weights, bool is_causal) {
    const Input q = float_input(query, "query"), k = float_input(key, "key"), v = float_input(value, "value");
    const std::optional<Input> kpm = optional_input(key_padding_mask, "key_padding_mask");
    const std::optional<Input> am = optional_input(attn_mask, "attn_mask");
    nn::MultiheadAttention::Result r = without_gil(self.training() && self.dropout > 0.0f, [&] {
      return self.forward(q.view, k.view, v.view, kpm ? kpm->view : TensorView{}, need_weights,
                          am ? am->view : TensorView{}, average_attn_weights, is_causal,
                          !kpm || kpm->kind == Kind::kBool, !am || am->kind == Kind::kBool);
    });
    nb::object w = r.attn_weights.defined() ? to_numpy(std::move(r.attn_weights)) : nb::none();
    return nb::make_tuple(to_numpy(std::move(r.output)), w);
  };
  nb::class_<nn::MultiheadAttention, nn::Module>(m, "MultiheadAttention",
      R"(torch.nn.MultiheadAttention: same constructor, forward, parameter names
(in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias; q_proj_weight, k_proj_weight,
v_proj_weight instead of in_proj_weight where kdim or vdim differs from embed_dim; bias_k, bias_v
with add_bias_kv) and seeded initialisation.)")
      .def("__init__", [](nn::MultiheadAttention* self, int64_t embed_dim, int64_t num_heads,
                          float dropout, bool bias, bool add_bias_kv, bool add_zero_attn,
                          std::optional<int64_t> kdim, std::optional<int64_t> vdim, bool batch_first) {
        std::lock_guard<std::mutex> lock(rng_mutex);
        new (self) nn::MultiheadAttention(embed_dim, num_heads, dropout, bias, add_bias_kv,
                                          add_zero_attn, kdim.value_or(0), vdim.value_or(0), batch_first);
      }, "embed_dim"_a, "num_heads"_a, "dropout"_a = 0.0f, "bias"_a = true, "add_bias_kv"_a = false,
         "add_zero_attn"_a = false, "kdim"_a = nb::none(), "vdim"_a = nb::none(), "batch_first"_a = false)
      .def("forward", mha_forward, "query"_a, "key"_a, "value"_a, "key_padding_mask"_a = nb::none(),
           "need_weights"_a = true, "attn_mask"_a = nb::none(), "average_attn_weights"_a = true,
           "is_causal"_a = false,
           R"(Returns (attn_output, attn_weights or None), as torch. Bool masks: True = ignore the
key (torch's convention here); float masks are added to the scores. is_causal applies the causal
mask (torch only uses it as a hint about attn_mask).)")
      .def("__call__", mha_forward, "query"_a, "key"_a, "value"_a, "key_padding_mask"_a = nb::none(),
           "need_weights"_a = true, "attn_mask"_a = nb::none(), "average_attn_weights"_a = true,
           "is_causal"_a = false)
      .def_ro("embed_dim", &nn::MultiheadAttention::embed_dim)
      .def_ro("num_heads", &nn::MultiheadAttention::num_heads)
      .def_ro("head_dim", &nn::MultiheadAttention::head_dim)
      .def_ro("batch_first", &nn::MultiheadAttention::batch_first)
      .def_ro("dropout", &nn::MultiheadAttention::dropout);
}
