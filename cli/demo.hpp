// `attn demo`: the chapter's steps, each printing exactly what the same PyTorch code prints.
//
// Every step is self-contained (it re-seeds and rebuilds what it needs), so `attn demo --step
// NAME` runs one step alone and tests can compare each step's text with PyTorch's.
#pragma once

#include <iosfwd>
#include <span>
#include <string>
#include <string_view>

namespace attn::demo {

struct Step {
  const char* name;   // what `--step` takes
  const char* title;  // one line for the learner
  int cell;           // notebook cell in shared/reference/chapter3.md; 0 for the seed notes' steps
  void (*run)(std::ostream& out);
};

std::span<const Step> steps();
const Step* find_step(std::string_view name);  // nullptr if unknown
std::string run_step(const Step& step);        // the step's printed output
void run_all(std::ostream& out);               // every step with a heading

}  // namespace attn::demo
