// The skinny product's tiles for AVX2 and FMA (skinny_linear_cpu.cpp has the design; skinny_block_cpu.h the
// tile loop both instruction sets share).
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

#include <cstdint>

#pragma GCC visibility push(hidden)  // as skinny_tiles_cpu.h: no calls through the PLT
namespace avx2 {

#pragma GCC push_options
#pragma GCC target("avx2,fma")

// The totals of 8 accumulators, accumulator r's in lane r. Every accumulator's lanes are summed by the same
// tree, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline __m256 reduce8(const __m256 (&a)[8]) {
  const __m256 c0 = _mm256_hadd_ps(a[0], a[1]), c1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 c2 = _mm256_hadd_ps(a[4], a[5]), c3 = _mm256_hadd_ps(a[6], a[7]);
  // d0: per 128-bit half, the halves' sums of accumulators 0-3; d1: of accumulators 4-7.
  const __m256 d0 = _mm256_hadd_ps(c0, c1), d1 = _mm256_hadd_ps(c2, c3);
  return _mm256_add_ps(_mm256_permute2f128_ps(d0, d1, 0x20), _mm256_permute2f128_ps(d0, d1, 0x31));
}

struct Vector {
  static constexpr int kLanes = kSkinnyTileAvx2;
  using Vec = __m256;
  using Tail = __m256i;
  FS_SKINNY_VECTOR_OPS(_mm256)
  static Tail tail(int64_t rest) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(rest)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Vec load_tail(const float* p, Tail t) { return _mm256_maskload_ps(p, t); }
  static Vec reduce(const Vec (&a)[kLanes]) { return reduce8(a); }
};

#include "skinny_block_cpu.h"

#pragma GCC pop_options

}  // namespace avx2
#pragma GCC visibility pop
