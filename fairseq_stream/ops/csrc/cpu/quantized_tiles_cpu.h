// What the int16 and int8 linear layers (int16_linear_cpu.cpp, int8_linear_cpu.cpp) share: the panel
// width of their packed weights and the dequantization of a row's integer sums.
#pragma once

#include <cstdint>

namespace fs_quant {

constexpr int64_t kCols = 16;     // output columns per packed panel (one 512-bit register of int32 sums)
constexpr float kInt8Max = 127.f;  // the largest |q| of an int8 value (symmetric: -128 is never used)

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

}  // namespace fs_quant
