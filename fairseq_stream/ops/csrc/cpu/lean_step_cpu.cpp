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

#include <ATen/ops/cat.h>
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

namespace {

using at::Tensor;

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

}  // namespace

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
