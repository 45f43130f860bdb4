// ATen side of the CUDA search step (beam_step_cuda.cu holds the kernel): the same arguments and
// results as the CPU op fairseq_select (../cpu/beam_step_cpu.cpp; fairseq_stream/ops/beam_step.py
// documents them), on CUDA tensors. The ranking that can tie, each sentence's best candidates, is
// at::topk itself, as in the CPU op and the torch reference. output_layer_cuda_binding.cpp puts it
// in the module (ATen headers only here: torch/python.h is the slow one to compile).

#include "beam_step_cuda_binding.h"

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

void check_on(const Tensor& t, const Tensor& cand, at::ScalarType type, std::vector<int64_t> shape,
              const char* name) {
  TORCH_CHECK(t.device() == cand.device() && t.scalar_type() == type && t.sizes() == at::IntArrayRef(shape),
              "fairseq_select: ", name, " must be a ", type, " tensor of shape ", at::IntArrayRef(shape), " on ",
              cand.device(), "; got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

template <typename scalar_t>
void launch(const fairseq_stream::SelectShape& sh, const Tensor& top_scores, const Tensor& top_idx,
            const std::optional<Tensor>& word_of, const std::optional<Tensor>& local, const Tensor& done_len,
            const Tensor& best_finished, const Tensor& max_lens, const Tensor& empty, const Tensor& ids,
            std::vector<Tensor>& out) {
  const int64_t S = sh.S, n = sh.n;
  const auto opts = top_scores.options();
  Tensor longs = at::empty({2, S, n}, opts.dtype(at::kLong));
  Tensor flags = at::empty({3, S, n}, opts.dtype(at::kByte));
  Tensor values = at::empty({2, S, n}, opts);
  fairseq_stream::FairseqSelectArgs<scalar_t> a{};
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
  a.out = {out[0].data_ptr<int64_t>(),  out[1].data_ptr<int64_t>(),  out[2].data_ptr<scalar_t>(),
           out[3].data_ptr<bool>(),     out[4].data_ptr<bool>(),     out[5].data_ptr<int64_t>(),
           out[6].data_ptr<scalar_t>(), out[7].data_ptr<int64_t>(),  out[8].data_ptr<scalar_t>(),
           out[9].data_ptr<bool>(),     out[10].data_ptr<int64_t>(), out[11].data_ptr<int64_t>(),
           out[12].data_ptr<bool>()};
  int64_t* l = longs.data_ptr<int64_t>();
  char* f = reinterpret_cast<char*>(flags.data_ptr<uint8_t>());
  scalar_t* v = values.data_ptr<scalar_t>();
  a.words = l;
  a.beams = l + S * n;
  a.is_eos = f;
  a.keep = f + S * n;
  a.carried = f + 2 * S * n;
  a.score = v;
  a.local_scratch = v + S * n;
  const cudaError_t err = fairseq_stream::fairseq_select_launch<scalar_t>(a, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "fairseq_select (CUDA): ", cudaGetErrorString(err));
}

}  // namespace

std::vector<Tensor> fairseq_select_cuda(const Tensor& cand, const std::optional<Tensor>& local,
                                        const std::optional<Tensor>& word_of, int64_t per_slot, int64_t k,
                                        int64_t eos, int64_t step, const Tensor& done_len,
                                        const Tensor& best_finished, const Tensor& max_lens, const Tensor& empty,
                                        const Tensor& ids, double rp, double ap, double rpl, int64_t mc) {
  TORCH_CHECK(cand.is_cuda() && cand.dim() == 2, "fairseq_select: cand must be a 2-d CUDA tensor");
  TORCH_CHECK(cand.scalar_type() == at::kFloat || cand.scalar_type() == at::kDouble,
              "fairseq_select: cand must be float32 or float64");
  const int64_t S = cand.size(0), W = cand.size(1);
  if (local) check_on(*local, cand, cand.scalar_type(), {S, W}, "local");
  if (word_of) check_on(*word_of, cand, at::kLong, {S, W}, "word_of");
  TORCH_CHECK(!(rpl >= 0) || local.has_value(), "fairseq_select: --prune-rpl needs local");
  check_on(done_len, cand, at::kLong, {S, k}, "done_len");
  check_on(best_finished, cand, cand.scalar_type(), {S}, "best_finished");
  check_on(max_lens, cand, at::kLong, {S}, "max_lens");
  check_on(empty, cand, at::kBool, {S}, "empty");
  check_on(ids, cand, at::kLong, {S}, "ids");
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

