// The int16 product's tiles (quantized_product_cpu.cpp registers them, int16_linear_cpu.cpp is the op): a
// tile sums the products of R rows of x, quantized to int16, with P panels of the packed weight into int32.
//
// Packed layout (made by int16_linear.pack): panels of 16 output columns; within a panel, for each
// pair of input positions k, k+1 the 32 values w[n][k], w[n][k+1] for its 16 columns n. A broadcast
// pair (x[k], x[k+1]) times 16 of those int16 is one multiply-add of 8 columns' two products each,
// summed in int32: vpmaddwd + vpaddd on AVX2 (two 256-bit halves per panel), one vpdpwssd on
// AVX-512 VNNI (the whole panel in one 512-bit register).
//
// Kernels, by instruction set (the registry picks one at run time from what the CPU reports): "avx512vnni",
// "avx2", and "portable" plain loops with the same integer arithmetic; every kernel gives identical results
// (integer sums are exact whatever their order: the scale rule bounds every partial sum).
#pragma once

#include <cstdint>

#include "quantized_tiles_cpu.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FS_INT16_X86 1
#else
#define FS_INT16_X86 0
#endif

namespace int16_tiles {

using fs_quant::Format;
using fs_quant::kAccStride;
using fs_quant::kCols;

// A tile's rows of x, quantized and packed: xq[p * R + r] holds row r's pair (x[2p], x[2p+1]) as
// two int16 in one int32 (the broadcast operand), so a tile reads its R rows from one pointer at
// offsets known at compile time (with a pointer per row, GCC spilled the 12-row tile to the stack).
// Each kernel's tile<R, P> computes acc[r * kAccStride + p * 16 + c] for the tile's R rows and the columns
// of panels [panel0, panel0 + P).

struct Portable {
  static constexpr Format kFormat = Format::kPairs16;
  template <int R, int P>
  static void tile(const void* xq, int64_t k_pairs, const int16_t* packed, int64_t panel0, int32_t* acc) {
    const int16_t* xs = static_cast<const int16_t*>(xq);
    for (int r = 0; r < R; ++r) {
      for (int b = 0; b < P; ++b) {
        const int16_t* w = packed + (panel0 + b) * k_pairs * 2 * kCols;
        // Columns innermost over contiguous weights: a loop compilers vectorize.
        int32_t sum[kCols] = {0};
        for (int64_t p = 0; p < k_pairs; ++p) {
          const int32_t x0 = xs[2 * (p * R + r)], x1 = xs[2 * (p * R + r) + 1];
          const int16_t* wp = w + p * 2 * kCols;
          for (int64_t c = 0; c < kCols; ++c) sum[c] += x0 * wp[2 * c] + x1 * wp[2 * c + 1];
        }
        for (int64_t c = 0; c < kCols; ++c) acc[r * kAccStride + b * kCols + c] = sum[c];
      }
    }
  }
};

#if FS_INT16_X86
// 6 rows x one panel: 12 sums, 2 weight halves and a broadcast, 15 of AVX2's 16 registers.
struct Avx2 {
  static constexpr Format kFormat = Format::kPairs16;
  template <int R, int P>
  __attribute__((target("avx2"))) static void tile(const void* xq_, int64_t k_pairs, const int16_t* packed,
                                                   int64_t panel0, int32_t* acc) {
    static_assert(P == 1, "one panel: its two halves are the tile's columns");
    const int32_t* xq = static_cast<const int32_t*>(xq_);
    const __m256i zero = _mm256_setzero_si256();
    FS_ROWS_6(FS_AVX2_PAIR_DECL)
    const int16_t* w = packed + panel0 * k_pairs * 2 * kCols;
    for (int64_t p = 0; p < k_pairs; ++p) {
      fs_quant::prefetch_ahead(w + p * 32);  // a step reads one 64-byte line
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32 + 16));
      // Row i's pair (x[2p], x[2p+1]).
#define FS_STEP(i) FS_AVX2_PAIR_STEP(i, xq[p * R + i])
      FS_ROWS_6(FS_STEP)
#undef FS_STEP
    }
    FS_ROWS_6(FS_AVX2_PAIR_STORE)
  }
};

// 12 rows x 2 panels: 24 sums, 2 weight panels and a broadcast, 27 of AVX-512's 32 registers, so a
// batched step's rows go 12 to a pass of the weights; a beam of 5 is one pass.
struct Avx512Vnni {
  static constexpr Format kFormat = Format::kPairs16;
  template <int R, int P>
  __attribute__((target("avx512f,avx512vnni"))) static void tile(const void* xq_, int64_t k_pairs,
                                                                 const int16_t* packed, int64_t panel0,
                                                                 int32_t* acc) {
    const int32_t* xq = static_cast<const int32_t*>(xq_);
    const __m512i zero = _mm512_setzero_si512();
#define FS_DECL(i) __m512i a##i = zero, b##i = zero;
    FS_ROWS_12(FS_DECL)
#undef FS_DECL
    const int16_t* w0 = packed + panel0 * k_pairs * 2 * kCols;
    const int16_t* w1 = w0 + k_pairs * 2 * kCols;  // the next panel (read only when P == 2)
    for (int64_t p = 0; p < k_pairs; ++p) {
      fs_quant::prefetch_ahead(w0 + p * 32);
      if constexpr (P > 1) fs_quant::prefetch_ahead(w1 + p * 32);
      const __m512i wa = _mm512_loadu_si512(w0 + p * 32);
      const __m512i wb = P > 1 ? _mm512_loadu_si512(w1 + p * 32) : zero;
#define FS_STEP(i)                                                   \
  if constexpr (R > i) {                                             \
    const __m512i xv = _mm512_set1_epi32(xq[p * R + i]);             \
    a##i = _mm512_dpwssd_epi32(a##i, xv, wa);                        \
    if constexpr (P > 1) b##i = _mm512_dpwssd_epi32(b##i, xv, wb);   \
  }
      FS_ROWS_12(FS_STEP)
#undef FS_STEP
    }
#define FS_STORE(i)                                                                   \
  if constexpr (R > i) {                                                              \
    _mm512_storeu_si512(acc + i * kAccStride, a##i);                                  \
    if constexpr (P > 1) _mm512_storeu_si512(acc + i * kAccStride + kCols, b##i);     \
  }
    FS_ROWS_12(FS_STORE)
#undef FS_STORE
  }
};
#endif

}  // namespace int16_tiles
