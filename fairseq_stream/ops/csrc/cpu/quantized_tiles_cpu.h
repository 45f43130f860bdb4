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
