// Fuzz target: attn::PagedKvCache and paged_attention, against the float64 truth on each
// sequence's gathered keys and values.
//
// The bytes decode to (see LLVMFuzzerTestOneInput for the layout; tests/fuzz/seeds.py writes the
// seed corpus in it): a cache (page size 1 .. 96, 1-3 kv heads, head dims 4 .. 128 with a value
// dim of its own, float32, bf16, f16 or int8, a pool of 1-64 pages), then up to 24 operations
// (add a sequence, append 1-40 tokens to an id that may be live, freed or never added, free an
// id), then one paged_attention call on 1-3 ids (one of them possibly dead) with 1-4 new tokens,
// queries in float32, bf16 or f16, GQA groups 1-8, is_causal, a sliding window, softcap, ALiBi
// slopes and sinks, a decode kernel by name or the default, 1 or 2 threads. Values are normal
// (a seeded generator), so the error rule below holds for every valid call.
//
// Properties (a violation aborts, so libFuzzer keeps the input):
//  * A cache operation either succeeds as documented (lengths grow by the appended tokens, a freed
//    id is gone) or throws an attn::Error and leaves every live sequence's length and gathered
//    keys and values unchanged. Nothing else is thrown.
//  * paged_attention throws an attn::Error exactly when an id is not live or holds fewer tokens
//    than the new ones, and then changes nothing in the cache; otherwise it returns the documented
//    shapes, the same bits for 1 and 2 threads, and per sequence, against the float64 truth of
//    scaled_dot_product_attention (bottom-right aligned, the same options) on the gathered keys
//    and values: err(output) <= 2 * err(float32 reference rounded to the query dtype) + 1e-5, LSE
//    within 1e-4 (equal where the truth's is infinite: a row that sees no key).
#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "fuzz_util.hpp"

namespace {

using namespace attn;
using attn::fuzz::ByteReader;
using attn::fuzz::SplitMix;
using attn::fuzz::throws_attn_error;

Tensor normal(Shape shape, SplitMix& rng) {
  Tensor t = Tensor::empty(shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data()[i] = rng.normal();
  return t;
}

double max_abs_err(const TensorView& a, const std::vector<double>& truth) {
  const std::vector<float> v = a.to_vector();
  double m = 0;
  for (size_t i = 0; i < v.size(); ++i) {
    const double x = v[i], t = truth[i];
    if (std::isnan(x) || std::isnan(t)) return INFINITY;  // normal inputs: no NaN anywhere
    if (x == t) continue;                                // equal infinities included
    m = std::max(m, std::fabs(x - t));
  }
  return m;
}

// Every live sequence's length and gathered keys and values: what a rejected operation must
// leave as it was.
struct Snapshot {
  std::map<int64_t, std::pair<std::vector<float>, std::vector<float>>> kv;
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(const PagedKvCache& c, const std::map<int64_t, int64_t>& lengths) {
  Snapshot s;
  for (const auto& [id, len] : lengths) {
    ATTN_FUZZ_CHECKF(c.contains(id) && c.length(id) == len, "sequence %lld: length %lld expected", (long long)id,
                     (long long)len);
    s.kv[id] = {c.gather_keys(id).to_vector(), c.gather_values(id).to_vector()};
  }
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ByteReader in(data, size);
  static const int64_t kPages[] = {1, 2, 3, 8, 16, 17, 64, 96};
  static const int64_t kDims[] = {4, 16, 33, 64, 80, 128};
  static const DType kCache[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kInt8};
  static const DType kQuery[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  PagedKvCacheOptions o;
  o.page_size = in.pick_from(kPages);
  o.heads_kv = 1 + in.pick(3);
  o.head_dim = in.pick_from(kDims);
  o.head_dim_v = in.flag() ? o.head_dim : in.pick_from(kDims);
  o.dtype = in.pick_from(kCache);
  o.num_pages = 1 + in.pick(64);
  SplitMix rng(in.u32());
  PagedKvCache cache(o);

  std::map<int64_t, int64_t> lengths;  // live ids
  int64_t ids_made = 0;
  const int ops = in.pick(25);
  for (int op = 0; op < ops; ++op) {
    const int kind = in.pick(3);
    const int64_t id = in.pick(static_cast<int>(ids_made) + 2);  // may be dead or never added
    const Snapshot before = snapshot(cache, lengths);
    if (kind == 0) {
      int64_t got = -1;
      ATTN_FUZZ_CHECK(!throws_attn_error("add_sequence", [&] { got = cache.add_sequence(); }));
      ATTN_FUZZ_CHECK(got >= 0 && !lengths.count(got) && cache.contains(got) && cache.length(got) == 0);
      lengths[got] = 0;
      ids_made = std::max(ids_made, got + 1);
    } else if (kind == 1) {
      const int64_t n = 1 + in.pick(40);
      const Tensor k = normal({n, o.heads_kv, o.head_dim}, rng), v = normal({n, o.heads_kv, o.head_dim_v}, rng);
      if (throws_attn_error("append", [&] { cache.append(id, k, v); })) {
        ATTN_FUZZ_CHECK(snapshot(cache, lengths) == before);
      } else {
        ATTN_FUZZ_CHECKF(lengths.count(id), "append to dead id %lld succeeded", (long long)id);
        lengths[id] += n;
        ATTN_FUZZ_CHECK(cache.length(id) == lengths[id]);
      }
    } else {
      if (throws_attn_error("free_sequence", [&] { cache.free_sequence(id); })) {
        ATTN_FUZZ_CHECKF(!lengths.count(id), "free of live id %lld threw", (long long)id);
        ATTN_FUZZ_CHECK(snapshot(cache, lengths) == before);
      } else {
        ATTN_FUZZ_CHECKF(lengths.erase(id) == 1, "free of dead id %lld succeeded", (long long)id);
        ATTN_FUZZ_CHECK(!cache.contains(id));
      }
    }
  }
  (void)snapshot(cache, lengths);

  // The call: N ids, L_q new tokens, the options.
  const int64_t N = 1 + in.pick(3), L_q = 1 + in.pick(4);
  static const int64_t kGroups[] = {1, 2, 4, 8};
  const int64_t group = in.pick_from(kGroups), Hq = group * o.heads_kv;
  std::vector<int64_t> ids;
  std::vector<int64_t> live(lengths.size());
  std::transform(lengths.begin(), lengths.end(), live.begin(), [](const auto& kv) { return kv.first; });
  bool valid = true;
  for (int64_t n = 0; n < N; ++n) {
    int64_t id = in.pick(static_cast<int>(ids_made) + 2);
    if (!live.empty() && in.pick(8) != 0) id = live[static_cast<size_t>(in.pick(static_cast<int>(live.size())))];
    valid = valid && lengths.count(id) && lengths[id] >= L_q;
    ids.push_back(id);
  }
  const DType qd = in.pick_from(kQuery);
  const Tensor q = normal({N, L_q, Hq, o.head_dim}, rng).to(qd);
  PagedAttentionOptions po;
  po.is_causal = in.flag();
  po.need_lse = true;
  static const WindowSize kWindows[] = {{-1, -1}, {5, 0}, {0, 0}, {300, 0}, {17, 3}, {-1, 2}, {40, -1}};
  po.window_size = in.pick_from(kWindows);
  static const double kSoftcaps[] = {0.0, 1.5, 30.0};
  if (const double c = in.pick_from(kSoftcaps); c > 0) po.softcap = c;
  Tensor slopes, sinks;
  if (in.flag()) {
    slopes = in.flag() ? Tensor::empty({Hq}) : Tensor::empty({N, Hq});
    for (int64_t i = 0; i < slopes.numel(); ++i) slopes.data()[i] = 0.01f * static_cast<float>(in.pick(40));
    po.alibi_slopes = slopes;
  }
  if (in.flag()) {
    sinks = normal({Hq}, rng);
    po.sinks = sinks;
  }
  static const std::vector<std::string> decode = [] {  // the decode kernels this CPU runs
    std::vector<std::string> names;
    for (const SdpaKernelInfo& k : sdpa_kernels()) {
      if (k.name.starts_with("cpu.decode.") && k.runs_on_this_cpu) names.push_back(k.name);
    }
    return names;
  }();
  const int which = in.pick(static_cast<int>(decode.size()) + 1);
  po.kernel = which < static_cast<int>(decode.size()) ? decode[static_cast<size_t>(which)] : "";

  const Snapshot before = snapshot(cache, lengths);
  po.num_threads = 1;
  SdpaResult one;
  const bool threw = throws_attn_error("paged_attention", [&] { one = paged_attention(q, cache, ids, po); });
  ATTN_FUZZ_CHECK(snapshot(cache, lengths) == before);
  ATTN_FUZZ_CHECKF(threw == !valid, "paged_attention %s a %s call", threw ? "refused" : "accepted",
                   valid ? "valid" : "invalid");
  if (threw) return 0;
  ATTN_FUZZ_CHECK(one.output.shape() == (Shape{N, L_q, Hq, cache.head_dim_v()}) && one.output.dtype() == qd);
  ATTN_FUZZ_CHECK(one.lse.shape() == (Shape{N, Hq, L_q}));
  po.num_threads = 2;
  const SdpaResult two = paged_attention(q, cache, ids, po);
  ATTN_FUZZ_CHECK(one.output.to_vector() == two.output.to_vector());
  ATTN_FUZZ_CHECK(one.lse.to_vector() == two.lse.to_vector());

  SdpaOptions so;
  so.enable_gqa = true;
  so.is_causal = po.is_causal;
  so.causal_alignment = CausalAlignment::kBottomRight;
  so.need_lse = true;
  so.window_size = po.window_size;
  so.softcap = po.softcap;
  so.sinks = po.sinks;
  so.backend = SdpaBackend::kReference;
  const Tensor q32 = q.to(DType::kFloat32);
  for (int64_t n = 0; n < N; ++n) {
    Tensor row_slopes;
    if (slopes.defined()) {
      row_slopes = slopes.dim() == 1 ? slopes.contiguous() : slopes.select(0, n).contiguous();
      so.alibi_slopes = row_slopes;
    }
    const Tensor qn = q32.select(0, n).transpose(0, 1).unsqueeze(0).contiguous();
    const Tensor k = cache.gather_keys(ids[static_cast<size_t>(n)]).unsqueeze(0).contiguous();
    const Tensor v = cache.gather_values(ids[static_cast<size_t>(n)]).unsqueeze(0).contiguous();
    const reference::SdpaResultF64 truth = reference::scaled_dot_product_attention_f64(qn, k, v, so);
    const double ref_err = max_abs_err(scaled_dot_product_attention(qn, k, v, so).output.to(qd), truth.output);
    const double err = max_abs_err(one.output.select(0, n).transpose(0, 1).unsqueeze(0), truth.output);
    ATTN_FUZZ_CHECKF(err <= 2.0 * ref_err + 1e-5, "sequence %lld: error %.3g, reference's %.3g",
                     (long long)ids[static_cast<size_t>(n)], err, ref_err);
    const double lse_err = max_abs_err(one.lse.select(0, n).unsqueeze(0), truth.lse);
    ATTN_FUZZ_CHECKF(lse_err <= 1e-4, "sequence %lld: LSE error %.3g", (long long)ids[static_cast<size_t>(n)], lse_err);
  }
  return 0;
}
