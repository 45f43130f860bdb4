// copy_cache_slots_ on CUDA: when a beam's rows move, a parent's second and later children take free slots with
// a copy of the parent's keys and values (fairseq_stream/runners/static_moves.py, runners/lean.py).
//
// Why a kernel: torch's form, cache[:, target, :, :n] = cache[:, source, :, :n], gathers the source slots into a
// new tensor and scatters it back (every byte moved twice), and copies every entry of the copy list, which is
// padded to a length the host knows (rows minus sentences) with entries that copy a slot onto itself. At the
// WMT'19 size, 4 members stacked and 320 rows, that was the static step's largest move left once its attention
// read the pool in place (benchmarks/device_work.py, docs/GPU.md). Here a block per (entry, share of the
// layers and heads) copies each contiguous run of positions once, in the widest words the layout allows, and a
// padded entry's block returns at once. Bits are copied, never converted: the result is torch's form's exactly.

#include "cache_slots_cuda.h"

#include <cassert>

namespace fairseq_stream {

namespace {

constexpr int kThreads = 256;

}  // namespace

#ifndef FS_LAUNCH
#define FS_LAUNCH(kernel, grid, stream, ...) kernel<<<(grid), kThreads, 0, (stream)>>>(__VA_ARGS__)
#endif

template <typename word_t>
__global__ void __launch_bounds__(kThreads) copy_cache_slots_kernel(const CacheSlotsArgs a) {
  const int64_t e = blockIdx.x;
  const int64_t from = a.source[e], to = a.target[e];
  if (from == to) return;  // a padded entry
  assert(from >= 0 && from < a.slots && to >= 0 && to < a.slots);
  word_t* cache = static_cast<word_t*>(a.cache);
  const int64_t pieces = a.outer * a.heads;
  for (int64_t piece = blockIdx.y; piece < pieces; piece += a.blocks_y) {
    const int64_t o = piece / a.heads, h = piece % a.heads;
    const word_t* src = cache + ((o * a.slots + from) * a.heads + h) * a.head_words;
    word_t* dst = cache + ((o * a.slots + to) * a.heads + h) * a.head_words;
    for (int64_t i = threadIdx.x; i < a.chunk_words; i += kThreads) dst[i] = src[i];
  }
}

namespace {

template <typename word_t>
cudaError_t launch_words(const CacheSlotsArgs& a, cudaStream_t stream) {
  FS_LAUNCH(copy_cache_slots_kernel<word_t>, dim3(static_cast<unsigned>(a.entries), static_cast<unsigned>(a.blocks_y)),
            stream, a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t copy_cache_slots_launch(const CacheSlotsArgs& a, int64_t word_bytes, cudaStream_t stream) {
  if (a.entries > 0x7fffffff || a.blocks_y < 1 || a.blocks_y > kCacheSlotsMaxBlocksY) return cudaErrorInvalidValue;
  if (a.entries <= 0 || a.chunk_words <= 0 || a.outer * a.heads <= 0) return cudaSuccess;
  switch (word_bytes) {
    case 16:
      return launch_words<Word16>(a, stream);
    case 8:
      return launch_words<uint64_t>(a, stream);
    case 4:
      return launch_words<uint32_t>(a, stream);
    case 2:
      return launch_words<uint16_t>(a, stream);
    case 1:
      return launch_words<uint8_t>(a, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace fairseq_stream
