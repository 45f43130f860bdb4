// The CUDA search step's kernel (../cuda/beam_step_cuda.cu) run on the host (see cuda_runtime.h here),
// behind a C entry point for ctypes. Built by tests/test_beam_step_cuda.py:
//   c++ -std=c++17 -O1 -shared -fPIC -I <this dir> -I ../cuda emulate_beam_step.cpp
// The binding's part (at::topk, the allocations) is the test's, in torch.
#include "beam_step_cuda.cu"

#include <vector>

namespace {

// The kernels' scratch in host memory, `cells` entries per array.
template <typename scalar_t>
struct Scratch {
  std::vector<int64_t> longs;
  std::vector<char> flags;
  std::vector<scalar_t> values;
  fairseq_stream::SelectScratch<scalar_t> carved;
  explicit Scratch(int64_t cells)
      : longs(2 * cells), flags(3 * cells), values(2 * cells),
        carved(fairseq_stream::carve_scratch<scalar_t>(longs.data(), flags.data(), values.data(), cells)) {}
};

template <typename scalar_t>
int run(const long* dims, const double* prune, const void* const* in, void* const* out) {
  using namespace fairseq_stream;
  FairseqSelectArgs<scalar_t> a{};
  a.shape = SelectShape{dims[0], dims[1],  dims[2], dims[3], dims[4],
                        dims[5], prune_options(prune[0], prune[1], prune[2], dims[8])};
  a.top_score = static_cast<const scalar_t*>(in[0]);
  a.top_idx = static_cast<const int64_t*>(in[1]);
  a.word_of = static_cast<const int64_t*>(in[2]);
  a.word_width = dims[6];
  a.local = static_cast<const scalar_t*>(in[3]);
  a.local_width = dims[7];
  a.done_len = static_cast<const int64_t*>(in[4]);
  a.best_finished = static_cast<const scalar_t*>(in[5]);
  a.max_lens = static_cast<const int64_t*>(in[6]);
  a.empty = static_cast<const bool*>(in[7]);
  a.ids = static_cast<const int64_t*>(in[8]);
  a.out = {static_cast<int64_t*>(out[0]),  static_cast<int64_t*>(out[1]),  static_cast<scalar_t*>(out[2]),
           static_cast<bool*>(out[3]),     static_cast<bool*>(out[4]),     static_cast<int64_t*>(out[5]),
           static_cast<scalar_t*>(out[6]), static_cast<int64_t*>(out[7]),  static_cast<scalar_t*>(out[8]),
           static_cast<bool*>(out[9]),     static_cast<int64_t*>(out[10]), static_cast<int64_t*>(out[11]),
           static_cast<bool*>(out[12])};
  Scratch<scalar_t> scratch(dims[0] * dims[1]);
  a.scratch = scratch.carved;
  return static_cast<int>(fairseq_select_launch<scalar_t>(a, nullptr));
}

template <typename scalar_t>
int run_stay(const long* dims, const double* prune, const void* const* in, void* const* out) {
  using namespace fairseq_stream;
  const int64_t S = dims[0], k = dims[1], W = dims[2];
  StaySelectArgs<scalar_t> a{};
  a.shape = StayShape{S, k, W, dims[3], dims[4], dims[5], dims[6], prune_options(prune[0], prune[1], prune[2], dims[7])};
  // The binding's order: the finished entries' scores first (a kernel), then at::topk (the caller's, given here
  // as top_score/top_idx), then the step.
  const int64_t* done_len = static_cast<const int64_t*>(in[4]);
  cudaError_t err = stay_done_scores_launch<scalar_t>(S, k, done_len, static_cast<const scalar_t*>(in[7]), dims[8],
                                                      static_cast<scalar_t*>(out[12]), nullptr);
  if (err != cudaSuccess || !in[0]) return static_cast<int>(err);  // no top-k given: the scores alone
  a.top_score = static_cast<const scalar_t*>(in[0]);
  a.top_idx = static_cast<const int64_t*>(in[1]);
  a.word_of = static_cast<const int64_t*>(in[2]);
  a.local = static_cast<const scalar_t*>(in[3]);
  a.done_len = done_len;
  a.empty = static_cast<const bool*>(in[5]);
  a.ids = static_cast<const int64_t*>(in[6]);
  a.out = {static_cast<int64_t*>(out[0]), static_cast<int64_t*>(out[1]),  static_cast<scalar_t*>(out[2]),
           static_cast<bool*>(out[3]),    static_cast<bool*>(out[4]),     static_cast<bool*>(out[5]),
           static_cast<bool*>(out[6]),    static_cast<int64_t*>(out[7]),  static_cast<bool*>(out[8]),
           static_cast<int64_t*>(out[9]), static_cast<int64_t*>(out[10]), static_cast<bool*>(out[11])};
  Scratch<scalar_t> scratch(S * k);
  a.scratch = scratch.carved;
  return static_cast<int>(stay_select_launch<scalar_t>(a, nullptr));
}

}  // namespace

// dims: S, n, k, per_slot, eos, step, word_width, local_width, mc; prune: rp, ap, rpl (negative: off);
// in: top_score, top_idx, word_of, local (null where absent), done_len, best_finished, max_lens, empty, ids;
// out: the 13 tensors of FairseqSelectArgs::out, the summary's last entry zeroed by the caller.
extern "C" int fs_emulate_fairseq_select(int is_double, const long* dims, const double* prune,
                                         const void* const* in, void* const* out) {
  return is_double ? run<double>(dims, prune, in, out) : run<float>(dims, prune, in, out);
}

// dims: S, k, W, per_slot, eos, pad, step, mc, width (the history's); prune: rp, ap, rpl;
// in: top_score, top_idx (both null: only the finished entries' scores), word_of, local, done_len, empty, ids,
// scores (the (S * k, width) history); out: the 12 tensors of StaySelectArgs::out (the summary's last entry
// zeroed by the caller), then the (S, k) finished entries' scores.
extern "C" int fs_emulate_stay_select(int is_double, const long* dims, const double* prune, const void* const* in,
                                      void* const* out) {
  return is_double ? run_stay<double>(dims, prune, in, out) : run_stay<float>(dims, prune, in, out);
}

// dims: R, step, token_stride, score_stride; in: flat_parent, extended, new_token, new_score; tokens and scores
// moved in place.
extern "C" int fs_emulate_reorder_beam(int is_double, const long* dims, void* tokens, void* scores,
                                       const void* const* in) {
  using namespace fairseq_stream;
  const int64_t R = dims[0], step = dims[1];
  std::vector<int64_t> token_buffer(R * (step + 1));
  auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    std::vector<scalar_t> score_buffer(R * step);
    const ReorderArgs<scalar_t> a{R, step, static_cast<int64_t*>(tokens), dims[2], static_cast<scalar_t*>(scores),
                                  dims[3], static_cast<const int64_t*>(in[0]), static_cast<const bool*>(in[1]),
                                  static_cast<const int64_t*>(in[2]), static_cast<const scalar_t*>(in[3]),
                                  token_buffer.data(), score_buffer.data()};
    return static_cast<int>(reorder_beam_launch<scalar_t>(a, nullptr));
  };
  return is_double ? run(0.0) : run(0.0f);
}
