// ATen side of the indexed attention (indexed_attention_cuda.cu holds the kernel): checks, the output, the
// launch on the current stream. ATen headers only here (torch/python.h is the slow one to compile).

#include "indexed_attention_cuda_binding.h"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "indexed_attention_cuda.h"

namespace {

using at::Tensor;

template <typename scalar_t, typename aten_t>
cudaError_t launch(const Tensor& q, const Tensor& keys, const Tensor& values, const Tensor& index, const Tensor* mask,
                   const Tensor* lengths, Tensor& out, double scale) {
  fairseq_stream::IndexedAttentionArgs<scalar_t> a{};
  a.q = reinterpret_cast<const scalar_t*>(q.data_ptr<aten_t>());
  a.q_row_stride = q.stride(0);
  a.keys = reinterpret_cast<const scalar_t*>(keys.data_ptr<aten_t>());
  a.values = reinterpret_cast<const scalar_t*>(values.data_ptr<aten_t>());
  a.index = index.data_ptr<int64_t>();
  a.mask = mask ? reinterpret_cast<const scalar_t*>(mask->data_ptr<aten_t>()) : nullptr;
  a.lengths = lengths ? lengths->data_ptr<int64_t>() : nullptr;
  a.out = reinterpret_cast<scalar_t*>(out.data_ptr<aten_t>());
  a.rows = q.size(0);
  a.heads = keys.size(1);
  a.T = keys.size(2);
  a.hd = keys.size(3);
  a.scale = scale;
  return fairseq_stream::indexed_attention_launch<scalar_t>(a, c10::cuda::getCurrentCUDAStream().stream());
}

}  // namespace

Tensor indexed_attention_cuda(const Tensor& q, const Tensor& keys, const Tensor& values, const Tensor& index,
                              const std::optional<Tensor>& mask, const std::optional<Tensor>& lengths, double scale) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 2 && q.stride(1) == 1, "indexed_attention: q must be a 2-d CUDA tensor, "
              "rows of contiguous entries; got ", q.sizes(), " on ", q.device());
  TORCH_CHECK(keys.dim() == 4 && keys.is_contiguous() && values.sizes() == keys.sizes() && values.is_contiguous() &&
                  keys.scalar_type() == q.scalar_type() && values.scalar_type() == q.scalar_type() &&
                  keys.device() == q.device() && values.device() == q.device(),
              "indexed_attention: keys and values must be contiguous (slots, heads, T, head_dim) tensors of q's dtype "
              "on its device; got ", keys.sizes(), " and ", values.sizes());
  const int64_t rows = q.size(0), slots = keys.size(0), heads = keys.size(1), T = keys.size(2), hd = keys.size(3);
  TORCH_CHECK(q.size(1) == heads * hd, "indexed_attention: q has ", q.size(1), " columns, the keys' heads * "
              "head_dim is ", heads * hd);
  TORCH_CHECK(hd <= fairseq_stream::kIndexedAttentionMaxHeadDim, "indexed_attention: head_dim ", hd, " above ",
              fairseq_stream::kIndexedAttentionMaxHeadDim);
  TORCH_CHECK(index.device() == q.device() && index.scalar_type() == at::kLong && index.dim() == 1 &&
                  index.size(0) == rows && index.is_contiguous(),
              "indexed_attention: index must be a contiguous (rows,) int64 tensor on q's device");
  Tensor mask_2d, lengths_1d;
  if (mask) {
    mask_2d = mask->reshape({slots, T});
    TORCH_CHECK(mask_2d.device() == q.device() && mask_2d.scalar_type() == q.scalar_type(),
                "indexed_attention: mask must be (slots, T) of q's dtype on its device; got ", mask->sizes());
    mask_2d = mask_2d.contiguous();
  }
  if (lengths) {
    TORCH_CHECK(lengths->device() == q.device() && lengths->scalar_type() == at::kLong && lengths->numel() == rows,
                "indexed_attention: lengths must be a (rows,) int64 tensor on q's device");
    lengths_1d = lengths->reshape({rows}).contiguous();
  }
  const c10::cuda::CUDAGuard guard(q.device());
  Tensor out = at::empty({rows, heads * hd}, q.options());
  const Tensor* m = mask ? &mask_2d : nullptr;
  const Tensor* l = lengths ? &lengths_1d : nullptr;
  cudaError_t err;
  switch (q.scalar_type()) {
    case at::kFloat:
      err = launch<float, float>(q, keys, values, index, m, l, out, scale);
      break;
    case at::kDouble:
      err = launch<double, double>(q, keys, values, index, m, l, out, scale);
      break;
    case at::kHalf:
      err = launch<__half, at::Half>(q, keys, values, index, m, l, out, scale);
      break;
    case at::kBFloat16:
      err = launch<__nv_bfloat16, at::BFloat16>(q, keys, values, index, m, l, out, scale);
      break;
    default:
      TORCH_CHECK(false, "indexed_attention: float16, bfloat16, float32 or float64, not ", q.scalar_type());
  }
  TORCH_CHECK(err == cudaSuccess, "indexed_attention (CUDA): ", cudaGetErrorString(err));
  return out;
}
