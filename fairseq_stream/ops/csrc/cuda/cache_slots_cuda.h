// Copies between the self-attention caches' slots when a beam's rows move (cache_slots_cuda.cu): plain CUDA, no
// ATen, so that the kernel also compiles against the host emulation of ../cuda_emu for the tests.
// cache_slots_cuda_binding.cpp is the binding; fairseq_stream/ops/attention.py (copy_slots_) documents the op.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "words.h"

namespace fairseq_stream {

// The cache (outer, slots, heads, capacity, head_dim), contiguous, seen as words of the launch's type: entry e
// copies, for every outer index o and head h, the first `chunk_words` words of (o, source[e], h) onto
// (o, target[e], h), which lie `head_words` words apart. An entry whose source is its target copies nothing
// (the padded entries of a copy list of fixed length); targets are slots no source is.
struct CacheSlotsArgs {
  void* cache;
  const int64_t* source;  // (entries,)
  const int64_t* target;  // (entries,)
  int64_t entries, outer, slots, heads;
  int64_t head_words;   // capacity * head_dim, in words
  int64_t chunk_words;  // length * head_dim, in words
  int64_t blocks_y;     // blocks along y (cache_slots_blocks_y): block y takes pieces y, y + blocks_y, ...
};

// Blocks along y per entry at most: with a few hundred entries (a beam's moves at 64 sentences) enough blocks to
// keep a GPU's memory busy, each still copying several (o, h) pieces.
constexpr int64_t kCacheSlotsMaxBlocksY = 16;

// The blocks along y for entries of `pieces` (outer * heads) pieces each.
inline int64_t cache_slots_blocks_y(int64_t pieces) {
  return pieces < 1 ? 1 : (pieces < kCacheSlotsMaxBlocksY ? pieces : kCacheSlotsMaxBlocksY);
}

// One launch, blocks (entries, blocks_y), in words of `word_bytes` (16, 8, 4, 2 or 1: the args count in them);
// the launch's error.
cudaError_t copy_cache_slots_launch(const CacheSlotsArgs& a, int64_t word_bytes, cudaStream_t stream);

}  // namespace fairseq_stream
