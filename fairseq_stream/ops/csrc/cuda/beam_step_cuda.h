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
  int64_t *words, *beams;
  char *is_eos, *keep, *carried;
  scalar_t *score, *local_scratch;
};

// Launches the step's kernel on stream (a thread per sentence); the launch's error.
template <typename scalar_t>
cudaError_t fairseq_select_launch(const FairseqSelectArgs<scalar_t>& a, cudaStream_t stream);

}  // namespace fairseq_stream
