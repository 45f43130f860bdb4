// The CUDA search step's ATen entries (beam_step_cuda_binding.cpp); output_layer_cuda_binding.cpp binds it.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

// fairseq_select of the CPU op (../cpu/beam_step_cpu.h) on CUDA tensors: one search step with fairseq's
// finalization and the pruning heuristics rp, ap, rpl, mc (negative: off). Returns [parent, token, score, live,
// eos_mask, top_slot, top_score, done_len, best_finished, finished_now, summary, flat_parent, no_live, zeros];
// fairseq_stream/ops/beam_step.py documents them.
std::vector<at::Tensor> fairseq_select_cuda(const at::Tensor& cand, const std::optional<at::Tensor>& local,
                                            const std::optional<at::Tensor>& word_of, int64_t per_slot, int64_t k,
                                            int64_t eos, int64_t step, const at::Tensor& done_len,
                                            const at::Tensor& best_finished, const at::Tensor& max_lens,
                                            const at::Tensor& empty, const at::Tensor& ids, double rp, double ap,
                                            double rpl, int64_t mc);

// stay_select of the CPU op on CUDA tensors: the streaming paper's rule with the same heuristics. Returns [parent,
// token, score, live, done, fresh, no_live, done_len, finished_now, summary, flat_parent, extended].
std::vector<at::Tensor> stay_select_cuda(const at::Tensor& cand, const std::optional<at::Tensor>& local,
                                         const std::optional<at::Tensor>& word_of, int64_t per_slot, int64_t k,
                                         int64_t eos, int64_t pad, int64_t step, const at::Tensor& done_len,
                                         const at::Tensor& scores, const at::Tensor& empty, const at::Tensor& ids,
                                         double rp, double ap, double rpl, int64_t mc);

// reorder_beam of the CPU op on CUDA tensors, in place: rows take their parent's token and score histories and,
// where extended, the new ones.
void reorder_beam_cuda(at::Tensor tokens, at::Tensor scores, const at::Tensor& flat_parent,
                       const at::Tensor& extended, const at::Tensor& new_token, const at::Tensor& new_score,
                       int64_t step);
