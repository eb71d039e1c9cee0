// kvgraph::ragged_attention on the CPU: store the new K/V into their pages, then flash-style
// attention of every new token over its own sequence, reading the pages in place.
//
// Layout assumptions (MAX's):
//   q [T, Hq, D], k/v [T, Hkv, D]: the head dim contiguous (tokens and heads may be strided).
//   kv_blocks, contiguous: paged      [num_pages, 2, L, page_size, Hkv, D]
//                          continuous [max_batch_size, 2, L, max_seq_len, Hkv, D]
//     axis 1: 0 = key, 1 = value. One (page, kv, layer, slot) row holds Hkv * D values.
//   cache_lengths int32 [B]: tokens cached before this step.
//   lookup_table int32: paged [B, max_num_pages] -> physical page of each logical page;
//                       continuous [B] -> slot (row of kv_blocks) of each sequence.
//   input_row_offsets int32 [B + 1]: prefix sums of the new tokens per sequence.
//   max_lengths int32 [num_steps, 2] (CPU): row 0 = [max new, max cached + new].
// Work: one item per (sequence, kv head, block of up to kQueryBlock new tokens). The rows of an
// item are (new token, query head of the group), so GQA reads each K/V row once per group and
// never repeats K/V. Softmax is online in fp32 (fp64 for fp64 inputs), K/V tiles never cross a
// page, and no sequence is padded to the longest one.
// Sliding window w: the token at position p sees only [max(0, p - w + 1), p]. An item's keys start
// at its first token's window start, so tiles and pages wholly before it are never read; a later
// token's window starts at most kQueryBlock - 1 keys further, masked in the tile that holds it.
// Softcap c (Gemma 2): each score s becomes c * tanh(s / c) right after its dot product, before
// masking, max and exp; 0 means none, checked once per row of a tile, never per score.
// Quantized cache (kv_scales given): kv_blocks int8 or float8_e4m3fn, kv_scales float32 laid out
// like kv_blocks with the last dim D / group. A stored row gets, per group of `group` elements,
// scale = max|x| / QMAX and x * (1 / scale) rounded (int8: to nearest even, clamped to +-127;
// fp8: clamped to +-448, then converted), as kvgraph/cache/quant.py. Reads dequantize each K/V
// row into the tile buffer the bf16/fp16 path converts into (x = q * scale, in fp32), so no fp32
// copy of the context is ever made.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace kvgraph {
namespace {

constexpr int64_t kQueryBlock = 16;  // new tokens per work item
constexpr int64_t kKeyTile = 64;     // keys per tile
constexpr int64_t kGatherRows = 16;  // fp32 items with fewer rows read short pages in place

// No sliding window: a window longer than any context, so plain causal attention.
constexpr int64_t kNoWindow = std::numeric_limits<int64_t>::max();

template <typename scalar_t>
using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

template <typename T>
constexpr bool kQuantized = std::is_same_v<T, int8_t> || std::is_same_v<T, c10::Float8_e4m3fn>;

template <typename T>
constexpr float kQMax = std::is_same_v<T, int8_t> ? 127.0f : 448.0f;

// float of every float8_e4m3fn bit pattern: dequantizing is one table load per element.
const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) {
      t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    }
    return t;
  }();
  return table.data();
}

// dst[0:D] = src * scale per group of `group` elements (a quantized row, dequantized in fp32).
template <typename cache_t, typename A>
inline void dequantize_row(const cache_t* src, const float* scales, int64_t group, int64_t D, A* dst) {
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    for (int64_t g0 = 0; g0 < D; g0 += group) {
      const float s = scales[g0 / group];
      int64_t j = g0;
#if defined(__AVX2__)
      if constexpr (std::is_same_v<A, float>) {
        const __m256 vs = _mm256_set1_ps(s);
        for (; j + 8 <= g0 + group; j += 8) {  // 8 int8 -> 8 int32 -> 8 float, times the scale
          const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j));
          _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), vs));
        }
      }
#endif
      for (; j < g0 + group; ++j) dst[j] = static_cast<A>(static_cast<float>(src[j]) * s);
    }
  } else {
    const float* table = fp8_table();
    for (int64_t g0 = 0; g0 < D; g0 += group) {
      const float s = scales[g0 / group];
      for (int64_t j = g0; j < g0 + group; ++j) dst[j] = static_cast<A>(table[src[j].x] * s);
    }
  }
}

// dst[0:D], scales[0:D / group] = x quantized per group (see the top of this file).
template <typename scalar_t, typename cache_t>
inline void quantize_row(const scalar_t* x, int64_t group, int64_t D, cache_t* dst, float* scales) {
  constexpr float qmax = kQMax<cache_t>;
  for (int64_t g0 = 0; g0 < D; g0 += group) {
    float amax = 0.0f;
    for (int64_t j = g0; j < g0 + group; ++j) amax = std::max(amax, std::abs(static_cast<float>(x[j])));
    const float scale = amax / qmax;
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    scales[g0 / group] = scale;
    for (int64_t j = g0; j < g0 + group; ++j) {
      float y = static_cast<float>(x[j]) * inv;
      if constexpr (std::is_same_v<cache_t, int8_t>) y = std::nearbyint(y);
      y = std::min(qmax, std::max(-qmax, y));
      dst[j] = static_cast<cache_t>(y);
    }
  }
}

// First position the token at position p sees (p - window + 1 does not overflow: p >= 0).
inline int64_t window_start(int64_t p, int64_t window) { return std::max<int64_t>(0, p - window + 1); }

// Where one (sequence, position) of one layer lives in kv_blocks.
struct Geometry {
  bool paged;
  int64_t num_rows;  // pages (paged) or slots (continuous): kv_blocks.size(0)
  int64_t rows_per_page;  // page_size (paged) or max_seq_len (continuous): kv_blocks.size(3)
  int64_t lut_cols;  // max_num_pages (paged) or 1
  int64_t hkv, d;
  int64_t stride_page, stride_kv, stride_layer, stride_slot;

  Geometry(const at::Tensor& blocks, const at::Tensor& lookup)
      : paged(lookup.dim() == 2),
        num_rows(blocks.size(0)),
        rows_per_page(blocks.size(3)),
        lut_cols(lookup.dim() == 2 ? lookup.size(1) : 1),
        hkv(blocks.size(4)),
        d(blocks.size(5)),
        stride_page(blocks.stride(0)),
        stride_kv(blocks.stride(1)),
        stride_layer(blocks.stride(2)),
        stride_slot(blocks.stride(3)) {}

  // Offset of row (sequence b, position pos, 0 = key / 1 = value, layer, head 0).
  int64_t offset(const int32_t* lut, int64_t b, int64_t pos, int64_t kv, int64_t layer) const {
    int64_t page = paged ? lut[b * lut_cols + pos / rows_per_page] : lut[b];
    int64_t slot = paged ? pos % rows_per_page : pos;
    return page * stride_page + kv * stride_kv + layer * stride_layer + slot * stride_slot;
  }

  // First position past the page holding pos (continuous: one page of max_seq_len rows).
  int64_t page_end(int64_t pos) const { return (pos / rows_per_page + 1) * rows_per_page; }
};

// Where a quantized cache's scales live: kv_scales' geometry (its d is the scales per head) and the
// elements per scale; data is null for an unquantized cache.
struct ScaleView {
  float* data;
  Geometry g;
  int64_t group;

  // Scales of row (sequence b, position pos, kv, layer, head h).
  float* row(const int32_t* lut, int64_t b, int64_t pos, int64_t kv, int64_t layer, int64_t h) const {
    return data + g.offset(lut, b, pos, kv, layer) + h * g.d;
  }
};

std::string format_list(const int32_t* xs, int64_t n) {
  std::ostringstream out;
  out << "[";
  for (int64_t i = 0; i < n; ++i) out << (i ? ", " : "") << xs[i];
  out << "]";
  return out.str();
}

// The index tensors' values against the cache; messages as kvgraph.ops.checks.check_values.
// Runs before anything is written, so a bad call leaves the cache as it was.
void check_values(const Geometry& g, const int32_t* offs, const int32_t* cl, const int32_t* lut,
                  const int32_t* max_lengths, int64_t batch, int64_t num_tokens) {
  TORCH_CHECK_VALUE(offs[0] == 0 && offs[batch] == num_tokens,
                    "input_row_offsets must run from 0 to the token count ", num_tokens, ", got ",
                    offs[0], "..", offs[batch]);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(offs[b + 1] >= offs[b], "input_row_offsets decreases at sequence ", b, ": ",
                      offs[b], " -> ", offs[b + 1]);
  }
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(cl[b] >= 0, "cache_lengths must be >= 0, got ", format_list(cl, batch));
  }
  if (batch == 0) return;
  int64_t max_new = 0, max_total = 0, arg_total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t total = int64_t{cl[b]} + offs[b + 1] - offs[b];
    max_new = std::max<int64_t>(max_new, offs[b + 1] - offs[b]);
    if (total > max_total) max_total = total, arg_total = b;
  }
  TORCH_CHECK_VALUE(max_new <= max_lengths[0] && max_total <= max_lengths[1], "max_lengths[0] = [",
                    max_lengths[0], ", ", max_lengths[1],
                    "] is below the batch's [max new tokens, max cached + new] = [", max_new, ", ",
                    max_total, "]");
  if (!g.paged) {
    TORCH_CHECK_VALUE(max_total <= g.rows_per_page, "sequence ", arg_total, " reaches ", max_total,
                      " tokens, past max_seq_len ", g.rows_per_page);
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK_VALUE(lut[b] >= 0 && lut[b] < g.num_rows, "lookup_table[", b, "] = ", lut[b],
                        " is not a slot in [0, ", g.num_rows, ")");
    }
    return;
  }
  int64_t max_pages = (max_total + g.rows_per_page - 1) / g.rows_per_page;
  TORCH_CHECK_VALUE(max_pages <= g.lut_cols, "sequence ", arg_total, " needs ", max_pages,
                    " pages for ", max_total, " tokens, but lookup_table has ", g.lut_cols,
                    " columns");
  for (int64_t b = 0; b < batch; ++b) {
    int64_t total = int64_t{cl[b]} + offs[b + 1] - offs[b];
    int64_t pages = (total + g.rows_per_page - 1) / g.rows_per_page;
    for (int64_t p = 0; p < pages; ++p) {
      int32_t page = lut[b * g.lut_cols + p];
      TORCH_CHECK_VALUE(page >= 0 && page < g.num_rows, "lookup_table[", b, ", ", p, "] = ", page,
                        " is not a page in [0, ", g.num_rows, ")");
    }
  }
}

// -- store: token t of sequence b goes to position cache_lengths[b] + (t - offsets[b]) --
//    (a quantized cache: each head's row quantized, its scales beside it)
template <typename scalar_t, typename cache_t>
void store_new_tokens(const at::Tensor& x, int64_t kv, cache_t* blocks, const Geometry& g, const ScaleView& sv,
                      const std::vector<int32_t>& seq_of_token, const int32_t* offs,
                      const int32_t* cl, const int32_t* lut, int64_t layer) {
  const scalar_t* src = x.const_data_ptr<scalar_t>();
  const int64_t st = x.stride(0), sh = x.stride(1), T = x.size(0);
  at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      int64_t b = seq_of_token[t];
      int64_t pos = int64_t{cl[b]} + t - offs[b];
      cache_t* dst = blocks + g.offset(lut, b, pos, kv, layer);
      for (int64_t h = 0; h < g.hkv; ++h) {
        if constexpr (kQuantized<cache_t>) {
          quantize_row(src + t * st + h * sh, sv.group, g.d, dst + h * g.d, sv.row(lut, b, pos, kv, layer, h));
        } else {
          std::copy_n(src + t * st + h * sh, g.d, dst + h * g.d);
        }
      }
    }
  });
}

template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  Vec acc0(T(0)), acc1(T(0));
  int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    acc0 = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc0);
    acc1 = at::vec::fmadd(Vec::loadu(a + i + W), Vec::loadu(b + i + W), acc1);
  }
  if (i + W <= n) {
    acc0 = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc0);
    i += W;
  }
  T sum = at::vec::vec_reduce_all<T>([](Vec& x, Vec& y) { return x + y; }, acc0 + acc1);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

#if defined(__AVX2__) && defined(__FMA__)
// out[i] = q . k[i * ld] for 8 keys: eight independent FMA chains, one transpose-sum at the end.
inline void dot8(const float* q, const float* k, int64_t ld, int64_t D, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + d), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + ld + d), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * ld + d), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * ld + d), a3);
    a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 4 * ld + d), a4);
    a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 5 * ld + d), a5);
    a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 6 * ld + d), a6);
    a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 7 * ld + d), a7);
  }
  // lanes of hadd(hadd(a0, a1), hadd(a2, a3)): [a0..a3 over lanes 0-3 | a0..a3 over lanes 4-7]
  const __m256 s03 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 s47 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(s03, s47, 0x20),
                                      _mm256_permute2f128_ps(s03, s47, 0x31)));
  for (; d < D; ++d) {
    for (int64_t i = 0; i < 8; ++i) out[i] += q[d] * k[i * ld + d];
  }
}
#endif

// out[j] = q . k[j * ld] for j < n.
template <typename T>
inline void dots(const T* q, const T* k, int64_t ld, int64_t D, int64_t n, T* out) {
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    for (; j + 8 <= n; j += 8) dot8(q, k + j * ld, ld, D, out + j);
  }
#endif
  for (; j < n; ++j) out[j] = dot(q, k + j * ld, D);
}

// acc[0:D] = acc * alpha + sum_j p[j] * v[j * ld], the row held in registers kChunks vectors at a time.
template <typename T>
inline void accumulate(T* acc, T alpha, const T* p, const T* v, int64_t ld, int64_t D, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  constexpr int64_t kChunks = 64 / W > 0 ? 64 / W : 1;
  int64_t d = 0;
  for (; d + kChunks * W <= D; d += kChunks * W) {
    Vec a[kChunks];
    for (int64_t c = 0; c < kChunks; ++c) a[c] = Vec::loadu(acc + d + c * W) * Vec(alpha);
    for (int64_t j = 0; j < n; ++j) {
      const Vec pj(p[j]);
      const T* vj = v + j * ld + d;
      for (int64_t c = 0; c < kChunks; ++c) a[c] = at::vec::fmadd(pj, Vec::loadu(vj + c * W), a[c]);
    }
    for (int64_t c = 0; c < kChunks; ++c) a[c].store(acc + d + c * W);
  }
  for (; d + W <= D; d += W) {
    // a short row: four keys in flight, so the FMAs do not wait on each other
    Vec a0 = Vec::loadu(acc + d) * Vec(alpha), a1(T(0)), a2(T(0)), a3(T(0));
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      const T* vj = v + j * ld + d;
      a0 = at::vec::fmadd(Vec(p[j]), Vec::loadu(vj), a0);
      a1 = at::vec::fmadd(Vec(p[j + 1]), Vec::loadu(vj + ld), a1);
      a2 = at::vec::fmadd(Vec(p[j + 2]), Vec::loadu(vj + 2 * ld), a2);
      a3 = at::vec::fmadd(Vec(p[j + 3]), Vec::loadu(vj + 3 * ld), a3);
    }
    for (; j < n; ++j) a0 = at::vec::fmadd(Vec(p[j]), Vec::loadu(v + j * ld + d), a0);
    ((a0 + a1) + (a2 + a3)).store(acc + d);
  }
  for (; d < D; ++d) {
    T a = acc[d] * alpha;
    for (int64_t j = 0; j < n; ++j) a += p[j] * v[j * ld + d];
    acc[d] = a;
  }
}

// max of x[0:n], n >= 1.
template <typename T>
inline T max_of(const T* x, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  T out = x[0];
  int64_t i = 0;
  if (n >= W) {
    Vec mx = Vec::loadu(x);
    for (i = W; i + W <= n; i += W) mx = at::vec::maximum(mx, Vec::loadu(x + i));
    out = at::vec::vec_reduce_all<T>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, mx);
  }
  for (; i < n; ++i) out = std::max(out, x[i]);
  return out;
}

// x[0:n] = exp(x - m); returns their sum.
template <typename T>
inline T exp_and_sum(T* x, T m, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec vm(m);
  Vec total(T(0));
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const Vec e = (Vec::loadu(x + i) - vm).exp_u20();
    e.store(x + i);
    total = total + e;
  }
  T sum = at::vec::vec_reduce_all<T>([](Vec& a, Vec& b) { return a + b; }, total);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    sum += x[i];
  }
  return sum;
}

// x[0:n] = c * tanh(x / c), the soft cap of the scores x.
template <typename T>
inline void soft_cap(T* x, T c, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const T inv = T(1) / c;
  const Vec vc(c), vinv(inv);
  int64_t i = 0;
  for (; i + W <= n; i += W) ((Vec::loadu(x + i) * vinv).tanh() * vc).store(x + i);
  for (; i < n; ++i) x[i] = c * std::tanh(x[i] * inv);
}

struct WorkItem {
  int64_t b, s0, s1;  // sequence, its new tokens [s0, s1)
};

// One new token: rows are the G query heads of kv head h, all seeing positions [kv_begin, kv_end).
// Softmax in two passes over the whole context (every score first, then one max and one exp pass,
// then V), so nothing is rescaled per tile: a decode step's per-tile work is just the dot products
// and the V accumulation.
template <typename cache_t, typename A>
void attend_one_token(const A* qf, int64_t rows, A* acc, A* l, std::vector<A>& scores, A* kf, A* vf,
                      const cache_t* blocks, const Geometry& g, const ScaleView& sv, const int32_t* lut,
                      int64_t b, int64_t h, int64_t layer, int64_t kv_begin, int64_t kv_end, A softcap) {
  constexpr bool kConvert = !std::is_same_v<cache_t, A>;
  const int64_t D = g.d, n_ctx = kv_end - kv_begin;
  if (static_cast<int64_t>(scores.size()) < rows * n_ctx) scores.resize(rows * n_ctx);
  // runs of consecutive positions in one page (at most kKeyTile when converting into kf / vf)
  auto run_end = [&](int64_t pos) {
    return std::min({kv_end, g.page_end(pos), kConvert ? pos + kKeyTile : kv_end});
  };
  auto rows_of = [&](int64_t pos, int64_t n, int64_t kv, A* buf, int64_t& ld) -> const A* {
    const cache_t* src = blocks + g.offset(lut, b, pos, kv, layer) + h * D;
    if constexpr (kQuantized<cache_t>) {
      const float* sc = sv.row(lut, b, pos, kv, layer, h);
      for (int64_t j = 0; j < n; ++j) {
        dequantize_row(src + j * g.stride_slot, sc + j * sv.g.stride_slot, sv.group, D, buf + j * D);
      }
      ld = D;
      return buf;
    } else if constexpr (kConvert) {
      for (int64_t j = 0; j < n; ++j) at::vec::convert(src + j * g.stride_slot, buf + j * D, D);
      ld = D;
      return buf;
    } else {
      ld = g.stride_slot;
      return src;
    }
  };
  // The first head of a sequence asks for each run's rows of every head (contiguous: a row holds
  // the heads side by side) one run ahead: the thread then takes the sequence's other heads, which
  // find them in cache. The rows of a decode step lie in pages scattered over the pool, one read
  // each, and the hardware prefetcher does not follow the jump from one page to the next.
  auto prefetch_run = [&](int64_t pos, int64_t kv) {
    if (h != 0 || pos >= kv_end) return;
    const int64_t n = run_end(pos) - pos;
    const char* src = reinterpret_cast<const char*>(blocks + g.offset(lut, b, pos, kv, layer));
    const int64_t span = g.hkv * D * static_cast<int64_t>(sizeof(cache_t));
    const int64_t stride = g.stride_slot * static_cast<int64_t>(sizeof(cache_t));
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t c = 0; c < span; c += 64) __builtin_prefetch(src + j * stride + c, 0, 2);
    }
  };
  prefetch_run(kv_begin, 0);
  // -- pass 1: every score, page by page (scores[r * n_ctx + j] is position kv_begin + j) --
  for (int64_t pos = kv_begin; pos < kv_end;) {
    const int64_t n = run_end(pos) - pos;
    prefetch_run(pos + n, 0);
    int64_t ld;
    const A* kt = rows_of(pos, n, 0, kf, ld);
    A* const sc = scores.data() + pos - kv_begin;
    for (int64_t r = 0; r < rows; ++r) dots(qf + r * D, kt, ld, D, n, sc + r * n_ctx);
    pos += n;
  }
  prefetch_run(kv_begin, 1);
  // -- pass 2: softmax numerators and their sums (of the capped scores: every key is visible) --
  for (int64_t r = 0; r < rows; ++r) {
    A* sr = scores.data() + r * n_ctx;
    if (softcap > 0) soft_cap(sr, softcap, n_ctx);
    l[r] = exp_and_sum(sr, max_of(sr, n_ctx), n_ctx);
  }
  // -- pass 3: acc = sum_j p_j v_j, page by page --
  for (int64_t pos = kv_begin; pos < kv_end;) {
    const int64_t n = run_end(pos) - pos;
    prefetch_run(pos + n, 1);
    int64_t ld;
    const A* vt = rows_of(pos, n, 1, vf, ld);
    const A* const sc = scores.data() + pos - kv_begin;
    for (int64_t r = 0; r < rows; ++r) accumulate(acc + r * D, A(1), sc + r * n_ctx, vt, ld, D, n);
    pos += n;
  }
}

// Several new tokens: rows are (token s0 + r / G, query head of the group). Flash-style online
// softmax over tiles of up to kKeyTile keys of [kv_begin, kv_end); a row skips the tiles past its
// causal limit or before its window, and masks the keys before its window in the tile across it.
template <typename cache_t, typename A>
void attend_block(const A* qf, int64_t rows, int64_t G, A* acc, A* m, A* l, A* scores, A* kf, A* vf,
                  const cache_t* blocks, const Geometry& g, const ScaleView& sv, const int32_t* lut, int64_t b,
                  int64_t h, int64_t layer, int64_t cached, int64_t s0, int64_t kv_begin, int64_t kv_end,
                  int64_t window, A softcap) {
  constexpr bool kConvert = !std::is_same_v<cache_t, A>;
  const int64_t D = g.d;
  for (int64_t pos = kv_begin; pos < kv_end;) {
    // -- one tile of up to kKeyTile keys: fp32 pages are read in place (one page per tile) when
    //    the item has few rows or the page is long; otherwise the tile is gathered page by page
    //    (and converted from bf16/fp16, or dequantized) into a contiguous buffer, so per-tile work
    //    is amortized --
    const bool in_place = !kConvert && (rows < kGatherRows || g.page_end(pos) >= pos + kKeyTile);
    const int64_t n = std::min({kv_end, pos + kKeyTile, in_place ? g.page_end(pos) : kv_end}) - pos;
    const A* kt;
    const A* vt;
    int64_t ld;
    if (in_place) {
      kt = reinterpret_cast<const A*>(blocks + g.offset(lut, b, pos, 0, layer) + h * D);
      vt = reinterpret_cast<const A*>(blocks + g.offset(lut, b, pos, 1, layer) + h * D);
      ld = g.stride_slot;
    } else {
      for (int64_t j = 0; j < n;) {
        const int64_t run = std::min(n, g.page_end(pos + j) - pos) - j;  // rows left in this page
        const cache_t* k_row = blocks + g.offset(lut, b, pos + j, 0, layer) + h * D;
        const cache_t* v_row = blocks + g.offset(lut, b, pos + j, 1, layer) + h * D;
        if constexpr (kQuantized<cache_t>) {
          const float* k_sc = sv.row(lut, b, pos + j, 0, layer, h);
          const float* v_sc = sv.row(lut, b, pos + j, 1, layer, h);
          for (int64_t i = 0; i < run; ++i, ++j) {
            dequantize_row(k_row + i * g.stride_slot, k_sc + i * sv.g.stride_slot, sv.group, D, kf + j * D);
            dequantize_row(v_row + i * g.stride_slot, v_sc + i * sv.g.stride_slot, sv.group, D, vf + j * D);
          }
        } else {
          for (int64_t i = 0; i < run; ++i, ++j) {
            at::vec::convert(k_row + i * g.stride_slot, kf + j * D, D);
            at::vec::convert(v_row + i * g.stride_slot, vf + j * D, D);
          }
        }
      }
      kt = kf, vt = vf, ld = D;
    }
    for (int64_t r = 0; r < rows; ++r) {
      // row r sees positions [window_start(p), p], p = cached + s: tile keys [0, visible) reach up
      // to p, the first `hidden` of them lie before its window. Skip the tile if none is left;
      // else score from the tile start and mask the hidden keys (fewer than kQueryBlock): K/V
      // pointers that differ per row would cost the causal path a few percent
      const int64_t p = cached + s0 + r / G;
      const int64_t visible = std::min(n, p + 1 - pos);
      const int64_t hidden = std::max<int64_t>(0, window_start(p, window) - pos);
      if (visible <= hidden) continue;
      A* sr = scores;
      dots(qf + r * D, kt, ld, D, visible, sr);
      if (softcap > 0) soft_cap(sr + hidden, softcap, visible - hidden);  // the masked keys stay -inf
      if (hidden > 0) std::fill_n(sr, hidden, -std::numeric_limits<A>::infinity());
      const A tile_max = max_of(sr, visible);
      // -- online softmax: rescale what was accumulated to the new running max --
      const A m_new = std::max(m[r], tile_max);
      const A alpha = std::exp(m[r] - m_new);
      const A tile_sum = exp_and_sum(sr, m_new, visible);
      accumulate(acc + r * D, alpha, sr, vt, ld, D, visible);
      l[r] = l[r] * alpha + tile_sum;
      m[r] = m_new;
    }
    pos += n;
  }
}

// -- attend: rows (s, g) of kv head h over positions [window_start(p), p], p = cache_lengths[b] + s --
template <typename scalar_t, typename cache_t>
void attend(const at::Tensor& q, at::Tensor& out, const cache_t* blocks, const Geometry& g, const ScaleView& sv,
            const std::vector<WorkItem>& items, const int32_t* offs, const int32_t* cl,
            const int32_t* lut, int64_t layer, double scale, int64_t window, double softcap) {
  using A = acc_t<scalar_t>;
  const int64_t hq = q.size(1), D = g.d, G = hq / g.hkv;
  const scalar_t* qp = q.const_data_ptr<scalar_t>();
  const int64_t sq_t = q.stride(0), sq_h = q.stride(1);
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  const int64_t rows_max = kQueryBlock * G;
  const int64_t n_items = static_cast<int64_t>(items.size()) * g.hkv;

  // -- the items, costliest first (keys read, summed over the rows), handed out one at a time:
  //    causal blocks late in a long prompt cost many times the early ones, and an even split by
  //    count would leave one thread with most of the work --
  std::vector<int64_t> cost(items.size()), order(n_items);
  for (size_t j = 0; j < items.size(); ++j) {
    const WorkItem& it = items[j];
    const int64_t cached = cl[it.b];
    cost[j] = 0;
    for (int64_t p = cached + it.s0; p < cached + it.s1; ++p) cost[j] += p + 1 - window_start(p, window);
  }
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return cost[x / g.hkv] > cost[y / g.hkv]; });
  std::atomic<int64_t> next{0};
  const int64_t n_workers = std::min<int64_t>(at::get_num_threads(), n_items);
  const int64_t chunk = static_cast<int64_t>(items.size()) >= 4 * n_workers ? g.hkv : 1;

  at::parallel_for(0, n_workers, 1, [&](int64_t, int64_t) {
    // per-thread scratch: queries (pre-scaled), accumulators, running max and sum, scores,
    // and one K and one V tile gathered from its pages in the accumulation type
    std::vector<A> qf(rows_max * D), acc(rows_max * D), m(rows_max), l(rows_max),
        scores(kKeyTile), kf(kKeyTile * D), vf(kKeyTile * D), context_scores;
    // with items enough to share out, a thread takes all kv heads of an item at once (they cost the
    // same, so the sort keeps them together, head 0 first): they read the same rows, which head 0
    // brings into cache
    for (int64_t first = next.fetch_add(chunk, std::memory_order_relaxed); first < n_items;
         first = next.fetch_add(chunk, std::memory_order_relaxed))
    for (int64_t n = first; n < first + chunk; ++n) {
      const int64_t i = order[n];
      const WorkItem& item = items[i / g.hkv];
      const int64_t h = i % g.hkv, b = item.b, cached = cl[b];
      const int64_t rows = (item.s1 - item.s0) * G;
      // -- load the rows' queries: row r = (s - s0) * G + gi reads query head h * G + gi --
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = offs[b] + item.s0 + r / G, head = h * G + r % G;
        const scalar_t* src = qp + t * sq_t + head * sq_h;
        for (int64_t j = 0; j < D; ++j) qf[r * D + j] = static_cast<A>(src[j]) * static_cast<A>(scale);
      }
      std::fill_n(acc.begin(), rows * D, A(0));
      std::fill_n(m.begin(), rows, -std::numeric_limits<A>::infinity());
      std::fill_n(l.begin(), rows, A(0));
      // the block's tokens see positions in [kv_begin, kv_end): from its first token's window
      // start to its last token
      const int64_t kv_begin = window_start(cached + item.s0, window), kv_end = cached + item.s1;
      if (item.s1 - item.s0 == 1) {
        attend_one_token(qf.data(), rows, acc.data(), l.data(), context_scores, kf.data(), vf.data(), blocks, g,
                         sv, lut, b, h, layer, kv_begin, kv_end, static_cast<A>(softcap));
      } else {
        attend_block(qf.data(), rows, G, acc.data(), m.data(), l.data(), scores.data(), kf.data(), vf.data(),
                     blocks, g, sv, lut, b, h, layer, cached, item.s0, kv_begin, kv_end, window,
                     static_cast<A>(softcap));
      }
      // -- write out: every row saw at least its own token, so l > 0 --
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = offs[b] + item.s0 + r / G, head = h * G + r % G;
        scalar_t* dst = op + (t * hq + head) * D;
        const A inv = A(1) / l[r];
        for (int64_t j = 0; j < D; ++j) dst[j] = static_cast<scalar_t>(acc[r * D + j] * inv);
      }
    }
  });
}

at::Tensor ragged_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                            at::Tensor& kv_blocks, const at::Tensor& cache_lengths,
                            const at::Tensor& lookup_table, const at::Tensor& input_row_offsets,
                            const at::Tensor& max_lengths, int64_t layer_idx,
                            std::optional<double> scale, std::optional<int64_t> sliding_window,
                            std::optional<double> softcap, const std::optional<at::Tensor>& kv_scales) {
  // shapes, dtypes and devices are checked by the caller (kvgraph.ops.checks.check_inputs)
  TORCH_CHECK_VALUE(!sliding_window.has_value() || *sliding_window >= 1,
                    "sliding_window must be a positive int (keys seen, itself included) or None, got ",
                    *sliding_window);
  TORCH_CHECK_VALUE(!softcap.has_value() || (std::isfinite(*softcap) && *softcap > 0),
                    "softcap must be a finite positive float or None, got ", *softcap);
  TORCH_CHECK_VALUE(kv_blocks.is_contiguous(), "kv_blocks must be contiguous, got strides ",
                    kv_blocks.strides());
  TORCH_CHECK_VALUE(!kv_scales.has_value() || kv_scales->is_contiguous(), "kv_scales must be contiguous");
  auto rows_contiguous = [](const at::Tensor& x) { return x.stride(2) == 1 ? x : x.contiguous(); };
  const at::Tensor q = rows_contiguous(q_in), k = rows_contiguous(k_in), v = rows_contiguous(v_in);
  const at::Tensor offs_t = input_row_offsets.contiguous(), cl_t = cache_lengths.contiguous(),
                   lut_t = lookup_table.contiguous(), ml_t = max_lengths.contiguous();
  const int32_t* offs = offs_t.const_data_ptr<int32_t>();
  const int32_t* cl = cl_t.const_data_ptr<int32_t>();
  const int32_t* lut = lut_t.const_data_ptr<int32_t>();
  const int64_t batch = cl_t.size(0), T = q.size(0), D = q.size(2);
  const Geometry g(kv_blocks, lut_t);
  check_values(g, offs, cl, lut, ml_t.const_data_ptr<int32_t>(), batch, T);

  std::vector<int32_t> seq_of_token(T);
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < batch; ++b) {
    std::fill(seq_of_token.begin() + offs[b], seq_of_token.begin() + offs[b + 1], static_cast<int32_t>(b));
    for (int64_t s0 = 0; s0 < offs[b + 1] - offs[b]; s0 += kQueryBlock) {
      items.push_back({b, s0, std::min<int64_t>(s0 + kQueryBlock, offs[b + 1] - offs[b])});
    }
  }
  at::Tensor out = at::empty({T, q.size(1), D}, q.options());
  const double softmax_scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(D));
  const ScaleView sv = kv_scales.has_value()
                           ? ScaleView{kv_scales->mutable_data_ptr<float>(), Geometry(*kv_scales, lut_t),
                                       D / kv_scales->size(5)}
                           : ScaleView{nullptr, g, D};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "kvgraph_ragged_attention", [&] {
    auto run = [&](auto* blocks) {
      store_new_tokens<scalar_t>(k, 0, blocks, g, sv, seq_of_token, offs, cl, lut, layer_idx);
      store_new_tokens<scalar_t>(v, 1, blocks, g, sv, seq_of_token, offs, cl, lut, layer_idx);
      attend<scalar_t>(q, out, blocks, g, sv, items, offs, cl, lut, layer_idx, softmax_scale,
                       sliding_window.value_or(kNoWindow), softcap.value_or(0.0));
    };
    if (!kv_scales.has_value()) {
      run(kv_blocks.mutable_data_ptr<scalar_t>());
    } else if (kv_blocks.scalar_type() == at::kChar) {
      run(kv_blocks.mutable_data_ptr<int8_t>());
    } else {
      TORCH_CHECK_VALUE(kv_blocks.scalar_type() == at::kFloat8_e4m3fn,
                        "a quantized kv_blocks must be int8 or float8_e4m3fn, got ", kv_blocks.scalar_type());
      run(kv_blocks.mutable_data_ptr<c10::Float8_e4m3fn>());
    }
  });
  return out;
}

}  // namespace
}  // namespace kvgraph

// The schema is kvgraph.ops.schema.SCHEMA, defined from Python (kvgraph/ops/cpp.py) before this
// library is loaded; here only the CPU implementation is registered.
TORCH_LIBRARY_IMPL(kvgraph_cpu, CPU, m) { m.impl("ragged_attention", &kvgraph::ragged_attention); }
