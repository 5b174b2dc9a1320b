// Sequence layouts over ranks (shard_ranges), and moving rows between a global tensor and them.
#include <cstring>
#include <fmt/format.h>

#include "attn/dist.hpp"
#include "dist/comm.hpp"
#include "dist/rows.hpp"

namespace attn::dist {

std::vector<std::pair<int64_t, int64_t>> shard_ranges(int64_t length, int world, int rank, Layout layout) {
  if (world < 1 || rank < 0 || rank >= world) {
    throw ValueError(fmt::format("shard_ranges: rank must be in [0, world) with world >= 1, got rank {} of {}", rank, world));
  }
  if (length < 0) throw ValueError(fmt::format("shard_ranges: length must be >= 0, got {}", length));
  const int64_t n = layout == Layout::kZigzag ? 2 * int64_t{world} : world;
  const auto chunk = [&](int64_t c) {
    const int64_t base = length / n, extra = length % n;
    const int64_t begin = c * base + std::min(c, extra);
    return std::pair<int64_t, int64_t>{begin, begin + base + (c < extra ? 1 : 0)};
  };
  if (layout == Layout::kContiguous) return {chunk(rank)};
  return {chunk(rank), chunk(n - 1 - rank)};
}

Tensor shard(const TensorView& global, int world, int rank, Layout layout) {
  if (!global.defined() || global.dim() < 2) {
    throw ShapeError("shard: global must have at least 2 dims (..., L, X), the sequence on dim -2");
  }
  const auto ranges = shard_ranges(global.size(-2), world, rank, layout);
  int64_t rows = 0;
  for (const auto& [b, e] : ranges) rows += e - b;
  Shape shape = global.shape();
  shape[shape.ndim() - 2] = rows;
  Tensor out = Tensor::empty(shape, global.dtype());
  int64_t at = 0;
  for (const auto& [b, e] : ranges) {
    detail::copy_rows(global.slice(-2, b, e), out.slice(-2, at, at + e - b));
    at += e - b;
  }
  return out;
}

Tensor gather(const TensorView& local, MPI_Comm comm_in, Layout layout, double timeout_seconds) {
  const char* who = "gather";
  detail::Comm comm(comm_in, timeout_seconds, who);
  detail::Agreement mine = detail::local_check([&](detail::Agreement& a) {
    if (!local.defined() || local.dim() < 2) throw ShapeError("gather: local must have at least 2 dims (..., L_r, X)");
    Shape s = local.shape();
    a.signature = fmt::format("dtype {}, shape {} (dim -2 aside)", dtype_name(local.dtype()),
                              (s[s.ndim() - 2] = 0, s.str()));
    a.len_q = a.len_k = local.size(-2);
  });
  const int64_t total = detail::agree(comm, mine, layout);
  const int P = comm.size();
  // Every rank's rows, packed row-major, sent to every rank (P^2 point-to-point messages).
  Shape shape = local.shape();
  shape[shape.ndim() - 2] = total;
  Tensor out = Tensor::empty(shape, local.dtype());
  const Tensor mine_packed = local.contiguous();
  std::vector<std::vector<char>> recv(static_cast<size_t>(P));
  std::vector<MPI_Request> reqs;
  Shape one = local.shape();
  for (int r = 0; r < P; ++r) {
    int64_t n = 0;
    for (const auto& [b, e] : shard_ranges(total, P, r, layout)) n += e - b;
    one[one.ndim() - 2] = n;
    recv[static_cast<size_t>(r)].resize(static_cast<size_t>(one.numel() * local.element_size()));
    comm.irecv(recv[static_cast<size_t>(r)].data(), static_cast<int64_t>(recv[static_cast<size_t>(r)].size()), r, 7, reqs);
  }
  for (int r = 0; r < P; ++r) {
    comm.isend(mine_packed.raw_data(), mine_packed.numel() * mine_packed.element_size(), r, 7, reqs);
  }
  comm.wait(reqs, "every rank's rows (gather)");
  for (int r = 0; r < P; ++r) {
    int64_t n = 0;
    const auto ranges = shard_ranges(total, P, r, layout);
    for (const auto& [b, e] : ranges) n += e - b;
    one[one.ndim() - 2] = n;
    const TensorView src(recv[static_cast<size_t>(r)].data(), local.dtype(), one);
    int64_t at = 0;
    for (const auto& [b, e] : ranges) {
      detail::copy_rows(src.slice(-2, at, at + e - b), out.slice(-2, b, e));
      at += e - b;
    }
  }
  return out;
}

}  // namespace attn::dist
