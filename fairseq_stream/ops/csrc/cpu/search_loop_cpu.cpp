// One sentence's search on the lean runner, the whole loop in one call: per step the embedding, every
// model's layers (lean_layers), the output layer and the fused log-softmax + rules + top-k
// (topk_log_softmax), then greedy's argmax or the beam's selection (fairseq_select, fairseq's
// finalization) and the histories' and caches' reorder, until the sentence ends.
// fairseq_stream/ops/search_loop.py documents it.
//
// Why: one sentence at a time, a step of the Multi30k transformer costs about 0.1 ms of products in int8
// (greedy) but about as much again of Python around them (the runner's step, the decoder's candidates,
// selection and bookkeeping, each a dozen small torch calls); at beam 5 the Python is a third of the
// time. The loops here call the same ATen ops and kernels, in the same order, as the Python loop does
// for one sentence, so their tokens and scores are bitwise the Python loop's (tests/test_search_loop.py).

#include "search_loop_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#include "beam_step_cpu.h"
#include "lean_step_cpu.h"
#include "output_layer_cpu.h"

namespace {

using NormWeights = std::tuple<Tensor, Tensor, double>;

std::optional<Norm> optional_norm(const std::optional<NormWeights>& n) {
  if (!n) return std::nullopt;
  return Norm{std::get<0>(*n), std::get<1>(*n), std::get<2>(*n)};
}

}  // namespace

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

// The decoder step of every model over the rows' last tokens at `step` (the caches hold the rows'
// prefixes): each model's logits (rows, V).
std::vector<Tensor> step_logits(const std::vector<LeanDecoderModel>& models, const std::vector<Tensor>& caches,
                                const std::vector<std::vector<Tensor>>& enc_keys,
                                const std::vector<std::vector<Tensor>>& enc_values,
                                const std::vector<std::optional<Tensor>>& masks, const Tensor& last,
                                const Tensor& row_sentence, int64_t step, const std::optional<Tensor>& slot) {
  const int64_t rows = last.size(0);
  std::vector<Tensor> logits;
  for (size_t i = 0; i < models.size(); ++i) {
    const LeanDecoderModel& m = models[i];
    Tensor x = m.embed_at(last, m.padding_idx + step + 1);
    x = lean_layers(x, m.layers, {caches[i]}, {slot}, {step}, {0, rows}, {enc_keys[i]}, {enc_values[i]}, {masks[i]},
                    {row_sentence});
    logits.push_back(m.logits(x).contiguous());
  }
  return logits;
}

// The selection's candidates as BeamDecoder._fused_candidates lays them out for one sentence: (1, k * n)
// scores, log-probabilities and words. At step 0 every row holds the start and only row 0 is extended.
std::vector<Tensor> beam_candidates(const Tensor& values, const Tensor& indices, const Tensor& scores, int64_t k,
                                    int64_t step) {
  const int64_t n = values.size(1);
  if (step == 0) {
    Tensor cand = at::full({k, n}, -std::numeric_limits<float>::infinity(), values.options());
    Tensor local = at::zeros({k, n}, values.options());
    Tensor word = at::zeros({k, n}, indices.options());
    cand[0].copy_(values[0]);
    local[0].copy_(values[0]);
    word[0].copy_(indices[0]);
    return {cand.view({1, k * n}), local.view({1, k * n}), word.view({1, k * n})};
  }
  const Tensor cand = values + scores.narrow(1, step - 1, 1);
  return {cand.view({1, k * n}), values.view({1, k * n}), indices.view({1, k * n})};
}

// Rows r of the beam continue rows parent[r]: positions 0..length-1 of each cache row whose parent is another
// row are copied from the parent (through a buffer: parents may be overwritten). Rows that continue
// themselves, often most of a beam, are not touched (index_select moved every row, a tenth of a step).
void follow_parents(Tensor& cache, const int64_t* parent, int64_t k, int64_t length) {
  std::vector<int64_t> moved;
  for (int64_t r = 0; r < k; ++r)
    if (parent[r] != r) moved.push_back(r);
  if (moved.empty() || length == 0) return;
  const int64_t layers = cache.size(0), heads = cache.size(2), capacity = cache.size(3), dim = cache.size(4);
  const int64_t block = length * dim;  // one head's written positions
  float* base = cache.data_ptr<float>();
  auto at = [&](int64_t l, int64_t row, int64_t h) { return base + ((l * k + row) * heads + h) * capacity * dim; };
  std::vector<float> buffer(layers * moved.size() * heads * block);
  float* out = buffer.data();
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t r : moved)
      for (int64_t h = 0; h < heads; ++h, out += block) std::memcpy(out, at(l, parent[r], h), block * sizeof(float));
  const float* in = buffer.data();
  for (int64_t l = 0; l < layers; ++l)
    for (int64_t r : moved)
      for (int64_t h = 0; h < heads; ++h, in += block) std::memcpy(at(l, r, h), in, block * sizeof(float));
}

}  // namespace

namespace {

// Positions a new cache holds (the Python runner's INITIAL_CAPACITY): a batch's caches are sized for the
// steps it runs, doubling as they grow, not for the longest output any of its sentences may reach.
constexpr int64_t kInitialPositions = 32;

// `caches` with room for `positions` positions, rows 0..rows-1 holding slots `slot` (written positions
// 0..length-1 only), as the Python runner's _resized: the copy also drops the slots of ended sentences.
void grow_caches(std::vector<Tensor>& caches, const Tensor& slot, int64_t positions, int64_t length) {
  for (auto& cache : caches) {
    Tensor grown = at::empty({cache.size(0), slot.size(0), cache.size(2), positions, cache.size(4)}, cache.options());
    grown.narrow(3, 0, length).copy_(cache.index_select(1, slot).narrow(3, 0, length));
    cache = grown;
  }
}

}  // namespace

std::vector<Tensor> greedy_decode(const std::vector<LeanDecoderModel>& models,
                                  const std::vector<std::vector<Tensor>>& enc_keys,
                                  const std::vector<std::vector<Tensor>>& enc_values,
                                  const std::vector<std::optional<Tensor>>& masks, int64_t bos,
                                  const std::vector<int64_t>& max_lens, int64_t min_len, int64_t pad, int64_t eos,
                                  int64_t unk, double unk_penalty, double temperature) {
  const size_t M = models.size();
  TORCH_CHECK(M > 0 && enc_keys.size() == M && enc_values.size() == M && masks.size() == M,
              "greedy_decode: one model, its encoder keys, values and mask each");
  const int64_t S = static_cast<int64_t>(max_lens.size());
  TORCH_CHECK(S > 0 && *std::min_element(max_lens.begin(), max_lens.end()) >= 0,
              "greedy_decode: a max_len >= 0 per sentence");
  const int64_t longest = *std::max_element(max_lens.begin(), max_lens.end());
  const auto options = models[0].embed.options();
  const auto lng = options.dtype(at::kLong);
  int64_t positions = std::min(longest + 1, kInitialPositions);
  std::vector<Tensor> caches = new_caches(models, S, positions - 1);
  // Row r runs sentence live[r] from cache slot slot[r]: an ending sentence's row leaves (the Python loop drops
  // it before the next step), the others keep their order and their slots.
  std::vector<int64_t> live(S);
  std::iota(live.begin(), live.end(), 0);
  Tensor slot = at::arange(S, lng), row_sentence = slot.clone();
  Tensor last = at::full({S}, bos, lng);
  std::vector<std::vector<int64_t>> words(S);
  std::vector<std::vector<float>> sums(S);
  for (int64_t step = 0; !live.empty(); ++step) {
    const int64_t rows = static_cast<int64_t>(live.size());
    if (step >= positions) {
      positions = std::min(2 * positions, longest + 1);
      grow_caches(caches, slot, positions, step);
      slot = at::arange(rows, lng);
    }
    std::optional<Tensor> force;
    for (int64_t r = 0; r < rows && !force; ++r)
      if (step >= max_lens[live[r]]) force = at::empty({rows}, options.dtype(at::kBool));
    if (force)
      for (int64_t r = 0; r < rows; ++r) force->data_ptr<bool>()[r] = step >= max_lens[live[r]];
    const std::vector<Tensor> logits =
        step_logits(models, caches, enc_keys, enc_values, masks, last, row_sentence, step, slot);
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
    slot = slot.index_select(0, keep);
    row_sentence = row_sentence.index_select(0, keep);
    last = out[1].view({rows}).index_select(0, keep);
    std::vector<int64_t> next;
    for (int64_t r : kept) next.push_back(live[r]);
    live.swap(next);
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

std::vector<Tensor> beam_decode(const std::vector<LeanDecoderModel>& models,
                                const std::vector<std::vector<Tensor>>& enc_keys,
                                const std::vector<std::vector<Tensor>>& enc_values,
                                const std::vector<std::optional<Tensor>>& masks, int64_t k, int64_t n, int64_t bos,
                                int64_t max_len, int64_t min_len, int64_t pad, int64_t eos, int64_t unk,
                                double unk_penalty, double temperature) {
  const size_t M = models.size();
  TORCH_CHECK(M > 0 && enc_keys.size() == M && enc_values.size() == M && masks.size() == M,
              "beam_decode: one model, its encoder keys, values and mask each");
  TORCH_CHECK(k >= 2 && n >= k && max_len >= 0, "beam_decode: k >= 2, n >= k, max_len >= 0");
  const auto options = models[0].embed.options();
  const auto lng = options.dtype(at::kLong);
  std::vector<Tensor> caches = new_caches(models, k, max_len);
  // The decoder's cohort of one sentence (BeamDecoder.open): histories, finalized lengths, best finished.
  Tensor tokens = at::full({k, max_len + 2}, pad, lng);
  tokens.select(1, 0).fill_(bos);
  Tensor scores = at::zeros({k, max_len + 1}, options);
  Tensor done_len = at::zeros({1, k}, lng), best_finished = at::full({1}, -INFINITY, options);
  const Tensor max_lens = at::full({1}, max_len, lng), empty = at::zeros({1}, options.dtype(at::kBool));
  const Tensor ids = at::zeros({1}, lng), row_sentence = at::zeros({k}, lng);
  std::vector<Tensor> kept_tokens, kept_cumulative;
  for (int64_t step = 0;; ++step) {
    std::vector<Tensor> logits =
        step_logits(models, caches, enc_keys, enc_values, masks, tokens.select(1, step), row_sentence, step,
                    std::nullopt);
    if (step == 0)
      for (auto& x : logits) x = x.narrow(0, 0, 1);
    const int64_t rows = logits[0].size(0);
    const std::optional<Tensor> force =
        step >= max_len ? std::optional<Tensor>(at::ones({rows}, options.dtype(at::kBool))) : std::nullopt;
    const auto out = topk_log_softmax(logits, {}, n, pad, eos, unk, unk_penalty, temperature, step < min_len,
                                      std::nullopt, force, std::nullopt);
    const auto cand = beam_candidates(out[0], out[1], scores, k, step);
    const auto sel = fairseq_select_step(cand[0], cand[1], cand[2], n, k, eos, step, done_len, best_finished,
                                         max_lens, empty, ids);
    const int64_t* summary = sel[10].data_ptr<int64_t>();
    if (summary[2] > 0) {
      // _finalize_fairseq: each EOS hypothesis of the step, in the mask's order, at most k in all.
      const bool* eos_mask = sel[4].data_ptr<bool>();
      const int64_t* top_slot = sel[5].data_ptr<int64_t>();
      const float* top_score = sel[6].data_ptr<float>();
      for (int64_t j = 0; j < k && static_cast<int64_t>(kept_tokens.size()) < k; ++j) {
        if (!eos_mask[j]) continue;
        Tensor words = tokens[top_slot[j]].narrow(0, 1, step + 1).clone();
        words[step] = eos;
        Tensor cumulative = scores[top_slot[j]].narrow(0, 0, step + 1).clone();
        cumulative[step] = top_score[j];
        kept_tokens.push_back(words);
        kept_cumulative.push_back(cumulative);
      }
    }
    done_len = sel[7];
    best_finished = sel[8];
    if (summary[0] & 1) break;
    reorder_beam_histories(tokens, scores, sel[11], sel[3].view({-1}), sel[1].view({-1}), sel[2].view({-1}), step);
    // The runner's rows follow their parents: positions 0..step of each cache.
    for (auto& cache : caches) follow_parents(cache, sel[11].data_ptr<int64_t>(), k, step + 1);
  }
  std::vector<int64_t> lengths;
  for (const auto& t : kept_tokens) lengths.push_back(t.numel());
  return {at::cat(kept_tokens), at::cat(kept_cumulative), at::tensor(lengths, lng)};
}

void register_search_loop(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<LeanDecoderModel>(m, "LeanDecoderModel",
                               "one model's decoder for the search loops: embedding, layers, output layer")
      .def(py::init([](Tensor embed, double embed_scale, std::optional<Tensor> positions,
                       std::optional<Product> project_in, std::optional<NormWeights> embed_norm,
                       std::vector<LeanLayer> layers, std::optional<NormWeights> final_norm,
                       std::optional<Product> project_out, Product output, int64_t padding_idx, int64_t heads,
                       int64_t head_dim) {
             return LeanDecoderModel{embed, embed_scale, positions, project_in, optional_norm(embed_norm),
                                     std::move(layers), optional_norm(final_norm), project_out, output,
                                     padding_idx, heads, head_dim};
           }),
           py::arg("embed"), py::arg("embed_scale"), py::arg("positions"), py::arg("project_in"),
           py::arg("embed_norm"), py::arg("layers"), py::arg("final_norm"), py::arg("project_out"),
           py::arg("output"), py::arg("padding_idx"), py::arg("heads"), py::arg("head_dim"));
  m.def("greedy_decode", &greedy_decode,
        "(models, per model: encoder keys [layers], values [layers], mask or None; bos, max_lens (one per "
        "sentence), min_len, pad, eos, unk (-1: none), unk_penalty, temperature) -> [words, cumulative scores "
        "(float32), lengths]: each sentence's words (EOS last), flat in sentence order",
        py::arg("models"), py::arg("enc_keys"), py::arg("enc_values"), py::arg("masks"), py::arg("bos"),
        py::arg("max_lens"), py::arg("min_len"), py::arg("pad"), py::arg("eos"), py::arg("unk"),
        py::arg("unk_penalty"), py::arg("temperature"), py::call_guard<py::gil_scoped_release>());
  m.def("beam_decode", &beam_decode,
        "(models, per model: encoder keys [layers], values [layers], mask or None; k, n (candidates a row), bos, "
        "max_len, min_len, pad, eos, unk (-1: none), unk_penalty, temperature) -> [words, cumulative scores "
        "(float32), lengths]: the finalized hypotheses in finalization order, flat",
        py::arg("models"), py::arg("enc_keys"), py::arg("enc_values"), py::arg("masks"), py::arg("k"), py::arg("n"),
        py::arg("bos"), py::arg("max_len"), py::arg("min_len"), py::arg("pad"), py::arg("eos"), py::arg("unk"),
        py::arg("unk_penalty"), py::arg("temperature"), py::call_guard<py::gil_scoped_release>());
}
