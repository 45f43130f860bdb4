// The skinny product's tiles for AVX2 and FMA (skinny_linear_cpu.cpp has the design and the AVX-512 tiles).
//
// Why its own tiles: AVX2-only CPUs (the EPYCs CPU users decode on) have 16 vector registers of 8 floats.
// Without these, one sentence's products went to MKL: its beam of 5 rows to the packed product, which
// re-reads W per block of rows, and the rows' bits depended on the rows beside them.
//
// How: W is taken 8 rows at a time; 8 accumulators (rows of x times rows of W: 1 x 8 for a single row,
// 4 x 2 for up to four rows sharing each load of W) run along k and are reduced together into one vector of
// 8 totals. 8 accumulators, 2 loads of W and one of x fit the 16 registers, so nothing waits on the stack.
//
// Determinism: as the AVX-512 tiles, each output is its accumulator's chain of FMAs along k and the same
// reduction tree, whatever block computes it. The bits differ from the AVX-512 tiles' (8 lanes, not 16).

#include "skinny_tiles_cpu.h"

#include <immintrin.h>

#include <algorithm>

namespace {

constexpr int64_t kTile = kSkinnyTileAvx2;

// The totals of 8 accumulators, accumulator r's in lane r. Every accumulator's lanes are summed by the same
// tree, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
__attribute__((target("avx2,fma"))) inline __m256 reduce8(const __m256 (&a)[kTile]) {
  const __m256 c0 = _mm256_hadd_ps(a[0], a[1]), c1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 c2 = _mm256_hadd_ps(a[4], a[5]), c3 = _mm256_hadd_ps(a[6], a[7]);
  // d0: per 128-bit half, the halves' sums of accumulators 0-3; d1: of accumulators 4-7.
  const __m256 d0 = _mm256_hadd_ps(c0, c1), d1 = _mm256_hadd_ps(c2, c3);
  return _mm256_add_ps(_mm256_permute2f128_ps(d0, d1, 0x20), _mm256_permute2f128_ps(d0, d1, 0x31));
}

// Rows m0 .. m0 + MB - 1 of x (those below ``rows``) against rows r0 .. r0 + R - 1 of W (those below n):
// MB x R accumulators (of the 8 that reduce8 sums, the rest zero). MB rows of x share each load of W.
template <int MB, int R>
__attribute__((target("avx2,fma"))) inline void block(const float* x, int64_t m0, int64_t rows, const float* w,
                                                        int64_t n, int64_t k, int64_t r0, const float* bias, float* y,
                                                        int64_t ahead) {
  static_assert(MB * R <= kTile, "8 accumulators");
  const int64_t chunks = k / 8;
  const int64_t rest = k % 8;
  const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rest)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const float* xr[MB];
  row_pointers(x, m0, rows, k, xr);
  const float* wr[R];
  row_pointers(w, r0, n, k, wr);
  __m256 acc[kTile];
#pragma GCC unroll 8
  for (int i = 0; i < kTile; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(wr[r] + ahead + c * 8), _MM_HINT_T0);
    __m256 wv[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(wr[r] + c * 8);
#pragma GCC unroll 8
    for (int b = 0; b < MB; ++b) {
      const __m256 xv = _mm256_loadu_ps(xr[b] + c * 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[b * R + r] = _mm256_fmadd_ps(wv[r], xv, acc[b * R + r]);
    }
  }
  if (rest != 0) {
#pragma GCC unroll 8
    for (int b = 0; b < MB; ++b) {
      const __m256 xv = _mm256_maskload_ps(xr[b] + chunks * 8, tail);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        acc[b * R + r] = _mm256_fmadd_ps(_mm256_maskload_ps(wr[r] + chunks * 8, tail), xv, acc[b * R + r]);
      }
    }
  }
  alignas(32) float total[kTile];
  _mm256_store_ps(total, reduce8(acc));
  for (int b = 0; b < MB && m0 + b < rows; ++b) {
    float* out = y + (m0 + b) * n + r0;
    for (int r = 0; r < R && r0 + r < n; ++r) out[r] = bias != nullptr ? total[b * R + r] + bias[r0 + r] : total[b * R + r];
  }
}

}  // namespace

__attribute__((target("avx2,fma"))) void skinny_tiles_avx2(const float* x, int64_t rows, const float* w, int64_t n,
                                                           int64_t k, const float* bias, float* y, int64_t first,
                                                           int64_t last, const float* residual, bool relu) {
  const int64_t ahead = prefetch_distance(kTile, k);
  for (int64_t t = first; t < last; ++t) {
    const int64_t n0 = t * kTile;
    // Blocks of 4 rows of x (the last one padded, as the AVX-512 tiles), and a single row alone.
    for (int64_t m0 = 0; m0 < rows; m0 += 4) {
      if (rows - m0 == 1) {
        block<1, 8>(x, m0, rows, w, n, k, n0, bias, y, ahead);
      } else {
        for (int64_t r0 = n0; r0 < n0 + kTile && r0 < n; r0 += 2) block<4, 2>(x, m0, rows, w, n, k, r0, bias, y, ahead);
      }
    }
    if (residual != nullptr || relu) finish_tile(y, rows, n, n0, kTile, residual, relu);
  }
}
