// One sentence's search step, on raw arrays, under fairseq's finalization (fairseq_select_row) or the
// streaming paper's (stay_select_row): the bodies of the compiled fairseq_select and stay_select of
// cpu/beam_step_cpu.cpp (a loop over sentences) and of cuda/beam_step_cuda.cu (a thread per
// sentence). fairseq_stream/ops/beam_step.py documents the ops; the torch code of
// fairseq_stream/search/selection.py (fairseq_step, stay_step) is the reference both equal.
//
// Plain C++17 without the standard library's math in device code, so that nvcc compiles it for the
// device: the pruning's logarithms come from the host (prune_options), and finiteness is tested by
// arithmetic.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define FS_HOST_DEVICE __host__ __device__
#else
#define FS_HOST_DEVICE
#endif

namespace fairseq_stream {

// Freitag & Al-Onaizan's heuristics (search/pruning.py: Pruning.keep); a negative value is "off".
// log_rp and log_rpl are std::log(rp) and std::log(rpl), computed on the host.
struct PruneOptions {
  double rp = -1, ap = -1, rpl = -1, log_rp = 0, log_rpl = 0;
  int64_t mc = -1;
  FS_HOST_DEVICE bool active() const { return rp >= 0 || ap >= 0 || rpl >= 0 || mc >= 0; }
};

// The options as the ops take them (a negative value: off), the logarithms taken here, on the host.
inline PruneOptions prune_options(double rp, double ap, double rpl, int64_t mc) {
  PruneOptions o;
  o.rp = rp;
  o.ap = ap;
  o.rpl = rpl;
  o.mc = mc;
  o.log_rp = rp >= 0 ? std::log(rp) : 0;
  o.log_rpl = rpl >= 0 ? std::log(rpl) : 0;
  return o;
}

// x - x is 0 for a finite x, NaN for an infinity or a NaN (std::isfinite, without <cmath> on the device).
template <typename scalar_t>
FS_HOST_DEVICE inline bool finite(scalar_t x) {
  return x - x == scalar_t(0);
}

template <typename T>
FS_HOST_DEVICE inline T larger(T a, T b) {
  return a < b ? b : a;
}

template <typename scalar_t>
FS_HOST_DEVICE inline scalar_t minus_infinity() {
  return -scalar_t(1) / scalar_t(0);
}

// Which of one sentence's n candidates (sorted best first) survive: Pruning.keep, row by row.
template <typename scalar_t>
FS_HOST_DEVICE void keep_row(const scalar_t* score, const scalar_t* local, const int64_t* parent,
                             const char* carried, int64_t n, scalar_t best_finished, const PruneOptions& o,
                             char* keep) {
  for (int64_t c = 0; c < n; ++c) keep[c] = finite(score[c]);
  if (!o.active() || n == 0) return;
  const scalar_t best = larger(score[0], best_finished);
  if (o.rp >= 0) {
    const scalar_t bound = best + static_cast<scalar_t>(o.log_rp);
    for (int64_t c = 0; c < n; ++c) keep[c] = keep[c] && score[c] >= bound;
  }
  if (o.ap >= 0) {
    const scalar_t bound = best - static_cast<scalar_t>(o.ap);
    for (int64_t c = 0; c < n; ++c) keep[c] = keep[c] && score[c] >= bound;
  }
  if (o.rpl >= 0) {
    scalar_t best_local = minus_infinity<scalar_t>();
    for (int64_t c = 0; c < n; ++c) {
      if (!carried[c] && finite(score[c])) best_local = larger(best_local, local[c]);
    }
    const scalar_t bound = best_local + static_cast<scalar_t>(o.log_rpl);
    for (int64_t c = 0; c < n; ++c) keep[c] = keep[c] && (carried[c] || local[c] >= bound);
  }
  if (o.mc >= 0) {
    // Rank among the earlier eligible candidates extending the same slot (parents clamped at 0).
    for (int64_t c = 0; c < n; ++c) {
      const bool eligible = !carried[c] && finite(score[c]);
      if (!eligible) continue;
      int64_t rank = 0;
      for (int64_t e = 0; e < c; ++e) {
        rank += !carried[e] && finite(score[e]) && larger<int64_t>(parent[e], 0) == larger<int64_t>(parent[c], 0);
      }
      keep[c] = keep[c] && rank < o.mc;
    }
  }
}

// Sentence s's inputs: its n best candidates (scores and flat indices, best first), the candidates'
// words where pre-selected (word_of's row, else null) and local scores (local's row, else null), its
// finalized lengths (k), best finished score, maximum length, whether its source is empty, its id.
template <typename scalar_t>
struct SelectRowIn {
  const scalar_t* top_score;
  const int64_t* top_idx;
  const int64_t* word_of;
  const scalar_t* local;
  const int64_t* done_len;
  scalar_t best_finished;
  int64_t max_len, id;
  bool empty;
};

// The step's shape and rules, the same for every sentence.
struct SelectShape {
  int64_t S, n, k, per_slot, eos, step;
  PruneOptions prune;
};

// The outputs, whole tensors (contiguous): sentence s writes row s of each (S, k) one, entry s of the (S,)
// ones, its summary entries and its k flat parents.
template <typename scalar_t>
struct SelectOut {
  int64_t *parent, *token;
  scalar_t* score;
  bool *live, *eos_mask;
  int64_t* top_slot;
  scalar_t* top_score;
  int64_t* done_len;
  scalar_t* best_finished;
  bool* finished_now;
  int64_t *summary, *flat_parent;
  bool* no_live;
};

// Scratch of n entries each, the sentence's own.
template <typename scalar_t>
struct SelectScratch {
  int64_t *words, *beams;
  char *is_eos, *keep, *carried;
  scalar_t *score, *local;
};

// Scratch of `cells` entries per array, carved from runs of 2 * cells int64, 3 * cells chars and 2 * cells scores.
template <typename scalar_t>
FS_HOST_DEVICE inline SelectScratch<scalar_t> carve_scratch(int64_t* longs, char* flags, scalar_t* values,
                                                             int64_t cells) {
  return {longs, longs + cells, flags, flags + cells, flags + 2 * cells, values, values + cells};
}

// The part of `w` from entry `offset` on: one sentence's.
template <typename scalar_t>
FS_HOST_DEVICE inline SelectScratch<scalar_t> scratch_at(const SelectScratch<scalar_t>& w, int64_t offset) {
  return {w.words + offset,   w.beams + offset, w.is_eos + offset, w.keep + offset,
          w.carried + offset, w.score + offset, w.local + offset};
}

// Sentence s's step; returns its live hypotheses left if it goes on (the summary's last entry sums them).
template <typename scalar_t>
FS_HOST_DEVICE int64_t fairseq_select_row(int64_t s, const SelectShape& sh, const SelectRowIn<scalar_t>& in,
                                          const SelectScratch<scalar_t>& w, const SelectOut<scalar_t>& out) {
  const int64_t n = sh.n, k = sh.k, S = sh.S;
  for (int64_t c = 0; c < n; ++c) {
    const int64_t idx = in.top_idx[c];
    w.beams[c] = idx / sh.per_slot;
    w.words[c] = in.word_of ? in.word_of[idx] : idx % sh.per_slot;
    // select_fairseq: words.eq(eos) & isfinite(top_scores)
    w.is_eos[c] = w.words[c] == sh.eos && finite(in.top_score[c]);
    w.score[c] = in.top_score[c];
    w.local[c] = in.local ? in.local[idx] : scalar_t(0);
    w.carried[c] = 0;
  }
  // Pruning sees no carried candidates here; the best finished score may be the best.
  keep_row<scalar_t>(w.score, w.local, w.beams, w.carried, n, in.best_finished, sh.prune, w.keep);
  // The best k candidates of this rank: finalized where they end in EOS.
  int64_t n_final = 0;
  scalar_t best = minus_infinity<scalar_t>();
  for (int64_t c = 0; c < k; ++c) {
    const bool finalized = w.is_eos[c] && w.keep[c];
    out.eos_mask[s * k + c] = finalized;
    out.top_slot[s * k + c] = w.beams[c];
    out.top_score[s * k + c] = in.top_score[c];
    if (finalized) {
      ++n_final;
      best = larger(best, in.top_score[c]);
    }
  }
  // The next beam: the best k candidates not ending in EOS, then (too few of those) the EOS
  // ones, each group by rank (the reference's topk of is_eos * n + rank, smallest first).
  int64_t j = 0;
  bool any_live = false;
  for (int pass = 0; pass < 2 && j < k; ++pass) {
    for (int64_t c = 0; c < n && j < k; ++c) {
      if (static_cast<bool>(w.is_eos[c]) != (pass == 1)) continue;
      out.parent[s * k + j] = w.beams[c];
      out.flat_parent[s * k + j] = s * k + w.beams[c];
      out.token[s * k + j] = w.words[c];
      out.score[s * k + j] = in.top_score[c];
      const bool l = w.keep[c] && !w.is_eos[c];
      out.live[s * k + j] = l;
      any_live = any_live || l;
      ++j;
    }
  }
  // done_len counts the finalized hypotheses: slots [had, now) get this step's length.
  int64_t had = 0;
  for (int64_t c = 0; c < k; ++c) had += in.done_len[c] > 0;
  const int64_t now = had + n_final < k ? had + n_final : k;
  for (int64_t c = 0; c < k; ++c) out.done_len[s * k + c] = (c >= had && c < now) ? sh.step + 1 : in.done_len[c];
  out.no_live[s] = !any_live;
  out.best_finished[s] = larger(in.best_finished, best);
  const bool finished = !any_live || now >= k || in.max_len <= sh.step;
  const bool ends = finished || in.empty;
  out.finished_now[s] = ends;
  out.summary[s] = static_cast<int64_t>(ends) + 2 * static_cast<int64_t>(in.empty);
  out.summary[S + s] = in.id;
  out.summary[2 * S + s] = n_final;
  int64_t live_left = 0;
  if (!ends) {
    for (int64_t c = 0; c < k; ++c) live_left += out.live[s * k + c];
  }
  return live_left;
}

// The streaming paper's rule ("stay": finished entries stay on the beam), sentence s of S: its k best
// of the expansions and the beam's finished entries (top_idx >= W: entry top_idx - W of the beam), and
// what the decoder tracks after it. Scratch: k entries each.
struct StayShape {
  int64_t S, k, W, per_slot, eos, pad, step;
  PruneOptions prune;
};

template <typename scalar_t>
struct StayRowIn {
  const scalar_t* top_score;
  const int64_t* top_idx;
  const int64_t* word_of;  // the row of word_of, or null
  const scalar_t* local;   // the row of local, or null
  const int64_t* done_len;  // (k,) the finished entries' lengths
  int64_t id;
  bool empty;
};

template <typename scalar_t>
struct StayOut {
  int64_t *parent, *token;
  scalar_t* score;
  bool *live, *done, *fresh, *no_live;
  int64_t* done_len;
  bool* finished_now;
  int64_t *summary, *flat_parent;
  bool* extended;
};

// Sentence s's step; returns its live hypotheses left if it goes on (the summary's last entry sums them).
template <typename scalar_t>
FS_HOST_DEVICE int64_t stay_select_row(int64_t s, const StayShape& sh, const StayRowIn<scalar_t>& in,
                                       const SelectScratch<scalar_t>& w, const StayOut<scalar_t>& out) {
  const int64_t k = sh.k, S = sh.S, W = sh.W;
  for (int64_t c = 0; c < k; ++c) {
    const int64_t idx = in.top_idx[c];
    w.carried[c] = idx >= W;  // a finished entry of the beam, carried over unchanged
    w.beams[c] = w.carried[c] ? idx - W : idx / sh.per_slot;
    const int64_t expansion = idx < W - 1 ? idx : W - 1;
    w.words[c] = w.carried[c] ? sh.pad : (in.word_of ? in.word_of[expansion] : expansion % sh.per_slot);
    w.score[c] = in.top_score[c];
    w.local[c] = w.carried[c] || !in.local ? scalar_t(0) : in.local[idx];
  }
  keep_row<scalar_t>(w.score, w.local, w.beams, w.carried, k, minus_infinity<scalar_t>(), sh.prune, w.keep);
  bool any_live = false;
  for (int64_t c = 0; c < k; ++c) {
    const bool f = w.keep[c] && !w.carried[c] && w.words[c] == sh.eos;
    const bool d = (w.keep[c] && w.carried[c]) || f;
    const bool l = w.keep[c] && !w.carried[c] && !f;
    out.parent[s * k + c] = w.beams[c];
    out.token[s * k + c] = w.words[c];
    out.score[s * k + c] = in.top_score[c];
    out.live[s * k + c] = l;
    out.done[s * k + c] = d;
    out.fresh[s * k + c] = f;
    any_live = any_live || l;
    // A finished entry keeps its length; a fresh one has this step's.
    out.done_len[s * k + c] = !d ? 0 : (f ? sh.step + 1 : in.done_len[w.beams[c]]);
    out.flat_parent[s * k + c] = s * k + w.beams[c];
    out.extended[s * k + c] = l || f;
  }
  out.no_live[s] = !any_live;
  const bool ends = !any_live || in.empty;
  out.finished_now[s] = ends;
  out.summary[s] = static_cast<int64_t>(ends) + 2 * static_cast<int64_t>(in.empty);
  out.summary[S + s] = in.id;
  int64_t live_left = 0;
  if (!ends) {
    for (int64_t c = 0; c < k; ++c) live_left += out.live[s * k + c];
  }
  return live_left;
}

// The beam's finished entries' cumulative scores for sentence s (-inf where slot j holds none): slot j's
// score at its length, from the (S * k, width) history of cumulative scores.
template <typename scalar_t>
FS_HOST_DEVICE void stay_done_scores_row(int64_t s, int64_t k, const int64_t* done_len, const scalar_t* scores,
                                         int64_t width, scalar_t* done_scores) {
  for (int64_t j = 0; j < k; ++j) {
    const int64_t len = done_len[s * k + j];
    done_scores[s * k + j] = len > 0 && len <= width ? scores[(s * k + j) * width + len - 1]
                                                     : minus_infinity<scalar_t>();
  }
}

}  // namespace fairseq_stream
