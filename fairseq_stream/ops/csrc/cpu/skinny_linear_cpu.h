// float32 y = x W^T + b for a few rows of x, reading W once in its own layout (skinny_linear_cpu.cpp).
#pragma once

#include <cstdint>

// The most rows the skinny product takes. On one Xeon thread, the Multi30k output layer (8008 x 256):
// 0.29 ms at 1 row, 0.32 at 4, 0.35 at 5, against MKL's 0.30-0.31 at 1 to 3 rows and 0.40 at 4 to 8
// (packed); at 6 rows both take 0.41 ms, at 8 MKL is 14% faster (docs/BENCHMARKS.md).
constexpr int64_t kSkinnyMaxRows = 5;

// Whether the CPU running this process has the skinny product's instructions: AVX-512F, or AVX2 and FMA
// (as capped by ATEN_CPU_CAPABILITY, cpu_isa_cpu.h).
bool skinny_linear_available();

// The tiles the skinny product runs here: "avx512", "avx2", or "" where it does not run.
const char* skinny_linear_kernel();

// Whether a product of `rows` rows runs here: 1 to kSkinnyMaxRows, on a CPU that has it.
inline bool skinny_linear_takes(int64_t rows) {
  return rows >= 1 && rows <= kSkinnyMaxRows && skinny_linear_available();
}

// What a transformer layer does after a product, on one of its outputs v: relu, then the residual r (or
// null) added; the float operations at::relu and r + v would do (at::relu keeps -0.0 and NaN; r + v is
// v + r).
inline float relu_then_residual(float v, bool relu, const float* r) {
  if (relu && v < 0.0f) v = 0.0f;
  return r != nullptr ? v + *r : v;
}

// y (rows, n) = x (rows, k) W^T (W: (n, k), row-major) + bias (n floats, or null); then, where asked,
// relu_then_residual with a residual (rows, n), in a pass over each tile's outputs. Each output is
// computed the same way whatever ``rows`` is and wherever its row stands: one row's results do not
// depend on the rows beside it. Needs skinny_linear_available().
void skinny_linear(const float* x, int64_t rows, const float* w, int64_t n, int64_t k, const float* bias, float* y,
                   const float* residual = nullptr, bool relu = false);
