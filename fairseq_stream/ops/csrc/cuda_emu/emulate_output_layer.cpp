// The CUDA output layer's kernels run on the host (see cuda_runtime.h here), behind a C entry
// point for ctypes. Built by tests/test_output_layer.py:
//   c++ -std=c++20 -O1 -shared -fPIC -I <this dir> -I ../cuda emulate_output_layer.cpp
#include "output_layer_cuda.cu"

#include <cstdlib>

extern "C" int fs_emulate_output_layer(int type, int models, long rows, int vocab, int n, const void** logits,
                                       const void** bias, int has_bias, double temperature, int pad, int eos,
                                       int unk, double unk_penalty, int ban_all, const bool* ban, const bool* force,
                                       const void* add, void* values, long* indices, void* eos_out,
                                       int multiprocessors) {
  using namespace fairseq_stream;
  OutputLayerArgs a{};
  a.type = static_cast<OutputLayerType>(type);
  a.models = models;
  a.rows = rows;
  a.vocab = vocab;
  a.n = n;
  for (int m = 0; m < models; ++m) {
    a.logits[m] = logits[m];
    a.bias[m] = has_bias ? bias[m] : nullptr;
  }
  a.has_bias = has_bias != 0;
  a.temperature = temperature;
  a.pad = pad;
  a.eos = eos;
  a.unk = unk;
  a.unk_penalty = unk_penalty;
  a.ban_all = ban_all != 0;
  a.ban = ban;
  a.force = force;
  a.add = add;
  a.values = values;
  a.indices = reinterpret_cast<int64_t*>(indices);
  a.eos_out = eos_out;
  a.multiprocessors = multiprocessors;
  const size_t bytes = output_layer_workspace_bytes(a);
  void* workspace = bytes ? std::malloc(bytes) : nullptr;
  const cudaError_t err = output_layer_launch(a, workspace, nullptr);
  std::free(workspace);
  return static_cast<int>(err);
}
