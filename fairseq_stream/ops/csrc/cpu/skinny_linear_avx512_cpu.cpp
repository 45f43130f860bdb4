// The skinny product's tiles for AVX-512F (skinny_linear_cpu.cpp has the design; skinny_block_cpu.h the tile
// loop both instruction sets share): 16 rows of W a tile, 16 accumulators (1 x 16 for a single row, 4 x 4
// for up to four rows sharing each load of W) reduced together into one vector of 16 totals by a transposing
// reduction: four rounds of shuffles and adds, the same tree for every accumulator.
//
// In a namespace named avx512: the generic code compiles for a baseline without AVX-512 (setup.py), and
// tests/test_cpu_baseline.py checks that AVX-512 instructions lie only in such functions.

#include "skinny_tiles_cpu.h"

#include <immintrin.h>

#include <cstdint>

#pragma GCC visibility push(hidden)  // as skinny_tiles_cpu.h: no calls through the PLT
namespace avx512 {

#pragma GCC push_options
#pragma GCC target("avx512f")

// The reduction leaves accumulator 4j + q's total in lane 4q + j; this gather puts accumulator r's in lane r.
inline __m512i tile_order() { return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15); }

// The totals of 16 accumulators, accumulator r's in lane r.
inline __m512 reduce16(const __m512 (&a)[16]) {
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
  return _mm512_permutexvar_ps(tile_order(), f);
}

struct Vector {
  static constexpr int kLanes = kSkinnyTileAvx512;
  using Vec = __m512;
  using Tail = __mmask16;
  FS_SKINNY_VECTOR_OPS(_mm512)
  static Tail tail(int64_t rest) { return static_cast<__mmask16>((1u << rest) - 1); }
  static Vec load_tail(const float* p, Tail t) { return _mm512_maskz_loadu_ps(t, p); }
  static Vec reduce(const Vec (&a)[kLanes]) { return reduce16(a); }
};

#include "skinny_block_cpu.h"

#pragma GCC pop_options

}  // namespace avx512
#pragma GCC visibility pop
