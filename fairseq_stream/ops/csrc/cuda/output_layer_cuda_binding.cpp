// ATen binding of the CUDA output layer (output_layer_cuda.cu holds the kernels). Arguments
// are checked again here because this module can be called directly; the Python wrapper
// (fairseq_stream/ops/output_layer.py) documents them.

#include <ATen/ops/empty.h>
#include <torch/python.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <optional>
#include <vector>

#include "../output_layer_binding.h"
#include "beam_step_cuda_binding.h"
#include "cache_slots_cuda_binding.h"
#include "indexed_attention_cuda_binding.h"
#include "output_layer_cuda.h"

namespace {

using fairseq_stream::OutputLayerArgs;

// Looked up once per device: the split of rows over the vocabulary depends on it.
int multiprocessors(int device) {
  static int cached[64] = {0};
  if (device < 0 || device >= 64) return 0;
  if (!cached[device]) {
    int count = 0;
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) == cudaSuccess) cached[device] = count;
  }
  return cached[device];
}
using fairseq_stream::OutputLayerType;

std::vector<at::Tensor> topk_log_softmax(const std::vector<at::Tensor>& logits, const std::vector<at::Tensor>& bias,
                                         int64_t n, int64_t pad, int64_t eos, int64_t unk, double unk_penalty,
                                         double temperature, bool ban_all, const std::optional<at::Tensor>& ban_eos,
                                         const std::optional<at::Tensor>& force_eos,
                                         const std::optional<at::Tensor>& add) {
  TORCH_CHECK(!logits.empty() && logits.size() <= static_cast<size_t>(fairseq_stream::kOutputLayerMaxModels),
              "logits: 1 to ", fairseq_stream::kOutputLayerMaxModels, " models");
  const at::Tensor& x0 = logits[0];
  TORCH_CHECK(x0.is_cuda() && x0.dim() == 2, "logits must be (rows, V) CUDA tensors");
  const auto type = x0.scalar_type();
  OutputLayerType code;
  switch (type) {
    case at::kFloat: code = OutputLayerType::kFloat; break;
    case at::kDouble: code = OutputLayerType::kDouble; break;
    case at::kHalf: code = OutputLayerType::kHalf; break;
    case at::kBFloat16: code = OutputLayerType::kBFloat16; break;
    default: TORCH_CHECK(false, "logits must be float16, bfloat16, float32 or float64");
  }
  const int64_t rows = x0.size(0), V = x0.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t(1) << 31) && rows < (int64_t(1) << 31), "rows or V out of range");
  TORCH_CHECK(n >= 1 && n <= V && n <= fairseq_stream::kOutputLayerMaxN, "n must be in [1, min(V, ",
              fairseq_stream::kOutputLayerMaxN, ")]");
  TORCH_CHECK(pad >= 0 && pad < V && eos >= 0 && eos < V && unk < V, "pad, eos, unk out of range");
  const c10::cuda::CUDAGuard guard(x0.device());
  OutputLayerArgs a{};
  a.type = code;
  a.models = static_cast<int>(logits.size());
  a.rows = rows;
  a.vocab = static_cast<int>(V);
  a.n = static_cast<int>(n);
  for (size_t m = 0; m < logits.size(); ++m) {
    const auto& x = logits[m];
    TORCH_CHECK(x.device() == x0.device() && x.is_contiguous() && x.sizes() == x0.sizes() && x.scalar_type() == type,
                "logits: contiguous tensors of one shape, dtype and device");
    a.logits[m] = x.data_ptr();
  }
  TORCH_CHECK(bias.empty() || bias.size() == logits.size(), "bias: none or one per model");
  a.has_bias = !bias.empty();
  for (size_t m = 0; m < bias.size(); ++m) {
    const auto& b = bias[m];
    TORCH_CHECK(b.device() == x0.device() && b.is_contiguous() && b.dim() == 1 && b.size(0) == V &&
                    b.scalar_type() == type,
                "bias: contiguous (V,) tensors of the logits' dtype and device");
    a.bias[m] = b.data_ptr();
  }
  const auto out_type = type == at::kDouble ? at::kDouble : at::kFloat;
  auto check_rows = [&](const std::optional<at::Tensor>& t, at::ScalarType want, const char* name) {
    if (!t) return;
    TORCH_CHECK(t->device() == x0.device() && t->is_contiguous() && t->dim() == 1 && t->size(0) == rows &&
                    t->scalar_type() == want,
                name, ": a contiguous (rows,) tensor of the right dtype on the logits' device");
  };
  check_rows(ban_eos, at::kBool, "ban_eos");
  check_rows(force_eos, at::kBool, "force_eos");
  check_rows(add, out_type, "add");
  a.temperature = temperature;
  a.pad = static_cast<int>(pad);
  a.eos = static_cast<int>(eos);
  a.unk = static_cast<int>(unk);
  a.unk_penalty = unk_penalty;
  a.ban_all = ban_all;
  a.ban = ban_eos ? ban_eos->data_ptr<bool>() : nullptr;
  a.force = force_eos ? force_eos->data_ptr<bool>() : nullptr;
  a.add = add ? add->data_ptr() : nullptr;

  auto values = at::empty({rows, n}, x0.options().dtype(out_type));
  auto indices = at::empty({rows, n}, x0.options().dtype(at::kLong));
  auto eos_out = at::empty({rows}, x0.options().dtype(out_type));
  a.values = values.data_ptr();
  a.indices = indices.data_ptr<int64_t>();
  a.eos_out = eos_out.data_ptr();
  a.multiprocessors = multiprocessors(x0.device().index());
  if (rows == 0) return {values, indices, eos_out};

  const size_t bytes = fairseq_stream::output_layer_workspace_bytes(a);
  at::Tensor workspace;
  if (bytes) workspace = at::empty({static_cast<int64_t>(bytes)}, x0.options().dtype(at::kByte));
  const cudaError_t err = fairseq_stream::output_layer_launch(a, bytes ? workspace.data_ptr() : nullptr,
                                                              c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "fused output layer: ", cudaGetErrorString(err));
  return {values, indices, eos_out};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fairseq-stream CUDA kernels: the fused output layer (log-softmax + search rules + top-n per row), "
            "the search step, the indexed attention and the cache slot copy";
  def_topk_log_softmax(m, &topk_log_softmax);
  m.def("fairseq_select", &fairseq_select_cuda,
        "One search step with fairseq's finalization on CUDA tensors (and the pruning heuristics rp, ap, rpl, mc; "
        "negative: off); the CPU op's results, see fairseq_stream/ops/beam_step.py");
  m.def("stay_select", &stay_select_cuda,
        "One search step with the streaming paper's rule on CUDA tensors (and the pruning heuristics); the CPU op's "
        "results, see fairseq_stream/ops/beam_step.py");
  m.def("reorder_beam_", &reorder_beam_cuda,
        "In place on CUDA tensors: rows take their parent's token and score histories and, where extended, the new "
        "token and score; see fairseq_stream/ops/beam_step.py");
  m.def("indexed_attention", &indexed_attention_cuda, "One query a row over the cached keys and values of slot "
        "index[row] (a mask by slot, or positions up to lengths[row]); see fairseq_stream/ops/attention.py",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("index"), py::arg("mask"), py::arg("lengths"),
        py::arg("scale"));
  m.def("copy_cache_slots_", &copy_cache_slots_cuda, "In place on a CUDA cache: positions 0..length-1 of each source "
        "slot copied to its target slot (an entry whose source is its target copies nothing); see "
        "fairseq_stream/ops/attention.py", py::arg("cache"), py::arg("source"), py::arg("target"), py::arg("length"));
}
