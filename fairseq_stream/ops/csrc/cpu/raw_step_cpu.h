// One float32 model's decoder step over a few rows on buffers kept for a whole search (raw_step_cpu.cpp):
// the search loops' step where it applies, the same bits as lean_layers and the output layer.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "layer_norm_kernel_cpu.h"
#include "search_loop_cpu.h"

class __attribute__((visibility("hidden"))) RawStep {
 public:
  // Whether the step runs here: float32, no input or output projection, at most kSkinnyMaxRows rows.
  static bool fits(const LeanDecoderModel& m, int64_t rows);

  // Whether the model's and the encoder's shapes are those the buffers and raw loops assume (every product,
  // norm and encoder table of the model's width, heads * head_dim; `sentences` sentences): they read and
  // write through raw pointers, where the ATen path checks its shapes. False: the search takes that path.
  static bool consistent(const LeanDecoderModel& m, const std::vector<Tensor>& enc_keys,
                         const std::vector<Tensor>& enc_values, const std::optional<Tensor>& mask, int64_t sentences);

  // Whether a step of `rows` rows fits the buffers (made for the most rows the search's steps have here).
  bool takes(int64_t rows) const { return rows <= x_.size(0); }

  // For `m` over sentences whose encoder keys and values (per layer) and mask are these, up to `rows` rows.
  RawStep(const LeanDecoderModel& m, const std::vector<Tensor>& enc_keys, const std::vector<Tensor>& enc_values,
          const std::optional<Tensor>& mask, int64_t rows);

  // The logits (rows, V) of the rows' last tokens at `step`, each row's cache slot and sentence given; the
  // caches (2 * layers, slots, heads, capacity, head_dim) get the step's keys and values. The result is a
  // buffer of this object, valid until the next call.
  Tensor logits(const Tensor& cache, const int64_t* last, const int64_t* sentence, const int64_t* slot, int64_t rows,
                int64_t step);

 private:
  const LeanDecoderModel& m_;
  const std::vector<Tensor>& enc_keys_;
  const std::vector<Tensor>& enc_values_;
  Tensor mask_;
  std::vector<int64_t> first_, span_;
  Tensor x_, y_, h_, qkv_, attn_, hidden_, out_;  // rows of: states (x_, y_, h_), q k v, attention, fc1, logits
  LayerNormKernelFn norm_kernel_ = nullptr;      // ATen's layer-norm kernel on the buffers, or null: native_layer_norm

  void norm(const Norm& n, const Tensor& in, Tensor& out, int64_t rows);
  void layer(const LeanLayer& layer, size_t l, const Tensor& cache, const int64_t* sentence, const int64_t* slot,
             int64_t rows, int64_t step);
};
