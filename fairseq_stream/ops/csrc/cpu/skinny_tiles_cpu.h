// The skinny product's tile loops, one per instruction set, and what they share (skinny_linear_cpu.cpp
// chooses one at run time; skinny_linear_avx2_cpu.cpp holds the AVX2 one).
#pragma once

#include "skinny_linear_cpu.h"

#include <algorithm>
#include <cstdint>

// Software prefetch of the next tile, into L1, only where a tile fits half of a 48 KB L1: a step's weights
// stream from L3 or memory, and on the Multi30k transformer (k = 256, 16 KB tiles) the hardware prefetcher
// alone held one Xeon thread at 27 GB/s on 16 interleaved rows (prefetching: one sentence in float32, greedy
// 5% and beam 5 12% faster). At WMT'19's k = 1024 (64 KB tiles) the prefetched lines evicted the tile in
// use: beam 5 on the stand-in 5% slower with them (24.2 against 22.9 s).
constexpr int64_t kPrefetchTileBytes = 24 * 1024;

// relu_then_residual on a tile's outputs (columns n0 .. n0 + tile - 1) as its blocks stored them: a pass of
// its own over outputs still in L1 (inside the blocks' stores, the epilogue slowed the 4-row form by a third).
inline void finish_tile(float* y, int64_t rows, int64_t n, int64_t n0, int64_t tile, const float* residual,
                        bool relu) {
  const int64_t end = std::min(n0 + tile, n);
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t c = n0; c < end; ++c) {
      y[m * n + c] = relu_then_residual(y[m * n + c], relu, residual != nullptr ? residual + m * n + c : nullptr);
    }
  }
}

// Rows of W per tile: each tile's outputs are reduced together, one output per vector lane.
constexpr int64_t kSkinnyTileAvx512 = 16;
constexpr int64_t kSkinnyTileAvx2 = 8;

// W's rows tile * first .. tile * last - 1 against every row of x, then relu_then_residual where asked.
// Needs AVX2 and FMA.
void skinny_tiles_avx2(const float* x, int64_t rows, const float* w, int64_t n, int64_t k, const float* bias,
                       float* y, int64_t first, int64_t last, const float* residual, bool relu);
