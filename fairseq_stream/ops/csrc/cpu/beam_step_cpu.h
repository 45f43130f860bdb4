// The compiled search step of fixed-width beam search with fairseq's finalization
// (beam_step_cpu.cpp); bindings_cpu.cpp binds it.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

// One search step of fixed-width beam search with fairseq's finalization, with the pruning heuristics rp, ap,
// rpl, mc (negative: off); ops/beam_step.py documents the results.
std::vector<torch::Tensor> fairseq_select(const torch::Tensor& cand, const std::optional<torch::Tensor>& local,
                                          const std::optional<torch::Tensor>& word_of, int64_t per_slot, int64_t k,
                                          int64_t eos, int64_t step, const torch::Tensor& done_len,
                                          const torch::Tensor& best_finished, const torch::Tensor& max_lens,
                                          const torch::Tensor& empty, const torch::Tensor& ids, double rp, double ap,
                                          double rpl, int64_t mc);

// The same step with the streaming paper's "stay" finalization; ops/beam_step.py documents the results.
std::vector<torch::Tensor> stay_select(const torch::Tensor& cand, const std::optional<torch::Tensor>& local,
                                       const std::optional<torch::Tensor>& word_of, int64_t per_slot, int64_t k,
                                       int64_t eos, int64_t pad, int64_t step, const torch::Tensor& done_len,
                                       const torch::Tensor& scores, const torch::Tensor& empty,
                                       const torch::Tensor& ids, double rp, double ap, double rpl, int64_t mc);

// In place: rows take their parent's token and score histories and, where extended, the new ones.
void reorder_beam(torch::Tensor tokens, torch::Tensor scores, const torch::Tensor& flat_parent,
                  const torch::Tensor& extended, const torch::Tensor& new_token, const torch::Tensor& new_score,
                  int64_t step);

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

