// The compiled search step with fairseq's finalization on CUDA (beam_step_cuda.cu): plain CUDA, no
// ATen, so that the kernel also compiles against the host emulation of ../cuda_emu for the tests.
// beam_step_cuda_binding.cpp is the binding; fairseq_stream/ops/beam_step.py documents the op.
#pragma once

#include <cuda_runtime.h>

#include "../beam_select_row.h"

namespace fairseq_stream {

// One step over S sentences: their n best candidates (row-major (S, n), from at::topk on the device),
// the per-sentence inputs, the outputs (SelectOut: contiguous, the summary's last entry zeroed), and
// scratch of (S, n) entries per array.
template <typename scalar_t>
struct FairseqSelectArgs {
  SelectShape shape;
  const scalar_t* top_score;
  const int64_t* top_idx;
  const int64_t* word_of;  // (S, word_width) or null
  int64_t word_width;
  const scalar_t* local;  // (S, local_width) or null
  int64_t local_width;
  const int64_t* done_len;  // (S, k)
  const scalar_t* best_finished;
  const int64_t* max_lens;
  const bool* empty;
  const int64_t* ids;
  SelectOut<scalar_t> out;
  SelectScratch<scalar_t> scratch;  // S * n entries per array
};

// Launches the step's kernel on stream (a thread per sentence); the launch's error.
template <typename scalar_t>
cudaError_t fairseq_select_launch(const FairseqSelectArgs<scalar_t>& a, cudaStream_t stream);

// The stay rule's step over S sentences: their k best (row-major (S, k), from at::topk over the
// expansions and the finished entries), the per-sentence inputs, the outputs (StayOut: contiguous, the
// summary's last entry zeroed), and scratch of (S, k) entries per array.
template <typename scalar_t>
struct StaySelectArgs {
  StayShape shape;
  const scalar_t* top_score;
  const int64_t* top_idx;
  const int64_t* word_of;  // (S, W) or null
  const scalar_t* local;   // (S, W) or null
  const int64_t* done_len;  // (S, k)
  const bool* empty;
  const int64_t* ids;
  StayOut<scalar_t> out;
  SelectScratch<scalar_t> scratch;  // S * k entries per array
};

template <typename scalar_t>
cudaError_t stay_select_launch(const StaySelectArgs<scalar_t>& a, cudaStream_t stream);

// The finished entries' cumulative scores, (S, k), from done_len (S, k) and the (S * k, width) history.
template <typename scalar_t>
cudaError_t stay_done_scores_launch(int64_t S, int64_t k, const int64_t* done_len, const scalar_t* scores,
                                    int64_t width, scalar_t* done_scores, cudaStream_t stream);

// reorder_beam_ on CUDA: rows take their parent's token history [0, step] and score history [0, step)
// (rows move among themselves: all read into the buffers first, then all write back) and, where extended,
// token step + 1 and score step become the new ones. Histories row-major with row strides given.
template <typename scalar_t>
struct ReorderArgs {
  int64_t R, step;
  int64_t* tokens;
  int64_t token_stride;
  scalar_t* scores;
  int64_t score_stride;
  const int64_t* flat_parent;
  const bool* extended;
  const int64_t* new_token;
  const scalar_t* new_score;
  int64_t* token_buffer;   // (R, step + 1)
  scalar_t* score_buffer;  // (R, step)
};

// Two launches, a thread per row: the read, then the write.
template <typename scalar_t>
cudaError_t reorder_beam_launch(const ReorderArgs<scalar_t>& a, cudaStream_t stream);

}  // namespace fairseq_stream
