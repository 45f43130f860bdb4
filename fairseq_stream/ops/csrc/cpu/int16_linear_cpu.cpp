// 16-bit fixed-point linear layer on the CPU (Devlin 2017, section 3): y = x W^T + b with W packed
// once as int16, x quantized per call and row as int16, products summed in int32.
// fairseq_stream/ops/int16_linear.py documents the op, the scale rule that keeps the int32 sums
// from overflowing, and holds the torch reference this must equal bit for bit.
//
// Packed layout (made by int16_linear.pack): panels of 16 output columns; within a panel, for each
// pair of input positions k, k+1 the 32 values w[n][k], w[n][k+1] for its 16 columns n. A broadcast
// pair (x[k], x[k+1]) times 16 of those int16 is one multiply-add of 8 columns' two products each,
// summed in int32: vpmaddwd + vpaddd on AVX2 (two 256-bit halves per panel), one vpdpwssd on
// AVX-512 VNNI (the whole panel in one 512-bit register).
//
// Kernels, chosen at run time from what the CPU reports (__builtin_cpu_supports, capped by
// ATEN_CPU_CAPABILITY as torch's are: cpu_isa_cpu.h), not from the compiler's -march: each is compiled for its own target (the target attribute), so one build runs
// on any x86-64 CPU and uses the best kernel it has. "portable" is plain loops with the same integer
// arithmetic; every kernel gives identical results (integer sums are exact whatever their order:
// the scale rule bounds every partial sum), and a name picks one, so tests compare them all.

#include "int16_linear_cpu.h"

#include "cpu_isa_cpu.h"
#include "quantized_tiles_cpu.h"

#include "parallel_cpu.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FS_INT16_X86 1
#else
#define FS_INT16_X86 0
#endif

namespace {

using fs_quant::kCols;
constexpr int kAccRows = 12;      // the most rows a tile holds
constexpr int kAccPanels = 2;     // the most panels a tile holds
constexpr int64_t kAccStride = kAccPanels * kCols;  // int32 sums per row in a tile's output

// A tile's rows of x, quantized and packed: xq[p * R + r] holds row r's pair (x[2p], x[2p+1]) as
// two int16 in one int32 (the broadcast operand), so a tile reads its R rows from one pointer at
// offsets known at compile time (with a pointer per row, GCC spilled the 12-row tile to the stack).
using Tile = void (*)(const int32_t* xq, int64_t k_pairs, const int16_t* packed, int64_t panel0, int32_t* acc);

// Rows of x quantized: q[m][k] = round(x[m][k] * scale[m]), scale[m] = a_max / max_k |x[m][k]|
// (1 for an all-zero row; a row that integers cannot hold gets kFloatRow and zeros, its outputs written by
// float_rows), packed tile by tile (tiles of tile_rows rows, the last one shorter): tile t starts at
// xq + t * tile_rows * k_pairs. K is padded to an even count with 0.
void quantize_rows(const float* x, int64_t rows, int64_t k, int64_t k_pairs, int32_t a_max, int64_t tile_rows,
                   int32_t* xq, float* scale) {
  int16_t* out = reinterpret_cast<int16_t*>(xq);
  for (int64_t m = 0; m < rows; ++m) {
    const float* row = x + m * k;
    const float s = fs_quant::row_scale(row, k, static_cast<float>(a_max));
    scale[m] = s;
    const int64_t m0 = m - m % tile_rows, r = m - m0, R = std::min(tile_rows, rows - m0);
    int16_t* tile = out + 2 * m0 * k_pairs;
    if (s == fs_quant::kFloatRow) {
      for (int64_t i = 0; i < k; ++i) tile[2 * ((i / 2) * R + r) + i % 2] = 0;
    } else {
      for (int64_t i = 0; i < k; ++i)
        tile[2 * ((i / 2) * R + r) + i % 2] = static_cast<int16_t>(std::nearbyint(row[i] * s));
    }
    if (k % 2) tile[2 * ((k / 2) * R + r) + 1] = 0;
  }
}

// w(n, i) of the packed int16 weight (int16_linear.pack): panels of 16 outputs, each input pair's 32 values.
struct PackedWeightAt {
  const int16_t* packed;
  int64_t k_pairs;
  int16_t operator()(int64_t n, int64_t i) const {
    return packed[((n / kCols) * k_pairs + i / 2) * 2 * kCols + 2 * (n % kCols) + i % 2];
  }
};

// Each kernel: the most rows and panels of one tile, and tile<R, P> computing acc[r][p * 16 + c]
// for the tile's R rows and the columns of panels [panel0, panel0 + P).

struct Portable {
  static constexpr int kRows = 6, kPanels = 1;
  template <int R, int P>
  static void tile(const int32_t* xq, int64_t k_pairs, const int16_t* packed, int64_t panel0, int32_t* acc) {
    const int16_t* xs = reinterpret_cast<const int16_t*>(xq);
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
  static constexpr int kRows = 6, kPanels = 1;
  template <int R, int P>
  __attribute__((target("avx2"))) static void tile(const int32_t* xq, int64_t k_pairs, const int16_t* packed,
                                                   int64_t panel0, int32_t* acc) {
    static_assert(P == 1, "one panel: its two halves are the tile's columns");
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
  static constexpr int kRows = 12, kPanels = 2;
  template <int R, int P>
  __attribute__((target("avx512f,avx512vnni"))) static void tile(const int32_t* xq, int64_t k_pairs,
                                                                 const int16_t* packed, int64_t panel0,
                                                                 int32_t* acc) {
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

// Every (rows, panels) a kernel's tiles take, as template instances: table[(R - 1) * kPanels + P - 1],
// so the sums stay in registers whatever the remainder of rows or panels.
template <class K, size_t I>
void tile_at(const int32_t* xq, int64_t k_pairs, const int16_t* packed, int64_t panel0, int32_t* acc) {
  K::template tile<static_cast<int>(I) / K::kPanels + 1, static_cast<int>(I) % K::kPanels + 1>(xq, k_pairs, packed,
                                                                                                 panel0, acc);
}

template <class K, size_t... I>
std::array<Tile, sizeof...(I)> tiles(std::index_sequence<I...>) {
  return {&tile_at<K, I>...};
}

struct Kernel {
  std::string name;
  int rows, panels;
  std::vector<Tile> table;
};

template <class K>
Kernel make_kernel(const char* name) {
  static_assert(K::kRows <= kAccRows && K::kPanels <= kAccPanels, "a tile larger than its output");
  const auto t = tiles<K>(std::make_index_sequence<K::kRows * K::kPanels>{});
  return Kernel{name, K::kRows, K::kPanels, std::vector<Tile>(t.begin(), t.end())};
}

// The kernels this CPU can run, the best last.
const std::vector<Kernel>& available_kernels() {
  static const std::vector<Kernel> kernels = [] {
    std::vector<Kernel> out{make_kernel<Portable>("portable")};
#if FS_INT16_X86
    __builtin_cpu_init();
    if (fs_cpu::allows_avx2()) out.push_back(make_kernel<Avx2>("avx2"));
    if (fs_cpu::allows_avx512() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni"))
      out.push_back(make_kernel<Avx512Vnni>("avx512vnni"));
#endif
    return out;
  }();
  return kernels;
}

const Kernel& find_kernel(const std::string& name) {
  return fs_quant::find_kernel(available_kernels(), name, "int16_linear");
}

}  // namespace

std::vector<std::string> int16_kernels() { return fs_quant::kernel_names(available_kernels()); }

torch::Tensor int16_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor weight_inv, int64_t a_max,
                           std::optional<torch::Tensor> bias, const std::string& kernel) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2,
              "int16_linear: x must be a 2-d float32 CPU tensor");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kShort && packed.dim() == 3 &&
                  packed.size(2) == 2 * kCols,
              "int16_linear: packed must come from int16_linear.pack");
  TORCH_CHECK(a_max >= 1 && a_max <= 32767, "int16_linear: a_max must be in [1, 32767]");
  const int64_t out_features = weight_inv.numel();
  fs_quant::check_scales_and_bias(weight_inv, bias, out_features, "int16_linear");
  weight_inv = weight_inv.contiguous();
  const Kernel& kern = find_kernel(kernel);
  x = x.contiguous();
  packed = packed.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), k_pairs = packed.size(1);
  const int64_t n_panels = packed.size(0);
  TORCH_CHECK((k + 1) / 2 == k_pairs, "int16_linear: x has ", k, " features, the packed weight ", 2 * k_pairs);
  TORCH_CHECK(n_panels == (out_features + kCols - 1) / kCols, "int16_linear: the packed weight has ", n_panels,
              " panels of ", kCols, " outputs for ", out_features, " scales");
  const float* b = nullptr;
  if (bias) {
    *bias = bias->contiguous();
    b = bias->data_ptr<float>();
  }
  auto out = torch::empty({rows, out_features}, x.options());
  std::vector<int32_t> xq(rows * k_pairs);
  std::vector<float> scale(rows);  // each row's scale, then its inverse (to_inverses)
  quantize_rows(x.data_ptr<float>(), rows, k, k_pairs, static_cast<int32_t>(a_max), kern.rows, xq.data(),
                scale.data());
  fs_quant::to_inverses(scale);
  const int16_t* w = packed.data_ptr<int16_t>();
  const float* inv_w = weight_inv.data_ptr<float>();
  float* y = out.data_ptr<float>();
  // Split over groups of panels: each thread streams its own part of the (large) weight once.
  // A group's multiply-adds: each chunk holds enough of them to pay for waking a thread.
  const int64_t group_work = rows * kern.panels * kCols * 2 * k_pairs;
  fs::parallel_for(0, (n_panels + kern.panels - 1) / kern.panels, fs::grain_for(group_work, fs::kMinChunkWork),
                   [&](int64_t first, int64_t last) {
    int32_t acc[kAccRows * kAccStride];
    for (int64_t group = first; group < last; ++group) {
      const int64_t p0 = group * kern.panels;
      const int panels = static_cast<int>(std::min<int64_t>(kern.panels, n_panels - p0));
      for (int64_t m0 = 0; m0 < rows; m0 += kern.rows) {
        const int r = static_cast<int>(std::min<int64_t>(kern.rows, rows - m0));
        kern.table[(r - 1) * kern.panels + panels - 1](xq.data() + m0 * k_pairs, k_pairs, w, p0, acc);
        for (int i = 0; i < r; ++i) {
          const int64_t n0 = p0 * kCols;
          fs_quant::dequantize(acc + i * kAccStride, std::min<int64_t>(panels * kCols, out_features - n0),
                               scale[m0 + i], inv_w + n0, b ? b + n0 : nullptr, y + (m0 + i) * out_features + n0);
        }
      }
    }
  });
  fs_quant::float_rows(x.data_ptr<float>(), k, scale, out_features, PackedWeightAt{w, k_pairs}, inv_w, b, y);
  return out;
}
