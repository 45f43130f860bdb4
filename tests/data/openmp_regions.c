// Counts GNU OpenMP parallel regions of more than one thread (tests/test_threads.py): preloaded into a
// decoding process, it sits in front of libgomp's GOMP_parallel, which every region of torch, MKL and
// an OpenMP kernel enters. openmp_regions() reads the count, openmp_regions_reset() zeroes it.
#define _GNU_SOURCE
#include <dlfcn.h>

typedef void (*parallel_fn)(void (*)(void*), void*, unsigned, unsigned);
typedef int (*max_threads_fn)(void);

static long regions = 0;

long openmp_regions(void) { return regions; }
void openmp_regions_reset(void) { regions = 0; }

void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags) {
  static parallel_fn real = 0;
  static max_threads_fn max_threads = 0;
  if (!real) real = (parallel_fn)dlsym(RTLD_NEXT, "GOMP_parallel");
  if (!max_threads) max_threads = (max_threads_fn)dlsym(RTLD_DEFAULT, "omp_get_max_threads");
  // num_threads 0: the team the calling thread's ICV gives.
  if (num_threads > 1 || (num_threads == 0 && max_threads() > 1)) __atomic_add_fetch(&regions, 1, __ATOMIC_RELAXED);
  real(fn, data, num_threads, flags);
}
