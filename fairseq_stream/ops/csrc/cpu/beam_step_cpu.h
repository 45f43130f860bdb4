// The compiled search step of fixed-width beam search with fairseq's finalization
// (beam_step_cpu.cpp), bound into the same extension module as the fused output layer.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

// fairseq_select without pruning (the beam loop of search_loop_cpu.cpp): see fairseq_stream/ops/beam_step.py.
std::vector<torch::Tensor> fairseq_select_step(const torch::Tensor& cand, const std::optional<torch::Tensor>& local,
                                               const std::optional<torch::Tensor>& word_of, int64_t per_slot,
                                               int64_t k, int64_t eos, int64_t step, const torch::Tensor& done_len,
                                               const torch::Tensor& best_finished, const torch::Tensor& max_lens,
                                               const torch::Tensor& empty, const torch::Tensor& ids);

// reorder_beam_: rows take their parent's token and score histories (and, where extended, the new ones).
void reorder_beam_histories(torch::Tensor tokens, torch::Tensor scores, const torch::Tensor& flat_parent,
                            const torch::Tensor& extended, const torch::Tensor& new_token,
                            const torch::Tensor& new_score, int64_t step);

void register_beam_step(pybind11::module& m);
