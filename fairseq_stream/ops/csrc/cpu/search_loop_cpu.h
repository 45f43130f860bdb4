// A batch's greedy or beam search on the lean runner in one call (search_loop_cpu.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "lean_step_cpu.h"

// One model's decoder as LeanModel arranges it (fairseq_stream/runners/lean_model.py): the embedding
// and its scale, positions, optional input projection and norm, the compiled layers, the optional
// final norm and output projection, and the output layer.
struct __attribute__((visibility("hidden"))) LeanDecoderModel {
  Tensor embed;
  double embed_scale;
  std::optional<Tensor> positions;
  std::optional<Product> project_in;
  std::optional<Norm> embed_norm;
  std::vector<LeanLayer> layers;
  std::optional<Norm> final_norm;
  std::optional<Product> project_out;
  Product output;
  int64_t padding_idx, heads, head_dim;

  // The decoder's input for `token` (1,) at position-table index `position`.
  Tensor embed_at(const Tensor& token, int64_t position) const;
  // The output layer's logits from the last layer's states.
  Tensor logits(Tensor x) const;
};

// Greedy search of a batch (one sentence per entry of max_lens): [words int64, cumulative scores float32,
// lengths]: each sentence's words chosen step by step (the last is EOS) and the running sums of their
// log-probabilities, as the Python loop keeps them, flat in sentence order. A sentence's row leaves the
// batch at the step after its EOS, as in the Python loop, so every step runs the rows the Python loop runs.
std::vector<Tensor> greedy_decode(const std::vector<LeanDecoderModel>& models,
                                  const std::vector<std::vector<Tensor>>& enc_keys,
                                  const std::vector<std::vector<Tensor>>& enc_values,
                                  const std::vector<std::optional<Tensor>>& masks, int64_t bos,
                                  const std::vector<int64_t>& max_lens, int64_t min_len, int64_t pad, int64_t eos,
                                  int64_t unk, double unk_penalty, double temperature);

// Beam search of a batch (one sentence per entry of max_lens) with fairseq's finalization (--search fixed,
// k >= 2, n candidates a row): [words, cumulative scores (float32), lengths] of each sentence's finalized
// hypotheses in finalization order, flat in sentence order; how many each sentence has; how many steps each
// ran. A sentence's rows leave the batch at the step after it ends, as in the Python loop.
std::vector<Tensor> beam_decode(const std::vector<LeanDecoderModel>& models,
                                const std::vector<std::vector<Tensor>>& enc_keys,
                                const std::vector<std::vector<Tensor>>& enc_values,
                                const std::vector<std::optional<Tensor>>& masks, int64_t k, int64_t n, int64_t bos,
                                const std::vector<int64_t>& max_lens, int64_t min_len, int64_t pad, int64_t eos,
                                int64_t unk, double unk_penalty, double temperature);

