// 16-bit fixed-point linear layer on the CPU (Devlin 2017, section 3): y = x W^T + b with W packed
// once as int16, x quantized per call and row as int16, products summed in int32.
// fairseq_stream/ops/int16_linear.py documents the op, the scale rule that keeps the int32 sums
// from overflowing, and holds the torch reference this must equal bit for bit.
//
// The packed layout and the kernels' steps are int16_tiles_cpu.h's; the tiles run through the driver
// that int8 shares (quantized_product_cpu.cpp). Here: the op's checks and the packed weight read back for
// rows the integers cannot hold.

#include "int16_linear_cpu.h"

#include <cstdint>
#include <string>
#include <vector>

#include "quantized_product_cpu.h"

namespace {

using fs_quant::kCols;

// w(n, i) of the packed int16 weight (int16_linear.pack): panels of 16 outputs, each input pair's 32 values.
struct PackedWeightAt {
  const int16_t* packed;
  int64_t k_pairs;
  int16_t operator()(int64_t n, int64_t i) const {
    return packed[((n / kCols) * k_pairs + i / 2) * 2 * kCols + 2 * (n % kCols) + i % 2];
  }
};

constexpr int kInt16Weight = 32767;  // the int16 kernels sum any int16 weight

}  // namespace

std::vector<std::string> int16_kernels() {
  return fs_quant::kernel_names(fs_quant::kernels_for(fs_quant::Precision::kInt16, kInt16Weight));
}

at::Tensor int16_linear(at::Tensor x, at::Tensor packed, at::Tensor weight_inv, int64_t a_max,
                           std::optional<at::Tensor> bias, const std::string& kernel) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "int16_linear: x must be a 2-d float32 CPU tensor");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kShort && packed.dim() == 3 &&
                  packed.size(2) == 2 * kCols,
              "int16_linear: packed must come from int16_linear.pack");
  TORCH_CHECK(a_max >= 1 && a_max <= 32767, "int16_linear: a_max must be in [1, 32767]");
  const int64_t out_features = weight_inv.numel();
  fs_quant::check_scales_and_bias(weight_inv, bias, out_features, "int16_linear");
  weight_inv = weight_inv.contiguous();
  const fs_quant::Kernel& kern =
      fs_quant::find_kernel(fs_quant::Precision::kInt16, kernel, kInt16Weight, "int16_linear");
  x = x.contiguous();
  packed = packed.contiguous();
  const int64_t k = x.size(1), k_pairs = packed.size(1);
  const int64_t n_panels = packed.size(0);
  TORCH_CHECK((k + 1) / 2 == k_pairs, "int16_linear: x has ", k, " features, the packed weight ", 2 * k_pairs);
  TORCH_CHECK(n_panels == (out_features + kCols - 1) / kCols, "int16_linear: the packed weight has ", n_panels,
              " panels of ", kCols, " outputs for ", out_features, " scales");
  const int16_t* w = packed.data_ptr<int16_t>();
  return fs_quant::product_of_rows(kern, x, w, k_pairs, n_panels, weight_inv, bias, nullptr,
                                   static_cast<float>(a_max), PackedWeightAt{w, k_pairs});
}
