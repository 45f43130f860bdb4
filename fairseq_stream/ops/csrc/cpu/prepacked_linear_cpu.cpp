// float32 y = x W^T + b with W packed once and every call computed on the packed form: by MKL
// (cblas_sgemm_pack once, cblas_sgemm_compute a call) or by oneDNN (torch's mkldnn::_reorder_linear_weight
// once, mkldnn::_linear_pointwise a call). fairseq_stream/ops/product.py documents the op and chooses.
//
// Why: a decoder step's products are skinny (5 to 100 rows against 512 to 8k columns), and there
// at::linear's sgemm packs W again on every call. On one Xeon thread the packed form is 1.3-2.6x
// faster at 5-64 rows for the Multi30k transformer's shapes (the 8k output layer at 40 rows: 2.2
// against 3.2 ms), and equal from a few hundred rows on. On an AMD CPU MKL runs its generic code: oneDNN's
// product of the 8k output layer took 0.59-0.77x MKL's packed one's time from 40 rows on the AVX2 EPYC, and
// WMT'19's products of 1024 x 1024 and up 0.5-0.8x on a Zen 4 EPYC (ops/product.py chooses by weight size).
//
// MKL comes from torch's own build (libtorch_cpu exports its cblas symbols). They are looked up
// at run time, not linked: a torch built without MKL still loads this module, and the op reports
// itself missing instead. oneDNN's ops are called through torch's dispatcher, found by name.

#include "prepacked_linear_cpu.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <omp.h>

#include "parallel_cpu.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "skinny_linear_cpu.h"

namespace {

using at::Tensor;

// CBLAS's enumerations (mkl_cblas.h), spelled out since no MKL header is installed.
constexpr int kRowMajor = 101;
constexpr int kNoTrans = 111;
constexpr int kTrans = 112;
constexpr int kPacked = 151;
constexpr int kBMatrix = 162;

// Rows a GEMM call takes at the most (gemm_rows).
constexpr int64_t kRowBlock = 64;
// float32_panels: weights of at least kPanelFromValues values are split, into panels of at least kPanelValues
// values, at most kMaxPanels, each a whole number of kPanelAlign columns (WMT'19's feed-forward products in 4,
// its output layer in 8). On one thread of the Zen 4 EPYC a step's products so split took 2-13% more than whole
// at 8 to 64 rows (oneDNN's; MKL's 0-8% less), where 1024 x 1024 in 2 panels took 3-14% more: those stay whole.
// Fewer, wider panels cost more there, not less (4 of the output layer: 4-18%). docs/threads.md, "A big
// weight's panels".
constexpr int64_t kPanelFromValues = int64_t(1) << 22;
constexpr int64_t kPanelValues = int64_t(1) << 21;
constexpr int64_t kMaxPanels = 8;
constexpr int64_t kPanelAlign = 64;

// MKL_INT is 32-bit: torch links MKL's LP64 interface.
using PackGetSize = size_t (*)(int identifier, int m, int n, int k);
using Pack = void (*)(int layout, int identifier, int trans, int m, int n, int k, float alpha, const float* src,
                      int ld, float* dest);
using Compute = void (*)(int layout, int transa, int transb, int m, int n, int k, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc);
// mkl_service.h's C entry (MKL_Set_Num_Threads_Local, the int by value; the lower-case symbol is the
// Fortran one and takes a pointer): MKL's threads for the calling thread only, returning the previous.
using SetLocalThreads = int (*)(int threads);

struct Mkl {
  PackGetSize get_size = nullptr;
  Pack pack = nullptr;
  Compute compute = nullptr;
  SetLocalThreads set_local_threads = nullptr;  // absent in some MKL builds: then MKL's global setting
  std::string missing;
};

const Mkl& mkl() {
  static const Mkl found = [] {
    Mkl m;
    void* torch_cpu = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    for (void* handle : {torch_cpu, RTLD_DEFAULT}) {
      if (handle == nullptr) continue;
      m.get_size = reinterpret_cast<PackGetSize>(dlsym(handle, "cblas_sgemm_pack_get_size"));
      m.pack = reinterpret_cast<Pack>(dlsym(handle, "cblas_sgemm_pack"));
      m.compute = reinterpret_cast<Compute>(dlsym(handle, "cblas_sgemm_compute"));
      m.set_local_threads = reinterpret_cast<SetLocalThreads>(dlsym(handle, "MKL_Set_Num_Threads_Local"));
      if (m.get_size && m.pack && m.compute) return m;
    }
    m = Mkl();
    m.missing = "MKL's packed sgemm (cblas_sgemm_pack) is not in this torch build";
    return m;
  }();
  return found;
}

}  // namespace

std::string prepacked_linear_missing() { return mkl().missing; }

namespace {

// torch's oneDNN linear ops, typed as their kernels are registered (aten/src/ATen/native/mkldnn/Linear.cpp).
using LinearPointwise = Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, std::string_view,
                               c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>);
using ReorderLinearWeight = Tensor(const Tensor&, std::optional<int64_t>);

struct OneDnn {
  std::optional<c10::TypedOperatorHandle<LinearPointwise>> linear;
  std::optional<c10::TypedOperatorHandle<ReorderLinearWeight>> reorder;
  std::string missing;
};

const OneDnn& onednn() {
  static const OneDnn found = [] {
    OneDnn d;
    auto& dispatcher = c10::Dispatcher::singleton();
    const auto linear = dispatcher.findSchema({"mkldnn::_linear_pointwise", ""});
    const auto reorder = dispatcher.findSchema({"mkldnn::_reorder_linear_weight", ""});
    if (!linear || !reorder) {
      d.missing = "torch's oneDNN linear ops (mkldnn::_linear_pointwise) are not in this torch build";
      return d;
    }
    try {
      d.linear = linear->typed<LinearPointwise>();
      d.reorder = reorder->typed<ReorderLinearWeight>();
    } catch (const std::exception& e) {
      d = OneDnn();
      d.missing = std::string("torch's oneDNN linear ops have another signature in this torch: ") + e.what();
    }
    return d;
  }();
  return found;
}

}  // namespace

std::string onednn_linear_missing() { return onednn().missing; }

namespace {

// Rows of W (count, in_features), contiguous, in the GEMM's own form.
Tensor pack_panel(const Tensor& w, Float32Gemm gemm) {
  const int64_t n = w.size(0), k = w.size(1);
  if (gemm == Float32Gemm::kOneDnn) {
    const OneDnn& d = onednn();
    TORCH_CHECK(d.missing.empty(), d.missing);
    // The layout for calls of kRowBlock rows, the most one call takes (gemm_rows' blocks).
    at::NoGradGuard no_grad;
    return d.reorder->call(w, kRowBlock);
  }
  const Mkl& m = mkl();
  TORCH_CHECK(m.missing.empty(), m.missing);
  // The packed B must not depend on how many rows a call has: ask MKL for two very different row
  // counts and refuse a build whose packed size differs.
  const size_t bytes = m.get_size(kBMatrix, 1, n, k);
  TORCH_CHECK(bytes == m.get_size(kBMatrix, 4096, n, k), "prepack_linear: this MKL packs by row count");
  Tensor packed = at::empty({static_cast<int64_t>((bytes + sizeof(float) - 1) / sizeof(float))}, w.options());
  m.pack(kRowMajor, kBMatrix, kTrans, 1, n, k, 1.0f, w.data_ptr<float>(), k, packed.data_ptr<float>());
  return packed;
}

}  // namespace

std::vector<std::pair<int64_t, int64_t>> float32_panels(int64_t out_features, int64_t in_features) {
  const int64_t values = out_features * in_features;
  // ops/product.py: "off" keeps every weight whole; "all" splits every weight of two kPanelAlign columns or
  // more, into as many panels as kMaxPanels and the columns allow, so that a small model's decode (the
  // tests' toys) goes through the panelled path a WMT'19 model takes.
  const char* asked = std::getenv("FAIRSEQ_STREAM_FLOAT32_PANELS");
  const std::string mode = asked != nullptr ? asked : "";
  const bool all = mode == "all";
  if (mode == "off" || (!all && values < kPanelFromValues)) return {{0, out_features}};
  const int64_t wanted = all ? std::min(kMaxPanels, out_features / kPanelAlign)
                             : std::min(kMaxPanels, values / kPanelValues);
  if (wanted < 2) return {{0, out_features}};
  const int64_t width = ((out_features + wanted - 1) / wanted + kPanelAlign - 1) / kPanelAlign * kPanelAlign;
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t first = 0; first < out_features; first += width) {
    out.emplace_back(first, std::min(width, out_features - first));
  }
  return out;
}

PrepackedLinear prepack_linear(const Tensor& weight, std::optional<Tensor> bias, Float32Gemm gemm) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "prepack_linear: a float32 CPU weight (out, in)");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n > 0 && k > 0 && n < INT32_MAX && k < INT32_MAX, "prepack_linear: weight of ", n, " x ", k);
  if (bias) {
    TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kFloat && bias->device().is_cpu(),
                "prepack_linear: bias of ", n, " floats on the CPU");
    bias = bias->contiguous();
  }
  const Tensor w = weight.contiguous();
  std::vector<Float32Panel> panels;
  for (const auto& [first, count] : float32_panels(n, k)) {
    std::optional<Tensor> panel_bias;  // MKL's calls start from the whole bias (gemm_rows): only oneDNN's need it
    if (bias && gemm == Float32Gemm::kOneDnn) panel_bias = bias->narrow(0, first, count).contiguous();
    panels.push_back(Float32Panel{pack_panel(w.narrow(0, first, count).contiguous(), gemm), first, count,
                                  panel_bias});
  }
  return PrepackedLinear{std::move(panels), n, k, bias, w, gemm};
}

namespace {

// x as float32 rows of in_features, and the output's shape.
std::pair<Tensor, std::vector<int64_t>> rows_of(const Tensor& x, int64_t in_features, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == in_features,
              "prepacked linear: float32 CPU input of ", in_features, " features");
  auto shape = x.sizes().vec();
  shape.back() = out_features;
  return {x.contiguous().view({-1, in_features}), shape};
}

// oneDNN's product of rows (at most kRowBlock) by one panel, its bias included.
Tensor onednn_block(const Float32Panel& q, const Tensor& a) {
  return onednn().linear->call(a, q.packed, q.bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// The calling thread's GEMM on one thread while it lives; the thread's setting is restored when it goes
// (an exception from the product too). MKL has a per-thread setting of its own where the build exports it;
// oneDNN takes OpenMP's, which is the calling thread's.
class OneThreadGemm {
 public:
  explicit OneThreadGemm(bool onednn_gemm) : onednn_(onednn_gemm) {
    const Mkl& m = mkl();
    mkl_local_ = !onednn_ && m.set_local_threads != nullptr;
    if (mkl_local_) before_ = m.set_local_threads(1);
    if (onednn_) {
      before_ = omp_get_max_threads();
      omp_set_num_threads(1);
    }
  }
  ~OneThreadGemm() {
    if (mkl_local_) mkl().set_local_threads(before_);
    if (onednn_) omp_set_num_threads(before_);
  }
  OneThreadGemm(const OneThreadGemm&) = delete;
  OneThreadGemm& operator=(const OneThreadGemm&) = delete;

 private:
  bool onednn_;
  bool mkl_local_ = false;
  int before_ = 0;
};

// The GEMM's product of rows (rows, in_features), contiguous. MKL: unpacked at kUnpackedFromRows ..
// kUnpackedToRows rows, packed otherwise. Rows go in blocks of kRowBlock, each block by each panel one call.
Tensor gemm_rows(const PrepackedLinear& p, const Tensor& a) {
  const int64_t rows = a.size(0);
  const bool onednn_gemm = p.gemm == Float32Gemm::kOneDnn;
  if (!onednn_gemm && rows >= kUnpackedFromRows && rows <= kUnpackedToRows) {
    return at::linear(a, p.weight, p.bias ? *p.bias : Tensor());
  }
  if (onednn_gemm && rows == 0) return at::empty({0, p.out_features}, a.options());
  const int64_t n_panels = static_cast<int64_t>(p.panels.size());
  if (onednn_gemm && rows <= kRowBlock && n_panels == 1) {
    // One call: oneDNN's own result, no copy (on one thread where torch's ops run on one, as below).
    if (at::get_num_threads() != 1) return onednn_block(p.panels[0], a);
    OneThreadGemm one(true);
    return onednn_block(p.panels[0], a);
  }
  Tensor y = at::empty({rows, p.out_features}, a.options());
  float beta = 0.0f;
  if (p.bias && !onednn_gemm) {
    // As addmm: C starts as the bias, and the product is added with beta = 1. (A copy always:
    // with one row, expand().contiguous() would be the bias itself, and MKL would write into it.)
    y.copy_(p.bias->expand({rows, p.out_features}));
    beta = 1.0f;
  }
  const float* x = a.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const int64_t n = p.out_features, k = p.in_features;
  // MKL's bits for a row depend on how many rows share its call (on 1024 x 4096 every block size from
  // 1 to 128 rows gave other bits than 320 rows at once). So the rows always go in blocks of kRowBlock,
  // on one thread or several alike (tests/test_threads.py): at 64 rows a block costs what one call does.
  // oneDNN's blocks likewise. The panels are fixed by the weight's shape: the same calls, so the same bits,
  // whatever the threads.
  auto call = [&](int64_t task) {
    const Float32Panel& q = p.panels[task % n_panels];
    const int64_t r = (task / n_panels) * kRowBlock;
    const int64_t m = std::min(kRowBlock, rows - r);
    if (onednn_gemm) {
      // Copied as bytes: y may be an inference tensor (made under the caller's InferenceMode), which our
      // worker threads, outside it, may not update through ATen.
      const Tensor block = onednn_block(q, a.narrow(0, r, m)).contiguous();
      const float* from = block.data_ptr<float>();
      for (int64_t i = 0; i < m; ++i) {
        std::memcpy(out + (r + i) * n + q.first, from + i * q.count, sizeof(float) * q.count);
      }
      return;
    }
    mkl().compute(kRowMajor, kNoTrans, kPacked, static_cast<int>(m), static_cast<int>(q.count), static_cast<int>(k),
                  x + r * k, static_cast<int>(k), q.packed.data_ptr<float>(), static_cast<int>(k), beta,
                  out + r * n + q.first, static_cast<int>(n));
  };
  const int64_t tasks = (rows + kRowBlock - 1) / kRowBlock * n_panels;
  if (at::get_num_threads() == 1) {
    // torch's ops on one thread (ops/threads.py): the GEMM runs sequentially, our loop spreads the calls.
    // Sequentially on every thread: torch's one thread is set on the thread that set it, and MKL or oneDNN
    // on one of our workers would otherwise open an OpenMP team of all the cores, whose spinning is
    // what issue 50's collapse was, and whose split of a block changes its bits (AVX2 MKL does): each of
    // our threads sets its own GEMM to one thread (OneThreadGemm).
    fs::parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
      OneThreadGemm one(onednn_gemm);
      for (int64_t t = first; t < last; ++t) call(t);
    });
  } else {
    for (int64_t t = 0; t < tasks; ++t) call(t);
  }
  return y;
}

}  // namespace

Tensor PrepackedLinear::operator()(const Tensor& x) const {
  auto [a, shape] = rows_of(x, in_features, out_features);
  const int64_t rows = a.size(0);
  if (skinny_linear_takes(rows)) {
    Tensor y = at::empty({rows, out_features}, a.options());
    skinny_linear(a.data_ptr<float>(), rows, weight.data_ptr<float>(), out_features, in_features,
                  bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>());
    return y.view(shape);
  }
  return gemm_rows(*this, a).view(shape);
}

Tensor PrepackedLinear::gemm_product(const Tensor& x) const {
  auto [a, shape] = rows_of(x, in_features, out_features);
  return gemm_rows(*this, a).view(shape);
}
