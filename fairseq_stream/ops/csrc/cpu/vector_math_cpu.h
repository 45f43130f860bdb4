// Elementwise math and dot products that GCC vectorizes, shared by the compiled decoder steps
// (rnn_step_cpu.cpp, attention_cpu.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// The float whose bits are `bits`, and the bits of a float (std::bit_cast is C++20; torch < 2.13's
// extensions build as C++17, and a memcpy of 4 bytes compiles to the same register move).
inline float float_of_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t bits_of_float(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// Cephes expf: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial in r, 2^n from the
// exponent bits. Straight-line code with no calls, so loops over it vectorize (setup.py compiles
// with -fno-trapping-math, without which GCC keeps the clamps and selects as branches).
//
// Outside [-87, 88] x is clamped: exp_approx(-inf) is exp_approx(-87) = 1.6e-38 and exp_approx(+inf) is
// exp_approx(88) = 1.7e38 (the callers skip masked -inf positions themselves). A NaN passes the clamp and
// gives NaN: 2^n is built from n's bits after adding 1.5 * 2^23 and shifted in uint32, never by converting
// n to an integer, which for a NaN n is undefined behaviour (x86 happens to give INT_MIN, but the compiler
// may assume it never happens; UBSan's float-cast-overflow stops there). For every finite x the bits are
// those of the former int32 conversion, so the results are the same.
// Giving exp(-inf) = 0 and exp(+inf) = inf too took two more selects, which also stopped GCC from folding
// the clamped lanes into constants: 28% more instructions in the LSTM cell loop (505 against 394 a 16-lane
// iteration), against 1% for the NaN rule alone.
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
  // The bits of n + 1.5 * 2^23 are those of 1.5 * 2^23 plus the integer n (|n| < 2^22); adding 127 and
  // shifting by 23 in uint32 leaves n + 127 in the exponent field, and only that.
  const uint32_t bits = (bits_of_float(n + 12582912.0f) + 127u) << 23;
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
