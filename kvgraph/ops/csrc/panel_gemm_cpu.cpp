// kvgraph::panel: y = x @ W^T (+ bias) in float32, for the few rows of a decode step and the
// thousands of a prompt.
//
// At those row counts a step's linear layers read every weight from memory once and do 2 * rows
// FLOPs per weight, too few to hide the reads: MKL's packed GEMM leaves the cores waiting on memory
// (benchmarks/RESULTS.md, "A GEMM for decode steps"). Here:
//   - W is packed once into panels of kCols columns (two SIMD vectors), each panel [K, kCols]
//     contiguous, so one panel is one sequential stream;
//   - a thread multiplies its panels in order, each by blocks of up to kRows rows of x (a register
//     block of 2 * kRows accumulators, x broadcast one value at a time, as MLAS's SGEMM kernels);
//   - at a decode step's rows (on AVX2 below kBlockedRows), K is taken in chunks that every row
//     block multiplies in turn, so the panel's chunk stays in L1 between blocks (the partial sums
//     wait in the output);
//   - while it multiplies panel p it prefetches panel p + 1 into L2, each row block a share of it,
//     so the next panel's reads overlap this one's arithmetic instead of following it;
//   - from kBlockedRows rows on AVX2 (a prompt, or a decode step of 16 sequences or more), x is
//     packed for the caches and the panels multiply it (blocked_linear).
// Sums run over k in order with fused multiply-adds: the result is F.linear's to float32 rounding.

#include "panel_gemm.h"

#include "pack_arena.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

// AVX-512 and AVX2 builds. With AVX2 (panels of 16 columns, blocks of 6 rows, 4 k steps at once)
// on a 2-core Zen 3 it multiplied llama-56m's linear layers in 0.51-0.58x oneDNN's packed product's
// time at 1-16 rows, 0.77x at 32-64, 0.87x at 96 and 0.94x at 128 with x read in place, and with
// x blocked 0.81-0.96x oneDNN's product with the plain weight at 96-2048 rows (benchmarks/RESULTS.md);
// x is now packed for the caches from 16 rows (kBlockedRows). On an
// Intel CPU without AVX-512 it measured 0.87-0.92x MKL's packed GEMM's speed from 32 rows on, so
// those keep MKL's.
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define KVGRAPH_PANEL_GEMM 1
#else
#define KVGRAPH_PANEL_GEMM 0
#endif

namespace kvgraph {
namespace panel {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();
constexpr int64_t kCols = 2 * kLanes;  // columns of a panel
// rows of a register block: 2 * kRows accumulators, 2 panel vectors and a broadcast fit in the
// 32 zmm registers (AVX-512) or the 16 ymm registers (AVX2)
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kRows = 12;
#else
constexpr int kRows = 6;
#endif
// k steps a block's loop takes at once, with one test for its prefetches: with AVX2 (16 ymm
// registers) on a 2-core Zen 3, 4 took 0.87x the time of 1 at 8-16 rows and 0.74-0.78x at 32-96
// (the decode step's 56 GEMMs of llama-56m, benchmarks/RESULTS.md); not measured with AVX-512,
// which keeps 1
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kUnroll = 1;
#else
constexpr int64_t kUnroll = 4;
#endif
constexpr int64_t kLine = 64;  // bytes of a cache line
constexpr int64_t kKChunk = 256;  // k steps of a panel multiplied by every row block in turn (32 KB)
constexpr int64_t kChunkedRows = 128;  // up to this many rows
constexpr int64_t kLinesPerK = kCols * static_cast<int64_t>(sizeof(float)) / kLine;  // of one panel row

// The accumulators as the compiler's own vector type (GCC keeps an array of Vectorized<float>
// objects on the stack, an array of these in registers); Vectorized<float> converts from and to it.
#if KVGRAPH_PANEL_GEMM && defined(CPU_CAPABILITY_AVX512)
using Simd = __m512;
#elif KVGRAPH_PANEL_GEMM
using Simd = __m256;
#else  // not used (available() is false); Vectorized's code for the build keeps it compiling
using Simd = Vec;
#endif
inline Simd simd_load(const float* p) { return Vec::loadu(p); }
inline Simd simd_set1(float x) { return Vec(x); }
inline Simd simd_fmadd(Simd a, Simd b, Simd c) { return at::vec::fmadd(Vec(a), Vec(b), Vec(c)); }

// What a row block prefetches of the next panel: `lines` lines from `from`, `per_k` a k step.
struct Prefetch {
  const char* from = nullptr;
  int64_t lines = 0;
  int64_t per_k = 1;
};

// One k step of a block: acc[r] += x[r, k] * b[k, 0:kCols] for its R rows, `x` row 0's x[k]
// (row stride lda), `b` the panel's row k.
template <int R>
__attribute__((always_inline)) inline void multiply_add(Simd (&acc0)[R], Simd (&acc1)[R], const float* x, int64_t lda,
                                                        const float* b) {
  const Simd b0 = simd_load(b), b1 = simd_load(b + kLanes);
  // row r's x[k] by one pointer stepped lda at a time: kept opaque, so the compiler holds one
  // address instead of R (which, with 2R accumulators, would spill them to the stack)
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const Simd v = simd_set1(*x);
    x += lda;
    asm("" : "+r"(x));
    acc0[r] = simd_fmadd(v, b0, acc0[r]);
    acc1[r] = simd_fmadd(v, b1, acc1[r]);
  }
}

// A block's sums: c's R rows (cols columns, row stride ldc) where it adds to them, else zeros.
template <int R>
__attribute__((always_inline)) inline void start_sums(Simd (&acc0)[R], Simd (&acc1)[R], const float* c, int64_t ldc,
                                                      int64_t cols, bool accumulate) {
  const int64_t cols0 = std::min(cols, kLanes), cols1 = cols - cols0;
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    acc0[r] = accumulate ? Simd(Vec::loadu(c + r * ldc, cols0)) : simd_set1(0.f);
    acc1[r] = accumulate && cols1 > 0 ? Simd(Vec::loadu(c + r * ldc + kLanes, cols1)) : simd_set1(0.f);
  }
}

// c's R rows = a block's sums (+ bias). Unrolled like the loops over the rows: an indexed
// accumulator would keep them all in memory.
template <int R>
__attribute__((always_inline)) inline void finish_sums(const Simd (&acc0)[R], const Simd (&acc1)[R], float* c, int64_t ldc,
                                                       int64_t cols, const float* bias) {
  const int64_t cols0 = std::min(cols, kLanes), cols1 = cols - cols0;
  Vec bias0(0.f), bias1(0.f);
  if (bias != nullptr) {
    bias0 = Vec::loadu(bias, cols0);
    if (cols1 > 0) bias1 = Vec::loadu(bias + kLanes, cols1);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    float* out = c + r * ldc;
    (Vec(acc0[r]) + bias0).store(out, cols0);
    if (cols1 > 0) (Vec(acc1[r]) + bias1).store(out + kLanes, cols1);
  }
}

// c[r, 0:cols] = a[r, :] . b[:, 0:cols] (+ bias) for R rows of a (row stride lda), b one panel.
template <int R>
__attribute__((noinline)) void block(const float* a, int64_t lda, const float* b, int64_t K, float* c, int64_t ldc,
                                     int64_t cols, const float* bias, Prefetch next, bool accumulate) {
  Simd acc0[R], acc1[R];
  start_sums<R>(acc0, acc1, c, ldc, cols, accumulate);
  // the next panel's lines this block still prefetches: a group of steps' worth at a time
  const char* ahead = next.from;
  int64_t ahead_lines = next.lines;
  const auto prefetch = [&](int64_t steps) {
    const int64_t lines = std::min(ahead_lines, steps * next.per_k);
    for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(ahead + l * kLine, 0, 2);
    ahead += lines * kLine;
    ahead_lines -= lines;
  };
  int64_t k = 0;
  for (; k + kUnroll <= K; k += kUnroll) {
    if (ahead_lines > 0) prefetch(kUnroll);
#pragma GCC unroll 4
    for (int64_t u = 0; u < kUnroll; ++u) multiply_add<R>(acc0, acc1, a + k + u, lda, b + (k + u) * kCols);
  }
  for (; k < K; ++k) {
    if (ahead_lines > 0) prefetch(1);
    multiply_add<R>(acc0, acc1, a + k, lda, b + k * kCols);
  }
  finish_sums<R>(acc0, acc1, c, ldc, cols, bias);
}

// c[r, 0:cols] (+)= ap's R rows . b[:, 0:cols] (+ bias), b K rows of a panel and ap R rows of x
// packed k-major (ap[k * R + r]): the kernel of blocked_linear. Each x value is at a constant
// offset of one pointer; block()'s stepped pointer cost it 1.1-1.3x the time here.
template <int R>
__attribute__((noinline)) void packed_block(const float* ap, const float* b, int64_t K, float* c, int64_t ldc,
                                            int64_t cols, const float* bias, bool accumulate) {
  Simd acc0[R], acc1[R];
  start_sums<R>(acc0, acc1, c, ldc, cols, accumulate);
#pragma GCC unroll 4
  for (int64_t k = 0; k < K; ++k) {
    const Simd b0 = simd_load(b + k * kCols), b1 = simd_load(b + k * kCols + kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Simd v = simd_set1(ap[k * R + r]);
      acc0[r] = simd_fmadd(v, b0, acc0[r]);
      acc1[r] = simd_fmadd(v, b1, acc1[r]);
    }
  }
  finish_sums<R>(acc0, acc1, c, ldc, cols, bias);
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, const float*, Prefetch, bool);

using PackedBlockFn = void (*)(const float*, const float*, int64_t, float*, int64_t, int64_t, const float*, bool);

template <int... Rs>
constexpr std::array<BlockFn, sizeof...(Rs)> blocks(std::integer_sequence<int, Rs...>) {
  return {block<Rs + 1>...};
}

template <int... Rs>
constexpr std::array<PackedBlockFn, sizeof...(Rs)> packed_blocks(std::integer_sequence<int, Rs...>) {
  return {packed_block<Rs + 1>...};
}

// kBlocks[R - 1]: the kernel of an R-row block of x's rows; kPackedBlocks[R - 1], of packed rows
constexpr auto kBlocks = blocks(std::make_integer_sequence<int, kRows>{});
constexpr auto kPackedBlocks = packed_blocks(std::make_integer_sequence<int, kRows>{});

// Rows split into as few register blocks as fit, of equal size (within one): 13 rows are 7 + 6,
// not 12 + 1, whose one-row block would read the whole panel again for a sixth of the arithmetic.
struct RowBlocks {
  int64_t count, base, longer;  // blocks; rows of each; how many (the first) have one more
  explicit RowBlocks(int64_t rows)
      : count((rows + kRows - 1) / kRows), base(rows / count), longer(rows % count) {}
  int64_t rows(int64_t block) const { return base + (block < longer ? 1 : 0); }
};

// From this many rows a GEMM is cache blocked (blocked_linear). With x packed by vectors
// (pack_rows) and a decode step's panels multiplied whole, llama-56m's linear layers took
// 0.76-0.90x the time of the K-chunked nest at 16-128 rows on a 2-core Zen 3 (one run equal at 64),
// and the same at 1-12, where the weights' reads bound both (benchmarks/RESULTS.md); with x packed
// one value at a time the K-chunked nest had led up to 128 rows. Measured on AVX2 only: an AVX-512
// build keeps whole panels.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kBlockedRows = std::numeric_limits<int64_t>::max();
#else
constexpr int64_t kBlockedRows = 16;
#endif
constexpr int64_t kBlockRows = 96;  // rows of x a blocked GEMM packs at once: 16 AVX2 register blocks
constexpr int64_t kBlockK = 256;  // k steps of them: 96 KB of x in L2, 16 KB of a panel in L1

// kBlockedRows, or KVGRAPH_PANEL_BLOCKED_ROWS (read at each call: the tests run both loop nests
// at every shape)
int64_t blocked_rows() {
  const char* env = std::getenv("KVGRAPH_PANEL_BLOCKED_ROWS");
  return env != nullptr && *env != '\0' ? std::max<int64_t>(1, std::atoll(env)) : kBlockedRows;
}

// Floats pack_rows may write past its block (then overwritten, or in the buffer's spare end).
constexpr int64_t kPackSpill = 8;

// dst[k * rows + r] = src[r * lda + k] for r < rows, k < kn: `rows` rows of x packed k-major. With
// AVX2, 8 k steps at a time: each row's 8 values loaded as one vector, the 8 x 8 block transposed
// in registers and each k step's `rows` values stored as one vector (its 8 - rows extra lanes are
// overwritten by the next k step's store, or by the next block, or land in kPackSpill). Scalar
// loads and strided stores took 13 % of a 2048 x 512 x 512 product's time on a 2-core Zen 3.
void pack_rows(const float* src, int64_t lda, int64_t rows, int64_t kn, float* dst) {
  int64_t k = 0;
#if defined(__AVX2__)
  if (rows <= 8) {
    for (; k + 8 <= kn; k += 8) {
      __m256 v[8];
      for (int64_t r = 0; r < 8; ++r) v[r] = r < rows ? _mm256_loadu_ps(src + r * lda + k) : _mm256_setzero_ps();
      const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
      const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
      const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
      const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
      const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      // column j of the block: (v[0][j], ..., v[7][j]), in order of j
      float* out = dst + k * rows;
      _mm256_storeu_ps(out, _mm256_permute2f128_ps(s0, s4, 0x20));
      _mm256_storeu_ps(out + rows, _mm256_permute2f128_ps(s1, s5, 0x20));
      _mm256_storeu_ps(out + 2 * rows, _mm256_permute2f128_ps(s2, s6, 0x20));
      _mm256_storeu_ps(out + 3 * rows, _mm256_permute2f128_ps(s3, s7, 0x20));
      _mm256_storeu_ps(out + 4 * rows, _mm256_permute2f128_ps(s0, s4, 0x31));
      _mm256_storeu_ps(out + 5 * rows, _mm256_permute2f128_ps(s1, s5, 0x31));
      _mm256_storeu_ps(out + 6 * rows, _mm256_permute2f128_ps(s2, s6, 0x31));
      _mm256_storeu_ps(out + 7 * rows, _mm256_permute2f128_ps(s3, s7, 0x31));
    }
  }
#endif
  for (; k < kn; ++k) {
    for (int64_t r = 0; r < rows; ++r) dst[k * rows + r] = src[r * lda + k];
  }
}

// x's rows m0.. of a row group (its register blocks `blocks`), k steps k0..k0+kn, packed for
// packed_block: each register block's rows k-major, one block after the other, from dst.
void pack_piece(const float* a, int64_t K, int64_t m0, const RowBlocks& blocks, int64_t k0, int64_t kn, float* dst) {
  for (int64_t rb = 0, r0 = m0; rb < blocks.count; r0 += blocks.rows(rb), ++rb) {
    pack_rows(a + r0 * K + k0, K, blocks.rows(rb), kn, dst);
    dst += blocks.rows(rb) * kn;
  }
}

// c[m0.., n0..n0 + cols] (+)= a piece of pack_piece times kn rows of a panel (+ bias).
void multiply_piece(const float* piece, const RowBlocks& blocks, int64_t m0, const float* panel, int64_t kn, float* c,
                    int64_t n, int64_t n0, int64_t cols, const float* bias, bool accumulate) {
  for (int64_t rb = 0, r0 = m0; rb < blocks.count; r0 += blocks.rows(rb), ++rb) {
    const int64_t rows = blocks.rows(rb);
    kPackedBlocks[rows - 1](piece, panel, kn, c + r0 * n + n0, n, cols, bias, accumulate);
    piece += rows * kn;
  }
}

// The GEMM of x packed for the caches, as BLIS does (Van Zee and van de Geijn, 2015). x is packed
// k-major by register block (pack_piece) and each kBlockK rows of a panel (16 KB, in L1) multiply
// every register block of a piece of it in turn. Each thread takes a share of the panels over all
// of x, packing x itself.
//   - A prompt's rows: x taken kBlockRows rows by kBlockK k steps at a time (96 KB, in L2), every
//     panel of the share multiplied by that piece before the next. Unblocked, each panel's pass at
//     2048 rows reads all of x (4 MB at K = 512) again from L3. On a 2-core Zen 3, llama-56m's 56
//     linear layers took 0.92-0.98x the time of whole panels at 96-192 and 1024-2048 rows (equal at
//     256-512) and 0.81-0.96x oneDNN's product with the plain weight at 96-2048 rows.
//   - Up to kBlockRows rows (a decode step): x packed whole, each panel multiplied whole in turn,
//     so the weight streams from memory in order; piece by piece, each panel's next 16 KB lay a
//     panel (K * 64 bytes) away, and at 16-24 rows this nest took 1.17-1.24x the time of the
//     K-chunked one instead of the same (benchmarks/RESULTS.md).
void blocked_linear(const float* a, int64_t M, int64_t K, const float* w, int64_t P, int64_t n, const float* bias,
                    float* c) {
  const int64_t row_groups = (M + kBlockRows - 1) / kBlockRows;
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(P, at::get_num_threads()));
  const bool whole = row_groups == 1;
  at::parallel_for(0, row_groups * shares, 1, [&](int64_t i0, int64_t i1) {
    // not zeroed: pack_piece writes every value a product reads (a vector's zeros were a memset of
    // all of x per thread and call at a decode step's rows)
    const std::unique_ptr<float[]> buffer(new float[(whole ? M * K : kBlockRows * std::min(K, kBlockK)) + kPackSpill]);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / row_groups, g = i % row_groups;  // a thread's items: one share, every row group
      const int64_t m0 = g * kBlockRows, mn = std::min(kBlockRows, M - m0);
      const int64_t p0 = P * s / shares, p1 = P * (s + 1) / shares;
      const RowBlocks blocks(mn);
      const auto bias_of = [&](int64_t k0, int64_t n0) {  // added by a panel's last k steps
        return k0 + kBlockK >= K && bias != nullptr ? bias + n0 : nullptr;
      };
      if (whole) {  // piece k0 at buffer + k0 * mn
        for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
          pack_piece(a, K, m0, blocks, k0, std::min(kBlockK, K - k0), buffer.get() + k0 * mn);
        }
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t n0 = p * kCols, cols = std::min(kCols, n - n0);
          for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
            multiply_piece(buffer.get() + k0 * mn, blocks, m0, w + (p * K + k0) * kCols, std::min(kBlockK, K - k0), c, n,
                           n0, cols, bias_of(k0, n0), k0 > 0);
          }
        }
        continue;
      }
      for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
        const int64_t kn = std::min(kBlockK, K - k0);
        pack_piece(a, K, m0, blocks, k0, kn, buffer.get());
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t n0 = p * kCols, cols = std::min(kCols, n - n0);
          multiply_piece(buffer.get(), blocks, m0, w + (p * K + k0) * kCols, kn, c, n, n0, cols, bias_of(k0, n0), k0 > 0);
        }
      }
    }
  });
}

}  // namespace

bool available() { return KVGRAPH_PANEL_GEMM; }

at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "panel::pack takes a float32 matrix, got ",
              w.scalar_type(), " of shape ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1), P = (N + kCols - 1) / kCols;
  at::Tensor packed = arena::zeros({P, K, kCols});  // next to the packs made before it
  const at::Tensor src = w.contiguous();
  const float* s = src.const_data_ptr<float>();
  float* d = packed.mutable_data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t j = 0; j < std::min(kCols, N - p * kCols); ++j) {
        const float* row = s + (p * kCols + j) * K;
        for (int64_t k = 0; k < K; ++k) d[(p * K + k) * kCols + j] = row[k];
      }
    }
  });
  return packed;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1), M = K > 0 ? x.numel() / K : 0, P = packed.size(0);
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == kCols && P * kCols >= n && n > P * kCols - kCols,
              "panel::linear: a pack of shape ", packed.sizes(), " is not a [", n, ", ", K, "] weight's panels of ", kCols,
              " columns");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == n && b.scalar_type() == at::kFloat, "panel::linear: a bias of ", b.numel(), " ",
                b.scalar_type(), " values for ", n, " outputs");
  }
  if (K == 0) {  // no products: the bias, or zeros
    return b.defined() ? b.expand(shape).clone() : at::zeros(shape, x.options());
  }
  at::Tensor y = at::empty(shape, x.options());
  if (M == 0) return y;
  const at::Tensor xc = x.contiguous();
  const float* a = xc.const_data_ptr<float>();
  const float* w = packed.const_data_ptr<float>();
  const float* bp = b.defined() ? b.const_data_ptr<float>() : nullptr;
  float* c = y.mutable_data_ptr<float>();
  if (M >= blocked_rows()) {
    blocked_linear(a, M, K, w, P, n, bp, c);
    return y;
  }
  const RowBlocks blocks(M);
  const int64_t row_blocks = blocks.count;
  // K in chunks whose share of a panel stays in L1 while every row block reads it, at a decode
  // step's rows (2-128 rows: 1.06-1.2x whole panels at 32-64 rows; more rows measured no better)
  const bool chunked = row_blocks > 1 && M <= kChunkedRows && K > kKChunk * 3 / 2;
  const int64_t k_chunk = chunked ? kKChunk : K, k_chunks = (K + k_chunk - 1) / k_chunk;
  // each (chunk, row block) call prefetches its share of the next panel, spread over its K steps
  const int64_t panel_lines = K * kLinesPerK, calls = row_blocks * k_chunks;
  const int64_t share = (panel_lines + calls - 1) / calls;
  const int64_t per_k = std::max<int64_t>(1, (share + k_chunk - 1) / k_chunk);
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kCols, cols = std::min(kCols, n - n0);
      const float* panel = w + p * K * kCols;
      const char* following = p + 1 < p1 ? reinterpret_cast<const char*>(panel + K * kCols) : nullptr;
      for (int64_t kc = 0; kc < k_chunks; ++kc) {
        const int64_t k0 = kc * k_chunk, kn = std::min(k_chunk, K - k0);
        const bool last = kc + 1 == k_chunks;
        for (int64_t rb = 0, r0 = 0; rb < row_blocks; ++rb) {
          const int64_t rows = blocks.rows(rb);
          Prefetch next;
          if (following != nullptr) {
            const int64_t first = std::min(panel_lines, (kc * row_blocks + rb) * share);
            next = Prefetch{following + first * kLine, std::min(share, panel_lines - first), per_k};
          }
          kBlocks[rows - 1](a + r0 * K + k0, K, panel + k0 * kCols, kn, c + r0 * n + n0, n, cols,
                            last && bp != nullptr ? bp + n0 : nullptr, next, kc > 0);
          r0 += rows;
        }
      }
    }
  });
  return y;
}

}  // namespace panel
}  // namespace kvgraph
