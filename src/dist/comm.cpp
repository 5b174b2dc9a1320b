#include "dist/comm.hpp"

#include <time.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <fmt/format.h>

namespace attn::dist::detail {

namespace {
constexpr int64_t kMaxMessage = int64_t{1} << 30;
}  // namespace

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

void check_mpi(int rc, const char* who, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw CommError(fmt::format("{}: MPI failed in {}: {}", who, what, std::string(text, static_cast<size_t>(len))));
}

Comm::Comm(MPI_Comm comm, double timeout_seconds, const char* who) : timeout_(timeout_seconds), who_(who) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) throw ValueError(fmt::format("{}: MPI is not initialized (call MPI_Init first)", who));
  if (comm == MPI_COMM_NULL) throw ValueError(fmt::format("{}: comm is MPI_COMM_NULL", who));
  if (!(timeout_seconds > 0)) {
    // Reported through agree() so that every rank throws it; until then, a default timeout.
    bad_argument_ = fmt::format("{}: timeout_seconds must be > 0, got {}", who, timeout_seconds);
    timeout_ = 300;
  }
  MPI_Request req = MPI_REQUEST_NULL;
  check_mpi(MPI_Comm_idup(comm, &comm_, &req), who, "MPI_Comm_idup");
  std::vector<MPI_Request> reqs{req};
  wait(reqs, "duplicating the communicator");
  MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

Comm::~Comm() {
  // After a timeout, requests on the duplicate may still be pending: freeing it could block.
  if (healthy_ && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

bool Comm::test(std::vector<MPI_Request>& reqs) const {
  if (reqs.empty()) return true;
  int done = 0;
  check_mpi(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE), who_, "MPI_Testall");
  if (done) reqs.clear();
  return done != 0;
}

void Comm::wait(std::vector<MPI_Request>& reqs, const std::string& what) const {
  const double deadline = now_seconds() + timeout_;
  while (!test(reqs)) {
    if (now_seconds() > deadline) {
      healthy_ = false;
      throw CommError(fmt::format("{}: rank {} of {} waited more than {} s for {} (a peer died, stalled "
                                  "or called with other arguments); no result is returned",
                                  who_, rank_, size_, timeout_, what));
    }
    // Short sleeps: the ranks may share cores with each other's compute.
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void Comm::isend(const void* data, int64_t bytes, int peer, int tag, std::vector<MPI_Request>& reqs) const {
  const char* p = static_cast<const char*>(data);
  for (int64_t off = 0; off < bytes || (bytes == 0 && off == 0); off += kMaxMessage) {
    const int n = static_cast<int>(std::min(kMaxMessage, bytes - off));
    reqs.emplace_back();
    check_mpi(MPI_Isend(p + off, n, MPI_BYTE, peer, tag, comm_, &reqs.back()), who_, "MPI_Isend");
    if (bytes == 0) break;
  }
}

void Comm::irecv(void* data, int64_t bytes, int peer, int tag, std::vector<MPI_Request>& reqs) const {
  char* p = static_cast<char*>(data);
  for (int64_t off = 0; off < bytes || (bytes == 0 && off == 0); off += kMaxMessage) {
    const int n = static_cast<int>(std::min(kMaxMessage, bytes - off));
    reqs.emplace_back();
    check_mpi(MPI_Irecv(p + off, n, MPI_BYTE, peer, tag, comm_, &reqs.back()), who_, "MPI_Irecv");
    if (bytes == 0) break;
  }
}

std::vector<std::string> Comm::allgather(const std::string& mine) const {
  // Lengths first, then the strings (Iallgatherv): no size limit, no separator to escape.
  int64_t len = static_cast<int64_t>(mine.size());
  std::vector<int64_t> lens(static_cast<size_t>(size_));
  std::vector<MPI_Request> reqs(1);
  check_mpi(MPI_Iallgather(&len, 1, MPI_INT64_T, lens.data(), 1, MPI_INT64_T, comm_, &reqs[0]), who_, "MPI_Iallgather");
  wait(reqs, "every rank's arguments (the collective check)");
  std::vector<int> counts(static_cast<size_t>(size_)), displs(static_cast<size_t>(size_));
  int64_t total = 0;
  for (int r = 0; r < size_; ++r) {
    if (lens[static_cast<size_t>(r)] < 0 || lens[static_cast<size_t>(r)] > (int64_t{1} << 20)) {
      throw CommError(fmt::format("{}: rank {} sent a malformed argument check ({} bytes)", who_, r, lens[static_cast<size_t>(r)]));
    }
    counts[static_cast<size_t>(r)] = static_cast<int>(lens[static_cast<size_t>(r)]);
    displs[static_cast<size_t>(r)] = static_cast<int>(total);
    total += lens[static_cast<size_t>(r)];
  }
  std::vector<char> recv(static_cast<size_t>(std::max<int64_t>(total, 1)));
  reqs.assign(1, MPI_REQUEST_NULL);
  check_mpi(MPI_Iallgatherv(mine.data(), static_cast<int>(len), MPI_CHAR, recv.data(), counts.data(), displs.data(),
                            MPI_CHAR, comm_, &reqs[0]),
            who_, "MPI_Iallgatherv");
  wait(reqs, "every rank's arguments (the collective check)");
  std::vector<std::string> out;
  for (int r = 0; r < size_; ++r) {
    out.emplace_back(recv.data() + displs[static_cast<size_t>(r)], static_cast<size_t>(counts[static_cast<size_t>(r)]));
  }
  return out;
}

namespace {
// Fields as "<length>:<bytes>": whatever a message or kernel name holds cannot shift them.
void put(std::string& s, const std::string& field) { s += std::to_string(field.size()) + ":" + field; }
std::string take(const std::string& s, size_t& at) {
  const size_t colon = s.find(':', at);
  if (colon == std::string::npos || colon == at || colon - at > 9) throw ValueError("malformed argument check");
  const size_t n = std::stoul(s.substr(at, colon - at));
  if (colon + 1 + n > s.size()) throw ValueError("malformed argument check");
  at = colon + 1 + n;
  return s.substr(colon + 1, n);
}
}  // namespace

int64_t agree(const Comm& comm, const Agreement& given, Layout layout) {
  Agreement mine = given;
  if (mine.error_kind == 0 && !comm.bad_argument().empty()) mine.error_kind = 'V', mine.error = comm.bad_argument();
  std::string text;
  put(text, std::string(1, mine.error_kind == 0 ? '-' : mine.error_kind));
  put(text, mine.error);
  put(text, std::string(comm.who()) + ": " + mine.signature);  // forward and backward do not match
  put(text, std::to_string(mine.len_q));
  put(text, std::to_string(mine.len_k));
  std::vector<Agreement> all;
  const std::vector<std::string> texts = comm.allgather(text);
  for (size_t r = 0; r < texts.size(); ++r) {
    Agreement a;
    try {
      size_t at = 0;
      const std::string kind = take(texts[r], at);
      a.error_kind = kind == "-" ? 0 : kind[0];
      a.error = take(texts[r], at);
      a.signature = take(texts[r], at);
      a.len_q = std::stoll(take(texts[r], at));
      a.len_k = std::stoll(take(texts[r], at));
    } catch (const std::exception&) {
      throw CommError(fmt::format("{}: rank {} sent a malformed argument check", comm.who(), r));
    }
    all.push_back(a);
  }
  const char* who = comm.who();
  for (size_t r = 0; r < all.size(); ++r) {
    const Agreement& a = all[r];
    if (a.error_kind == 0) continue;
    const std::string msg = fmt::format("{}: rank {}: {}", who, r, a.error);
    if (a.error_kind == 'S') throw ShapeError(msg);
    if (a.error_kind == 'D') throw DTypeError(msg);
    throw ValueError(msg);
  }
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r].signature != all[0].signature) {
      throw ValueError(fmt::format("{}: every rank must pass the same options and shapes (the sequence length "
                                   "aside); rank 0 has [{}], rank {} has [{}]",
                                   who, all[0].signature, r, all[r].signature));
    }
  }
  int64_t total = 0;
  for (const Agreement& a : all) total += a.len_q;
  for (size_t r = 0; r < all.size(); ++r) {
    int64_t want = 0;
    for (const auto& [b, e] : shard_ranges(total, comm.size(), static_cast<int>(r), layout)) want += e - b;
    if (all[r].len_q != want || all[r].len_k != want) {
      throw ShapeError(fmt::format(
          "{}: rank {} must hold {} of the {} tokens ({} layout over {} ranks: the first chunks take one "
          "token more), got query length {} and key length {}",
          who, r, want, total, layout == Layout::kZigzag ? "zigzag" : "contiguous", comm.size(), all[r].len_q,
          all[r].len_k));
    }
  }
  return total;
}

}  // namespace attn::dist::detail
