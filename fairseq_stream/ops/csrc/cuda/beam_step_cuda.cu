// fairseq_select and stay_select on CUDA: a thread per sentence runs fairseq_select_row or
// stay_select_row (../beam_select_row.h), the bodies the CPU ops (../cpu/beam_step_cpu.cpp) run in a
// loop, so both equal the torch reference (fairseq_stream/search/selection.py: fairseq_step,
// stay_step) by the same code. The binding
// (beam_step_cuda_binding.cpp) takes each sentence's best candidates with at::topk first, so
// that equal scores come out in torch.topk's order on the device, as in the reference there.
//
// reorder_beam_ too: two kernels (read every parent row, then write), where the torch code makes about
// eight (index_select, slice copies and where for each history).
//
// Why: on CUDA the torch reference is about 57 small kernels a step (fairseq's rules, top-k,
// pruning masks), each launched from the host; on an H200 the host's time per decoder call in
// CUDA graphs was 1.6-2 ms, most of it such launches outside the graph (docs/GPU.md). Here: the
// top-k, two fills and one kernel. A sentence's step is a few hundred numbers: one thread walks
// them as the CPU does; the kernel's work is small next to one launch.

#include "beam_step_cuda.h"

namespace fairseq_stream {

namespace {

constexpr int kThreads = 256;

// A thread per item (sentence or row): the grid that covers n items, and the item of this thread.
dim3 grid_for(int64_t n) { return dim3(static_cast<unsigned>((n + kThreads - 1) / kThreads)); }
__device__ __forceinline__ int64_t item_index() { return static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; }

}  // namespace

#ifndef FS_LAUNCH
#define FS_LAUNCH(kernel, grid, stream, ...) kernel<<<(grid), kThreads, 0, (stream)>>>(__VA_ARGS__)
#endif

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) fairseq_select_kernel(const FairseqSelectArgs<scalar_t> a) {
  const int64_t s = item_index();
  if (s >= a.shape.S) return;
  const int64_t n = a.shape.n, k = a.shape.k;
  const SelectRowIn<scalar_t> in{a.top_score + s * n,
                                 a.top_idx + s * n,
                                 a.word_of ? a.word_of + s * a.word_width : nullptr,
                                 a.local ? a.local + s * a.local_width : nullptr,
                                 a.done_len + s * k,
                                 a.best_finished[s],
                                 a.max_lens[s],
                                 a.ids[s],
                                 a.empty[s]};
  const int64_t left = fairseq_select_row<scalar_t>(s, a.shape, in, scratch_at(a.scratch, s * n), a.out);
  if (left) {
    atomicAdd(reinterpret_cast<unsigned long long*>(a.out.summary + 3 * a.shape.S),
              static_cast<unsigned long long>(left));
  }
}

template <typename scalar_t>
cudaError_t fairseq_select_launch(const FairseqSelectArgs<scalar_t>& a, cudaStream_t stream) {
  if (a.shape.S <= 0) return cudaSuccess;
  FS_LAUNCH(fairseq_select_kernel<scalar_t>, grid_for(a.shape.S), stream, a);
  return cudaGetLastError();
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) stay_select_kernel(const StaySelectArgs<scalar_t> a) {
  const int64_t s = item_index();
  if (s >= a.shape.S) return;
  const int64_t k = a.shape.k, W = a.shape.W;
  const StayRowIn<scalar_t> in{a.top_score + s * k,
                               a.top_idx + s * k,
                               a.word_of ? a.word_of + s * W : nullptr,
                               a.local ? a.local + s * W : nullptr,
                               a.done_len + s * k,
                               a.ids[s],
                               a.empty[s]};
  const int64_t left = stay_select_row<scalar_t>(s, a.shape, in, scratch_at(a.scratch, s * k), a.out);
  if (left) {
    atomicAdd(reinterpret_cast<unsigned long long*>(a.out.summary + 2 * a.shape.S),
              static_cast<unsigned long long>(left));
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    stay_done_scores_kernel(int64_t S, int64_t k, const int64_t* done_len, const scalar_t* scores, int64_t width,
                            scalar_t* done_scores) {
  const int64_t s = item_index();
  if (s < S) stay_done_scores_row<scalar_t>(s, k, done_len, scores, width, done_scores);
}

template <typename scalar_t>
cudaError_t stay_select_launch(const StaySelectArgs<scalar_t>& a, cudaStream_t stream) {
  if (a.shape.S <= 0) return cudaSuccess;
  FS_LAUNCH(stay_select_kernel<scalar_t>, grid_for(a.shape.S), stream, a);
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t stay_done_scores_launch(int64_t S, int64_t k, const int64_t* done_len, const scalar_t* scores,
                                    int64_t width, scalar_t* done_scores, cudaStream_t stream) {
  if (S <= 0) return cudaSuccess;
  FS_LAUNCH(stay_done_scores_kernel<scalar_t>, grid_for(S), stream, S, k, done_len, scores, width, done_scores);
  return cudaGetLastError();
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) reorder_read_kernel(const ReorderArgs<scalar_t> a) {
  const int64_t r = item_index();
  if (r >= a.R) return;
  const int64_t p = a.flat_parent[r], tw = a.step + 1, sw = a.step;
  for (int64_t c = 0; c < tw; ++c) a.token_buffer[r * tw + c] = a.tokens[p * a.token_stride + c];
  for (int64_t c = 0; c < sw; ++c) a.score_buffer[r * sw + c] = a.scores[p * a.score_stride + c];
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) reorder_write_kernel(const ReorderArgs<scalar_t> a) {
  const int64_t r = item_index();
  if (r >= a.R) return;
  const int64_t tw = a.step + 1, sw = a.step;
  for (int64_t c = 0; c < tw; ++c) a.tokens[r * a.token_stride + c] = a.token_buffer[r * tw + c];
  for (int64_t c = 0; c < sw; ++c) a.scores[r * a.score_stride + c] = a.score_buffer[r * sw + c];
  if (a.extended[r]) {
    a.tokens[r * a.token_stride + a.step + 1] = a.new_token[r];
    a.scores[r * a.score_stride + a.step] = a.new_score[r];
  }
}

template <typename scalar_t>
cudaError_t reorder_beam_launch(const ReorderArgs<scalar_t>& a, cudaStream_t stream) {
  if (a.R <= 0) return cudaSuccess;
  FS_LAUNCH(reorder_read_kernel<scalar_t>, grid_for(a.R), stream, a);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  FS_LAUNCH(reorder_write_kernel<scalar_t>, grid_for(a.R), stream, a);
  return cudaGetLastError();
}

template cudaError_t fairseq_select_launch<float>(const FairseqSelectArgs<float>&, cudaStream_t);
template cudaError_t fairseq_select_launch<double>(const FairseqSelectArgs<double>&, cudaStream_t);
template cudaError_t stay_select_launch<float>(const StaySelectArgs<float>&, cudaStream_t);
template cudaError_t stay_select_launch<double>(const StaySelectArgs<double>&, cudaStream_t);
template cudaError_t stay_done_scores_launch<float>(int64_t, int64_t, const int64_t*, const float*, int64_t, float*,
                                                    cudaStream_t);
template cudaError_t stay_done_scores_launch<double>(int64_t, int64_t, const int64_t*, const double*, int64_t,
                                                     double*, cudaStream_t);
template cudaError_t reorder_beam_launch<float>(const ReorderArgs<float>&, cudaStream_t);
template cudaError_t reorder_beam_launch<double>(const ReorderArgs<double>&, cudaStream_t);

}  // namespace fairseq_stream
