// The one product's constructor and what it tells about itself (product_cpu.h); ops/product.py calls it
// through bindings_cpu.cpp, once a weight.

#include "product_cpu.h"

using at::Tensor;

namespace {

// int8 or int16 on the packed weight and scales of `q`, after the checks the kernels' calls rely on.
QuantizedLinear quantized_of(int64_t bits, const std::optional<Tensor>& bias, const QuantizedParts& q) {
  TORCH_CHECK(q.packed && q.weight_inv, "Product: int", bits, " needs its packed weight and scales");
  TORCH_CHECK(bits == 16 || q.excess, "Product: int8 needs its excess");
  TORCH_CHECK(q.weight_inv->numel() == q.out_features, "Product: one scale per output row");
  TORCH_CHECK(q.kernel != "onednn" || q.weight_kn, "Product: kernel onednn needs weight_kn");
  return QuantizedLinear{bits, q.packed->contiguous(), q.weight_inv->contiguous(),
                         q.excess ? q.excess->contiguous() : Tensor(), q.a_max, q.weight_max,
                         bias ? std::optional<Tensor>(bias->contiguous()) : std::nullopt, q.in_features,
                         q.out_features, q.kernel,
                         q.weight_kn ? std::optional<Tensor>(q.weight_kn->contiguous()) : std::nullopt,
                         q.onednn_from_rows};
}

}  // namespace

Product make_product(const std::string& precision, const std::optional<Tensor>& weight,
                     const std::optional<Tensor>& bias, const QuantizedParts& q) {
  if (precision == "int8" || precision == "int16")
    return Product{std::nullopt, quantized_of(precision == "int8" ? 8 : 16, bias, q), Tensor(), std::nullopt};
  TORCH_CHECK(precision == "float32" || precision == "plain", "Product: precision float32, int8, int16 or plain, not ",
              precision);
  TORCH_CHECK(weight && weight->dim() == 2, "Product: ", precision, " needs a weight (out, in)");
  if (precision == "float32") {
    TORCH_CHECK(q.kernel == "auto" || q.kernel == "mkl" || q.kernel == "onednn",
                "Product: float32's kernel is mkl or onednn (auto: mkl), not ", q.kernel);
    const Float32Gemm gemm = q.kernel == "onednn" ? Float32Gemm::kOneDnn : Float32Gemm::kMkl;
    return Product{prepack_linear(*weight, bias, gemm), std::nullopt, Tensor(), std::nullopt};
  }
  return Product{std::nullopt, std::nullopt, *weight, bias};
}

std::string Product::precision() const {
  if (packed) return "float32";
  if (quantized) return quantized->bits == 8 ? "int8" : "int16";
  return "plain";
}

int64_t Product::in_features() const {
  if (packed) return packed->in_features;
  if (quantized) return quantized->in_features;
  return weight.size(1);
}

int64_t Product::out_features() const {
  if (packed) return packed->out_features;
  if (quantized) return quantized->out_features;
  return weight.size(0);
}
