// Rendering attention weights as PNG heatmaps: an RGB canvas with a built-in 5x7 bitmap font for
// the token labels, panels laid out in a grid, and libpng to write the file.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace attn::cli {

// One heatmap: rows x cols weights in [0, 1] (row-major), labelled on both axes.
struct HeatPanel {
  std::string title;
  int64_t rows = 0, cols = 0;
  std::vector<float> weights;
  std::vector<std::string> row_labels, col_labels;  // queries (left), keys (top)
  std::vector<std::pair<int64_t, int64_t>> marks;   // (row, col) cells outlined in red
};

// Panels in a grid of `columns` per row under a title line; each cell's colour runs from white
// (0) to dark blue (1); cells of small maps also print their weight.
struct Image {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;  // height * width * 3
};
Image render_heatmaps(const std::vector<HeatPanel>& panels, int columns, const std::string& title);

// 8-bit RGB PNG through libpng, written to "<path>.tmp" then renamed over `path`. IoError if the
// file cannot be written.
void write_png(const Image& image, const std::string& path);

}  // namespace attn::cli
