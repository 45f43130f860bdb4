// Greedy decoding of one sentence on the lean runner, the whole loop in one call: the embedding, every
// model's layers (lean_layers), the output layer and the fused log-softmax + rules + argmax
// (topk_log_softmax), step after step until EOS. fairseq_stream/ops/greedy_loop.py documents it.
//
// Why: one sentence at a time, a greedy step of the Multi30k transformer costs about 0.1 ms of
// products in int8 but about 0.1 ms more of Python around them (the runner's step, the decoder's
// candidates, selection and bookkeeping, each a dozen small torch calls). The loop here calls the
// same ATen ops and kernels, in the same order, as the Python loop does for one sentence with beam 1,
// so its tokens and scores are bitwise those of the Python loop (tests/test_greedy_loop.py).

#include "greedy_loop_cpu.h"

#include <optional>
#include <vector>

#include "lean_step_cpu.h"
#include "output_layer_cpu.h"

namespace {

using NormWeights = std::tuple<Tensor, Tensor, double>;

std::optional<Norm> optional_norm(const std::optional<NormWeights>& n) {
  if (!n) return std::nullopt;
  return Norm{std::get<0>(*n), std::get<1>(*n), std::get<2>(*n)};
}

}  // namespace

Tensor LeanDecoderModel::embed_at(const Tensor& token, int64_t position) const {
  // LeanModel.embed_at, op for op.
  Tensor x = at::mul(at::embedding(embed, token), embed_scale);
  if (project_in) x = (*project_in)(x);
  if (positions) x = at::add(x, positions->select(0, position));
  if (embed_norm) x = (*embed_norm)(x);
  return x;
}

Tensor LeanDecoderModel::logits(Tensor x) const {
  // LeanModel.logits, op for op.
  if (final_norm) x = (*final_norm)(x);
  if (project_out) x = (*project_out)(x);
  return output(x);
}

std::vector<Tensor> greedy_decode(const std::vector<LeanDecoderModel>& models,
                                  const std::vector<std::vector<Tensor>>& enc_keys,
                                  const std::vector<std::vector<Tensor>>& enc_values,
                                  const std::vector<std::optional<Tensor>>& masks, int64_t bos, int64_t max_len,
                                  int64_t min_len, int64_t pad, int64_t eos, int64_t unk, double unk_penalty,
                                  double temperature) {
  const size_t M = models.size();
  TORCH_CHECK(M > 0 && enc_keys.size() == M && enc_values.size() == M && masks.size() == M,
              "greedy_decode: one model, its encoder keys, values and mask each");
  TORCH_CHECK(max_len >= 0, "greedy_decode: max_len >= 0");
  const auto options = models[0].embed.options();
  std::vector<Tensor> caches;
  for (const auto& m : models) {
    // Every position the sentence can reach, allocated once (the Python runner doubles from 32): an
    // attention reads only the positions written, so the capacity changes no result.
    caches.push_back(at::empty({2 * static_cast<int64_t>(m.layers.size()), 1, m.heads, max_len + 1, m.head_dim},
                               options));
  }
  const Tensor row_sentence = at::zeros({1}, options.dtype(at::kLong));
  const std::vector<int64_t> starts{0, 1};
  const std::vector<std::optional<Tensor>> no_slot{std::nullopt};
  const std::optional<Tensor> force = at::ones({1}, options.dtype(at::kBool));
  std::vector<int64_t> tokens;
  std::vector<float> cumulative;
  Tensor token = at::full({1}, bos, options.dtype(at::kLong));
  float total = 0.f;
  for (int64_t step = 0; step <= max_len; ++step) {
    std::vector<Tensor> logits;
    for (size_t i = 0; i < M; ++i) {
      const LeanDecoderModel& m = models[i];
      Tensor x = m.embed_at(token, m.padding_idx + step + 1);
      x = lean_layers(x, m.layers, {caches[i]}, no_slot, {step}, starts, {enc_keys[i]}, {enc_values[i]},
                      {masks[i]}, {row_sentence});
      logits.push_back(m.logits(x).contiguous());
    }
    const auto out = topk_log_softmax(logits, {}, 1, pad, eos, unk, unk_penalty, temperature, step < min_len,
                                      std::nullopt, step >= max_len ? force : std::nullopt, std::nullopt);
    const int64_t word = out[1].item<int64_t>();
    // The decoder's candidate score: the word's log-probability plus the prefix's (float32 additions).
    total = step == 0 ? out[0].item<float>() : total + out[0].item<float>();
    tokens.push_back(word);
    cumulative.push_back(total);
    if (word == eos) break;
    token.fill_(word);
  }
  const int64_t n = static_cast<int64_t>(tokens.size());
  Tensor words = at::empty({n}, options.dtype(at::kLong));
  Tensor scores = at::empty({n}, options.dtype(at::kFloat));
  std::copy(tokens.begin(), tokens.end(), words.data_ptr<int64_t>());
  std::copy(cumulative.begin(), cumulative.end(), scores.data_ptr<float>());
  return {words, scores};
}

void register_greedy_loop(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<LeanDecoderModel>(m, "LeanDecoderModel",
                               "one model's decoder for greedy_decode: embedding, layers, output layer")
      .def(py::init([](Tensor embed, double embed_scale, std::optional<Tensor> positions,
                       std::optional<Product> project_in, std::optional<NormWeights> embed_norm,
                       std::vector<LeanLayer> layers, std::optional<NormWeights> final_norm,
                       std::optional<Product> project_out, Product output, int64_t padding_idx, int64_t heads,
                       int64_t head_dim) {
             return LeanDecoderModel{embed, embed_scale, positions, project_in, optional_norm(embed_norm),
                                     std::move(layers), optional_norm(final_norm), project_out, output,
                                     padding_idx, heads, head_dim};
           }),
           py::arg("embed"), py::arg("embed_scale"), py::arg("positions"), py::arg("project_in"),
           py::arg("embed_norm"), py::arg("layers"), py::arg("final_norm"), py::arg("project_out"),
           py::arg("output"), py::arg("padding_idx"), py::arg("heads"), py::arg("head_dim"));
  m.def("greedy_decode", &greedy_decode,
        "(models, per model: encoder keys [layers], values [layers], mask or None; bos, max_len, min_len, pad, "
        "eos, unk (-1: none), unk_penalty, temperature) -> [words (steps,), cumulative scores (steps,) float32]",
        py::arg("models"), py::arg("enc_keys"), py::arg("enc_values"), py::arg("masks"), py::arg("bos"),
        py::arg("max_len"), py::arg("min_len"), py::arg("pad"), py::arg("eos"), py::arg("unk"),
        py::arg("unk_penalty"), py::arg("temperature"), py::call_guard<py::gil_scoped_release>());
}
