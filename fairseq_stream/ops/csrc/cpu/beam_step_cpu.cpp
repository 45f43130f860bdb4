// One search step of fixed-width beam search with fairseq's finalization, in one call: the
// selection of fairseq_stream/search/selection.py:select_fairseq with no pruning, and the
// bookkeeping BeamDecoder.update does after it (finalized counts and lengths, which sentences
// end, the best finished score, the step's summary for the host). The Python functions are the
// reference; fairseq_stream/ops/beam_step.py documents the op and tests/test_beam_step.py
// compares the two on real decoding.
//
// Why: one sentence at a time, the step above is about 40 small torch ops, and on one CPU thread
// their dispatch costs more than their arithmetic (docs/BENCHMARKS.md, issue 14). Here the (S, 2k)
// candidates are a few hundred numbers walked in plain loops.
//
// The one ranking with possible ties, the best 2k candidates of each sentence, is at::topk itself,
// so that equal scores come out in torch.topk's order, as in the reference. The rest is exact:
// comparisons, copies and integer counts, no floating-point arithmetic but a max.
//
// reorder_beam_ is the in-place move of the token and score histories to the next beam (the
// update's step when no sentence ends), for any search.

#include "beam_step_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace {

using torch::Tensor;

template <typename scalar_t>
void select_loop(const Tensor& top_scores, const Tensor& top_idx, const std::optional<Tensor>& word_of,
                 int64_t per_slot, int64_t k, int64_t eos, int64_t step, const Tensor& done_len,
                 const Tensor& best_finished, const Tensor& max_lens, const Tensor& empty, const Tensor& ids,
                 std::vector<Tensor>& out) {
  const int64_t S = top_scores.size(0), n = top_scores.size(1);
  auto ts = top_scores.accessor<scalar_t, 2>();
  auto ti = top_idx.accessor<int64_t, 2>();
  auto dl = done_len.accessor<int64_t, 2>();
  auto bf = best_finished.accessor<scalar_t, 1>();
  auto ml = max_lens.accessor<int64_t, 1>();
  auto em = empty.accessor<bool, 1>();
  auto id = ids.accessor<int64_t, 1>();
  std::optional<at::TensorAccessor<int64_t, 2>> wo;
  if (word_of) wo.emplace(word_of->accessor<int64_t, 2>());

  auto parent = out[0].accessor<int64_t, 2>();
  auto token = out[1].accessor<int64_t, 2>();
  auto score = out[2].accessor<scalar_t, 2>();
  auto live = out[3].accessor<bool, 2>();
  auto eos_mask = out[4].accessor<bool, 2>();
  auto top_slot = out[5].accessor<int64_t, 2>();
  auto top_score = out[6].accessor<scalar_t, 2>();
  auto new_done_len = out[7].accessor<int64_t, 2>();
  auto new_best = out[8].accessor<scalar_t, 1>();
  auto finished_now = out[9].accessor<bool, 1>();
  auto summary = out[10].accessor<int64_t, 1>();
  auto flat_parent = out[11].accessor<int64_t, 1>();
  auto emptied = out[12].accessor<bool, 1>();

  std::vector<int64_t> words(n), beams(n);
  std::vector<char> is_eos(n);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t c = 0; c < n; ++c) {
      const int64_t idx = ti[s][c];
      beams[c] = idx / per_slot;
      words[c] = wo ? (*wo)[s][idx] : idx % per_slot;
      // select_fairseq: words.eq(eos) & isfinite(top_scores); keep = isfinite (no pruning).
      is_eos[c] = words[c] == eos && std::isfinite(static_cast<double>(ts[s][c]));
    }
    // The best k candidates of this rank: finalized where they end in EOS.
    int64_t n_final = 0;
    scalar_t best = -std::numeric_limits<scalar_t>::infinity();
    for (int64_t c = 0; c < k; ++c) {
      eos_mask[s][c] = is_eos[c];
      top_slot[s][c] = beams[c];
      top_score[s][c] = ts[s][c];
      if (is_eos[c]) {
        ++n_final;
        best = std::max(best, ts[s][c]);
      }
    }
    // The next beam: the best k candidates not ending in EOS, then (too few of those) the EOS
    // ones, each group by rank (the reference's topk of is_eos * n + rank, smallest first).
    int64_t j = 0;
    bool any_live = false;
    for (int pass = 0; pass < 2 && j < k; ++pass) {
      for (int64_t c = 0; c < n && j < k; ++c) {
        if (static_cast<bool>(is_eos[c]) != (pass == 1)) continue;
        parent[s][j] = beams[c];
        flat_parent[s * k + j] = s * k + beams[c];
        token[s][j] = words[c];
        score[s][j] = ts[s][c];
        const bool l = !is_eos[c] && std::isfinite(static_cast<double>(ts[s][c]));
        live[s][j] = l;
        any_live = any_live || l;
        ++j;
      }
    }
    // done_len counts the finalized hypotheses: slots [had, now) get this step's length.
    int64_t had = 0;
    for (int64_t c = 0; c < k; ++c) had += dl[s][c] > 0;
    const int64_t now = std::min(had + n_final, k);
    for (int64_t c = 0; c < k; ++c) new_done_len[s][c] = (c >= had && c < now) ? step + 1 : dl[s][c];
    emptied[s] = !any_live;
    new_best[s] = std::max(bf[s], best);
    const bool finished = !any_live || now >= k || ml[s] <= step;
    finished_now[s] = finished || em[s];
    summary[s] = static_cast<int64_t>(finished_now[s]) + 2 * static_cast<int64_t>(em[s]);
    summary[S + s] = id[s];
    summary[2 * S + s] = n_final;
  }
}

// Returns [parent, token, score, live, eos_mask, top_slot, top_score (all (S, k)), done_len (S, k),
// best_finished (S,), finished_now (S,), summary (3S,), flat_parent (S*k,), no_live (S,), and an (S, k)
// bool of zeros (the Step's done and fresh, which fairseq's rule leaves empty)].
std::vector<Tensor> fairseq_select(const Tensor& cand, const std::optional<Tensor>& word_of, int64_t per_slot,
                                   int64_t k, int64_t eos, int64_t step, const Tensor& done_len,
                                   const Tensor& best_finished, const Tensor& max_lens, const Tensor& empty,
                                   const Tensor& ids) {
  TORCH_CHECK(cand.dim() == 2 && cand.device().is_cpu(), "fairseq_select: cand must be a 2-d CPU tensor");
  TORCH_CHECK(cand.scalar_type() == at::kFloat || cand.scalar_type() == at::kDouble,
              "fairseq_select: cand must be float32 or float64");
  TORCH_CHECK(best_finished.scalar_type() == cand.scalar_type(), "fairseq_select: best_finished dtype");
  TORCH_CHECK(done_len.scalar_type() == at::kLong && max_lens.scalar_type() == at::kLong &&
                  ids.scalar_type() == at::kLong && empty.scalar_type() == at::kBool,
              "fairseq_select: done_len, max_lens, ids must be int64 and empty bool");
  const int64_t S = cand.size(0), W = cand.size(1);
  TORCH_CHECK(done_len.dim() == 2 && done_len.size(0) == S && done_len.size(1) == k,
              "fairseq_select: done_len must be (S, k)");
  if (word_of) {
    TORCH_CHECK(word_of->sizes() == cand.sizes() && word_of->scalar_type() == at::kLong,
                "fairseq_select: word_of must be int64 and shaped as cand");
  }
  // fairseq's bound (size - 1) on whole-vocabulary candidates; pre-selected ones are all usable.
  const int64_t n = std::min(2 * k, W - (word_of ? 0 : 1));
  TORCH_CHECK(n >= k && per_slot > 0, "fairseq_select: fewer candidates than the beam");

  auto top = at::topk(cand, n, 1, /*largest=*/true, /*sorted=*/true);
  const Tensor top_scores = std::get<0>(top), top_idx = std::get<1>(top);
  auto lng = cand.options().dtype(at::kLong);
  auto bol = cand.options().dtype(at::kBool);
  std::vector<Tensor> out = {
      at::empty({S, k}, lng), at::empty({S, k}, lng), at::empty({S, k}, cand.options()), at::empty({S, k}, bol),
      at::empty({S, k}, bol), at::empty({S, k}, lng), at::empty({S, k}, cand.options()), at::empty({S, k}, lng),
      at::empty({S}, cand.options()), at::empty({S}, bol), at::empty({3 * S}, lng), at::empty({S * k}, lng),
      at::empty({S}, bol), at::zeros({S, k}, bol)};
  AT_DISPATCH_FLOATING_TYPES(cand.scalar_type(), "fairseq_select", [&] {
    select_loop<scalar_t>(top_scores, top_idx, word_of, per_slot, k, eos, step, done_len, best_finished, max_lens,
                          empty, ids, out);
  });
  return out;
}

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

void reorder_beam(Tensor tokens, Tensor scores, const Tensor& flat_parent, const Tensor& extended,
                  const Tensor& new_token, const Tensor& new_score, int64_t step) {
  TORCH_CHECK(tokens.device().is_cpu() && tokens.scalar_type() == at::kLong && tokens.dim() == 2,
              "reorder_beam_: tokens must be a 2-d int64 CPU tensor");
  TORCH_CHECK(scores.dim() == 2 && scores.size(0) == tokens.size(0) && new_score.scalar_type() == scores.scalar_type(),
              "reorder_beam_: scores must be (rows, width) of new_score's dtype");
  TORCH_CHECK(tokens.size(1) > step + 1 && scores.size(1) > step, "reorder_beam_: step beyond the histories");
  const int64_t R = tokens.size(0);
  TORCH_CHECK(flat_parent.numel() == R && extended.numel() == R && new_token.numel() == R && new_score.numel() == R,
              "reorder_beam_: one parent, flag, token and score per row");
  TORCH_CHECK(extended.scalar_type() == at::kBool && flat_parent.scalar_type() == at::kLong &&
                  new_token.scalar_type() == at::kLong,
              "reorder_beam_: flat_parent and new_token int64, extended bool");
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "reorder_beam_", [&] {
    reorder_loop<scalar_t>(tokens, scores, flat_parent.reshape(-1), extended.reshape(-1), new_token.reshape(-1),
                           new_score.reshape(-1), step);
  });
}

}  // namespace

void register_beam_step(pybind11::module& m) {
  m.def("fairseq_select", &fairseq_select,
        "(cand (S, W), word_of (S, W) or None, per_slot, k, eos, step, done_len (S, k), best_finished (S,), "
        "max_lens (S,), empty (S,), ids (S,)) -> [parent, token, score, live, eos_mask, top_slot, top_score, "
        "done_len, best_finished, finished_now, summary, flat_parent, no_live, zeros]; see fairseq_stream/ops/beam_step.py",
        pybind11::arg("cand"), pybind11::arg("word_of"), pybind11::arg("per_slot"), pybind11::arg("k"),
        pybind11::arg("eos"), pybind11::arg("step"), pybind11::arg("done_len"), pybind11::arg("best_finished"),
        pybind11::arg("max_lens"), pybind11::arg("empty"), pybind11::arg("ids"));
  m.def("reorder_beam_", &reorder_beam,
        "(tokens (R, L) int64, scores (R, L') float, flat_parent (R,), extended (R,) bool, new_token (R,), "
        "new_score (R,), step): in place, rows take their parent's history and, where extended, the new "
        "token and score; see fairseq_stream/ops/beam_step.py",
        pybind11::arg("tokens"), pybind11::arg("scores"), pybind11::arg("flat_parent"), pybind11::arg("extended"),
        pybind11::arg("new_token"), pybind11::arg("new_score"), pybind11::arg("step"));
}
