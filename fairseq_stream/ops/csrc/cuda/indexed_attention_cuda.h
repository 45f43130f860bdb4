// Attention of one query a row over cached keys and values that the row names by index (indexed_attention_cuda.cu):
// plain CUDA, no ATen, so that the kernel also compiles against the host emulation of ../cuda_emu for the tests.
// indexed_attention_cuda_binding.cpp is the binding; fairseq_stream/ops/attention.py documents the op.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fairseq_stream {

// Row r, head h: its query q[r, h*hd:(h+1)*hd] over keys[index[r], h, p, :] and values[index[r], h, p, :] for the
// positions p < T (and p <= lengths[r] where lengths is given), each score scale * q.k plus mask[index[r], p] where
// mask is given; the softmax over them; out[r, h*hd:(h+1)*hd] their weighted sum. A row whose positions are all
// -inf gets NaN, as torch's softmax gives. keys, values (slots, heads, T, hd) and out (rows, heads * hd) are
// contiguous; q's rows are q_row_stride apart, each contiguous.
template <typename scalar_t>
struct IndexedAttentionArgs {
  const scalar_t* q;
  int64_t q_row_stride;
  const scalar_t* keys;
  const scalar_t* values;
  const int64_t* index;    // (rows,)
  const scalar_t* mask;    // (slots, T) additive, or null
  const int64_t* lengths;  // (rows,), or null
  scalar_t* out;
  int64_t rows, heads, T, hd;
  double scale;
};

// The largest head_dim the kernel takes (a thread per output dimension).
constexpr int64_t kIndexedAttentionMaxHeadDim = 256;

// One launch, a block per (row, head); the launch's error.
template <typename scalar_t>
cudaError_t indexed_attention_launch(const IndexedAttentionArgs<scalar_t>& a, cudaStream_t stream);

}  // namespace fairseq_stream
