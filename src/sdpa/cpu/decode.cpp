// The split-KV decode driver: cuts a decode call into (sequence, kv head, key range) items, runs
// them on OpenMP threads with one ISA build of decode_kernel.hpp, and merges each row's ranges
// through their LSEs (flash-decoding).
//
// Why split the keys: decoding has few (sequence, kv head) pairs, often fewer than threads, and
// each is one long read; splitting S gives every thread a share of the bandwidth. The split
// depends on the problem only (about kTargetItems items, ranges of at least kMinSplit keys), not
// on the thread count, and ranges merge in a fixed order: results are bit-identical for any
// number of threads, as the prefill kernels' are.
//
// Variants: the ranges cover only the keys inside the band (is_causal, window_size) of some
// query of the pair, so with a sliding window the reads, the items and the merge all scale with
// the window, not S (a pair whose band is empty has no range: its rows see no key). Softcap and
// ALiBi act on the scores inside the kernel; a sink is one more logit per row with no value,
// so it belongs to no range: the merge adds it once, as if it were one more range with l = 1,
// m = the sink and acc = 0 (adding it to every range's partial would count it once per range).
//
// Shapes: an item's partial is R * (Evp + 2) floats (m, l, acc of R = group * L rows), all items'
// partials live at once in `parts` (items * R * (Evp + 2) floats, small next to K and V: about
// max(kTargetItems, pairs) items per call, or max(kTargetItems, N) * heads_kv from a paged
// cache, whose heads share their ranges).
#include "sdpa/cpu/flush_denormals.hpp"
#include "sdpa/cpu/decode.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>

#include <omp.h>

#include "core/convert.hpp"
#include "sdpa/cpu/flash_inputs.hpp"

namespace attn::cpu {
namespace {

// A range shorter than this costs more to merge than it gains from another thread.
constexpr int64_t kMinSplit = 512;
// Items to aim for: several per thread up to 16 threads, so a dynamic schedule evens them out.
constexpr int64_t kTargetItems = 64;

struct Item {
  int64_t n, kvh, j0, j1;  // item t leaves its partial (m, l, acc) in block t of `parts`
};

}  // namespace

DecodeParams make_decode_params(int64_t E, int64_t Ev, DType kv_dtype, double scale, bool causal,
                                WindowSize window, double softcap) {
  DecodeParams dp;
  dp.E = E, dp.Ev = Ev, dp.Ep = decode_padded(E), dp.Evp = decode_padded(Ev);
  dp.kv = kv_type_of(kv_dtype);
  dp.scale_log2 = static_cast<float>(scale * std::numbers::log2e);
  dp.causal = causal;
  // A side beyond any position (2^40 tokens) hides nothing more: clamped, so that the band's
  // offsets cannot overflow for INT64_MAX, a valid "unbounded".
  constexpr int64_t kReach = int64_t{1} << 40;
  dp.window_left = std::min(window.left, kReach), dp.window_right = std::min(window.right, kReach);
  // is_causal and the window's right side both bound j from above (the tighter wins per
  // sequence, set_decode_band), the window's left side from below.
  dp.band_hi = causal || window.right >= 0;
  dp.band_lo = window.left >= 0;
  dp.softcap2 = static_cast<float>(softcap * std::numbers::log2e);
  return dp;
}

void set_decode_band(const DecodeParams& p, int64_t diag_offset, DecodeKv& kv) {
  kv.diag_offset = diag_offset;
  kv.hi_offset = std::numeric_limits<int64_t>::max() / 2;
  if (p.window_right >= 0) kv.hi_offset = diag_offset + p.window_right;
  if (p.causal) kv.hi_offset = std::min(kv.hi_offset, diag_offset);
  kv.lo_offset = p.window_left >= 0 ? diag_offset - p.window_left : 0;
}

KvType kv_type_of(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16: return KvType::kBFloat16;
    case DType::kFloat16: return KvType::kFloat16;
    case DType::kInt8: return KvType::kInt8;
    default: return KvType::kFloat32;
  }
}

void run_decode(const DecodeKernel& kernel, const DecodeCall& c) {
  DecodeParams p = c.params;
  p.q_bf16 = c.q_dtype == DType::kBFloat16 && p.kv == KvType::kBFloat16;
  const int64_t group = c.heads_q / c.heads_kv, R = group * c.L;
  const int threads = std::max(1, c.threads);

  // Ranges per (sequence, kv head), over the keys some query sees: the band of queries 0 .. L-1
  // (is_causal, the window) is [lo_offset, L - 1 + hi_offset], so with a sliding window only the
  // window's keys are split and read, whatever S is. A pair whose band is empty has no range.
  // A paged cache's heads go together (one task per sequence and range, every kv head, see
  // decode_kernel.hpp), so each sequence is cut into about kTargetItems ranges, not each pair.
  // One head at a time, a thread read one 4-8 KiB block per page, a whole page (H_kv blocks)
  // apart; the heads together read the pool in order. On AMD Zen 4 (2 threads, H_q 32, H_kv 8,
  // E 128, S 8192, 16-token pages; each paged call followed by one on the same K/V dense, in one
  // process): paged / contiguous float32 1.07-1.12 -> 1.00-1.04, bf16 1.20-1.23 -> 1.11-1.18.
  // A read probe in the two patterns (8 heads, 4 KiB blocks): 22 -> 32 GB/s.
  const int64_t pairs = c.N * c.heads_kv;
  bool together = c.heads_kv > 1 && !c.kv.empty() && c.kv[0].pages != nullptr;
  for (int64_t pair = 0; together && pair < pairs; ++pair) {  // one band and length per sequence
    const DecodeKv &a = c.kv[pair], &b = c.kv[pair - pair % c.heads_kv];
    together = a.S == b.S && a.pages == b.pages && a.lo_offset == b.lo_offset && a.hi_offset == b.hi_offset &&
               a.diag_offset == b.diag_offset;
  }
  const int64_t per = std::max<int64_t>(1, (kTargetItems + (together ? c.N : pairs) - 1) / (together ? c.N : pairs));
  std::vector<Item> items;
  std::vector<int64_t> first_item(static_cast<size_t>(pairs + 1));
  for (int64_t n = 0; n < c.N; ++n) {
    for (int64_t kvh = 0; kvh < c.heads_kv; ++kvh) {
      first_item[n * c.heads_kv + kvh] = static_cast<int64_t>(items.size());
      const DecodeKv& kv = c.kv[n * c.heads_kv + kvh];
      const int64_t b0 = p.band_lo ? std::max<int64_t>(0, kv.lo_offset) : 0;
      const int64_t b1 = p.band_hi ? std::min(kv.S, c.L + kv.hi_offset) : kv.S;
      int64_t len = std::max(kMinSplit, (b1 - b0 + per - 1) / per);
      len = (len + 63) / 64 * 64;
      for (int64_t j0 = b0; j0 < b1; j0 += len) {
        items.push_back({n, kvh, j0, std::min(b1, j0 + len)});
      }
    }
  }
  first_item[pairs] = static_cast<int64_t>(items.size());
  // Tasks: the items one kernel call runs, `heads` of them at first, first + stride, ...: a
  // sequence's kv heads have the same ranges (one band, one length per sequence), so range r of
  // head kvh is item first_item[n * heads_kv + kvh] + r.
  struct Task {
    int64_t first, stride, heads;
  };
  std::vector<Task> tasks;
  for (int64_t n = 0; n < c.N; ++n) {
    const int64_t f0 = first_item[n * c.heads_kv], ranges = first_item[n * c.heads_kv + 1] - f0;
    for (int64_t r = 0; r < (together ? ranges : 0); ++r) tasks.push_back({f0 + r, ranges, c.heads_kv});
  }
  if (!together) {
    for (int64_t t = 0; t < static_cast<int64_t>(items.size()); ++t) tasks.push_back({t, 0, 1});
  }
  const int64_t max_heads = together ? c.heads_kv : 1;

  const int64_t part_floats = R * (p.Evp + 2);
  std::vector<float> parts(static_cast<size_t>(items.size() * part_floats));
  const int64_t q_size = dtype_size(c.q_dtype), o_size = dtype_size(c.o_dtype);

#pragma omp parallel num_threads(threads)
  {
    const FlushDenormals ftz;  // flush_denormals.hpp
    // Kept per thread across calls: a fresh ~80 KiB each call went back to the OS when freed
    // (glibc trims the heap top) and was faulted in again, 10 us of a 0.08 ms call (S = 1024).
    thread_local std::vector<float> ws;
    if (const auto need = static_cast<size_t>(kernel.workspace_floats(R, p.Ep, p.Evp, max_heads)); ws.size() < need) {
      ws.resize(need);
    }
    // Per head of a task: its rows' queries (float32, zero-padded), positions, masks and slopes.
    const auto rows = static_cast<size_t>(max_heads * R);
    std::vector<float> qrows(rows * static_cast<size_t>(p.Ep), 0.0f);
    std::vector<int64_t> pos(rows);
    std::vector<const float*> mask(rows);
    std::vector<float> slope2(rows);
    std::vector<DecodeItem> di(static_cast<size_t>(max_heads));
    int64_t packed = -1;  // the first (n, kv head) whose queries qrows holds
#pragma omp for schedule(dynamic, 1)
    for (size_t t = 0; t < tasks.size(); ++t) {
      const Task& task = tasks[t];
      const Item& it0 = items[task.first];
      const int64_t pair0 = it0.n * c.heads_kv + it0.kvh;
      for (int64_t hh = 0; hh < task.heads; ++hh) {
        const int64_t kvh = it0.kvh + hh;
        const int64_t base = hh * R;
        if (packed != pair0) {
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kvh * group + g;
            for (int64_t i = 0; i < c.L; ++i) {
              const int64_t r = base + g * c.L + i;
              const char* src = static_cast<const char*>(c.q) + (it0.n * c.q_n + h * c.q_h + i * c.q_i) * q_size;
              detail::convert_elements(src, c.q_dtype, qrows.data() + r * p.Ep, DType::kFloat32, p.E);
              pos[r] = i;
              mask[r] = c.mask != nullptr ? c.mask + it0.n * c.mask_n + h * c.mask_h + i * c.mask_i : nullptr;
              if (c.alibi != nullptr) slope2[r] = c.alibi[it0.n * c.alibi_n + h * c.alibi_h] * std::numbers::log2e_v<float>;
            }
          }
        }
        const int64_t item = task.first + hh * task.stride;
        float* part = parts.data() + item * part_floats;
        di[hh] = DecodeItem{qrows.data() + base * p.Ep, pos.data() + base, mask.data() + base,
                            c.alibi != nullptr ? slope2.data() + base : nullptr, R, items[item].j0, items[item].j1,
                            part, part + R, part + 2 * R};
      }
      packed = pair0;
      kernel.split(p, c.kv.data() + pair0, di.data(), task.heads, ws.data());
    }
    // Merge: row r's ranges s, with m_s, l_s, acc_s, and its head's sink logit s2 (base 2; -inf
    // for none), combine as
    //   M = max(s2, max m_s),  l = 2^(s2 - M) + sum l_s 2^(m_s - M),  o = sum acc_s 2^(m_s - M) / l,
    // skipping a range whose factor is 0 (its weights all underflow: a zero weight never
    // multiplies a value). The sink is one logit with no value, counted here once (not in each
    // range's partial). A row with no visible key is 0 with LSE -inf, or the sink with one.
    // After the loop's implicit barrier (every partial written), in the same parallel region: a
    // second region cost ~1.5 us a call (its fork and join; Zen 5 VM, 2 threads, bf16 K/V in the
    // cache, H_q 32, H_kv 8, E 128): S 16 13.6-14.0 -> 12.1-12.3 us, S 512 60 -> 59 us.
    std::vector<float> row(static_cast<size_t>(p.Evp));
#pragma omp for schedule(static)
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int64_t n = pair / c.heads_kv, kvh = pair % c.heads_kv;
      const int64_t s0 = first_item[pair], s1 = first_item[pair + 1];
      for (int64_t r = 0; r < R; ++r) {
        const int64_t h = kvh * group + r / c.L, i = r % c.L;
        const float sink2 = c.sinks != nullptr ? c.sinks[h * c.sinks_h] * std::numbers::log2e_v<float>
                                               : -std::numeric_limits<float>::infinity();
        float M = sink2;
        bool nan = false;
        for (int64_t s = s0; s < s1; ++s) {
          const float m = parts[s * part_floats + r], l = parts[s * part_floats + R + r];
          nan = nan || m != m || l != l;
          if (l > 0.0f) M = std::max(M, m);
        }
        std::fill(row.begin(), row.end(), 0.0f);
        float L = 0.0f;
        if (nan) {
          L = std::numeric_limits<float>::quiet_NaN();
          std::fill(row.begin(), row.end(), L);
        } else if (M != -std::numeric_limits<float>::infinity()) {
          for (int64_t s = s0; s < s1; ++s) {
            const float* part = parts.data() + s * part_floats;
            const float l = part[R + r];
            if (!(l > 0.0f)) continue;
            const float f = std::exp2(part[r] - M);
            if (f == 0.0f) continue;
            L += l * f;
            const float* acc = part + 2 * R + r * p.Evp;
            for (int64_t e = 0; e < p.Ev; ++e) row[e] += acc[e] * f;
          }
          if (c.sinks != nullptr) L += std::exp2(sink2 - M);
          const float inv = 1.0f / L;
          for (int64_t e = 0; e < p.Ev; ++e) row[e] *= inv;
        }
        char* dst = static_cast<char*>(c.o) + (n * c.o_n + h * c.o_h + i * c.o_i) * o_size;
        detail::convert_elements(row.data(), DType::kFloat32, dst, c.o_dtype, p.Ev);
        if (c.lse != nullptr) {
          float lse = -std::numeric_limits<float>::infinity();
          if (nan) lse = L;
          else if (L > 0.0f) lse = (M + std::log2(L)) * std::numbers::ln2_v<float>;
          c.lse[n * c.lse_n + h * c.lse_h + i * c.lse_i] = lse;
        }
      }
    }
  }
}

// ---- scaled_dot_product_attention's short-query path ---------------------------------------------

namespace {

// Strides of the (n, h) leading dims of a view whose lead is p.lead: (B, H), (H) or none.
void lead_strides(const TensorView& t, const detail::SdpaProblem& p, int64_t& sn, int64_t& sh) {
  const int nlead = p.lead.ndim();
  sn = nlead == 2 ? t.stride(0) : 0;
  sh = nlead >= 1 ? t.stride(nlead - 1) : 0;
}

}  // namespace

SdpaResult decode_forward(const DecodeKernel& kernel, const TensorView& q_in, const TensorView& k_in,
                          const TensorView& v_in, const SdpaOptions& options,
                          const detail::SdpaProblem& p) {
  Tensor qs, ks, vs;
  const TensorView q = rows_contiguous(q_in, qs), k = rows_contiguous(k_in, ks),
                   v = rows_contiguous(v_in, vs);
  SdpaResult result = make_forward_result(p, p.dtype, options.need_lse);

  DecodeCall c;
  c.N = p.lead.ndim() == 2 ? p.lead[0] : 1;
  c.heads_q = p.heads_q;
  c.heads_kv = p.heads_kv;
  c.L = p.L;
  DecodeParams& dp = c.params;
  dp = make_decode_params(p.E, p.Ev, p.kv_dtype, flash_softmax_scale(p), p.causal,
                          {p.window_left, p.window_right}, p.softcap);

  c.q = q.raw_data();
  c.q_dtype = p.dtype;
  lead_strides(q, p, c.q_n, c.q_h);
  c.q_i = q.stride(-2);
  c.o = result.output.raw_data();
  c.o_dtype = p.dtype;
  c.o_h = p.L * p.Ev, c.o_n = p.heads_q * c.o_h, c.o_i = p.Ev;
  if (options.need_lse) {
    c.lse = result.lse.data();
    c.lse_i = 1, c.lse_h = p.L, c.lse_n = p.heads_q * p.L;
  }
  if (p.mask.defined()) {
    c.mask = p.mask.data();
    lead_strides(p.mask, p, c.mask_n, c.mask_h);
    c.mask_i = p.mask.stride(-2);
    dp.mask_col = p.mask.stride(-1);
    dp.mask_is_bool = p.mask_is_bool;
  }
  if (p.alibi.defined()) {  // (H) or (B, H), as SdpaProblem::alibi_slope reads it
    c.alibi = p.alibi.data();
    c.alibi_n = p.alibi.dim() == 2 ? p.alibi.stride(0) : 0;
    c.alibi_h = p.alibi.stride(-1);
  }
  if (p.sinks.defined()) {
    c.sinks = p.sinks.data();
    c.sinks_h = p.sinks.stride(0);
  }

  int64_t k_n, k_h, v_n, v_h;
  lead_strides(k, p, k_n, k_h);
  lead_strides(v, p, v_n, v_h);
  const int64_t esize = dtype_size(p.kv_dtype);
  c.kv.resize(static_cast<size_t>(c.N * c.heads_kv));
  for (int64_t n = 0; n < c.N; ++n) {
    for (int64_t h = 0; h < c.heads_kv; ++h) {
      DecodeKv& kv = c.kv[n * c.heads_kv + h];
      kv.k = static_cast<const char*>(k.raw_data()) + (n * k_n + h * k_h) * esize;
      kv.v = static_cast<const char*>(v.raw_data()) + (n * v_n + h * v_h) * esize;
      kv.k_row = k.stride(-2), kv.v_row = v.stride(-2);
      kv.page_size = std::max<int64_t>(p.S, 1);  // one page: the whole head
      kv.S = p.S;
      set_decode_band(dp, p.diag_offset, kv);  // causal_offset is diag_offset whenever causal
    }
  }
  c.threads = options.num_threads > 0 ? options.num_threads : omp_get_max_threads();
  run_decode(kernel, c);
  return result;
}

}  // namespace attn::cpu
