// The indexed attention kernel (../cuda/indexed_attention_cuda.cu) run on the host (see cuda_runtime.h here),
// behind a C entry point for ctypes. Built by tests/test_indexed_attention.py:
//   c++ -std=c++17 -O1 -shared -fPIC -I <this dir> -I ../cuda emulate_indexed_attention.cpp
// Float32 and float64 only (half precision is a type here, not emulated).
#include "indexed_attention_cuda.cu"

namespace {

template <typename scalar_t>
int run(const long* dims, double scale, const void* const* in, void* out) {
  using namespace fairseq_stream;
  IndexedAttentionArgs<scalar_t> a{};
  a.q = static_cast<const scalar_t*>(in[0]);
  a.q_row_stride = dims[0];
  a.keys = static_cast<const scalar_t*>(in[1]);
  a.values = static_cast<const scalar_t*>(in[2]);
  a.index = static_cast<const int64_t*>(in[3]);
  a.mask = static_cast<const scalar_t*>(in[4]);
  a.lengths = static_cast<const int64_t*>(in[5]);
  a.out = static_cast<scalar_t*>(out);
  a.rows = dims[1];
  a.heads = dims[2];
  a.T = dims[3];
  a.hd = dims[4];
  a.scale = scale;
  return indexed_attention_launch<scalar_t>(a, nullptr) == cudaSuccess ? 0 : 1;
}

}  // namespace

// dims: q_row_stride, rows, heads, T, head_dim; in: q, keys, values, index, mask (or null), lengths (or null).
extern "C" int fs_emulate_indexed_attention(int float64, const long* dims, double scale, const void* const* in,
                                            void* out) {
  return float64 ? run<double>(dims, scale, in, out) : run<float>(dims, scale, in, out);
}
