// The lean runner's decoder and encoder layers (lean_step_cpu.cpp): their weights as the compiled
// calls take them, and one step of one model's decoder layers
// (bindings_cpu.cpp binds them). The search loops (search_loop_cpu.cpp) run them too.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/relu.h>
#include <ATen/TensorOperators.h>

#include <optional>
#include <tuple>
#include <vector>

#include "product_cpu.h"

using at::Tensor;

struct __attribute__((visibility("hidden"))) Norm {
  Tensor weight, bias;
  double eps;

  Tensor operator()(const Tensor& x) const { return at::layer_norm(x, {x.size(-1)}, weight, bias, eps); }
};

// A norm as Python hands it: (weight, bias, eps).
using NormWeights = std::tuple<Tensor, Tensor, double>;

inline Norm norm_of(const NormWeights& n) { return Norm{std::get<0>(n), std::get<1>(n), std::get<2>(n)}; }

inline std::optional<Norm> optional_norm(const std::optional<NormWeights>& n) {
  if (!n) return std::nullopt;
  return norm_of(*n);
}

enum class Activation { kRelu = 0, kGeluInFloat = 1 };

// What a decoder layer and an encoder layer share: the residual sums and the feed-forward block.
struct __attribute__((visibility("hidden"))) Sublayers {
  bool pre_norm;
  Activation activation;
  Product fc1, fc2;
  Norm final_norm;

  // x + block(x), the norm where fairseq places it (before the block, or after the sum).
  template <typename Block>
  Tensor residual(const Tensor& x, const Norm& norm, Block block) const {
    const Tensor h = pre_norm ? norm(x) : x;
    const Tensor y = x + block(h);
    return pre_norm ? y : norm(y);
  }

  Tensor activate(const Tensor& x) const {
    if (activation == Activation::kRelu) return at::relu(x);
    // fairseq's gelu: torch's, computed in float32 whatever the type.
    return at::gelu(x.to(at::kFloat)).to(x.scalar_type());
  }

  // The feed-forward sub-layer, with its residual and norm.
  Tensor feed_forward(const Tensor& x) const {
    return residual(x, final_norm, [&](const Tensor& h) { return fc2(activate(fc1(h))); });
  }
};

struct __attribute__((visibility("hidden"))) LeanLayer : Sublayers {
  Product qkv, self_out, cross_q, cross_out;
  Norm self_norm, cross_norm;
  double scaling, cross_scaling;
};

// fairseq's TransformerEncoderLayer: self-attention over the sentence, then the feed-forward block.
struct __attribute__((visibility("hidden"))) LeanEncoderLayer : Sublayers {
  Product qkv, self_out;
  Norm self_norm;
  double scaling;
  int64_t heads;
};

// The layers of one model for one step over the segments' rows (rows in segment order): each
// segment's cache (written in place), slot index or none, length, encoder keys and values per layer,
// additive mask or none, and each row's sentence; starts: the segments' first rows and the end.
Tensor lean_layers(Tensor x, const std::vector<LeanLayer>& layers, const std::vector<Tensor>& caches,
                   const std::vector<std::optional<Tensor>>& slots, const std::vector<int64_t>& lengths,
                   const std::vector<int64_t>& starts, const std::vector<std::vector<Tensor>>& enc_keys,
                   const std::vector<std::vector<Tensor>>& enc_values, const std::vector<std::optional<Tensor>>& masks,
                   const std::vector<Tensor>& row_sentences);

// The same layers for one Jacobi window call: window position n is row window_row[n]'s token at cache
// position window_step[n]; visible (positions, W) additive or none (a tree-shaped window).
Tensor lean_window_layers(Tensor x, const std::vector<LeanLayer>& layers, const Tensor& cache, const Tensor& window_row,
                          const Tensor& window_step, const std::vector<Tensor>& enc_keys,
                          const std::vector<Tensor>& enc_values, std::optional<Tensor> mask,
                          const std::optional<Tensor>& visible);

// One model's encoder layers over a batch's sources packed without padding (sentence s: rows starts[s] ..
// starts[s + 1]); sentences of at least dense_from tokens attend through batched products.
Tensor lean_encoder_layers(Tensor x, const std::vector<LeanEncoderLayer>& layers, const std::vector<int64_t>& starts,
                           int64_t dense_from);

// A layer's shared parts from Python: the norm placement, the activation (0 relu, 1 fairseq's gelu), the
// feed-forward products and their norm.
void set_sublayers(Sublayers& layer, const char* kind, bool pre_norm, int64_t activation, const Product& fc1,
                   const Product& fc2, const NormWeights& final_norm);
