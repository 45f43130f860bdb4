// The cache slot copy's ATen entry (cache_slots_cuda_binding.cpp); output_layer_cuda_binding.cpp binds it.
#pragma once

#include <ATen/core/Tensor.h>

// In place: positions 0..length-1 of each source slot of `cache` (2 * layers, slots, heads, capacity, head_dim),
// contiguous on CUDA, copied to its target slot (int64 (n,) each, on the cache's device); an entry whose source
// is its target copies nothing. The CPU op of the same name (csrc/cpu/attention_cpu.cpp) does the same;
// fairseq_stream/ops/attention.py (copy_slots_) documents it.
void copy_cache_slots_cuda(at::Tensor cache, const at::Tensor& source, const at::Tensor& target, int64_t length);
