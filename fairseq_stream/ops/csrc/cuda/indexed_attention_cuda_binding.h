// The indexed attention's ATen entry (indexed_attention_cuda_binding.cpp); output_layer_cuda_binding.cpp binds it.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

// One query a row over the keys and values of slot index[r]: q (rows, heads * hd), keys and values (slots, heads,
// T, hd), mask (slots, T) additive or none, lengths (rows,) or none (positions 0..lengths[r] only). Returns (rows,
// heads * hd) in q's dtype; fairseq_stream/ops/attention.py documents it.
at::Tensor indexed_attention_cuda(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                  const at::Tensor& index, const std::optional<at::Tensor>& mask,
                                  const std::optional<at::Tensor>& lengths, double scale);
