// Broadcast reduction of the attn_mask gradient (mask_grad.hpp). Output rows (the mask's rows)
// are independent, so they run on OpenMP threads, and each sums its preimage rows in buffer
// order: the same bits for any thread count.
#include "sdpa/mask_grad.hpp"

#include <algorithm>
#include <array>
#include <cstring>

namespace attn::detail {

namespace {

// The mask's shape padded to the scores' rank with leading 1s, and the scores' row-major strides.
struct Broadcast {
  int n;
  std::array<int64_t, kMaxDims> full{}, msz{}, stride{};
  int64_t out_rows = 1, summed_rows = 1;  // over the row dims (all but the last)
  bool keep_cols;                         // the mask has S columns (else 1: summed too)

  Broadcast(const SdpaProblem& p, const TensorView& mask) {
    Shape f = p.lead;
    f.push_back(p.L);
    f.push_back(p.S);
    n = f.ndim();
    const int pad = n - mask.dim();
    for (int d = 0; d < n; ++d) full[d] = f[d], msz[d] = d < pad ? 1 : mask.size(d - pad);
    stride[n - 1] = 1;
    for (int d = n - 2; d >= 0; --d) stride[d] = stride[d + 1] * full[d + 1];
    for (int d = 0; d < n - 1; ++d) (kept(d) ? out_rows : summed_rows) *= full[d];
    keep_cols = msz[n - 1] == full[n - 1];
  }
  bool kept(int d) const { return msz[d] == full[d]; }
  // Buffer offset of row c (row-major over the summed dims) of output row r (over the kept ones).
  int64_t offset(int64_t r, int64_t c) const {
    int64_t off = 0;
    for (int d = n - 2; d >= 0; --d) {
      int64_t& idx = kept(d) ? r : c;
      off += idx % full[d] * stride[d];
      idx /= full[d];
    }
    return off;
  }
};

// out[r * cols + j] = sum over c of rows[offset(r, c) + j] (or of the whole row when the mask
// has one column), accumulated in double; Out is float or double.
template <typename T, typename Out>
void reduce(const T* rows, const Broadcast& bc, int64_t S, Out* out, int threads) {
  const int64_t cols = bc.keep_cols ? S : 1;
#pragma omp parallel num_threads(threads) if (bc.out_rows > 1 && bc.out_rows * bc.summed_rows * S > 65536)
  {
    std::vector<double> acc(static_cast<size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < bc.out_rows; ++r) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t c = 0; c < bc.summed_rows; ++c) {
        const T* row = rows + bc.offset(r, c);
        if (bc.keep_cols) {
          for (int64_t j = 0; j < S; ++j) acc[static_cast<size_t>(j)] += static_cast<double>(row[j]);
        } else {
          for (int64_t j = 0; j < S; ++j) acc[0] += static_cast<double>(row[j]);
        }
      }
      for (int64_t j = 0; j < cols; ++j) out[r * cols + j] = static_cast<Out>(acc[static_cast<size_t>(j)]);
    }
  }
}

}  // namespace

MaskGradRows::MaskGradRows(const SdpaProblem& p, const TensorView& mask, int threads, bool bf16_rows)
    : p_(p), mask_(mask), direct_(mask.dtype() != DType::kFloat64 && mask.numel() == p.batch * p.L * p.S) {
  // An element per score: the mask's row-major order is the rows' (its shape is lead + (L, S)
  // up to leading 1s), so its gradient is the rows themselves (rounded to a 16-bit dtype).
  const bool own_dtype = direct_ && (mask.dtype() == DType::kFloat32 || (bf16_rows && mask.dtype() == DType::kBFloat16));
  storage_ = own_dtype ? Tensor::empty(mask.shape(), mask.dtype()) : Tensor::empty({p.batch * p.L * p.S});
  if (storage_.dtype() == DType::kBFloat16) {
    rows_bf16_ = static_cast<uint16_t*>(storage_.raw_data());
  } else {
    rows_ = storage_.data();
  }
  char* bytes = static_cast<char*>(storage_.raw_data());
  const int64_t item = storage_.element_size();
  const int64_t n = p.batch * p.L * p.S * item, chunk = int64_t{1} << 18;
#pragma omp parallel for num_threads(threads) schedule(static) if (n > chunk)
  for (int64_t c = 0; c < (n + chunk - 1) / chunk; ++c) {
    std::memset(bytes + c * chunk, 0, static_cast<size_t>(std::min(chunk, n - c * chunk)));
  }
}

Tensor MaskGradRows::finish(int threads) {
  const DType dt = mask_.dtype();
  if (direct_) return storage_.dtype() == dt ? std::move(storage_) : storage_.view(mask_.shape()).to(dt);
  const Broadcast bc(p_, mask_);
  if (dt == DType::kFloat64) {
    Tensor out = Tensor::empty(mask_.shape(), dt);
    reduce(rows_, bc, p_.S, out.data_as<double>(), threads);
    return out;
  }
  // 16-bit: through float32, as every float64 -> 16-bit conversion goes (c10's too).
  Tensor out = Tensor::empty(mask_.shape());
  reduce(rows_, bc, p_.S, out.data(), threads);
  return dt == DType::kFloat32 ? out : out.to(dt);
}

std::vector<double> reduce_mask_grad(const double* ds, const SdpaProblem& p, const TensorView& mask) {
  const Broadcast bc(p, mask);
  std::vector<double> out(static_cast<size_t>(mask.numel()));
  reduce(ds, bc, p.S, out.data(), 1);
  return out;
}

Tensor mask_grad_tensor(const std::vector<double>& sums, const TensorView& mask) {
  Tensor t = Tensor::empty(mask.shape(), DType::kFloat64);
  std::copy(sums.begin(), sums.end(), t.data_as<double>());
  return mask.dtype() == DType::kFloat64 ? t : t.to(mask.dtype());
}

}  // namespace attn::detail
