// float32 x W^T + b on a weight packed once, by MKL's cblas_sgemm_pack or into oneDNN's blocked layout
// (prepacked_linear_cpu.cpp); bindings_cpu.cpp binds it, product_cpu.h holds it for the compiled steps.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

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

struct __attribute__((visibility("hidden"))) PrepackedLinear {
  at::Tensor packed;  // MKL: its opaque packed form of W^T, never copied or moved (MKL's rule); oneDNN:
                         // W in oneDNN's blocked layout (an opaque mkldnn tensor)
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

