// Heatmap rendering (heatmap_render.hpp): canvas, 5x7 font, layout, libpng output.
#include "heatmap_render.hpp"

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <fmt/format.h>
#include <png.h>

#include "attn/safetensors.hpp"

namespace attn::cli {

namespace {

// A 5x7 bitmap font drawn for this tool: 7 rows of 5 pixels per glyph, '#' set.
struct Glyph {
  char c;
  const char* rows;  // 35 characters, row by row
};
constexpr Glyph kFont[] = {
    {' ', "..................................."},
    {'0', ".###.#...##..###.#.###..##...#.###."}, {'1', "..#...##....#....#....#....#...###."},
    {'2', ".###.#...#....#...#...#...#...#####"}, {'3', "#####...#...#.....#.....##...#.###."},
    {'4', "...#...##..#.#.#..#.#####...#....#."}, {'5', "######....####.....#....##...#.###."},
    {'6', "..##..#...#....####.#...##...#.###."}, {'7', "#####....#...#...#...#....#....#..."},
    {'8', ".###.#...##...#.###.#...##...#.###."}, {'9', ".###.#...##...#.####....#...#..##.."},
    {'A', ".###.#...##...#######...##...##...#"}, {'B', "####.#...##...#####.#...##...#####."},
    {'C', ".###.#...##....#....#....#...#.###."}, {'D', "###..#..#.#...##...##...##..#.###.."},
    {'E', "######....#....####.#....#....#####"}, {'F', "######....#....####.#....#....#...."},
    {'G', ".###.#...##....#.####...##...#.####"}, {'H', "#...##...##...#######...##...##...#"},
    {'I', ".###...#....#....#....#....#...###."}, {'J', "..###...#....#....#....#.#..#..##.."},
    {'K', "#...##..#.#.#..##...#.#..#..#.#...#"}, {'L', "#....#....#....#....#....#....#####"},
    {'M', "#...###.###.#.##.#.##...##...##...#"}, {'N', "#...##...###..##.#.##..###...##...#"},
    {'O', ".###.#...##...##...##...##...#.###."}, {'P', "####.#...##...#####.#....#....#...."},
    {'Q', ".###.#...##...##...##.#.##..#..##.#"}, {'R', "####.#...##...#####.#.#..#..#.#...#"},
    {'S', ".#####....#.....###.....#....#####."}, {'T', "#####..#....#....#....#....#....#.."},
    {'U', "#...##...##...##...##...##...#.###."}, {'V', "#...##...##...##...##...#.#.#...#.."},
    {'W', "#...##...##...##.#.##.#.##.#.#.#.#."}, {'X', "#...##...#.#.#...#...#.#.#...##...#"},
    {'Y', "#...##...#.#.#...#....#....#....#.."}, {'Z', "#####....#...#...#...#...#....#####"},
    {'a', "...........###.....#.#####...#.####"}, {'b', "#....#....#.##.##..##...##...#####."},
    {'c', "...........###.#....#....#...#.###."}, {'d', "....#....#.##.##..###...##...#.####"},
    {'e', "...........###.#...#######.....###."}, {'f', "..##..#..#.#...###...#....#....#..."},
    {'g', "......#####...##...#.####....#.###."}, {'h', "#....#....#.##.##..##...##...##...#"},
    {'i', "..#........##....#....#....#...###."}, {'j', "...#........##....#....#.#..#..##.."},
    {'k', "#....#....#..#.#.#..##...#.#..#..#."}, {'l', ".##....#....#....#....#....#...###."},
    {'m', "..........##.#.#.#.##.#.##...##...#"}, {'n', "..........#.##.##..##...##...##...#"},
    {'o', "...........###.#...##...##...#.###."}, {'p', "..........####.#...#####.#....#...."},
    {'q', "...........##.##..##.####....#....#"}, {'r', "..........#.##.##..##....#....#...."},
    {'s', "...........###.#.....###.....#####."}, {'t', ".#....#...###..#....#....#..#..##.."},
    {'u', "..........#...##...##...##..##.##.#"}, {'v', "..........#...##...##...#.#.#...#.."},
    {'w', "..........#...##...##.#.##.#.#.#.#."}, {'x', "..........#...#.#.#...#...#.#.#...#"},
    {'y', "..........#...##...#.####....#.###."}, {'z', "..........#####...#...#...#...#####"},
    {'|', "..#....#....#....#....#....#....#.."}, {'.', "..........................##...##.."},
    {',', "....................##....#...#...."}, {'-', "...............#####..............."},
    {':', ".....##...##.........##...##......."}, {'(', "...#...#...#....#....#.....#.....#."},
    {')', ".#.....#.....#....#....#...#...#..."}, {'=', "..........#####.....#####.........."},
    {'/', "....#...#....#...#...#....#...#...."}, {'_', "..............................#####"},
    {'#', ".#.#..#.#.#####.#.#.#####.#.#..#.#."}, {'+', "......#....#..#####..#....#........"},
    {'\'', "..#....#...#......................."}, {'?', ".###.#...#....#...#...#.........#.."},
    {'"', ".#.#..#.#.........................."}, {'^', "..#...#.#.#...#...................."},
    {'>', ".#.....#.....#.....#...#...#...#..."}, {'<', "...#...#...#...#.....#.....#.....#."},
};

const char* glyph(char c) {
  for (const Glyph& g : kFont) {
    if (g.c == c) return g.rows;
  }
  return glyph('?');
}

struct Rgb {
  uint8_t r, g, b;
};
constexpr Rgb kWhite{255, 255, 255}, kBlack{0, 0, 0}, kGray{200, 200, 200}, kRed{220, 30, 30};
constexpr int kScale = 2;                 // font pixels per glyph pixel
constexpr int kAdvance = 6 * kScale;      // glyph width plus one column of spacing
constexpr int kLineHeight = 9 * kScale;

class Canvas {
 public:
  Canvas(int w, int h) : img_{w, h, std::vector<uint8_t>(static_cast<size_t>(w) * h * 3, 255)} {}
  void pixel(int x, int y, Rgb c) {
    if (x < 0 || y < 0 || x >= img_.width || y >= img_.height) return;
    uint8_t* p = &img_.rgb[(static_cast<size_t>(y) * img_.width + x) * 3];
    p[0] = c.r, p[1] = c.g, p[2] = c.b;
  }
  void rect(int x, int y, int w, int h, Rgb c) {
    for (int j = 0; j < h; ++j)
      for (int i = 0; i < w; ++i) pixel(x + i, y + j, c);
  }
  void outline(int x, int y, int w, int h, Rgb c) {
    rect(x, y, w, 2, c), rect(x, y + h - 2, w, 2, c), rect(x, y, 2, h, c), rect(x + w - 2, y, 2, h, c);
  }
  // Text with its top-left corner at (x, y); scale s.
  void text(int x, int y, const std::string& s, Rgb c, int scale = kScale) {
    for (size_t k = 0; k < s.size(); ++k) {
      const char* g = glyph(s[k]);
      for (int gy = 0; gy < 7; ++gy)
        for (int gx = 0; gx < 5; ++gx)
          if (g[gy * 5 + gx] == '#') rect(x + (static_cast<int>(k) * 6 + gx) * scale, y + gy * scale, scale, scale, c);
    }
  }
  // Text rotated 90 degrees counter-clockwise (reading upwards), its baseline's start at (x, y).
  void text_up(int x, int y, const std::string& s, Rgb c) {
    for (size_t k = 0; k < s.size(); ++k) {
      const char* g = glyph(s[k]);
      for (int gy = 0; gy < 7; ++gy)
        for (int gx = 0; gx < 5; ++gx)
          if (g[gy * 5 + gx] == '#') {
            rect(x + gy * kScale, y - (static_cast<int>(k) * 6 + gx + 1) * kScale, kScale, kScale, c);
          }
    }
  }
  Image take() { return std::move(img_); }

 private:
  Image img_;
};

// White to dark blue.
Rgb colour(float w) {
  const float t = std::clamp(std::isfinite(w) ? w : 0.0f, 0.0f, 1.0f);
  auto lerp = [t](int a, int b) { return static_cast<uint8_t>(std::lround(a + (b - a) * t)); };
  return {lerp(255, 8), lerp(255, 48), lerp(255, 107)};
}

int max_len(const std::vector<std::string>& v) {
  size_t n = 0;
  for (const std::string& s : v) n = std::max(n, s.size());
  return static_cast<int>(n);
}

}  // namespace

Image render_heatmaps(const std::vector<HeatPanel>& panels, int columns, const std::string& title) {
  if (panels.empty()) throw ValueError("heatmap: nothing to draw");
  columns = std::max(1, std::min<int>(columns, static_cast<int>(panels.size())));
  int64_t n = 0;
  int label_w = 0, label_h = 0, title_w = 0;
  for (const HeatPanel& p : panels) {
    n = std::max({n, p.rows, p.cols});
    label_w = std::max(label_w, max_len(p.row_labels) * kAdvance);
    label_h = std::max(label_h, max_len(p.col_labels) * kAdvance);
    title_w = std::max(title_w, static_cast<int>(p.title.size()) * kAdvance);
  }
  const int cell = n <= 8 ? 56 : n <= 16 ? 28 : 16;
  const int grid = static_cast<int>(n) * cell;
  const int pad = 16;
  const int panel_w = std::max(label_w + 8 + grid, title_w) + pad;
  const int panel_h = kLineHeight + label_h + 8 + grid + pad;
  const int rows = (static_cast<int>(panels.size()) + columns - 1) / columns;
  const int top = pad + kLineHeight + 8;
  Canvas cv(pad + columns * panel_w, top + rows * panel_h);
  cv.text(pad, pad, title, kBlack);
  for (size_t i = 0; i < panels.size(); ++i) {
    const HeatPanel& p = panels[i];
    const int ox = pad + static_cast<int>(i % columns) * panel_w;
    const int oy = top + static_cast<int>(i / columns) * panel_h;
    cv.text(ox, oy, p.title, kBlack);
    const int gx = ox + label_w + 8, gy = oy + kLineHeight + label_h + 8;
    for (int64_t r = 0; r < p.rows; ++r) {
      for (int64_t c = 0; c < p.cols; ++c) {
        const float w = p.weights[static_cast<size_t>(r * p.cols + c)];
        const int x = gx + static_cast<int>(c) * cell, y = gy + static_cast<int>(r) * cell;
        cv.rect(x, y, cell, cell, colour(w));
        if (cell >= 56) {  // small maps: the weight itself, 0.xx
          const std::string s = fmt::format("{:.2f}", w);
          cv.text(x + (cell - static_cast<int>(s.size()) * 6) / 2, y + cell / 2 - 3, s,
                  w > 0.5f ? kWhite : kBlack, 1);
        }
      }
    }
    // Cell borders, then the outlined cells on top.
    for (int64_t k = 0; k <= p.rows; ++k) cv.rect(gx, gy + static_cast<int>(k) * cell, static_cast<int>(p.cols) * cell, 1, kGray);
    for (int64_t k = 0; k <= p.cols; ++k) cv.rect(gx + static_cast<int>(k) * cell, gy, 1, static_cast<int>(p.rows) * cell, kGray);
    for (const auto& [r, c] : p.marks) {
      cv.outline(gx + static_cast<int>(c) * cell, gy + static_cast<int>(r) * cell, cell + 1, cell + 1, kRed);
    }
    for (size_t r = 0; r < p.row_labels.size(); ++r) {
      const std::string& s = p.row_labels[r];
      cv.text(gx - 6 - static_cast<int>(s.size()) * kAdvance, gy + static_cast<int>(r) * cell + (cell - 7 * kScale) / 2, s, kBlack);
    }
    for (size_t c = 0; c < p.col_labels.size(); ++c) {
      cv.text_up(gx + static_cast<int>(c) * cell + (cell - 7 * kScale) / 2, gy - 6, p.col_labels[c], kBlack);
    }
  }
  return cv.take();
}

void write_png(const Image& image, const std::string& path) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) throw IoError(fmt::format("{}: cannot open for writing", tmp));
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png != nullptr ? png_create_info_struct(png) : nullptr;
  if (png == nullptr || info == nullptr || setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    std::fclose(f);
    std::remove(tmp.c_str());
    throw IoError(fmt::format("{}: libpng could not write the image", path));
  }
  png_init_io(png, f);
  png_set_IHDR(png, info, static_cast<png_uint_32>(image.width), static_cast<png_uint_32>(image.height), 8,
               PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < image.height; ++y) {
    png_write_row(png, const_cast<png_bytep>(&image.rgb[static_cast<size_t>(y) * image.width * 3]));
  }
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  const bool ok = std::fflush(f) == 0;
  if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw IoError(fmt::format("{}: cannot write the image", path));
  }
}

}  // namespace attn::cli
