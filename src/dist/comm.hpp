// MPI plumbing of attn::dist: a private duplicate of the caller's
// communicator (so our tags never meet the caller's messages, and errors return instead of
// aborting), waits that give up after a timeout, and the collective argument check.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "attn/dist.hpp"

namespace attn::dist::detail {

// Throws CommError naming `what` unless rc is MPI_SUCCESS.
void check_mpi(int rc, const char* who, const char* what);

class Comm {
 public:
  // Duplicates `comm` (non-blocking, so a dead peer times out here too).
  Comm(MPI_Comm comm, double timeout_seconds, const char* who);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  const char* who() const { return who_; }
  // A bad timeout_seconds, reported by agree() on every rank (non-empty when bad).
  const std::string& bad_argument() const { return bad_argument_; }

  // Polls: true when every request has completed (completed ones become MPI_REQUEST_NULL).
  bool test(std::vector<MPI_Request>& reqs) const;
  // Waits for every request; CommError after the timeout, naming `what`.
  void wait(std::vector<MPI_Request>& reqs, const std::string& what) const;

  // Every rank's string (each up to 1 MiB), gathered on every rank.
  std::vector<std::string> allgather(const std::string& mine) const;

  // Non-blocking send / receive of `bytes` bytes, split into messages below 1 GiB (MPI counts
  // are int), appended to `reqs`.
  void isend(const void* data, int64_t bytes, int peer, int tag, std::vector<MPI_Request>& reqs) const;
  void irecv(void* data, int64_t bytes, int peer, int tag, std::vector<MPI_Request>& reqs) const;

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  double timeout_;
  const char* who_;
  std::string bad_argument_;
  mutable bool healthy_ = true;  // false after a timeout: requests may be pending, the dup is not freed
};

// What a rank brings to the collective check: its local error (if its own arguments are bad),
// a signature of everything that must agree, and its query and key lengths.
struct Agreement {
  char error_kind = 0;  // 0: none; 'S' ShapeError, 'D' DTypeError, 'V' ValueError
  std::string error;
  std::string signature;
  int64_t len_q = 0, len_k = 0;
};
// Gathers every rank's Agreement and throws, identically on every rank, the first rank's local
// error (a bad timeout included), or a ValueError naming the first rank whose signature (or
// function: ring_attention vs its backward) differs from rank 0's, or a
// ShapeError for a rank whose lengths are not its shard of the total under `layout`. Returns
// the global sequence length.
int64_t agree(const Comm& comm, const Agreement& mine, Layout layout);

// Runs `f` and turns an attn::Error it throws into the Agreement's local error.
template <typename F>
Agreement local_check(F&& f) {
  Agreement a;
  try {
    f(a);
  } catch (const ShapeError& e) {
    a.error_kind = 'S', a.error = e.what();
  } catch (const DTypeError& e) {
    a.error_kind = 'D', a.error = e.what();
  } catch (const Error& e) {
    a.error_kind = 'V', a.error = e.what();
  }
  return a;
}

double now_seconds();
double cpu_seconds();  // this process, all threads

}  // namespace attn::dist::detail
