// ATen side of the CUDA search step (beam_step_cuda.cu holds the kernels): the same arguments and
// results as the CPU ops fairseq_select, stay_select and reorder_beam (../cpu/beam_step_cpu.cpp;
// fairseq_stream/ops/beam_step.py documents them), on CUDA tensors. The ranking that can tie, each
// sentence's best candidates, is at::topk itself, as in the CPU ops and the torch reference.
// output_layer_cuda_binding.cpp puts them in the module (ATen headers only here: torch/python.h is
// the slow one to compile).

#include "beam_step_cuda_binding.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "../beam_step_outputs.h"
#include "beam_step_cuda.h"

namespace {

using at::Tensor;

// op's argument `name` must be a `type` tensor of `shape` on like's device.
void check_on(const char* op, const Tensor& t, const Tensor& like, at::ScalarType type, std::vector<int64_t> shape,
              const char* name) {
  TORCH_CHECK(t.device() == like.device() && t.scalar_type() == type && t.sizes() == at::IntArrayRef(shape), op,
              ": ", name, " must be a ", type, " tensor of shape ", at::IntArrayRef(shape), " on ", like.device(),
              "; got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

// What both ops take alike: cand (S, W) float32 or float64 on CUDA, local and word_of beside it, done_len (S, k),
// empty and ids (S,); rpl needs local.
void check_step_inputs(const char* op, const Tensor& cand, const std::optional<Tensor>& local,
                       const std::optional<Tensor>& word_of, double rpl, int64_t k, const Tensor& done_len,
                       const Tensor& empty, const Tensor& ids) {
  TORCH_CHECK(cand.is_cuda() && cand.dim() == 2, op, ": cand must be a 2-d CUDA tensor");
  TORCH_CHECK(cand.scalar_type() == at::kFloat || cand.scalar_type() == at::kDouble, op,
              ": cand must be float32 or float64");
  const int64_t S = cand.size(0), W = cand.size(1);
  if (local) check_on(op, *local, cand, cand.scalar_type(), {S, W}, "local");
  if (word_of) check_on(op, *word_of, cand, at::kLong, {S, W}, "word_of");
  TORCH_CHECK(!(rpl >= 0) || local.has_value(), op, ": --prune-rpl needs local");
  check_on(op, done_len, cand, at::kLong, {S, k}, "done_len");
  check_on(op, empty, cand, at::kBool, {S}, "empty");
  check_on(op, ids, cand, at::kLong, {S}, "ids");
}

// The kernels' scratch, `cells` entries per array, on like's device; `held` keeps the tensors until the launch
// (the caching allocator orders their reuse after it on the stream).
template <typename scalar_t>
fairseq_stream::SelectScratch<scalar_t> scratch_on(const Tensor& like, int64_t cells, std::vector<Tensor>& held) {
  const auto opts = like.options();
  held = {at::empty({2 * cells}, opts.dtype(at::kLong)), at::empty({3 * cells}, opts.dtype(at::kByte)),
          at::empty({2 * cells}, opts)};
  return fairseq_stream::carve_scratch<scalar_t>(held[0].data_ptr<int64_t>(),
                                                 reinterpret_cast<char*>(held[1].data_ptr<uint8_t>()),
                                                 held[2].data_ptr<scalar_t>(), cells);
}

template <typename scalar_t>
void launch(const fairseq_stream::SelectShape& sh, const Tensor& top_scores, const Tensor& top_idx,
            const std::optional<Tensor>& word_of, const std::optional<Tensor>& local, const Tensor& done_len,
            const Tensor& best_finished, const Tensor& max_lens, const Tensor& empty, const Tensor& ids,
            std::vector<Tensor>& out) {
  std::vector<Tensor> held;
  fairseq_stream::FairseqSelectArgs<scalar_t> a{};
  a.scratch = scratch_on<scalar_t>(top_scores, sh.S * sh.n, held);
  a.shape = sh;
  a.top_score = top_scores.data_ptr<scalar_t>();
  a.top_idx = top_idx.data_ptr<int64_t>();
  a.word_of = word_of ? word_of->data_ptr<int64_t>() : nullptr;
  a.word_width = word_of ? word_of->size(1) : 0;
  a.local = local ? local->data_ptr<scalar_t>() : nullptr;
  a.local_width = local ? local->size(1) : 0;
  a.done_len = done_len.data_ptr<int64_t>();
  a.best_finished = best_finished.data_ptr<scalar_t>();
  a.max_lens = max_lens.data_ptr<int64_t>();
  a.empty = empty.data_ptr<bool>();
  a.ids = ids.data_ptr<int64_t>();
  a.out = fairseq_stream::select_out_of<scalar_t>(out);
  const cudaError_t err =
      fairseq_stream::fairseq_select_launch<scalar_t>(a, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "fairseq_select (CUDA): ", cudaGetErrorString(err));
}

}  // namespace

std::vector<Tensor> fairseq_select_cuda(const Tensor& cand, const std::optional<Tensor>& local,
                                        const std::optional<Tensor>& word_of, int64_t per_slot, int64_t k,
                                        int64_t eos, int64_t step, const Tensor& done_len,
                                        const Tensor& best_finished, const Tensor& max_lens, const Tensor& empty,
                                        const Tensor& ids, double rp, double ap, double rpl, int64_t mc) {
  check_step_inputs("fairseq_select", cand, local, word_of, rpl, k, done_len, empty, ids);
  const int64_t S = cand.size(0), W = cand.size(1);
  check_on("fairseq_select", best_finished, cand, cand.scalar_type(), {S}, "best_finished");
  check_on("fairseq_select", max_lens, cand, at::kLong, {S}, "max_lens");
  // fairseq's bound (size - 1) on whole-vocabulary candidates; pre-selected ones are all usable.
  const int64_t n = std::min(2 * k, W - (word_of ? 0 : 1));
  TORCH_CHECK(n >= k && per_slot > 0, "fairseq_select: fewer candidates than the beam");
  const c10::cuda::CUDAGuard guard(cand.device());

  auto top = at::topk(cand, n, 1, /*largest=*/true, /*sorted=*/true);
  const Tensor top_scores = std::get<0>(top).contiguous(), top_idx = std::get<1>(top).contiguous();
  std::vector<Tensor> out = fairseq_select_outputs(cand, S, k);
  const fairseq_stream::SelectShape sh{S, n, k, per_slot, eos, step, fairseq_stream::prune_options(rp, ap, rpl, mc)};
  std::optional<Tensor> word_rows, local_rows;
  if (word_of) word_rows = word_of->contiguous();
  if (local) local_rows = local->contiguous();
  if (cand.scalar_type() == at::kDouble) {
    launch<double>(sh, top_scores, top_idx, word_rows, local_rows, done_len.contiguous(),
                   best_finished.contiguous(), max_lens.contiguous(), empty.contiguous(), ids.contiguous(), out);
  } else {
    launch<float>(sh, top_scores, top_idx, word_rows, local_rows, done_len.contiguous(), best_finished.contiguous(),
                  max_lens.contiguous(), empty.contiguous(), ids.contiguous(), out);
  }
  return out;
}


namespace {

template <typename scalar_t>
void launch_stay(const fairseq_stream::StayShape& sh, const Tensor& done_len, const Tensor& scores,
                 const Tensor& cand, const std::optional<Tensor>& word_of, const std::optional<Tensor>& local,
                 const Tensor& empty, const Tensor& ids, std::vector<Tensor>& out) {
  const int64_t S = sh.S, k = sh.k;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  // The finished entries compete with the expansions: their cumulative scores, -inf for other slots.
  Tensor done_scores = at::empty({S, k}, cand.options());
  cudaError_t err = fairseq_stream::stay_done_scores_launch<scalar_t>(
      S, k, done_len.data_ptr<int64_t>(), scores.data_ptr<scalar_t>(), scores.size(1),
      done_scores.data_ptr<scalar_t>(), stream);
  TORCH_CHECK(err == cudaSuccess, "stay_select (CUDA): ", cudaGetErrorString(err));
  auto top = at::topk(at::cat({cand, done_scores}, 1), k, 1, /*largest=*/true, /*sorted=*/true);
  const Tensor top_scores = std::get<0>(top).contiguous(), top_idx = std::get<1>(top).contiguous();
  std::vector<Tensor> held;
  fairseq_stream::StaySelectArgs<scalar_t> a{};
  a.scratch = scratch_on<scalar_t>(cand, S * k, held);
  a.shape = sh;
  a.top_score = top_scores.data_ptr<scalar_t>();
  a.top_idx = top_idx.data_ptr<int64_t>();
  a.word_of = word_of ? word_of->data_ptr<int64_t>() : nullptr;
  a.local = local ? local->data_ptr<scalar_t>() : nullptr;
  a.done_len = done_len.data_ptr<int64_t>();
  a.empty = empty.data_ptr<bool>();
  a.ids = ids.data_ptr<int64_t>();
  a.out = fairseq_stream::stay_out_of<scalar_t>(out);
  err = fairseq_stream::stay_select_launch<scalar_t>(a, stream);
  TORCH_CHECK(err == cudaSuccess, "stay_select (CUDA): ", cudaGetErrorString(err));
}

}  // namespace

std::vector<Tensor> stay_select_cuda(const Tensor& cand, const std::optional<Tensor>& local,
                                     const std::optional<Tensor>& word_of, int64_t per_slot, int64_t k, int64_t eos,
                                     int64_t pad, int64_t step, const Tensor& done_len, const Tensor& scores,
                                     const Tensor& empty, const Tensor& ids, double rp, double ap, double rpl,
                                     int64_t mc) {
  check_step_inputs("stay_select", cand, local, word_of, rpl, k, done_len, empty, ids);
  const int64_t S = cand.size(0), W = cand.size(1);
  TORCH_CHECK(scores.device() == cand.device() && scores.dim() == 2 && scores.size(0) == S * k &&
                  scores.scalar_type() == cand.scalar_type(),
              "stay_select: scores must be an (S * k, width) tensor of cand's dtype and device");
  TORCH_CHECK(W >= 1 && per_slot > 0, "stay_select: no candidates");
  const c10::cuda::CUDAGuard guard(cand.device());
  // A length beyond the history (never from the decoder) reads as no finished entry: checking it here
  // would read the device.
  std::vector<Tensor> out = stay_select_outputs(cand, S, k);
  const fairseq_stream::StayShape sh{S, k, W, per_slot, eos, pad, step, fairseq_stream::prune_options(rp, ap, rpl, mc)};
  std::optional<Tensor> word_rows, local_rows;
  if (word_of) word_rows = word_of->contiguous();
  if (local) local_rows = local->contiguous();
  if (cand.scalar_type() == at::kDouble) {
    launch_stay<double>(sh, done_len.contiguous(), scores.contiguous(), cand, word_rows, local_rows,
                        empty.contiguous(), ids.contiguous(), out);
  } else {
    launch_stay<float>(sh, done_len.contiguous(), scores.contiguous(), cand, word_rows, local_rows,
                       empty.contiguous(), ids.contiguous(), out);
  }
  return out;
}

void reorder_beam_cuda(Tensor tokens, Tensor scores, const Tensor& flat_parent, const Tensor& extended,
                       const Tensor& new_token, const Tensor& new_score, int64_t step) {
  TORCH_CHECK(tokens.is_cuda() && tokens.scalar_type() == at::kLong && tokens.dim() == 2 && tokens.stride(1) == 1,
              "reorder_beam_: tokens must be a 2-d int64 CUDA tensor, rows of contiguous entries");
  TORCH_CHECK(scores.device() == tokens.device() && scores.dim() == 2 && scores.size(0) == tokens.size(0) &&
                  scores.stride(1) == 1 && new_score.scalar_type() == scores.scalar_type() &&
                  (scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kDouble),
              "reorder_beam_: scores must be a (rows, width) float32 or float64 tensor of new_score's dtype, rows of "
              "contiguous entries, on the tokens' device");
  TORCH_CHECK(step >= 0 && tokens.size(1) > step + 1 && scores.size(1) > step, "reorder_beam_: step ", step,
              " outside the histories (tokens ", tokens.sizes(), ", scores ", scores.sizes(), ")");
  const int64_t R = tokens.size(0);
  check_on("reorder_beam_", flat_parent.reshape(-1), tokens, at::kLong, {R}, "flat_parent");
  check_on("reorder_beam_", extended.reshape(-1), tokens, at::kBool, {R}, "extended");
  check_on("reorder_beam_", new_token.reshape(-1), tokens, at::kLong, {R}, "new_token");
  check_on("reorder_beam_", new_score.reshape(-1), tokens, scores.scalar_type(), {R}, "new_score");
  const c10::cuda::CUDAGuard guard(tokens.device());
  const Tensor parent = flat_parent.reshape(-1).contiguous(), flags = extended.reshape(-1).contiguous();
  const Tensor token = new_token.reshape(-1).contiguous(), score = new_score.reshape(-1).contiguous();
  const Tensor token_buffer = at::empty({R * (step + 1)}, tokens.options());
  const Tensor score_buffer = at::empty({R * step}, scores.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    const fairseq_stream::ReorderArgs<scalar_t> a{R, step, tokens.data_ptr<int64_t>(), tokens.stride(0),
                                                  scores.data_ptr<scalar_t>(), scores.stride(0),
                                                  parent.data_ptr<int64_t>(), flags.data_ptr<bool>(),
                                                  token.data_ptr<int64_t>(), score.data_ptr<scalar_t>(),
                                                  token_buffer.data_ptr<int64_t>(), score_buffer.data_ptr<scalar_t>()};
    return fairseq_stream::reorder_beam_launch<scalar_t>(a, stream);
  };
  const cudaError_t err = scores.scalar_type() == at::kDouble ? run(0.0) : run(0.0f);
  TORCH_CHECK(err == cudaSuccess, "reorder_beam_ (CUDA): ", cudaGetErrorString(err));
}
