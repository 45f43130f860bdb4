// A batch's search on the lean runner, the whole loop in one call: the Python engine's loop
// (engine.py:Engine.run with schedule/plan.py:BatchPlanner: the batch admitted whole, its one cohort stepped
// until every sentence ended) compiled, phase by phase, each phase one function below named after the
// Python function it compiles:
//
//   open          start_rows + the policy's own cohort   cohort_steps.open_cohort (runner.start)
//   step          step_model                              LeanRunner.step (_forward: the caches' growth,
//                                                         each model's layers, LeanModel.logits)
//   output layer  output_layer                            candidates.top_candidates (the fused bias +
//                                                         log-softmax + rules + top-k)
//   search        SearchPolicy::select                    search/policies.py:FairseqPolicy.select
//                                                         (search/selection.py:fairseq_step; greedy: the
//                                                         argmax) and the finalizer's after_step (finalize.py)
//   next beam     SearchPolicy::next_beam + follow_rows   cohort_steps.next_beam: the histories, then the
//                                                         runner's reorder (runners/lean.py:_reorder_segment)
//   drop ended    run's loop condition                    Engine.run: a cohort without sentences leaves
//
// The policies (search_policy_cpu.h: greedy's argmax, fairseq's beam) are the only part that differs by
// search; the rows' caches move by the lean runner's own function (cache_slots_cpu.cpp), and the beam's
// selection is the CPU selection the Python loop runs (beam_step_cpu.cpp). A sentence's rows leave at the
// step after it ends. fairseq_stream/ops/search_loop.py documents it.
//
// Why: one sentence at a time, a step of the Multi30k transformer costs about 0.1 ms of products in int8
// (greedy) but about as much again of Python around them (the runner's step, the decoder's candidates,
// selection and bookkeeping, each a dozen small torch calls); at beam 5 the Python is a third of the
// time. In a batch, the few sentences that never end run alone to the maximum length, one row a step.
// The loop calls the same ATen ops and kernels, in the same order, over the same rows, as the Python
// loop, so its tokens and scores are bitwise the Python loop's (tests/test_search_loop.py). Where a step
// has few rows of one float32 model (one sentence at a time, a batch's last sentences), it runs on
// buffers kept for the search instead (raw_step_cpu.cpp): the same arithmetic without ~150 ATen calls.

#include "search_loop_cpu.h"

#include <ATen/ops/add.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/tensor.h>
#include <pybind11/pybind11.h>
#include <algorithm>
#include <memory>
#include <numeric>
#include <optional>
#include <vector>

#include "cache_slots_cpu.h"
#include "lean_step_cpu.h"
#include "output_layer_cpu.h"
#include "raw_step_cpu.h"
#include "search_policy_cpu.h"
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

// Each model's self-attention cache for `rows` rows and max_len + 1 positions (LeanModel.new_cache, not
// zeroed: an attention reads only the positions written).
std::vector<Tensor> new_caches(const std::vector<LeanDecoderModel>& models, int64_t rows, int64_t max_len) {
  std::vector<Tensor> caches;
  for (const auto& m : models)
    caches.push_back(at::empty({2 * static_cast<int64_t>(m.layers.size()), rows, m.heads, max_len + 1, m.head_dim},
                               m.embed.options()));
  return caches;
}

// The step on kept buffers (RawStep) for a search of one float32 model whose rows are few enough, made once
// in `raw`: `rows` the most rows a step has, `sentences` the batch's.
void make_raw_step(std::optional<RawStep>& raw, const std::vector<LeanDecoderModel>& models,
                   const std::vector<std::vector<Tensor>>& enc_keys, const std::vector<std::vector<Tensor>>& enc_values,
                   const std::vector<std::optional<Tensor>>& masks, int64_t rows, int64_t sentences) {
  rows = std::min(rows, kSkinnyMaxRows);
  if (models.size() != 1 || !RawStep::fits(models[0], rows) ||
      !RawStep::consistent(models[0], enc_keys[0], enc_values[0], masks[0], sentences))
    return;
  for (size_t l = 0; l < enc_keys[0].size(); ++l)
    if (!enc_keys[0][l].is_contiguous() || !enc_values[0][l].is_contiguous()) return;
  raw.emplace(models[0], enc_keys[0], enc_values[0], masks[0], rows);
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

// A batch's whole search is one call that runs without the GIL: between steps the loop asks Python whether
// a signal is pending, so that Ctrl-C (its handler's KeyboardInterrupt) ends the call at the next step
// rather than at the end of the batch (minutes for a WMT'19 batch on a CPU).
void check_signals() {
  pybind11::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
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

// Positions a new cache holds (the Python runner's INITIAL_CAPACITY): a batch's caches are sized for the
// steps it runs, doubling as they grow, not for the longest output any of its sentences may reach.
constexpr int64_t kInitialPositions = 32;
// Slots above which caches mostly free are compacted (runners/lean.py: COMPACT_ABOVE_SLOTS).
constexpr int64_t kCompactAboveSlots = 32;

// The models and the batch's encoder output: all that the runner's step reads besides the rows.
struct LoopModels {
  const std::vector<LeanDecoderModel>& models;
  const std::vector<std::vector<Tensor>>& keys;
  const std::vector<std::vector<Tensor>>& values;
  const std::vector<std::optional<Tensor>>& masks;
};

// The rows' runner state (runners/lean.py: a LeanState of one _Segment): each row's sentence, each model's
// self-attention cache and each row's slot in it; the step on kept buffers where it applies.
struct RunnerRows {
  Tensor row_sentence;
  std::vector<Tensor> caches;
  std::vector<int64_t> slot;
  int64_t positions, longest;
  std::optional<RawStep> raw;
};

// Open (LeanRunner.start): `per_sentence` rows a sentence, each its own slot, caches for the first
// kInitialPositions positions.
void start_rows(RunnerRows& r, const LoopModels& m, int64_t sentences, int64_t per_sentence, int64_t longest) {
  const auto lng = m.models[0].embed.options().dtype(at::kLong);
  const int64_t rows = sentences * per_sentence;
  r.row_sentence = at::arange(sentences, lng);
  if (per_sentence > 1) r.row_sentence = r.row_sentence.repeat_interleave(per_sentence);
  r.positions = std::min(longest + 1, kInitialPositions);
  r.longest = longest;
  r.caches = new_caches(m.models, rows, r.positions - 1);
  r.slot.resize(rows);
  std::iota(r.slot.begin(), r.slot.end(), 0);
  make_raw_step(r.raw, m.models, m.keys, m.values, m.masks, rows, sentences);
}

// Step the model (LeanRunner.step): room for position `step` first (_forward's growth: full caches double, up
// to the longest sentence's last position, keeping only the rows' own slots), then every model's logits for
// the rows' last tokens.
std::vector<Tensor> step_model(const LoopModels& m, RunnerRows& r, const Tensor& last, int64_t step) {
  if (step >= r.positions) {
    r.positions = std::min(2 * r.positions, r.longest + 1);
    regather_slots(r.caches, r.slot, r.positions, step);
  }
  return step_logits(m.models, r.caches, m.keys, m.values, m.masks, last, r.row_sentence, step, r.slot, r.raw);
}

// The output layer (candidates.top_candidates): each scored row's best words by fairseq's step rules.
std::vector<Tensor> output_layer(const std::vector<Tensor>& logits, const SearchPolicy& policy,
                                 const SearchRules& rules, int64_t step) {
  const std::optional<Tensor> force = policy.forced_eos(logits[0].size(0), step);
  return topk_log_softmax(logits, {}, policy.candidates(), rules.pad, rules.eos, rules.unk, rules.unk_penalty,
                          rules.temperature, step < rules.min_len, std::nullopt, force, std::nullopt);
}

// The runner's rows follow the next beam (LeanRunner.reorder: _reorder_segment): row i continues row
// parent[i], in the slots the runner's reorder gives them (cache_slots_cpu.cpp); `dropped`: sentences left.
void follow_rows(RunnerRows& r, const std::vector<int64_t>& parent, int64_t length, bool dropped) {
  std::vector<int64_t> parent_slot(parent.size());
  for (size_t i = 0; i < parent.size(); ++i) parent_slot[i] = r.slot[parent[i]];
  r.slot = follow_parent_slots(r.caches, parent_slot, length);
  if (compacts(r.caches[0].size(1), static_cast<int64_t>(r.slot.size()), kCompactAboveSlots))
    regather_slots(r.caches, r.slot, r.caches[0].size(3), length);
  if (dropped) r.row_sentence = r.row_sentence.index_select(0, at::tensor(parent, r.row_sentence.options()));
}

// The engine's loop under the batch planner (Engine.run with BatchPlanner), compiled: the batch's one cohort
// stepped until every sentence ended, the policy choosing.
void run(SearchPolicy& policy, const LoopModels& m, const SearchRules& rules, int64_t longest) {
  const int64_t S = static_cast<int64_t>(rules.max_lens.size());
  RunnerRows rows;
  start_rows(rows, m, S, policy.rows_per_sentence(), longest);
  for (int64_t step = 0; policy.running() > 0; ++step) {
    if (step > 0) check_signals();
    const std::vector<Tensor> logits = policy.scored_rows(step_model(m, rows, policy.last_tokens(step), step), step);
    const std::vector<Tensor> out = output_layer(logits, policy, rules, step);
    const int64_t running = policy.running();
    const std::vector<int64_t> ending = policy.select(out, step);
    if (static_cast<int64_t>(ending.size()) == running) break;
    const auto parent = policy.next_beam(ending, step);
    if (parent) follow_rows(rows, *parent, step + 1, !ending.empty());
  }
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
  const SearchRules rules{bos, min_len, pad, eos, unk, unk_penalty, temperature, max_lens};
  const auto policy = greedy_policy(rules, models[0].embed.options());
  run(*policy, LoopModels{models, enc_keys, enc_values, masks}, rules, longest);
  return policy->results();
}

std::vector<Tensor> beam_decode(const std::vector<LeanDecoderModel>& models,
                                const std::vector<std::vector<Tensor>>& enc_keys,
                                const std::vector<std::vector<Tensor>>& enc_values,
                                const std::vector<std::optional<Tensor>>& masks, int64_t k, int64_t n, int64_t bos,
                                const std::vector<int64_t>& max_lens, int64_t min_len, int64_t pad, int64_t eos,
                                int64_t unk, double unk_penalty, double temperature) {
  const int64_t longest =
      check_batch("beam_decode", models.size(), enc_keys.size(), enc_values.size(), masks.size(), max_lens);
  const SearchRules rules{bos, min_len, pad, eos, unk, unk_penalty, temperature, max_lens};
  const auto policy = fairseq_beam_policy(rules, k, n, longest, models[0].embed.options());
  run(*policy, LoopModels{models, enc_keys, enc_values, masks}, rules, longest);
  return policy->results();
}
