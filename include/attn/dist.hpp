// attn::dist — exact attention over a sequence split across MPI ranks (context parallelism).
// Optional component: built when CMake finds MPI (-DATTN_WITH_MPI=ON requires it); link
// attn::dist. docs/DISTRIBUTED.md has the algorithms, the layouts and the scaling model.
//
// Every rank holds a slice of the sequence (dim -2) of query, key and value, (..., L_r, E), with
// the same leading dims on every rank:
//   Layout::kContiguous  rank r holds chunk r of P (tokens in order);
//   Layout::kZigzag      the sequence is cut into 2P chunks and rank r holds chunks r and
//                        2P-1-r, concatenated: with is_causal every rank then does equal work.
// When L is not divisible by P (or 2P), the first L % P (L % 2P) chunks take one token more.
// shard_ranges() says which tokens a rank holds; shard() and gather() move between a global
// tensor and this layout.
//
//   ring_attention     K/V blocks travel around the ring (non-blocking Isend/Irecv, double-
//                      buffered) while the fused kernel computes on the block in hand; partial
//                      results merge through their LSE. Backward: dK/dV travel the ring back.
//   ulysses_attention  all-to-all from sequence-sharded to head-sharded, one local SDPA over the
//                      whole sequence, all-to-all back (DeepSpeed-Ulysses). Needs H and H_kv
//                      divisible by P and no dropout (else ValueError: use the ring). Moves q,
//                      k, v and o once where the ring moves K/V P-1 times, but cannot hide it
//                      behind compute. Which to use: docs/DISTRIBUTED.md ("Ring or Ulysses").
//
// Both compute exactly what scaled_dot_product_attention computes on the gathered tensors
// (SdpaOptions::query_pos_offset / key_pos_offset place each block at its global position, so
// causal, window, ALiBi and Philox dropout see global positions and the dropout mask is the
// single-process one), up to float rounding: the ring merges partials through their LSEs in
// float32, and with 16-bit inputs each block's partial output comes back rounded to that dtype
// before the merge (one rounding per visible block; the tests hold the whole to 2x the
// single-process error vs float64). Supported options: is_causal, scale, enable_gqa, dropout
// with DropoutRng::kPhilox (ring only), window_size, softcap, alibi_slopes, sinks, need_lse,
// kernel / backend / num_threads. Refused with ValueError: attn_mask (its keys are spread over
// the ranks), need_weights, kTorch dropout, nonzero position offsets, a named kernel that
// would refuse the blocks; with DTypeError: float64, query/key/value of different dtypes.
// Query and key shards must both be the layout's (ShapeError).
//
// Collective contract: every rank of `comm` calls the same function with the same options and
// shapes (except the sequence length, which must be its shard's). This is checked collectively
// before any transfer: a mismatch or a bad argument on any rank makes every rank throw the same
// typed error naming the rank and what differs. A peer that stalls: every other rank throws
// CommError once it has waited RingOptions::timeout_seconds in one transfer or collective
// (wall time of that wait: set it above the slowest expected block transfer); nothing partial
// is returned. A peer that dies: Open MPI's runtime aborts the job, the other ranks with it.
// After a CommError the communicator passed in may hold a collective that can never complete
// (MPI cannot cancel one): treat it as broken (abort, or stop using it).
// The calls are thread-compatible with MPI_THREAD_FUNNELED (only the calling thread uses MPI).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "attn/error.hpp"
#include "attn/sdpa.hpp"
#include "attn/tensor.hpp"

namespace attn::dist {

// A transfer or collective failed or made no progress within the timeout (a peer died or
// stalled), or MPI returned an error.
class CommError : public Error {
 public:
  using Error::Error;
};

enum class Layout { kContiguous, kZigzag };

// The global token ranges [first, second) a rank holds, in the order its rows store them.
std::vector<std::pair<int64_t, int64_t>> shard_ranges(int64_t length, int world, int rank, Layout layout);

// The rows (dim -2) of `global` that `rank` holds, as an owning contiguous tensor.
Tensor shard(const TensorView& global, int world, int rank, Layout layout);

// Every rank's shard (dim -2) of one tensor, reassembled in global order on every rank
// (collective; the inverse of shard()). Same typed-error and timeout contract as the attention.
Tensor gather(const TensorView& local, MPI_Comm comm, Layout layout, double timeout_seconds = 300);

// What one call measured on this rank (seconds; CPU time is this process's, all threads).
// wall = setup + compute + wait (up to the loop's bookkeeping).
struct RingStats {
  double wall = 0;          // the whole call
  double setup = 0;         // duplicating the communicator, the collective argument check, packing
  double compute = 0;       // wall - setup - wait: the local work (kernels, merging, casts)
  double compute_cpu = 0;   // CPU time of the ring steps' local work
  double wait = 0;          // wall time blocked on transfers after a step's local work was done
  int64_t bytes_sent = 0;   // payload sent by this rank
  int steps = 0;            // ring steps (P; 2P for a 16-bit backward, which runs a forward ring)
};

struct RingOptions {
  Layout layout = Layout::kContiguous;
  // A rank that waits this long on a transfer or collective without progress throws CommError.
  double timeout_seconds = 300;
  // The ring's compute on a block is split into pieces of at most this many query rows, and MPI
  // is polled between pieces: MPI moves a large message only when called (no progress thread),
  // so this is what lets a transfer overlap the compute.
  int64_t progress_rows = 256;
  RingStats* stats = nullptr;  // filled when set
};

// Forward. Returns the local rows of the output (and of the LSE with need_lse: the backward
// needs it).
SdpaResult ring_attention(const TensorView& query, const TensorView& key, const TensorView& value,
                          MPI_Comm comm, const SdpaOptions& options = {}, const RingOptions& ring = {});

// Backward: gradients of the local query, key and value rows (d(sinks) summed over every rank,
// identical on each). `forward` holds views of this rank's forward output and LSE.
// With bfloat16 / float16 inputs it first recomputes the output in float32 with a forward ring
// (as the single-process backward recomputes it: D = rowsum(dO * O) from the 16-bit output
// would put its rounding into every dS), then runs the backward ring in float32; K/V then travel
// in float32, twice the bytes.
SdpaGrads ring_attention_backward(const TensorView& grad_output, const TensorView& query,
                                  const TensorView& key, const TensorView& value,
                                  const SdpaSaved& forward, MPI_Comm comm,
                                  const SdpaOptions& options = {}, const RingOptions& ring = {});

// DeepSpeed-Ulysses head parallelism: same inputs, layouts, results and contract as
// ring_attention (RingOptions::progress_rows is unused; RingStats::wait is the all-to-alls).
SdpaResult ulysses_attention(const TensorView& query, const TensorView& key, const TensorView& value,
                             MPI_Comm comm, const SdpaOptions& options = {}, const RingOptions& ring = {});
SdpaGrads ulysses_attention_backward(const TensorView& grad_output, const TensorView& query,
                                     const TensorView& key, const TensorView& value,
                                     const SdpaSaved& forward, MPI_Comm comm,
                                     const SdpaOptions& options = {}, const RingOptions& ring = {});

}  // namespace attn::dist
