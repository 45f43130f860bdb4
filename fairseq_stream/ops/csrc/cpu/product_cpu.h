// The product x W^T + b as every compiled step takes it (the lean runner's layers, the search loops, the LSTM
// step): float32 on a weight packed for MKL (PrepackedLinear, with the skinny tiles at few rows), int8 or
// int16 on a quantized weight (QuantizedLinear), or at::linear on a plain weight (float64, no MKL, or the
// LSTM's float output layer). Python makes each through ops/lean_step.py:product_of.
#pragma once

#include <torch/extension.h>

#include <optional>

#include "prepacked_linear_cpu.h"
#include "quantized_linear_cpu.h"

struct __attribute__((visibility("hidden"))) Product {
  std::optional<PrepackedLinear> packed;
  std::optional<QuantizedLinear> quantized;
  torch::Tensor weight;
  std::optional<torch::Tensor> bias;

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (packed) return (*packed)(x);
    if (quantized) return (*quantized)(x);
    return at::linear(x, weight, bias);
  }
};
