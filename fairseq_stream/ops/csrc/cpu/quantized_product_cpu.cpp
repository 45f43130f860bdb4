// The quantized product's one driver, registry and row quantization (quantized_product_cpu.h), for int8
// and int16 alike. fairseq_stream/ops/quantized_linear.py and int16_linear.py document the ops and hold the
// torch references every kernel must equal bit for bit.
//
// Kernels are chosen at run time from what the CPU reports (__builtin_cpu_supports, capped by
// ATEN_CPU_CAPABILITY as torch's are: cpu_isa_cpu.h), not from the compiler's -march: each tile is compiled
// for its own target (the target attribute), so one build runs on any x86-64 CPU and uses the best kernel it
// has. Every kernel of a precision computes the same integer sums, so all give identical floats, and a name
// picks one, so tests compare them all.

#include "quantized_product_cpu.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "cpu_isa_cpu.h"
#include "int16_tiles_cpu.h"
#include "int8_tiles_cpu.h"
#include "parallel_cpu.h"

namespace fs_quant {
namespace {

constexpr int kInt8Weight = 127;     // the largest |w| of an 8-bit weight
constexpr int kInt7Weight = 63;      // of a 7-bit one (int8w7)
constexpr int kInt16Weight = 32767;  // of an int16 one

template <class K, class W, int PMax, size_t I>
void tile_at(const void* xq, int64_t steps, const void* packed, int64_t panel0, int32_t* acc) {
  K::template tile<static_cast<int>(I) / PMax + 1, static_cast<int>(I) % PMax + 1>(
      xq, steps, static_cast<const W*>(packed), panel0, acc);
}

template <class K, class W, int RMax, int PMax, size_t... I>
Shape shape(std::index_sequence<I...>) {
  static_assert(RMax <= kAccRows && PMax * kCols <= kAccStride, "a tile larger than its output");
  return Shape{RMax, PMax, {&tile_at<K, W, PMax, I>...}};
}

// The tiles of kernel K (on weights of type W) up to RMax rows x PMax panels.
template <class K, class W, int RMax, int PMax>
Shape shape() {
  return shape<K, W, RMax, PMax>(std::make_index_sequence<RMax * PMax>{});
}

template <class K, int RMax, int PMax>
Shape int8_shape() {
  return shape<K, int8_t, RMax, PMax>();
}

template <class K, int RMax, int PMax>
Shape int16_shape() {
  return shape<K, int16_t, RMax, PMax>();
}

bool runs(CpuIsa isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  switch (isa) {
    case CpuIsa::kPortable:
      return true;
    case CpuIsa::kAvx2:
      return fs_cpu::allows_avx2();
    case CpuIsa::kAvx512Vnni:
      return fs_cpu::allows_avx512() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vnni");
  }
  return false;
#else
  return isa == CpuIsa::kPortable;
#endif
}

// Every kernel of both precisions, each precision's best last: the registry. The AVX2 int8 kernels have a
// row tile (1 row x 4 panels: a lone row, greedy one sentence at a time, gets 8 independent sums) before
// their 6-row one; VNNI's int8 tiles are (2, 8) and (4, 4) for one sentence's few rows, (12, 2) for batches.
std::vector<Kernel> all_kernels() {
  using P = Precision;
  using I = CpuIsa;
  std::vector<Kernel> all;
  all.push_back({P::kInt8, "portable", I::kPortable, Format::kSigned8, kInt8Weight,
                 {int8_shape<int8_tiles::Portable, 4, 1>()}});
  all.push_back({P::kInt16, "portable", I::kPortable, Format::kPairs16, kInt16Weight,
                 {int16_shape<int16_tiles::Portable, 6, 1>()}});
#if FS_INT8_X86 && FS_INT16_X86
  all.push_back({P::kInt8, "avx2", I::kAvx2, Format::kWide16, kInt8Weight,
                 {int8_shape<int8_tiles::Avx2Row, 1, 4>(), int8_shape<int8_tiles::Avx2, 6, 1>()}});
  all.push_back({P::kInt8, "avx2w7", I::kAvx2, Format::kShifted8, kInt7Weight,
                 {int8_shape<int8_tiles::Avx2BytesRow, 1, 4>(), int8_shape<int8_tiles::Avx2Bytes, 6, 1>()}});
  all.push_back({P::kInt16, "avx2", I::kAvx2, Format::kPairs16, kInt16Weight,
                 {int16_shape<int16_tiles::Avx2, 6, 1>()}});
  all.push_back({P::kInt8, "avx512vnni", I::kAvx512Vnni, Format::kShifted8, kInt8Weight,
                 {int8_shape<int8_tiles::Avx512Vnni, 2, 8>(), int8_shape<int8_tiles::Avx512Vnni, 4, 4>(),
                  int8_shape<int8_tiles::Avx512Vnni, 12, 2>()}});
  all.push_back({P::kInt16, "avx512vnni", I::kAvx512Vnni, Format::kPairs16, kInt16Weight,
                 {int16_shape<int16_tiles::Avx512Vnni, 12, 2>()}});
#endif
  return all;
}

// The kernels of `precision` this CPU runs, the best last.
const std::vector<Kernel>& of_precision(Precision precision) {
  static const std::array<std::vector<Kernel>, 2> runnable = [] {
    std::array<std::vector<Kernel>, 2> out;
    for (Kernel& k : all_kernels())
      if (runs(k.isa)) out[static_cast<int>(k.precision)].push_back(std::move(k));
    return out;
  }();
  return runnable[static_cast<int>(precision)];
}

// int8: the weights are of 8 bits (127) or 7 (63).
void check_weight_max(Precision precision, int weight_max, const char* op) {
  TORCH_CHECK(precision != Precision::kInt8 || weight_max == kInt8Weight || weight_max == kInt7Weight, op,
              ": weight_max must be ", kInt8Weight, " (8-bit weights) or ", kInt7Weight, " (7-bit), got ",
              weight_max);
}

// Rows of x quantized to [-a_max, a_max] (q = round(x * scale), scale = a_max / max |x|, 1 for an all-zero row;
// a row that integers cannot hold gets kFloatRow and zeros) and laid out tile by tile as the format wants
// them, one element T per (step, row): tile t (rows t * tile_rows ..) starts at element t * tile_rows * steps;
// within it, step p of row r is element p * R + r.
template <typename T>
void quantize_rows(const Operands& o, int64_t tile_rows, Format format, T* xq, float* scale) {
  const bool wide = format == Format::kWide16 || format == Format::kPairs16;
  const int64_t padded = o.steps * static_cast<int64_t>(sizeof(T) / (wide ? 2 : 1));
  std::vector<int32_t> q(padded);
  // The row's values as the format stores them: bytes (q, or q + 128 unsigned) or int16. Each pass is a
  // plain loop GCC vectorizes; the last one moves whole elements.
  std::vector<T> packed(o.steps);
  uint8_t* bytes = reinterpret_cast<uint8_t*>(packed.data());
  int16_t* halves = reinterpret_cast<int16_t*>(packed.data());
  const int32_t shift = format == Format::kShifted8 ? 128 : 0;
  for (int64_t m = 0; m < o.rows; ++m) {
    const float* row = o.x + m * o.k;
    scale[m] = row_scale(row, o.k, o.a_max);
    if (scale[m] == kFloatRow)
      std::fill(q.begin(), q.end(), 0);  // its integer sums are not used (float_rows writes the row)
    else
      round_row(row, o.k, padded, scale[m], q.data());
    if (wide)
      for (int64_t i = 0; i < padded; ++i) halves[i] = static_cast<int16_t>(q[i]);
    else
      for (int64_t i = 0; i < padded; ++i) bytes[i] = static_cast<uint8_t>(q[i] + shift);
    const int64_t m0 = m - m % tile_rows, r = m - m0, R = std::min(tile_rows, o.rows - m0);
    T* tile = xq + m0 * o.steps;
    for (int64_t p = 0; p < o.steps; ++p) tile[p * R + r] = packed[p];
  }
}

}  // namespace

const Shape& Kernel::for_rows(int64_t rows) const {
  for (const Shape& s : shapes)
    if (rows <= s.rows) return s;
  return shapes.back();
}

std::vector<Kernel> kernels_for(Precision precision, int weight_max) {
  check_weight_max(precision, weight_max, precision == Precision::kInt8 ? "int8_linear" : "int16_linear");
  std::vector<Kernel> out;
  for (const Kernel& k : of_precision(precision))
    if (k.max_weight >= weight_max) out.push_back(k);
  return out;
}

const Kernel& find_kernel(Precision precision, const std::string& name, int weight_max, const char* op) {
  check_weight_max(precision, weight_max, op);
  const std::vector<Kernel>& all = of_precision(precision);
  for (const Kernel& k : all)
    TORCH_CHECK(k.name != name || k.max_weight >= weight_max, op, ": kernel '", name, "' sums weights of ",
                k.max_weight == kInt7Weight ? 7 : 8, " bits only (|w| <= ", k.max_weight, "); these have ",
                weight_max == kInt7Weight ? 7 : 8);
  if (name != "auto") return find_kernel(all, name, op);
  for (auto k = all.rbegin(); k != all.rend(); ++k)
    if (k->max_weight >= weight_max) return *k;
  return all.front();  // portable sums any weight
}

void round_row(const float* row, int64_t k, int64_t padded, float s, int32_t* q) {
  for (int64_t i = 0; i < k; ++i) q[i] = static_cast<int32_t>(std::nearbyint(row[i] * s));
  for (int64_t i = k; i < padded; ++i) q[i] = 0;
}

std::vector<float> quantized_product(const Kernel& kernel, const Operands& o) {
  std::vector<float> scale(o.rows);  // each row's scale, then its inverse (to_inverses)
  if (o.rows == 0) return scale;
  const Shape& shape = kernel.for_rows(o.rows);
  // The rows split into tiles of nearly equal size: 13 rows as 7 + 6, not 12 + 1, whose lone row would
  // read the weight a second time with too few independent sums to hide the multiply-adds' latency.
  const int64_t tiles = (o.rows + shape.rows - 1) / shape.rows, tile_rows = (o.rows + tiles - 1) / tiles;
  // A (step, row)'s bytes: 8 for AVX2's int8 quads widened to int16, 4 for the others.
  const int64_t element = kernel.format == Format::kWide16 ? 8 : 4;
  std::vector<int64_t> storage((o.rows * o.steps * element + 7) / 8);
  if (element == 8)
    quantize_rows(o, tile_rows, kernel.format, storage.data(), scale.data());
  else
    quantize_rows(o, tile_rows, kernel.format, reinterpret_cast<int32_t*>(storage.data()), scale.data());
  to_inverses(scale);
  const char* xq = reinterpret_cast<const char*>(storage.data());
  const int32_t* shift = kernel.format == Format::kShifted8 ? o.excess : nullptr;
  // A group's multiply-adds: each chunk holds enough of them to pay for waking a thread.
  const int64_t values = kernel.format == Format::kPairs16 ? 2 : 4;  // a step's inputs
  const int64_t group_work = o.rows * shape.panels * kCols * o.steps * values;
  // Split over groups of panels: each thread streams its own part of the (large) weight once.
  fs::parallel_for(0, (o.n_panels + shape.panels - 1) / shape.panels, fs::grain_for(group_work, fs::kMinChunkWork),
                   [&](int64_t first, int64_t last) {
    int32_t acc[kAccRows * kAccStride];
    for (int64_t group = first; group < last; ++group) {
      const int64_t p0 = group * shape.panels;
      const int panels = static_cast<int>(std::min<int64_t>(shape.panels, o.n_panels - p0));
      for (int64_t m0 = 0; m0 < o.rows; m0 += tile_rows) {
        const int r = static_cast<int>(std::min<int64_t>(tile_rows, o.rows - m0));
        shape.table[(r - 1) * shape.panels + panels - 1](xq + m0 * o.steps * element, o.steps, o.packed, p0, acc);
        const int64_t n0 = p0 * kCols, count = std::min<int64_t>(panels * kCols, o.out_features - n0);
        dequantize_rows(acc, kAccStride, r, count, shift ? shift + n0 : nullptr, scale.data() + m0, o.inv_w + n0,
                        o.bias ? o.bias + n0 : nullptr, o.y + m0 * o.out_features + n0, o.out_features);
      }
    }
  });
  return scale;
}

}  // namespace fs_quant
