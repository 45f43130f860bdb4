// Host emulation of the CUDA features that ../cuda/output_layer_cuda.cu (and beam_step_cuda.cu) use, so that their
// kernels' logic (tiles, shared-memory buffer, barriers, bitonic sorts, the split/merge path)
// can be tested on a machine without a GPU (tests/test_output_layer.py compiles
// emulate_output_layer.cpp against these headers). Not a CUDA implementation: blocks run one
// at a time, and a block's 256 threads are fibers (ucontext) on one OS thread, switched at
// every __syncthreads, so each thread runs from one barrier to the next before any starts
// the next phase; __shared__ becomes a function static (one block at a time). Warp shuffles
// are emulated with two barriers, as the kernels only call them with the whole block in step.
// It checks the algorithm and the block-level synchronization, not CUDA's memory model,
// warp scheduling or the device math library.
#pragma once

#include <ucontext.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(x)

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
using cudaStream_t = void*;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }

namespace emu {
constexpr int kBlockThreads = 256;  // the kernels' kThreads
constexpr size_t kStack = 256 * 1024;
inline int current = 0;
inline dim3 block_index;
inline ucontext_t scheduler;
inline ucontext_t fibers[kBlockThreads];
inline bool finished[kBlockThreads];
inline std::vector<char> stacks;
inline std::function<void()>* body = nullptr;

inline void fiber_main() {
  (*body)();
  finished[current] = true;  // returns to uc_link: the scheduler
}

template <class F>
void launch(dim3 grid, F kernel) {
  std::function<void()> run = kernel;
  body = &run;
  if (stacks.empty()) stacks.resize(kBlockThreads * kStack);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        block_index = dim3(x, y, z);
        for (int t = 0; t < kBlockThreads; ++t) {
          getcontext(&fibers[t]);
          fibers[t].uc_stack.ss_sp = stacks.data() + t * kStack;
          fibers[t].uc_stack.ss_size = kStack;
          fibers[t].uc_link = &scheduler;
          makecontext(&fibers[t], fiber_main, 0);
          finished[t] = false;
        }
        // One round: every live thread runs to its next barrier (or its end).
        for (bool live = true; live;) {
          live = false;
          for (int t = 0; t < kBlockThreads; ++t) {
            if (finished[t]) continue;
            current = t;
            swapcontext(&scheduler, &fibers[t]);
            live = true;
          }
        }
      }
}

inline dim3 thread_index() { return dim3(current); }
}  // namespace emu

#define threadIdx (emu::thread_index())
#define blockIdx (emu::block_index)
#define FS_LAUNCH(kernel, grid, stream, ...) emu::launch((grid), [&] { kernel(__VA_ARGS__); })

inline void __syncthreads() { swapcontext(&emu::fibers[emu::current], &emu::scheduler); }

template <class T>
T __shfl_xor_sync(unsigned, T value, int lane_mask) {
  static T lanes[emu::kBlockThreads];
  lanes[threadIdx.x] = value;
  __syncthreads();
  const T other = lanes[threadIdx.x ^ lane_mask];
  __syncthreads();
  return other;
}

inline int atomicAdd(int* address, int value) {
  const int old = *address;  // one OS thread: no other thread runs in between
  *address = value + old;
  return old;
}
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  const unsigned long long old = *address;
  *address = value + old;
  return old;
}
// memcpy, not std::bit_cast: C++17, as torch < 2.13 builds extensions.
inline float __int_as_float(int bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline double __longlong_as_double(long long bits) {
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}
using std::fabs;
using std::isinf;
using std::min;
