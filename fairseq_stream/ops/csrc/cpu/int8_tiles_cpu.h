// The int8 product's tiles (quantized_product_cpu.cpp registers them, int8_linear_cpu.cpp is the op): a tile
// sums the products of R rows of x, quantized, with P panels of the packed weight into int32. The portable,
// AVX2 and AVX-512 tiles are quantized_tiles_cpu.h's, shared with int16; here are int8's steps of them and
// its one-row AVX2 tile.
//
// Packed layout (made by quantized_linear.pack_int8): panels of 16 output columns; within a panel,
// for each quad of input positions 4p .. 4p+3, the 64 bytes w[n][4p + j] at byte 4 * c + j of column
// n = 16 * panel + c (K padded with zeros to a multiple of 4). That is the operand layout of
// AVX-512 VNNI's vpdpbusd: one instruction sums four products per column for 16 columns.
//
// Kernels, by instruction set (the registry picks one at run time from what the CPU reports):
// * "avx512vnni": vpdpbusd multiplies unsigned by signed bytes, so a row's quantized values q (in
//   [-127, 127]) enter as q + 128 (in [1, 255]) and the known excess 128 * sum_k w[n][k] is taken
//   off each column's sum before it is dequantized. Nothing saturates: |sum| <= 255 * 127 * K.
// * "avx2": the weights are widened to int16 (vpmovsxbw) and multiplied by the row's values as
//   int16 pairs (vpmaddwd, as the int16 kernel does): exact, with no unsigned trick (vpmaddubsw's
//   int16 pair sums could saturate at 255 * 127 * 2). It reads the same bytes in another order within
//   each quad (quantized_linear.pair_order): 16 columns' inputs 4p, 4p+1, then their 4p+2, 4p+3.
// * "avx2w7", for weights of 7 bits (|w| <= 63, quantized_linear's int8w7): vpmaddubsw multiplies
//   the row's unsigned bytes q + 128 by the signed weights in the VNNI kernel's order, and no pair sum
//   can saturate (2 * 255 * 63 < 2^15); then vpmaddwd by ones and vpaddd. On 8-bit weights it would
//   saturate, so it is refused there and "auto" never picks it for them.
// * "portable": plain loops.
// Every kernel computes the same integer sums, so all give identical floats.

#pragma once

#include <cstdint>

#include "quantized_tiles_cpu.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FS_INT8_X86 1
#else
#define FS_INT8_X86 0
#endif

// Hidden: called only within this library. At default visibility every call of a template instance (a
// tile, from the driver's table) went through the PLT.
#pragma GCC visibility push(hidden)
namespace int8_tiles {

using fs_quant::Format;
using fs_quant::kAccRows;
using fs_quant::kAccStride;
using fs_quant::kCols;

constexpr int64_t kQuad = 4;  // input positions per packed group
constexpr int64_t kPanelBytes = kCols * kQuad;  // one quad of one panel

// Plain loops on the values as signed bytes.
using Portable = fs_quant::PortableTile<int8_t, kQuad, Format::kSigned8>;

#if FS_INT8_X86
// The AVX2 kernels' two ways to multiply, each a step of the AVX2 tile (quantized_tiles_cpu.h's Avx2Tile;
// int16's is int16_tiles_cpu.h's PairsStep): load one step's weights of a panel (16 columns, kStepBytes
// bytes) as two vectors, columns 0-7 and 8-15, and multiply one by a row's broadcast int32 of values into 8
// columns' int32 partial sums.
//
// 8-bit weights ("avx2"), in pair order (quantized_linear.pair_order: within each quad, every column's
// inputs 4p, 4p+1, then every column's 4p+2, 4p+3): a step is one input pair, the weights widened to
// int16 (vpmovsxbw) and vpmaddwd against the row's pair of int16. Exact, with no unsigned trick.
struct WidenedStep {
  static constexpr Format kFormat = Format::kWide16;
  static constexpr int64_t kStepBytes = kPanelBytes / 2;
  __attribute__((target("avx2"), always_inline)) static inline void load(const int8_t* wp, __m256i& w0,
                                                                         __m256i& w1) {
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp)));
    w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16)));
  }
  __attribute__((target("avx2"), always_inline)) static inline __m256i mul(__m256i xv, __m256i w) {
    return _mm256_madd_epi16(xv, w);
  }
};

// 7-bit weights ("avx2w7", |w| <= 63), in quad order (as VNNI reads them): a step is one quad, vpmaddubsw
// multiplies the row's unsigned bytes q + 128 (at most 255) by the signed weights and adds pairs into
// int16, which cannot saturate (2 * 255 * 63 = 32130 < 32767); vpmaddwd by ones sums the quad into int32.
// Three instructions per 32 products a row against the widened step's four (vpmaddwd and vpaddd per 16),
// and no widening.
struct BytesStep {
  static constexpr Format kFormat = Format::kShifted8;
  static constexpr int64_t kStepBytes = kPanelBytes;
  __attribute__((target("avx2"), always_inline)) static inline void load(const int8_t* wp, __m256i& w0,
                                                                         __m256i& w1) {
    w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
    w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32));
  }
  __attribute__((target("avx2"), always_inline)) static inline __m256i mul(__m256i xv, __m256i w) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(xv, w), _mm256_set1_epi16(1));
  }
};

// One row x up to 4 panels: a lone row (greedy, one sentence at a time) gets 8 independent sums instead of
// the 6-row tile's 2 (at 1 row x 1 panel the Multi30k output layer took 79 us against 64 for the quad-order
// 2-row tile; the build for AVX2, one Xeon thread). The row's values for step q are at xq[q].
template <class Step>
struct Avx2RowTile {
  static constexpr Format kFormat = Step::kFormat;
  template <int R, int P>
  __attribute__((target("avx2"))) static void tile(const void* xq_, int64_t quads, const int8_t* packed,
                                                   int64_t panel0, int32_t* acc) {
    static_assert(R == 1 && P <= 4, "one row, at most 4 panels");
    constexpr int64_t S = kPanelBytes / Step::kStepBytes;
    const int32_t* xq = static_cast<const int32_t*>(xq_);
    const __m256i zero = _mm256_setzero_si256();
    __m256i lo0 = zero, hi0 = zero, lo1 = zero, hi1 = zero, lo2 = zero, hi2 = zero, lo3 = zero, hi3 = zero;
    const int64_t panel_bytes = quads * kPanelBytes;
    const int8_t* w = packed + panel0 * panel_bytes;
    for (int64_t q = 0; q < S * quads; ++q) {
      const __m256i xv = _mm256_set1_epi32(xq[q]);
#define FS_PANEL(j)                                                  \
  if constexpr (P > j) {                                             \
    const int8_t* wp = w + j * panel_bytes + q * Step::kStepBytes;   \
    if (q % S == 0) fs_quant::prefetch_ahead(wp);                    \
    __m256i w0, w1;                                                  \
    Step::load(wp, w0, w1);                                          \
    fs_quant::accumulate<Step>(xv, w0, w1, lo##j, hi##j);                      \
  }
      FS_PANEL(0) FS_PANEL(1) FS_PANEL(2) FS_PANEL(3)
#undef FS_PANEL
    }
#define FS_STORE(j)                                                                          \
  if constexpr (P > j) {                                                                     \
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + j * kCols), lo##j);                 \
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + j * kCols + 8), hi##j);             \
  }
    FS_STORE(0) FS_STORE(1) FS_STORE(2) FS_STORE(3)
#undef FS_STORE
  }
};

using Avx2 = fs_quant::Avx2Tile<WidenedStep>;
using Avx2Row = Avx2RowTile<WidenedStep>;
using Avx2Bytes = fs_quant::Avx2Tile<BytesStep>;
using Avx2BytesRow = Avx2RowTile<BytesStep>;

using Avx512Vnni = fs_quant::Avx512VnniTile<Format::kShifted8>;
#endif

}  // namespace int8_tiles
#pragma GCC visibility pop
