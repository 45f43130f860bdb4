// A 16-byte word: the widest load or store one thread makes, where a layout allows it (its rows' bytes a
// multiple of 16, aligned). Used by cache_slots_cuda.cu (copies) and indexed_attention_cuda.cu (key reads); plain
// C++, so that it also compiles against the host emulation of ../cuda_emu.
#pragma once

#include <cstdint>

namespace fairseq_stream {

struct alignas(16) Word16 {
  uint64_t low, high;
};

}  // namespace fairseq_stream
