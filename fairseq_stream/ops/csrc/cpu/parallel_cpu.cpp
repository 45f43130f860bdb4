// The kernels' parallel loop; parallel_cpu.h says why it is not OpenMP.
//
// One job at a time. The caller publishes it under the mutex (a new generation, its chunk count and
// body), wakes sleeping workers, and claims chunks itself. A claim is a compare-and-swap on `ticket`,
// which packs (generation << 32 | next chunk): a worker that read an older job's generation can never
// claim a chunk of a newer one, so it never runs a body whose caller has returned. The caller waits
// only for chunks already claimed (`done` reaching the chunk count), never for a worker to wake.
//
// The pool is created on first use and never destroyed, its threads detached: nothing is joined or
// destroyed at interpreter exit (a joinable std::thread destroyed at exit calls std::terminate). A
// forked child (a DataLoader worker) starts a pool of its own: the parent's threads do not exist there.

#include "parallel_cpu.h"

#include <ATen/Parallel.h>
#include <pthread.h>
#include <sched.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#define FS_PAUSE() _mm_pause()
#else
#define FS_PAUSE() ((void)0)
#endif

namespace fs {
namespace {

using Body = std::function<void(int64_t, int64_t)>;

// Pause rounds a worker waits for the next job before it sleeps (a few microseconds): back-to-back
// calls of a step find it awake, and a core another process needs is given up soon.
constexpr int kSpinRounds = 4000;
constexpr uint64_t kChunkMask = 0xffffffffull;

struct Job {
  const Body* body = nullptr;
  int64_t begin = 0, end = 0, grain = 1, chunks = 0;
  int helpers = 0;  // workers allowed to take part (kernel_threads() - 1 when it was published)
};

struct Pool {
  std::mutex mutex;  // guards job, generation and sleepers
  std::condition_variable wake;
  std::mutex calls;  // one call at a time; a second caller runs its call alone
  Job job;
  uint32_t generation = 0;
  std::atomic<uint32_t> published{0};
  std::atomic<uint64_t> ticket{0};
  std::atomic<int64_t> done{0};
  std::exception_ptr error;  // the first exception a worker's chunk threw (under mutex)
  int sleepers = 0;
  int started = 0;  // worker threads started (only grows)
  // Counters for tests and benchmarks.
  std::atomic<int64_t> count_calls{0}, count_shared{0}, count_worker_chunks{0};
};

std::atomic<Pool*> the_pool{nullptr};
std::atomic<int> wanted_threads{0};  // 0: torch's at::get_num_threads()
thread_local bool in_chunk = false;

void start_over_in_child() { the_pool.store(new Pool); }  // the old pool's threads and locks stay behind

Pool& pool() {
  static std::once_flag once;
  std::call_once(once, [] {
    the_pool.store(new Pool);
    pthread_atfork(nullptr, nullptr, start_over_in_child);
  });
  return *the_pool.load();
}

// Claims and runs chunks of generation `gen` until none is left; returns the chunks it ran.
int64_t run_chunks(Pool& p, uint32_t gen, const Job& job) {
  int64_t ran = 0;
  for (;;) {
    uint64_t t = p.ticket.load(std::memory_order_relaxed);
    do {
      if ((t >> 32) != gen || static_cast<int64_t>(t & kChunkMask) >= job.chunks) return ran;
    } while (!p.ticket.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel));
    const int64_t first = job.begin + static_cast<int64_t>(t & kChunkMask) * job.grain;
    try {
      in_chunk = true;
      (*job.body)(first, std::min(job.end, first + job.grain));
      in_chunk = false;
    } catch (...) {
      in_chunk = false;
      std::lock_guard<std::mutex> lock(p.mutex);
      if (!p.error) p.error = std::current_exception();
    }
    ++ran;
    p.done.fetch_add(1, std::memory_order_acq_rel);
  }
}

// Waits for a generation other than `seen`: spins a little, then sleeps. Returns it with its job.
uint32_t next_job(Pool& p, uint32_t seen, Job& job) {
  for (int i = 0; i < kSpinRounds && p.published.load(std::memory_order_acquire) == seen; ++i) FS_PAUSE();
  std::unique_lock<std::mutex> lock(p.mutex);
  if (p.generation == seen) {
    ++p.sleepers;
    p.wake.wait(lock, [&] { return p.generation != seen; });
    --p.sleepers;
  }
  job = p.job;
  return p.generation;
}

void worker(Pool* p, int index) {
  uint32_t seen = 0;
  Job job;
  for (;;) {
    seen = next_job(*p, seen, job);
    if (index < job.helpers) p->count_worker_chunks.fetch_add(run_chunks(*p, seen, job), std::memory_order_relaxed);
  }
}

void start_workers(Pool& p, int count) {
  std::lock_guard<std::mutex> lock(p.mutex);
  for (; p.started < count; ++p.started) std::thread(worker, &p, p.started).detach();
}

uint32_t publish(Pool& p, const Job& job) {
  std::lock_guard<std::mutex> lock(p.mutex);
  p.job = job;
  p.error = nullptr;
  p.done.store(0, std::memory_order_relaxed);
  const uint32_t gen = ++p.generation;
  p.ticket.store(static_cast<uint64_t>(gen) << 32, std::memory_order_release);
  p.published.store(gen, std::memory_order_release);
  if (p.sleepers > 0) p.wake.notify_all();
  return gen;
}

void wait_for_claimed(Pool& p, int64_t chunks) {
  for (int i = 0; p.done.load(std::memory_order_acquire) < chunks; ++i) {
    if (i < kSpinRounds) {
      FS_PAUSE();
    } else {
      sched_yield();  // a claimed chunk runs on a thread that may need this core
    }
  }
}

}  // namespace

int kernel_threads() {
  const int wanted = wanted_threads.load(std::memory_order_relaxed);
  return std::max(1, wanted > 0 ? wanted : at::get_num_threads());
}

void set_kernel_threads(int threads) {
  TORCH_CHECK(threads >= 0, "set_kernel_threads: 0 (torch's count) or more threads, got ", threads);
  wanted_threads.store(threads, std::memory_order_relaxed);
}

int64_t grain_for(int64_t work_per_item, int64_t min_work) {
  return std::max<int64_t>(1, (min_work + std::max<int64_t>(1, work_per_item) - 1) / std::max<int64_t>(1, work_per_item));
}

void parallel_for(int64_t begin, int64_t end, int64_t grain, const Body& body) {
  if (end <= begin) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t chunks = (end - begin + grain - 1) / grain;
  const int threads = kernel_threads();
  Pool& p = pool();
  p.count_calls.fetch_add(1, std::memory_order_relaxed);
  std::unique_lock<std::mutex> one(p.calls, std::defer_lock);
  if (chunks <= 1 || threads <= 1 || in_chunk || chunks > static_cast<int64_t>(kChunkMask) || !one.try_lock()) {
    body(begin, end);
    return;
  }
  p.count_shared.fetch_add(1, std::memory_order_relaxed);
  start_workers(p, threads - 1);
  Job job;
  job.body = &body;
  job.begin = begin, job.end = end, job.grain = grain, job.chunks = chunks;
  job.helpers = threads - 1;
  const uint32_t gen = publish(p, job);
  run_chunks(p, gen, job);
  wait_for_claimed(p, chunks);
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(p.mutex);
    error = p.error;
  }
  if (error) std::rethrow_exception(error);
}

std::tuple<int64_t, int64_t, int64_t> parallel_counters() {
  Pool& p = pool();
  return std::make_tuple(p.count_calls.load(), p.count_shared.load(), p.count_worker_chunks.load());
}

std::tuple<int64_t, int64_t> parallel_sum_of_squares(int64_t n, int64_t grain) {
  // A parallel loop's own test: every item counted once, whatever the threads (exact in int64).
  TORCH_CHECK(n >= 0 && grain >= 1, "parallel_sum_of_squares: n >= 0 and grain >= 1, got ", n, " and ", grain);
  std::vector<int64_t> out(n, 0);
  parallel_for(0, n, grain, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) out[i] += i * i;
  });
  int64_t sum = 0, twice = 0;
  for (int64_t i = 0; i < n; ++i) sum += out[i], twice += out[i] != i * i;
  return std::make_tuple(sum, twice);
}

}  // namespace fs
