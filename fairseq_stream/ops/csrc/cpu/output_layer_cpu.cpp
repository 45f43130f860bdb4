// Fused output layer on the CPU: log-softmax + the search's rules + top-n per row, without
// writing log-probabilities (fairseq_stream/ops/output_layer.py documents the op and holds the
// torch reference this must equal).
//
// Per row and model, one pass in blocks of kBlock logits (in L1) keeps Marian's online max/sum
// (Algorithm 2): the block's max first, one rescale of the running sum when it rises, then the
// block's exp-sum against the running max; so there is one exp per logit, not two. For one
// model the same pass offers each logit above the current threshold to the top-n buffer (the
// top n by logit are the top n by log-probability), so a row is read once; for n = 1 the buffer
// is a running argmax (Algorithm 3). For an ensemble the normalizers must be known first: a
// second pass bounds each word's ensemble log-probability by its best model's and computes the
// exact value (as torch.logsumexp) only for the few words whose bound beats the threshold.
//
// Float rows use AVX2 + FMA where the compiler targets it (setup.py builds with -march=native);
// other types and targets use the portable loops. AVX-512 is left out on purpose: the AVX2 path
// runs on every AVX-512 machine, and the build machine here has no AVX-512 to test a second path.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include "parallel_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <vector>

#include "output_layer_cpu.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FS_AVX2 1
#else
#define FS_AVX2 0
#endif

namespace {

// Small enough that a block stays in L1 between its max sweep and its exp-sum sweep.
constexpr int64_t kBlock = 1024;

template <typename T>
constexpr T kInf = std::numeric_limits<T>::infinity();

template <typename T>
struct Cand {
  T key;
  int32_t idx;
};

// The kernels' one order: larger key first, equal keys by lower word index.
template <typename T>
inline bool better(const Cand<T>& a, const Cand<T>& b) {
  return a.key > b.key || (a.key == b.key && a.idx < b.idx);
}

// The n best (key, word) offered so far. Words must be offered in increasing index order
// and only when key > thr(): a later word whose key equals the threshold ranks below the
// kept one (larger index), so the strict test keeps exactly the first n of `better`.
// Candidates go into a buffer of 3n (at least n + 32); when it is full, nth_element keeps the
// best n and raises the threshold, so the cost per offered word stays O(1) amortized at
// n = 200 (a heap would pay log n per word).
template <typename T>
class TopN {
 public:
  void reset(int n) {
    n_ = n;
    cap_ = std::max(kSpare * n, n + 32);
    if (static_cast<int>(buf_.size()) < cap_) buf_.resize(cap_);
    size_ = 0;
    thr_ = -kInf<T>;
  }
  T thr() const { return thr_; }
  void push(T key, int32_t idx) {
    if (n_ == 1) {  // Algorithm 3: a running argmax
      buf_[0] = {key, idx};
      size_ = 1;
      thr_ = key;
      return;
    }
    buf_[size_++] = {key, idx};
    if (size_ == cap_) compact();
  }
  // Sorts the kept candidates, best first; returns how many (<= n).
  int finish() {
    if (size_ > n_) compact();
    std::sort(buf_.begin(), buf_.begin() + size_, better<T>);
    return size_;
  }
  T key(int i) const { return buf_[i].key; }
  int32_t idx(int i) const { return buf_[i].idx; }

 private:
  void compact() {
    std::nth_element(buf_.begin(), buf_.begin() + (n_ - 1), buf_.begin() + size_, better<T>);
    size_ = n_;
    thr_ = buf_[n_ - 1].key;
  }
  static constexpr int kSpare = 3;
  std::vector<Cand<T>> buf_;
  int n_ = 1, cap_ = 0, size_ = 0;
  T thr_ = -kInf<T>;
};

// float keys: (key, word) packed into one integer whose order is `better`'s (key bits made
// monotone, then the complemented index), so that nth_element and sort compare integers:
// about twice as fast as comparing pairs, and the buffer's compactions are the main cost of
// a large n.
template <>
class TopN<float> {
 public:
  void reset(int n) {
    n_ = n;
    cap_ = std::max(kSpare * n, n + 32);
    if (static_cast<int>(buf_.size()) < cap_) buf_.resize(cap_);
    size_ = 0;
    thr_ = -kInf<float>;
  }
  float thr() const { return thr_; }
  void push(float key, int32_t idx) {
    const uint64_t p = pack(key, idx);
    if (n_ == 1) {
      buf_[0] = p;
      size_ = 1;
      thr_ = key;
      return;
    }
    buf_[size_++] = p;
    if (size_ == cap_) compact();
  }
  int finish() {
    if (size_ > n_) compact();
    std::sort(buf_.begin(), buf_.begin() + size_, std::greater<uint64_t>());
    return size_;
  }
  float key(int i) const {
    uint32_t u = static_cast<uint32_t>(buf_[i] >> 32);
    u = (u & 0x80000000u) ? (u & 0x7fffffffu) : ~u;
    float k;
    std::memcpy(&k, &u, sizeof k);
    return k;
  }
  int32_t idx(int i) const { return static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(buf_[i])); }

 private:
  static uint64_t pack(float key, int32_t idx) {
    key += 0.0f;  // -0.0 -> +0.0: equal keys must pack equal
    uint32_t u;
    std::memcpy(&u, &key, sizeof u);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return (static_cast<uint64_t>(u) << 32) | (0xffffffffu - static_cast<uint32_t>(idx));
  }
  void compact() {
    std::nth_element(buf_.begin(), buf_.begin() + (n_ - 1), buf_.begin() + size_, std::greater<uint64_t>());
    size_ = n_;
    thr_ = key(n_ - 1);
  }
  static constexpr int kSpare = 3;
  std::vector<uint64_t> buf_;
  int n_ = 1, cap_ = 0, size_ = 0;
  float thr_ = -kInf<float>;
};

// Columns that the rules give their own value: never offered to the top-n buffer.
struct Specials {
  int64_t a = -1, b = -1, c = -1;
  bool has(int64_t i) const { return i == a || i == b || i == c; }
};

// A model's normalizer for one row: log_softmax(x)[i] = (x[i] - max) - log(sum).
template <typename T>
struct Stats {
  T max;
  T sum;
  bool nan;
  // torch gives NaN everywhere (then -inf after the rules) for a row with a NaN or +inf
  // logit or with no finite one.
  bool bad() const { return nan || !(max > -kInf<T> && max < kInf<T>); }
};

// Portable pass (any type, any target). FILTER: also offer x[i] > thr to `top`.
template <typename T, bool FILTER>
Stats<T> scan_generic(const T* x, int64_t V, TopN<T>* top, const Specials& sp) {
  T m = -kInf<T>, s = 0;
  bool nan = false;
  for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
    const int64_t b1 = std::min(V, b0 + kBlock);
    T bm = -kInf<T>;
    for (int64_t i = b0; i < b1; ++i) {
      const T v = x[i];
      nan |= (v != v);
      bm = v > bm ? v : bm;
      if (FILTER && v > top->thr() && !sp.has(i)) top->push(v, static_cast<int32_t>(i));
    }
    if (bm > m) {
      s = m > -kInf<T> ? s * std::exp(m - bm) : T(0);
      m = bm;
    }
    // Nothing to add while every logit so far is -inf (exp(-inf - -inf) would be NaN);
    // a +inf max spoils the row anyway.
    if (!(m > -kInf<T>) || m == kInf<T>) continue;
    T bs = 0;
    for (int64_t i = b0; i < b1; ++i) bs += std::exp(x[i] - m);
    s += bs;
  }
  return {m, s, nan};
}

#if FS_AVX2

// exp for x <= 0 (Cephes' expf: Cody-Waite reduction, degree-5 polynomial, about 1 ulp);
// 0 below -87.3 (where the result would be subnormal) and for NaN, which the callers
// detect separately.
inline __m256 exp_avx2(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 keep = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  // (p r^2 + r) + 1: the small terms first, one rounding against 1.
  __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_and_ps(y, keep);
}

// log for positive normal x (Cephes' logf: mantissa in [sqrt(1/2), sqrt(2)), degree-8
// polynomial, about 1 ulp). The ensemble path takes it of sums in [1, M].
inline __m256 log_avx2(__m256 x) {
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256i bits = _mm256_castps_si256(x);
  __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(126)));
  // The mantissa as a float in [0.5, 1).
  x = _mm256_or_ps(_mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x007fffff))), _mm256_set1_ps(0.5f));
  const __m256 small = _mm256_cmp_ps(x, _mm256_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm256_sub_ps(e, _mm256_and_ps(one, small));
  x = _mm256_add_ps(_mm256_sub_ps(x, one), _mm256_and_ps(x, small));
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(7.0376836292e-2f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(-1.1514610310e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.1676998740e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(-1.2420140846e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.4249322787e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(-1.6668057665e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(2.0000714765e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(-2.4999993993e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(3.3333331174e-1f));
  y = _mm256_mul_ps(_mm256_mul_ps(y, x), z);
  y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
  y = _mm256_fnmadd_ps(z, _mm256_set1_ps(0.5f), y);
  x = _mm256_add_ps(x, y);
  return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), x);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The last, partial vector of a row: missing lanes read as -inf, which no test passes and
// whose exp is 0.
inline __m256 load_tail(const float* p, int64_t left) {
  alignas(32) static const int32_t ramp[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  const __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(left)),
                                        _mm256_load_si256(reinterpret_cast<const __m256i*>(ramp)));
  const __m256 v = _mm256_maskload_ps(p, in);
  return _mm256_blendv_ps(_mm256_set1_ps(-kInf<float>), v, _mm256_castsi256_ps(in));
}

inline void offer_lanes(const float* x, int64_t i, int mask, TopN<float>* top, const Specials& sp) {
  do {
    const int64_t j = i + __builtin_ctz(mask);
    mask &= mask - 1;
    // The threshold may have risen since the vector compare.
    if (x[j] > top->thr() && !sp.has(j)) top->push(x[j], static_cast<int32_t>(j));
  } while (mask);
}

template <bool FILTER>
Stats<float> scan_avx2(const float* x, int64_t V, TopN<float>* top, const Specials& sp) {
  float m = -kInf<float>;
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  __m256 nans = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < V; b0 += kBlock) {
    const int64_t b1 = std::min(V, b0 + kBlock);
    const int64_t full = b0 + ((b1 - b0) & ~int64_t(7));
    __m256 vmax = _mm256_set1_ps(-kInf<float>);
    __m256 thr = _mm256_set1_ps(FILTER ? top->thr() : kInf<float>);
    for (int64_t i = b0; i <= b1 - 8; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      vmax = _mm256_max_ps(v, vmax);  // operand order: a NaN in v leaves vmax as it was
      nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      if (FILTER) {
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(v, thr, _CMP_GT_OQ));
        if (mask) {
          offer_lanes(x, i, mask, top, sp);
          thr = _mm256_set1_ps(top->thr());
        }
      }
    }
    if (full < b1) {
      const __m256 v = load_tail(x + full, b1 - full);
      vmax = _mm256_max_ps(v, vmax);
      nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      if (FILTER) {
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(v, thr, _CMP_GT_OQ));
        if (mask) offer_lanes(x, full, mask, top, sp);
      }
    }
    const float bm = hmax(vmax);
    if (bm > m) {
      if (m > -kInf<float>) {
        const __m256 scale = _mm256_set1_ps(std::exp(m - bm));
        acc0 = _mm256_mul_ps(acc0, scale);
        acc1 = _mm256_mul_ps(acc1, scale);
      }
      m = bm;
    }
    if (!(m > -kInf<float>) || m == kInf<float>) continue;
    const __m256 mv = _mm256_set1_ps(m);
    int64_t i = b0;
    for (; i <= b1 - 16; i += 16) {  // two accumulators: the adds do not wait on each other
      acc0 = _mm256_add_ps(acc0, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
      acc1 = _mm256_add_ps(acc1, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), mv)));
    }
    for (; i <= b1 - 8; i += 8) acc0 = _mm256_add_ps(acc0, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
    if (i < b1) acc1 = _mm256_add_ps(acc1, exp_avx2(_mm256_sub_ps(load_tail(x + i, b1 - i), mv)));
  }
  return {m, hsum(_mm256_add_ps(acc0, acc1)), _mm256_movemask_ps(nans) != 0};
}

#endif  // FS_AVX2

template <typename T, bool FILTER>
Stats<T> scan(const T* x, int64_t V, TopN<T>* top, const Specials& sp) {
#if FS_AVX2
  if constexpr (std::is_same_v<T, float>) return scan_avx2<FILTER>(x, V, top, sp);
#endif
  return scan_generic<T, FILTER>(x, V, top, sp);
}

template <typename T>
struct Problem {
  int M;
  int64_t rows, V;
  int n;
  std::vector<const T*> x, bias;  // per model; bias empty when none
  T temperature;
  bool scale;  // bias or temperature != 1
  int64_t pad, eos, unk;
  T unk_penalty;
  bool penalize_unk;
  bool ban_all;
  const bool* ban;
  const bool* force;
  const T* add;
  T* values;
  int64_t* indices;
  T* eos_out;
};

// An ensemble's normalized rows: lp_m(i) = (x_m[i] - max_m) - ls_m.
template <typename T>
struct Ensemble {
  int M;
  const T* const* x;
  const T* max;
  const T* ls;
  T log_m;
};

// A tighter bound than the best model's log-probability a, for words whose second best model b is
// well behind: logsumexp_m(lp_m) - log M <= a - log M + log(1 + (M - 1) exp(-(a - b))). A word with
// a - b >= kGaps[t] lies at least lift[t] below a. Why: with members that disagree, a third of the
// vectors passed the bound a alone and paid M exps and a log each (more than the M normalizers'
// pass); these tiers leave about one in twenty (4 random Multi30k-sized members). Each lift is
// rounded down by kSlack, well above the rounding of a - b and of a - lift: a word it skips has an
// exact value below the threshold, so the kept words and their values are those of the plain bound.
constexpr int kTiers = 7;
constexpr double kGaps[kTiers] = {0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
constexpr double kSlack = 1e-4;

struct GapTiers {
  float gap[kTiers];
  float lift[kTiers];

  explicit GapTiers(int M) {
    for (int t = 0; t < kTiers; ++t) {
      gap[t] = static_cast<float>(kGaps[t]);
      const double lift_exact = std::log(double(M)) - std::log1p((M - 1) * std::exp(-kGaps[t])) - kSlack;
      lift[t] = static_cast<float>(std::max(0.0, lift_exact));
    }
  }
};

// The ensemble log-probability of word i, as torch.logsumexp(stack(lp_m), 0) - log(M): the
// max (0 if infinite), the sum of exps in model order, log, add the max back.
template <typename T>
T ensemble_word(const Ensemble<T>& en, int64_t i) {
  T lp[64];
  T mx = -kInf<T>;
  for (int k = 0; k < en.M; ++k) {
    lp[k] = (en.x[k][i] - en.max[k]) - en.ls[k];
    mx = std::max(mx, lp[k]);
  }
  const T shift = std::isinf(mx) ? T(0) : mx;
  T s = 0;
  for (int k = 0; k < en.M; ++k) s += std::exp(lp[k] - shift);
  return (std::log(s) + shift) - en.log_m;
}

#if FS_AVX2
// Eight words at once, from their models' log-probabilities lp[k] and their max: the same
// steps in the vector exp/log, so that a word's value does not depend on how it was reached.
inline __m256 ensemble_words_avx2(const Ensemble<float>& en, const __m256* lp, __m256 mx) {
  const __m256 inf = _mm256_set1_ps(kInf<float>);
  const __m256 infinite = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), mx), inf, _CMP_EQ_OQ);
  const __m256 shift = _mm256_andnot_ps(infinite, mx);
  __m256 s = _mm256_setzero_ps();
  for (int k = 0; k < en.M; ++k) s = _mm256_add_ps(s, exp_avx2(_mm256_sub_ps(lp[k], shift)));
  const __m256 e = _mm256_sub_ps(_mm256_add_ps(log_avx2(s), shift), _mm256_set1_ps(en.log_m));
  // Every model -inf: the sum is 0 and the value -inf (log_avx2 needs a positive sum).
  return _mm256_blendv_ps(e, _mm256_sub_ps(_mm256_setzero_ps(), inf),
                          _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_EQ_OQ));
}

template <>
float ensemble_word<float>(const Ensemble<float>& en, int64_t i) {
  __m256 lp[64];
  __m256 mx = _mm256_set1_ps(-kInf<float>);
  for (int k = 0; k < en.M; ++k) {
    lp[k] = _mm256_set1_ps((en.x[k][i] - en.max[k]) - en.ls[k]);
    mx = _mm256_max_ps(lp[k], mx);
  }
  return _mm256_cvtss_f32(ensemble_words_avx2(en, lp, mx));
}
#endif

// A key may beat the threshold only if its bound is within rounding of it: the ensemble
// log-probability never exceeds its best model's log-probability in exact arithmetic.
template <typename T>
inline T bound_threshold(T thr) {
  if (!(thr > -kInf<T>)) return thr;
  return thr - T(64) * std::numeric_limits<T>::epsilon() * std::max(T(1), std::abs(thr));
}

template <typename T>
void select_ensemble_generic(const Ensemble<T>& en, int64_t V, TopN<T>& top, const Specials& sp) {
  T thr = bound_threshold(top.thr());
  for (int64_t i = 0; i < V; ++i) {
    T bound = -kInf<T>;
    for (int k = 0; k < en.M; ++k) bound = std::max(bound, (en.x[k][i] - en.max[k]) - en.ls[k]);
    if (!(bound > thr) || sp.has(i)) continue;
    const T e = ensemble_word(en, i);
    if (e > top.thr()) {
      top.push(e, static_cast<int32_t>(i));
      thr = bound_threshold(top.thr());
    }
  }
}

#if FS_AVX2
// Each lane's lift (GapTiers) from its best and second best model: the largest tier its gap reaches.
inline __m256 gap_lift(const GapTiers& tiers, __m256 bound, __m256 second) {
  const __m256 gap = _mm256_sub_ps(bound, second);
  __m256 lift = _mm256_setzero_ps();
  for (int t = 0; t < kTiers; ++t) {
    const __m256 reached = _mm256_cmp_ps(gap, _mm256_set1_ps(tiers.gap[t]), _CMP_GE_OQ);
    lift = _mm256_blendv_ps(lift, _mm256_set1_ps(tiers.lift[t]), reached);
  }
  return lift;
}

void select_ensemble_avx2(const Ensemble<float>& en, int64_t V, TopN<float>& top, const Specials& sp) {
  __m256 thr = _mm256_set1_ps(bound_threshold(top.thr()));
  __m256 lp[64];
  const GapTiers tiers(en.M);
  auto visit = [&](int64_t i, bool tail) {
    __m256 bound = _mm256_set1_ps(-kInf<float>), second = bound;
    for (int k = 0; k < en.M; ++k) {
      const __m256 x = tail ? load_tail(en.x[k] + i, V - i) : _mm256_loadu_ps(en.x[k] + i);
      lp[k] = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_set1_ps(en.max[k])), _mm256_set1_ps(en.ls[k]));
      second = _mm256_max_ps(_mm256_min_ps(lp[k], bound), second);
      bound = _mm256_max_ps(lp[k], bound);
    }
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(bound, thr, _CMP_GT_OQ));
    if (!mask) return;
    mask &= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_sub_ps(bound, gap_lift(tiers, bound, second)), thr, _CMP_GT_OQ));
    if (!mask) return;
    // Whole vectors pass early in a row (the threshold still low): value all eight at once.
    alignas(32) float e[8];
    _mm256_store_ps(e, ensemble_words_avx2(en, lp, bound));
    do {
      const int lane = __builtin_ctz(mask);
      mask &= mask - 1;
      const int64_t j = i + lane;
      if (e[lane] > top.thr() && !sp.has(j)) top.push(e[lane], static_cast<int32_t>(j));
    } while (mask);
    thr = _mm256_set1_ps(bound_threshold(top.thr()));
  };
  int64_t i = 0;
  for (; i <= V - 8; i += 8) visit(i, false);
  if (i < V) visit(i, true);
}
#endif

template <typename T>
void select_ensemble(const Ensemble<T>& en, int64_t V, TopN<T>& top, const Specials& sp) {
#if FS_AVX2
  if constexpr (std::is_same_v<T, float>) return select_ensemble_avx2(en, V, top, sp);
#endif
  select_ensemble_generic(en, V, top, sp);
}

// Per-thread buffers, reused across the rows of a parallel_for chunk.
template <typename T>
struct Scratch {
  TopN<T> top;
  std::vector<Cand<T>> out;
  std::vector<T> scaled;  // M x V, when the logits need a bias or a temperature first
  std::vector<const T*> x;
  std::vector<T> max, ls;
  std::vector<int32_t> used;
};

template <typename T>
void run_row(const Problem<T>& P, int64_t r, Scratch<T>& S) {
  const int64_t V = P.V;
  const int n = P.n;
  T* values = P.values + r * n;
  int64_t* indices = P.indices + r * n;

  for (int k = 0; k < P.M; ++k) {
    const T* row = P.x[k] + r * V;
    if (P.scale) {
      // The reference rounds (logits + bias) and then / temperature, each in the logits' type.
      T* dst = S.scaled.data() + k * V;
      const T* b = P.bias.empty() ? nullptr : P.bias[k];
      for (int64_t i = 0; i < V; ++i) dst[i] = ((b ? row[i] + b[i] : row[i])) / P.temperature;
      row = dst;
    }
    S.x[k] = row;
  }

  const bool force = P.force && P.force[r];
  const bool ban = P.ban_all || (P.ban && P.ban[r]);
  Specials sp;
  sp.a = P.pad;
  sp.b = P.penalize_unk ? P.unk : -1;
  sp.c = (force || ban) ? P.eos : -1;
  S.top.reset(n);

  // Rows whose every word but EOS is -inf need no selection, only the normalizer.
  bool bad = false;
  T single_max = 0, single_ls = 0;
  Ensemble<T> en{P.M, S.x.data(), S.max.data(), S.ls.data(), static_cast<T>(std::log(static_cast<double>(P.M)))};
  if (P.M == 1) {
    const Stats<T> st = force ? scan<T, false>(S.x[0], V, nullptr, sp) : scan<T, true>(S.x[0], V, &S.top, sp);
    bad = st.bad();
    single_max = st.max;
    single_ls = std::log(st.sum);
  } else {
    for (int k = 0; k < P.M && !bad; ++k) {
      const Stats<T> st = scan<T, false>(S.x[k], V, nullptr, sp);
      bad = st.bad();
      S.max[k] = st.max;
      S.ls[k] = std::log(st.sum);
    }
    if (!bad && !force) select_ensemble(en, V, S.top, sp);
  }

  if (bad) {
    for (int j = 0; j < n; ++j) {
      values[j] = -kInf<T>;
      indices[j] = j;
    }
    P.eos_out[r] = -kInf<T>;
    return;
  }

  auto word_lp = [&](int64_t i) -> T {
    return P.M == 1 ? (S.x[0][i] - single_max) - single_ls : ensemble_word(en, i);
  };
  const bool has_add = P.add != nullptr;
  const T add = has_add ? P.add[r] : T(0);
  // The reference adds the row's score and then turns NaN into -inf.
  auto final_value = [&](T lp) -> T {
    const T v = has_add ? lp + add : lp;
    return v != v ? -kInf<T> : v;
  };

  auto& out = S.out;
  out.clear();
  if (!force) {
    const int kept = S.top.finish();
    for (int j = 0; j < kept; ++j) {
      // One model: keys are logits, monotone in the log-probability.
      const T key = S.top.key(j);
      const T lp = P.M == 1 ? (key - single_max) - single_ls : key;
      out.push_back({final_value(lp), S.top.idx(j)});
    }
    // Distinct logits can round to one log-probability; restore the index order among them.
    for (size_t j = 1; j < out.size(); ++j) {
      if (better(out[j], out[j - 1])) {
        std::sort(out.begin(), out.end(), better<T>);
        break;
      }
    }
  }
  const T eos_lp = ban ? -kInf<T> : word_lp(P.eos);
  P.eos_out[r] = eos_lp;
  auto insert = [&](Cand<T> c) {
    out.insert(std::upper_bound(out.begin(), out.end(), c, better<T>), c);
  };
  if (force || ban) insert({final_value(eos_lp), static_cast<int32_t>(P.eos)});
  if (P.penalize_unk) {
    insert({force ? -kInf<T> : final_value(word_lp(P.unk) - P.unk_penalty), static_cast<int32_t>(P.unk)});
  }

  const int take = std::min<int>(n, static_cast<int>(out.size()));
  for (int j = 0; j < take; ++j) {
    values[j] = out[j].key;
    indices[j] = out[j].idx;
  }
  if (take < n) {
    // Fewer than n words have a value: every other word is -inf (the pad, -inf logits);
    // give the rest distinct indices, the lowest not yet taken.
    auto& used = S.used;
    used.clear();
    for (int j = 0; j < take; ++j) used.push_back(out[j].idx);
    std::sort(used.begin(), used.end());
    int64_t word = 0;
    size_t u = 0;
    for (int j = take; j < n; ++j, ++word) {
      while (u < used.size() && used[u] == word) {
        ++u;
        ++word;
      }
      values[j] = -kInf<T>;
      indices[j] = word;
    }
  }
}

template <typename T>
void run(const Problem<T>& P) {
  // Enough words per task that a thread's start-up is paid back (decoder steps often have
  // a handful of rows).
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (P.V * P.M));
  fs::parallel_for(0, P.rows, grain, [&](int64_t begin, int64_t end) {
    Scratch<T> S;
    S.x.resize(P.M);
    S.max.resize(P.M);
    S.ls.resize(P.M);
    if (P.scale) S.scaled.resize(static_cast<size_t>(P.M) * P.V);
    S.out.reserve(P.n + 2);
    for (int64_t r = begin; r < end; ++r) run_row(P, r, S);
  });
}

}  // namespace

std::vector<at::Tensor> topk_log_softmax(const std::vector<at::Tensor>& logits, const std::vector<at::Tensor>& bias,
                                         int64_t n, int64_t pad, int64_t eos, int64_t unk, double unk_penalty,
                                         double temperature, bool ban_all, const std::optional<at::Tensor>& ban_eos,
                                         const std::optional<at::Tensor>& force_eos,
                                         const std::optional<at::Tensor>& add) {
  TORCH_CHECK(!logits.empty() && logits.size() <= 64, "logits: 1 to 64 models");
  const at::Tensor& x0 = logits[0];
  TORCH_CHECK(x0.dim() == 2, "logits must be (rows, V)");
  TORCH_CHECK(x0.scalar_type() == at::kFloat || x0.scalar_type() == at::kDouble, "logits must be float32 or float64");
  const int64_t rows = x0.size(0), V = x0.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t(1) << 31), "V out of range");
  TORCH_CHECK(n >= 1 && n <= V, "n must be in [1, V]");
  TORCH_CHECK(pad >= 0 && pad < V && eos >= 0 && eos < V && unk < V, "pad, eos, unk out of range");
  for (const auto& x : logits) {
    TORCH_CHECK(x.device().is_cpu() && x.is_contiguous() && x.sizes() == x0.sizes() &&
                    x.scalar_type() == x0.scalar_type(),
                "logits: contiguous CPU tensors of one shape and dtype");
  }
  TORCH_CHECK(bias.empty() || bias.size() == logits.size(), "bias: none or one per model");
  for (const auto& b : bias) {
    TORCH_CHECK(b.device().is_cpu() && b.is_contiguous() && b.dim() == 1 && b.size(0) == V &&
                    b.scalar_type() == x0.scalar_type(),
                "bias: contiguous (V,) CPU tensors of the logits' dtype");
  }
  auto check_rows = [&](const std::optional<at::Tensor>& t, at::ScalarType type, const char* name) {
    if (!t) return;
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->dim() == 1 && t->size(0) == rows &&
                    t->scalar_type() == type,
                name, ": a contiguous (rows,) CPU tensor of the right dtype");
  };
  check_rows(ban_eos, at::kBool, "ban_eos");
  check_rows(force_eos, at::kBool, "force_eos");
  check_rows(add, x0.scalar_type(), "add");

  auto values = at::empty({rows, n}, x0.options());
  auto indices = at::empty({rows, n}, x0.options().dtype(at::kLong));
  auto eos_out = at::empty({rows}, x0.options());
  AT_DISPATCH_FLOATING_TYPES(x0.scalar_type(), "topk_log_softmax_cpu", [&] {
    Problem<scalar_t> P;
    P.M = static_cast<int>(logits.size());
    P.rows = rows;
    P.V = V;
    P.n = static_cast<int>(n);
    for (const auto& x : logits) P.x.push_back(x.data_ptr<scalar_t>());
    for (const auto& b : bias) P.bias.push_back(b.data_ptr<scalar_t>());
    P.temperature = static_cast<scalar_t>(temperature);
    P.scale = !bias.empty() || temperature != 1.0;
    P.pad = pad;
    P.eos = eos;
    P.unk = unk;
    P.unk_penalty = static_cast<scalar_t>(unk_penalty);
    P.penalize_unk = unk >= 0 && unk_penalty != 0.0;
    P.ban_all = ban_all;
    P.ban = ban_eos ? ban_eos->data_ptr<bool>() : nullptr;
    P.force = force_eos ? force_eos->data_ptr<bool>() : nullptr;
    P.add = add ? add->data_ptr<scalar_t>() : nullptr;
    P.values = values.data_ptr<scalar_t>();
    P.indices = indices.data_ptr<int64_t>();
    P.eos_out = eos_out.data_ptr<scalar_t>();
    if (rows > 0) run(P);
  });
  return {values, indices, eos_out};
}
