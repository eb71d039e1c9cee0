// A decode step over an int8 KV cache with AVX2 and FMA (CPUs without AVX-512 VNNI), reading the
// int8 rows in place: each K or V row is widened to fp32 in registers, used by every query row of
// its item, and never stored. The scales come out of the inner loops: a key's scale multiplies
// its finished dot products, a value's scale its softmax numerators (one scale per row), or each
// 8-lane chunk of the row (several groups per row). Products and sums stay fp32, so the scores and
// outputs equal the dequantized cache's up to fp32 rounding, as the tile path's do.
//
// Needs D % 8 == 0 and group % 8 == 0 (each 8-lane chunk of a row inside one scale group);
// ragged_attention_cpu.cpp falls back to its dequantizing tile path otherwise.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace kvgraph {

// f(r0, std::integral_constant<int, R>) for R = min(4, rows - r0) at r0 = 0, 4, 8, ...: rows in
// register blocks of up to 4 (both int8 decode paths).
template <typename F>
inline void for_row_blocks(int64_t rows, F&& f) {
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    switch (std::min<int64_t>(4, rows - r0)) {
      case 1: f(r0, std::integral_constant<int, 1>{}); break;
      case 2: f(r0, std::integral_constant<int, 2>{}); break;
      case 3: f(r0, std::integral_constant<int, 3>{}); break;
      default: f(r0, std::integral_constant<int, 4>{}); break;
    }
  }
}

}  // namespace kvgraph

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace kvgraph {
namespace int8_avx2 {

inline bool usable(int64_t D, int64_t group) { return D % 8 == 0 && group % 8 == 0 && group > 0; }

// 8 int8 at p widened to 8 floats.
inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// lane j = x[j * ld] for j < m (m <= 8), else x[(m - 1) * ld]: eight scalar loads, faster than a
// gather on the CPUs this path is for.
inline __m256 strided8(const float* x, int64_t ld, int64_t m) {
  auto at = [&](int64_t j) { return x[std::min(j, m - 1) * ld]; };
  return _mm256_setr_ps(at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7));
}

// out[r * ld_out + j] = q_r . k_j for R rows q_r = q + r * D and m <= 8 keys k_j = key[j] (m..7
// repeat a valid key and are not stored), one group [d0, d1) of D, each dot times scale[j]; added
// to out when `add`.
template <int R>
inline void scores_group(const float* q, int64_t D, const int8_t* const* key, int64_t m, int64_t d0, int64_t d1,
                         __m256 scale, bool add, float* out, int64_t ld_out) {
  // keys in pairs: R x 2 FMA chains, each pair's two sums folded by one hadd right away, so 4 x R
  // vectors wait for the rest of the transpose-sum, not 8 x R
  __m256 pairs[4][R];
  for (int j = 0; j < 8; j += 2) {
    __m256 a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
    // unrolled: the bounds are not compile-time, and the loop's own instructions held back its FMAs
    _Pragma("GCC unroll 8")
    for (int64_t d = d0; d < d1; d += 8) {
      const __m256 k0 = widen8(key[j] + d), k1 = widen8(key[j + 1] + d);
      for (int r = 0; r < R; ++r) {
        const __m256 qv = _mm256_loadu_ps(q + r * D + d);
        a[r][0] = _mm256_fmadd_ps(qv, k0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(qv, k1, a[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) pairs[j / 2][r] = _mm256_hadd_ps(a[r][0], a[r][1]);
  }
  for (int r = 0; r < R; ++r) {
    // [keys 0-3 over lanes 0-3 | keys 0-3 over lanes 4-7], the same for keys 4-7
    const __m256 s03 = _mm256_hadd_ps(pairs[0][r], pairs[1][r]), s47 = _mm256_hadd_ps(pairs[2][r], pairs[3][r]);
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(s03, s47, 0x20), _mm256_permute2f128_ps(s03, s47, 0x31));
    const __m256 s = _mm256_mul_ps(sums, scale);
    float* o = out + r * ld_out;
    if (m == 8) {
      _mm256_storeu_ps(o, add ? _mm256_add_ps(s, _mm256_loadu_ps(o)) : s);
    } else {  // a run's tail: no masked store (slow on some CPUs), no write past the run
      alignas(32) float t[8];
      _mm256_store_ps(t, s);
      for (int64_t j = 0; j < m; ++j) o[j] = add ? o[j] + t[j] : t[j];
    }
  }
}

// out[r * ld_out + j] = q_r . k_j (dequantized) for every row r < rows (q_r = q + r * D, pre-scaled)
// and n keys k_j = k + j * ld_k with scales ks[j * ld_ks + d / group].
inline void scores(const float* q, int64_t rows, int64_t D, int64_t group, const int8_t* k, int64_t ld_k,
                   const float* ks, int64_t ld_ks, int64_t n, float* out, int64_t ld_out) {
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t m = std::min<int64_t>(8, n - j0);
    const int8_t* key[8];
    for (int64_t j = 0; j < 8; ++j) key[j] = k + (j0 + std::min(j, m - 1)) * ld_k;
    for (int64_t g = 0; g * group < D; ++g) {
      const __m256 scale = strided8(ks + j0 * ld_ks + g, ld_ks, m);
      for_row_blocks(rows, [&](int64_t r0, auto R) {
        scores_group<decltype(R)::value>(q + r0 * D, D, key, m, g * group, (g + 1) * group, scale, g > 0,
                                         out + r0 * ld_out + j0, ld_out);
      });
    }
  }
}

// acc[r * D + d] += sum_j p[r * ld_p + j] * v_j[d] for R rows and C 8-lane chunks from lane c0,
// n keys v_j = v + j * ld_v; each chunk times its group's scale vs[j * ld_vs + group index] unless
// kFolded (the scales already in p). R x C accumulators in registers over the run.
template <int R, int C, bool kFolded>
inline void accumulate_chunks(float* acc, int64_t D, int64_t group, int64_t c0, const float* p, int64_t ld_p,
                              const int8_t* v, int64_t ld_v, const float* vs, int64_t ld_vs, int64_t n) {
  __m256 a[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) a[r][c] = _mm256_loadu_ps(acc + r * D + c0 + 8 * c);
  }
  _Pragma("GCC unroll 4")
  for (int64_t j = 0; j < n; ++j) {
    __m256 x[C];
    for (int c = 0; c < C; ++c) {
      x[c] = widen8(v + j * ld_v + c0 + 8 * c);
      if constexpr (!kFolded) x[c] = _mm256_mul_ps(x[c], _mm256_broadcast_ss(vs + j * ld_vs + (c0 + 8 * c) / group));
    }
    for (int r = 0; r < R; ++r) {
      const __m256 pr = _mm256_broadcast_ss(p + r * ld_p + j);
      for (int c = 0; c < C; ++c) a[r][c] = _mm256_fmadd_ps(pr, x[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + r * D + c0 + 8 * c, a[r][c]);
  }
}

// acc[r * D + d] += sum_j p[r * ld_p + j] * v_j[d] (dequantized) for every row r < rows and n keys
// v_j = v + j * ld_v with scales vs[j * ld_vs + d / group]. With one scale per row (group == D) it
// goes into p (which it overwrites) once per key.
inline void accumulate(float* acc, int64_t rows, int64_t D, int64_t group, float* p, int64_t ld_p, const int8_t* v,
                       int64_t ld_v, const float* vs, int64_t ld_vs, int64_t n) {
  const bool folded = group == D;
  if (folded) {
    int64_t j0 = 0;
    for (; j0 + 8 <= n; j0 += 8) {
      const __m256 s = strided8(vs + j0 * ld_vs, ld_vs, 8);
      for (int64_t r = 0; r < rows; ++r) {
        float* pr = p + r * ld_p + j0;
        _mm256_storeu_ps(pr, _mm256_mul_ps(_mm256_loadu_ps(pr), s));
      }
    }
    for (; j0 < n; ++j0) {
      for (int64_t r = 0; r < rows; ++r) p[r * ld_p + j0] *= vs[j0 * ld_vs];
    }
  }
  for_row_blocks(rows, [&](int64_t r0, auto R) {
    constexpr int kR = decltype(R)::value;
    auto run = [&](int64_t c0, auto C) {
      constexpr int kC = decltype(C)::value;
      float* a = acc + r0 * D;
      const float* pr = p + r0 * ld_p;
      if (folded) {
        accumulate_chunks<kR, kC, true>(a, D, group, c0, pr, ld_p, v, ld_v, vs, ld_vs, n);
      } else {
        accumulate_chunks<kR, kC, false>(a, D, group, c0, pr, ld_p, v, ld_v, vs, ld_vs, n);
      }
    };
    int64_t c0 = 0;
    for (; c0 + 16 <= D; c0 += 16) run(c0, std::integral_constant<int, 2>{});
    for (; c0 < D; c0 += 8) run(c0, std::integral_constant<int, 1>{});
  });
}

}  // namespace int8_avx2
}  // namespace kvgraph
#endif
