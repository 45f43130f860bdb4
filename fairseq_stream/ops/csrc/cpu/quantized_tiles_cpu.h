// What the int16 and int8 linear layers (int16_linear_cpu.cpp, int8_linear_cpu.cpp) share: the panel
// width of their packed weights, picking a kernel by name, and the dequantization of a row's integer sums.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fs_quant {

constexpr int64_t kCols = 16;     // output columns per packed panel (one 512-bit register of int32 sums)
constexpr float kInt8Max = 127.f;  // the largest |q| of an int8 value (symmetric: -128 is never used)

// How far ahead of a tile's reads its weight panels are prefetched into L1, in bytes (prefetch_ahead). On a
// big model a step's weights stream from memory: on the WMT'19-sized stand-in (194 MB of int8 weights a step,
// one sentence at beam 5, one thread of the Xeon running the AVX2 kernel) the tile outran the hardware
// prefetcher, which restarts at every 4 KB page, and waited on memory. One prefetch a 64-byte line, 2 KB
// ahead, took decoding from 14.5 to 7.6 s (256 bytes ahead: 13.3 s, 1 KB: 8.5, 4 KB: 7.9).
constexpr int64_t kPrefetchAheadBytes = 2048;

// Prefetch the line kPrefetchAheadBytes past `p` in a weight panel. A panel's bytes run on into the next
// panel's, which the next tile reads; a prefetch past the end of the weights never faults.
inline void prefetch_ahead(const void* p) {
  __builtin_prefetch(static_cast<const char*>(p) + kPrefetchAheadBytes, 0, 3);
}

// float32(1 / scale), computed in double as the torch reference computes it.
inline float inverse(float scale) { return static_cast<float>(1.0 / static_cast<double>(scale)); }

// y[c] = (float(acc[c]) * inv_a) * inv_w[c] + bias[c], each operation rounded to float32 as the torch
// reference rounds it: contracting a multiply and the add into one FMA (GCC does by default) would
// change the last bit. (A function with other optimize options is not inlined into one without them.)
__attribute__((optimize("fp-contract=off"), noinline)) static void dequantize(const int32_t* acc, int64_t count,
                                                                              float inv_a, const float* inv_w,
                                                                              const float* bias, float* y) {
  for (int64_t c = 0; c < count; ++c) {
    const float scaled = (static_cast<float>(acc[c]) * inv_a) * inv_w[c];
    y[c] = bias ? scaled + bias[c] : scaled;
  }
}

// The kernel called `name` ("auto": the best, the last of `kernels`); an error naming `op` where this CPU
// has none of that name.
template <class Kernel>
const Kernel& find_kernel(const std::vector<Kernel>& kernels, const std::string& name, const char* op) {
  if (name == "auto") return kernels.back();
  for (const auto& k : kernels)
    if (k.name == name) return k;
  TORCH_CHECK(false, op, ": kernel '", name, "' does not run on this CPU (it has: ", kernels.back().name,
              " and below)");
  return kernels.back();  // not reached
}

template <class Kernel>
std::vector<std::string> kernel_names(const std::vector<Kernel>& kernels) {
  std::vector<std::string> names;
  for (const auto& k : kernels) names.push_back(k.name);
  return names;
}

}  // namespace fs_quant
