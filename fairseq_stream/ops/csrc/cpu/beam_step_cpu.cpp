// One search step in one call: the selection of fairseq_stream/search/selection.py
// (select_fairseq or select_stay, with the pruning of search/pruning.py) and the bookkeeping
// cohort_steps.py:BeamBookkeeping.update does after it (finalized counts and lengths, which sentences end, the best
// finished score, the step's summary for the host). The Python functions (fairseq_step,
// stay_step) are the reference; fairseq_stream/ops/beam_step.py documents the ops and
// tests/test_beam_step.py compares the two on every step of real decoding.
//
// Why: one sentence at a time, the step above is about 40 small torch ops, and on one CPU thread
// their dispatch costs more than their arithmetic (docs/BENCHMARKS.md, issue 14). Here the (S, 2k)
// candidates are a few hundred numbers walked in plain loops.
//
// The one ranking with possible ties, each sentence's best candidates, is at::topk itself, so that
// equal scores come out in torch.topk's order, as in the reference. The rest is exact: comparisons,
// copies and integer counts; the pruning thresholds are one float32 addition each, as torch
// computes them (a Python float added to a float32 tensor is rounded to float32 first).
//
// reorder_beam_ is the in-place move of the token and score histories to the next beam (the
// update's step when no sentence ends), for any search.

#include "beam_step_cpu.h"

#include "../beam_select_row.h"
#include "../beam_step_outputs.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace {

using at::Tensor;

using fairseq_stream::keep_row;
using fairseq_stream::prune_options;
using fairseq_stream::PruneOptions;

// Each sentence in turn through fairseq_select_row (../beam_select_row.h), which the CUDA kernel runs a
// thread per sentence. The inputs are contiguous (fairseq_select makes them so).
template <typename scalar_t>
void select_loop(const Tensor& top_scores, const Tensor& top_idx, const std::optional<Tensor>& word_of,
                 int64_t per_slot, int64_t k, int64_t eos, int64_t step, const Tensor& done_len,
                 const Tensor& best_finished, const Tensor& max_lens, const Tensor& empty, const Tensor& ids,
                 const std::optional<Tensor>& local, const PruneOptions& prune, std::vector<Tensor>& out) {
  using namespace fairseq_stream;
  const int64_t S = top_scores.size(0), n = top_scores.size(1), W = word_of ? word_of->size(1) : 0;
  const int64_t L = local ? local->size(1) : 0;
  const SelectShape sh{S, n, k, per_slot, eos, step, prune};
  const SelectOut<scalar_t> o = select_out_of<scalar_t>(out);
  std::vector<int64_t> longs(2 * n);
  std::vector<char> flags(3 * n);
  std::vector<scalar_t> values(2 * n);
  const auto w = carve_scratch<scalar_t>(longs.data(), flags.data(), values.data(), n);
  const scalar_t* ts = top_scores.data_ptr<scalar_t>();
  const int64_t* ti = top_idx.data_ptr<int64_t>();
  const int64_t* dl = done_len.data_ptr<int64_t>();
  const scalar_t* bf = best_finished.data_ptr<scalar_t>();
  const int64_t* ml = max_lens.data_ptr<int64_t>();
  const bool* em = empty.data_ptr<bool>();
  const int64_t* id = ids.data_ptr<int64_t>();
  int64_t live_left = 0;
  for (int64_t s = 0; s < S; ++s) {
    const SelectRowIn<scalar_t> in{ts + s * n, ti + s * n, word_of ? word_of->data_ptr<int64_t>() + s * W : nullptr,
                                   local ? local->data_ptr<scalar_t>() + s * L : nullptr, dl + s * k, bf[s], ml[s],
                                   id[s], em[s]};
    live_left += fairseq_select_row<scalar_t>(s, sh, in, w, o);
  }
  o.summary[3 * S] = live_left;
}

void check_common(const Tensor& cand, const std::optional<Tensor>& local, const std::optional<Tensor>& word_of,
                  const char* op) {
  TORCH_CHECK(cand.dim() == 2 && cand.device().is_cpu(), op, ": cand must be a 2-d CPU tensor");
  TORCH_CHECK(cand.scalar_type() == at::kFloat || cand.scalar_type() == at::kDouble, op,
              ": cand must be float32 or float64");
  if (local) {
    TORCH_CHECK(local->device().is_cpu() && local->sizes() == cand.sizes() && local->scalar_type() == cand.scalar_type(),
                op, ": local must be a CPU tensor shaped and typed as cand");
  }
  if (word_of) {
    TORCH_CHECK(word_of->device().is_cpu() && word_of->sizes() == cand.sizes() && word_of->scalar_type() == at::kLong,
                op, ": word_of must be an int64 CPU tensor shaped as cand");
  }
}

// One entry per sentence (best_finished, max_lens, empty, ids): the loops read S of each, so a shorter
// tensor would be read past its end.
void check_per_sentence(const Tensor& t, const char* name, int64_t S, at::ScalarType type, const char* op) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 1 && t.size(0) == S && t.scalar_type() == type, op, ": ", name,
              " must be a (", S, ",) ", type, " CPU tensor, one entry per sentence; got ", t.sizes(), " ",
              t.scalar_type(), " on ", t.device());
}

// done_len: (S, k) int64, each sentence's finalized lengths.
void check_done_len(const Tensor& done_len, int64_t S, int64_t k, const char* op) {
  TORCH_CHECK(done_len.device().is_cpu() && done_len.scalar_type() == at::kLong && done_len.dim() == 2 &&
                  done_len.size(0) == S && done_len.size(1) == k,
              op, ": done_len must be an (S, k) = (", S, ", ", k, ") int64 CPU tensor; got ", done_len.sizes());
}

}  // namespace

// Returns [parent, token, score, live, eos_mask, top_slot, top_score (all (S, k)), done_len (S, k),
// best_finished (S,), finished_now (S,), summary (3S + 1,), flat_parent (S*k,), no_live (S,), and an (S, k)
// bool of zeros (the Step's done and fresh, which fairseq's rule leaves empty)].
std::vector<Tensor> fairseq_select(const Tensor& cand, const std::optional<Tensor>& local,
                                   const std::optional<Tensor>& word_of, int64_t per_slot, int64_t k, int64_t eos,
                                   int64_t step, const Tensor& done_len, const Tensor& best_finished,
                                   const Tensor& max_lens, const Tensor& empty, const Tensor& ids, double rp,
                                   double ap, double rpl, int64_t mc) {
  check_common(cand, local, word_of, "fairseq_select");
  const PruneOptions prune = prune_options(rp, ap, rpl, mc);
  TORCH_CHECK(!(prune.rpl >= 0) || local.has_value(), "fairseq_select: --prune-rpl needs local");
  const int64_t S = cand.size(0), W = cand.size(1);
  check_done_len(done_len, S, k, "fairseq_select");
  check_per_sentence(best_finished, "best_finished", S, cand.scalar_type(), "fairseq_select");
  check_per_sentence(max_lens, "max_lens", S, at::kLong, "fairseq_select");
  check_per_sentence(empty, "empty", S, at::kBool, "fairseq_select");
  check_per_sentence(ids, "ids", S, at::kLong, "fairseq_select");
  // fairseq's bound (size - 1) on whole-vocabulary candidates; pre-selected ones are all usable.
  const int64_t n = std::min(2 * k, W - (word_of ? 0 : 1));
  TORCH_CHECK(n >= k && per_slot > 0, "fairseq_select: fewer candidates than the beam");

  auto top = at::topk(cand, n, 1, /*largest=*/true, /*sorted=*/true);
  const Tensor top_scores = std::get<0>(top), top_idx = std::get<1>(top);
  std::vector<Tensor> out = fairseq_select_outputs(cand, S, k);
  // The loop reads raw rows: contiguous inputs (copies only where a caller passed a strided view).
  std::optional<Tensor> word_rows, local_rows;
  if (word_of) word_rows = word_of->contiguous();
  if (local) local_rows = local->contiguous();
  AT_DISPATCH_FLOATING_TYPES(cand.scalar_type(), "fairseq_select", [&] {
    select_loop<scalar_t>(top_scores.contiguous(), top_idx.contiguous(), word_rows, per_slot, k, eos, step,
                          done_len.contiguous(), best_finished.contiguous(), max_lens.contiguous(),
                          empty.contiguous(), ids.contiguous(), local_rows, prune, out);
  });
  return out;
}

namespace {

// Each sentence in turn through stay_select_row (../beam_select_row.h), which the CUDA kernel runs a thread
// per sentence. The inputs are contiguous (stay_select makes them so).
template <typename scalar_t>
void stay_loop(const Tensor& top_scores, const Tensor& top_idx, const std::optional<Tensor>& local,
               const std::optional<Tensor>& word_of, int64_t W, int64_t per_slot, int64_t k, int64_t eos, int64_t pad,
               int64_t step, const Tensor& done_len, const Tensor& empty, const Tensor& ids, const PruneOptions& prune,
               std::vector<Tensor>& out) {
  using namespace fairseq_stream;
  const int64_t S = top_scores.size(0);
  const StayShape sh{S, k, W, per_slot, eos, pad, step, prune};
  const StayOut<scalar_t> o = stay_out_of<scalar_t>(out);
  std::vector<int64_t> longs(2 * k);
  std::vector<char> flags(3 * k);
  std::vector<scalar_t> values(2 * k);
  const auto w = carve_scratch<scalar_t>(longs.data(), flags.data(), values.data(), k);
  const scalar_t* ts = top_scores.data_ptr<scalar_t>();
  const int64_t* ti = top_idx.data_ptr<int64_t>();
  const int64_t* dl = done_len.data_ptr<int64_t>();
  const bool* em = empty.data_ptr<bool>();
  const int64_t* id = ids.data_ptr<int64_t>();
  int64_t live_left = 0;
  for (int64_t s = 0; s < S; ++s) {
    const StayRowIn<scalar_t> in{ts + s * k, ti + s * k, word_of ? word_of->data_ptr<int64_t>() + s * W : nullptr,
                                 local ? local->data_ptr<scalar_t>() + s * W : nullptr, dl + s * k, id[s], em[s]};
    live_left += stay_select_row<scalar_t>(s, sh, in, w, o);
  }
  o.summary[2 * S] = live_left;
}

}  // namespace

// Returns [parent, token, score, live, done, fresh (all (S, k)), no_live (S,), done_len (S, k),
// finished_now (S,), summary (2S + 1,): finished_now + 2 * empty, ids, live rows left,
// flat_parent (S*k,), extended (S*k,)].
std::vector<Tensor> stay_select(const Tensor& cand, const std::optional<Tensor>& local,
                                const std::optional<Tensor>& word_of, int64_t per_slot, int64_t k, int64_t eos,
                                int64_t pad, int64_t step, const Tensor& done_len, const Tensor& scores,
                                const Tensor& empty, const Tensor& ids, double rp, double ap, double rpl,
                                int64_t mc) {
  check_common(cand, local, word_of, "stay_select");
  const PruneOptions prune = prune_options(rp, ap, rpl, mc);
  TORCH_CHECK(!(prune.rpl >= 0) || local.has_value(), "stay_select: --prune-rpl needs local");
  const int64_t S = cand.size(0), W = cand.size(1);
  check_done_len(done_len, S, k, "stay_select");
  TORCH_CHECK(scores.device().is_cpu() && scores.dim() == 2 && scores.size(0) == S * k &&
                  scores.scalar_type() == cand.scalar_type(),
              "stay_select: scores must be an (S * k, width) CPU tensor of cand's dtype");
  check_per_sentence(empty, "empty", S, at::kBool, "stay_select");
  check_per_sentence(ids, "ids", S, at::kLong, "stay_select");
  TORCH_CHECK(W >= 1 && per_slot > 0, "stay_select: no candidates");
  // The finished entries compete with the expansions: their cumulative scores, -inf for other slots.
  Tensor done_scores = at::empty({S, k}, cand.options());
  const Tensor lengths = done_len.contiguous(), history = scores.contiguous();
  const int64_t* dl = lengths.data_ptr<int64_t>();
  for (int64_t i = 0; i < S * k; ++i) {
    TORCH_CHECK(dl[i] <= scores.size(1), "stay_select: done_len beyond the scores");
  }
  AT_DISPATCH_FLOATING_TYPES(cand.scalar_type(), "stay_select_done", [&] {
    for (int64_t s = 0; s < S; ++s) {
      fairseq_stream::stay_done_scores_row<scalar_t>(s, k, dl, history.data_ptr<scalar_t>(), history.size(1),
                                                     done_scores.data_ptr<scalar_t>());
    }
  });
  auto top = at::topk(at::cat({cand, done_scores}, 1), k, 1, /*largest=*/true, /*sorted=*/true);
  std::vector<Tensor> out = stay_select_outputs(cand, S, k);
  // The loop reads raw rows: contiguous inputs (copies only where a caller passed a strided view).
  std::optional<Tensor> word_rows, local_rows;
  if (word_of) word_rows = word_of->contiguous();
  if (local) local_rows = local->contiguous();
  AT_DISPATCH_FLOATING_TYPES(cand.scalar_type(), "stay_select", [&] {
    stay_loop<scalar_t>(std::get<0>(top).contiguous(), std::get<1>(top).contiguous(), local_rows, word_rows, W,
                        per_slot, k, eos, pad, step, lengths, empty.contiguous(), ids.contiguous(), prune, out);
  });
  return out;
}

namespace {

template <typename scalar_t>
void reorder_loop(Tensor& tokens, Tensor& scores, const Tensor& flat_parent, const Tensor& extended,
                  const Tensor& new_token, const Tensor& new_score, int64_t step) {
  const int64_t R = tokens.size(0);
  auto tk = tokens.accessor<int64_t, 2>();
  auto sc = scores.accessor<scalar_t, 2>();
  auto fp = flat_parent.accessor<int64_t, 1>();
  auto ex = extended.accessor<bool, 1>();
  auto nt = new_token.accessor<int64_t, 1>();
  auto ns = new_score.accessor<scalar_t, 1>();
  // Rows move among themselves: read every source row before any is overwritten.
  const int64_t tw = step + 1, sw = step;
  std::vector<int64_t> tbuf(R * tw);
  std::vector<scalar_t> sbuf(R * sw);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t p = fp[r];
    TORCH_CHECK(p >= 0 && p < R, "reorder_beam_: parent row out of range");
    for (int64_t c = 0; c < tw; ++c) tbuf[r * tw + c] = tk[p][c];
    for (int64_t c = 0; c < sw; ++c) sbuf[r * sw + c] = sc[p][c];
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < tw; ++c) tk[r][c] = tbuf[r * tw + c];
    for (int64_t c = 0; c < sw; ++c) sc[r][c] = sbuf[r * sw + c];
    if (ex[r]) {
      tk[r][step + 1] = nt[r];
      sc[r][step] = ns[r];
    }
  }
}

}  // namespace

void reorder_beam(Tensor tokens, Tensor scores, const Tensor& flat_parent, const Tensor& extended,
                  const Tensor& new_token, const Tensor& new_score, int64_t step) {
  TORCH_CHECK(tokens.device().is_cpu() && tokens.scalar_type() == at::kLong && tokens.dim() == 2,
              "reorder_beam_: tokens must be a 2-d int64 CPU tensor");
  TORCH_CHECK(scores.device().is_cpu() && scores.dim() == 2 && scores.size(0) == tokens.size(0) &&
                  new_score.scalar_type() == scores.scalar_type(),
              "reorder_beam_: scores must be a (rows, width) CPU tensor of new_score's dtype");
  TORCH_CHECK(step >= 0 && tokens.size(1) > step + 1 && scores.size(1) > step, "reorder_beam_: step ", step,
              " outside the histories (tokens ", tokens.sizes(), ", scores ", scores.sizes(), ")");
  const int64_t R = tokens.size(0);
  TORCH_CHECK(flat_parent.numel() == R && extended.numel() == R && new_token.numel() == R && new_score.numel() == R,
              "reorder_beam_: one parent, flag, token and score per row");
  for (const Tensor* t : {&flat_parent, &extended, &new_token, &new_score})
    TORCH_CHECK(t->device().is_cpu(), "reorder_beam_: CPU tensors only");
  TORCH_CHECK(extended.scalar_type() == at::kBool && flat_parent.scalar_type() == at::kLong &&
                  new_token.scalar_type() == at::kLong,
              "reorder_beam_: flat_parent and new_token int64, extended bool");
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "reorder_beam_", [&] {
    reorder_loop<scalar_t>(tokens, scores, flat_parent.reshape(-1), extended.reshape(-1), new_token.reshape(-1),
                           new_score.reshape(-1), step);
  });
}

std::vector<Tensor> fairseq_select_step(const Tensor& cand, const std::optional<Tensor>& local,
                                        const std::optional<Tensor>& word_of, int64_t per_slot, int64_t k,
                                        int64_t eos, int64_t step, const Tensor& done_len,
                                        const Tensor& best_finished, const Tensor& max_lens, const Tensor& empty,
                                        const Tensor& ids) {
  return fairseq_select(cand, local, word_of, per_slot, k, eos, step, done_len, best_finished, max_lens, empty, ids,
                        -1.0, -1.0, -1.0, -1);
}

void reorder_beam_histories(Tensor tokens, Tensor scores, const Tensor& flat_parent, const Tensor& extended,
                            const Tensor& new_token, const Tensor& new_score, int64_t step) {
  reorder_beam(tokens, scores, flat_parent, extended, new_token, new_score, step);
}
