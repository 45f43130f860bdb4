// The quantized product x W^T + b, int8 or int16, on its packed weight: one tile driver, one registry of
// kernels and one quantization of x's rows for both precisions (quantized_product_cpu.cpp); the tiles are
// quantized_tiles_cpu.h's, one per instruction set, each over a precision's step (int8_tiles_cpu.h,
// int16_tiles_cpu.h); the ops are int8_linear_cpu.cpp and int16_linear_cpu.cpp (their checks, their weight
// layouts for rows the integers cannot hold). As CTranslate2's ops/gemm.cc: the
// precision and the instruction set are parameters of one op, the kernels chosen at run time.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "quantized_tiles_cpu.h"

// Hidden: called only within this library. At default visibility every call of a template instance (a
// tile, from the driver's table) went through the PLT.
#pragma GCC visibility push(hidden)
namespace fs_quant {

enum class Precision { kInt8, kInt16 };

// The instruction set a kernel needs: it runs where the CPU reports it and ATen's dispatch allows it
// (cpu_isa_cpu.h: ATEN_CPU_CAPABILITY=avx2 caps ours as it caps torch's).
enum class CpuIsa { kPortable, kAvx2, kAvx512Vnni };

// A tile of R rows x P panels: acc[r * kAccStride + b * 16 + c] = sum over the steps of the rows' values (as
// the kernel's format gives them) times those of output 16 * (panel0 + b) + c. xq: the tile's rows,
// step-major; packed: the weight (int8 or int16) as its op packs it.
using Tile = void (*)(const void* xq, int64_t steps, const void* packed, int64_t panel0, int32_t* acc);

// One tile shape of a kernel: up to `rows` rows and `panels` panels a tile, every smaller remainder an
// instance of its own (table[(r - 1) * panels + p - 1]) so the sums stay in registers.
struct Shape {
  int rows, panels;
  std::vector<Tile> table;
};

struct Kernel {
  Precision precision;
  std::string name;
  CpuIsa isa;
  Format format;
  int max_weight;  // the largest |w| whose products the kernel sums exactly (int8: 127, or 63 for avx2w7)
  std::vector<Shape> shapes;  // by how many rows a call has: shapes[i] serves up to shapes[i].rows rows,
                              // the last one any count
  const Shape& for_rows(int64_t rows) const;
};

// The kernels of `precision` this CPU runs on weights of magnitude up to weight_max, the best last.
std::vector<Kernel> kernels_for(Precision precision, int weight_max);

// The kernel called `name` ("auto": the best for weights up to weight_max); an error naming `op` where this
// CPU has none of that name, or where it cannot sum such weights.
const Kernel& find_kernel(Precision precision, const std::string& name, int weight_max, const char* op);

// q[i] = round(row[i] * s) (to nearest, ties to even: the default rounding mode, as torch.round), for
// i < k, and 0 up to `padded`. A loop GCC vectorizes (-fno-trapping-math lets nearbyint become vroundps).
void round_row(const float* row, int64_t k, int64_t padded, float s, int32_t* q);

// What a product call multiplies: x (rows, k) float32; the packed weight (n_panels panels of `steps` steps);
// each output's 1 / scale, the bias or null, and for the shifted format each output's excess (what the rows'
// + 128 adds); y (rows, out_features).
struct Operands {
  const float* x;
  int64_t rows, k, steps, n_panels, out_features;
  float a_max;  // the largest |q| a row of x is scaled to
  const void* packed;
  const float* inv_w;
  const float* bias;
  const int32_t* excess;
  float* y;
};

// y = x W^T + b by `kernel`'s tiles, over groups of panels on the kernels' threads. Returns each row's
// 1 / scale, kFloatRow for a row the integers cannot hold, whose outputs the caller writes (float_rows).
std::vector<float> quantized_product(const Kernel& kernel, const Operands& o);

// An op's whole product: y (rows, out) = x (rows, k; float32, contiguous) times the packed weight (n_panels
// panels of `steps` steps) by `kernel`, then float_rows for the rows the integers cannot hold, which read the
// weight through weight_at. weight_inv contiguous; the bias is made contiguous here.
template <class WeightAt>
at::Tensor product_of_rows(const Kernel& kernel, const at::Tensor& x, const void* packed, int64_t steps,
                           int64_t n_panels, const at::Tensor& weight_inv, std::optional<at::Tensor>& bias,
                           const int32_t* excess, float a_max, const WeightAt& weight_at) {
  const float* b = nullptr;
  if (bias) {
    *bias = bias->contiguous();
    b = bias->data_ptr<float>();
  }
  const int64_t rows = x.size(0), k = x.size(1), out_features = weight_inv.numel();
  at::Tensor out = x.new_empty({rows, out_features});
  const float* inv_w = weight_inv.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const std::vector<float> scale = quantized_product(
      kernel, {x.data_ptr<float>(), rows, k, steps, n_panels, out_features, a_max, packed, inv_w, b, excess, y});
  float_rows(x.data_ptr<float>(), k, scale, out_features, weight_at, inv_w, b, y);
  return out;
}

}  // namespace fs_quant
#pragma GCC visibility pop
