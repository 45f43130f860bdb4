// One --rnn-int16 decoder step of a fairseq LSTM model (rnn_step_cpu.cpp), bound into the same
// extension module as the fused output layer.
#pragma once

#include <torch/extension.h>

#include <optional>

// x W^T + b: the int16 kernel on a packed weight (int16_linear.pack), or at::linear on a float one
// (the output layer under --no-rnn-int16-output).
struct __attribute__((visibility("hidden"))) Int16Product {
  torch::Tensor packed;
  torch::Tensor weight_inv;  // float32 (out,): the packed weight's row scales, inverted
  int64_t out_features;
  int64_t a_max;
  std::optional<torch::Tensor> bias;
  std::optional<torch::Tensor> weight;

  torch::Tensor operator()(const torch::Tensor& x) const;
};

void register_rnn_step(pybind11::module& m);
