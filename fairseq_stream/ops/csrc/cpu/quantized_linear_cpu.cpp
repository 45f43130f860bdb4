// A quantized linear layer as one object: the packed weight, its scales and the kernel, applied to
// inputs of any leading shape. fairseq_stream/ops/quantized_linear.py makes these (the scale rules)
// and documents them; the arithmetic is int8_linear_cpu.cpp's and int16_linear_cpu.cpp's.

#include "quantized_linear_cpu.h"

#include <vector>

#include "int16_linear_cpu.h"
#include "int8_linear_cpu.h"

using at::Tensor;

Tensor QuantizedLinear::operator()(const Tensor& x) const {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == in_features,
              "quantized linear: float32 CPU input of ", in_features, " features");
  auto shape = x.sizes().vec();
  shape.back() = out_features;
  const Tensor rows = x.reshape({-1, in_features});
  const bool onednn = bits == 8 && weight_kn &&
                      (kernel == "onednn" || (kernel == "auto" && rows.size(0) >= onednn_from_rows));
  const Tensor y = onednn      ? int8_linear_onednn(rows, *weight_kn, weight_inv, bias)
                   : bits == 8 ? int8_linear(rows, packed, weight_inv, excess, bias, kernel, weight_max)
                               : int16_linear(rows, packed, weight_inv, a_max, bias, kernel);
  return y.view(shape);
}
