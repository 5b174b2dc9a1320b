// `attn ring` (built with attn::dist): ring attention under `mpirun -np P attn ring`, timed and
// optionally checked against the single-process fused kernel.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace attn::cli {

std::function<int()> add_ring_command(CLI::App& app);

}  // namespace attn::cli
