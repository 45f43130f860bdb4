// 8-bit linear layer on the CPU: y = x W^T + b with W quantized once per output row to int8, x
// quantized per call and row to int8, products summed exactly in int32, then dequantized.
// fairseq_stream/ops/quantized_linear.py documents the op and its scale rule, and holds the torch
// reference this must equal bit for bit.
//
// Packed layout (made by quantized_linear.pack_int8): panels of 16 output columns; within a panel,
// for each quad of input positions 4p .. 4p+3, the 64 bytes w[n][4p + j] at byte 4 * c + j of column
// n = 16 * panel + c (K padded with zeros to a multiple of 4). That is the operand layout of
// AVX-512 VNNI's vpdpbusd: one instruction sums four products per column for 16 columns.
//
// Kernels, chosen at run time from what the CPU reports (as int16_linear_cpu.cpp's):
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

#include "int8_linear_cpu.h"

#include "cpu_isa_cpu.h"

#include "parallel_cpu.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "quantized_tiles_cpu.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FS_INT8_X86 1
#else
#define FS_INT8_X86 0
#endif

namespace {

using fs_quant::kCols;

constexpr int64_t kQuad = 4;  // input positions per packed group
constexpr int kAccRows = 12;  // the most rows a tile holds
constexpr int64_t kAccStride = 8 * kCols;  // int32 sums per row in a tile's output: up to 8 panels
constexpr int64_t kPanelBytes = kCols * kQuad;  // one quad of one panel
constexpr int kInt8Weight = 127;  // the largest |w| of an 8-bit weight
constexpr int kInt7Weight = 63;   // of a 7-bit one (int8w7)

// How a kernel takes a row's quantized values: one int32 per (quad, row) holding 4 signed bytes
// (portable), 4 bytes q + 128 (VNNI), or one int64 per (quad, row) holding 4 int16 (AVX2).
enum class Format { kSigned8, kShifted8, kWide16 };

// A tile of R rows x P panels: acc[r * kAccStride + b * 16 + c] = sum over k of the row's value
// (as the format gives it) times w[16 * (panel0 + b) + c][k]. xq: the tile's rows, quad-major.
using Tile = void (*)(const void* xq, int64_t quads, const int8_t* packed, int64_t panel0, int32_t* acc);

struct Portable {
  static constexpr Format kFormat = Format::kSigned8;
  template <int R, int P>
  static void tile(const void* xq_, int64_t quads, const int8_t* packed, int64_t panel0, int32_t* acc) {
    const int8_t* xs = static_cast<const int8_t*>(xq_);
    for (int r = 0; r < R; ++r) {
      for (int b = 0; b < P; ++b) {
        const int8_t* w = packed + (panel0 + b) * quads * kPanelBytes;
        int32_t sum[kCols] = {0};
        for (int64_t p = 0; p < quads; ++p) {
          const int8_t* x = xs + 4 * (p * R + r);
          const int8_t* wp = w + p * kPanelBytes;
          for (int64_t c = 0; c < kCols; ++c) {
            int32_t s = 0;
            for (int j = 0; j < 4; ++j) s += static_cast<int32_t>(x[j]) * wp[4 * c + j];
            sum[c] += s;
          }
        }
        for (int64_t c = 0; c < kCols; ++c) acc[r * kAccStride + b * kCols + c] = sum[c];
      }
    }
  }
};

#if FS_INT8_X86
// The AVX2 kernels' two ways to multiply, each a step of a tile: load one step's weights of a panel (16
// columns, kStepBytes bytes) as two vectors, columns 0-7 and 8-15, and multiply one by a row's broadcast
// int32 of values into 8 columns' int32 partial sums.
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

// 6 rows x one panel, as the int16 kernel's AVX2 tile: 12 sums (a row's columns 0-7 and 8-15), a step's
// 2 weight vectors and a broadcast, within AVX2's 16 registers. Row i's values for step q (S steps a
// quad) are at xq[(q / S) * R * S + S * i + q % S]. Before the pair order (quad order, each column's two
// pair sums kept apart): 3-row tiles spilled 8 sums to the stack in a build for AVX2 (-march=x86-64-v3,
// as on an EPYC), and 2-row tiles made int8 slower than int16 there (fixed k=5 in batches of 64 on the
// Multi30k transformer: 10.7 s against int16's 9.5). One input pair a step for the widened weights (as
// the int16 tile): both pairs of a quad in one step made GCC keep sums on the stack from 4 rows on.
template <class Step>
struct Avx2Tile {
  static constexpr Format kFormat = Step::kFormat;
  template <int R, int P>
  __attribute__((target("avx2"))) static void tile(const void* xq_, int64_t quads, const int8_t* packed,
                                                   int64_t panel0, int32_t* acc) {
    static_assert(P == 1, "one panel: its two halves are the tile's columns");
    constexpr int64_t S = kPanelBytes / Step::kStepBytes;  // steps a quad, and a 64-byte line
    const int32_t* xq = static_cast<const int32_t*>(xq_);
    const __m256i zero = _mm256_setzero_si256();
    FS_ROWS_6(FS_AVX2_PAIR_DECL)
    const int8_t* w = packed + panel0 * quads * kPanelBytes;
    for (int64_t q = 0; q < S * quads; ++q) {
      const int8_t* wp = w + q * Step::kStepBytes;
      const int32_t* xp = xq + (q / S) * R * S + q % S;
      if (q % S == 0) fs_quant::prefetch_ahead(wp);  // one prefetch a 64-byte line
      __m256i w0, w1;
      Step::load(wp, w0, w1);
#define FS_STEP(i)                                                  \
  if constexpr (R > i) {                                            \
    const __m256i xv = _mm256_set1_epi32(xp[S * i]);                \
    lo##i = _mm256_add_epi32(lo##i, Step::mul(xv, w0));             \
    hi##i = _mm256_add_epi32(hi##i, Step::mul(xv, w1));             \
  }
      FS_ROWS_6(FS_STEP)
#undef FS_STEP
    }
    FS_ROWS_6(FS_AVX2_PAIR_STORE)
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
    lo##j = _mm256_add_epi32(lo##j, Step::mul(xv, w0));              \
    hi##j = _mm256_add_epi32(hi##j, Step::mul(xv, w1));              \
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

using Avx2 = Avx2Tile<WidenedStep>;
using Avx2Row = Avx2RowTile<WidenedStep>;
using Avx2Bytes = Avx2Tile<BytesStep>;
using Avx2BytesRow = Avx2RowTile<BytesStep>;

// R rows x P panels, R * P <= 24 sums in registers: (12, 2) for batched rows, (4, 4) and (2, 8) for
// one sentence's few rows, so that a lone row still has 8 independent chains of vpdpbusd. The sums are
// named variables (s<row>_<panel>), not an array: GCC kept an array of vectors on the stack, a load
// and a store around every vpdpbusd; the variables of rows and panels a tile lacks are compiled away.
#define FS_PANELS_8(X, i) X(i, 0) X(i, 1) X(i, 2) X(i, 3) X(i, 4) X(i, 5) X(i, 6) X(i, 7)
struct Avx512Vnni {
  static constexpr Format kFormat = Format::kShifted8;
  template <int R, int P>
  __attribute__((target("avx512f,avx512bw,avx512vnni"))) static void tile(const void* xq_, int64_t quads,
                                                                          const int8_t* packed, int64_t panel0,
                                                                          int32_t* acc) {
    static_assert(R * P <= 24 && P <= 8 && R <= 12, "a tile of at most 24 sums");
    const int32_t* xq = static_cast<const int32_t*>(xq_);
    const __m512i zero = _mm512_setzero_si512();
#define FS_DECL(i, j) __m512i s##i##_##j = zero;
#define FS_DECL_ROW(i) FS_PANELS_8(FS_DECL, i)
    FS_ROWS_12(FS_DECL_ROW)
#undef FS_DECL_ROW
#undef FS_DECL
    const int8_t* w = packed + panel0 * quads * kPanelBytes;
    const int64_t panel_bytes = quads * kPanelBytes;
    for (int64_t p = 0; p < quads; ++p) {
      const int8_t* wp = w + p * kPanelBytes;
#define FS_LOAD(j)                                                                  \
  if constexpr (P > j) fs_quant::prefetch_ahead(wp + j * panel_bytes);              \
  const __m512i w##j = P > j ? _mm512_loadu_si512(wp + j * panel_bytes) : zero;
      FS_LOAD(0) FS_LOAD(1) FS_LOAD(2) FS_LOAD(3) FS_LOAD(4) FS_LOAD(5) FS_LOAD(6) FS_LOAD(7)
#undef FS_LOAD
#define FS_STEP(i, j) \
  if constexpr (P > j) s##i##_##j = _mm512_dpbusd_epi32(s##i##_##j, x##i, w##j);
#define FS_STEP_ROW(i)                                         \
  if constexpr (R > i) {                                       \
    const __m512i x##i = _mm512_set1_epi32(xq[p * R + i]);    \
    FS_PANELS_8(FS_STEP, i)                                    \
  }
      FS_ROWS_12(FS_STEP_ROW)
#undef FS_STEP_ROW
#undef FS_STEP
    }
#define FS_STORE(i, j) \
  if constexpr (R > i && P > j) _mm512_storeu_si512(acc + i * kAccStride + j * kCols, s##i##_##j);
#define FS_STORE_ROW(i) FS_PANELS_8(FS_STORE, i)
    FS_ROWS_12(FS_STORE_ROW)
#undef FS_STORE_ROW
#undef FS_STORE
  }
};
#undef FS_PANELS_8
#endif

// One tile shape of a kernel: up to `rows` rows and `panels` panels a tile, every smaller remainder
// an instance of its own (table[(r - 1) * panels + p - 1]) so the sums stay in registers.
struct Shape {
  int rows, panels;
  std::vector<Tile> table;
};

template <class K, int RMax, int PMax, size_t I>
void tile_at(const void* xq, int64_t quads, const int8_t* packed, int64_t panel0, int32_t* acc) {
  K::template tile<static_cast<int>(I) / PMax + 1, static_cast<int>(I) % PMax + 1>(xq, quads, packed, panel0, acc);
}

template <class K, int RMax, int PMax, size_t... I>
Shape shape(std::index_sequence<I...>) {
  static_assert(RMax <= kAccRows && PMax * kCols <= kAccStride, "a tile larger than its output");
  return Shape{RMax, PMax, {&tile_at<K, RMax, PMax, I>...}};
}

template <class K, int RMax, int PMax>
Shape shape() {
  return shape<K, RMax, PMax>(std::make_index_sequence<RMax * PMax>{});
}

struct Kernel {
  std::string name;
  Format format;
  int max_weight;  // the largest |w| whose products the kernel sums exactly (127, or 63 for avx2w7)
  std::vector<Shape> shapes;  // by how many rows a call has: shapes[i] serves up to shapes[i].rows rows,
                              // the last one any count
  const Shape& for_rows(int64_t rows) const {
    for (const Shape& s : shapes)
      if (rows <= s.rows) return s;
    return shapes.back();
  }
};

const std::vector<Kernel>& available_kernels() {
  static const std::vector<Kernel> kernels = [] {
    std::vector<Kernel> out;
    out.push_back(Kernel{"portable", Format::kSigned8, kInt8Weight, {}});
    out.back().shapes.push_back(shape<Portable, 4, 1>());
#if FS_INT8_X86
    __builtin_cpu_init();
    if (fs_cpu::allows_avx2()) {
      out.push_back(Kernel{"avx2", Format::kWide16, kInt8Weight, {}});
      out.back().shapes.push_back(shape<Avx2Row, 1, 4>());
      out.back().shapes.push_back(shape<Avx2, 6, 1>());
      out.push_back(Kernel{"avx2w7", Format::kShifted8, kInt7Weight, {}});
      out.back().shapes.push_back(shape<Avx2BytesRow, 1, 4>());
      out.back().shapes.push_back(shape<Avx2Bytes, 6, 1>());
    }
    if (fs_cpu::allows_avx512() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vnni")) {
      out.push_back(Kernel{"avx512vnni", Format::kShifted8, kInt8Weight, {}});
      out.back().shapes.push_back(shape<Avx512Vnni, 2, 8>());
      out.back().shapes.push_back(shape<Avx512Vnni, 4, 4>());
      out.back().shapes.push_back(shape<Avx512Vnni, 12, 2>());
    }
#endif
    return out;
  }();
  return kernels;
}

// The kernels that sum weights of magnitude up to weight_max exactly, the best last.
void check_weight_max(int64_t weight_max) {
  TORCH_CHECK(weight_max == kInt8Weight || weight_max == kInt7Weight, "int8_linear: weight_max must be ",
              kInt8Weight, " (8-bit weights) or ", kInt7Weight, " (7-bit), got ", weight_max);
}

std::vector<Kernel> kernels_for(int64_t weight_max) {
  check_weight_max(weight_max);
  std::vector<Kernel> out;
  for (const Kernel& k : available_kernels())
    if (k.max_weight >= weight_max) out.push_back(k);
  return out;
}

const Kernel& find_kernel(const std::string& name, int64_t weight_max) {
  check_weight_max(weight_max);
  for (const Kernel& k : available_kernels())
    TORCH_CHECK(k.name != name || k.max_weight >= weight_max, "int8_linear: kernel '", name, "' sums weights of ",
                k.max_weight == kInt7Weight ? 7 : 8, " bits only (|w| <= ", k.max_weight, "); these have ",
                weight_max == kInt7Weight ? 7 : 8);
  const auto& all = available_kernels();
  if (name != "auto") return fs_quant::find_kernel(all, name, "int8_linear");
  for (auto k = all.rbegin(); k != all.rend(); ++k)
    if (k->max_weight >= weight_max) return *k;
  return all.front();  // portable sums any weight
}

// q[i] = round(row[i] * s) (to nearest, ties to even: the default rounding mode, as torch.round), for
// i < k, and 0 up to `padded`. A loop GCC vectorizes (-fno-trapping-math lets nearbyint become vroundps).
void round_row(const float* row, int64_t k, int64_t padded, float s, int32_t* q) {
  for (int64_t i = 0; i < k; ++i) q[i] = static_cast<int32_t>(std::nearbyint(row[i] * s));
  for (int64_t i = k; i < padded; ++i) q[i] = 0;
}

// Rows of x quantized to [-127, 127] (q = round(x * scale), scale = 127 / max |x|, 1 for an all-zero
// row; a row that integers cannot hold gets kFloatRow and zeros) and laid out tile by tile as the format wants them: tile t (rows t * tile_rows ..) starts at
// element t * tile_rows * quads; within it, quad p of row r is element p * R + r.
template <typename T>
void quantize_rows(const float* x, int64_t rows, int64_t k, int64_t quads, int64_t tile_rows, Format format,
                   T* xq, float* scale) {
  const int64_t padded = quads * kQuad;
  std::vector<int32_t> q(padded);
  // The row's values as the format stores them, 4 to an element: bytes (q, or q + 128 unsigned for
  // VNNI) or int16 (AVX2). Each pass is a plain loop GCC vectorizes; the last one moves whole elements.
  std::vector<T> packed(quads);
  uint8_t* bytes = reinterpret_cast<uint8_t*>(packed.data());
  int16_t* wide = reinterpret_cast<int16_t*>(packed.data());
  const int32_t shift = format == Format::kShifted8 ? 128 : 0;
  for (int64_t m = 0; m < rows; ++m) {
    const float* row = x + m * k;
    scale[m] = fs_quant::row_scale(row, k, fs_quant::kInt8Max);
    if (scale[m] == fs_quant::kFloatRow)
      std::fill(q.begin(), q.end(), 0);  // its integer sums are not used (float_rows writes the row)
    else
      round_row(row, k, padded, scale[m], q.data());
    if (format == Format::kWide16)
      for (int64_t i = 0; i < padded; ++i) wide[i] = static_cast<int16_t>(q[i]);
    else
      for (int64_t i = 0; i < padded; ++i) bytes[i] = static_cast<uint8_t>(q[i] + shift);
    const int64_t m0 = m - m % tile_rows, r = m - m0, R = std::min(tile_rows, rows - m0);
    T* tile = xq + m0 * quads;
    for (int64_t p = 0; p < quads; ++p) tile[p * R + r] = packed[p];
  }
}

// w(n, i) of the weight that int8_linear's `packed` holds (quantized_linear.pack_int8), in quad order or,
// for the "avx2" kernel, in pair order (quantized_linear.pair_order): float_rows reads it.
struct PackedWeightAt {
  const int8_t* packed;
  int64_t quads;
  bool pair_order;
  int8_t operator()(int64_t n, int64_t i) const {
    const int64_t c = n % kCols, j = i % kQuad;
    const int64_t byte = pair_order ? 32 * (j / 2) + 2 * c + j % 2 : 4 * c + j;
    return packed[((n / kCols) * quads + i / kQuad) * kPanelBytes + byte];
  }
};

// w(n, i) of the transposed weight (in, out) that oneDNN's product takes.
struct TransposedWeightAt {
  const int8_t* kn;
  int64_t out;
  int8_t operator()(int64_t n, int64_t i) const { return kn[i * out + n]; }
};

// The most input features whose int32 sums cannot overflow: 255 * 127 * in < 2^31 (the VNNI kernel's
// unsigned operand; quantized_linear.INT8_MAX_IN_FEATURES).
constexpr int64_t kMaxInFeatures = ((int64_t{1} << 31) - 1) / (255 * 127);

}  // namespace

std::vector<std::string> int8_kernels(int64_t weight_max) { return fs_quant::kernel_names(kernels_for(weight_max)); }

bool int8_onednn_exact() {
  // oneDNN (torch's at::_int_mm) sums int8 products exactly where it has AMX or VNNI; an AVX2-only path
  // could use vpmaddubsw, whose int16 pair sums saturate. So its result on the one input that would
  // saturate (every byte product at its largest magnitude, of both signs) must be the exact one, on a
  // CPU that has VNNI or AMX, before it is used.
  static const bool exact = [] {
    __builtin_cpu_init();
    if (!fs_cpu::allows_avx512() || !__builtin_cpu_supports("avx512vnni")) return false;
    try {
      const int64_t k = 512;
      auto x = at::full({2, k}, 127, at::kChar);
      x[1].fill_(-128);
      auto w = at::full({k, 3}, 127, at::kChar);
      w.select(1, 1).fill_(-127);
      w.select(1, 2).fill_(-128);
      const auto got = at::_int_mm(x, w).to(at::kLong);
      const auto want = at::matmul(x.to(at::kLong), w.to(at::kLong));
      return at::equal(got, want);
    } catch (const std::exception&) {
      return false;
    }
  }();
  return exact;
}

torch::Tensor int8_linear_onednn(torch::Tensor x, const torch::Tensor& weight_kn, const torch::Tensor& weight_inv,
                                 const std::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2,
              "int8_linear: x must be a 2-d float32 CPU tensor");
  TORCH_CHECK(int8_onednn_exact(), "int8_linear: oneDNN's int8 product is not exact on this CPU (or not built)");
  TORCH_CHECK(weight_kn.device().is_cpu() && weight_kn.scalar_type() == torch::kChar && weight_kn.dim() == 2 &&
                  weight_kn.size(0) == x.size(1) && weight_kn.size(1) == weight_inv.numel(),
              "int8_linear: weight_kn must be the quantized weight transposed, (in, out) int8");
  const int64_t rows = x.size(0), k = x.size(1), out_features = weight_kn.size(1);
  fs_quant::check_scales_and_bias(weight_inv, bias, out_features, "int8_linear");
  TORCH_CHECK(k <= kMaxInFeatures, "int8_linear: ", k, " input features could overflow int32 sums (at most ",
              kMaxInFeatures, ")");
  x = x.contiguous();
  auto out = torch::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  // The rows quantized exactly as the own kernels quantize them (signed, row-major).
  auto xq = torch::empty({rows, k}, x.options().dtype(torch::kChar));
  std::vector<float> scale(rows);  // each row's scale, then its inverse (to_inverses)
  std::vector<int32_t> q(k);
  const float* xs = x.data_ptr<float>();
  int8_t* qs = xq.data_ptr<int8_t>();
  for (int64_t m = 0; m < rows; ++m) {
    scale[m] = fs_quant::row_scale(xs + m * k, k, fs_quant::kInt8Max);
    if (scale[m] == fs_quant::kFloatRow)
      std::fill(q.begin(), q.end(), 0);
    else
      round_row(xs + m * k, k, k, scale[m], q.data());
    for (int64_t i = 0; i < k; ++i) qs[m * k + i] = static_cast<int8_t>(q[i]);
  }
  const torch::Tensor kn = weight_kn.contiguous(), inv_t = weight_inv.contiguous();
  const torch::Tensor b_t = bias ? bias->contiguous() : torch::Tensor();
  const auto acc = at::_int_mm(xq, kn);
  const int32_t* a = acc.data_ptr<int32_t>();
  const float* inv_w = inv_t.data_ptr<float>();
  const float* b = bias ? b_t.data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
  fs_quant::to_inverses(scale);
  for (int64_t m = 0; m < rows; ++m)
    fs_quant::dequantize(a + m * out_features, out_features, scale[m], inv_w, b, y + m * out_features);
  fs_quant::float_rows(xs, k, scale, out_features, TransposedWeightAt{kn.data_ptr<int8_t>(), out_features}, inv_w, b,
                       y);
  return out;
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor weight_inv, torch::Tensor excess,
                          std::optional<torch::Tensor> bias, const std::string& kernel, int64_t weight_max) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2,
              "int8_linear: x must be a 2-d float32 CPU tensor");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kChar && packed.dim() == 3 &&
                  packed.size(2) == kPanelBytes,
              "int8_linear: packed must come from quantized_linear.packed_for");
  const int64_t out_features = weight_inv.numel();
  fs_quant::check_scales_and_bias(weight_inv, bias, out_features, "int8_linear");
  TORCH_CHECK(excess.device().is_cpu() && excess.scalar_type() == torch::kInt && excess.numel() == out_features,
              "int8_linear: excess must be 128 * each row's sum of quantized weights (int32)");
  const Kernel& kern = find_kernel(kernel, weight_max);
  x = x.contiguous(), packed = packed.contiguous(), weight_inv = weight_inv.contiguous();
  excess = excess.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), quads = packed.size(1), n_panels = packed.size(0);
  TORCH_CHECK((k + kQuad - 1) / kQuad == quads, "int8_linear: x has ", k, " features, the packed weight ",
              kQuad * quads);
  TORCH_CHECK(n_panels == (out_features + kCols - 1) / kCols, "int8_linear: the packed weight has ", n_panels,
              " panels of ", kCols, " outputs for ", out_features, " scales");
  TORCH_CHECK(k <= kMaxInFeatures, "int8_linear: ", k, " input features could overflow int32 sums (at most ",
              kMaxInFeatures, ")");
  const float* b = nullptr;
  if (bias) {
    *bias = bias->contiguous();
    b = bias->data_ptr<float>();
  }
  auto out = torch::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const Shape& shape = kern.for_rows(rows);
  // The rows split into tiles of nearly equal size: 13 rows as 7 + 6, not 12 + 1, whose lone row would
  // read the weight a second time with too few independent sums to hide vpdpbusd's latency.
  const int64_t tiles = (rows + shape.rows - 1) / shape.rows, tile_rows = (rows + tiles - 1) / tiles;
  // int64 elements for every format (the AVX2 one needs 8 bytes; the others use the first half of the
  // buffer as int32).
  std::vector<int64_t> xq_storage(rows * quads);
  std::vector<float> scale(rows);  // each row's scale, then its inverse (to_inverses)
  void* xq = xq_storage.data();
  if (kern.format == Format::kWide16)
    quantize_rows(x.data_ptr<float>(), rows, k, quads, tile_rows, kern.format, static_cast<int64_t*>(xq),
                  scale.data());
  else
    quantize_rows(x.data_ptr<float>(), rows, k, quads, tile_rows, kern.format, static_cast<int32_t*>(xq),
                  scale.data());
  fs_quant::to_inverses(scale);
  const int64_t element = kern.format == Format::kWide16 ? 8 : 4;
  const int8_t* w = packed.data_ptr<int8_t>();
  const float* inv_w = weight_inv.data_ptr<float>();
  const int32_t* shift = kern.format == Format::kShifted8 ? excess.data_ptr<int32_t>() : nullptr;
  float* y = out.data_ptr<float>();
  // A group's multiply-adds: each chunk holds enough of them to pay for waking a thread.
  const int64_t group_work = rows * shape.panels * kCols * quads * 4;
  fs::parallel_for(0, (n_panels + shape.panels - 1) / shape.panels, fs::grain_for(group_work, fs::kMinChunkWork),
                   [&](int64_t first, int64_t last) {
    int32_t acc[kAccRows * kAccStride];
    for (int64_t group = first; group < last; ++group) {
      const int64_t p0 = group * shape.panels;
      const int panels = static_cast<int>(std::min<int64_t>(shape.panels, n_panels - p0));
      for (int64_t m0 = 0; m0 < rows; m0 += tile_rows) {
        const int r = static_cast<int>(std::min<int64_t>(tile_rows, rows - m0));
        shape.table[(r - 1) * shape.panels + panels - 1](static_cast<const char*>(xq) + m0 * quads * element,
                                                          quads, w, p0, acc);
        const int64_t n0 = p0 * kCols, count = std::min<int64_t>(panels * kCols, out_features - n0);
        for (int i = 0; i < r; ++i) {
          int32_t* a = acc + i * kAccStride;
          if (shift)
            for (int64_t c = 0; c < count; ++c) a[c] -= shift[n0 + c];
          fs_quant::dequantize(a, count, scale[m0 + i], inv_w + n0, b ? b + n0 : nullptr,
                               y + (m0 + i) * out_features + n0);
        }
      }
    }
  });
  fs_quant::float_rows(x.data_ptr<float>(), k, scale, out_features,
                       PackedWeightAt{w, quads, kern.format == Format::kWide16}, inv_w, b, y);
  return out;
}
