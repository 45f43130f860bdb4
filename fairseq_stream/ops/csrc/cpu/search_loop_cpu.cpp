// A batch's search on the lean runner, the whole loop in one call: per step the embedding, every model's
// layers (lean_layers), the output layer and the fused log-softmax + rules + top-k (topk_log_softmax),
// then greedy's argmax or the beam's selection (fairseq_select, fairseq's finalization) and the
// histories' and caches' reorder, until every sentence ends; a sentence's rows leave at the step after
// it ends. fairseq_stream/ops/search_loop.py documents it.
//
// Why: one sentence at a time, a step of the Multi30k transformer costs about 0.1 ms of products in int8
// (greedy) but about as much again of Python around them (the runner's step, the decoder's candidates,
// selection and bookkeeping, each a dozen small torch calls); at beam 5 the Python is a third of the
// time. In a batch, the few sentences that never end run alone to the maximum length, one row a step.
// The loops here call the same ATen ops and kernels, in the same order, over the same rows, as the
// Python loop, so their tokens and scores are bitwise the Python loop's (tests/test_search_loop.py). Where
// a step has few rows of one float32 model (one sentence at a time, a batch's last sentences), it runs on
// buffers kept for the search instead (raw_step_cpu.cpp): the same arithmetic without ~150 ATen calls.

#include "search_loop_cpu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#include "attention_cpu.h"
#include "beam_step_cpu.h"
#include "lean_step_cpu.h"
#include "output_layer_cpu.h"
#include "raw_step_cpu.h"
#include "skinny_linear_cpu.h"

Tensor LeanDecoderModel::embed_at(const Tensor& token, int64_t position) const {
  // LeanModel.embed_at, op for op.
  Tensor x = at::mul(at::embedding(embed, token), embed_scale);
  if (project_in) x = (*project_in)(x);
  if (positions) x = at::add(x, positions->select(0, position));
  if (embed_norm) x = (*embed_norm)(x);
  return x;
}

Tensor LeanDecoderModel::logits(Tensor x) const {
  // LeanModel.logits, op for op.
  if (final_norm) x = (*final_norm)(x);
  if (project_out) x = (*project_out)(x);
  return output(x);
}

namespace {

// Each model's self-attention cache for `rows` rows, every position the sentence can reach allocated
// once (the Python runner doubles from 32): an attention reads only the positions written, so the
// capacity changes no result.
std::vector<Tensor> new_caches(const std::vector<LeanDecoderModel>& models, int64_t rows, int64_t max_len) {
  std::vector<Tensor> caches;
  for (const auto& m : models)
    caches.push_back(at::empty({2 * static_cast<int64_t>(m.layers.size()), rows, m.heads, max_len + 1, m.head_dim},
                               m.embed.options()));
  return caches;
}

// The step on kept buffers (RawStep) for a search of one float32 model whose rows are few enough, made once:
// `rows` the most rows a step has, `sentences` the batch's.
std::optional<RawStep> raw_step(const std::vector<LeanDecoderModel>& models,
                                const std::vector<std::vector<Tensor>>& enc_keys,
                                const std::vector<std::vector<Tensor>>& enc_values,
                                const std::vector<std::optional<Tensor>>& masks, int64_t rows, int64_t sentences) {
  std::optional<RawStep> raw;
  rows = std::min(rows, kSkinnyMaxRows);
  if (models.size() != 1 || !RawStep::fits(models[0], rows) ||
      !RawStep::consistent(models[0], enc_keys[0], enc_values[0], masks[0], sentences))
    return raw;
  for (size_t l = 0; l < enc_keys[0].size(); ++l)
    if (!enc_keys[0][l].is_contiguous() || !enc_values[0][l].is_contiguous()) return raw;
  raw.emplace(models[0], enc_keys[0], enc_values[0], masks[0], rows);
  return raw;
}

// The decoder step of every model over the rows' last tokens at `step` (the caches hold the rows'
// prefixes; slot: each row's): each model's logits (rows, V). On `raw`'s buffers where it takes the rows.
std::vector<Tensor> step_logits(const std::vector<LeanDecoderModel>& models, const std::vector<Tensor>& caches,
                                const std::vector<std::vector<Tensor>>& enc_keys,
                                const std::vector<std::vector<Tensor>>& enc_values,
                                const std::vector<std::optional<Tensor>>& masks, const Tensor& last,
                                const Tensor& row_sentence, int64_t step, const std::vector<int64_t>& slot,
                                std::optional<RawStep>& raw) {
  const int64_t rows = last.size(0);
  if (raw && raw->takes(rows)) {
    const Tensor tokens = last.contiguous(), sentence = row_sentence.contiguous();
    return {raw->logits(caches[0], tokens.data_ptr<int64_t>(), sentence.data_ptr<int64_t>(), slot.data(), rows, step)};
  }
  const Tensor slots = at::tensor(slot, last.options());
  std::vector<Tensor> logits;
  for (size_t i = 0; i < models.size(); ++i) {
    const LeanDecoderModel& m = models[i];
    Tensor x = m.embed_at(last, m.padding_idx + step + 1);
    x = lean_layers(x, m.layers, {caches[i]}, {slots}, {step}, {0, rows}, {enc_keys[i]}, {enc_values[i]}, {masks[i]},
                    {row_sentence});
    logits.push_back(m.logits(x).contiguous());
  }
  return logits;
}

// The selection's candidates as BeamDecoder._fused_candidates lays them out: (S, k * n) scores, log-probabilities
// and words. At step 0 every row holds the start and only each sentence's first row was run (values: (S, n)).
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

// Rows r of the next beam continue rows parent[r] (the rows that stay): each keeps its parent's cache slot; a
// parent's second and later children get free slots with a copy of its positions 0..length-1 (the Python
// runner's _reorder_segment). Slots no row keeps, those of ended sentences among them, become free. Returns
// each row's slot. Rows never outnumber the slots: a beam's rows only ever shrink.
std::vector<int64_t> follow_parents(std::vector<Tensor>& caches, const std::vector<int64_t>& slot,
                                    const int64_t* parent, int64_t rows, int64_t length) {
  const int64_t capacity = caches[0].size(1);
  std::vector<char> used(capacity, 0);
  std::vector<int64_t> next(rows), children;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = slot[parent[r]];
    if (used[s]) {
      children.push_back(r);
      continue;
    }
    used[s] = 1;
    next[r] = s;
  }
  if (children.empty()) return next;
  std::vector<int64_t> source, target;
  for (int64_t j = 0, c = 0; c < static_cast<int64_t>(children.size()); ++j) {
    if (used[j]) continue;
    source.push_back(slot[parent[children[c]]]);
    target.push_back(j);
    next[children[c]] = j;
    ++c;
  }
  const auto lng = caches[0].options().dtype(at::kLong);
  const Tensor from = at::tensor(source, lng), to = at::tensor(target, lng);
  for (auto& cache : caches) copy_cache_slots_(cache, from, to, length);
  return next;
}

}  // namespace

namespace {

// A batch's whole search is one call that runs without the GIL: between steps the loop asks Python whether
// a signal is pending, so that Ctrl-C (its handler's KeyboardInterrupt) ends the call at the next step
// rather than at the end of the batch (minutes for a WMT'19 batch on a CPU).
void check_signals() {
  pybind11::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
}

// Positions a new cache holds (the Python runner's INITIAL_CAPACITY): a batch's caches are sized for the
// steps it runs, doubling as they grow, not for the longest output any of its sentences may reach.
constexpr int64_t kInitialPositions = 32;

// `caches` in new tensors with room for `positions` positions, row r holding what slot[r] held (written
// positions 0..length-1 only), as the Python runner's _resized; then every row is its own slot. The copy
// also drops the slots no row uses (those of ended sentences).
void regather(std::vector<Tensor>& caches, std::vector<int64_t>& slot, int64_t positions, int64_t length) {
  const Tensor from = at::tensor(slot, caches[0].options().dtype(at::kLong));
  for (auto& cache : caches) {
    Tensor grown = at::empty({cache.size(0), from.size(0), cache.size(2), positions, cache.size(4)}, cache.options());
    grown.narrow(3, 0, length).copy_(cache.narrow(3, 0, length).index_select(1, from));
    cache = grown;
  }
  std::iota(slot.begin(), slot.end(), 0);
}

// Room for position `step` in the caches: full ones double (up to the longest sentence's last position).
void make_room(std::vector<Tensor>& caches, std::vector<int64_t>& slot, int64_t& positions, int64_t step,
               int64_t longest) {
  if (step < positions) return;
  positions = std::min(2 * positions, longest + 1);
  regather(caches, slot, positions, step);
}

// The arguments both loops take, checked; the longest maximum length.
int64_t check_batch(const char* loop, size_t models, size_t keys, size_t values, size_t masks,
                    const std::vector<int64_t>& max_lens) {
  TORCH_CHECK(models > 0 && keys == models && values == models && masks == models, loop,
              ": one model, its encoder keys, values and mask each");
  TORCH_CHECK(!max_lens.empty() && *std::min_element(max_lens.begin(), max_lens.end()) >= 0, loop,
              ": a max_len >= 0 per sentence");
  return *std::max_element(max_lens.begin(), max_lens.end());
}

}  // namespace

std::vector<Tensor> greedy_decode(const std::vector<LeanDecoderModel>& models,
                                  const std::vector<std::vector<Tensor>>& enc_keys,
                                  const std::vector<std::vector<Tensor>>& enc_values,
                                  const std::vector<std::optional<Tensor>>& masks, int64_t bos,
                                  const std::vector<int64_t>& max_lens, int64_t min_len, int64_t pad, int64_t eos,
                                  int64_t unk, double unk_penalty, double temperature) {
  const int64_t longest =
      check_batch("greedy_decode", models.size(), enc_keys.size(), enc_values.size(), masks.size(), max_lens);
  const int64_t S = static_cast<int64_t>(max_lens.size());
  const auto options = models[0].embed.options();
  const auto lng = options.dtype(at::kLong);
  int64_t positions = std::min(longest + 1, kInitialPositions);
  std::vector<Tensor> caches = new_caches(models, S, positions - 1);
  // Row r runs sentence live[r] from cache slot slot[r]: an ending sentence's row leaves (the Python loop drops
  // it before the next step), the others keep their order and their slots.
  std::vector<int64_t> live(S), slot(S);
  std::iota(live.begin(), live.end(), 0);
  std::iota(slot.begin(), slot.end(), 0);
  Tensor row_sentence = at::arange(S, lng);
  Tensor last = at::full({S}, bos, lng);
  std::vector<std::vector<int64_t>> words(S);
  std::vector<std::vector<float>> sums(S);
  std::optional<RawStep> raw = raw_step(models, enc_keys, enc_values, masks, S, S);
  for (int64_t step = 0; !live.empty(); ++step) {
    if (step > 0) check_signals();
    const int64_t rows = static_cast<int64_t>(live.size());
    make_room(caches, slot, positions, step, longest);
    std::optional<Tensor> force;
    for (int64_t r = 0; r < rows && !force; ++r)
      if (step >= max_lens[live[r]]) force = at::empty({rows}, options.dtype(at::kBool));
    if (force)
      for (int64_t r = 0; r < rows; ++r) force->data_ptr<bool>()[r] = step >= max_lens[live[r]];
    const std::vector<Tensor> logits =
        step_logits(models, caches, enc_keys, enc_values, masks, last, row_sentence, step, slot, raw);
    const auto out = topk_log_softmax(logits, {}, 1, pad, eos, unk, unk_penalty, temperature, step < min_len,
                                      std::nullopt, force, std::nullopt);
    const float* value = out[0].data_ptr<float>();
    const int64_t* word = out[1].data_ptr<int64_t>();
    std::vector<int64_t> kept;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t s = live[r];
      // The decoder's candidate score: the word's log-probability plus the prefix's (float32 additions).
      sums[s].push_back(step == 0 ? value[r] : sums[s].back() + value[r]);
      words[s].push_back(word[r]);
      if (word[r] != eos) kept.push_back(r);
    }
    if (static_cast<int64_t>(kept.size()) == rows) {
      last = out[1].view({rows});
      continue;
    }
    const Tensor keep = at::tensor(kept, lng);
    row_sentence = row_sentence.index_select(0, keep);
    last = out[1].view({rows}).index_select(0, keep);
    std::vector<int64_t> next_live, next_slot;
    for (int64_t r : kept) {
      next_live.push_back(live[r]);
      next_slot.push_back(slot[r]);
    }
    live.swap(next_live);
    slot.swap(next_slot);
  }
  std::vector<int64_t> flat_words, lengths;
  std::vector<float> flat_sums;
  for (int64_t s = 0; s < S; ++s) {
    flat_words.insert(flat_words.end(), words[s].begin(), words[s].end());
    flat_sums.insert(flat_sums.end(), sums[s].begin(), sums[s].end());
    lengths.push_back(static_cast<int64_t>(words[s].size()));
  }
  return {at::tensor(flat_words, lng), at::tensor(flat_sums, options.dtype(at::kFloat)), at::tensor(lengths, lng)};
}

namespace {

// The beam search's state for the sentences still running (BeamDecoder's cohort): k rows a sentence.
struct Beams {
  std::vector<int64_t> sentence;  // the batch index of each running sentence
  Tensor tokens, scores;          // histories (rows, max_len + 2), (rows, max_len + 1)
  Tensor done_len, best_finished, max_lens, empty, ids, row_sentence;
  std::vector<Tensor> caches;
  std::vector<int64_t> slot;  // each row's cache slot
  int64_t positions;
};

// The EOS hypotheses the selection finalized this step (_finalize_fairseq), at most k a sentence.
void keep_finalized(const Beams& b, const std::vector<Tensor>& sel, int64_t k, int64_t step, int64_t eos,
                    std::vector<std::vector<std::pair<Tensor, Tensor>>>& kept) {
  const int64_t S = static_cast<int64_t>(b.sentence.size());
  const int64_t* summary = sel[10].data_ptr<int64_t>();
  const bool* eos_mask = sel[4].data_ptr<bool>();
  const int64_t* top_slot = sel[5].data_ptr<int64_t>();
  const float* top_score = sel[6].data_ptr<float>();
  for (int64_t i = 0; i < S; ++i) {
    auto& mine = kept[b.sentence[i]];
    for (int64_t j = 0; j < k && summary[2 * S + i] > 0 && static_cast<int64_t>(mine.size()) < k; ++j) {
      if (!eos_mask[i * k + j]) continue;
      const int64_t row = i * k + top_slot[i * k + j];
      Tensor words = b.tokens[row].narrow(0, 1, step + 1).clone();
      words[step] = eos;
      Tensor cumulative = b.scores[row].narrow(0, 0, step + 1).clone();
      cumulative[step] = top_score[i * k + j];
      mine.emplace_back(words, cumulative);
    }
  }
}

// The next beam (_next_beam): rows follow their parents; sentences that ended leave, with their rows.
void next_beam(Beams& b, const std::vector<Tensor>& sel, int64_t k, int64_t step, const std::vector<int64_t>& ending) {
  const Tensor &flat_parent = sel[11], extended = sel[3].view({-1}), token = sel[1].view({-1}),
               score = sel[2].view({-1});
  b.done_len = sel[7];
  b.best_finished = sel[8];
  if (ending.empty()) {
    reorder_beam_histories(b.tokens, b.scores, flat_parent, extended, token, score, step);
    b.slot = follow_parents(b.caches, b.slot, flat_parent.data_ptr<int64_t>(), flat_parent.numel(), step + 1);
    return;
  }
  const int64_t S = static_cast<int64_t>(b.sentence.size());
  std::vector<int64_t> keep, rows_keep, sentence;
  for (int64_t i = 0, e = 0; i < S; ++i) {
    if (e < static_cast<int64_t>(ending.size()) && ending[e] == i) {
      ++e;
      continue;
    }
    keep.push_back(i);
    sentence.push_back(b.sentence[i]);
    for (int64_t j = 0; j < k; ++j) rows_keep.push_back(i * k + j);
  }
  const auto lng = b.tokens.options().dtype(at::kLong);
  const Tensor kept = at::tensor(keep, lng), kept_rows = at::tensor(rows_keep, lng);
  const Tensor parent = flat_parent.index_select(0, kept_rows);
  // Whole rows in one copy: the columns not written yet are padding in every row.
  b.tokens = b.tokens.index_select(0, parent);
  b.scores = b.scores.index_select(0, parent);
  const Tensor ext = extended.index_select(0, kept_rows);
  b.tokens.select(1, step + 1).copy_(at::where(ext, token.index_select(0, kept_rows), b.tokens.select(1, step + 1)));
  b.scores.select(1, step).copy_(at::where(ext, score.index_select(0, kept_rows), b.scores.select(1, step)));
  b.done_len = b.done_len.index_select(0, kept);
  b.best_finished = b.best_finished.index_select(0, kept);
  b.max_lens = b.max_lens.index_select(0, kept);
  b.empty = b.empty.index_select(0, kept);
  b.ids = b.ids.index_select(0, kept);
  b.row_sentence = b.row_sentence.index_select(0, kept_rows);
  b.sentence = sentence;
  b.slot = follow_parents(b.caches, b.slot, parent.data_ptr<int64_t>(), parent.numel(), step + 1);
  const int64_t rows = parent.numel();
  if (b.caches[0].size(1) >= 2 * kInitialPositions && 2 * rows < b.caches[0].size(1)) {
    // Most slots are free (sentences ended): keep the used ones only, in row order.
    regather(b.caches, b.slot, b.positions, step + 1);
  }
}

}  // namespace

std::vector<Tensor> beam_decode(const std::vector<LeanDecoderModel>& models,
                                const std::vector<std::vector<Tensor>>& enc_keys,
                                const std::vector<std::vector<Tensor>>& enc_values,
                                const std::vector<std::optional<Tensor>>& masks, int64_t k, int64_t n, int64_t bos,
                                const std::vector<int64_t>& max_lens, int64_t min_len, int64_t pad, int64_t eos,
                                int64_t unk, double unk_penalty, double temperature) {
  const int64_t longest =
      check_batch("beam_decode", models.size(), enc_keys.size(), enc_values.size(), masks.size(), max_lens);
  TORCH_CHECK(k >= 2 && n >= k, "beam_decode: k >= 2, n >= k");
  const int64_t S = static_cast<int64_t>(max_lens.size());
  const auto options = models[0].embed.options();
  const auto lng = options.dtype(at::kLong);
  // The decoder's cohort (BeamDecoder.open): histories, finalized lengths, best finished, the rows' caches.
  Beams b;
  b.sentence.resize(S);
  std::iota(b.sentence.begin(), b.sentence.end(), 0);
  b.tokens = at::full({S * k, longest + 2}, pad, lng);
  b.tokens.select(1, 0).fill_(bos);
  b.scores = at::zeros({S * k, longest + 1}, options);
  b.done_len = at::zeros({S, k}, lng);
  b.best_finished = at::full({S}, -INFINITY, options);
  b.max_lens = at::tensor(max_lens, lng);
  b.empty = at::zeros({S}, options.dtype(at::kBool));
  b.ids = at::arange(S, lng);
  b.row_sentence = at::arange(S, lng).repeat_interleave(k);
  b.positions = std::min(longest + 1, kInitialPositions);
  b.caches = new_caches(models, S * k, b.positions - 1);
  b.slot.resize(S * k);
  std::iota(b.slot.begin(), b.slot.end(), 0);
  std::vector<std::vector<std::pair<Tensor, Tensor>>> kept(S);
  std::vector<int64_t> steps(S, 0);
  std::optional<RawStep> raw = raw_step(models, enc_keys, enc_values, masks, S * k, S);
  for (int64_t step = 0; !b.sentence.empty(); ++step) {
    if (step > 0) check_signals();
    const int64_t running = static_cast<int64_t>(b.sentence.size());
    make_room(b.caches, b.slot, b.positions, step, longest);
    std::vector<Tensor> logits = step_logits(models, b.caches, enc_keys, enc_values, masks, b.tokens.select(1, step),
                                             b.row_sentence, step, b.slot, raw);
    if (step == 0)
      for (auto& x : logits) x = x.slice(0, 0, x.size(0), k).contiguous();  // each sentence's first row
    const int64_t rows = logits[0].size(0);
    std::optional<Tensor> force;
    const Tensor at_max = at::le(b.max_lens, step);
    if (at_max.any().item<bool>()) force = at_max.repeat_interleave(rows / running);
    const auto out = topk_log_softmax(logits, {}, n, pad, eos, unk, unk_penalty, temperature, step < min_len,
                                      std::nullopt, force, std::nullopt);
    const auto cand = beam_candidates(out[0], out[1], b.scores, k, step);
    const auto sel = fairseq_select_step(cand[0], cand[1], cand[2], n, k, eos, step, b.done_len, b.best_finished,
                                         b.max_lens, b.empty, b.ids);
    keep_finalized(b, sel, k, step, eos, kept);
    const int64_t* summary = sel[10].data_ptr<int64_t>();
    std::vector<int64_t> ending;
    for (int64_t i = 0; i < running; ++i)
      if (summary[i] & 1) {
        ending.push_back(i);
        steps[b.sentence[i]] = step + 1;
      }
    if (static_cast<int64_t>(ending.size()) == running) break;
    next_beam(b, sel, k, step, ending);
  }
  std::vector<Tensor> words, sums;
  std::vector<int64_t> lengths, counts;
  for (int64_t s = 0; s < S; ++s) {
    for (const auto& [w, c] : kept[s]) {
      words.push_back(w);
      sums.push_back(c);
      lengths.push_back(w.numel());
    }
    counts.push_back(static_cast<int64_t>(kept[s].size()));
  }
  return {at::cat(words), at::cat(sums), at::tensor(lengths, lng), at::tensor(counts, lng), at::tensor(steps, lng)};
}
