// ATen side of the cache slot copy (cache_slots_cuda.cu holds the kernel): checks, the word size, the launch on the
// current stream. ATen headers only here (torch/python.h is the slow one to compile).

#include "cache_slots_cuda_binding.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "cache_slots_cuda.h"

namespace {

// The widest word (16, 8, 4, 2 or 1 bytes) that divides one position's bytes (head_dim elements) and the cache's
// address: every (slot, head) run then starts on a word and holds whole words.
int64_t word_bytes(const at::Tensor& cache) {
  const int64_t unit = cache.size(4) * static_cast<int64_t>(cache.element_size());
  const auto address = reinterpret_cast<std::uintptr_t>(cache.data_ptr());
  int64_t word = 16;
  while (word > 1 && (unit % word != 0 || address % word != 0)) word /= 2;
  return word;
}

}  // namespace

void copy_cache_slots_cuda(at::Tensor cache, const at::Tensor& source, const at::Tensor& target, int64_t length) {
  TORCH_CHECK(cache.is_cuda() && cache.dim() == 5 && cache.is_contiguous(),
              "copy_cache_slots_: a contiguous CUDA cache (2 * layers, slots, heads, capacity, head_dim); got ",
              cache.sizes(), " on ", cache.device());
  TORCH_CHECK(source.device() == cache.device() && target.device() == cache.device() &&
                  source.scalar_type() == at::kLong && target.scalar_type() == at::kLong && source.dim() == 1 &&
                  target.dim() == 1 && source.numel() == target.numel(),
              "copy_cache_slots_: int64 (n,) source and target slots on the cache's device, as many of each");
  TORCH_CHECK(length >= 0 && length <= cache.size(3), "copy_cache_slots_: length ", length, " not within the "
              "capacity ", cache.size(3));
  const at::Tensor from = source.contiguous(), to = target.contiguous();
  const int64_t word = word_bytes(cache);
  fairseq_stream::CacheSlotsArgs a{};
  a.cache = cache.data_ptr();
  a.source = from.data_ptr<int64_t>();
  a.target = to.data_ptr<int64_t>();
  a.entries = from.numel();
  a.outer = cache.size(0);
  a.slots = cache.size(1);
  a.heads = cache.size(2);
  const int64_t position_bytes = cache.size(4) * static_cast<int64_t>(cache.element_size());
  a.head_words = cache.size(3) * position_bytes / word;
  a.chunk_words = length * position_bytes / word;
  a.blocks_y = fairseq_stream::cache_slots_blocks_y(a.outer * a.heads);
  const c10::cuda::CUDAGuard guard(cache.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const cudaError_t err = fairseq_stream::copy_cache_slots_launch(a, word, stream);
  TORCH_CHECK(err == cudaSuccess, "copy_cache_slots_ (CUDA): ", cudaGetErrorString(err));
}
