// 8-bit linear layer on the CPU: y = x W^T + b with W quantized once per output row to int8, x
// quantized per call and row to int8, products summed exactly in int32, then dequantized.
// fairseq_stream/ops/quantized_linear.py documents the op and its scale rule, and holds the torch
// reference this must equal bit for bit.
//
// The packed layout and the kernels' steps are int8_tiles_cpu.h's; the tiles run through the driver
// that int16 shares (quantized_product_cpu.cpp). Here: the op's checks, the packed weight read back for rows
// the integers cannot hold, and oneDNN's GEMM for calls of many rows.

#include "int8_linear_cpu.h"

#include "cpu_isa_cpu.h"

#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/matmul.h>
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "int8_tiles_cpu.h"
#include "quantized_product_cpu.h"

namespace {

using fs_quant::kCols;
using int8_tiles::kPanelBytes;
using int8_tiles::kQuad;

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

std::vector<std::string> int8_kernels(int64_t weight_max) {
  return fs_quant::kernel_names(fs_quant::kernels_for(fs_quant::Precision::kInt8, static_cast<int>(weight_max)));
}

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

at::Tensor int8_linear_onednn(at::Tensor x, const at::Tensor& weight_kn, const at::Tensor& weight_inv,
                                 const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "int8_linear: x must be a 2-d float32 CPU tensor");
  TORCH_CHECK(int8_onednn_exact(), "int8_linear: oneDNN's int8 product is not exact on this CPU (or not built)");
  TORCH_CHECK(weight_kn.device().is_cpu() && weight_kn.scalar_type() == at::kChar && weight_kn.dim() == 2 &&
                  weight_kn.size(0) == x.size(1) && weight_kn.size(1) == weight_inv.numel(),
              "int8_linear: weight_kn must be the quantized weight transposed, (in, out) int8");
  const int64_t rows = x.size(0), k = x.size(1), out_features = weight_kn.size(1);
  fs_quant::check_scales_and_bias(weight_inv, bias, out_features, "int8_linear");
  TORCH_CHECK(k <= kMaxInFeatures, "int8_linear: ", k, " input features could overflow int32 sums (at most ",
              kMaxInFeatures, ")");
  x = x.contiguous();
  auto out = at::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  // The rows quantized exactly as the own kernels quantize them (signed, row-major).
  auto xq = at::empty({rows, k}, x.options().dtype(at::kChar));
  std::vector<float> scale(rows);  // each row's scale, then its inverse (to_inverses)
  std::vector<int32_t> q(k);
  const float* xs = x.data_ptr<float>();
  int8_t* qs = xq.data_ptr<int8_t>();
  for (int64_t m = 0; m < rows; ++m) {
    scale[m] = fs_quant::row_scale(xs + m * k, k, fs_quant::kInt8Max);
    if (scale[m] == fs_quant::kFloatRow)
      std::fill(q.begin(), q.end(), 0);
    else
      fs_quant::round_row(xs + m * k, k, k, scale[m], q.data());
    for (int64_t i = 0; i < k; ++i) qs[m * k + i] = static_cast<int8_t>(q[i]);
  }
  const at::Tensor kn = weight_kn.contiguous(), inv_t = weight_inv.contiguous();
  const at::Tensor b_t = bias ? bias->contiguous() : at::Tensor();
  const auto acc = at::_int_mm(xq, kn);
  const int32_t* a = acc.data_ptr<int32_t>();
  const float* inv_w = inv_t.data_ptr<float>();
  const float* b = bias ? b_t.data_ptr<float>() : nullptr;
  float* y = out.data_ptr<float>();
  fs_quant::to_inverses(scale);
  fs_quant::dequantize_rows(a, out_features, rows, out_features, nullptr, scale.data(), inv_w, b, y, out_features);
  fs_quant::float_rows(xs, k, scale, out_features, TransposedWeightAt{kn.data_ptr<int8_t>(), out_features}, inv_w, b,
                       y);
  return out;
}

at::Tensor int8_linear(at::Tensor x, at::Tensor packed, at::Tensor weight_inv, at::Tensor excess,
                          std::optional<at::Tensor> bias, const std::string& kernel, int64_t weight_max) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "int8_linear: x must be a 2-d float32 CPU tensor");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kChar && packed.dim() == 3 &&
                  packed.size(2) == kPanelBytes,
              "int8_linear: packed must come from quantized_linear.packed_for");
  const int64_t out_features = weight_inv.numel();
  fs_quant::check_scales_and_bias(weight_inv, bias, out_features, "int8_linear");
  TORCH_CHECK(excess.device().is_cpu() && excess.scalar_type() == at::kInt && excess.numel() == out_features,
              "int8_linear: excess must be 128 * each row's sum of quantized weights (int32)");
  const fs_quant::Kernel& kern =
      fs_quant::find_kernel(fs_quant::Precision::kInt8, kernel, static_cast<int>(weight_max), "int8_linear");
  x = x.contiguous(), packed = packed.contiguous(), weight_inv = weight_inv.contiguous();
  excess = excess.contiguous();
  const int64_t k = x.size(1), quads = packed.size(1), n_panels = packed.size(0);
  TORCH_CHECK((k + kQuad - 1) / kQuad == quads, "int8_linear: x has ", k, " features, the packed weight ",
              kQuad * quads);
  TORCH_CHECK(n_panels == (out_features + kCols - 1) / kCols, "int8_linear: the packed weight has ", n_panels,
              " panels of ", kCols, " outputs for ", out_features, " scales");
  TORCH_CHECK(k <= kMaxInFeatures, "int8_linear: ", k, " input features could overflow int32 sums (at most ",
              kMaxInFeatures, ")");
  const int8_t* w = packed.data_ptr<int8_t>();
  const PackedWeightAt weight_at{w, quads, kern.format == fs_quant::Format::kWide16};
  return fs_quant::product_of_rows(kern, x, w, quads, n_panels, weight_inv, bias, excess.data_ptr<int32_t>(),
                                   fs_quant::kInt8Max, weight_at);
}
