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
  const SelectOut<scalar_t> o{out[0].data_ptr<int64_t>(),  out[1].data_ptr<int64_t>(), out[2].data_ptr<scalar_t>(),
                              out[3].data_ptr<bool>(),     out[4].data_ptr<bool>(),    out[5].data_ptr<int64_t>(),
                              out[6].data_ptr<scalar_t>(), out[7].data_ptr<int64_t>(), out[8].data_ptr<scalar_t>(),
                              out[9].data_ptr<bool>(),     out[10].data_ptr<int64_t>(), out[11].data_ptr<int64_t>(),
                              out[12].data_ptr<bool>()};
  std::vector<int64_t> words(n), beams(n);
  std::vector<char> is_eos(n), keep(n), carried(n, 0);
  std::vector<scalar_t> row_score(n), row_local(n, 0);
  const SelectScratch<scalar_t> w{words.data(), beams.data(), is_eos.data(), keep.data(), carried.data(),
                                  row_score.data(), row_local.data()};
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

// Returns [parent, token, score, live, eos_mask, top_slot, top_score (all (S, k)), done_len (S, k),
// best_finished (S,), finished_now (S,), summary (3S + 1,), flat_parent (S*k,), no_live (S,), and an (S, k)
// bool of zeros (the Step's done and fresh, which fairseq's rule leaves empty)].

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

template <typename scalar_t>
void stay_loop(const Tensor& top_scores, const Tensor& top_idx, const std::optional<Tensor>& local,
               const std::optional<Tensor>& word_of, int64_t W, int64_t per_slot, int64_t k, int64_t eos, int64_t pad,
               int64_t step, const Tensor& done_len, const Tensor& empty, const Tensor& ids, const PruneOptions& prune,
               std::vector<Tensor>& out) {
  const int64_t S = top_scores.size(0);
  auto ts = top_scores.accessor<scalar_t, 2>();
  auto ti = top_idx.accessor<int64_t, 2>();
  auto dl = done_len.accessor<int64_t, 2>();
  auto em = empty.accessor<bool, 1>();
  auto id = ids.accessor<int64_t, 1>();
  std::optional<at::TensorAccessor<int64_t, 2>> wo;
  if (word_of) wo.emplace(word_of->accessor<int64_t, 2>());
  std::optional<at::TensorAccessor<scalar_t, 2>> lo;
  if (local) lo.emplace(local->accessor<scalar_t, 2>());

  auto parent = out[0].accessor<int64_t, 2>();
  auto token = out[1].accessor<int64_t, 2>();
  auto score = out[2].accessor<scalar_t, 2>();
  auto live = out[3].accessor<bool, 2>();
  auto done = out[4].accessor<bool, 2>();
  auto fresh = out[5].accessor<bool, 2>();
  auto no_live = out[6].accessor<bool, 1>();
  auto new_done_len = out[7].accessor<int64_t, 2>();
  auto finished_now = out[8].accessor<bool, 1>();
  auto summary = out[9].accessor<int64_t, 1>();
  auto flat_parent = out[10].accessor<int64_t, 1>();
  auto extended = out[11].accessor<bool, 1>();

  std::vector<int64_t> beams(k), words(k);
  std::vector<char> carried(k), keep(k);
  std::vector<scalar_t> row_score(k), row_local(k);
  int64_t live_left = 0;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t c = 0; c < k; ++c) {
      const int64_t idx = ti[s][c];
      carried[c] = idx >= W;  // a finished entry of the beam, carried over unchanged
      beams[c] = carried[c] ? idx - W : idx / per_slot;
      const int64_t expansion = std::min(idx, W - 1);
      words[c] = carried[c] ? pad : (wo ? (*wo)[s][expansion] : expansion % per_slot);
      row_score[c] = ts[s][c];
      row_local[c] = carried[c] || !lo ? scalar_t(0) : (*lo)[s][idx];
    }
    keep_row<scalar_t>(row_score.data(), row_local.data(), beams.data(), carried.data(), k,
                       -std::numeric_limits<scalar_t>::infinity(), prune, keep.data());
    bool any_live = false;
    for (int64_t c = 0; c < k; ++c) {
      const bool f = keep[c] && !carried[c] && words[c] == eos;
      const bool d = (keep[c] && carried[c]) || f;
      const bool l = keep[c] && !carried[c] && !f;
      parent[s][c] = beams[c];
      token[s][c] = words[c];
      score[s][c] = ts[s][c];
      live[s][c] = l;
      done[s][c] = d;
      fresh[s][c] = f;
      any_live = any_live || l;
      // A finished entry keeps its length; a fresh one has this step's.
      new_done_len[s][c] = !d ? 0 : (f ? step + 1 : dl[s][beams[c]]);
      flat_parent[s * k + c] = s * k + beams[c];
      extended[s * k + c] = l || f;
    }
    no_live[s] = !any_live;
    finished_now[s] = !any_live || em[s];
    summary[s] = static_cast<int64_t>(finished_now[s]) + 2 * static_cast<int64_t>(em[s]);
    summary[S + s] = id[s];
    if (!finished_now[s]) {
      for (int64_t c = 0; c < k; ++c) live_left += live[s][c];
    }
  }
  summary[2 * S] = live_left;
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
  AT_DISPATCH_FLOATING_TYPES(cand.scalar_type(), "stay_select_done", [&] {
    auto dl = done_len.accessor<int64_t, 2>();
    auto sc = scores.accessor<scalar_t, 2>();
    auto ds = done_scores.accessor<scalar_t, 2>();
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t j = 0; j < k; ++j) {
        const int64_t len = dl[s][j];
        TORCH_CHECK(len <= scores.size(1), "stay_select: done_len beyond the scores");
        ds[s][j] = len > 0 ? sc[s * k + j][len - 1] : -std::numeric_limits<scalar_t>::infinity();
      }
    }
  });
  auto top = at::topk(at::cat({cand, done_scores}, 1), k, 1, /*largest=*/true, /*sorted=*/true);
  auto lng = cand.options().dtype(at::kLong);
  auto bol = cand.options().dtype(at::kBool);
  std::vector<Tensor> out = {
      at::empty({S, k}, lng), at::empty({S, k}, lng), at::empty({S, k}, cand.options()), at::empty({S, k}, bol),
      at::empty({S, k}, bol), at::empty({S, k}, bol), at::empty({S}, bol), at::empty({S, k}, lng),
      at::empty({S}, bol), at::empty({2 * S + 1}, lng), at::empty({S * k}, lng), at::empty({S * k}, bol)};
  AT_DISPATCH_FLOATING_TYPES(cand.scalar_type(), "stay_select", [&] {
    stay_loop<scalar_t>(std::get<0>(top), std::get<1>(top), local, word_of, W, per_slot, k, eos, pad, step, done_len,
                        empty, ids, prune, out);
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
