// `attn train`, `attn generate`, `attn eval` and `attn heatmap`: each adds its subcommand (options bound to
// state the returned function owns) and returns the function that runs it once parsed, giving
// the exit code. Library errors propagate to main (one line, exit 1).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <optional>
#include <string>

#include "attn/dtype.hpp"

namespace attn::cli {

std::function<int()> add_train_command(CLI::App& app);
std::function<int()> add_generate_command(CLI::App& app);
std::function<int()> add_heatmap_command(CLI::App& app);
std::function<int()> add_eval_command(CLI::App& app);

// --kv-dtype's names: f32, bf16, f16, int8; nullopt for another.
std::optional<DType> parse_kv_dtype(const std::string& name);

// Sets OpenMP's and OpenBLAS's thread counts (0: leave the defaults).
void set_threads(int threads);
// Tunes glibc's allocator for loops that free and reallocate the same tensors (no-op elsewhere).
void keep_freed_memory();

}  // namespace attn::cli
