// Fused output layer on CUDA: log-softmax + the search's rules + top-n per row (n <= 200),
// without writing log-probabilities. fairseq_stream/ops/output_layer.py documents the op and
// holds the torch reference these kernels must equal.
//
// Plain CUDA, no ATen: output_layer_cuda_binding.cpp is the binding. Checked where it was
// written with nvcc alone (that machine's torch has no CUDA, so the extension could not be
// built or run there):
//   nvcc -std=c++17 -O3 -c output_layer_cuda.cu -gencode arch=compute_80,code=sm_80
//        -gencode arch=compute_90,code=sm_90
// and the binding with g++ -fsyntax-only against torch's headers and CUDA's include dir.
//
// Layout: a block of 256 threads works on one row, or on one of S chunks of a row when rows
// are too few to fill the GPU (S blocks per row, then a merge kernel per row).
//   A. Normalizer: each thread keeps Marian's online (max, sum) over its words (Algorithm 2),
//      merged across the block by shuffles. An ensemble needs every model's normalizer of the
//      whole row before any word's value: with S > 1 a separate stats kernel computes them.
//   B. Threshold: each thread also keeps its best key among ordinary words (the logit for one
//      model, the ensemble log-probability for several). The n-th best of the 256 per-thread
//      bests is a lower bound of the chunk's n-th best key (they are n distinct words), so
//      the filter that follows admits few words besides the answer; for n = 1 it is the
//      row's max (Algorithm 3).
//   C. Filter: words with key >= bound go to a candidate buffer in shared memory (a shared
//      counter gives slots); if the buffer fills (adversarial rows), a block-wide bitonic
//      sort keeps the best n and raises the bound. Tiles of the chunk are visited in index
//      order, so after a sort a strict test keeps the kernels' order (larger key, then lower
//      index) exact.
//   D. Final: keys become values (plus the row's add), the rule-bound columns (EOS, unk) join
//      with their own values, one bitonic sort orders them, the first n are written; rows with
//      fewer than n finite values get -inf at the lowest unused word indices.

#include "output_layer_cuda.h"

#include "accumulate.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <climits>
#include <cmath>

// A macro so that a host-side emulation of the block model can run these kernels too.
#ifndef FS_LAUNCH
#define FS_LAUNCH(kernel, grid, stream, ...) kernel<<<(grid), kThreads, 0, (stream)>>>(__VA_ARGS__)
#endif

namespace fairseq_stream {
namespace {

constexpr int kThreads = 256;  // > kOutputLayerMaxN, so per-thread bests can bound the n-th best
constexpr int kItems = 4;      // words per thread per tile
constexpr int kTile = kThreads * kItems;
constexpr int kBuffer = 2048;  // candidate slots: a tile always fits after a sort (n + kTile)
constexpr int kSpare = 4;      // slots kept for the rule-bound columns in the final sort
constexpr int kMaxSplits = 32;

static_assert(kOutputLayerMaxN + kTile + kSpare <= kBuffer, "buffer too small for a tile");
static_assert(kThreads > kOutputLayerMaxN, "per-thread bests must outnumber n");

// torch rounds the results of `logits + bias` and `logits / temperature` to the logits' type.
template <typename scalar_t>
__device__ __forceinline__ typename Acc<scalar_t>::type round_to(typename Acc<scalar_t>::type v) {
  return v;
}
template <>
__device__ __forceinline__ float round_to<__half>(float v) {
  return __half2float(__float2half_rn(v));
}
template <>
__device__ __forceinline__ float round_to<__nv_bfloat16>(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

template <typename T>
__device__ __forceinline__ T dev_inf();
template <>
__device__ __forceinline__ float dev_inf<float>() {
  return __int_as_float(0x7f800000);
}
template <>
__device__ __forceinline__ double dev_inf<double>() {
  return __longlong_as_double(0x7ff0000000000000LL);
}

__device__ __forceinline__ float acc_exp(float v) { return expf(v); }
__device__ __forceinline__ double acc_exp(double v) { return exp(v); }
__device__ __forceinline__ float acc_log(float v) { return logf(v); }
__device__ __forceinline__ double acc_log(double v) { return log(v); }

// Kernel parameters with typed pointers (the ensemble's pointers by value: at most 64).
template <typename scalar_t>
struct Params {
  using acc_t = typename Acc<scalar_t>::type;
  int models;
  int64_t rows;
  int vocab;
  int n;
  int splits;
  int chunk;  // words per split (a multiple of kTile, except the last chunk)
  const scalar_t* logits[kOutputLayerMaxModels];
  const scalar_t* bias[kOutputLayerMaxModels];
  bool has_bias;
  bool scale;
  acc_t inv_temperature;  // torch's CUDA division by a scalar multiplies by its reciprocal
  int pad, eos, unk;
  bool penalize_unk;
  acc_t unk_penalty;
  acc_t log_models;
  bool ban_all;
  const bool* ban;
  const bool* force;
  const acc_t* add;
  acc_t* values;
  int64_t* indices;
  acc_t* eos_out;
  // Workspace (splits > 1): per (row, split[, model]) partial statistics and candidates.
  acc_t* part_max;    // rows x splits x models
  acc_t* part_sum;    // rows x splits x models
  int* part_bad;      // rows x splits x models
  acc_t* cand_key;    // rows x splits x n
  int* cand_idx;      // rows x splits x n
  int* cand_count;    // rows x splits
};

// The logit of word i in model m, as the reference rounds it.
template <typename scalar_t>
__device__ __forceinline__ typename Acc<scalar_t>::type logit(const Params<scalar_t>& p, int m, int64_t row,
                                                              int i) {
  using acc_t = typename Acc<scalar_t>::type;
  acc_t x = to_acc(p.logits[m][row * p.vocab + i]);
  if (p.has_bias) x = round_to<scalar_t>(x + to_acc(p.bias[m][i]));
  if (p.scale) x = round_to<scalar_t>(x * p.inv_temperature);
  return x;
}

// Online (max, sum of exp(x - max)) with a NaN flag. -inf words add nothing (and would
// give exp(-inf - -inf) = NaN while the max is still -inf).
template <typename acc_t>
struct Online {
  acc_t max, sum;
  bool nan;
  __device__ void init() {
    max = -dev_inf<acc_t>();
    sum = 0;
    nan = false;
  }
  __device__ __forceinline__ void add(acc_t x) {
    if (x > max) {
      sum = sum * acc_exp(max - x) + acc_t(1);
      max = x;
    } else if (x > -dev_inf<acc_t>()) {
      sum += acc_exp(x - max);
    }
    nan |= (x != x);
  }
  __device__ __forceinline__ void merge(acc_t omax, acc_t osum, bool onan) {
    nan |= onan;
    const acc_t m = omax > max ? omax : max;
    if (!(m > -dev_inf<acc_t>())) return;  // both empty
    if (m == dev_inf<acc_t>()) {  // the row is spoilt anyway; keep the flag visible
      max = m;
      return;
    }
    sum = (max > -dev_inf<acc_t>() ? sum * acc_exp(max - m) : acc_t(0)) +
          (omax > -dev_inf<acc_t>() ? osum * acc_exp(omax - m) : acc_t(0));
    max = m;
  }
  // torch's log_softmax is NaN on the whole row (-inf after the rules) for a NaN or +inf
  // logit or when no logit is finite.
  __device__ bool bad() const { return nan || !(max > -dev_inf<acc_t>() && max < dev_inf<acc_t>()); }
};

template <typename acc_t>
__device__ __forceinline__ acc_t shfl_xor(acc_t v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}

// Block-wide merge of every thread's Online; the result is returned to all threads.
template <typename acc_t>
__device__ Online<acc_t> block_merge(Online<acc_t> o) {
  __shared__ acc_t s_max[kThreads / 32], s_sum[kThreads / 32];
  __shared__ int s_nan[kThreads / 32];
  for (int mask = 16; mask > 0; mask >>= 1) {
    const acc_t om = shfl_xor(o.max, mask), os = shfl_xor(o.sum, mask);
    const bool on = __shfl_xor_sync(0xffffffffu, static_cast<int>(o.nan), mask) != 0;
    o.merge(om, os, on);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // s_* may still be read by a previous call
  if (lane == 0) {
    s_max[warp] = o.max;
    s_sum[warp] = o.sum;
    s_nan[warp] = o.nan;
  }
  __syncthreads();
  Online<acc_t> r;
  r.init();
  for (int w = 0; w < kThreads / 32; ++w) r.merge(s_max[w], s_sum[w], s_nan[w] != 0);
  return r;
}

// The kernels' order: larger key first, equal keys by lower index.
template <typename acc_t>
__device__ __forceinline__ bool better(acc_t ka, int ia, acc_t kb, int ib) {
  return ka > kb || (ka == kb && ia < ib);
}

// Sorts keys/idx[0, size) best first (bitonic over the next power of two, padded with
// (-inf, INT_MAX)). All threads call it; ends with the block synchronized.
template <typename acc_t>
__device__ void block_sort(acc_t* keys, int* idx, int size) {
  int p = 1;
  while (p < size) p <<= 1;
  for (int i = size + threadIdx.x; i < p; i += kThreads) {
    keys[i] = -dev_inf<acc_t>();
    idx[i] = INT_MAX;
  }
  __syncthreads();
  for (int k = 2; k <= p; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < p; i += kThreads) {
        const int o = i ^ j;
        if (o > i) {
          const bool up = (i & k) == 0;
          const bool o_better = better(keys[o], idx[o], keys[i], idx[i]);
          if (up == o_better) {
            const acc_t tk = keys[i];
            keys[i] = keys[o];
            keys[o] = tk;
            const int ti = idx[i];
            idx[i] = idx[o];
            idx[o] = ti;
          }
        }
      }
      __syncthreads();
    }
  }
}

// The n-th largest of the threads' values (all threads get it).
template <typename acc_t>
__device__ acc_t block_nth_largest(acc_t v, int n, acc_t* scratch, int* scratch_idx) {
  __syncthreads();
  scratch[threadIdx.x] = v;
  scratch_idx[threadIdx.x] = threadIdx.x;
  block_sort(scratch, scratch_idx, kThreads);
  return scratch[n - 1];
}

template <typename scalar_t>
struct Shared {
  using acc_t = typename Acc<scalar_t>::type;
  acc_t keys[kBuffer];
  int idx[kBuffer];
  acc_t max[kOutputLayerMaxModels];
  acc_t log_sum[kOutputLayerMaxModels];
  int count;
  int bad;
  int used[kOutputLayerMaxN];
};

template <typename scalar_t>
__device__ __forceinline__ bool is_special(const Params<scalar_t>& p, int i, bool rule_eos) {
  return i == p.pad || (p.penalize_unk && i == p.unk) || (rule_eos && i == p.eos);
}

// Model m's normalizer of a whole row, merged from stats_kernel's partials in split order.
template <typename scalar_t>
__device__ __forceinline__ Online<typename Acc<scalar_t>::type> merged_partials(const Params<scalar_t>& p,
                                                                               int64_t row, int m) {
  Online<typename Acc<scalar_t>::type> o;
  o.init();
  for (int s = 0; s < p.splits; ++s) {
    const int64_t at = (row * p.splits + s) * p.models + m;
    o.merge(p.part_max[at], p.part_sum[at], p.part_bad[at] != 0);
  }
  return o;
}

// Keeps model m's row normalizer o for the row's log-probabilities; whether it spoils the row.
template <typename scalar_t>
__device__ __forceinline__ bool keep_normalizer(Shared<scalar_t>& sh, int m,
                                                const Online<typename Acc<scalar_t>::type>& o) {
  const bool bad = o.bad();
  if (threadIdx.x == 0) {
    sh.max[m] = o.max;
    sh.log_sum[m] = acc_log(o.sum);
  }
  return bad;
}

// The ensemble log-probability of word i, as torch.logsumexp(stack(lp_m), 0) - log(M).
template <typename scalar_t>
__device__ typename Acc<scalar_t>::type ensemble_lp(const Params<scalar_t>& p, const Shared<scalar_t>& sh,
                                                    int64_t row, int i) {
  using acc_t = typename Acc<scalar_t>::type;
  acc_t mx = -dev_inf<acc_t>();
  for (int m = 0; m < p.models; ++m) {
    const acc_t lp = (logit(p, m, row, i) - sh.max[m]) - sh.log_sum[m];
    mx = lp > mx ? lp : mx;
  }
  const acc_t shift = isinf(mx) ? acc_t(0) : mx;
  acc_t s = 0;
  for (int m = 0; m < p.models; ++m) s += acc_exp(((logit(p, m, row, i) - sh.max[m]) - sh.log_sum[m]) - shift);
  return (acc_log(s) + shift) - p.log_models;
}

// The word's log-probability before the rules (row normalizers in shared memory).
template <typename scalar_t>
__device__ typename Acc<scalar_t>::type word_lp(const Params<scalar_t>& p, const Shared<scalar_t>& sh, int64_t row,
                                                int i) {
  if (p.models == 1) return (logit(p, 0, row, i) - sh.max[0]) - sh.log_sum[0];
  return ensemble_lp(p, sh, row, i);
}

template <typename scalar_t>
__device__ __forceinline__ typename Acc<scalar_t>::type key_of(const Params<scalar_t>& p,
                                                               const Shared<scalar_t>& sh, int64_t row, int i) {
  return p.models == 1 ? logit(p, 0, row, i) : ensemble_lp(p, sh, row, i);
}

// Keeps the best n of the buffer's `count`, sorted; the caller reads the n-th as its new,
// strict threshold (later tiles only hold larger indices).
template <typename scalar_t>
__device__ void compact(Shared<scalar_t>& sh, int n, int count) {
  block_sort(sh.keys, sh.idx, count);
  if (threadIdx.x == 0 && count > n) sh.count = n;
  __syncthreads();
}

// Phase D: buffer keys -> values, rule-bound columns, sort, write (or the bad-row answer).
template <typename scalar_t>
__device__ void finish_row(const Params<scalar_t>& p, Shared<scalar_t>& sh, int64_t row, bool bad, bool force,
                           bool ban) {
  using acc_t = typename Acc<scalar_t>::type;
  const acc_t inf = dev_inf<acc_t>();
  acc_t* values = p.values + row * p.n;
  int64_t* indices = p.indices + row * p.n;
  if (bad) {
    for (int j = threadIdx.x; j < p.n; j += kThreads) {
      values[j] = -inf;
      indices[j] = j;
    }
    if (threadIdx.x == 0) p.eos_out[row] = -inf;
    return;
  }
  const bool has_add = p.add != nullptr;
  const acc_t add = has_add ? p.add[row] : acc_t(0);
  int count = sh.count;
  __syncthreads();  // all have read count before thread 0 appends below
  for (int j = threadIdx.x; j < count; j += kThreads) {
    acc_t v = p.models == 1 ? (sh.keys[j] - sh.max[0]) - sh.log_sum[0] : sh.keys[j];
    if (has_add) v = v + add;
    sh.keys[j] = v != v ? -inf : v;
  }
  if (threadIdx.x == 0) {
    const acc_t eos_lp = ban ? -inf : word_lp(p, sh, row, p.eos);
    p.eos_out[row] = eos_lp;
    auto put = [&](acc_t v, int i) {
      if (has_add) v = v + add;
      sh.keys[count] = v != v ? -inf : v;
      sh.idx[count] = i;
      ++count;
    };
    if (force || ban) put(eos_lp, p.eos);
    if (p.penalize_unk) put(force ? -inf : word_lp(p, sh, row, p.unk) - p.unk_penalty, p.unk);
    sh.count = count;
  }
  __syncthreads();
  count = sh.count;
  block_sort(sh.keys, sh.idx, count);
  const int take = count < p.n ? count : p.n;
  for (int j = threadIdx.x; j < take; j += kThreads) {
    values[j] = sh.keys[j];
    indices[j] = sh.idx[j];
  }
  if (take < p.n) {
    // Every other word is -inf: the rest get the lowest indices not taken (all below n).
    for (int j = threadIdx.x; j < p.n; j += kThreads) sh.used[j] = 0;
    __syncthreads();
    for (int j = threadIdx.x; j < take; j += kThreads) {
      if (sh.idx[j] < p.n) sh.used[sh.idx[j]] = 1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int out = take;
      for (int w = 0; w < p.n && out < p.n; ++w) {
        if (!sh.used[w]) {
          values[out] = -inf;
          indices[out] = w;
          ++out;
        }
      }
    }
  }
}

// Phases B and C over words [c0, c1) of `row`: fills sh.keys/idx/count with candidates
// (a superset of the chunk's best n, or exactly them after a sort).
template <typename scalar_t>
__device__ void select_chunk(const Params<scalar_t>& p, Shared<scalar_t>& sh, int64_t row, int c0, int c1,
                             bool rule_eos, typename Acc<scalar_t>::type thread_best) {
  using acc_t = typename Acc<scalar_t>::type;
  const acc_t inf = dev_inf<acc_t>();
  // Reuse the candidate buffer's tail as scratch for the per-thread bests.
  acc_t bound = block_nth_largest(thread_best, p.n, sh.keys + kBuffer - kThreads, sh.idx + kBuffer - kThreads);
  bool strict = false;
  if (threadIdx.x == 0) sh.count = 0;
  __syncthreads();
  for (int tile = c0; tile < c1; tile += kTile) {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = tile + j * kThreads + threadIdx.x;
      if (i >= c1) break;
      if (p.models > 1) {
        // The ensemble value never exceeds its best model's log-probability: skip the exps
        // for words whose bound is below the threshold (with room for rounding).
        acc_t hi = -inf;
        for (int m = 0; m < p.models; ++m) {
          const acc_t lp = (logit(p, m, row, i) - sh.max[m]) - sh.log_sum[m];
          hi = lp > hi ? lp : hi;
        }
        const acc_t slack = acc_t(64) * (sizeof(acc_t) == 4 ? acc_t(FLT_EPSILON) : acc_t(DBL_EPSILON)) *
                            (fabs(bound) > acc_t(1) ? fabs(bound) : acc_t(1));
        if (!(hi >= bound - slack)) continue;
      }
      const acc_t key = key_of(p, sh, row, i);
      const bool admit = key > -inf && (strict ? key > bound : key >= bound);
      if (admit && !is_special(p, i, rule_eos)) {
        const int slot = atomicAdd(&sh.count, 1);
        sh.keys[slot] = key;
        sh.idx[slot] = i;
      }
    }
    __syncthreads();
    const int count = sh.count;
    __syncthreads();  // everyone has read count before the next tile adds to it
    if (count > kBuffer - kSpare - kTile) {
      compact(sh, p.n, count);
      bound = sh.keys[p.n - 1];
      strict = true;
    }
  }
  __syncthreads();
}

// One block per (row, split). splits == 1: the whole row, written out. splits > 1: the chunk's
// best n keys and (one model) its partial normalizer, for merge_kernel.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) select_kernel(Params<scalar_t> p) {
  using acc_t = typename Acc<scalar_t>::type;
  __shared__ Shared<scalar_t> sh;
  const acc_t inf = dev_inf<acc_t>();
  const int64_t row = blockIdx.x;
  const int split = blockIdx.y;
  const int c0 = split * p.chunk;
  const int c1 = min(p.vocab, c0 + p.chunk);
  const bool force = p.force && p.force[row];
  const bool ban = p.ban_all || (p.ban && p.ban[row]);
  const bool rule_eos = force || ban;

  acc_t best = -inf;  // this thread's best key among ordinary words
  bool bad = false;
  if (p.models == 1) {
    Online<acc_t> o;
    o.init();
    for (int tile = c0; tile < c1; tile += kTile) {
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        const int i = tile + j * kThreads + threadIdx.x;
        if (i < c1) {
          const acc_t x = logit(p, 0, row, i);
          o.add(x);
          if (x > best && !is_special(p, i, rule_eos)) best = x;
        }
      }
    }
    o = block_merge(o);
    if (p.splits > 1) {
      if (threadIdx.x == 0) {
        const int64_t at = row * p.splits + split;
        p.part_max[at] = o.max;
        p.part_sum[at] = o.sum;
        p.part_bad[at] = o.nan || o.max == inf;
      }
    } else {
      bad = keep_normalizer(sh, 0, o);
    }
  } else {
    // Every model's normalizer of the whole row: computed here (one block per row) or
    // merged from stats_kernel's partials.
    for (int m = 0; m < p.models; ++m) {
      Online<acc_t> o;
      o.init();
      if (p.splits == 1) {
        for (int i = threadIdx.x; i < p.vocab; i += kThreads) o.add(logit(p, m, row, i));
        o = block_merge(o);
      } else {
        o = merged_partials(p, row, m);
      }
      bad |= keep_normalizer(sh, m, o);
    }
    __syncthreads();
    if (!bad && !force) {
      for (int i = c0 + threadIdx.x; i < c1; i += kThreads) {
        if (is_special(p, i, rule_eos)) continue;
        const acc_t e = ensemble_lp(p, sh, row, i);
        best = e > best ? e : best;
      }
    }
  }
  __syncthreads();

  if (bad || force) {
    if (threadIdx.x == 0) sh.count = 0;
    __syncthreads();
  } else {
    select_chunk(p, sh, row, c0, c1, rule_eos, best);
  }

  if (p.splits == 1) {
    finish_row(p, sh, row, bad, force, ban);
    return;
  }
  int count = sh.count;
  if (count > p.n) {
    compact(sh, p.n, count);
    count = p.n;
  } else {
    block_sort(sh.keys, sh.idx, count);
  }
  const int64_t at = row * p.splits + split;
  for (int j = threadIdx.x; j < count; j += kThreads) {
    p.cand_key[at * p.n + j] = sh.keys[j];
    p.cand_idx[at * p.n + j] = sh.idx[j];
  }
  if (threadIdx.x == 0) p.cand_count[at] = count;
}

// Partial normalizers of every model over one chunk (ensembles split over the vocabulary).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) stats_kernel(Params<scalar_t> p) {
  using acc_t = typename Acc<scalar_t>::type;
  const int64_t row = blockIdx.x;
  const int split = blockIdx.y, m = blockIdx.z;
  const int c0 = split * p.chunk;
  const int c1 = min(p.vocab, c0 + p.chunk);
  Online<acc_t> o;
  o.init();
  for (int i = c0 + threadIdx.x; i < c1; i += kThreads) o.add(logit(p, m, row, i));
  o = block_merge(o);
  if (threadIdx.x == 0) {
    const int64_t at = (row * p.splits + split) * p.models + m;
    p.part_max[at] = o.max;
    p.part_sum[at] = o.sum;
    p.part_bad[at] = o.nan || o.max == dev_inf<acc_t>();
  }
}

// One block per row: the splits' normalizers and candidates merged, then phase D.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) merge_kernel(Params<scalar_t> p) {
  using acc_t = typename Acc<scalar_t>::type;
  __shared__ Shared<scalar_t> sh;
  const int64_t row = blockIdx.x;
  const bool force = p.force && p.force[row];
  const bool ban = p.ban_all || (p.ban && p.ban[row]);
  bool bad = false;
  for (int m = 0; m < p.models; ++m) bad |= keep_normalizer(sh, m, merged_partials(p, row, m));
  if (threadIdx.x == 0) {
    // Splits in index order keep equal keys in index order for the final sort's tie rule.
    int count = 0;
    for (int s = 0; s < p.splits; ++s) {
      const int64_t at = row * p.splits + s;
      const int c = p.cand_count[at];
      for (int j = 0; j < c; ++j) {
        sh.keys[count + j] = p.cand_key[at * p.n + j];
        sh.idx[count + j] = p.cand_idx[at * p.n + j];
      }
      count += c;
    }
    sh.count = count;
  }
  __syncthreads();
  finish_row(p, sh, row, bad, force, ban);
}

template <typename scalar_t>
cudaError_t launch_typed(const OutputLayerArgs& a, int splits, void* workspace, cudaStream_t stream) {
  using acc_t = typename Acc<scalar_t>::type;
  Params<scalar_t> p;
  p.models = a.models;
  p.rows = a.rows;
  p.vocab = a.vocab;
  p.n = a.n;
  p.splits = splits;
  const int per = (a.vocab + splits - 1) / splits;
  p.chunk = splits == 1 ? a.vocab : ((per + kTile - 1) / kTile) * kTile;
  for (int m = 0; m < kOutputLayerMaxModels; ++m) {
    p.logits[m] = m < a.models ? static_cast<const scalar_t*>(a.logits[m]) : nullptr;
    p.bias[m] = (m < a.models && a.has_bias) ? static_cast<const scalar_t*>(a.bias[m]) : nullptr;
  }
  p.has_bias = a.has_bias;
  p.scale = a.temperature != 1.0;
  p.inv_temperature = acc_t(1) / static_cast<acc_t>(a.temperature);
  p.pad = a.pad;
  p.eos = a.eos;
  p.unk = a.unk;
  p.penalize_unk = a.unk >= 0 && a.unk_penalty != 0.0;
  p.unk_penalty = static_cast<acc_t>(a.unk_penalty);
  p.log_models = static_cast<acc_t>(std::log(static_cast<double>(a.models)));
  p.ban_all = a.ban_all;
  p.ban = a.ban;
  p.force = a.force;
  p.add = static_cast<const acc_t*>(a.add);
  p.values = static_cast<acc_t*>(a.values);
  p.indices = a.indices;
  p.eos_out = static_cast<acc_t*>(a.eos_out);
  p.part_max = p.part_sum = p.cand_key = nullptr;
  p.part_bad = p.cand_idx = p.cand_count = nullptr;
  if (splits > 1) {
    const size_t parts = static_cast<size_t>(a.rows) * splits * a.models;
    const size_t cands = static_cast<size_t>(a.rows) * splits * a.n;
    char* w = static_cast<char*>(workspace);
    p.part_max = reinterpret_cast<acc_t*>(w);
    w += parts * sizeof(acc_t);
    p.part_sum = reinterpret_cast<acc_t*>(w);
    w += parts * sizeof(acc_t);
    p.cand_key = reinterpret_cast<acc_t*>(w);
    w += cands * sizeof(acc_t);
    p.part_bad = reinterpret_cast<int*>(w);
    w += parts * sizeof(int);
    p.cand_idx = reinterpret_cast<int*>(w);
    w += cands * sizeof(int);
    p.cand_count = reinterpret_cast<int*>(w);
  }
  const unsigned rows = static_cast<unsigned>(a.rows);
  if (splits > 1 && a.models > 1) FS_LAUNCH(stats_kernel<scalar_t>, dim3(rows, splits, a.models), stream, p);
  FS_LAUNCH(select_kernel<scalar_t>, dim3(rows, splits), stream, p);
  if (splits > 1) FS_LAUNCH(merge_kernel<scalar_t>, dim3(rows), stream, p);
  return cudaGetLastError();
}

// Blocks per row: enough blocks for about two waves of the GPU when rows are few, each
// split still worth a few tiles, and the merge's candidates (splits x n) within its buffer.
int choose_splits(const OutputLayerArgs& a) {
  const int64_t target = 2 * static_cast<int64_t>(a.multiprocessors > 0 ? a.multiprocessors : 80);
  if (a.rows >= target) return 1;
  int64_t s = (target + a.rows - 1) / a.rows;
  s = s < (a.vocab + 4 * kTile - 1) / (4 * kTile) ? s : (a.vocab + 4 * kTile - 1) / (4 * kTile);
  s = s < (kBuffer - kSpare) / a.n ? s : (kBuffer - kSpare) / a.n;
  s = s < kMaxSplits ? s : kMaxSplits;
  return s < 1 ? 1 : static_cast<int>(s);
}

}  // namespace

size_t output_layer_workspace_bytes(const OutputLayerArgs& a) {
  const int splits = choose_splits(a);
  if (splits == 1) return 0;
  const size_t acc = a.type == OutputLayerType::kDouble ? sizeof(double) : sizeof(float);
  const size_t parts = static_cast<size_t>(a.rows) * splits * a.models;
  const size_t cands = static_cast<size_t>(a.rows) * splits * a.n;
  return parts * (2 * acc + sizeof(int)) + cands * (acc + sizeof(int)) + static_cast<size_t>(a.rows) * splits * sizeof(int);
}

cudaError_t output_layer_launch(const OutputLayerArgs& a, void* workspace, cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  if (a.models < 1 || a.models > kOutputLayerMaxModels || a.n < 1 || a.n > kOutputLayerMaxN || a.n > a.vocab ||
      a.rows > INT_MAX) {
    return cudaErrorInvalidValue;
  }
  const int splits = choose_splits(a);
  switch (a.type) {
    case OutputLayerType::kFloat:
      return launch_typed<float>(a, splits, workspace, stream);
    case OutputLayerType::kDouble:
      return launch_typed<double>(a, splits, workspace, stream);
    case OutputLayerType::kHalf:
      return launch_typed<__half>(a, splits, workspace, stream);
    case OutputLayerType::kBFloat16:
      return launch_typed<__nv_bfloat16>(a, splits, workspace, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace fairseq_stream
