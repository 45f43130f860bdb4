// The results of fairseq_select and stay_select, allocated for the CPU op (cpu/beam_step_cpu.cpp) and the CUDA one
// (cuda/beam_step_cuda_binding.cpp) alike; fairseq_stream/ops/beam_step.py names them.
#pragma once

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <vector>

#include "beam_select_row.h"

// On cand's device, scores of cand's dtype: [parent, token, score, live, eos_mask, top_slot, top_score, done_len
// (all (S, k)), best_finished (S,), finished_now (S,), summary (3S + 1,), flat_parent (S*k,), no_live (S,), zeros
// (S, k) bool]. The summary starts at zeros: its last entry is a sum the CUDA kernel adds to.
inline std::vector<at::Tensor> fairseq_select_outputs(const at::Tensor& cand, int64_t S, int64_t k) {
  const auto lng = cand.options().dtype(at::kLong);
  const auto bol = cand.options().dtype(at::kBool);
  const auto val = cand.options();
  return {at::empty({S, k}, lng), at::empty({S, k}, lng), at::empty({S, k}, val), at::empty({S, k}, bol),
          at::empty({S, k}, bol), at::empty({S, k}, lng), at::empty({S, k}, val), at::empty({S, k}, lng),
          at::empty({S}, val),    at::empty({S}, bol),    at::zeros({3 * S + 1}, lng), at::empty({S * k}, lng),
          at::empty({S}, bol),    at::zeros({S, k}, bol)};
}

// stay_select's: [parent, token, score, live, done, fresh (all (S, k)), no_live (S,), done_len (S, k),
// finished_now (S,), summary (2S + 1,), flat_parent (S*k,), extended (S*k,)]; the summary starts at zeros.
inline std::vector<at::Tensor> stay_select_outputs(const at::Tensor& cand, int64_t S, int64_t k) {
  const auto lng = cand.options().dtype(at::kLong);
  const auto bol = cand.options().dtype(at::kBool);
  return {at::empty({S, k}, lng), at::empty({S, k}, lng),     at::empty({S, k}, cand.options()),
          at::empty({S, k}, bol), at::empty({S, k}, bol),     at::empty({S, k}, bol),
          at::empty({S}, bol),    at::empty({S, k}, lng),     at::empty({S}, bol),
          at::zeros({2 * S + 1}, lng), at::empty({S * k}, lng), at::empty({S * k}, bol)};
}

namespace fairseq_stream {

// The kernels' view of fairseq_select_outputs' tensors (contiguous, as allocated there).
template <typename scalar_t>
SelectOut<scalar_t> select_out_of(std::vector<at::Tensor>& out) {
  return {out[0].data_ptr<int64_t>(),  out[1].data_ptr<int64_t>(),  out[2].data_ptr<scalar_t>(),
          out[3].data_ptr<bool>(),     out[4].data_ptr<bool>(),     out[5].data_ptr<int64_t>(),
          out[6].data_ptr<scalar_t>(), out[7].data_ptr<int64_t>(),  out[8].data_ptr<scalar_t>(),
          out[9].data_ptr<bool>(),     out[10].data_ptr<int64_t>(), out[11].data_ptr<int64_t>(),
          out[12].data_ptr<bool>()};
}

// The kernels' view of stay_select_outputs' tensors.
template <typename scalar_t>
StayOut<scalar_t> stay_out_of(std::vector<at::Tensor>& out) {
  return {out[0].data_ptr<int64_t>(), out[1].data_ptr<int64_t>(),  out[2].data_ptr<scalar_t>(),
          out[3].data_ptr<bool>(),    out[4].data_ptr<bool>(),     out[5].data_ptr<bool>(),
          out[6].data_ptr<bool>(),    out[7].data_ptr<int64_t>(),  out[8].data_ptr<bool>(),
          out[9].data_ptr<int64_t>(), out[10].data_ptr<int64_t>(), out[11].data_ptr<bool>()};
}

}  // namespace fairseq_stream
