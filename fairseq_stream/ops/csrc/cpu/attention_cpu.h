// One query per row attending over the lean runner's caches and encoder keys (attention_cpu.cpp),
// bound into the same extension module as the fused output layer.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

// Writes each row's k, v (rows, heads * head_dim) at position `length` of its slot of keys/values
// (slots, heads, capacity, head_dim), then attends over positions 0..length: (rows, heads * head_dim).
torch::Tensor cached_attention_(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                torch::Tensor keys, torch::Tensor values, std::optional<torch::Tensor> slot,
                                int64_t length, double scale);

// Each row over its sentence's encoder keys/values (sentences, heads, source, head_dim), padding masked.
torch::Tensor source_attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                               const torch::Tensor& row_sentence, std::optional<torch::Tensor> mask, double scale);

// Jacobi's window, flat: query n at position window_step[n] of cache row window_row[n], causal inside
// its row's window (rows' windows may differ in width); with `visible`, a tree-shaped window's mask.
torch::Tensor window_attention_(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                torch::Tensor keys, torch::Tensor values, const torch::Tensor& window_row,
                                const torch::Tensor& window_step, double scale,
                                const std::optional<torch::Tensor>& visible = std::nullopt);

// An encoder's self-attention over sources packed without padding: qkv (tokens, 3 * heads * head_dim),
// sentence s is tokens starts[s] .. starts[s + 1]; sentences of dense_from tokens or more use batched products.
torch::Tensor sentence_attention(const torch::Tensor& qkv, const std::vector<int64_t>& starts, int64_t heads,
                                 double scale, int64_t dense_from);

// Positions 0..length-1 of each source slot of `cache` (2 * layers, slots, heads, capacity, head_dim) copied
// to its target slot, in place: a beam's second child of a row takes its parent's keys and values.
void copy_cache_slots_(torch::Tensor cache, const torch::Tensor& source, const torch::Tensor& target, int64_t length);

void register_attention(pybind11::module& m);
