// indexed_attention on CUDA: a block per (row, head) reads its row's keys and values where they lie, in the
// static-slot runner's pool (the key/value slot of the row, or the encoder keys of its sentence slot), and
// attends with one query.
//
// Why: the torch form (fairseq_stream/runners/static_attention.py) gathers every row's keys and values into new
// tensors each layer and step before attending. At the WMT'19 size, 4 members stacked and 320 rows, that is about
// 7.7 GB moved a decoder call against 0.2 GB for the lean runner's packed attention (benchmarks/device_work.py,
// docs/GPU.md): the CUDA graphs of the static step lost to the eager lean runner on an H200 for it. Here each
// key and value is read once.
//
// The positions go in chunks of the block's threads, a thread a position, with the softmax's running maximum and
// sum (the online softmax: each chunk rescales what the earlier ones summed); each thread below head_dim then
// owns one output dimension. Accumulation is in float (double for double); the sums' order differs from torch's
// bmm and softmax, so the results agree with the torch form to rounding (tests/test_indexed_attention.py).

#include "indexed_attention_cuda.h"

#include "accumulate.h"

#include <cmath>

namespace fairseq_stream {

namespace {

constexpr int kThreads = 256;

template <typename acc_t>
__device__ __forceinline__ acc_t larger(acc_t a, acc_t b) {
  return a > b ? a : b;
}

// The block's maximum or sum of each thread's `value` (every thread gets it); `buffer` holds kThreads entries.
template <typename acc_t, bool kMax>
__device__ acc_t block_reduce(acc_t value, acc_t* buffer) {
  const int t = threadIdx.x;
  buffer[t] = value;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
    if (t < stride) buffer[t] = kMax ? larger(buffer[t], buffer[t + stride]) : buffer[t] + buffer[t + stride];
    __syncthreads();
  }
  const acc_t result = buffer[0];
  __syncthreads();  // buffer is reused by the next reduction
  return result;
}

}  // namespace

#ifndef FS_LAUNCH
#define FS_LAUNCH(kernel, grid, stream, ...) kernel<<<(grid), kThreads, 0, (stream)>>>(__VA_ARGS__)
#endif

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) indexed_attention_kernel(const IndexedAttentionArgs<scalar_t> a) {
  using acc_t = typename Acc<scalar_t>::type;
  __shared__ acc_t query[kIndexedAttentionMaxHeadDim];
  __shared__ acc_t weight[kThreads];
  __shared__ acc_t reduce_buffer[kThreads];
  const int t = threadIdx.x;
  const int64_t r = static_cast<int64_t>(blockIdx.x) / a.heads, h = static_cast<int64_t>(blockIdx.x) % a.heads;
  const int64_t slot = a.index[r];
  const int64_t visible = a.lengths ? (a.lengths[r] + 1 < a.T ? a.lengths[r] + 1 : a.T) : a.T;
  const scalar_t* keys = a.keys + (slot * a.heads + h) * a.T * a.hd;
  const scalar_t* values = a.values + (slot * a.heads + h) * a.T * a.hd;
  const scalar_t* mask = a.mask ? a.mask + slot * a.T : nullptr;
  const acc_t scale = static_cast<acc_t>(a.scale);
  const acc_t minus_inf = -static_cast<acc_t>(INFINITY);
  for (int64_t d = t; d < a.hd; d += kThreads) query[d] = to_acc(a.q[r * a.q_row_stride + h * a.hd + d]);
  __syncthreads();
  acc_t running_max = minus_inf, running_sum = 0, out = 0;
  for (int64_t start = 0; start < visible; start += kThreads) {
    const int64_t p = start + t;
    acc_t score = minus_inf;
    if (p < visible) {
      acc_t dot = 0;
      const scalar_t* key = keys + p * a.hd;
      for (int64_t d = 0; d < a.hd; ++d) dot += query[d] * to_acc(key[d]);
      score = dot * scale;
      if (mask) score += to_acc(mask[p]);
    }
    const acc_t chunk_max = block_reduce<acc_t, true>(score, reduce_buffer);
    const acc_t new_max = larger(running_max, chunk_max);
    const acc_t e = score == minus_inf ? acc_t(0) : static_cast<acc_t>(exp(score - new_max));
    weight[t] = e;
    const acc_t chunk_sum = block_reduce<acc_t, false>(e, reduce_buffer);  // its barriers publish weight too
    const acc_t carry = running_max == minus_inf ? acc_t(0) : static_cast<acc_t>(exp(running_max - new_max));
    running_sum = running_sum * carry + chunk_sum;
    if (t < a.hd) {
      const int64_t n = visible - start < kThreads ? visible - start : kThreads;
      acc_t part = 0;
      for (int64_t j = 0; j < n; ++j) part += weight[j] * to_acc(values[(start + j) * a.hd + t]);
      out = out * carry + part;
    }
    running_max = new_max;
    __syncthreads();  // weight is rewritten by the next chunk
  }
  if (t < a.hd) {
    const acc_t result = running_sum > 0 ? out / running_sum : static_cast<acc_t>(NAN);
    store_acc(a.out + (r * a.heads + h) * a.hd + t, result);
  }
}

template <typename scalar_t>
cudaError_t indexed_attention_launch(const IndexedAttentionArgs<scalar_t>& a, cudaStream_t stream) {
  if (a.rows <= 0 || a.heads <= 0) return cudaSuccess;
  if (a.hd > kIndexedAttentionMaxHeadDim || a.hd > kThreads) return cudaErrorInvalidValue;
  FS_LAUNCH(indexed_attention_kernel<scalar_t>, dim3(static_cast<unsigned>(a.rows * a.heads)), stream, a);
  return cudaGetLastError();
}

template cudaError_t indexed_attention_launch<float>(const IndexedAttentionArgs<float>&, cudaStream_t);
template cudaError_t indexed_attention_launch<double>(const IndexedAttentionArgs<double>&, cudaStream_t);
template cudaError_t indexed_attention_launch<__half>(const IndexedAttentionArgs<__half>&, cudaStream_t);
template cudaError_t indexed_attention_launch<__nv_bfloat16>(const IndexedAttentionArgs<__nv_bfloat16>&,
                                                             cudaStream_t);

}  // namespace fairseq_stream
