// The int16 product's tiles (quantized_product_cpu.cpp registers them, int16_linear_cpu.cpp is the op): a
// tile sums the products of R rows of x, quantized to int16, with P panels of the packed weight into int32.
// The tiles are quantized_tiles_cpu.h's, shared with int8; here are int16's steps of them.
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

// Hidden: called only within this library. At default visibility every call of a template instance (a
// tile, from the driver's table) went through the PLT.
#pragma GCC visibility push(hidden)
namespace int16_tiles {

using fs_quant::Format;
using fs_quant::kAccStride;
using fs_quant::kCols;

// A tile's rows of x, quantized and packed: xq[p * R + r] holds row r's pair (x[2p], x[2p+1]) as
// two int16 in one int32 (the broadcast operand), so a tile reads its R rows from one pointer at
// offsets known at compile time (with a pointer per row, GCC spilled the 12-row tile to the stack).
// Each kernel's tile<R, P> computes acc[r * kAccStride + p * 16 + c] for the tile's R rows and the columns
// of panels [panel0, panel0 + P).

// Plain loops on the values as int16.
using Portable = fs_quant::PortableTile<int16_t, 2, Format::kPairs16>;

#if FS_INT16_X86
// A step of the AVX2 tile (fs_quant::Avx2Tile): one input pair, its 32 weights (16 columns' two) loaded as
// columns 0-7 and 8-15, and vpmaddwd against the row's broadcast pair: 6 rows x one panel, 12 sums, 2 weight
// halves and a broadcast, 15 of AVX2's 16 registers.
struct PairsStep {
  static constexpr Format kFormat = Format::kPairs16;
  static constexpr int64_t kStepBytes = fs_quant::kGroupBytes;
  __attribute__((target("avx2"), always_inline)) static inline void load(const int8_t* wp, __m256i& w0,
                                                                         __m256i& w1) {
    w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
    w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 32));
  }
  __attribute__((target("avx2"), always_inline)) static inline __m256i mul(__m256i xv, __m256i w) {
    return _mm256_madd_epi16(xv, w);
  }
};
using Avx2 = fs_quant::Avx2Tile<PairsStep>;

// 12 rows x 2 panels: 24 sums, 2 weight panels and a broadcast, 27 of AVX-512's 32 registers, so a batched
// step's rows go 12 to a pass of the weights; a beam of 5 is one pass.
using Avx512Vnni = fs_quant::Avx512VnniTile<Format::kPairs16>;
#endif

}  // namespace int16_tiles
#pragma GCC visibility pop
