// What the int8 and int16 products share, for their tiles (int8_tiles_cpu.h, int16_tiles_cpu.h) and their
// one driver (quantized_product_cpu.cpp): the panel width of the packed weights, a tile's output, how a tile
// takes its rows; the tiles themselves, one per instruction set, each a template over a precision's step
// (PortableTile, Avx2Tile, Avx512VnniTile); a row's scale, picking a kernel by name, and the dequantization
// of a row's integer sums.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

// Rows of a tile, for the x86 tiles' macros: a tile's sums are named variables (one set per row), not an
// array, since GCC 12 kept an array of vectors in memory (a load and a store around every multiply-add);
// the variables of rows a tile lacks are compiled away.
#define FS_ROWS_6(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define FS_ROWS_12(X) FS_ROWS_6(X) X(6) X(7) X(8) X(9) X(10) X(11)

// Hidden: called only within this library. At default visibility every call of a template instance (a
// tile, from the driver's table) went through the PLT.
#pragma GCC visibility push(hidden)
namespace fs_quant {

constexpr int64_t kCols = 16;     // output columns per packed panel (one 512-bit register of int32 sums)
constexpr int kAccRows = 12;      // the most rows a tile holds
constexpr int64_t kAccStride = 8 * kCols;  // int32 sums per row in a tile's output: up to 8 panels

// How a tile takes a row's quantized values, one element per (step, row): int8's quad of 4 signed bytes
// (portable), or of 4 bytes q + 128 (VNNI, avx2w7), or of 4 int16 (AVX2, an int64); int16's pair of int16.
enum class Format { kSigned8, kShifted8, kWide16, kPairs16 };
constexpr float kInt8Max = 127.f;  // the largest |q| of an int8 value (symmetric: -128 is never used)

// How far ahead of a tile's reads its weight panels are prefetched into L1, in bytes (prefetch_ahead). On a
// big model a step's weights stream from memory: on the WMT'19-sized stand-in (194 MB of int8 weights a step,
// one sentence at beam 5, one thread of the Xeon running the AVX2 kernel) the tile outran the hardware
// prefetcher, which restarts at every 4 KB page, and waited on memory. One prefetch a 64-byte line, 2 KB
// ahead, took decoding from 14.5 to 7.6 s (256 bytes ahead: 13.3 s, 1 KB: 8.5, 4 KB: 7.9).
constexpr int64_t kPrefetchAheadBytes = 2048;

// Prefetch the line kPrefetchAheadBytes past `p` in a weight panel. A panel's bytes run on into the next
// panel's, which the next tile reads; a prefetch past the end of the weights never faults.
inline void prefetch_ahead(const void* p) {
  __builtin_prefetch(static_cast<const char*>(p) + kPrefetchAheadBytes, 0, 3);
}

// The portable tile of either precision, plain loops: T the weight's and the values' type, V a step's inputs
// (int8's quad, int16's pair), the packed weight V * 16 values a step and panel (input j of column c at
// V * c + j), a row's values V a (step, row) element. Columns innermost over contiguous weights: a loop
// compilers vectorize. Sums exactly in int32, as every other kernel.
template <typename T, int V, Format F>
struct PortableTile {
  static constexpr Format kFormat = F;
  template <int R, int P>
  static void tile(const void* xq, int64_t steps, const T* packed, int64_t panel0, int32_t* acc) {
    const T* xs = static_cast<const T*>(xq);
    for (int r = 0; r < R; ++r) {
      for (int b = 0; b < P; ++b) {
        const T* w = packed + (panel0 + b) * steps * V * kCols;
        int32_t sum[kCols] = {0};
        for (int64_t p = 0; p < steps; ++p) {
          const T* x = xs + V * (p * R + r);
          const T* wp = w + p * V * kCols;
          for (int64_t c = 0; c < kCols; ++c) {
            int32_t s = 0;
            for (int j = 0; j < V; ++j) s += static_cast<int32_t>(x[j]) * wp[V * c + j];
            sum[c] += s;
          }
        }
        for (int64_t c = 0; c < kCols; ++c) acc[r * kAccStride + b * kCols + c] = sum[c];
      }
    }
  }
};

#if defined(__x86_64__) || defined(__i386__)
// A panel's weights for one group of a row's inputs: int8's quad or int16's pair, 16 columns, 64 bytes.
constexpr int64_t kGroupBytes = 64;

// The AVX2 tile's sums: row i's lo<i> and hi<i>, columns 0-7 and 8-15 (expanded where the tile has R, `zero`
// and `acc`).
#define FS_AVX2_PAIR_DECL(i) __m256i lo##i = zero, hi##i = zero;
#define FS_AVX2_PAIR_STORE(i)                                                        \
  if constexpr (R > i) {                                                             \
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + i * kAccStride), lo##i);    \
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + i * kAccStride + 8), hi##i); \
  }

// One step of a row: its broadcast values xv times the step's weights w0 (columns 0-7) and w1 (8-15), added
// to its sums lo and hi.
template <class Step>
__attribute__((target("avx2"), always_inline)) inline void accumulate(__m256i xv, __m256i w0, __m256i w1,
                                                                      __m256i& lo, __m256i& hi) {
  lo = _mm256_add_epi32(lo, Step::mul(xv, w0));
  hi = _mm256_add_epi32(hi, Step::mul(xv, w1));
}

// 6 rows x one panel, the AVX2 tile of both precisions (int16 on its weights, int8 widened to int16 or as
// bytes; the Step says how): 12 sums (a row's columns 0-7 and 8-15), a step's 2 weight vectors and a
// broadcast, within AVX2's 16 registers. A panel holds kGroupBytes of weights for each group of a row's
// inputs (int8's quad, int16's pair), read in S steps; row i's values for step q are at
// xq[(q / S) * R * S + S * i + q % S]. For int8, before the pair order (quad order, each column's two
// pair sums kept apart): 3-row tiles spilled 8 sums to the stack in a build for AVX2 (-march=x86-64-v3,
// as on an EPYC), and 2-row tiles made int8 slower than int16 there (fixed k=5 in batches of 64 on the
// Multi30k transformer: 10.7 s against int16's 9.5). One input pair a step for the widened weights (as
// the int16 tile): both pairs of a quad in one step made GCC keep sums on the stack from 4 rows on.
template <class Step>
struct Avx2Tile {
  static constexpr Format kFormat = Step::kFormat;
  template <int R, int P>
  __attribute__((target("avx2"))) static void tile(const void* xq_, int64_t groups, const void* packed,
                                                   int64_t panel0, int32_t* acc) {
    static_assert(P == 1, "one panel: its two halves are the tile's columns");
    constexpr int64_t S = kGroupBytes / Step::kStepBytes;  // steps a group, and a 64-byte line
    const int32_t* xq = static_cast<const int32_t*>(xq_);
    const __m256i zero = _mm256_setzero_si256();
    FS_ROWS_6(FS_AVX2_PAIR_DECL)
    const int8_t* w = static_cast<const int8_t*>(packed) + panel0 * groups * kGroupBytes;
    for (int64_t q = 0; q < S * groups; ++q) {
      const int8_t* wp = w + q * Step::kStepBytes;
      const int32_t* xp = xq + (q / S) * R * S + q % S;
      if (q % S == 0) fs_quant::prefetch_ahead(wp);  // one prefetch a 64-byte line
      __m256i w0, w1;
      Step::load(wp, w0, w1);
#define FS_STEP(i) \
  if constexpr (R > i) accumulate<Step>(_mm256_set1_epi32(xp[S * i]), w0, w1, lo##i, hi##i);
      FS_ROWS_6(FS_STEP)
#undef FS_STEP
    }
    FS_ROWS_6(FS_AVX2_PAIR_STORE)
  }
};

// The AVX-512 VNNI tile of both precisions (int8's vpdpbusd, int16's vpdpwssd: the format says which), R rows
// x P panels, R * P <= 24 sums in registers: for int8 (12, 2) for batched rows, (4, 4) and (2, 8) for one
// sentence's few rows, so that a lone row still has 8 independent chains of multiply-adds; for int16 (12, 2),
// a beam of 5 in one pass of the weights. The sums are named variables (s<row>_<panel>), not an array: GCC
// kept an array of vectors on the stack, a load and a store around every multiply-add; the variables of rows
// and panels a tile lacks are compiled away.
#define FS_PANELS_8(X, i) X(i, 0) X(i, 1) X(i, 2) X(i, 3) X(i, 4) X(i, 5) X(i, 6) X(i, 7)
template <Format F>
struct Avx512VnniTile {
  static constexpr Format kFormat = F;
  // int8: vpdpbusd, the row's unsigned bytes q + 128 times the signed weights, four products a column
  // (nothing saturates); int16: vpdpwssd, the row's pair times each column's two weights.
  __attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline __m512i dot(__m512i acc,
                                                                                                 __m512i x,
                                                                                                 __m512i w) {
    static_assert(F == Format::kShifted8 || F == Format::kPairs16, "the VNNI tile's formats");
    if constexpr (F == Format::kPairs16) return _mm512_dpwssd_epi32(acc, x, w);
    return _mm512_dpbusd_epi32(acc, x, w);
  }
  template <int R, int P>
  __attribute__((target("avx512f,avx512bw,avx512vnni"))) static void tile(const void* xq_, int64_t groups,
                                                                          const void* packed, int64_t panel0,
                                                                          int32_t* acc) {
    static_assert(R * P <= 24 && P <= 8 && R <= 12, "a tile of at most 24 sums");
    const int32_t* xq = static_cast<const int32_t*>(xq_);
    const __m512i zero = _mm512_setzero_si512();
#define FS_DECL(i, j) __m512i s##i##_##j = zero;
#define FS_DECL_ROW(i) FS_PANELS_8(FS_DECL, i)
    FS_ROWS_12(FS_DECL_ROW)
#undef FS_DECL_ROW
#undef FS_DECL
    const int8_t* w = static_cast<const int8_t*>(packed) + panel0 * groups * kGroupBytes;
    const int64_t panel_bytes = groups * kGroupBytes;
    for (int64_t p = 0; p < groups; ++p) {
      const int8_t* wp = w + p * kGroupBytes;
#define FS_LOAD(j)                                                                  \
  if constexpr (P > j) fs_quant::prefetch_ahead(wp + j * panel_bytes);              \
  const __m512i w##j = P > j ? _mm512_loadu_si512(wp + j * panel_bytes) : zero;
      FS_LOAD(0) FS_LOAD(1) FS_LOAD(2) FS_LOAD(3) FS_LOAD(4) FS_LOAD(5) FS_LOAD(6) FS_LOAD(7)
#undef FS_LOAD
#define FS_STEP(i, j) \
  if constexpr (P > j) s##i##_##j = dot(s##i##_##j, x##i, w##j);
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

// float32(1 / scale), computed in double as the torch reference computes it.
inline float inverse(float scale) { return static_cast<float>(1.0 / static_cast<double>(scale)); }

// The scale row_scale gives a row the integers cannot hold: float_row computes its outputs instead.
constexpr float kFloatRow = 0.f;

// The largest |x[i]| of a row, and whether every x[i] is finite, in sixteen lanes (max is exact in any order).
// Finiteness is a second sum, of x[i] * 0: 0 for finite values, NaN from the first NaN or infinity on (not
// folded away: without -ffast-math, x * 0 is not 0 for those); the maxima pass over a NaN. omp simd makes GCC
// vectorize the lanes: without it GCC 12 kept them as sixteen scalar chains, 59 instructions for 16 values
// of the maxima alone against 10 for both sums.
struct RowPeak {
  float peak;
  bool finite;
};

inline RowPeak row_peak(const float* row, int64_t k) {
  float lane[16] = {0.f}, probe[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
#pragma omp simd
    for (int j = 0; j < 16; ++j) {
      const float v = std::fabs(row[i + j]);
      lane[j] = lane[j] > v ? lane[j] : v;
      probe[j] += row[i + j] * 0.f;
    }
  }
  float peak = 0.f, nonfinite = 0.f;
  for (int j = 0; j < 16; ++j) peak = std::max(peak, lane[j]), nonfinite += probe[j];
  for (; i < k; ++i) peak = std::max(peak, std::fabs(row[i])), nonfinite += row[i] * 0.f;
  return {peak, nonfinite == 0.f};
}

// A row's scale: a_max / max |x| (1 for an all-zero row), as int16_linear.integer_reference has it; or
// kFloatRow where integers cannot hold the row: a NaN or an infinity in it, or values so small that the
// scale overflows float32 (a peak below a_max / FLT_MAX, 3.7e-37 for int8). Rounding x * scale to an
// integer there would convert a NaN or an infinity to an integer, which is undefined behaviour (x86 gives
// INT_MIN: a NaN row came out finite, a +inf row NaN). Checked once a row, outside the products.
inline float row_scale(const float* row, int64_t k, float a_max) {
  const RowPeak p = row_peak(row, k);
  if (!p.finite) return kFloatRow;
  if (!(p.peak > 0.f)) return 1.f;
  const float s = a_max / p.peak;
  return std::isfinite(s) ? s : kFloatRow;
}

// Each row's scale replaced by its 1 / scale for dequantize, once a row and in place (no allocation a call). A
// kFloatRow row keeps kFloatRow, which no inverse is (1 / FLT_MAX is a subnormal, not 0): float_rows finds it.
inline void to_inverses(std::vector<float>& scale) {
  for (float& s : scale) s = s == kFloatRow ? kFloatRow : inverse(s);
}

// The outputs of a row the integers cannot hold (kFloatRow) in float32, as the float product on the
// dequantized weight gives them: y[n] = sum_i x[i] * (float(w(n, i)) * inv_w[n]) + b[n], each product and
// sum rounded to float32 and summed in order of i (no FMA, as int16_linear.integer_reference computes such
// rows). A NaN in x makes every output NaN; an infinity gives +-inf, or NaN where its weight is 0 or
// infinities of both signs meet, as float arithmetic does; values too small to scale give about b. Such
// rows are rare, hence plain loops.
template <class WeightAt>
__attribute__((optimize("fp-contract=off"), noinline)) void float_row(const float* x, int64_t k, int64_t out,
                                                                      const WeightAt& w, const float* inv_w,
                                                                      const float* bias, float* y) {
  for (int64_t n = 0; n < out; ++n) {
    float acc = 0.f;
    for (int64_t i = 0; i < k; ++i) acc += x[i] * (static_cast<float>(w(n, i)) * inv_w[n]);
    y[n] = bias ? acc + bias[n] : acc;
  }
}

// float_row for every row of a product's rows x (rows, k) whose scale (or inverse, to_inverses) is kFloatRow,
// into y (rows, out).
template <class WeightAt>
void float_rows(const float* x, int64_t k, const std::vector<float>& scale, int64_t out, const WeightAt& w,
                const float* inv_w, const float* bias, float* y) {
  for (size_t m = 0; m < scale.size(); ++m)
    if (scale[m] == kFloatRow) float_row(x + m * k, k, out, w, inv_w, bias, y + m * out);
}

// The float32 scales and bias a quantized product dequantizes with: (out,) CPU tensors each (the callers make
// them contiguous).
inline void check_scales_and_bias(const at::Tensor& weight_inv, const std::optional<at::Tensor>& bias,
                                  int64_t out_features, const char* op) {
  TORCH_CHECK(weight_inv.device().is_cpu() && weight_inv.scalar_type() == at::kFloat && weight_inv.dim() == 1 &&
                  weight_inv.numel() == out_features,
              op, ": weight_inv must be the packed weight's (", out_features, ",) float32 row scales");
  TORCH_CHECK(!bias || (bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                        bias->numel() == out_features),
              op, ": bias must be a (", out_features, ",) float32 CPU tensor");
}

// y[c] = (float(acc[c] - shift[c]) * inv_a) * inv_w[c] + bias[c] for each of `rows` rows of a tile's sums
// (row i at acc + i * acc_stride, its 1 / scale inv_a[i], its outputs at y + i * y_stride), each operation
// rounded to float32 as the torch reference rounds it: contracting a multiply and the add into one FMA (GCC
// does by default) would change the last bit. A function with other optimize options is not inlined into
// one without them, so a call takes a whole tile: one call a row of 16 sums cost more than the loop
// (a perf profile of int8 beam 5 on an AVX2 EPYC put 10% of the decode in the per-row function, half of it
// at its entry). The shift (the VNNI and avx2w7 kernels' excess, or none) and the bias are tested once,
// outside the loops, so that each loop is plain and vectorized.
__attribute__((optimize("fp-contract=off"), noinline)) static void dequantize_rows(
    const int32_t* __restrict acc, int64_t acc_stride, int64_t rows, int64_t count, const int32_t* __restrict shift,
    const float* __restrict inv_a, const float* __restrict inv_w, const float* __restrict bias, float* __restrict y,
    int64_t y_stride) {
  for (int64_t i = 0; i < rows; ++i) {
    const int32_t* __restrict a = acc + i * acc_stride;
    float* __restrict out = y + i * y_stride;
    const float s = inv_a[i];
    if (shift && bias)
      for (int64_t c = 0; c < count; ++c) out[c] = (static_cast<float>(a[c] - shift[c]) * s) * inv_w[c] + bias[c];
    else if (shift)
      for (int64_t c = 0; c < count; ++c) out[c] = (static_cast<float>(a[c] - shift[c]) * s) * inv_w[c];
    else if (bias)
      for (int64_t c = 0; c < count; ++c) out[c] = (static_cast<float>(a[c]) * s) * inv_w[c] + bias[c];
    else
      for (int64_t c = 0; c < count; ++c) out[c] = (static_cast<float>(a[c]) * s) * inv_w[c];
  }
}

// The kernel called `name` ("auto": the best, the last of `kernels`); an error naming `op` where this CPU
// has none of that name.
template <class Kernel>
const Kernel& find_kernel(const std::vector<Kernel>& kernels, const std::string& name, const char* op) {
  if (name == "auto") return kernels.back();
  for (const auto& k : kernels)
    if (k.name == name) return k;
  TORCH_CHECK(false, op, ": kernel '", name, "' does not run on this CPU (it has: ", kernels.back().name,
              " and below)");
  return kernels.back();  // not reached
}

template <class Kernel>
std::vector<std::string> kernel_names(const std::vector<Kernel>& kernels) {
  std::vector<std::string> names;
  for (const auto& k : kernels) names.push_back(k.name);
  return names;
}

}  // namespace fs_quant
#pragma GCC visibility pop
