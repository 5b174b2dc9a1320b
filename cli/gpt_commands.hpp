// `attn train`, `attn generate` and `attn heatmap`: each adds its subcommand (options bound to
// state the returned function owns) and returns the function that runs it once parsed, giving
// the exit code. Library errors propagate to main (one line, exit 1).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace attn::cli {

std::function<int()> add_train_command(CLI::App& app);
std::function<int()> add_generate_command(CLI::App& app);
std::function<int()> add_heatmap_command(CLI::App& app);

// Sets OpenMP's and OpenBLAS's thread counts (0: leave the defaults).
void set_threads(int threads);
// Tunes glibc's allocator for loops that free and reallocate the same tensors (no-op elsewhere).
void keep_freed_memory();

}  // namespace attn::cli
