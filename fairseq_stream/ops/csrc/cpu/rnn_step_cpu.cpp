// One decoder step of a fairseq LSTM model under --rnn-int16, in one call: the int16 products, the
// LSTM cells with vectorized sigmoid and tanh (Devlin 2017, section 4.4), the attention over the
// pre-computed source tables and the output layer. fairseq_stream/ops/rnn_step.py documents the op;
// fairseq_stream/runners/rnn.py (RnnModel, _model_step) is the step it replaces, op by op.
//
// Why: one sentence at a time (5 rows), that step is about 35 small torch ops, and on one CPU
// thread their dispatch cost about 150 us of a 390 us step whose products take 190 us
// (docs/BENCHMARKS.md, issue 14). Here the elementwise parts are plain loops that the compiler
// vectorizes, and the products are the lean runner's (product_cpu.h: the int16 kernel through QuantizedLinear).
//
// Arithmetic: the products are the int16 kernel's (identical to the torch path's). Sums, the
// softmax and the activations are float32 in another order than torch's, and exp and tanh are the
// Cephes single-precision approximations (a few ulp), so results differ from the torch int16 path
// by float rounding, far below the int16 quantization error. Every row is computed on its own, so
// a row's result does not depend on which other rows share the call.

#include "rnn_step_cpu.h"

#include "vector_math_cpu.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace {

// One LSTM cell for every row: gates = x + recurrent[parent]; c, h as torch.nn.LSTMCell.
void cells(const float* x, const float* rec, const float* c_prev, const int64_t* parent, int64_t rows,
           int64_t H, float* h_out, float* c_out) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t p = parent ? parent[r] : r;
    const float* xr = x + r * 4 * H;
    const float* rr = rec + p * 4 * H;
    const float* cp = c_prev + p * H;
    float* h = h_out + r * H;
    float* c = c_out + r * H;
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) {
      const float i = sigmoid_approx(xr[j] + rr[j]);
      const float f = sigmoid_approx(xr[H + j] + rr[H + j]);
      const float g = tanh_approx(xr[2 * H + j] + rr[2 * H + j]);
      const float o = sigmoid_approx(xr[3 * H + j] + rr[3 * H + j]);
      const float cj = f * cp[j] + i * g;
      c[j] = cj;
      h[j] = o * tanh_approx(cj);
    }
  }
}

// The attention mix of each row over its sentence's source positions (pre-computed keys and
// values, padding masked): out[r] = softmax_t(h[r] . keys[s, t]) . values[s, t].
void attend(const float* hidden, int64_t rows, int64_t H, const Tensor& keys, const Tensor& values,
            const Tensor& mask, const int64_t* row_sentence, float* mixed) {
  const int64_t T = keys.size(1);
  const float* k = keys.data_ptr<float>();
  const float* v = values.data_ptr<float>();
  const bool* m = mask.data_ptr<bool>();
  std::vector<float> w(T);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = row_sentence[r];
    const float* q = hidden + r * H;
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < T; ++t) {
      w[t] = m[s * T + t] ? -std::numeric_limits<float>::infinity() : dot(q, k + (s * T + t) * H, H);
      peak = std::max(peak, w[t]);
    }
    float total = 0.f;
    for (int64_t t = 0; t < T; ++t) {
      w[t] = m[s * T + t] ? 0.f : exp_approx(w[t] - peak);
      total += w[t];
    }
    float* out = mixed + r * H;
    std::fill(out, out + H, 0.f);
    for (int64_t t = 0; t < T; ++t) {
      if (w[t] == 0.f) continue;
      const float wt = w[t] / total;
      const float* vt = v + (s * T + t) * H;
#pragma omp simd
      for (int64_t j = 0; j < H; ++j) out[j] += wt * vt[j];
    }
  }
}

Tensor contiguous_float(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "rnn_step: ", name,
              " must be a float32 CPU tensor");
  return t.contiguous();
}

// One of the step's activations over a tensor, for tests of its accuracy.
template <float (*F)(float)>
Tensor elementwise(const Tensor& x) {
  Tensor y = contiguous_float(x, "x").clone();
  float* p = y.data_ptr<float>();
  for (int64_t i = 0; i < y.numel(); ++i) p[i] = F(p[i]);
  return y;
}

}  // namespace

Tensor exp_approx_of(const Tensor& x) { return elementwise<exp_approx>(x); }
Tensor sigmoid_approx_of(const Tensor& x) { return elementwise<sigmoid_approx>(x); }
Tensor tanh_approx_of(const Tensor& x) { return elementwise<tanh_approx>(x); }

std::vector<Tensor> rnn_step(const Tensor& x_in, const Tensor& feed_in, const Tensor& h_in, const Tensor& c_in,
                             const std::optional<Tensor>& parent_in, const std::vector<Product>& recurrent,
                             const std::vector<Product>& upper_input, bool residuals,
                             const std::vector<Tensor>& keys, const std::vector<Tensor>& values,
                             const std::vector<Tensor>& masks, const std::vector<Tensor>& row_sentences,
                             const std::optional<Product>& out_hidden,
                             const std::optional<Product>& additional_fc, const Product& output) {
  Tensor x = contiguous_float(x_in, "x");
  const Tensor feed = contiguous_float(feed_in, "feed");
  const Tensor h_prev = contiguous_float(h_in, "h"), c_prev = contiguous_float(c_in, "c");
  TORCH_CHECK(h_prev.dim() == 3 && h_prev.size(0) >= 1 && x.dim() == 2,
              "rnn_step: h must be (layers >= 1, parents, hidden) and x (rows, 4 * hidden)");
  const int64_t rows = x.size(0), L = h_prev.size(0), P = h_prev.size(1), H = h_prev.size(2);
  TORCH_CHECK(x.size(1) == 4 * H, "rnn_step: x must be (rows, 4 * hidden)");
  TORCH_CHECK(c_prev.sizes() == h_prev.sizes() && feed.dim() == 2 && feed.size(0) == P,
              "rnn_step: h and c must be (layers, parents, hidden) and feed (parents, features)");
  TORCH_CHECK(static_cast<int64_t>(recurrent.size()) == L && static_cast<int64_t>(upper_input.size()) == L - 1,
              "rnn_step: one recurrent product per layer and one input product per upper layer");
  const int64_t* parent = nullptr;
  Tensor parent_t;
  if (parent_in) {
    parent_t = parent_in->contiguous();
    TORCH_CHECK(parent_t.device().is_cpu() && parent_t.scalar_type() == at::kLong && parent_t.numel() == rows,
                "rnn_step: parent must be (rows,) int64 on the CPU");
    const int64_t* pp = parent_t.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(pp[r] >= 0 && pp[r] < P, "rnn_step: parent out of range");
    parent = pp;
  } else {
    TORCH_CHECK(P == rows, "rnn_step: without parents, one recurrent state per row");
  }

  auto opts = x.options();
  Tensor h_new = at::empty({L, rows, H}, opts), c_new = at::empty({L, rows, H}, opts);
  for (int64_t layer = 0; layer < L; ++layer) {
    Tensor rec_in;
    if (layer == 0) {
      rec_in = at::cat({feed, h_prev[0]}, 1);
    } else {
      rec_in = h_prev[layer];
      x = upper_input[layer - 1](x).contiguous();
    }
    const Tensor rec = recurrent[layer](rec_in).contiguous();
    TORCH_CHECK(rec.dim() == 2 && rec.size(0) == P && rec.size(1) == 4 * H && x.dim() == 2 && x.size(0) == rows &&
                    x.size(1) == 4 * H,
                "rnn_step: gate width");
    float* h = h_new[layer].data_ptr<float>();
    cells(x.data_ptr<float>(), rec.data_ptr<float>(), c_prev[layer].data_ptr<float>(), parent, rows, H, h,
          c_new[layer].data_ptr<float>());
    if (layer + 1 < L) {
      // The next layer's input: h, plus the previous h of the row's parent with residuals.
      Tensor next = h_new[layer].clone();
      if (residuals) {
        float* n = next.data_ptr<float>();
        const float* hp = h_prev[layer].data_ptr<float>();
        for (int64_t r = 0; r < rows; ++r) {
          const float* src = hp + (parent ? parent[r] : r) * H;
          for (int64_t j = 0; j < H; ++j) n[r * H + j] += src[j];
        }
      }
      x = next;
    }
  }
  Tensor hidden = h_new[L - 1];
  Tensor out = hidden;
  if (!keys.empty()) {
    TORCH_CHECK(out_hidden.has_value(), "rnn_step: the attention needs its output product");
    TORCH_CHECK(values.size() == keys.size() && masks.size() == keys.size() && row_sentences.size() == keys.size(),
                "rnn_step: keys, values, masks and row_sentences: one per group of rows");
    Tensor mixed = at::empty({rows, H}, opts);
    int64_t at_row = 0;
    for (size_t g = 0; g < keys.size(); ++g) {
      const Tensor kg = contiguous_float(keys[g], "keys"), vg = contiguous_float(values[g], "values");
      const Tensor mg = masks[g].contiguous(), rs = row_sentences[g].contiguous();
      const int64_t n = rs.numel(), S = kg.size(0);
      TORCH_CHECK(kg.dim() == 3 && kg.size(2) == H && vg.sizes() == kg.sizes(), "rnn_step: keys and values (S, T, hidden)");
      TORCH_CHECK(mg.device().is_cpu() && mg.scalar_type() == at::kBool && mg.dim() == 2 && mg.size(0) == S &&
                      mg.size(1) == kg.size(1),
                  "rnn_step: mask must be (S, T) bool on the CPU");
      TORCH_CHECK(rs.device().is_cpu() && rs.scalar_type() == at::kLong && at_row + n <= rows,
                  "rnn_step: row_sentence: int64 CPU sentence indices, no more than the rows");
      const int64_t* sent = rs.data_ptr<int64_t>();
      for (int64_t r = 0; r < n; ++r) TORCH_CHECK(sent[r] >= 0 && sent[r] < S, "rnn_step: row_sentence out of range");
      attend(hidden.data_ptr<float>() + at_row * H, n, H, kg, vg, mg, sent, mixed.data_ptr<float>() + at_row * H);
      at_row += n;
    }
    TORCH_CHECK(at_row == rows, "rnn_step: the groups' rows must add up to the rows");
    // tanh(mixed + W_out_hidden h), as fairseq's AttentionLayer with the context half pre-computed.
    Tensor projected = (*out_hidden)(hidden).contiguous();
    TORCH_CHECK(projected.dim() == 2 && projected.size(0) == rows && projected.size(1) == H,
                "rnn_step: the attention's output width");
    float* o = mixed.data_ptr<float>();
    const float* pr = projected.data_ptr<float>();
    const int64_t total = rows * H;
#pragma omp simd
    for (int64_t i = 0; i < total; ++i) o[i] = tanh_approx(o[i] + pr[i]);
    out = mixed;
  }
  Tensor logits_in = additional_fc ? (*additional_fc)(out) : out;
  Tensor logits = output(logits_in);
  return {logits, h_new, c_new, out};
}
