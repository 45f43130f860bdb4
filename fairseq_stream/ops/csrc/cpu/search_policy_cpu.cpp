// The compiled loop's two search policies (search_policy_cpu.h): greedy's argmax and fixed-width beam search
// with fairseq's finalization. Each compiles the Python loop's search step for its search, op for op on the
// same rows, so that the loop's words and scores are bitwise the Python loop's (tests/test_search_loop.py):
// the selection (search/selection.py:fairseq_step, whose CPU form is beam_step_cpu.cpp's fairseq_select,
// called here too), what the finalizer keeps (finalize.py:FairseqFinalizer) and the histories' move to
// the next beam (cohort_steps.py:next_beam). The rows' caches are the loop's (search_loop_cpu.cpp).

#include "search_policy_cpu.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/le.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/TensorOperators.h>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>

#include "beam_step_cpu.h"

using at::Tensor;

namespace {

// Greedy search: one row a sentence, its best word each step. Row r runs sentence live[r]; a sentence's row
// leaves at the step after its EOS (the Python loop drops it before the next step), the others keep their
// order.
class GreedyArgmax : public SearchPolicy {
 public:
  GreedyArgmax(const SearchRules& rules, const at::TensorOptions& options)
      : rules_(rules), options_(options), live_(rules.max_lens.size()), words_(live_.size()), sums_(live_.size()) {
    std::iota(live_.begin(), live_.end(), 0);
    last_ = at::full({static_cast<int64_t>(live_.size())}, rules.bos, options.dtype(at::kLong));
  }

  int64_t rows_per_sentence() const override { return 1; }
  int64_t running() const override { return static_cast<int64_t>(live_.size()); }
  Tensor last_tokens(int64_t) const override { return last_; }
  std::vector<Tensor> scored_rows(std::vector<Tensor> logits, int64_t) const override { return logits; }
  int64_t candidates() const override { return 1; }

  std::optional<Tensor> forced_eos(int64_t rows, int64_t step) const override {
    std::optional<Tensor> force;
    for (int64_t r = 0; r < rows && !force; ++r)
      if (step >= rules_.max_lens[live_[r]]) force = at::empty({rows}, options_.dtype(at::kBool));
    if (force)
      for (int64_t r = 0; r < rows; ++r) force->data_ptr<bool>()[r] = step >= rules_.max_lens[live_[r]];
    return force;
  }

  // The argmax, and each sentence's word and running sum (the decoder's candidate score: the word's
  // log-probability plus the prefix's, float32 additions).
  std::vector<int64_t> select(const std::vector<Tensor>& out, int64_t step) override {
    best_ = out[1];
    const float* value = out[0].data_ptr<float>();
    const int64_t* word = out[1].data_ptr<int64_t>();
    std::vector<int64_t> ending;
    kept_.clear();
    for (int64_t r = 0; r < running(); ++r) {
      const int64_t s = live_[r];
      sums_[s].push_back(step == 0 ? value[r] : sums_[s].back() + value[r]);
      words_[s].push_back(word[r]);
      if (word[r] == rules_.eos)
        ending.push_back(r);
      else
        kept_.push_back(r);
    }
    return ending;
  }

  // The rows that did not end go on with their word; none to move where every row goes on.
  std::optional<std::vector<int64_t>> next_beam(const std::vector<int64_t>& ending, int64_t) override {
    const int64_t rows = running();
    if (ending.empty()) {
      last_ = best_.view({rows});
      return std::nullopt;
    }
    last_ = best_.view({rows}).index_select(0, at::tensor(kept_, options_.dtype(at::kLong)));
    std::vector<int64_t> next_live;
    for (int64_t r : kept_) next_live.push_back(live_[r]);
    live_.swap(next_live);
    return kept_;
  }

  // [words, cumulative scores, lengths], flat in sentence order.
  std::vector<Tensor> results() const override {
    std::vector<int64_t> flat_words, lengths;
    std::vector<float> flat_sums;
    for (size_t s = 0; s < words_.size(); ++s) {
      flat_words.insert(flat_words.end(), words_[s].begin(), words_[s].end());
      flat_sums.insert(flat_sums.end(), sums_[s].begin(), sums_[s].end());
      lengths.push_back(static_cast<int64_t>(words_[s].size()));
    }
    const auto lng = options_.dtype(at::kLong);
    return {at::tensor(flat_words, lng), at::tensor(flat_sums, options_.dtype(at::kFloat)), at::tensor(lengths, lng)};
  }

 private:
  SearchRules rules_;
  at::TensorOptions options_;
  std::vector<int64_t> live_, kept_;
  Tensor last_, best_;
  std::vector<std::vector<int64_t>> words_;
  std::vector<std::vector<float>> sums_;
};

// The selection's candidates as candidates.py lays them out for the fused layer: (S, k * n) scores,
// log-probabilities and words. At step 0 every row holds the start and only each sentence's first row was
// scored (values: (S, n)).
std::vector<Tensor> beam_candidates(const Tensor& values, const Tensor& indices, const Tensor& scores, int64_t k,
                                    int64_t step) {
  const int64_t n = values.size(1);
  if (step == 0) {
    const int64_t S = values.size(0);
    Tensor cand = at::full({S, k, n}, -std::numeric_limits<float>::infinity(), values.options());
    Tensor local = at::zeros({S, k, n}, values.options());
    Tensor word = at::zeros({S, k, n}, indices.options());
    cand.select(1, 0).copy_(values);
    local.select(1, 0).copy_(values);
    word.select(1, 0).copy_(indices);
    return {cand.view({S, k * n}), local.view({S, k * n}), word.view({S, k * n})};
  }
  const int64_t S = values.size(0) / k;
  const Tensor cand = values + scores.narrow(1, step - 1, 1);
  return {cand.view({S, k * n}), values.view({S, k * n}), indices.view({S, k * n})};
}

// The cohort of a beam search (cohort.py:Cohort, as cohort_steps.open_cohort makes it) for the sentences
// still running: k rows a sentence, their histories and fairseq's finalization's counts.
struct BeamCohort {
  std::vector<int64_t> sentence;  // the batch index of each running sentence (Cohort.ids)
  Tensor tokens, scores;          // histories (rows, max_len + 2), (rows, max_len + 1)
  Tensor done_len, best_finished, max_lens, empty, ids;
};

// Fixed-width beam search with fairseq's finalization (--search fixed).
class FairseqBeam : public SearchPolicy {
 public:
  FairseqBeam(const SearchRules& rules, int64_t k, int64_t n, int64_t longest, const at::TensorOptions& options)
      : rules_(rules), k_(k), n_(n), kept_(rules.max_lens.size()), steps_(rules.max_lens.size(), 0) {
    open(longest, options);
  }

  int64_t rows_per_sentence() const override { return k_; }
  int64_t running() const override { return static_cast<int64_t>(c_.sentence.size()); }
  Tensor last_tokens(int64_t step) const override { return c_.tokens.select(1, step); }
  int64_t candidates() const override { return n_; }

  std::vector<Tensor> scored_rows(std::vector<Tensor> logits, int64_t step) const override {
    if (step == 0)
      for (auto& x : logits) x = x.slice(0, 0, x.size(0), k_).contiguous();  // each sentence's first row
    return logits;
  }

  std::optional<Tensor> forced_eos(int64_t rows, int64_t step) const override {
    const Tensor at_max = at::le(c_.max_lens, step);
    if (!at_max.any().item<bool>()) return std::nullopt;
    return at_max.repeat_interleave(rows / running());
  }

  // fairseq_step without pruning (the compiled selection), what the finalizer stores, and who ends.
  std::vector<int64_t> select(const std::vector<Tensor>& out, int64_t step) override {
    const auto cand = beam_candidates(out[0], out[1], c_.scores, k_, step);
    sel_ = fairseq_select_step(cand[0], cand[1], cand[2], n_, k_, rules_.eos, step, c_.done_len, c_.best_finished,
                               c_.max_lens, c_.empty, c_.ids);
    keep_finalized(step);
    const int64_t* summary = sel_[10].data_ptr<int64_t>();
    std::vector<int64_t> ending;
    for (int64_t i = 0; i < running(); ++i)
      if (summary[i] & 1) {
        ending.push_back(i);
        steps_[c_.sentence[i]] = step + 1;
      }
    return ending;
  }

  std::optional<std::vector<int64_t>> next_beam(const std::vector<int64_t>& ending, int64_t step) override;

  // [words, cumulative scores, lengths] of each sentence's finalized hypotheses in finalization order, flat
  // in sentence order; how many each sentence has; how many steps each ran.
  std::vector<Tensor> results() const override {
    std::vector<Tensor> words, sums;
    std::vector<int64_t> lengths, counts;
    for (const auto& mine : kept_) {
      for (const auto& [w, c] : mine) {
        words.push_back(w);
        sums.push_back(c);
        lengths.push_back(w.numel());
      }
      counts.push_back(static_cast<int64_t>(mine.size()));
    }
    const auto lng = c_.tokens.options();
    return {at::cat(words), at::cat(sums), at::tensor(lengths, lng), at::tensor(counts, lng), at::tensor(steps_, lng)};
  }

 private:
  void open(int64_t longest, const at::TensorOptions& options);
  void keep_finalized(int64_t step);
  std::vector<int64_t> drop_ended(const std::vector<int64_t>& ending, int64_t step);

  SearchRules rules_;
  int64_t k_, n_;
  BeamCohort c_;
  std::vector<Tensor> sel_;  // the step's selection (fairseq_select's results)
  std::vector<std::vector<std::pair<Tensor, Tensor>>> kept_;  // each sentence's finalized (words, sums)
  std::vector<int64_t> steps_;
};

// cohort_steps.open_cohort: histories, finalized lengths, best finished.
void FairseqBeam::open(int64_t longest, const at::TensorOptions& options) {
  const int64_t S = static_cast<int64_t>(rules_.max_lens.size());
  const auto lng = options.dtype(at::kLong);
  c_.sentence.resize(S);
  std::iota(c_.sentence.begin(), c_.sentence.end(), 0);
  c_.tokens = at::full({S * k_, longest + 2}, rules_.pad, lng);
  c_.tokens.select(1, 0).fill_(rules_.bos);
  c_.scores = at::zeros({S * k_, longest + 1}, options);
  c_.done_len = at::zeros({S, k_}, lng);
  c_.best_finished = at::full({S}, -INFINITY, options);
  c_.max_lens = at::tensor(rules_.max_lens, lng);
  c_.empty = at::zeros({S}, options.dtype(at::kBool));
  c_.ids = at::arange(S, lng);
}

// The EOS hypotheses the selection finalized this step (finalize.py:FairseqFinalizer.after_step), at most k a
// sentence.
void FairseqBeam::keep_finalized(int64_t step) {
  const int64_t S = running();
  const int64_t* summary = sel_[10].data_ptr<int64_t>();
  const bool* eos_mask = sel_[4].data_ptr<bool>();
  const int64_t* top_slot = sel_[5].data_ptr<int64_t>();
  const float* top_score = sel_[6].data_ptr<float>();
  for (int64_t i = 0; i < S; ++i) {
    auto& mine = kept_[c_.sentence[i]];
    for (int64_t j = 0; j < k_ && summary[2 * S + i] > 0 && static_cast<int64_t>(mine.size()) < k_; ++j) {
      if (!eos_mask[i * k_ + j]) continue;
      const int64_t row = i * k_ + top_slot[i * k_ + j];
      Tensor words = c_.tokens[row].narrow(0, 1, step + 1).clone();
      words[step] = rules_.eos;
      Tensor cumulative = c_.scores[row].narrow(0, 0, step + 1).clone();
      cumulative[step] = top_score[i * k_ + j];
      mine.emplace_back(words, cumulative);
    }
  }
}

// cohort_steps.next_beam: slot j of a sentence continues its parent, in place where no sentence ended.
std::optional<std::vector<int64_t>> FairseqBeam::next_beam(const std::vector<int64_t>& ending, int64_t step) {
  const Tensor &flat_parent = sel_[11], extended = sel_[3].view({-1}), token = sel_[1].view({-1}),
               score = sel_[2].view({-1});
  c_.done_len = sel_[7];
  c_.best_finished = sel_[8];
  if (!ending.empty()) return drop_ended(ending, step);
  reorder_beam_histories(c_.tokens, c_.scores, flat_parent, extended, token, score, step);
  const int64_t* p = flat_parent.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + flat_parent.numel());
}

// next_beam where sentences ended: they leave with their rows, the others' rows follow their parents.
std::vector<int64_t> FairseqBeam::drop_ended(const std::vector<int64_t>& ending, int64_t step) {
  const Tensor &flat_parent = sel_[11], extended = sel_[3].view({-1}), token = sel_[1].view({-1}),
               score = sel_[2].view({-1});
  std::vector<int64_t> keep, rows_keep, sentence;
  for (int64_t i = 0, e = 0; i < running(); ++i) {
    if (e < static_cast<int64_t>(ending.size()) && ending[e] == i) {
      ++e;
      continue;
    }
    keep.push_back(i);
    sentence.push_back(c_.sentence[i]);
    for (int64_t j = 0; j < k_; ++j) rows_keep.push_back(i * k_ + j);
  }
  const auto lng = c_.tokens.options().dtype(at::kLong);
  const Tensor kept = at::tensor(keep, lng), kept_rows = at::tensor(rows_keep, lng);
  const Tensor parent = flat_parent.index_select(0, kept_rows);
  // Whole rows in one copy: the columns not written yet are padding in every row.
  c_.tokens = c_.tokens.index_select(0, parent);
  c_.scores = c_.scores.index_select(0, parent);
  const Tensor ext = extended.index_select(0, kept_rows);
  c_.tokens.select(1, step + 1).copy_(at::where(ext, token.index_select(0, kept_rows), c_.tokens.select(1, step + 1)));
  c_.scores.select(1, step).copy_(at::where(ext, score.index_select(0, kept_rows), c_.scores.select(1, step)));
  c_.done_len = c_.done_len.index_select(0, kept);
  c_.best_finished = c_.best_finished.index_select(0, kept);
  c_.max_lens = c_.max_lens.index_select(0, kept);
  c_.empty = c_.empty.index_select(0, kept);
  c_.ids = c_.ids.index_select(0, kept);
  c_.sentence = sentence;
  const int64_t* p = parent.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + parent.numel());
}

}  // namespace

std::unique_ptr<SearchPolicy> greedy_policy(const SearchRules& rules, const at::TensorOptions& options) {
  return std::make_unique<GreedyArgmax>(rules, options);
}

std::unique_ptr<SearchPolicy> fairseq_beam_policy(const SearchRules& rules, int64_t k, int64_t n, int64_t longest,
                                                  const at::TensorOptions& options) {
  TORCH_CHECK(k >= 2 && n >= k, "beam_decode: k >= 2, n >= k");
  return std::make_unique<FairseqBeam>(rules, k, n, longest, options);
}
