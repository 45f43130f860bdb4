// One --rnn-int16 decoder step of a fairseq LSTM model (rnn_step_cpu.cpp); bindings_cpu.cpp binds it.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "product_cpu.h"

using at::Tensor;

// [logits (rows, V), h (layers, rows, H), c (layers, rows, H), out (rows, H)]; the products are the lean runner's
// (product_cpu.h): int16 on a packed weight, or at::linear on a float one (--no-rnn-int16-output).
// fairseq_stream/ops/rnn_step.py documents the arguments.
std::vector<Tensor> rnn_step(const Tensor& x_in, const Tensor& feed_in, const Tensor& h_in, const Tensor& c_in,
                             const std::optional<Tensor>& parent_in, const std::vector<Product>& recurrent,
                             const std::vector<Product>& upper_input, bool residuals,
                             const std::vector<Tensor>& keys, const std::vector<Tensor>& values,
                             const std::vector<Tensor>& masks, const std::vector<Tensor>& row_sentences,
                             const std::optional<Product>& out_hidden, const std::optional<Product>& additional_fc,
                             const Product& output);

// The step's exp, sigmoid and tanh approximations elementwise over a float32 tensor (for tests).
Tensor exp_approx_of(const Tensor& x);
Tensor sigmoid_approx_of(const Tensor& x);
Tensor tanh_approx_of(const Tensor& x);
