// float32 x W^T + b on a weight packed once, by MKL's cblas_sgemm_pack or into oneDNN's blocked layout
// (prepacked_linear_cpu.cpp); bindings_cpu.cpp binds it, product_cpu.h holds it for the compiled steps.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

// Row counts at which at::linear on the unpacked weight beats the packed product (MKL's skinny path:
// 18% faster on the Multi30k output layer at 2 and 3 rows on a Xeon, docs/BENCHMARKS.md Jacobi run 5;
// the packed one is level at 1 row and up to twice as fast from 4). On a CPU with AVX-512F the
// skinny product (skinny_linear_cpu.h) takes these row counts first.
constexpr int64_t kUnpackedFromRows = 2;
constexpr int64_t kUnpackedToRows = 3;

// Which library's GEMM multiplies the rows the skinny product does not take. MKL's code on a CPU that is not
// Intel's is its generic one (on the AVX2 EPYC it copied rows on every call); oneDNN runs its own code for
// the CPU's instruction set there, as CTranslate2 does on AMD CPUs (ops/product.py chooses).
enum class Float32Gemm { kMkl, kOneDnn };

// Output columns [first, first + count) of W, packed on their own: MKL's opaque packed form of their W^T, never
// copied or moved (MKL's rule), or oneDNN's blocked layout of their rows of W (an opaque mkldnn tensor).
struct __attribute__((visibility("hidden"))) Float32Panel {
  at::Tensor packed;
  int64_t first;
  int64_t count;
  std::optional<at::Tensor> bias;  // oneDNN's: their bias, which it adds (MKL's calls start from the whole bias)
};

// The panels a weight of (out_features, in_features) is packed in: one below 4M values; above, up to 8 of at
// least 2M values each, so that a call of one row block (up to 64 rows: a beam of a few sentences, a greedy
// batch) has work for more than one of our threads. Fixed by the shape alone, never by the threads: a row's
// bits do not depend on how many threads share its call.
std::vector<std::pair<int64_t, int64_t>> float32_panels(int64_t out_features, int64_t in_features);

struct __attribute__((visibility("hidden"))) PrepackedLinear {
  std::vector<Float32Panel> panels;  // W's output columns in order (float32_panels)
  int64_t out_features;
  int64_t in_features;
  std::optional<at::Tensor> bias;
  at::Tensor weight;  // W itself (the model's parameter, not a copy), for the skinny and unpacked products
  Float32Gemm gemm = Float32Gemm::kMkl;

  // The skinny product (skinny_linear_cpu.h) at its row counts where the CPU has it, else gemm_product.
  at::Tensor operator()(const at::Tensor& x) const;
  // The GEMM's product at every row count: MKL's (unpacked at kUnpackedFromRows .. kUnpackedToRows rows,
  // packed otherwise) or oneDNN's on its blocked weight, rows in blocks of the same size either way.
  at::Tensor gemm_product(const at::Tensor& x) const;
};

// "" where MKL's packed sgemm was found in the process (torch's own MKL), else why not.
std::string prepacked_linear_missing();
// "" where torch's oneDNN linear ops (mkldnn::_linear_pointwise, _reorder_linear_weight) are registered, else
// why not.
std::string onednn_linear_missing();

PrepackedLinear prepack_linear(const at::Tensor& weight, std::optional<at::Tensor> bias,
                               Float32Gemm gemm = Float32Gemm::kMkl);

