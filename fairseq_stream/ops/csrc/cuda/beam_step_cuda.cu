// fairseq_select on CUDA: a thread per sentence runs fairseq_select_row (../beam_select_row.h),
// the body the CPU op (../cpu/beam_step_cpu.cpp) runs in a loop, so both equal the torch reference
// (fairseq_stream/search/selection.py: fairseq_step) by the same code. The binding
// (beam_step_cuda_binding.cpp) takes each sentence's best candidates with at::topk first, so
// that equal scores come out in torch.topk's order on the device, as in the reference there.
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

}  // namespace

#ifndef FS_LAUNCH
#define FS_LAUNCH(kernel, grid, stream, ...) kernel<<<(grid), kThreads, 0, (stream)>>>(__VA_ARGS__)
#endif

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) fairseq_select_kernel(const FairseqSelectArgs<scalar_t> a) {
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
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
  const SelectScratch<scalar_t> w{a.words + s * n,   a.beams + s * n, a.is_eos + s * n,       a.keep + s * n,
                                  a.carried + s * n, a.score + s * n, a.local_scratch + s * n};
  const int64_t left = fairseq_select_row<scalar_t>(s, a.shape, in, w, a.out);
  if (left) {
    atomicAdd(reinterpret_cast<unsigned long long*>(a.out.summary + 3 * a.shape.S),
              static_cast<unsigned long long>(left));
  }
}

template <typename scalar_t>
cudaError_t fairseq_select_launch(const FairseqSelectArgs<scalar_t>& a, cudaStream_t stream) {
  if (a.shape.S <= 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((a.shape.S + kThreads - 1) / kThreads);
  FS_LAUNCH(fairseq_select_kernel<scalar_t>, dim3(blocks), stream, a);
  return cudaGetLastError();
}

template cudaError_t fairseq_select_launch<float>(const FairseqSelectArgs<float>&, cudaStream_t);
template cudaError_t fairseq_select_launch<double>(const FairseqSelectArgs<double>&, cudaStream_t);

}  // namespace fairseq_stream
