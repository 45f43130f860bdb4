// The search policies of the compiled loop (search_policy_cpu.cpp): what search_loop_cpu.cpp's one driver
// asks of a search at each step, as the Python engine asks the decoder's policy and bookkeeping
// (search/policies.py: the selection; cohort_steps.py:BeamBookkeeping.update: the finalizer, the next beam). fairseq's Search.step and
// CTranslate2's SearchStrategy have this shape: the loop owns the model and the rows, the policy the choice.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <vector>

// fairseq's step rules the output layer applies, and the batch's lengths (decoder.py's settings).
struct SearchRules {
  int64_t bos, min_len, pad, eos, unk;
  double unk_penalty, temperature;
  std::vector<int64_t> max_lens;  // each sentence's maximum length (lengths.max_lengths)
};

class SearchPolicy {
 public:
  virtual ~SearchPolicy() = default;
  // Decoder rows a sentence opens with (Cohort: k slots, or 1 for greedy).
  virtual int64_t rows_per_sentence() const = 0;
  // Sentences still running (Cohort.size).
  virtual int64_t running() const = 0;
  // The last token of every row the step runs (BeamDecoder.advance: Cohort.tokens[:, step]).
  virtual at::Tensor last_tokens(int64_t step) const = 0;
  // The rows of `logits` the selection reads: at step 0 a beam reads each sentence's first row, all of
  // whose rows hold the start (candidates.py).
  virtual std::vector<at::Tensor> scored_rows(std::vector<at::Tensor> logits, int64_t step) const = 0;
  // Candidates the output layer keeps a row (the decoder's candidates_per_row).
  virtual int64_t candidates() const = 0;
  // Of the `rows` scored, those at their sentence's maximum length, where EOS is forced (candidates.py's
  // force_eos); none where no row is.
  virtual std::optional<at::Tensor> forced_eos(int64_t rows, int64_t step) const = 0;
  // The search step over the output layer's [log-probabilities, words] and what the finalizer keeps of it
  // (search/selection.py:fairseq_step, finalize.py:FairseqFinalizer.after_step; greedy: the argmax):
  // the sentences that end, in order.
  virtual std::vector<int64_t> select(const std::vector<at::Tensor>& out, int64_t step) = 0;
  // The next beam (cohort_steps.next_beam): the histories follow the selection and the ended sentences
  // leave. Returns each new row's parent row, for the runner's rows to follow, or none where every row
  // continues itself (greedy, no sentence ended).
  virtual std::optional<std::vector<int64_t>> next_beam(const std::vector<int64_t>& ending, int64_t step) = 0;
  // What the loop returns (see search_loop_cpu.h).
  virtual std::vector<at::Tensor> results() const = 0;
};

// Greedy search: each row's best word until EOS.
std::unique_ptr<SearchPolicy> greedy_policy(const SearchRules& rules, const at::TensorOptions& options);

// Fixed-width beam search of k slots, n candidates a row, with fairseq's finalization (beam_step_cpu.cpp's
// fairseq_select, the one CPU selection the Python loop runs too).
std::unique_ptr<SearchPolicy> fairseq_beam_policy(const SearchRules& rules, int64_t k, int64_t n, int64_t longest,
                                                  const at::TensorOptions& options);
