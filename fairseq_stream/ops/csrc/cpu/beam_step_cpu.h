// The compiled search step of fixed-width beam search with fairseq's finalization
// (beam_step_cpu.cpp); bindings_cpu.cpp binds it.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

// One search step of fixed-width beam search with fairseq's finalization, with the pruning heuristics rp, ap,
// rpl, mc (negative: off); ops/beam_step.py documents the results.
std::vector<at::Tensor> fairseq_select(const at::Tensor& cand, const std::optional<at::Tensor>& local,
                                          const std::optional<at::Tensor>& word_of, int64_t per_slot, int64_t k,
                                          int64_t eos, int64_t step, const at::Tensor& done_len,
                                          const at::Tensor& best_finished, const at::Tensor& max_lens,
                                          const at::Tensor& empty, const at::Tensor& ids, double rp, double ap,
                                          double rpl, int64_t mc);

// The same step with the streaming paper's "stay" finalization; ops/beam_step.py documents the results.
std::vector<at::Tensor> stay_select(const at::Tensor& cand, const std::optional<at::Tensor>& local,
                                       const std::optional<at::Tensor>& word_of, int64_t per_slot, int64_t k,
                                       int64_t eos, int64_t pad, int64_t step, const at::Tensor& done_len,
                                       const at::Tensor& scores, const at::Tensor& empty,
                                       const at::Tensor& ids, double rp, double ap, double rpl, int64_t mc);

// In place: rows take their parent's token and score histories and, where extended, the new ones.
void reorder_beam(at::Tensor tokens, at::Tensor scores, const at::Tensor& flat_parent,
                  const at::Tensor& extended, const at::Tensor& new_token, const at::Tensor& new_score,
                  int64_t step);

// fairseq_select without pruning (the beam loop of search_loop_cpu.cpp): see fairseq_stream/ops/beam_step.py.
std::vector<at::Tensor> fairseq_select_step(const at::Tensor& cand, const std::optional<at::Tensor>& local,
                                               const std::optional<at::Tensor>& word_of, int64_t per_slot,
                                               int64_t k, int64_t eos, int64_t step, const at::Tensor& done_len,
                                               const at::Tensor& best_finished, const at::Tensor& max_lens,
                                               const at::Tensor& empty, const at::Tensor& ids);

// reorder_beam_: rows take their parent's token and score histories (and, where extended, the new ones).
void reorder_beam_histories(at::Tensor tokens, at::Tensor scores, const at::Tensor& flat_parent,
                            const at::Tensor& extended, const at::Tensor& new_token,
                            const at::Tensor& new_score, int64_t step);

