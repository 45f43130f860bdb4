// float32 y = x W^T + b for 1 to kSkinnyMaxRows rows of x: W is read once, in its own layout.
//
// Why: at one to a few rows a decoder step is bound by reading its weights (the Multi30k output
// layer, 8 MB, takes 0.3 ms at one row on one Xeon thread). MKL's sgemm takes a skinny path at 1 to
// 3 rows and then changes method: at 4 and 5 rows the packed product costs 0.40 ms, 30% more, while
// a product that reads W once while it computes needs little more than the one-row time. One
// sentence's Jacobi window (4 or 5 positions) and one sentence's beam (5 rows) are such products.
//
// How: W is taken 16 rows at a time (a tile, 16 x k floats, read from memory once and from cache for
// the rows of x after the first four). Up to 4 rows of x share each load of W: 16 AVX-512
// accumulators (rows of x times rows of W) run along k and are reduced together into one vector of
// 16 totals (a transposing reduction: four rounds of shuffles and adds, the same tree for every
// accumulator).
//
// Determinism: each output is the same sequence of operations on its own row of x and its own row of
// W, whatever the number of rows and wherever the row stands. A row decoded alone and the same row
// beside others (a Jacobi window against greedy's step, one sentence in a batch) get the same bits
// from this product, which MKL does not promise across row counts.

#include "skinny_linear_cpu.h"

#include "cpu_isa_cpu.h"
#include "skinny_tiles_cpu.h"

#include "parallel_cpu.h"
#include <immintrin.h>

#include <algorithm>

namespace {
// The AVX-512 code, in a namespace of that name: the generic code compiles for a baseline without AVX-512
// (setup.py), and tests/test_install.py checks that AVX-512 instructions lie only in such functions.
namespace avx512 {

constexpr int64_t kTile = kSkinnyTileAvx512;

// The reduction leaves accumulator 4j + q's total in lane 4q + j; this gather puts accumulator r's in lane r.
__attribute__((target("avx512f"))) inline __m512i tile_order() {
  return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

// The totals of 16 accumulators, accumulator r's in lane r.
__attribute__((target("avx512f"))) inline __m512 reduce16(const __m512 (&a)[16], __m512i order) {
  __m512 c[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    // 128-bit lanes [a.L0 + a.L2, a.L1 + a.L3, b.L0 + b.L2, b.L1 + b.L3] for a = a[2i], b = a[2i + 1].
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  __m512 d[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    // 128-bit lane q: four partial sums of accumulator 4j + q.
    d[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  const __m512 e0 = _mm512_add_ps(_mm512_unpacklo_ps(d[0], d[1]), _mm512_unpackhi_ps(d[0], d[1]));
  const __m512 e1 = _mm512_add_ps(_mm512_unpacklo_ps(d[2], d[3]), _mm512_unpackhi_ps(d[2], d[3]));
  const __m512d p0 = _mm512_castps_pd(e0), p1 = _mm512_castps_pd(e1);
  const __m512 f = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p0, p1)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(p0, p1)));
  return _mm512_permutexvar_ps(order, f);
}

// Rows m0 .. m0 + MB - 1 of x (those below ``rows``) against rows r0 .. r0 + R - 1 of W (those below n):
// MB x R accumulators (of the 16 that reduce16 sums, the rest zero). MB rows of x share each load of W.
template <int MB, int R>
__attribute__((target("avx512f"))) inline void block(const float* x, int64_t m0, int64_t rows, const float* w,
                                                     int64_t n, int64_t k, int64_t r0, const float* bias, float* y,
                                                     __m512i order, int64_t ahead) {
  static_assert(MB * R <= kTile, "16 accumulators");
  const int64_t chunks = k / 16;
  const int64_t rest = k % 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << rest) - 1);
  const float* xr[MB];
  row_pointers(x, m0, rows, k, xr);
  const float* wr[R];
  row_pointers(w, r0, n, k, wr);
  __m512 acc[kTile];
#pragma GCC unroll 16
  for (int i = 0; i < kTile; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    // The same lines of the next tile's rows where a tile fits half of L1, else lines further along the row
    // (prefetch_distance). A prefetch never faults, past W's end included, and changes no arithmetic.
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(wr[r] + ahead + c * 16), _MM_HINT_T0);
#pragma GCC unroll 16
    for (int b = 0; b < MB; ++b) {
      const __m512 xv = _mm512_loadu_ps(xr[b] + c * 16);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[b * R + r] = _mm512_fmadd_ps(_mm512_loadu_ps(wr[r] + c * 16), xv, acc[b * R + r]);
    }
  }
  if (rest != 0) {
#pragma GCC unroll 16
    for (int b = 0; b < MB; ++b) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, xr[b] + chunks * 16);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        acc[b * R + r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, wr[r] + chunks * 16), xv, acc[b * R + r]);
      }
    }
  }
  alignas(64) float total[kTile];
  _mm512_store_ps(total, reduce16(acc, order));
  for (int b = 0; b < MB && m0 + b < rows; ++b) {
    float* out = y + (m0 + b) * n + r0;
    for (int r = 0; r < R && r0 + r < n; ++r) out[r] = bias != nullptr ? total[b * R + r] + bias[r0 + r] : total[b * R + r];
  }
}

// W's rows 16 * first .. 16 * last - 1 against every row of x. A group of 16 rows of W (16 x k floats)
// is read from memory by the first rows of x and from cache by the others; up to 4 rows of x share
// each load of W. Every output is one accumulator's chain along k and the same reduction, whichever
// block computes it and whatever rows pad the block.
__attribute__((target("avx512f"))) void tiles(const float* x, int64_t rows, const float* w, int64_t n, int64_t k,
                                              const float* bias, float* y, int64_t first, int64_t last,
                                              const float* residual, bool relu) {
  const __m512i order = tile_order();
  const int64_t ahead = prefetch_distance(kTile, k);
  for (int64_t t = first; t < last; ++t) {
    const int64_t n0 = t * kTile;
    // Blocks of 4 rows of x (the last one padded: 4 rows share W's loads faster than 2 or 3 do), and a
    // single row alone, which reads each load of W once.
    for (int64_t m0 = 0; m0 < rows; m0 += 4) {
      if (rows - m0 == 1) {
        block<1, 16>(x, m0, rows, w, n, k, n0, bias, y, order, ahead);
      } else {
        for (int64_t r0 = n0; r0 < n0 + kTile && r0 < n; r0 += 4)
          block<4, 4>(x, m0, rows, w, n, k, r0, bias, y, order, ahead);
      }
    }
    if (residual != nullptr || relu) finish_tile(y, rows, n, n0, kTile, residual, relu);
  }
}

}  // namespace avx512
}  // namespace

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
      skinny_tiles_avx2(x, rows, w, n, k, bias, y, first, last, residual, relu);
    }
  });
}
