// 16-bit fixed-point linear layer on the CPU (Devlin 2017, section 3): y = x W^T + b with W packed
// once as int16, x quantized per call and row as int16, products summed in int32.
// fairseq_stream/ops/int16_linear.py documents the op, the scale rule that keeps the int32 sums
// from overflowing, and holds the torch reference this must equal bit for bit.
//
// Packed layout (made by int16_linear.pack): blocks of 8 output columns; within a block, for each
// pair of input positions k, k+1 the 16 values w[n][k], w[n][k+1] for its 8 columns n. One 256-bit
// load is then one vpmaddwd operand: a broadcast pair (x[k], x[k+1]) times it gives each column's
// two products summed, in int32. The micro-kernel keeps up to 6 rows x 2 blocks (12 accumulators)
// in registers, so each weight load serves 6 rows and each broadcast 16 columns.
//
// AVX2 where the compiler targets it (setup.py builds with -march=native), else portable loops
// with the same integer arithmetic (so both give identical results; the portable loops are always
// built, and a flag runs them, so tests compare the two on one machine). No AVX-512 VNNI kernel
// yet: this machine has no AVX-512 to test one on.

#include "int16_linear_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#define FS_INT16_AVX2 1
#else
#define FS_INT16_AVX2 0
#endif

namespace {

constexpr int64_t kCols = 8;     // output columns per packed block
constexpr int64_t kRows = 6;     // rows per micro-kernel (a beam of 5 or 6 in one pass)
constexpr int64_t kBlocks = 2;   // column blocks per micro-kernel

// Rows of x quantized: q[m][k] = round(x[m][k] * scale[m]), scale[m] = a_max / max_k |x[m][k]|
// (1 for an all-zero row). Written with K padded to an even count (the pad is 0).
void quantize_rows(const float* x, int64_t rows, int64_t k, int64_t k_pad, int32_t a_max, int16_t* q,
                   float* scale) {
  for (int64_t m = 0; m < rows; ++m) {
    const float* row = x + m * k;
    float peak = 0.f;
    for (int64_t i = 0; i < k; ++i) peak = std::max(peak, std::fabs(row[i]));
    const float s = peak > 0.f ? static_cast<float>(a_max) / peak : 1.f;
    scale[m] = s;
    int16_t* out = q + m * k_pad;
    for (int64_t i = 0; i < k; ++i) out[i] = static_cast<int16_t>(std::nearbyint(row[i] * s));
    for (int64_t i = k; i < k_pad; ++i) out[i] = 0;
  }
}

// acc[r][c] for rows [m0, m0 + R) and the columns of blocks [b0, b0 + B), portable.
template <int R, int B>
void block_portable(const int16_t* q, int64_t k_pairs, const int16_t* packed, int64_t b0, int32_t* acc) {
  for (int r = 0; r < R; ++r) {
    const int16_t* xr = q + r * 2 * k_pairs;
    for (int b = 0; b < B; ++b) {
      const int16_t* w = packed + (b0 + b) * k_pairs * 2 * kCols;
      // Columns innermost over contiguous weights: a loop compilers vectorize.
      int32_t sum[kCols] = {0};
      for (int64_t p = 0; p < k_pairs; ++p) {
        const int32_t x0 = xr[2 * p], x1 = xr[2 * p + 1];
        const int16_t* wp = w + p * 2 * kCols;
        for (int64_t c = 0; c < kCols; ++c) sum[c] += x0 * wp[2 * c] + x1 * wp[2 * c + 1];
      }
      for (int64_t c = 0; c < kCols; ++c) acc[r * kBlocks * kCols + b * kCols + c] = sum[c];
    }
  }
}

#if FS_INT16_AVX2
template <int R, int B>
void block_avx2(const int16_t* q, int64_t k_pairs, const int16_t* packed, int64_t b0, int32_t* acc) {
  __m256i sum[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) sum[r][b] = _mm256_setzero_si256();
  const int16_t* w[B];
  for (int b = 0; b < B; ++b) w[b] = packed + (b0 + b) * k_pairs * 2 * kCols;
  const int32_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = reinterpret_cast<const int32_t*>(q + r * 2 * k_pairs);
  for (int64_t p = 0; p < k_pairs; ++p) {
    __m256i wv[B];
    for (int b = 0; b < B; ++b) wv[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[b] + p * 16));
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_set1_epi32(x[r][p]);  // the pair (x[2p], x[2p+1])
      for (int b = 0; b < B; ++b) sum[r][b] = _mm256_add_epi32(sum[r][b], _mm256_madd_epi16(xv, wv[b]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kBlocks * kCols + b * kCols), sum[r][b]);
}
#endif

template <int R, int B>
void block(bool portable, const int16_t* q, int64_t k_pairs, const int16_t* packed, int64_t b0, int32_t* acc) {
#if FS_INT16_AVX2
  if (!portable) return block_avx2<R, B>(q, k_pairs, packed, b0, acc);
#endif
  block_portable<R, B>(q, k_pairs, packed, b0, acc);
}

// y[c] = float(acc[c]) * inv + bias[c], rounded after the multiply and after the add as the torch
// reference rounds them: contracting the two into one FMA (GCC does by default) would change the
// last bit. (A function with other optimize options is not inlined into one without them.)
__attribute__((optimize("fp-contract=off"), noinline)) void dequantize(const int32_t* acc, int64_t count,
                                                                       float inv, const float* bias, float* y) {
  for (int64_t c = 0; c < count; ++c) {
    const float scaled = static_cast<float>(acc[c]) * inv;
    y[c] = bias ? scaled + bias[c] : scaled;
  }
}

// Row counts 1..6 and block counts 1..2 as template arguments: the accumulators stay in registers
// (6 x 2 sums, 2 weight vectors and a broadcast: 15 of AVX2's 16).
void block_any(bool portable, int rows, int blocks, const int16_t* q, int64_t k_pairs, const int16_t* packed,
               int64_t b0, int32_t* acc) {
  switch (rows * 2 + blocks - 3) {
    case 0: return block<1, 1>(portable, q, k_pairs, packed, b0, acc);
    case 1: return block<1, 2>(portable, q, k_pairs, packed, b0, acc);
    case 2: return block<2, 1>(portable, q, k_pairs, packed, b0, acc);
    case 3: return block<2, 2>(portable, q, k_pairs, packed, b0, acc);
    case 4: return block<3, 1>(portable, q, k_pairs, packed, b0, acc);
    case 5: return block<3, 2>(portable, q, k_pairs, packed, b0, acc);
    case 6: return block<4, 1>(portable, q, k_pairs, packed, b0, acc);
    case 7: return block<4, 2>(portable, q, k_pairs, packed, b0, acc);
    case 8: return block<5, 1>(portable, q, k_pairs, packed, b0, acc);
    case 9: return block<5, 2>(portable, q, k_pairs, packed, b0, acc);
    case 10: return block<6, 1>(portable, q, k_pairs, packed, b0, acc);
    default: return block<6, 2>(portable, q, k_pairs, packed, b0, acc);
  }
}

}  // namespace

torch::Tensor int16_linear(torch::Tensor x, torch::Tensor packed, double weight_scale, int64_t out_features,
                           int64_t a_max, std::optional<torch::Tensor> bias, bool portable) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2,
              "int16_linear: x must be a 2-d float32 CPU tensor");
  TORCH_CHECK(packed.scalar_type() == torch::kShort && packed.dim() == 3 && packed.size(2) == 2 * kCols,
              "int16_linear: packed must come from int16_linear.pack");
  TORCH_CHECK(a_max >= 1 && a_max <= 32767, "int16_linear: a_max must be in [1, 32767]");
  x = x.contiguous();
  packed = packed.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), k_pairs = packed.size(1);
  const int64_t k_pad = 2 * k_pairs, n_blocks = packed.size(0);
  TORCH_CHECK((k + 1) / 2 == k_pairs && out_features <= n_blocks * kCols,
              "int16_linear: x has ", k, " features, the packed weight ", 2 * k_pairs);
  const float* b = nullptr;
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == out_features, "int16_linear: bias");
    *bias = bias->contiguous();
    b = bias->data_ptr<float>();
  }
  auto out = torch::empty({rows, out_features}, x.options());
  std::vector<int16_t> q(rows * k_pad);
  std::vector<float> scale(rows);
  quantize_rows(x.data_ptr<float>(), rows, k, k_pad, static_cast<int32_t>(a_max), q.data(), scale.data());
  const int16_t* w = packed.data_ptr<int16_t>();
  float* y = out.data_ptr<float>();
  // Split over column blocks: each thread streams its own part of the (large) weight once.
  at::parallel_for(0, (n_blocks + kBlocks - 1) / kBlocks, 1, [&](int64_t first, int64_t last) {
    int32_t acc[kRows * kBlocks * kCols];
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t b0 = pair * kBlocks;
      const int blocks = static_cast<int>(std::min<int64_t>(kBlocks, n_blocks - b0));
      for (int64_t m0 = 0; m0 < rows; m0 += kRows) {
        const int r = static_cast<int>(std::min<int64_t>(kRows, rows - m0));
        block_any(portable, r, blocks, q.data() + m0 * k_pad, k_pairs, w, b0, acc);
        for (int i = 0; i < r; ++i) {
          const float inv = static_cast<float>(1.0 / (static_cast<double>(scale[m0 + i]) * weight_scale));
          const int64_t n0 = b0 * kCols;
          dequantize(acc + i * kBlocks * kCols, std::min<int64_t>(blocks * kCols, out_features - n0), inv,
                     b ? b + n0 : nullptr, y + (m0 + i) * out_features + n0);
        }
      }
    }
  });
  return out;
}

void register_int16_linear(pybind11::module& m) {
  m.def("int16_linear", &int16_linear,
        "(x float32 (rows, in), packed int16, weight_scale, out_features, a_max, bias or None, portable) -> "
        "float32 (rows, out); portable=True runs the portable loops even where AVX2 is built (tests); "
        "see fairseq_stream/ops/int16_linear.py",
        py::arg("x"), py::arg("packed"), py::arg("weight_scale"), py::arg("out_features"), py::arg("a_max"),
        py::arg("bias") = py::none(), py::arg("portable") = false);
#if FS_INT16_AVX2
  m.attr("int16_simd") = "avx2";
#else
  m.attr("int16_simd") = "none";
#endif
}
