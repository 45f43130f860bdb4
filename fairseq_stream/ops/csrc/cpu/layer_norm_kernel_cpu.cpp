// ATen's CPU layer-norm kernel without at::native_layer_norm around it.
//
// Why: a decoder step of one sentence makes 7 to 9 layer norms of one row of 256 to 1,024 floats. The
// kernel takes well under a microsecond there; at::native_layer_norm around it takes about 3 us (the
// dispatcher, and the output, mean and rstd tensors it allocates and frees), about 0.13 s of the 3.3 s
// Multi30k float32 greedy decoding takes one sentence at a time (perf, docs/quantize.md). A copy of the
// kernel would have to match, bit for bit, whichever of torch's AVX2 and AVX-512 builds of its Welford
// moments the dispatcher picks; the kernel itself gives those bits by construction.
//
// How: the kernel's dispatch stub (at::native::LayerNormKernel) exports the kernel it holds for each
// CPU capability (DEFAULT, AVX2, AVX512; AVX512 is null where torch registers no AVX-512 build of it), and
// picks among them by at::get_cpu_capability() as DispatchStubImpl::choose_cpu_impl does. Its entry
// points' signatures depend on macros of torch's own build, so they cannot be linked from an extension;
// the pointers are looked up by name in the library that holds the dispatcher's layer norm. The kernel
// is taken only if it gives native_layer_norm's bits on rows of several widths; otherwise (names not
// found, another choice rule) callers keep calling at::native_layer_norm.

#include "layer_norm_kernel_cpu.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/full.h>
#include <ATen/ops/native_layer_norm.h>
#include <dlfcn.h>

#include <ATen/Version.h>
#include <ATen/TensorOperators.h>

#include <cstring>
#include <string>

namespace {

// The stub's static members DispatchStub<forward_fn, LayerNormKernel_DECLARE_DISPATCH_type>::{DEFAULT,
// AVX2,AVX512} (torch 2.13's names, `nm -D libtorch_cpu.so`).
#define FS_LAYER_NORM_STUB "_ZN2at6native12DispatchStubIPFvRKNS_6TensorES4_S4_lldPS2_S5_S5_ENS0_37LayerNormKernel_DECLARE_DISPATCH_typeEE"
constexpr const char* kDefault = FS_LAYER_NORM_STUB "7DEFAULTE";
constexpr const char* kAvx2 = FS_LAYER_NORM_STUB "4AVX2E";
constexpr const char* kAvx512 = FS_LAYER_NORM_STUB "6AVX512E";
#undef FS_LAYER_NORM_STUB

LayerNormKernelFn stub_member(void* library, const char* name) {
  const auto* member = static_cast<const LayerNormKernelFn*>(dlsym(library, name));
  return member ? *member : nullptr;
}

// The kernel the dispatcher runs on this CPU, as choose_cpu_impl picks it: AVX512 where the CPU has it
// and the kernel exists, else AVX2 where the CPU has it, else DEFAULT.
LayerNormKernelFn dispatched_kernel() {
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&at::_ops::native_layer_norm::call), &info) || !info.dli_fname) return nullptr;
  void* library = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (!library) return nullptr;
  const std::string capability = at::get_cpu_capability();
  LayerNormKernelFn fn = nullptr;
  if (capability == "AVX512") fn = stub_member(library, kAvx512);
  if (!fn && (capability == "AVX512" || capability == "AVX2")) fn = stub_member(library, kAvx2);
  if (!fn && capability == "DEFAULT") fn = stub_member(library, kDefault);
  dlclose(library);
  return fn;
}

// Rows of several widths: a wave, a constant row (variance 0), a wave far from 0; weights and biases
// other than 1 and 0.
bool gives_native_bits(LayerNormKernelFn fn) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  for (const int64_t N : {1, 7, 8, 16, 33, 256, 1000, 1024}) {
    for (const int64_t M : {1, 3}) {
      at::Tensor x = ((at::arange(M * N, options) * 0.37).sin() * 3.0 + 0.5).view({M, N});
      if (M > 1) x[1].fill_(1.25), x[2].add_(1000.0);
      const at::Tensor w = at::arange(N, options).cos() + 1.0, b = at::arange(N, options) * 0.01 - 0.3;
      const at::Tensor want = std::get<0>(at::native_layer_norm(x, {N}, w, b, 1e-5));
      at::Tensor got = at::full({M, N}, 7.0, options);
      fn(x, w, b, M, N, 1e-5, &got, nullptr, nullptr);
      if (std::memcmp(got.data_ptr<float>(), want.data_ptr<float>(), sizeof(float) * M * N) != 0) return false;
    }
  }
  return true;
}

LayerNormKernelFn find_kernel() {
  const LayerNormKernelFn fn = dispatched_kernel();
  return fn && gives_native_bits(fn) ? fn : nullptr;
}

}  // namespace

LayerNormKernelFn aten_layer_norm_kernel() {
  static const LayerNormKernelFn kernel = find_kernel();
  return kernel;
}
