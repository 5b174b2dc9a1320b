// What the ring's forward and backward share: the pieces of the sequence a rank holds, the checks
// every rank runs before the collective agreement, and the options of one block's kernel call.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attn/dist.hpp"
#include "dist/comm.hpp"

namespace attn::dist::detail {

// Global tokens [begin, end) stored from local row `row` on.
struct Piece {
  int64_t begin, end, row;
};
std::vector<Piece> pieces(int64_t length, int world, int rank, Layout layout);
int64_t rows_of(int64_t length, int world, int rank, Layout layout);

// Whether some query of `q` sees some key of `k` by position (is_causal, window_size).
bool band_visible(const Piece& q, const Piece& k, const SdpaOptions& o, int64_t length);

// The options of one (query piece, key piece) kernel call: global positions, LSE, no sinks
// (folded in once by the caller), top-left alignment (positions are global).
SdpaOptions block_options(const SdpaOptions& o, const Piece& q, const Piece& k);

// The local checks (refused options, check_sdpa on this rank's slices) and the signature every
// rank must share; throws attn errors (local_check turns them into the Agreement's error).
Agreement check_ring_args(const TensorView& q, const TensorView& k, const TensorView& v,
                          const SdpaOptions& o, const RingOptions& ring, const char* who);
// The backward's own checks; returns what must also agree across ranks (grad_output and the
// saved forward's shapes without the rows, dtypes).
std::string check_ring_backward_args(const TensorView& dout, const SdpaSaved& fwd, const TensorView& q,
                                     const TensorView& k, const TensorView& v, const SdpaOptions& o, const char* who);

// d(sinks)_h = -sum over every rank's rows of head h of exp(s_h - lse) * rowsum(dO * O).
Tensor sinks_grad(const Comm& comm, const TensorView& dout, const SdpaSaved& fwd, const TensorView& sinks);

}  // namespace attn::dist::detail
