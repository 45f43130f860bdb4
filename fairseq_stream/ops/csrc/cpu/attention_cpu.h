// One query per row attending over the lean runner's caches and encoder keys (attention_cpu.cpp);
// bindings_cpu.cpp binds them.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <utility>
#include <vector>

// cached_attention_'s work on raw rows (the decoder step on buffers, raw_step_cpu.cpp, and the tensor
// op alike): q, k, v rows at their strides, keys/values (slots, H, capacity, hd), each row's slot (or
// row r in slot r), out (rows, H * hd). run(0, rows * H) does every (row, head) pair on the calling thread.
template <typename T>
struct CachedRows {
  const T *q, *k, *v;
  int64_t q_stride, k_stride, v_stride;
  T *keys, *values;
  const int64_t* slot;
  int64_t H, capacity, hd, length;
  T scale;
  T* out;

  void run(int64_t begin, int64_t end) const;
};

// source_attention's work on raw rows: keys/values (S, H, T_len, hd), mask (S, T_len) additive or null,
// each sentence's unmasked span (source_spans), each row's sentence, out (rows, H * hd).
template <typename T>
struct SourceRows {
  const T* q;
  int64_t q_stride;
  const T *keys, *values, *mask;
  const int64_t *first, *span, *sentence;
  int64_t H, T_len, hd;
  T scale;
  T* out;

  void run(int64_t begin, int64_t end) const;
};

// Each sentence's unmasked span of a (S, T_len) additive mask (null: all of it): first positions, lengths
// (float and double).
template <typename T>
std::pair<std::vector<int64_t>, std::vector<int64_t>> source_spans(const T* mask, int64_t S, int64_t T_len);

// Writes each row's k, v (rows, heads * head_dim) at position `length` of its slot of keys/values
// (slots, heads, capacity, head_dim), then attends over positions 0..length: (rows, heads * head_dim).
at::Tensor cached_attention_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                at::Tensor keys, at::Tensor values, std::optional<at::Tensor> slot,
                                int64_t length, double scale);

// Each row over its sentence's encoder keys/values (sentences, heads, source, head_dim), padding masked.
at::Tensor source_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                               const at::Tensor& row_sentence, std::optional<at::Tensor> mask, double scale);

// Jacobi's window, flat: query n at position window_step[n] of cache row window_row[n], causal inside
// its row's window (rows' windows may differ in width); with `visible`, a tree-shaped window's mask.
at::Tensor window_attention_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                at::Tensor keys, at::Tensor values, const at::Tensor& window_row,
                                const at::Tensor& window_step, double scale,
                                const std::optional<at::Tensor>& visible = std::nullopt);

// An encoder's self-attention over sources packed without padding: qkv (tokens, 3 * heads * head_dim),
// sentence s is tokens starts[s] .. starts[s + 1]; sentences of dense_from tokens or more use batched products.
at::Tensor sentence_attention(const at::Tensor& qkv, const std::vector<int64_t>& starts, int64_t heads,
                                 double scale, int64_t dense_from);

// Positions 0..length-1 of each source slot of `cache` (2 * layers, slots, heads, capacity, head_dim) copied
// to its target slot, in place: a beam's second child of a row takes its parent's keys and values.
void copy_cache_slots_(at::Tensor cache, const at::Tensor& source, const at::Tensor& target, int64_t length);

