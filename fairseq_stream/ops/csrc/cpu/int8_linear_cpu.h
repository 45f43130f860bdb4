// The 8-bit linear layer's entry points (int8_linear_cpu.cpp: the checks and oneDNN's path; the tiles and
// their driver are quantized_product_cpu.cpp's, shared with int16).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

// x (rows, in) float32 times the packed int8 weight, plus bias: (rows, out) float32. packed: in the order
// `kernel` reads (quantized_linear.packed_for: pair order for "avx2", as packed for the others). excess: 128
// times each output row's sum of quantized weights (what the unsigned operand of the VNNI and avx2w7 kernels
// adds). weight_max: 127 for 8-bit weights, 63 for 7-bit ones (int8w7), which the "avx2w7" kernel needs.
at::Tensor int8_linear(at::Tensor x, at::Tensor packed, at::Tensor weight_inv, at::Tensor excess,
                          std::optional<at::Tensor> bias, const std::string& kernel, int64_t weight_max = 127);

// The int8 kernels this CPU runs on weights of magnitude up to weight_max, the best (the "auto" one) last.
std::vector<std::string> int8_kernels(int64_t weight_max = 127);

// Whether oneDNN's int8 GEMM (at::_int_mm) is exact on this CPU (AMX or VNNI, checked once on the input
// that would saturate a vpmaddubsw path): the "onednn" product then takes calls of many rows.
bool int8_onednn_exact();

// The same product with the integer sums by oneDNN: weight_kn the quantized weight transposed (in, out).
at::Tensor int8_linear_onednn(at::Tensor x, const at::Tensor& weight_kn, const at::Tensor& weight_inv,
                                 const std::optional<at::Tensor>& bias);
