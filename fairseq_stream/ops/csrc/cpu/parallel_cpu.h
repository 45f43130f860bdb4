// The kernels' own parallel loop (parallel_cpu.cpp): the calling thread takes chunks too, and never
// waits for a thread that has not started one. fairseq_stream/threads.py documents the layout.
//
// Why not at::parallel_for (OpenMP): an OpenMP region ends in a barrier that waits for every thread
// of the team, and GNU OpenMP's waiting threads spin. Where another process holds a core, one of the
// team's threads is descheduled, the region waits a scheduler time slice for it, and the spinning
// waiter keeps it from the core: int8 decoding on two threads of two cores with one taken ran 20x
// slower than on one thread (issue 50), over ~2,900 regions a run of the toy. Here the caller claims
// chunks from a shared counter with the workers: a worker still asleep when the chunks run out is
// simply not waited for, so a call is never slower than the caller alone running it, plus a few
// atomic operations. Workers wait a few microseconds, then sleep on a condition variable.
#pragma once

#include <cstdint>
#include <functional>
#include <tuple>

namespace fs {

// (kernel calls, calls shared with worker threads, chunks the workers ran) since the process started.
std::tuple<int64_t, int64_t, int64_t> parallel_counters();

// The parallel loop's own test: (sum of i * i over [0, n), items not counted exactly once).
std::tuple<int64_t, int64_t> parallel_sum_of_squares(int64_t n, int64_t grain);

// Threads a kernel call may use, the caller included (at least 1).
int kernel_threads();
void set_kernel_threads(int threads);

// body(first, last) over [begin, end) in chunks of at most `grain` items, on up to kernel_threads()
// threads. One chunk, one thread, a call from inside a chunk, or a call while another thread's call
// runs: the caller runs it all alone. Chunks are independent: threads change nothing but speed.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& body);

// Multiply-adds a quantized product's chunk holds at the least: about 10 us of one core's work, several
// times what waking a sleeping thread costs.
constexpr int64_t kMinChunkWork = int64_t(1) << 20;

// Items per chunk so that a chunk holds at least `min_work` units where each item holds `work_per_item`.
int64_t grain_for(int64_t work_per_item, int64_t min_work);

}  // namespace fs
