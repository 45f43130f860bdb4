// The skinny product's tile loop (skinny_linear_cpu.cpp has the design), written once over a vector type V:
// included by each instruction set's file (skinny_linear_avx512_cpu.cpp, skinny_linear_avx2_cpu.cpp) inside
// its namespace (avx512, avx2), after `#pragma GCC target` and its vector type `Vector`, so that this code is
// compiled for that instruction set there and for no other (GCC does not inline intrinsics into a template
// whose target lacks them); it defines that namespace's tiles (skinny_tiles_cpu.h). No includes:
// skinny_tiles_cpu.h and <immintrin.h> come first, outside the pragma.
//
// V: kLanes floats a vector (Vec), a mask for the last partial chunk of k (Tail, tail(rest)), zero, load,
// load_tail (masked lanes read as 0), fmadd(a, b, c) = a * b + c, reduce (the totals of kLanes accumulators,
// accumulator r's in lane r, each by the same tree) and store (aligned).

// Rows m0 .. m0 + MB - 1 of x (those below ``rows``) against rows r0 .. r0 + R - 1 of W (those below n):
// MB x R accumulators (of the kLanes that V::reduce sums, the rest zero). MB rows of x share each load of W.
template <class V, int MB, int R>
inline void block(const float* x, int64_t m0, int64_t rows, const float* w, int64_t n, int64_t k, int64_t r0,
                  const float* bias, float* y, int64_t ahead) {
  constexpr int kLanes = V::kLanes;
  static_assert(MB * R <= kLanes, "one accumulator a lane");
  const int64_t chunks = k / kLanes;
  const int64_t rest = k % kLanes;
  const typename V::Tail tail = V::tail(rest);
  const float* xr[MB];
  row_pointers(x, m0, rows, k, xr);
  const float* wr[R];
  row_pointers(w, r0, n, k, wr);
  typename V::Vec acc[kLanes];
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) acc[i] = V::zero();
  for (int64_t c = 0; c < chunks; ++c) {
    // The same lines of the next tile's rows where a tile fits half of L1, else lines further along the row
    // (prefetch_distance). A prefetch never faults, past W's end included, and changes no arithmetic.
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(wr[r] + ahead + c * kLanes), _MM_HINT_T0);
#pragma GCC unroll 16
    for (int b = 0; b < MB; ++b) {
      const typename V::Vec xv = V::load(xr[b] + c * kLanes);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[b * R + r] = V::fmadd(V::load(wr[r] + c * kLanes), xv, acc[b * R + r]);
    }
  }
  if (rest != 0) {
#pragma GCC unroll 16
    for (int b = 0; b < MB; ++b) {
      const typename V::Vec xv = V::load_tail(xr[b] + chunks * kLanes, tail);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        acc[b * R + r] = V::fmadd(V::load_tail(wr[r] + chunks * kLanes, tail), xv, acc[b * R + r]);
      }
    }
  }
  alignas(64) float total[kLanes];
  V::store(total, V::reduce(acc));
  for (int b = 0; b < MB && m0 + b < rows; ++b) {
    float* out = y + (m0 + b) * n + r0;
    for (int r = 0; r < R && r0 + r < n; ++r) out[r] = bias != nullptr ? total[b * R + r] + bias[r0 + r] : total[b * R + r];
  }
}

// W's rows kLanes * first .. kLanes * last - 1 (tiles of kLanes rows) against every row of x, then
// relu_then_residual where asked. A tile (kLanes x k floats) is read from memory by the first rows of x and
// from cache by the others. Every output is one accumulator's chain along k and the same reduction,
// whichever block computes it and whatever rows pad the block.
template <class V>
void tiles_of(const float* x, int64_t rows, const float* w, int64_t n, int64_t k, const float* bias, float* y,
              int64_t first, int64_t last, const float* residual, bool relu) {
  constexpr int kTile = V::kLanes;
  const int64_t ahead = prefetch_distance(kTile, k);
  for (int64_t t = first; t < last; ++t) {
    const int64_t n0 = t * kTile;
    // Blocks of 4 rows of x, each against a quarter of the tile (the last block padded: 4 rows share W's
    // loads faster than 2 or 3 do), and a single row alone against the whole tile, which reads each load of
    // W once.
    for (int64_t m0 = 0; m0 < rows; m0 += 4) {
      if (rows - m0 == 1) {
        block<V, 1, kTile>(x, m0, rows, w, n, k, n0, bias, y, ahead);
      } else {
        for (int64_t r0 = n0; r0 < n0 + kTile && r0 < n; r0 += kTile / 4)
          block<V, 4, kTile / 4>(x, m0, rows, w, n, k, r0, bias, y, ahead);
      }
    }
    if (residual != nullptr || relu) finish_tile(y, rows, n, n0, kTile, residual, relu);
  }
}

void tiles(const float* x, int64_t rows, const float* w, int64_t n, int64_t k, const float* bias, float* y,
           int64_t first, int64_t last, const float* residual, bool relu) {
  tiles_of<Vector>(x, rows, w, n, k, bias, y, first, last, residual, relu);
}
