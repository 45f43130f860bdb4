// The 8-bit linear layer's entry points (int8_linear_cpu.cpp).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

// x (rows, in) float32 times the packed int8 weight, plus bias: (rows, out) float32. excess: 128 times
// each output row's sum of quantized weights (what the VNNI kernel's unsigned operand adds).
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor weight_inv, torch::Tensor excess,
                          std::optional<torch::Tensor> bias, const std::string& kernel);

// The int8 kernels this CPU runs, the best (the "auto" one) last.
std::vector<std::string> int8_kernels();
