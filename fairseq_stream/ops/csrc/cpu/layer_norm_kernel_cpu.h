// ATen's own CPU layer-norm kernel, called on caller-kept buffers (layer_norm_kernel_cpu.cpp).
#pragma once

#include <ATen/core/Tensor.h>

// The kernel at::native_layer_norm runs on this CPU: the same arithmetic, so the same bits, without
// the three tensors it allocates a call and its dispatch. Arguments: input, weight, bias (contiguous),
// rows M, width N, eps, the output (rows written from its data pointer) and nullptr, nullptr (no mean,
// no rstd). Null where this torch build does not expose it as checked (the caller then calls
// at::native_layer_norm).
using LayerNormKernelFn = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, double,
                                   at::Tensor*, at::Tensor*, at::Tensor*);
LayerNormKernelFn aten_layer_norm_kernel();
