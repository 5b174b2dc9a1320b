// ThreadSanitizer canary for scripts/sanitize.sh: proves that the TSan + OpenMP setup sees what
// it must and nothing else, before the project's tests are trusted to it.
//
//   tsan_canary clean   the fused kernel's OpenMP pattern (a team per call, per-thread scratch,
//                       `omp for schedule(dynamic)` writing disjoint rows of a shared output, the
//                       caller reading it after the region; a second region whose threads read
//                       what other threads wrote in the first). Correct code: must give no report.
//                       Without Archer (OMP_TOOL=disabled) TSan cannot see libomp's barriers and
//                       reports false races here, which is how the script shows Archer is active.
//   tsan_canary race    the same with one unsynchronised counter shared by every iteration: a real
//                       race, which TSan must report (exit code 66 with TSAN_OPTIONS' default).
//
// Built by the script with clang++ -fsanitize=thread -fopenmp (LLVM's libomp), not by CMake.
#include <omp.h>

#include <cstdio>
#include <cstring>
#include <vector>

int main(int argc, char** argv) {
  const bool race = argc > 1 && std::strcmp(argv[1], "race") == 0;
  constexpr int kRows = 256, kCols = 16;
  std::vector<float> in(kRows * kCols), out(kRows * kCols, 0.0f), again(kRows, 0.0f);
  for (int i = 0; i < kRows * kCols; ++i) in[i] = static_cast<float>(i % 7);
  long shared_counter = 0;

  for (int call = 0; call < 4; ++call) {
#pragma omp parallel num_threads(4)
    {
      std::vector<float> ws(kCols);  // per-thread scratch, as the kernel's workspace
#pragma omp for schedule(dynamic, 1)
      for (int r = 0; r < kRows; ++r) {
        for (int c = 0; c < kCols; ++c) ws[c] = in[r * kCols + c] * 2.0f;
        for (int c = 0; c < kCols; ++c) out[r * kCols + c] += ws[c];
        if (race) ++shared_counter;  // the bug TSan must find
      }
    }
    // The caller reads the output after the implicit barrier.
    double sum = 0.0;
    for (float x : out) sum += x;
    // A second region, rows assigned in reverse so threads read other threads' writes.
#pragma omp parallel for schedule(static) num_threads(4)
    for (int r = kRows - 1; r >= 0; --r) again[r] = out[r * kCols] + static_cast<float>(sum > 0.0);
  }
  std::printf("canary %s: out[0] = %g, again[0] = %g, counter = %ld\n", race ? "race" : "clean",
              static_cast<double>(out[0]), static_cast<double>(again[0]), shared_counter);
  return 0;
}
