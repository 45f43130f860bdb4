// The fused output layer on the CPU (output_layer_cpu.cpp): per row, log-softmax of the models' logits,
// the search's rules and the top n, in one pass. fairseq_stream/ops/output_layer.py documents it.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

// [values (rows, n), indices (rows, n), eos (rows,)]; unk -1: none; ban_all bans EOS in every row.
std::vector<at::Tensor> topk_log_softmax(const std::vector<at::Tensor>& logits, const std::vector<at::Tensor>& bias,
                                         int64_t n, int64_t pad, int64_t eos, int64_t unk, double unk_penalty,
                                         double temperature, bool ban_all, const std::optional<at::Tensor>& ban_eos,
                                         const std::optional<at::Tensor>& force_eos,
                                         const std::optional<at::Tensor>& add);
