// The one product op, x W^T + b, with its precision and instruction set as parameters (issue 51, item 4):
// float32 on a weight packed for MKL or oneDNN (PrepackedLinear, with the skinny tiles at few rows), int8 or int16 on a
// quantized weight (QuantizedLinear: the quantized product's kernels, the best this CPU runs or the one
// named), or at::linear on a plain weight (float64, no MKL, the LSTM's float layers). Every compiled step
// takes it (the lean runner's layers, the search loops, the LSTM step) and Python calls it: bindings_cpu.cpp
// binds this one type as `Product`, made by make_product (product_cpu.cpp) from what ops/product.py hands it.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/linear.h>

#include <optional>
#include <string>

#include "prepacked_linear_cpu.h"
#include "quantized_linear_cpu.h"

struct __attribute__((visibility("hidden"))) Product {
  std::optional<PrepackedLinear> packed;
  std::optional<QuantizedLinear> quantized;
  at::Tensor weight;
  std::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {
    if (packed) return (*packed)(x);
    if (quantized) return (*quantized)(x);
    return at::linear(x, weight, bias);
  }

  // "float32", "int8", "int16" or "plain".
  std::string precision() const;
  int64_t in_features() const;
  int64_t out_features() const;
};

// A quantized weight as ops/product.py packs it (int8: ops/quantized_linear.py; int16: ops/int16_linear.py):
// what QuantizedLinear holds besides its bits and bias.
struct QuantizedParts {
  std::optional<at::Tensor> packed;      // int8 (panels, quads, 64) in its kernel's order, or int16 (panels, pairs, 32)
  std::optional<at::Tensor> weight_inv;  // float32 (out,): 1 / each output row's scale
  std::optional<at::Tensor> excess;      // int8: int32 (out,), 128 * each row's sum of quantized weights
  int64_t a_max = 0;                        // int16: the largest |q| a row of x is scaled to
  int64_t weight_max = 127;                 // int8: the largest |w| (127, or 63 for int8w7)
  int64_t in_features = 0, out_features = 0;
  std::string kernel = "auto";              // "auto", one of the kernels' names, or "onednn" (int8); float32:
                                            // "mkl" (also "auto") or "onednn", the GEMM above the skinny rows
  std::optional<at::Tensor> weight_kn;   // int8 with oneDNN: the quantized weight transposed, (in, out)
  int64_t onednn_from_rows = 0;             // "auto": calls of at least this many rows go to oneDNN
};

// The one constructor: "float32" packs `weight` for MKL or oneDNN (q.kernel), "plain" keeps it for at::linear, "int8" and "int16"
// take the quantized weight in `q` (the bias is the float32 one in each case). Checks every part.
Product make_product(const std::string& precision, const std::optional<at::Tensor>& weight,
                     const std::optional<at::Tensor>& bias, const QuantizedParts& q);
