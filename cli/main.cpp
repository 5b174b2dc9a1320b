// The `attn` command-line tool. Subcommands are thin: they parse arguments (CLI11) and call the
// library; every attn::Error becomes one line on stderr and exit code 1.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <iostream>

#include "attn/error.hpp"
#include "demo.hpp"

namespace {

std::string step_list() {
  std::string s;
  for (const attn::demo::Step& step : attn::demo::steps()) {
    s += fmt::format("  {:<22} {}\n", step.name, step.title);
  }
  return s;
}

int run_demo(const std::string& step_name, bool list) {
  if (list) {
    std::cout << step_list();
    return 0;
  }
  if (step_name.empty()) {
    attn::demo::run_all(std::cout);
    return 0;
  }
  const attn::demo::Step* step = attn::demo::find_step(step_name);
  if (step == nullptr) {
    std::cerr << "attn demo: unknown step '" << step_name << "'; the steps are:\n" << step_list();
    return 2;
  }
  std::cout << attn::demo::run_step(*step);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "attn: attention mechanisms of transformer language models, with PyTorch's numbers.\n"
      "Run `attn demo` to walk through chapter 3 of \"Build a Large Language Model (From\n"
      "Scratch)\": every tensor printed is the one PyTorch prints for the same code and seed."};
  app.require_subcommand(1);
  app.footer(
      "Each subcommand has its own --help. Tensors are printed in PyTorch's format; seeds give\n"
      "PyTorch's weights and dropout masks (x86 AVX2 kernels, torch 1.13). Errors are reported\n"
      "on one line with exit code 1; usage errors exit with 2.");

  std::string step;
  bool list = false;
  CLI::App* demo = app.add_subcommand(
      "demo",
      "Walk through the chapter step by step on \"Your journey starts with one step\":\n"
      "dot-product scores, naive and stable softmax, context vectors, trainable weights\n"
      "(SelfAttention v1/v2), causal masks, dropout, CausalAttention, multi-head attention,\n"
      "embeddings from a vocabulary and the variance argument for 1/sqrt(d_k).");
  demo->add_option("--step", step, "Print only this step (see --list)");
  demo->add_flag("--list", list, "List the steps and exit");
  demo->footer("Steps:\n" + step_list());

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints the help or the usage error
    return code == 0 ? 0 : 2;
  }
  try {
    if (demo->parsed()) return run_demo(step, list);
  } catch (const attn::Error& e) {
    std::cerr << "attn: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
