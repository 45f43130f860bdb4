// The 16-bit fixed-point linear layer's entry points (int16_linear_cpu.cpp: the checks; the
// tiles and their driver are quantized_product_cpu.cpp's, shared with int8).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

at::Tensor int16_linear(at::Tensor x, at::Tensor packed, at::Tensor weight_inv, int64_t a_max,
                           std::optional<at::Tensor> bias, const std::string& kernel);

std::vector<std::string> int16_kernels();

