// The skinny product's tiles, one set per instruction set, and what they share (skinny_linear_cpu.cpp
// chooses one at run time; skinny_linear_avx512_cpu.cpp and skinny_linear_avx2_cpu.cpp hold them, both the
// tile loop of skinny_block_cpu.h over their own vector type).
#pragma once

#include "skinny_linear_cpu.h"

#include <algorithm>
#include <cstdint>

// Hidden: called only within this library. At default visibility every call of a template instance (a
// block, from its tiles) went through the PLT.
#pragma GCC visibility push(hidden)

// Software prefetch into L1, how far ahead of the row of W a block reads (prefetch_distance).
//
// Where a tile fits half of a 48 KB L1: the same lines of the next tile's rows. A step's weights stream from
// L3 or memory, and on the Multi30k transformer (k = 256, 16 KB tiles) the hardware prefetcher alone held one
// Xeon thread at 27 GB/s on 16 interleaved rows (prefetching: one sentence in float32, greedy 5% and beam 5
// 12% faster). At WMT'19's k = 1024 (64 KB tiles) those prefetched lines evicted the tile in use: beam 5 on
// the stand-in 5% slower with them (24.2 against 22.9 s).
constexpr int64_t kPrefetchTileBytes = 24 * 1024;
// Larger tiles: 512 bytes further along each row read. The stand-in, one sentence at a time, beam 5, one
// Xeon thread: 24.4-24.8 s without, 22.9 with on the AVX2 tiles (1 KB ahead: 23.3, 2 KB: 24.3); 22.4-22.8
// and 22.0 on the AVX-512 tiles.
constexpr int64_t kPrefetchRowBytes = 512;

// How many floats ahead of its reads a block of W's rows prefetches, for tiles of `tile` rows of k floats.
inline int64_t prefetch_distance(int64_t tile, int64_t k) {
  const bool fits = tile * k * static_cast<int64_t>(sizeof(float)) <= kPrefetchTileBytes;
  return fits ? tile * k : kPrefetchRowBytes / static_cast<int64_t>(sizeof(float));
}

// out[i] points at row first + i of a (count, k) row-major matrix; rows past its end point at its last row
// (a block's padding rows: read, their outputs not stored).
template <int N>
inline void row_pointers(const float* a, int64_t first, int64_t count, int64_t k, const float* (&out)[N]) {
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) out[i] = a + std::min(first + i, count - 1) * k;
}

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

// The members of a vector type for skinny_block_cpu.h whose intrinsics differ only by their prefix (mm:
// _mm256 or _mm512): zero, load, fmadd (a * b + c, one rounding), store (aligned).
#define FS_SKINNY_VECTOR_OPS(mm)                                                     \
  static Vec zero() { return mm##_setzero_ps(); }                                    \
  static Vec load(const float* p) { return mm##_loadu_ps(p); }                       \
  static Vec fmadd(Vec a, Vec b, Vec c) { return mm##_fmadd_ps(a, b, c); }           \
  static void store(float* p, Vec v) { mm##_store_ps(p, v); }

// Rows of W per tile: each tile's outputs are reduced together, one output per vector lane.
constexpr int64_t kSkinnyTileAvx512 = 16;
constexpr int64_t kSkinnyTileAvx2 = 8;

// W's rows tile * first .. tile * last - 1 (tiles of kSkinnyTileAvx512 or kSkinnyTileAvx2 rows) against every
// row of x, then relu_then_residual where asked. Each needs its instruction set.
namespace avx512 {
void tiles(const float* x, int64_t rows, const float* w, int64_t n, int64_t k, const float* bias, float* y,
           int64_t first, int64_t last, const float* residual, bool relu);
}  // namespace avx512
namespace avx2 {
void tiles(const float* x, int64_t rows, const float* w, int64_t n, int64_t k, const float* bias, float* y,
           int64_t first, int64_t last, const float* residual, bool relu);
}  // namespace avx2

#pragma GCC visibility pop
