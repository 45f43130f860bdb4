// One float32 model's decoder step over a few rows, on buffers kept for the whole search: the search
// loops' step (search_loop_cpu.cpp) where RawStep::fits, the same arithmetic as lean_layers and the
// output layer, so the same bits (tests/test_search_loop.py runs the loops against the Python loop).
//
// Why: one sentence at a time in float32, a Multi30k step reads its 19.2 MB of weights in about 565 us
// (one Xeon thread at its memory ceiling; CTranslate2's products take as long), and the ~170 ATen calls
// around the products (allocations, views, slices, adds, layer norms, each with its dispatch and
// TensorImpl) about 100 us more, which CTranslate2 does not spend. Here the products write into kept
// buffers (the skinny product adds the residual and applies relu over each tile it finished), attention
// runs on raw rows, and the layer norm is ATen's own kernel called on the buffers: a step makes a few
// ATen calls.

#include "raw_step_cpu.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/native_layer_norm.h>
#include <cstring>

#include "attention_cpu.h"
#include "layer_norm_kernel_cpu.h"
#include "skinny_linear_cpu.h"

namespace {

// out (rows, n) = p(in (rows, k)), then relu, then + residual (rows, n), all contiguous: the skinny
// product on the buffers where it runs; else the product's own call, its result finished here with the
// same float operations.
void product_into(const Product& p, const float* in, int64_t rows, float* out, const float* residual = nullptr,
                  bool relu = false) {
  if (p.packed && skinny_linear_takes(rows)) {
    const PrepackedLinear& w = *p.packed;
    skinny_linear(in, rows, w.weight.data_ptr<float>(), w.out_features, w.in_features,
                  w.bias ? w.bias->data_ptr<float>() : nullptr, out, residual, relu);
    return;
  }
  const Tensor x = at::from_blob(const_cast<float*>(in), {rows, p.in_features()}, at::kFloat);
  const Tensor y = p(x).contiguous();
  const float* v = y.data_ptr<float>();
  for (int64_t i = 0, count = y.numel(); i < count; ++i)
    out[i] = relu_then_residual(v[i], relu, residual != nullptr ? residual + i : nullptr);
}

// Whether ATen's kernel reads this norm's weight and bias as native_layer_norm would: float32 and
// contiguous (or absent), as the kernel reads them from their data pointers.
bool kernel_takes(const Norm& n) {
  for (const Tensor* t : {&n.weight, &n.bias})
    if (t->defined() && (t->scalar_type() != at::kFloat || !t->is_contiguous())) return false;
  return true;
}

// A norm of width D: its weight and bias (where present) hold D values each, as ATen's kernel reads them.
bool norm_of_width(const Norm& n, int64_t D) {
  for (const Tensor* t : {&n.weight, &n.bias})
    if (t->defined() && t->numel() != D) return false;
  return true;
}

// A product from `in` features to `out` (out < 0: any).
bool maps(const Product& p, int64_t in, int64_t out) {
  if (!p.packed && !p.quantized && p.weight.dim() != 2) return false;
  return p.in_features() == in && (out < 0 || p.out_features() == out);
}

// Every layer's products and norms of the model's width D (the feed-forward's own width in between).
bool layers_fit(const LeanDecoderModel& m, int64_t D) {
  for (const LeanLayer& layer : m.layers) {
    const bool attention = maps(layer.qkv, D, 3 * D) && maps(layer.self_out, D, D) && maps(layer.cross_q, D, D) &&
                           maps(layer.cross_out, D, D);
    const bool feed_forward = maps(layer.fc1, D, -1) && maps(layer.fc2, layer.fc1.out_features(), D);
    const bool norms = norm_of_width(layer.self_norm, D) && norm_of_width(layer.cross_norm, D) &&
                       norm_of_width(layer.final_norm, D);
    if (!attention || !feed_forward || !norms) return false;
  }
  return maps(m.output, D, -1) && (!m.embed_norm || norm_of_width(*m.embed_norm, D)) &&
         (!m.final_norm || norm_of_width(*m.final_norm, D));
}

// One (S, heads, T, head_dim) float32 table of keys and one of values per layer, all of one shape (the spans
// are layer 0's), S covering the sentences; the mask (S, T) where present.
bool encoder_fits(const LeanDecoderModel& m, const std::vector<Tensor>& keys, const std::vector<Tensor>& values,
                  const std::optional<Tensor>& mask, int64_t sentences) {
  if (keys.size() != m.layers.size() || values.size() != m.layers.size() || keys.empty()) return false;
  const Tensor& first = keys[0];
  if (first.dim() != 4 || first.size(0) < sentences || first.size(1) != m.heads || first.size(3) != m.head_dim)
    return false;
  for (size_t l = 0; l < keys.size(); ++l)
    for (const Tensor* t : {&keys[l], &values[l]})
      if (t->sizes() != first.sizes() || t->scalar_type() != at::kFloat || !t->device().is_cpu()) return false;
  return !mask || (mask->scalar_type() == at::kFloat && mask->device().is_cpu() &&
                   mask->numel() == first.size(0) * first.size(2));
}

}  // namespace

bool RawStep::consistent(const LeanDecoderModel& m, const std::vector<Tensor>& enc_keys,
                         const std::vector<Tensor>& enc_values, const std::optional<Tensor>& mask, int64_t sentences) {
  if (m.embed.dim() != 2 || m.layers.empty() || m.heads < 1 || m.head_dim < 1) return false;
  const int64_t D = m.embed.size(1);
  if (m.heads * m.head_dim != D) return false;
  if (m.positions && (m.positions->dim() != 2 || m.positions->size(1) != D || m.positions->scalar_type() != at::kFloat))
    return false;
  return layers_fit(m, D) && encoder_fits(m, enc_keys, enc_values, mask, sentences);
}

bool RawStep::fits(const LeanDecoderModel& m, int64_t rows) {
  if (m.embed.dim() != 2 || m.embed.scalar_type() != at::kFloat || m.embed.stride(1) != 1 || m.project_in || m.project_out || rows < 1 ||
      rows > kSkinnyMaxRows)
    return false;
  if (m.positions && !m.positions->is_contiguous()) return false;
  for (const LeanLayer& layer : m.layers)
    if (layer.activation != Activation::kRelu) return false;
  return true;
}

RawStep::RawStep(const LeanDecoderModel& m, const std::vector<Tensor>& enc_keys, const std::vector<Tensor>& enc_values,
                 const std::optional<Tensor>& mask, int64_t rows)
    : m_(m), enc_keys_(enc_keys), enc_values_(enc_values) {
  const int64_t S = enc_keys[0].size(0), T = enc_keys[0].size(2);
  if (mask) mask_ = mask->contiguous();
  std::tie(first_, span_) = source_spans<float>(mask ? mask_.data_ptr<float>() : nullptr, S, T);
  const int64_t D = m.embed.size(1);
  int64_t widest = 0;  // the feed-forward's hidden width, the widest of the layers'
  for (const LeanLayer& layer : m.layers) widest = std::max(widest, layer.fc1.out_features());
  const auto options = m.embed.options();
  x_ = at::empty({rows, D}, options), y_ = at::empty({rows, D}, options), h_ = at::empty({rows, D}, options);
  qkv_ = at::empty({rows, 3 * D}, options), attn_ = at::empty({rows, D}, options);
  hidden_ = at::empty({rows, widest}, options), out_ = at::empty({rows, m.output.out_features()}, options);
  bool plain = (!m.embed_norm || kernel_takes(*m.embed_norm)) && (!m.final_norm || kernel_takes(*m.final_norm));
  for (const LeanLayer& layer : m.layers)
    plain = plain && kernel_takes(layer.self_norm) && kernel_takes(layer.cross_norm) && kernel_takes(layer.final_norm);
  if (plain) norm_kernel_ = aten_layer_norm_kernel();
}

void RawStep::norm(const Norm& n, const Tensor& in, Tensor& out, int64_t rows) {
  if (norm_kernel_) {
    norm_kernel_(in, n.weight, n.bias, rows, in.size(1), n.eps, &out, nullptr, nullptr);
    return;
  }
  // at::layer_norm is native_layer_norm's first result: the same kernel, one dispatch fewer.
  const Tensor x = in.narrow(0, 0, rows);
  const Tensor y = std::get<0>(at::native_layer_norm(x, {x.size(1)}, n.weight, n.bias, n.eps));
  std::memcpy(out.data_ptr<float>(), y.data_ptr<float>(), sizeof(float) * y.numel());
}

void RawStep::layer(const LeanLayer& layer, size_t l, const Tensor& cache, const int64_t* sentence,
                    const int64_t* slot, int64_t rows, int64_t step) {
  const int64_t D = x_.size(1), H = m_.heads, hd = m_.head_dim;
  // Sublayers::residual: x + block(norm(x)) before, or norm(x + block(x)) after (x_ holds the result).
  auto residual = [&](const Norm& n, auto block) {
    if (layer.pre_norm) norm(n, x_, h_, rows);
    block(layer.pre_norm ? h_ : x_, y_);
    if (layer.pre_norm)
      std::swap(x_, y_);
    else
      norm(n, y_, x_, rows);
  };
  residual(layer.self_norm, [&](const Tensor& h, Tensor& y) {
    product_into(layer.qkv, h.data_ptr<float>(), rows, qkv_.data_ptr<float>());
    const float* q = qkv_.data_ptr<float>();
    const int64_t stride = qkv_.size(1);
    float* keys = cache.data_ptr<float>() + (2 * l) * cache.stride(0);
    float* values = keys + cache.stride(0);
    const CachedRows<float> attention{q, q + D, q + 2 * D, stride, stride, stride, keys, values,
                                      slot, H, cache.size(3), hd, step, static_cast<float>(layer.scaling),
                                      attn_.data_ptr<float>()};
    attention.run(0, rows * H);
    product_into(layer.self_out, attn_.data_ptr<float>(), rows, y.data_ptr<float>(), x_.data_ptr<float>());
  });
  residual(layer.cross_norm, [&](const Tensor& h, Tensor& y) {
    product_into(layer.cross_q, h.data_ptr<float>(), rows, qkv_.data_ptr<float>());  // rows of D
    const Tensor& keys = enc_keys_[l];
    const float* mask = mask_.defined() ? mask_.data_ptr<float>() : nullptr;
    const SourceRows<float> attention{qkv_.data_ptr<float>(), D, keys.data_ptr<float>(),
                                      enc_values_[l].data_ptr<float>(), mask, first_.data(), span_.data(), sentence,
                                      H, keys.size(2), hd, static_cast<float>(layer.cross_scaling),
                                      attn_.data_ptr<float>()};
    attention.run(0, rows * H);
    product_into(layer.cross_out, attn_.data_ptr<float>(), rows, y.data_ptr<float>(), x_.data_ptr<float>());
  });
  residual(layer.final_norm, [&](const Tensor& h, Tensor& y) {
    product_into(layer.fc1, h.data_ptr<float>(), rows, hidden_.data_ptr<float>(), nullptr, true);
    product_into(layer.fc2, hidden_.data_ptr<float>(), rows, y.data_ptr<float>(), x_.data_ptr<float>());
  });
}

Tensor RawStep::logits(const Tensor& cache, const int64_t* last, const int64_t* sentence, const int64_t* slot,
                       int64_t rows, int64_t step) {
  // LeanDecoderModel::embed_at: embed[token] * scale (float32), + the position's row.
  const int64_t D = x_.size(1), row = m_.padding_idx + step + 1;
  // The rows of the tables read below exist (at::embedding and select check them on the ATen path).
  TORCH_CHECK(!m_.positions || (row >= 0 && row < m_.positions->size(0)), "the decoder step: position ", row,
              " outside the position table (", m_.positions ? m_.positions->size(0) : 0, " rows)");
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(last[r] >= 0 && last[r] < m_.embed.size(0), "the decoder step: token ", last[r],
                " outside the embedding (", m_.embed.size(0), " rows)");
  const float scale = static_cast<float>(m_.embed_scale);
  const float* position = m_.positions ? m_.positions->data_ptr<float>() + row * D : nullptr;
  float* x = x_.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* e = m_.embed.data_ptr<float>() + last[r] * m_.embed.stride(0);
    for (int64_t d = 0; d < D; ++d) {
      float v = e[d] * scale;
      // Two roundings, as ATen's mul and add: the empty asm keeps the compiler from fusing them into one
      // multiply-add (-march=native has FMA, and GCC contracts by default).
      asm("" : "+x"(v));
      x[r * D + d] = position ? v + position[d] : v;
    }
  }
  if (m_.embed_norm) {
    norm(*m_.embed_norm, x_, y_, rows);
    std::swap(x_, y_);
  }
  for (size_t l = 0; l < m_.layers.size(); ++l) layer(m_.layers[l], l, cache, sentence, slot, rows, step);
  const Tensor* states = &x_;
  if (m_.final_norm) {
    norm(*m_.final_norm, x_, h_, rows);
    states = &h_;
  }
  product_into(m_.output, states->data_ptr<float>(), rows, out_.data_ptr<float>());
  return out_.narrow(0, 0, rows);
}
