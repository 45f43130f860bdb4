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
// The positions go in chunks of the block's threads, a thread a position (its key read in 16-byte words where the
// layout allows), with the softmax's running maximum and sum (the online softmax: each chunk rescales what the
// earlier ones summed; the block's maximum and sum by warp shuffles); then the threads, in groups of head_dim,
// each own one output dimension over every groups-th position, the groups' sums added in order at the end.
// Accumulation is in float (double for double); the sums' order differs from torch's bmm and softmax, so the
// results agree with the torch form to rounding (tests/test_indexed_attention.py).

#include "indexed_attention_cuda.h"

#include "accumulate.h"
#include "words.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fairseq_stream {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <typename acc_t>
__device__ __forceinline__ acc_t larger(acc_t a, acc_t b) {
  return a > b ? a : b;
}

// The block's maximum or sum of each thread's `value` (every thread gets it): within each warp by shuffles, then
// across the warps in order through `buffer` (kWarps entries); two barriers, where a tree in shared memory takes
// eight. The order of the additions is fixed, so a row's result does not depend on anything but its inputs.
template <typename acc_t, bool kMax>
__device__ acc_t block_reduce(acc_t value, acc_t* buffer) {
  for (int lanes = 16; lanes > 0; lanes >>= 1) {
    const acc_t other = __shfl_xor_sync(0xffffffffu, value, lanes);
    value = kMax ? larger(value, other) : value + other;
  }
  if (threadIdx.x % 32 == 0) buffer[threadIdx.x / 32] = value;
  __syncthreads();
  acc_t result = buffer[0];
  for (int w = 1; w < kWarps; ++w) result = kMax ? larger(result, buffer[w]) : result + buffer[w];
  __syncthreads();  // buffer is reused by the next reduction
  return result;
}

// q . key over head_dim entries, in order (the same sum whichever way the key is read): in 16-byte words where
// `wide` (the row's bytes a multiple of 16 and the keys aligned to them), else one entry at a time.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t dot_with_query(const acc_t* query, const scalar_t* key, int64_t hd, bool wide) {
  acc_t dot = 0;
  if (wide) {
    constexpr int kPerWord = static_cast<int>(16 / sizeof(scalar_t));
    for (int64_t d = 0; d < hd; d += kPerWord) {
      const Word16 word = *reinterpret_cast<const Word16*>(key + d);  // one 16-byte load
      scalar_t part[kPerWord];
      memcpy(part, &word, 16);
      for (int i = 0; i < kPerWord; ++i) dot += query[d + i] * to_acc(part[i]);
    }
  } else {
    for (int64_t d = 0; d < hd; ++d) dot += query[d] * to_acc(key[d]);
  }
  return dot;
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
  __shared__ acc_t partial[kThreads];
  __shared__ acc_t reduce_buffer[kWarps];
  const int t = threadIdx.x;
  const int64_t r = static_cast<int64_t>(blockIdx.x) / a.heads, h = static_cast<int64_t>(blockIdx.x) % a.heads;
  const int64_t slot = a.index[r];
  const int64_t visible = a.lengths ? (a.lengths[r] + 1 < a.T ? a.lengths[r] + 1 : a.T) : a.T;
  const scalar_t* keys = a.keys + (slot * a.heads + h) * a.T * a.hd;
  const scalar_t* values = a.values + (slot * a.heads + h) * a.T * a.hd;
  const scalar_t* mask = a.mask ? a.mask + slot * a.T : nullptr;
  const acc_t scale = static_cast<acc_t>(a.scale);
  const acc_t minus_inf = -static_cast<acc_t>(INFINITY);
  const bool wide = (a.hd * static_cast<int64_t>(sizeof(scalar_t))) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(a.keys) % 16 == 0;
  // The weighted sum of values: the threads in `groups` groups of head_dim, group g taking positions g, g +
  // groups, ... of each chunk (one group of 64 threads would leave three quarters of the block idle at WMT'19's
  // head_dim); their partial sums are added in group order at the end.
  const int64_t groups = kThreads / a.hd, group = t / a.hd, dim = t % a.hd;
  for (int64_t d = t; d < a.hd; d += kThreads) query[d] = to_acc(a.q[r * a.q_row_stride + h * a.hd + d]);
  __syncthreads();
  acc_t running_max = minus_inf, running_sum = 0, out = 0;
  for (int64_t start = 0; start < visible; start += kThreads) {
    const int64_t p = start + t;
    acc_t score = minus_inf;
    if (p < visible) {
      score = dot_with_query(query, keys + p * a.hd, a.hd, wide) * scale;
      if (mask) score += to_acc(mask[p]);
    }
    const acc_t chunk_max = block_reduce<acc_t, true>(score, reduce_buffer);
    const acc_t new_max = larger(running_max, chunk_max);
    const acc_t e = score == minus_inf ? acc_t(0) : static_cast<acc_t>(exp(score - new_max));
    weight[t] = e;
    const acc_t chunk_sum = block_reduce<acc_t, false>(e, reduce_buffer);  // its barriers publish weight too
    const acc_t carry = running_max == minus_inf ? acc_t(0) : static_cast<acc_t>(exp(running_max - new_max));
    running_sum = running_sum * carry + chunk_sum;
    if (group < groups) {
      const int64_t n = visible - start < kThreads ? visible - start : kThreads;
      acc_t part = 0;
      for (int64_t j = group; j < n; j += groups) part += weight[j] * to_acc(values[(start + j) * a.hd + dim]);
      out = out * carry + part;
    }
    running_max = new_max;
    __syncthreads();  // weight is rewritten by the next chunk
  }
  partial[t] = out;
  __syncthreads();
  if (t < a.hd) {
    acc_t total = 0;
    for (int64_t g = 0; g < groups; ++g) total += partial[g * a.hd + t];
    const acc_t result = running_sum > 0 ? total / running_sum : static_cast<acc_t>(NAN);
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
