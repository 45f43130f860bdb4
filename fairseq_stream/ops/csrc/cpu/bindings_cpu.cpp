// The Python bindings of every CPU kernel family, in one place: fairseq_stream._ops_cpu. Each family's
// kernels live in their own file (named in its section's comment) beside the Python op in
// fairseq_stream/ops/ that documents them; this file only names them for Python. fairseq_stream/ops/loader.py
// loads the module. The CUDA kernels are another module, with their own bindings (csrc/cuda).

#include <torch/python.h>

#include <optional>
#include <string>
#include <vector>

#include "../output_layer_binding.h"
#include "attention_cpu.h"
#include "beam_step_cpu.h"
#include "cache_slots_cpu.h"
#include "int16_linear_cpu.h"
#include "int8_linear_cpu.h"
#include "layer_norm_kernel_cpu.h"
#include "lean_step_cpu.h"
#include "output_layer_cpu.h"
#include "parallel_cpu.h"
#include "product_cpu.h"
#include "rnn_step_cpu.h"
#include "search_loop_cpu.h"
#include "skinny_linear_cpu.h"

namespace {

// output_layer_cpu.cpp: the fused output layer.
void bind_output_layer(py::module& m) {
  def_topk_log_softmax(m, &topk_log_softmax);
  // What the output layer's float rows run on: its AVX2 + FMA loops where the build targets them.
#if defined(__AVX2__) && defined(__FMA__)
  m.attr("simd") = "avx2";
#else
  m.attr("simd") = "none";
#endif
}

// product_cpu.cpp: the one product op, every precision (float32 packed for MKL, int8, int16, plain), for
// Python and for every compiled step. Its call runs without the GIL: it touches no Python object, and the
// encoder thread (schedule/read_ahead.py) runs its products while the decoder's Python runs.
void bind_product(py::module& m) {
  py::class_<Product>(m, "Product",
                      "x W^T + b at a precision: 'float32' (the weight packed for MKL or oneDNN, the skinny tiles at few rows), "
                      "'int8' or 'int16' (a quantized weight, see ops/quantized_linear.py and ops/int16_linear.py) "
                      "or 'plain' (at::linear on the weight); ops/product.py makes them")
      .def(py::init([](std::optional<Tensor> weight, std::optional<Tensor> bias, const std::string& precision,
                       std::optional<Tensor> packed, std::optional<Tensor> weight_inv, std::optional<Tensor> excess,
                       int64_t a_max, int64_t weight_max, int64_t in_features, int64_t out_features,
                       const std::string& kernel, std::optional<Tensor> weight_kn, int64_t onednn_from_rows) {
             return make_product(precision, weight, bias,
                                 {packed, weight_inv, excess, a_max, weight_max, in_features, out_features, kernel,
                                  weight_kn, onednn_from_rows});
           }),
           py::arg("weight") = py::none(), py::arg("bias") = py::none(), py::arg("precision") = "plain",
           py::kw_only(), py::arg("packed") = py::none(), py::arg("weight_inv") = py::none(),
           py::arg("excess") = py::none(), py::arg("a_max") = 0, py::arg("weight_max") = 127,
           py::arg("in_features") = 0, py::arg("out_features") = 0, py::arg("kernel") = "auto",
           py::arg("weight_kn") = py::none(), py::arg("onednn_from_rows") = 0)
      .def_property_readonly("precision", &Product::precision)
      .def_property_readonly("in_features", &Product::in_features)
      .def_property_readonly("out_features", &Product::out_features)
      .def_property_readonly("weight", [](const Product& p) -> std::optional<Tensor> {
        if (p.packed) return p.packed->weight;
        return p.weight.defined() ? std::optional<Tensor>(p.weight) : std::nullopt;
      }, "the float weight it reads (float32, plain); None for int8 and int16")
      .def_property_readonly("bias", [](const Product& p) {
        return p.packed ? p.packed->bias : p.quantized ? p.quantized->bias : p.bias;
      })
      .def_property_readonly("packed", [](const Product& p) -> std::optional<Tensor> {
        if (p.packed) return p.packed->panels.front().packed;
        if (p.quantized) return p.quantized->packed;
        return std::nullopt;
      }, "the arranged weight it holds (its memory): MKL's packed copy (its first panel's, where float32_panels "
         "splits it), or the packed integers; None for plain")
      .def_property_readonly("panels", [](const Product& p) -> std::vector<std::pair<int64_t, int64_t>> {
        if (!p.packed) return {};
        std::vector<std::pair<int64_t, int64_t>> out;
        for (const auto& q : p.packed->panels) out.emplace_back(q.first, q.count);
        return out;
      }, "float32: the (first column, columns) of each panel its weight is packed in; empty for other precisions")
      .def_property_readonly("weight_inv", [](const Product& p) {
        return p.quantized ? std::optional<Tensor>(p.quantized->weight_inv) : std::nullopt;
      }, "int8, int16: 1 / each output row's scale")
      .def_property_readonly("weight_kn", [](const Product& p) {
        return p.quantized ? p.quantized->weight_kn : std::nullopt;
      }, "int8 with oneDNN: the quantized weight transposed")
      .def_property_readonly("kernel", [](const Product& p) -> std::string {
        if (p.packed) return p.packed->gemm == Float32Gemm::kOneDnn ? "onednn" : "mkl";
        return p.quantized ? p.quantized->kernel : "";
      }, "int8, int16: the kernel asked for ('auto', a kernel's name, 'onednn'); float32: its GEMM ('mkl', 'onednn')")
      .def("__call__", &Product::operator(), py::arg("x"), py::call_guard<py::gil_scoped_release>())
      .def("gemm_product", [](const Product& p, const Tensor& x) {
        TORCH_CHECK(p.packed, "gemm_product: a float32 product only");
        return p.packed->gemm_product(x);
      }, "float32: the product as its GEMM (MKL's or oneDNN's) computes it at every row count (no skinny product), "
         "for benchmarks and tests", py::call_guard<py::gil_scoped_release>());
  m.def("prepacked_linear_missing", &prepacked_linear_missing,
        "'' where MKL's packed sgemm is found in this process, else why not");
  m.def("onednn_linear_missing", &onednn_linear_missing,
        "'' where torch's oneDNN linear ops (the float32 product's other GEMM) are in this torch, else why not");
  m.def("skinny_linear_rows", [] { return skinny_linear_available() ? kSkinnyMaxRows : int64_t{0}; },
        "up to how many rows the float32 product reads W once in its own layout (0: never, no AVX2 and FMA)");
  m.def("skinny_linear_kernel", &skinny_linear_kernel, "the skinny product's tiles here: avx512, avx2 or ''");
}

// int8_linear_cpu.cpp: the int8 kernels (the product's int8 precision calls them).
void bind_int8_linear(py::module& m) {
  m.def("int8_linear", &int8_linear,
        "(x float32 (rows, in), packed int8 (quantized_linear.packed_for), weight_inv float32 (out,), excess int32 (out,), bias or None, kernel, "
        "weight_max 127 or 63) "
        "-> float32 (rows, out); see fairseq_stream/ops/quantized_linear.py",
        py::arg("x"), py::arg("packed"), py::arg("weight_inv"), py::arg("excess"), py::arg("bias") = py::none(),
        py::arg("kernel") = "auto", py::arg("weight_max") = 127);
  m.def("int8_kernels", &int8_kernels,
        "the int8 kernels this CPU runs on weights of magnitude up to weight_max, the best (the 'auto' one) last",
        py::arg("weight_max") = 127);
  m.def("int8_onednn_exact", &int8_onednn_exact,
        "whether oneDNN's int8 GEMM (at::_int_mm) sums exactly on this CPU (AMX or VNNI, checked once)");
}

// int16_linear_cpu.cpp: the int16 kernels (the product's int16 precision calls them).
void bind_int16_linear(py::module& m) {
  m.def("int16_linear", &int16_linear,
        "(x float32 (rows, in), packed int16, weight_inv float32 (out,), a_max, bias or None, kernel) -> "
        "float32 (rows, out); kernel: 'auto' (the best this CPU has) or one of int16_kernels(); "
        "see fairseq_stream/ops/int16_linear.py",
        py::arg("x"), py::arg("packed"), py::arg("weight_inv"), py::arg("a_max"),
        py::arg("bias") = py::none(), py::arg("kernel") = "auto");
  m.def("int16_kernels", &int16_kernels, "the int16 kernels this CPU runs, the best (the 'auto' one) last");
}

// lean_step_cpu.cpp: the lean runner's layers (their products are Product objects, bind_product).
// The three calls run without the GIL (they touch no Python object): the encoder thread
// (schedule/read_ahead.py) encodes while the decoder's layers run, and the other way round. Holding
// it, a batch's whole encoder call would stall the decoder's Python for its duration.
void bind_lean_step(py::module& m) {
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

// attention_cpu.cpp and cache_slots_cpu.cpp: the attentions and their caches.
void bind_attention(py::module& m) {
  m.def("copy_cache_slots_", &copy_cache_slots_,
        "(cache (2 * layers, slots, heads, capacity, head_dim), source, target (n,) slots, length): positions "
        "0..length-1 of each source slot copied to its target slot, in place (targets distinct from sources)",
        py::arg("cache"), py::arg("source"), py::arg("target"), py::arg("length"));
  m.def("reorder_cache_slots_", &reorder_cache_slots,
        "(caches [(2 * layers, slots, heads, capacity, head_dim)], parent_slot (rows,), length, compact_above) -> "
        "(caches, slot (rows,)): rows follow their parents' slots (a parent's later children take free slots, "
        "lowest first, with a copy), then compaction where most slots are free; see "
        "fairseq_stream/ops/attention.py:follow_parents_",
        py::arg("caches"), py::arg("parent_slot"), py::arg("length"), py::arg("compact_above"));
  m.def("cached_attention_", &cached_attention_,
        "(q, k, v (rows, heads * head_dim), keys, values (slots, heads, capacity, head_dim), slot (rows,) or None, "
        "length, scale) -> (rows, heads * head_dim); writes k, v at position length first",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("keys"), py::arg("values"),
        py::arg("slot"), py::arg("length"), py::arg("scale"));
  m.def("source_attention", &source_attention,
        "(q (rows, heads * head_dim), keys, values (sentences, heads, source, head_dim), row_sentence (rows,), "
        "mask (sentences, 1, 1, source) additive or None, scale) -> (rows, heads * head_dim)",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("row_sentence"),
        py::arg("mask"), py::arg("scale"));
  m.def("sentence_attention", &sentence_attention,
        "(qkv (tokens, 3 * heads * head_dim), starts (sentences + 1), heads, scale, dense_from) -> "
        "(tokens, heads * head_dim): each token over its own sentence's tokens",
        py::arg("qkv"), py::arg("starts"), py::arg("heads"), py::arg("scale"),
        py::arg("dense_from"));
  m.def("window_attention_", &window_attention_,
        "(q, k, v (positions, heads * head_dim), keys, values (rows, heads, capacity, head_dim), window_row, "
        "window_step (positions,), scale, visible (positions, W) additive or None) -> (positions, heads * head_dim); "
        "writes the window's k, v first",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("keys"), py::arg("values"),
        py::arg("window_row"), py::arg("window_step"), py::arg("scale"),
        py::arg("visible") = py::none());
}

// beam_step_cpu.cpp: the compiled search step.
void bind_beam_step(py::module& m) {
  m.def("fairseq_select", &fairseq_select,
        "(cand (S, W), local (S, W) or None, word_of (S, W) or None, per_slot, k, eos, step, done_len (S, k), "
        "best_finished (S,), max_lens (S,), empty (S,), ids (S,), rp, ap, rpl, mc (negative: off)) -> [parent, "
        "token, score, live, eos_mask, top_slot, top_score, done_len, best_finished, finished_now, summary, "
        "flat_parent, no_live, zeros]; see fairseq_stream/ops/beam_step.py",
        py::arg("cand"), py::arg("local"), py::arg("word_of"), py::arg("per_slot"),
        py::arg("k"), py::arg("eos"), py::arg("step"), py::arg("done_len"),
        py::arg("best_finished"), py::arg("max_lens"), py::arg("empty"), py::arg("ids"),
        py::arg("rp"), py::arg("ap"), py::arg("rpl"), py::arg("mc"));
  m.def("stay_select", &stay_select,
        "(cand (S, W), local (S, W) or None, word_of (S, W) or None, per_slot, k, eos, pad, step, done_len (S, k), "
        "scores (S*k, width), empty (S,), ids (S,), rp, ap, rpl, mc (negative: off)) -> [parent, token, score, "
        "live, done, fresh, no_live, done_len, finished_now, summary, flat_parent, extended]; see "
        "fairseq_stream/ops/beam_step.py",
        py::arg("cand"), py::arg("local"), py::arg("word_of"), py::arg("per_slot"),
        py::arg("k"), py::arg("eos"), py::arg("pad"), py::arg("step"),
        py::arg("done_len"), py::arg("scores"), py::arg("empty"), py::arg("ids"),
        py::arg("rp"), py::arg("ap"), py::arg("rpl"), py::arg("mc"));
  m.def("reorder_beam_", &reorder_beam,
        "(tokens (R, L) int64, scores (R, L') float, flat_parent (R,), extended (R,) bool, new_token (R,), "
        "new_score (R,), step): in place, rows take their parent's history and, where extended, the new "
        "token and score; see fairseq_stream/ops/beam_step.py",
        py::arg("tokens"), py::arg("scores"), py::arg("flat_parent"), py::arg("extended"),
        py::arg("new_token"), py::arg("new_score"), py::arg("step"));
}

// search_loop_cpu.cpp: a batch's whole search in one call.
void bind_search_loop(py::module& m) {
  py::class_<LeanDecoderModel>(m, "LeanDecoderModel",
                               "one model's decoder for the search loops: embedding, layers, output layer")
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
        "(models, per model: encoder keys [layers], values [layers], mask or None; bos, max_lens (one per "
        "sentence), min_len, pad, eos, unk (-1: none), unk_penalty, temperature) -> [words, cumulative scores "
        "(float32), lengths]: each sentence's words (EOS last), flat in sentence order",
        py::arg("models"), py::arg("enc_keys"), py::arg("enc_values"), py::arg("masks"), py::arg("bos"),
        py::arg("max_lens"), py::arg("min_len"), py::arg("pad"), py::arg("eos"), py::arg("unk"),
        py::arg("unk_penalty"), py::arg("temperature"), py::call_guard<py::gil_scoped_release>());
  m.def("beam_decode", &beam_decode,
        "(models, per model: encoder keys [layers], values [layers], mask or None; k, n (candidates a row), bos, "
        "max_lens (one per sentence), min_len, pad, eos, unk (-1: none), unk_penalty, temperature) -> [words, "
        "cumulative scores (float32), lengths, hypotheses per sentence, steps per sentence]: each sentence's "
        "finalized hypotheses in finalization order, flat in sentence order",
        py::arg("models"), py::arg("enc_keys"), py::arg("enc_values"), py::arg("masks"), py::arg("k"), py::arg("n"),
        py::arg("bos"), py::arg("max_lens"), py::arg("min_len"), py::arg("pad"), py::arg("eos"), py::arg("unk"),
        py::arg("unk_penalty"), py::arg("temperature"), py::call_guard<py::gil_scoped_release>());
  m.def("aten_layer_norm_kernel_found", [] { return aten_layer_norm_kernel() != nullptr; },
        "whether the search loops' kept-buffer step calls ATen's layer-norm kernel directly (else "
        "at::native_layer_norm)");
}

// rnn_step_cpu.cpp: the LSTM step.
void bind_rnn_step(py::module& m) {
  m.def("rnn_step", &rnn_step,
        "(x (rows, 4H), feed (P, F), h (L, P, H), c (L, P, H), parent (rows,) or None, recurrent [L products], "
        "upper_input [L-1] (Product each), residuals, keys [groups], values, masks, row_sentences, "
        "out_hidden or None, "
        "additional_fc or None, output) -> [logits (rows, V), h (L, rows, H), c (L, rows, H), out (rows, H)]; "
        "see fairseq_stream/ops/rnn_step.py",
        py::arg("x"), py::arg("feed"), py::arg("h"), py::arg("c"), py::arg("parent"),
        py::arg("recurrent"), py::arg("upper_input"), py::arg("residuals"), py::arg("keys"),
        py::arg("values"), py::arg("masks"), py::arg("row_sentences"), py::arg("out_hidden"),
        py::arg("additional_fc"), py::arg("output"));
  m.def("exp_approx", &exp_approx_of, "the step's exp, elementwise (for tests)");
  m.def("sigmoid_approx", &sigmoid_approx_of, "the step's sigmoid, elementwise (for tests)");
  m.def("tanh_approx", &tanh_approx_of, "the step's tanh, elementwise (for tests)");
}

// parallel_cpu.cpp: the kernels' own threads.
void bind_parallel(py::module& m) {
  m.def("kernel_threads", &fs::kernel_threads, "threads a kernel call may use, the caller included");
  m.def("set_kernel_threads", &fs::set_kernel_threads,
        "threads a kernel call may use, the caller included (0: torch's get_num_threads())");
  m.def("parallel_counters", &fs::parallel_counters,
        "(kernel calls, calls shared with worker threads, chunks the workers ran) since the process started");
  m.def("parallel_sum_of_squares", &fs::parallel_sum_of_squares, py::call_guard<py::gil_scoped_release>(),
        "sum of i*i over [0, n) and the items not counted exactly once");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fairseq-stream's CPU kernels: the fused output layer, the products, the lean and LSTM steps, attention, "
            "the search step and loops";
  bind_output_layer(m);
  bind_product(m);
  bind_int8_linear(m);
  bind_int16_linear(m);
  bind_lean_step(m);
  bind_attention(m);
  bind_beam_step(m);
  bind_search_loop(m);
  bind_rnn_step(m);
  bind_parallel(m);
}
