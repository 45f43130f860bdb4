// float32 y = x W^T + b for 1 to kSkinnyMaxRows rows of x: W is read once, in its own layout.
//
// Why: at one to a few rows a decoder step is bound by reading its weights (the Multi30k output
// layer, 8 MB, takes 0.3 ms at one row on one Xeon thread). MKL's sgemm takes a skinny path at 1 to
// 3 rows and then changes method: at 4 and 5 rows the packed product costs 0.40 ms, 30% more, while
// a product that reads W once while it computes needs little more than the one-row time. One
// sentence's Jacobi window (4 or 5 positions) and one sentence's beam (5 rows) are such products.
//
// How: W is taken 16 rows at a time with AVX-512, 8 with AVX2 (a tile, read from memory once and from
// cache for the rows of x after the first four). Up to 4 rows of x share each load of W: one accumulator
// a vector lane (rows of x times rows of W) runs along k, and all are reduced together into one vector of
// totals. The tile loop is written once (skinny_block_cpu.h) over each instruction set's vector type
// (skinny_linear_avx512_cpu.cpp, skinny_linear_avx2_cpu.cpp); this file picks one at run time.
//
// Determinism: each output is the same sequence of operations on its own row of x and its own row of
// W, whatever the number of rows and wherever the row stands. A row decoded alone and the same row
// beside others (a Jacobi window against greedy's step, one sentence in a batch) get the same bits
// from this product, which MKL does not promise across row counts.

#include "skinny_linear_cpu.h"

#include "cpu_isa_cpu.h"
#include "skinny_tiles_cpu.h"

#include "parallel_cpu.h"

namespace {

bool wide_tiles() {
  static const bool wide = fs_cpu::allows_avx512() && __builtin_cpu_supports("avx512f");
  return wide;
}

}  // namespace

bool skinny_linear_available() {
  static const bool available = wide_tiles() || (fs_cpu::allows_avx2() && __builtin_cpu_supports("fma"));
  return available;
}

const char* skinny_linear_kernel() {
  if (!skinny_linear_available()) return "";
  return wide_tiles() ? "avx512" : "avx2";
}

void skinny_linear(const float* x, int64_t rows, const float* w, int64_t n, int64_t k, const float* bias, float* y,
                   const float* residual, bool relu) {
  const bool wide = wide_tiles();
  const int64_t tile = wide ? kSkinnyTileAvx512 : kSkinnyTileAvx2;
  const int64_t count = (n + tile - 1) / tile;
  // Tiles are independent and each output is computed within one: threads change nothing but speed.
  fs::parallel_for(0, count, 16, [&](int64_t first, int64_t last) {
    if (wide) {
      avx512::tiles(x, rows, w, n, k, bias, y, first, last, residual, relu);
    } else {
      avx2::tiles(x, rows, w, n, k, bias, y, first, last, residual, relu);
    }
  });
}
