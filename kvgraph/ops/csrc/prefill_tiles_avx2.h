// A prompt's attention over one tile of keys with AVX2 and FMA, as two small matrix products:
// the scores of every row of a work item at once, S^T = K Q^T, then acc += P V. Each product is a
// register block of up to 6 x 16 outputs (12 accumulators) that broadcasts one value of its left
// operand at a time and loads two vectors of its right one, as the panel GEMM's kernel does: the
// keys and values are read in place (a key's values broadcast, a value row loaded), Q^T is packed
// once per item, and the online softmax runs down the columns of S^T, 8 query rows per vector.
// ragged_attention_cpu.cpp's attend_block calls it for float32 accumulation when D % 16 == 0;
// its row-at-a-time path (one query row against the tile, dot products and a horizontal sum per
// key) stays for the rest, and KVGRAPH_PREFILL_TILES=rows picks it.
//
// Sums run over the head dimension (scores) and over the tile's keys (values) in order, one FMA
// chain per output: the outputs equal the row path's to float32 rounding, not bit for bit.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <ATen/cpu/vec/vec.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <utility>

namespace kvgraph {
namespace prefill_avx2 {

constexpr int64_t kCols = 16;  // columns of a product's register block: two vectors
constexpr int kMaxRows = 6;    // rows of it: 12 accumulators, 2 loaded vectors and a broadcast in 16 ymm

inline bool usable(int64_t D) { return D % kCols == 0; }

// c[r * ldc + 0:16] (+)= sum_k a[r * a_rs + k * a_ks] * b[k * ldb + 0:16] for r < R.
template <int R>
__attribute__((noinline)) void product(const float* a, int64_t a_rs, int64_t a_ks, const float* b, int64_t ldb,
                                       int64_t kdim, float* c, int64_t ldc, bool accumulate) {
  __m256 c0[R], c1[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    c0[r] = accumulate ? _mm256_loadu_ps(c + r * ldc) : _mm256_setzero_ps();
    c1[r] = accumulate ? _mm256_loadu_ps(c + r * ldc + 8) : _mm256_setzero_ps();
  }
#pragma GCC unroll 4
  for (int64_t k = 0; k < kdim; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * ldb), b1 = _mm256_loadu_ps(b + k * ldb + 8);
    const float* ak = a + k * a_ks;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 v = _mm256_broadcast_ss(ak + r * a_rs);
      c0[r] = _mm256_fmadd_ps(v, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(v, b1, c1[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * ldc, c0[r]);
    _mm256_storeu_ps(c + r * ldc + 8, c1[r]);
  }
}

using ProductFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t, bool);

template <int... Rs>
constexpr std::array<ProductFn, sizeof...(Rs)> products(std::integer_sequence<int, Rs...>) {
  return {product<Rs + 1>...};
}

// kProducts[R - 1]: the product of an R-row block
inline constexpr auto kProducts = products(std::make_integer_sequence<int, kMaxRows>{});

// f(first, count) over [0, n) in as few blocks of at most kMaxRows as fit, of equal size (within one).
template <typename F>
inline void for_blocks(int64_t n, F&& f) {
  if (n <= 0) return;
  const int64_t count = (n + kMaxRows - 1) / kMaxRows, base = n / count, longer = n % count;
  for (int64_t i = 0, first = 0; i < count; ++i) {
    const int64_t rows = base + (i < longer ? 1 : 0);
    f(first, rows);
    first += rows;
  }
}

// Columns of S^T for `rows` query rows: a multiple of 16.
inline int64_t padded(int64_t rows) { return (rows + kCols - 1) / kCols * kCols; }

// qt[(p * D + d) * 16 + c] = q[(16 p + c) * D + d], zero past `rows`: Q^T in panels of 16 rows.
inline void pack_queries(const float* q, int64_t rows, int64_t D, float* qt) {
  for (int64_t p = 0; p * kCols < rows; ++p) {
    for (int64_t d = 0; d < D; ++d) {
      float* out = qt + (p * D + d) * kCols;
      for (int64_t c = 0; c < kCols; ++c) {
        const int64_t r = p * kCols + c;
        out[c] = r < rows ? q[r * D + d] : 0.f;
      }
    }
  }
}

// One tile of n keys (k and v rows ld apart) for every row of an item: row r sees tile keys
// [lo[r / G], hi[r / G]) (none when lo >= hi), the rows of one token alike. qt: pack_queries of
// the item's (pre-scaled) queries; st: scratch of n x padded(rows); m, l, alpha: padded(rows)
// each. Updates acc [rows, D], the running max m and sum l of each row as attend_block's row path does.
inline void tile(const float* qt, int64_t rows, int64_t G, int64_t D, const float* k, const float* v, int64_t ld,
                 int64_t n, const int64_t* lo, const int64_t* hi, float softcap, float* st, float* acc, float* m,
                 float* l, float* alpha) {
  using Vec = at::vec::Vectorized<float>;
  const int64_t ld_s = padded(rows), tokens = (rows + G - 1) / G;
  // keys past every row's last visible one are neither scored nor read
  int64_t used = 0;
  bool masked = false;
  for (int64_t t = 0; t < tokens; ++t) {
    if (lo[t] < hi[t]) used = std::max(used, hi[t]);
  }
  if (used == 0) return;  // no row sees a key of this tile
  for (int64_t t = 0; t < tokens; ++t) masked |= lo[t] > 0 || hi[t] < used;
  // -- S^T = K Q^T: st[j * ld_s + r] = k_j . q_r --
  for_blocks(used, [&](int64_t j0, int64_t R) {
    for (int64_t p = 0; p < ld_s / kCols; ++p) {
      kProducts[R - 1](k + j0 * ld, ld, 1, qt + p * D * kCols, kCols, D, st + j0 * ld_s + p * kCols, ld_s, false);
    }
  });
  if (softcap > 0) {
    const Vec vc(softcap), inv(1.f / softcap);
    for (int64_t i = 0; i < used * ld_s; i += Vec::size()) (vc * (Vec::loadu(st + i) * inv).tanh()).store(st + i);
  }
  if (masked) {  // the keys a row does not see
    const float neg = -std::numeric_limits<float>::infinity();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t a = std::min(used, std::max<int64_t>(0, lo[r / G])), b = std::max(a, std::min(used, hi[r / G]));
      for (int64_t j = 0; j < a; ++j) st[j * ld_s + r] = neg;
      for (int64_t j = b; j < used; ++j) st[j * ld_s + r] = neg;
    }
  }
  // -- online softmax down the columns, 8 rows at a time: st becomes the numerators --
  const Vec neg_inf(-std::numeric_limits<float>::infinity()), zero(0.f);
  for (int64_t c = 0; c < ld_s; c += Vec::size()) {
    Vec mx = Vec::loadu(st + c);
    for (int64_t j = 1; j < used; ++j) mx = at::vec::maximum(mx, Vec::loadu(st + j * ld_s + c));
    const Vec m_old = Vec::loadu(m + c), m_new = at::vec::maximum(m_old, mx);
    // a row that has seen no key yet keeps m = -inf: subtract 0 instead, so exp gives 0, not NaN
    const Vec shift = Vec::blendv(m_new, zero, m_new == neg_inf);
    const Vec a = (m_old - shift).exp_u20();
    Vec sum(0.f);
    for (int64_t j = 0; j < used; ++j) {
      const Vec e = (Vec::loadu(st + j * ld_s + c) - shift).exp_u20();
      e.store(st + j * ld_s + c);
      sum = sum + e;
    }
    (Vec::loadu(l + c) * a + sum).store(l + c);
    m_new.store(m + c);
    a.store(alpha + c);
  }
  // -- acc = acc * alpha + P V, P = st^T --
  for (int64_t r = 0; r < rows; ++r) {
    const Vec a(alpha[r]);
    for (int64_t d = 0; d < D; d += Vec::size()) (Vec::loadu(acc + r * D + d) * a).store(acc + r * D + d);
  }
  for_blocks(rows, [&](int64_t r0, int64_t R) {
    for (int64_t d0 = 0; d0 < D; d0 += kCols) {
      kProducts[R - 1](st + r0, 1, ld_s, v + d0, ld, used, acc + r0 * D + d0, D, true);
    }
  });
}

}  // namespace prefill_avx2
}  // namespace kvgraph
#endif
