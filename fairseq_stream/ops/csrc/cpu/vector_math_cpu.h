// Elementwise math and dot products that GCC vectorizes, shared by the compiled decoder steps
// (rnn_step_cpu.cpp, attention_cpu.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// The float whose bits are `bits` (std::bit_cast is C++20; torch < 2.13's extensions build as C++17,
// and a memcpy of 4 bytes compiles to the same register move).
inline float float_of_bits(int32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Cephes expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial in r, 2^n from the
// exponent bits. Straight-line code with no calls, so loops over it vectorize (setup.py compiles
// with -fno-trapping-math, without which GCC keeps the clamps and selects as branches).
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r2 + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return y * float_of_bits(bits);
}

inline float sigmoid_approx(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

// Cephes tanhf: an odd polynomial below 0.625, 1 - 2 / (e^{2|x|} + 1) above, with x's sign.
inline float tanh_approx(float x) {
  const float a = std::fabs(x);
  const float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = p * z * x + x;
  const float big = 1.0f - 2.0f / (exp_approx(2.0f * a) + 1.0f);
  return a < 0.625f ? small : std::copysign(big, x);
}

// The exp of the attention kernels: exp_approx in float32 (vectorizes), the libm one in float64
// (the exactness tests' type).
inline float exp_of(float x) { return exp_approx(x); }
inline double exp_of(double x) { return std::exp(x); }

// sum_i a[i] b[i] in independent partial sums (one 512-bit register's worth): the loop vectorizes
// without reassociating one sum.
template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  constexpr int kLanes = 64 / sizeof(T);
  T acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  }
  T s = 0;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}


}  // namespace
