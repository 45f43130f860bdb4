// One decoder step of a fairseq transformer's layers on the lean runner, in one call: what
// LeanRunner._model_step runs between the embedding and the output layer, op for op.
// fairseq_stream/ops/lean_step.py documents the op.
//
// Why: at a dozen rows a step (greedy over a batch of 64), the layers' products take about 0.4 ms
// and the Python around ~50 torch ops and our kernels about 0.7 ms more (one Xeon thread). Here
// the same ops are called from C++: the same ATen kernels, the same prepacked products and
// attention kernels, in the same order, so the results are bitwise those of the Python step.

#include "lean_step_cpu.h"

#include "attention_cpu.h"
#include "prepacked_linear_cpu.h"
#include "quantized_linear_cpu.h"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

namespace {

using torch::Tensor;

using NormWeights = std::tuple<Tensor, Tensor, double>;

Norm norm_of(const NormWeights& n) { return Norm{std::get<0>(n), std::get<1>(n), std::get<2>(n)}; }

// The parts both layer kinds take from Python: the norm placement, the activation (0 relu, 1 fairseq's
// gelu), the feed-forward products and their norm.
void set_sublayers(Sublayers& layer, const char* kind, bool pre_norm, int64_t activation, const Product& fc1,
                   const Product& fc2, const NormWeights& final_norm) {
  TORCH_CHECK(activation == 0 || activation == 1, kind, ": activation 0 (relu) or 1 (gelu in float)");
  layer.pre_norm = pre_norm;
  layer.activation = static_cast<Activation>(activation);
  layer.fc1 = fc1, layer.fc2 = fc2;
  layer.final_norm = norm_of(final_norm);
}

Tensor joined(std::vector<Tensor>& parts) { return parts.size() == 1 ? parts[0] : at::cat(parts); }

// Encoder keys and values: one tensor of each per layer (the loops index them by layer).
void check_per_layer(const std::vector<Tensor>& keys, const std::vector<Tensor>& values, size_t layers,
                     const char* op) {
  TORCH_CHECK(keys.size() == layers && values.size() == layers, op, ": encoder keys and values for each of the ",
              layers, " layers; got ", keys.size(), " and ", values.size());
}

// Segment boundaries: 0 = starts[0] <= starts[1] <= ... <= starts.back() = rows.
void check_starts(const std::vector<int64_t>& starts, int64_t rows, const char* op) {
  TORCH_CHECK(!starts.empty() && starts.front() == 0 && starts.back() == rows &&
                  std::is_sorted(starts.begin(), starts.end()),
              op, ": starts must run in order from 0 to the ", rows, " rows");
}

// The layers of one model for one Jacobi window call (runners/lean_window.py, op for op): window
// position n is row window_row[n]'s token at cache position window_step[n] (row = sentence), x and
// the result (positions, dim).
Tensor lean_window_layers(Tensor x, const std::vector<LeanLayer>& layers, const Tensor& cache, const Tensor& window_row,
                          const Tensor& window_step, const std::vector<Tensor>& enc_keys,
                          const std::vector<Tensor>& enc_values, std::optional<Tensor> mask,
                          const std::optional<Tensor>& visible) {
  check_per_layer(enc_keys, enc_values, layers.size(), "lean_window_layers");
  TORCH_CHECK(x.dim() == 2, "lean_window_layers: x must be (positions, dim)");
  const int64_t D = x.size(-1);
  for (size_t l = 0; l < layers.size(); ++l) {
    const LeanLayer& layer = layers[l];
    x = layer.residual(x, layer.self_norm, [&](const Tensor& h) {
      const Tensor qkv = layer.qkv(h);
      return layer.self_out(window_attention_(qkv.slice(1, 0, D), qkv.slice(1, D, 2 * D), qkv.slice(1, 2 * D, 3 * D),
                                              cache.select(0, 2 * l), cache.select(0, 2 * l + 1), window_row,
                                              window_step, layer.scaling, visible));
    });
    x = layer.residual(x, layer.cross_norm, [&](const Tensor& h) {
      return layer.cross_out(
          source_attention(layer.cross_q(h), enc_keys[l], enc_values[l], window_row, mask, layer.cross_scaling));
    });
    x = layer.feed_forward(x);
  }
  return x;
}

// The layers of one model's encoder over a batch's sources packed without padding: sentence s is
// rows starts[s] .. starts[s + 1] of x (tokens, dim), and each token attends over its own sentence.
// fairseq's encoder runs every padded position of the batch's longest source; here a token costs the
// same whatever the batch, and the Python and dispatch around ~15 ops a layer are paid once.
Tensor lean_encoder_layers(Tensor x, const std::vector<LeanEncoderLayer>& layers, const std::vector<int64_t>& starts,
                           int64_t dense_from) {
  for (const LeanEncoderLayer& layer : layers) {
    x = layer.residual(x, layer.self_norm, [&](const Tensor& h) {
      return layer.self_out(sentence_attention(layer.qkv(h), starts, layer.heads, layer.scaling, dense_from));
    });
    x = layer.feed_forward(x);
  }
  return x;
}

}  // namespace

// The layers of one model for one step over the segments' rows (rows in segment order).
Tensor lean_layers(Tensor x, const std::vector<LeanLayer>& layers, const std::vector<Tensor>& caches,
                   const std::vector<std::optional<Tensor>>& slots, const std::vector<int64_t>& lengths,
                   const std::vector<int64_t>& starts, const std::vector<std::vector<Tensor>>& enc_keys,
                   const std::vector<std::vector<Tensor>>& enc_values, const std::vector<std::optional<Tensor>>& masks,
                   const std::vector<Tensor>& row_sentences) {
  const size_t segments = caches.size();
  TORCH_CHECK(slots.size() == segments && lengths.size() == segments && starts.size() == segments + 1 &&
                  enc_keys.size() == segments && enc_values.size() == segments && masks.size() == segments &&
                  row_sentences.size() == segments,
              "lean_layers: one entry per segment in every list (starts: one more)");
  TORCH_CHECK(x.dim() == 2, "lean_layers: x must be (rows, dim)");
  check_starts(starts, x.size(0), "lean_layers");
  for (size_t s = 0; s < segments; ++s) check_per_layer(enc_keys[s], enc_values[s], layers.size(), "lean_layers");
  const int64_t D = x.size(-1);
  std::vector<Tensor> outs(segments);
  for (size_t l = 0; l < layers.size(); ++l) {
    const LeanLayer& layer = layers[l];
    x = layer.residual(x, layer.self_norm, [&](const Tensor& h) {
      const Tensor qkv = layer.qkv(h);
      const Tensor q = qkv.slice(1, 0, D), k = qkv.slice(1, D, 2 * D), v = qkv.slice(1, 2 * D, 3 * D);
      for (size_t s = 0; s < segments; ++s) {
        const int64_t a = starts[s], b = starts[s + 1];
        outs[s] = cached_attention_(q.slice(0, a, b), k.slice(0, a, b), v.slice(0, a, b), caches[s].select(0, 2 * l),
                                    caches[s].select(0, 2 * l + 1), slots[s], lengths[s], layer.scaling);
      }
      return layer.self_out(joined(outs));
    });
    x = layer.residual(x, layer.cross_norm, [&](const Tensor& h) {
      const Tensor q = layer.cross_q(h);
      for (size_t s = 0; s < segments; ++s) {
        outs[s] = source_attention(q.slice(0, starts[s], starts[s + 1]), enc_keys[s][l], enc_values[s][l],
                                   row_sentences[s], masks[s], layer.cross_scaling);
      }
      return layer.cross_out(joined(outs));
    });
    x = layer.feed_forward(x);
  }
  return x;
}

// The three calls run without the GIL (they touch no Python object): the encoder thread
// (schedule/read_ahead.py) encodes while the decoder's layers run, and the other way round. Holding
// it, a batch's whole encoder call would stall the decoder's Python for its duration.
void register_lean_step(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<Product>(m, "LeanProduct",
                      "x W^T + b for lean_layers: a PrepackedLinear, a QuantizedLinear, or a weight and bias")
      .def(py::init([](const PrepackedLinear& p) { return Product{p, std::nullopt, Tensor(), std::nullopt}; }),
           py::arg("packed"))
      .def(py::init([](const QuantizedLinear& q) { return Product{std::nullopt, q, Tensor(), std::nullopt}; }),
           py::arg("quantized"))
      .def(py::init([](Tensor w, std::optional<Tensor> b) { return Product{std::nullopt, std::nullopt, w, b}; }),
           py::arg("weight"), py::arg("bias"));
  py::class_<LeanLayer>(m, "LeanLayer", "one decoder layer's weights for lean_layers (see ops/lean_step.py)")
      .def(py::init([](bool pre_norm, std::vector<Product> products, std::vector<NormWeights> norms, double scaling,
                       double cross_scaling, int64_t activation) {
             TORCH_CHECK(products.size() == 6 && norms.size() == 3, "LeanLayer: 6 products and 3 norms");
             LeanLayer layer;
             set_sublayers(layer, "LeanLayer", pre_norm, activation, products[4], products[5], norms[2]);
             layer.qkv = products[0], layer.self_out = products[1], layer.cross_q = products[2];
             layer.cross_out = products[3];
             layer.self_norm = norm_of(norms[0]), layer.cross_norm = norm_of(norms[1]);
             layer.scaling = scaling, layer.cross_scaling = cross_scaling;
             return layer;
           }),
           py::arg("pre_norm"), py::arg("products"), py::arg("norms"), py::arg("scaling"), py::arg("cross_scaling"),
           py::arg("activation"));
  py::class_<LeanEncoderLayer>(m, "LeanEncoderLayer", "one encoder layer's weights for lean_encoder_layers")
      .def(py::init([](bool pre_norm, std::vector<Product> products, std::vector<NormWeights> norms, double scaling,
                       int64_t activation, int64_t heads) {
             TORCH_CHECK(products.size() == 4 && norms.size() == 2, "LeanEncoderLayer: 4 products and 2 norms");
             TORCH_CHECK(heads > 0, "LeanEncoderLayer: heads > 0");
             LeanEncoderLayer layer;
             set_sublayers(layer, "LeanEncoderLayer", pre_norm, activation, products[2], products[3], norms[1]);
             layer.qkv = products[0], layer.self_out = products[1];
             layer.self_norm = norm_of(norms[0]);
             layer.scaling = scaling, layer.heads = heads;
             return layer;
           }),
           py::arg("pre_norm"), py::arg("products"), py::arg("norms"), py::arg("scaling"), py::arg("activation"),
           py::arg("heads"));
  m.def("lean_encoder_layers", &lean_encoder_layers,
        "(x (tokens, dim): the batch's sources packed, layers, starts (sentences + 1), dense_from: sentences of at "
        "least this many tokens attend through batched products) -> (tokens, dim)",
        py::arg("x"), py::arg("layers"), py::arg("starts"), py::arg("dense_from"), py::call_guard<py::gil_scoped_release>());
  m.def("lean_layers", &lean_layers,
        "(x (rows, dim), layers, per segment: caches, slot or None, length; starts (segments + 1), per segment: "
        "encoder keys [layers], values [layers], mask or None, row_sentence) -> (rows, dim)",
        py::arg("x"), py::arg("layers"), py::arg("caches"), py::arg("slots"), py::arg("lengths"), py::arg("starts"),
        py::arg("enc_keys"), py::arg("enc_values"), py::arg("masks"), py::arg("row_sentences"),
        py::call_guard<py::gil_scoped_release>());
  m.def("lean_window_layers", &lean_window_layers,
        "(x (positions, dim), layers, cache, window_row, window_step (positions,), encoder keys [layers], "
        "values [layers], mask or None, visible (positions, W) additive or None: a tree-shaped window) -> "
        "(positions, dim)",
        py::arg("x"), py::arg("layers"), py::arg("cache"), py::arg("window_row"), py::arg("window_step"),
        py::arg("enc_keys"), py::arg("enc_values"), py::arg("mask"), py::arg("visible") = py::none(),
        py::call_guard<py::gil_scoped_release>());
}
