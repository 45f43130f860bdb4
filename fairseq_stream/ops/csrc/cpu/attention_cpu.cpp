// The lean runner's two attentions of a decoder step, one query per row, in one call each:
// fairseq_stream/ops/attention.py documents the ops and holds their torch references.
//
// Why: in torch each is a handful of ops (a cache write by index, batched matmuls of one query by
// ~30 keys per row and head, a softmax, the packing of rows by sentence and back), whose fixed cost
// dominates at decoder-step sizes: on one Xeon thread, 26 rows spent 0.36 ms a step in bmm alone
// for about 0.4 M multiply-adds. Here each (row, head) is a short loop over its own keys: the dot
// products and the weighted sum vectorize over the head dimension, the exps over positions.
//
// Arithmetic: float32 or float64 throughout, in another order than torch's (and float32's exp is
// exp_approx, within 1 ulp), so results differ from the references by rounding only. Each row and
// head is computed on its own: a row's result does not depend on which rows share the call.

#include "attention_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/softmax.h>
#include <ATen/TensorOperators.h>
#include <cstring>

#include "vector_math_cpu.h"

#include "parallel_cpu.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

// softmax_j(q . K[j] + mask[j]) . V: q already scaled, K and V rows `step` apart, `positions` of
// them; scores: scratch of `positions`. A position whose mask is -inf has weight exactly 0.
template <typename T>
void attend_one(const T* q, const T* K, const T* V, int64_t step, int64_t positions, const T* mask,
                int64_t hd, T* scores, T* out) {
  T peak = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < positions; ++j) {
    T s = dot(q, K + j * step, hd);
    if (mask) s += mask[j];
    scores[j] = s;
    peak = std::max(peak, s);
  }
  T total = 0;
  for (int64_t j = 0; j < positions; ++j) {
    const T s = scores[j];
    const T e = s == -std::numeric_limits<T>::infinity() ? T(0) : exp_of(s - peak);
    scores[j] = e;
    total += e;
  }
  const T inv = T(1) / total;
  std::fill(out, out + hd, T(0));
  for (int64_t j = 0; j < positions; ++j) {
    const T p = scores[j] * inv;
    if (p == T(0)) continue;
    const T* v = V + j * step;
    for (int64_t d = 0; d < hd; ++d) out[d] += p * v[d];
  }
}

void check_rows(const Tensor& t, const char* name, int64_t rows, int64_t width, at::ScalarType type) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.dim() == 2 && t.size(0) == rows &&
                  t.size(1) == width && (t.stride(1) == 1 || width <= 1),
              name, ": (", rows, ", ", width, ") CPU rows of the query's type, contiguous within a row");
}

// Keys and values (4-d, one shape `layout`), contiguous CPU tensors of one floating type: the kernels read
// them through raw pointers at offsets from their sizes.
void check_keys_values(const Tensor& keys, const Tensor& values, const char* op, const char* layout) {
  TORCH_CHECK(keys.dim() == 4 && keys.is_contiguous() && values.is_contiguous() && keys.sizes() == values.sizes() &&
                  keys.device().is_cpu() && values.device().is_cpu() && keys.scalar_type() == values.scalar_type(),
              op, ": keys and values ", layout, ", contiguous CPU tensors of one shape and type");
}

// An index tensor read through a raw pointer: int64 on the CPU, `count` entries.
void check_index(const Tensor& t, int64_t count, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.numel() == count, op, ": ", name, " must be (",
              count, ",) int64 on the CPU; got ", t.sizes(), " ", t.scalar_type());
}

// The data of a cached attention's queries, new keys and values, cache and output.
template <typename T>
std::tuple<const T*, const T*, const T*, T*, T*, T*> pointers(const Tensor& q, const Tensor& k, const Tensor& v,
                                                              Tensor& keys, Tensor& values, Tensor& out) {
  return {q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), keys.data_ptr<T>(), values.data_ptr<T>(),
          out.data_ptr<T>()};
}

}  // namespace

// Padding (left, and right where sentences of different batches were joined) is skipped rather than
// scored. A masked position's weight is exactly 0 in attend_one, so the result is bitwise the same;
// unsorted batches (mini-batching, top-up) pad a short sentence to their longest, and scored every padded
// position before.
template <typename T>
std::pair<std::vector<int64_t>, std::vector<int64_t>> source_spans(const T* mask, int64_t S, int64_t T_len) {
  std::vector<int64_t> first(S, 0), span(S, T_len);
  if (mask == nullptr) return {first, span};
  const T hidden = -std::numeric_limits<T>::infinity();
  for (int64_t n = 0; n < S; ++n) {
    const T* m = mask + n * T_len;
    int64_t a = 0, b = T_len;
    while (a < T_len && m[a] == hidden) ++a;
    while (b > a && m[b - 1] == hidden) --b;
    if (a < b) first[n] = a, span[n] = b - a;
  }
  return {first, span};
}

// Pairs begin .. end - 1 of (row, head): the row's key and value written at position `length` of its
// slot, then its query attending over positions 0 .. length.
template <typename T>
void CachedRows<T>::run(int64_t begin, int64_t end) const {
  std::vector<T> scores(length + 1), query(hd);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t r = i / H, h = i % H;
    const int64_t base = ((slot ? slot[r] : r) * H + h) * capacity * hd;
    std::copy_n(k + r * k_stride + h * hd, hd, keys + base + length * hd);
    std::copy_n(v + r * v_stride + h * hd, hd, values + base + length * hd);
    const T* qr = q + r * q_stride + h * hd;
    for (int64_t d = 0; d < hd; ++d) query[d] = qr[d] * scale;
    attend_one(query.data(), keys + base, values + base, hd, length + 1, static_cast<const T*>(nullptr), hd,
               scores.data(), out + r * H * hd + h * hd);
  }
}

// Pairs begin .. end - 1 of (row, head): the row's query over its sentence's unmasked span.
template <typename T>
void SourceRows<T>::run(int64_t begin, int64_t end) const {
  std::vector<T> scores(T_len), query(hd);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t r = i / H, h = i % H, n = sentence[r];
    const int64_t base = (n * H + h) * T_len * hd + first[n] * hd;
    const T* qr = q + r * q_stride + h * hd;
    for (int64_t d = 0; d < hd; ++d) query[d] = qr[d] * scale;
    attend_one(query.data(), keys + base, values + base, hd, span[n], mask ? mask + n * T_len + first[n] : nullptr, hd,
               scores.data(), out + r * H * hd + h * hd);
  }
}

template struct CachedRows<float>;
template struct CachedRows<double>;
template struct SourceRows<float>;
template struct SourceRows<double>;
template std::pair<std::vector<int64_t>, std::vector<int64_t>> source_spans(const float*, int64_t, int64_t);
template std::pair<std::vector<int64_t>, std::vector<int64_t>> source_spans(const double*, int64_t, int64_t);

namespace {

// (row, head) pairs per parallel chunk: enough work to be worth a thread.
int64_t grain(int64_t positions, int64_t hd) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, positions * hd)); }

}  // namespace

// Writes each row's key and value at position `length` of its cache slot, then attends over
// positions 0..length of that slot.
Tensor cached_attention_(const Tensor& q, const Tensor& k, const Tensor& v, Tensor keys, Tensor values,
                         std::optional<Tensor> slot, int64_t length, double scale) {
  check_keys_values(keys, values, "cached_attention_", "(slots, heads, capacity, head_dim)");
  TORCH_CHECK(q.dim() == 2, "cached_attention_: q must be (rows, heads * head_dim)");
  const int64_t slots = keys.size(0), H = keys.size(1), capacity = keys.size(2), hd = keys.size(3);
  const int64_t rows = q.size(0);
  TORCH_CHECK(length >= 0 && length < capacity, "cached_attention_: position ", length, " past the capacity ",
              capacity);
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) check_rows(*t, name, rows, H * hd, keys.scalar_type());
  const int64_t* slot_of = nullptr;
  Tensor slot_c;
  if (slot) {
    slot_c = slot->contiguous();
    check_index(slot_c, rows, "cached_attention_", "slot");
    slot_of = slot_c.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(slot_of[r] >= 0 && slot_of[r] < slots, "cached_attention_: slot out of range");
  } else {
    TORCH_CHECK(rows <= slots, "cached_attention_: more rows than cache slots");
  }
  Tensor out = at::empty({rows, H * hd}, q.options());
  AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "cached_attention_", [&] {
    const auto [qp, kp, vp, K, V, o] = pointers<scalar_t>(q, k, v, keys, values, out);
    const CachedRows<scalar_t> job{qp, kp, vp, q.stride(0), k.stride(0), v.stride(0), K, V, slot_of,
                                   H, capacity, hd, length, static_cast<scalar_t>(scale), o};
    fs::parallel_for(0, rows * H, grain(length + 1, hd), [&](int64_t begin, int64_t end) { job.run(begin, end); });
  });
  return out;
}

// Each row attends over its sentence's encoder keys and values (row_sentence), padding masked.
Tensor source_attention(const Tensor& q, const Tensor& keys, const Tensor& values, const Tensor& row_sentence,
                        std::optional<Tensor> mask, double scale) {
  check_keys_values(keys, values, "source_attention", "(sentences, heads, source, head_dim)");
  TORCH_CHECK(q.dim() == 2, "source_attention: q must be (rows, heads * head_dim)");
  const int64_t S = keys.size(0), H = keys.size(1), T = keys.size(2), hd = keys.size(3);
  const int64_t rows = q.size(0);
  check_rows(q, "q", rows, H * hd, keys.scalar_type());
  const Tensor sentence = row_sentence.contiguous();
  check_index(sentence, rows, "source_attention", "row_sentence");
  const int64_t* sentence_of = sentence.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(sentence_of[r] >= 0 && sentence_of[r] < S, "source_attention: sentence out of range");
  Tensor mask_c;
  if (mask) {
    mask_c = mask->contiguous();
    TORCH_CHECK(mask_c.device().is_cpu() && mask_c.numel() == S * T && mask_c.scalar_type() == keys.scalar_type(),
                "source_attention: mask (sentences, 1, 1, source) additive, of the keys' type, on the CPU");
  }
  Tensor out = at::empty({rows, H * hd}, q.options());
  AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "source_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* K = keys.data_ptr<scalar_t>();
    const scalar_t* V = values.data_ptr<scalar_t>();
    const scalar_t* M = mask ? mask_c.data_ptr<scalar_t>() : nullptr;
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t s = static_cast<scalar_t>(scale);
    const auto [first, span] = source_spans(M, S, T);
    const SourceRows<scalar_t> job{qp, q.stride(0), K, V, M, first.data(), span.data(), sentence_of, H, T, hd, s, o};
    fs::parallel_for(0, rows * H, grain(T, hd), [&](int64_t begin, int64_t end) { job.run(begin, end); });
  });
  return out;
}

// Jacobi's window, flat: window position n is a query of cache row window_row[n] at position
// window_step[n]. Rows may have windows of different widths (a row without a draft runs one
// position). Writes every window key and value first, then query n attends over positions
// 0 .. window_step[n] of its row (causal inside the window, the verified prefix as it is).
//
// With `visible` (positions, W) additive (0 or -inf, W >= max(window_step) + 1), query n attends over
// positions 0 .. window_step[n] of its row plus visible[n]: a window shaped as a tree of drafts
// (jacobi/decoder.py), where a position sees the verified prefix and its own ancestors only.
Tensor window_attention_(const Tensor& q, const Tensor& k, const Tensor& v, Tensor keys, Tensor values,
                         const Tensor& window_row, const Tensor& window_step, double scale,
                         const std::optional<Tensor>& visible) {
  check_keys_values(keys, values, "window_attention_", "(rows, heads, capacity, head_dim)");
  const int64_t rows = keys.size(0), H = keys.size(1), capacity = keys.size(2), hd = keys.size(3);
  const int64_t N = window_row.numel();
  for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) check_rows(*t, name, N, H * hd, keys.scalar_type());
  const Tensor row = window_row.contiguous(), step = window_step.contiguous();
  check_index(row, N, "window_attention_", "window_row");
  check_index(step, N, "window_attention_", "window_step");
  const int64_t* row_of = row.data_ptr<int64_t>();
  const int64_t* step_of = step.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(row_of[n] >= 0 && row_of[n] < rows, "window_attention_: a window row out of range");
    TORCH_CHECK(step_of[n] >= 0 && step_of[n] < capacity, "window_attention_: a window past the capacity");
    longest = std::max(longest, step_of[n] + 1);
  }
  Tensor mask;
  if (visible.has_value()) {
    mask = visible->contiguous();
    TORCH_CHECK(mask.device().is_cpu() && mask.scalar_type() == keys.scalar_type() && mask.dim() == 2 &&
                    mask.size(0) == N && mask.size(1) >= longest,
                "window_attention_: visible (positions, >= max(window_step) + 1) additive, of the keys' type");
  }
  Tensor out = at::empty({N, H * hd}, q.options());
  AT_DISPATCH_FLOATING_TYPES(keys.scalar_type(), "window_attention_", [&] {
    const auto [qp, kp, vp, K, V, o] = pointers<scalar_t>(q, k, v, keys, values, out);
    const scalar_t s = static_cast<scalar_t>(scale);
    const scalar_t* M = mask.defined() ? mask.data_ptr<scalar_t>() : nullptr;
    const int64_t W = mask.defined() ? mask.size(1) : 0;
    // Writes first: a query reads the keys of the window positions before it.
    fs::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t n = i / H, h = i % H;
        const int64_t at = ((row_of[n] * H + h) * capacity + step_of[n]) * hd;
        std::copy_n(kp + n * k.stride(0) + h * hd, hd, K + at);
        std::copy_n(vp + n * v.stride(0) + h * hd, hd, V + at);
      }
    });
    fs::parallel_for(0, N * H, grain(longest, hd), [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> scores(longest), query(hd);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t n = i / H, h = i % H;
        const int64_t base = (row_of[n] * H + h) * capacity * hd;
        const scalar_t* qr = qp + n * q.stride(0) + h * hd;
        for (int64_t d = 0; d < hd; ++d) query[d] = qr[d] * s;
        attend_one(query.data(), K + base, V + base, hd, step_of[n] + 1, M ? M + n * W : nullptr, hd,
                   scores.data(), o + n * H * hd + h * hd);
      }
    });
  });
  return out;
}

// An encoder's self-attention over sources packed without padding: qkv (tokens, 3 * heads * head_dim)
// holds each token's query, key and value side by side; sentence s is tokens starts[s] .. starts[s + 1],
// and each of its tokens attends over them all. A sentence of fewer than `dense_from` tokens runs
// attend_one per (token, head), reading keys and values in place; a longer one runs as batched
// products and a softmax, whose cost grows with its length squared where the loops' would.
Tensor sentence_attention(const Tensor& qkv, const std::vector<int64_t>& starts, int64_t heads, double scale,
                          int64_t dense_from) {
  // heads first: the width's test divides by it.
  TORCH_CHECK(heads >= 1, "sentence_attention: heads must be at least 1, got ", heads);
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) % (3 * heads) == 0,
              "sentence_attention: qkv (tokens, 3 * heads * head_dim) CPU rows, contiguous within a row");
  const int64_t N = qkv.size(0), D = qkv.size(1) / 3, H = heads, hd = D / heads;
  TORCH_CHECK(!starts.empty() && starts.front() == 0 && starts.back() == N,
              "sentence_attention: starts from 0 to the token count");
  std::vector<int64_t> first(N), last(N);  // each token's sentence, for the loops; -1: a dense sentence
  int64_t longest = 0;
  for (size_t s = 0; s + 1 < starts.size(); ++s) {
    const int64_t a = starts[s], b = starts[s + 1];
    TORCH_CHECK(a <= b, "sentence_attention: starts in order");
    const bool dense = b - a >= dense_from;
    for (int64_t n = a; n < b; ++n) first[n] = dense ? -1 : a, last[n] = b;
    if (!dense) longest = std::max(longest, b - a);
  }
  Tensor out = at::empty({N, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES(qkv.scalar_type(), "sentence_attention", [&] {
    const scalar_t* base = qkv.data_ptr<scalar_t>();
    const int64_t row = qkv.stride(0);
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t s = static_cast<scalar_t>(scale);
    fs::parallel_for(0, N * H, grain(std::max<int64_t>(1, longest), hd), [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> scores(longest), query(hd);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t n = i / H, h = i % H;
        if (first[n] < 0) continue;
        const scalar_t* qr = base + n * row + h * hd;
        for (int64_t d = 0; d < hd; ++d) query[d] = qr[d] * s;
        const scalar_t* keys = base + first[n] * row + D + h * hd;
        attend_one(query.data(), keys, keys + D, row, last[n] - first[n], static_cast<const scalar_t*>(nullptr), hd,
                   scores.data(), o + n * D + h * hd);
      }
    });
  });
  for (size_t s = 0; s + 1 < starts.size(); ++s) {
    const int64_t a = starts[s], b = starts[s + 1];
    if (b - a < dense_from || a == b) continue;
    auto part = [&](int64_t i) { return qkv.slice(0, a, b).slice(1, i * D, (i + 1) * D).view({b - a, H, hd}).transpose(0, 1); };
    const Tensor scores = at::matmul(part(0) * scale, part(1).transpose(1, 2));  // (H, T, T)
    const Tensor mixed = at::matmul(at::softmax(scores, -1), part(2));        // (H, T, hd)
    out.slice(0, a, b).copy_(mixed.transpose(0, 1).reshape({b - a, D}));
  }
  return out;
}

void copy_cache_slots_(at::Tensor cache, const at::Tensor& source, const at::Tensor& target, int64_t length) {
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous() && cache.device().is_cpu(),
              "copy_cache_slots_: a contiguous CPU cache (2 * layers, slots, heads, capacity, head_dim)");
  TORCH_CHECK(source.device().is_cpu() && target.device().is_cpu() && source.scalar_type() == at::kLong &&
                  target.scalar_type() == at::kLong && source.numel() == target.numel(),
              "copy_cache_slots_: int64 CPU source and target slots, as many of each");
  const int64_t layers = cache.size(0), slots = cache.size(1), heads = cache.size(2), capacity = cache.size(3),
                dim = cache.size(4);
  TORCH_CHECK(length >= 0 && length <= capacity, "copy_cache_slots_: length within the capacity");
  const at::Tensor src = source.contiguous(), dst = target.contiguous();
  const int64_t* from = src.data_ptr<int64_t>();
  const int64_t* to = dst.data_ptr<int64_t>();
  for (int64_t i = 0; i < src.numel(); ++i)
    TORCH_CHECK(from[i] >= 0 && from[i] < slots && to[i] >= 0 && to[i] < slots, "copy_cache_slots_: slot out of range");
  const int64_t bytes = length * dim * static_cast<int64_t>(cache.element_size());
  char* base = static_cast<char*>(cache.data_ptr());
  const int64_t head_stride = capacity * dim * cache.element_size(), slot_stride = heads * head_stride,
                layer_stride = slots * slot_stride;
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t i = 0; i < src.numel(); ++i) {
      if (from[i] == to[i]) continue;  // nothing to copy, and memcpy of a region onto itself is undefined
      for (int64_t h = 0; h < heads; ++h)
        std::memcpy(base + l * layer_stride + to[i] * slot_stride + h * head_stride,
                    base + l * layer_stride + from[i] * slot_stride + h * head_stride, bytes);
    }
  }
}
