// Fused output layer on CUDA: the plain-CUDA launcher that output_layer_cuda.cpp (the ATen
// binding) calls. Kept free of ATen/torch headers so that output_layer_cuda.cu compiles with
// nvcc alone, which is how it is checked on a machine whose torch has no CUDA.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace fairseq_stream {

constexpr int kOutputLayerMaxModels = 64;
constexpr int kOutputLayerMaxN = 200;

enum class OutputLayerType : int { kFloat = 0, kDouble = 1, kHalf = 2, kBFloat16 = 3 };

// Device pointers and options of one call. Values and eos_out are float, except for double
// logits (double); add has the values' type; ban/force are bool (one byte) per row.
struct OutputLayerArgs {
  OutputLayerType type;
  int models;
  int64_t rows;
  int vocab;
  int n;
  const void* logits[kOutputLayerMaxModels];  // (rows, vocab) each, contiguous
  const void* bias[kOutputLayerMaxModels];    // (vocab,) each, or all null
  bool has_bias;
  double temperature;
  int pad, eos, unk;  // unk < 0: none
  double unk_penalty;
  bool ban_all;
  const bool* ban;    // (rows,) or null
  const bool* force;  // (rows,) or null
  const void* add;    // (rows,) or null
  void* values;       // (rows, n)
  int64_t* indices;   // (rows, n)
  void* eos_out;      // (rows,)
  int multiprocessors;  // of the device, to size the split of rows over the vocabulary
};

// Bytes of device workspace the call needs (0 when every row fits one block).
size_t output_layer_workspace_bytes(const OutputLayerArgs& args);

// Enqueues the kernels on `stream`; workspace: output_layer_workspace_bytes(args) bytes.
cudaError_t output_layer_launch(const OutputLayerArgs& args, void* workspace, cudaStream_t stream);

}  // namespace fairseq_stream
