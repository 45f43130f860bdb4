// A quantized linear layer as one object (quantized_linear_cpu.cpp): the lean runner's products under
// --quantize int8|int16, called from Python and from the compiled step (lean_step_cpu.cpp) alike.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

struct __attribute__((visibility("hidden"))) QuantizedLinear {
  int64_t bits;                  // 8 or 16
  at::Tensor packed;          // int8 (panels, quads, 64) in its kernel's order (packed_for), or int16 (panels, pairs, 32)
  at::Tensor weight_inv;      // float32 (out,): 1 / each output row's scale
  at::Tensor excess;          // int8: int32 (out,), 128 * each row's sum of quantized weights
  int64_t a_max;                 // int16: the largest |q| a row of x is scaled to
  int64_t weight_max;            // int8: the largest |w| of the quantized weight (127, or 63 for int8w7)
  std::optional<at::Tensor> bias;
  int64_t in_features, out_features;
  std::string kernel;            // "auto", one of the kernels' names, or "onednn" (int8)
  std::optional<at::Tensor> weight_kn;  // int8 with oneDNN: the quantized weight transposed, (in, out)
  int64_t onednn_from_rows;      // "auto": calls of at least this many rows go to oneDNN (with weight_kn)

  // x (..., in_features) float32 -> (..., out_features) float32.
  at::Tensor operator()(const at::Tensor& x) const;
};

