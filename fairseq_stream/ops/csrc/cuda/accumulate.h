// The kernels' arithmetic types: each storage type's accumulator (float for half, bfloat16 and float; double for
// double), the conversions into it and the stores back, rounded to nearest. Shared by output_layer_cuda.cu and
// indexed_attention_cuda.cu; plain CUDA, so that it also compiles against the host emulation of ../cuda_emu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace fairseq_stream {

template <typename scalar_t>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ void store_acc(float* to, float v) { *to = v; }
__device__ __forceinline__ void store_acc(double* to, double v) { *to = v; }
__device__ __forceinline__ void store_acc(__half* to, float v) { *to = __float2half_rn(v); }
__device__ __forceinline__ void store_acc(__nv_bfloat16* to, float v) { *to = __float2bfloat16_rn(v); }

}  // namespace fairseq_stream
