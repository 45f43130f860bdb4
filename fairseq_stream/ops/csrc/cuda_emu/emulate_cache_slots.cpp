// The cache slot copy kernel (../cuda/cache_slots_cuda.cu) run on the host (see cuda_runtime.h here), behind a C
// entry point for ctypes. Built by tests/test_cache_slots_cuda.py:
//   c++ -std=c++17 -O1 -shared -fPIC -I <this dir> -I ../cuda emulate_cache_slots.cpp
// The word size is the caller's choice, as the binding's is (cache_slots_cuda_binding.cpp: word_bytes).
#include "cache_slots_cuda.cu"

// dims: entries, outer, slots, heads, head_words, chunk_words (in words of word_bytes); blocks_y as the binding
// sets it.
extern "C" int fs_emulate_copy_cache_slots(int word_bytes, const long* dims, void* cache, const int64_t* source,
                                           const int64_t* target) {
  using namespace fairseq_stream;
  CacheSlotsArgs a{};
  a.cache = cache;
  a.source = source;
  a.target = target;
  a.entries = dims[0];
  a.outer = dims[1];
  a.slots = dims[2];
  a.heads = dims[3];
  a.head_words = dims[4];
  a.chunk_words = dims[5];
  a.blocks_y = cache_slots_blocks_y(a.outer * a.heads);
  return copy_cache_slots_launch(a, word_bytes, nullptr) == cudaSuccess ? 0 : 1;
}
