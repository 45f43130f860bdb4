// The CUDA search step's kernel (../cuda/beam_step_cuda.cu) run on the host (see cuda_runtime.h here),
// behind a C entry point for ctypes. Built by tests/test_beam_step_cuda.py:
//   c++ -std=c++17 -O1 -shared -fPIC -I <this dir> -I ../cuda emulate_beam_step.cpp
// The binding's part (at::topk, the allocations) is the test's, in torch.
#include "beam_step_cuda.cu"

#include <vector>

namespace {

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
  const size_t cells = static_cast<size_t>(dims[0] * dims[1]);
  std::vector<int64_t> longs(2 * cells);
  std::vector<char> flags(3 * cells);
  std::vector<scalar_t> values(2 * cells);
  a.words = longs.data();
  a.beams = longs.data() + cells;
  a.is_eos = flags.data();
  a.keep = flags.data() + cells;
  a.carried = flags.data() + 2 * cells;
  a.score = values.data();
  a.local_scratch = values.data() + cells;
  return static_cast<int>(fairseq_select_launch<scalar_t>(a, nullptr));
}

}  // namespace

// dims: S, n, k, per_slot, eos, step, word_width, local_width, mc; prune: rp, ap, rpl (negative: off);
// in: top_score, top_idx, word_of, local (null where absent), done_len, best_finished, max_lens, empty, ids;
// out: the 13 tensors of FairseqSelectArgs::out, the summary's last entry zeroed by the caller.
extern "C" int fs_emulate_fairseq_select(int is_double, const long* dims, const double* prune,
                                         const void* const* in, void* const* out) {
  return is_double ? run<double>(dims, prune, in, out) : run<float>(dims, prune, in, out);
}
