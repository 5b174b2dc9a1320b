// `attn demo` prints, step by step, exactly what PyTorch prints for the chapter's code.
//
// Two independent references: the printed outputs of the book's notebook cells
// (tests/fixtures/chapter3.md, a copy of shared/reference/chapter3.md) and, for every step,
// the output of the same code under PyTorch 1.13.1 (tests/fixtures/demo.txt from gen_demo.py).
// attn has no autograd, so PyTorch's ", grad_fn=<...>" suffixes are removed before comparing.
#include <fstream>
#include <gtest/gtest.h>
#include <regex>
#include <set>
#include <sstream>

#include "demo.hpp"
#include "fixture.hpp"

namespace attn::demo {
// Names parameterised tests by the step instead of a byte dump.
void PrintTo(const Step& step, std::ostream* os) { *os << step.name; }
}  // namespace attn::demo

namespace {

std::string strip_grad_fn(const std::string& s) {
  static const std::regex grad_fn(R"(,\s*grad_fn=<\w+>)");
  return std::regex_replace(s, grad_fn, "");
}

std::string trim_trailing_newlines(std::string s) {
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

// Cell number -> printed output, for the cells of chapter3.md that list one.
std::map<int, std::string> chapter_outputs() {
  std::ifstream in(std::string(ATTN_FIXTURE_DIR) + "/chapter3.md");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string md = ss.str();
  std::map<int, std::string> out;
  static const std::regex cell(R"(## Notebook cell (\d+)[^\n]*\n)");
  const std::string marker = "Printed output:\n\n```\n";
  for (auto it = std::sregex_iterator(md.begin(), md.end(), cell); it != std::sregex_iterator(); ++it) {
    const size_t start = static_cast<size_t>(it->position(0) + it->length(0));
    const size_t next = md.find("## Notebook cell", start);
    const std::string body = md.substr(start, next == std::string::npos ? std::string::npos : next - start);
    const size_t m = body.find(marker);
    if (m == std::string::npos) continue;
    const size_t end = body.find("\n```", m + marker.size());
    out[std::stoi((*it)[1])] = body.substr(m + marker.size(), end - m - marker.size());
  }
  return out;
}

class DemoStep : public testing::TestWithParam<attn::demo::Step> {};

TEST_P(DemoStep, PrintsWhatPyTorchPrints) {
  static const attn::test::FixtureFile expected = attn::test::load_fixtures("demo.txt");
  const attn::demo::Step& step = GetParam();
  EXPECT_EQ(trim_trailing_newlines(attn::demo::run_step(step)),
            strip_grad_fn(expected.text(step.name)))
      << "step " << step.name;
}

std::string param_name(const testing::TestParamInfo<attn::demo::Step>& info) {
  std::string n = info.param.name;
  for (char& c : n) {
    if (c == '-') c = '_';
  }
  return n;
}

INSTANTIATE_TEST_SUITE_P(AllSteps, DemoStep,
                         testing::ValuesIn(attn::demo::steps().begin(), attn::demo::steps().end()),
                         param_name);

// The steps whose notebook cell has a printed output in the book.
std::vector<attn::demo::Step> book_steps() {
  const std::map<int, std::string> book = chapter_outputs();
  std::vector<attn::demo::Step> v;
  for (const attn::demo::Step& s : attn::demo::steps()) {
    if (book.count(s.cell)) v.push_back(s);
  }
  return v;
}

class BookCell : public testing::TestWithParam<attn::demo::Step> {};

TEST_P(BookCell, DemoPrintsTheBooksOutput) {
  static const std::map<int, std::string> book = chapter_outputs();
  const attn::demo::Step& step = GetParam();
  EXPECT_EQ(trim_trailing_newlines(attn::demo::run_step(step)), strip_grad_fn(book.at(step.cell)))
      << "step " << step.name << " (cell " << step.cell << ")";
}

INSTANTIATE_TEST_SUITE_P(Chapter3, BookCell, testing::ValuesIn(book_steps()), param_name);

TEST(Demo, BookHasPrintedOutputsToCompare) {
  // Guards the parser: if chapter3.md stopped parsing, BookCell would silently test nothing.
  EXPECT_GE(book_steps().size(), 30u);
}

TEST(Demo, EveryBookCellWithOutputIsAStep) {
  std::set<int> cells;
  for (const attn::demo::Step& s : attn::demo::steps()) cells.insert(s.cell);
  for (const auto& [cell, text] : chapter_outputs()) {
    if (cell == 3) continue;  // the torch version banner
    EXPECT_TRUE(cells.count(cell)) << "chapter cell " << cell << " has no demo step";
  }
}

TEST(Demo, EveryFixtureStepExistsAndNamesAreUnique) {
  const attn::test::FixtureFile expected = attn::test::load_fixtures("demo.txt");
  std::set<std::string> names;
  for (const attn::demo::Step& s : attn::demo::steps()) {
    EXPECT_TRUE(names.insert(s.name).second) << "duplicate step " << s.name;
    EXPECT_TRUE(expected.texts.count(s.name)) << "no PyTorch output for step " << s.name;
  }
  for (const auto& [name, text] : expected.texts) {
    EXPECT_NE(attn::demo::find_step(name), nullptr) << "fixture step " << name << " missing";
  }
  EXPECT_EQ(attn::demo::find_step("no-such-step"), nullptr);
}

TEST(Demo, StepsAreIndependentOfOrder) {
  // Each step re-seeds what it uses, so running one alone or after others prints the same.
  const attn::demo::Step* dropout = attn::demo::find_step("dropout-weights");
  ASSERT_NE(dropout, nullptr);
  const std::string alone = attn::demo::run_step(*dropout);
  attn::demo::run_step(*attn::demo::find_step("variance"));
  EXPECT_EQ(attn::demo::run_step(*dropout), alone);
}

}  // namespace
