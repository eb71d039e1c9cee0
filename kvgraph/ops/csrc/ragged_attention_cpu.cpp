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
// copy of the context is ever made; except a decode step over an int8 cache, which reads the int8
// rows in place: with AVX-512 VNNI (scores_int8 and accumulate_int8 here), else with AVX2
// (csrc/int8_decode_avx2.h). KVGRAPH_INT8_DECODE picks a slower path (see Int8Path).

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
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "int8_decode_avx2.h"
#include "int8_parts.h"
#include "prefill_tiles_avx2.h"

namespace kvgraph {
namespace {

constexpr int64_t kQueryBlock = 16;  // new tokens per work item
constexpr int64_t kKeyTile = 64;     // keys per tile
constexpr int64_t kGatherRows = 16;  // fp32 items with fewer rows read short pages in place
constexpr int64_t kPrefetchKeys = 64;  // a decode pass asks for its K or V rows this many positions ahead

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
  int page_shift;  // log2(rows_per_page) when it is a power of two, else -1

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
        stride_slot(blocks.stride(3)),
        page_shift(rows_per_page > 0 && (rows_per_page & (rows_per_page - 1)) == 0 ? __builtin_ctzll(rows_per_page) : -1) {}

  // pos / rows_per_page and pos % rows_per_page, by a shift and a mask for a power-of-two page
  // (every paged cache kvgraph makes): the decode passes ask for them once per run of keys.
  int64_t page_of(int64_t pos) const { return page_shift >= 0 ? pos >> page_shift : pos / rows_per_page; }
  int64_t slot_of(int64_t pos) const { return page_shift >= 0 ? pos & (rows_per_page - 1) : pos % rows_per_page; }

  // Offset of row (sequence b, position pos, 0 = key / 1 = value, layer, head 0).
  int64_t offset(const int32_t* lut, int64_t b, int64_t pos, int64_t kv, int64_t layer) const {
    int64_t page = paged ? lut[b * lut_cols + page_of(pos)] : lut[b];
    int64_t slot = paged ? slot_of(pos) : pos;
    return page * stride_page + kv * stride_kv + layer * stride_layer + slot * stride_slot;
  }

  // First position past the page holding pos (continuous: one page of max_seq_len rows).
  int64_t page_end(int64_t pos) const { return (page_of(pos) + 1) * rows_per_page; }
};

// How a decode step reads an int8 cache (KVGRAPH_INT8_DECODE, read at every call): kAuto the fastest
// path this CPU has (AVX-512 VNNI, else AVX2), kAvx2 never VNNI, kTiles rows dequantized into the
// tile buffer (the fp8 cache's path). A CPU without a path takes the next one down.
enum class Int8Path { kAuto, kAvx2, kTiles };

Int8Path int8_path() {
  const char* env = std::getenv("KVGRAPH_INT8_DECODE");
  const std::string value = env ? env : "";
  if (value.empty() || value == "auto") return Int8Path::kAuto;
  if (value == "avx2") return Int8Path::kAvx2;
  TORCH_CHECK_VALUE(value == "tiles", "KVGRAPH_INT8_DECODE=", value, " is not one of auto, avx2, tiles");
  return Int8Path::kTiles;
}

// How a prompt's tiles are computed (KVGRAPH_PREFILL_TILES, read at every call): "auto" (or unset)
// every row of an item at once as two small products where csrc/prefill_tiles_avx2.h applies,
// "rows" one query row at a time against the tile (the path before it, kept for the rest).
bool prefill_tiles() {
  const char* env = std::getenv("KVGRAPH_PREFILL_TILES");
  const std::string value = env ? env : "";
  if (value.empty() || value == "auto") return true;
  TORCH_CHECK_VALUE(value == "rows", "KVGRAPH_PREFILL_TILES=", value, " is not one of auto, rows");
  return false;
}

// A thread's scratch for a prompt's tiles: packed queries, S^T, and each row's rescale factor.
template <typename A>
struct Tiles {
  bool on;
  A* qt;
  A* st;
  A* alpha;
};

// Where a quantized cache's scales live: kv_scales' geometry (its d is the scales per head) and the
// elements per scale; data is null for an unquantized cache. int8_path: how a decode step reads it.
struct ScaleView {
  float* data;
  Geometry g;
  int64_t group;
  Int8Path int8_path = Int8Path::kAuto;

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

// -- int8 decode with AVX-512 VNNI: QK^T in int32, V dequantized inside the PV accumulation --
// A decode item's G query rows share every K/V row, so a run of up to 16 keys of one page is
// transposed once (lane i = key i, one dword = 4 head-dim bytes per vector) and each row's scores
// come out of VPDPBUSD with its query broadcast 4 bytes at a time, no horizontal sums. VPDPBUSD
// multiplies u8 by s8, so K is read as k + 128 (x ^ 0x80) and 128 * sum(q) taken off per group.
// The query is split exactly enough for an fp32 result: x / sq = h + m / 254 + l / 254^2 with h, m,
// l int8 (sq = max|x| / 127), an error below 2^-23 of max|x|, so the scores match the dequantized
// cache's to fp32 rounding. V rows are converted and scaled in registers and go straight into
// the accumulators of up to 4 rows, never through a tile buffer.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__GNUC__)
#define KVGRAPH_INT8_VNNI 1
#define KVGRAPH_VNNI_TARGET __attribute__((target("avx512vnni")))

using int8_parts::has_vnni;
constexpr int64_t kQParts = int8_parts::kParts;  // int8 parts of a query: h, m, l (csrc/int8_parts.h)
constexpr float kQRadix = static_cast<float>(int8_parts::kRadix);

// A thread's int8 decode state, prepared once per item: the item's queries split for VPDPBUSD,
// the layout of a row's groups over the 16-lane chunks of D, and the scratch of a run's transposed K
// and scales.
struct Int8Decode {
  int64_t rows = 0, D = 0, group = 0;
  std::vector<int8_t> parts;  // [rows, kQParts, D]
  std::vector<int32_t> offset;  // [rows, kQParts, D / group]: 128 * the part's sum over the group
  std::vector<float> scale;  // [rows]: sq
  std::vector<double> rest;  // [2, D]: what the parts so far leave of a query row, and the next part
  std::vector<int32_t> kt;  // [D / 4 padded to 16, 16]: a run's K, kt[w, i] = dword w of key i (as u8)
  std::vector<float> kscale;  // [D / group, 16]: a run's K scales, kscale[g, i] of key i
  // per 16-lane chunk c of D: its lanes in D, and its groups: the first, how many it spans, and
  // each lane's group from the first
  std::vector<__mmask16> lanes, spanned;
  std::vector<int64_t> first_group;
  std::vector<int32_t> group_of;  // [chunks, 16]

  // Split the rows x D queries qf (pre-scaled) of an item whose cache has `group` elements per scale.
  void prepare(const float* qf, int64_t rows_, int64_t D_, int64_t group_) {
    if (D_ != D || group_ != group) layout(D_, group_);
    rows = rows_;
    parts.resize(rows * kQParts * D);
    offset.assign(rows * kQParts * (D / group), 0);
    scale.resize(rows);
    for (int64_t r = 0; r < rows; ++r) {
      const float* x = qf + r * D;
      __m512 mx = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes[d / 16], x + d)));
      }
      const float amax = _mm512_reduce_max_ps(mx);
      scale[r] = amax / 127.0f;
      const double inv = amax > 0.0f ? 127.0 / amax : 0.0;
      for (int64_t d = 0; d < D; ++d) rest[d] = x[d] * inv;  // in [-127, 127]
      int8_parts::split(rest.data(), rest.data() + D, D, parts.data() + r * kQParts * D, D);
      for (int64_t k = 0; k < kQParts; ++k) {
        const int8_t* part = parts.data() + (r * kQParts + k) * D;
        int32_t* off = offset.data() + (r * kQParts + k) * (D / group);
        for (int64_t gi = 0; gi < D / group; ++gi) {
          int32_t sum = 0;
          for (int64_t d = gi * group; d < (gi + 1) * group; ++d) sum += part[d];
          off[gi] = 128 * sum;
        }
      }
    }
  }

 private:
  void layout(int64_t D_, int64_t group_) {
    D = D_, group = group_;
    rest.resize(2 * D);
    kt.resize((D + 63) / 64 * 16 * 16);
    kscale.resize(D / group * 16);
    lanes.clear(), spanned.clear(), first_group.clear(), group_of.clear();
    for (int64_t first = 0; first < D; first += 16) {
      const int64_t left = std::min<int64_t>(16, D - first);
      lanes.push_back(static_cast<__mmask16>((1u << left) - 1));
      first_group.push_back(first / group);
      spanned.push_back(static_cast<__mmask16>((1u << ((first + left - 1) / group - first / group + 1)) - 1));
      for (int64_t i = 0; i < 16; ++i) group_of.push_back(static_cast<int32_t>((first + i) / group - first / group));
    }
  }
};

// The calling thread's Int8Decode, reused by its items. Not inlined: the caller then holds a plain
// pointer, not a thread-local address the compiler may look up again in every loop.
__attribute__((noinline)) Int8Decode& int8_state() {
  thread_local Int8Decode st;
  return st;
}

// rows[w] lane i = dword w of rows[i] (a 16 x 16 transpose of 32-bit elements).
inline void transpose16_epi32(__m512i* rows) {
  __m512i a[16], b[16];
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  // b[4k + e] 128-bit lane L holds dword 4L + e of rows 4k..4k+3
  for (int e = 0; e < 4; ++e) {
    const __m512i c0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x88), c1 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xDD);
    const __m512i d0 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x88);
    const __m512i d1 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xDD);
    rows[e] = _mm512_shuffle_i32x4(c0, d0, 0x88);
    rows[4 + e] = _mm512_shuffle_i32x4(c1, d1, 0x88);
    rows[8 + e] = _mm512_shuffle_i32x4(c0, d0, 0xDD);
    rows[12 + e] = _mm512_shuffle_i32x4(c1, d1, 0xDD);
  }
}

// lane i = x[i * ld] for the keys i in `keys`, else 0.
inline __m512 gather_keys(const float* x, int64_t ld, __mmask16 keys) {
  const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int32_t>(ld)));
  return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), keys, index, x, 4);
}

inline __m512i broadcast_dword(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, 4);
  return _mm512_set1_epi32(word);
}

// out[r * ld_out + j] = q_r . k_j for rows r0..r0+R of st and the run's keys (st.kt, st.kscale).
template <int R>
KVGRAPH_VNNI_TARGET void scores_rows(const Int8Decode& st, int64_t r0, __mmask16 keys, float* out, int64_t ld_out) {
  const int64_t D = st.D, steps = st.group / 4, groups = D / st.group;
  const __m512 radix = _mm512_set1_ps(1.0f / kQRadix);
  __m512 sc[R];
  for (int r = 0; r < R; ++r) sc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i a[R][kQParts];
    for (int r = 0; r < R; ++r) {
      for (int p = 0; p < kQParts; ++p) a[r][p] = _mm512_setzero_si512();
    }
    for (int64_t w = g * steps; w < (g + 1) * steps; ++w) {
      const __m512i k = _mm512_loadu_si512(st.kt.data() + 16 * w);
      for (int r = 0; r < R; ++r) {
        const int8_t* q = st.parts.data() + (r0 + r) * kQParts * D + 4 * w;
        for (int p = 0; p < kQParts; ++p) a[r][p] = _mm512_dpbusd_epi32(a[r][p], k, broadcast_dword(q + p * D));
      }
    }
    // -- the group's exact int32 sums to fp32, times the query's and the keys' scales --
    for (int r = 0; r < R; ++r) {
      __m512 f[kQParts];
      for (int p = 0; p < kQParts; ++p) {
        const int32_t off = st.offset[((r0 + r) * kQParts + p) * groups + g];
        f[p] = _mm512_cvtepi32_ps(_mm512_sub_epi32(a[r][p], _mm512_set1_epi32(off)));
      }
      const __m512 total = _mm512_fmadd_ps(_mm512_fmadd_ps(f[2], radix, f[1]), radix, f[0]);
      const __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(st.kscale.data() + 16 * g), _mm512_set1_ps(st.scale[r0 + r]));
      sc[r] = _mm512_fmadd_ps(total, scale, sc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (r0 + r) * ld_out, keys, sc[r]);
}

// out[r * ld_out + j] = q_r . k_j (dequantized) for every row and n <= 16 keys k_j = k[j * ld_k]
// with scales ks[j * ld_ks + group index].
KVGRAPH_VNNI_TARGET void scores_int8(Int8Decode& st, const int8_t* k, int64_t ld_k, const float* ks, int64_t ld_ks,
                                     int64_t n, float* out, int64_t ld_out) {
  const int64_t D = st.D;
  const __mmask16 keys = static_cast<__mmask16>((1u << n) - 1);
  // -- the run's K as u8 (absent keys and bytes zero, then flipped), transposed 64 bytes at a time --
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t c0 = 0; c0 < D; c0 += 64) {
    const int64_t len = std::min<int64_t>(64, D - c0);
    const __mmask64 bytes = len == 64 ? ~__mmask64{0} : (__mmask64{1} << len) - 1;
    __m512i t[16];
    for (int64_t j = 0; j < 16; ++j) {
      t[j] = j < n ? _mm512_xor_si512(_mm512_maskz_loadu_epi8(bytes, k + j * ld_k + c0), flip) : flip;
    }
    transpose16_epi32(t);
    for (int64_t w = 0; w < 16; ++w) _mm512_storeu_si512(st.kt.data() + 16 * (c0 / 4 + w), t[w]);
  }
  for (int64_t g = 0; g < D / st.group; ++g) {
    _mm512_storeu_ps(st.kscale.data() + 16 * g, gather_keys(ks + g, ld_ks, keys));
  }
  for_row_blocks(st.rows, [&](int64_t r0, auto R) { scores_rows<decltype(R)::value>(st, r0, keys, out, ld_out); });
}

// acc[r * D + d] += sum_j p[r * ld_p + j] * v_j[d] (dequantized) for R rows and C 16-lane chunks
// from lane c0 of D (C = 4: all in D), n keys v_j = v[j * ld_v] with scales vs[j * ld_vs + d / group],
// or (kFolded) with the scales already in p. R x C accumulators in registers over the run.
template <int R, int C, bool kFolded>
KVGRAPH_VNNI_TARGET void accumulate_chunks(const Int8Decode& st, int64_t c0, float* acc, const float* p,
                                           int64_t ld_p, const int8_t* v, int64_t ld_v, const float* vs,
                                           int64_t ld_vs, int64_t n) {
  const int64_t D = st.D, ci = c0 / 16;
  const __mmask16 last = st.lanes[ci + C - 1];  // the lanes of the last chunk in D
  auto lanes = [&](int c) -> __mmask16 { return c == C - 1 ? last : 0xFFFF; };
  __m512 a[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) a[r][c] = _mm512_maskz_loadu_ps(lanes(c), acc + r * D + c0 + 16 * c);
  }
  for (int64_t j = 0; j < n; ++j) {
    const int8_t* vj = v + j * ld_v + c0;
    __m512 x[C];
    for (int c = 0; c < C; ++c) {
      const __m128i q = C == 4 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(vj + 16 * c))
                               : _mm_maskz_loadu_epi8(lanes(c), vj + 16 * c);
      x[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
      if constexpr (!kFolded) {
        const __m512 spanned = _mm512_maskz_loadu_ps(st.spanned[ci + c], vs + j * ld_vs + st.first_group[ci + c]);
        const __m512i group_of = _mm512_loadu_si512(st.group_of.data() + 16 * (ci + c));
        x[c] = _mm512_mul_ps(x[c], _mm512_permutexvar_ps(group_of, spanned));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * ld_p + j]);
      for (int c = 0; c < C; ++c) a[r][c] = _mm512_fmadd_ps(pr, x[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(acc + r * D + c0 + 16 * c, lanes(c), a[r][c]);
  }
}

// acc[r * D + d] += sum_j p[r * ld_p + j] * v_j[d] (dequantized) for every row and n <= 16 keys
// v_j = v[j * ld_v] with scales vs[j * ld_vs + d / group]. With one scale per row (group = D) it
// goes into p (which it overwrites) once per key, not into every element of v_j.
KVGRAPH_VNNI_TARGET void accumulate_int8(Int8Decode& st, float* acc, float* p, int64_t ld_p, const int8_t* v,
                                         int64_t ld_v, const float* vs, int64_t ld_vs, int64_t n) {
  const bool folded = st.group == st.D;
  if (folded) {
    const __mmask16 keys = static_cast<__mmask16>((1u << n) - 1);
    const __m512 s = gather_keys(vs, ld_vs, keys);
    for (int64_t r = 0; r < st.rows; ++r) {
      _mm512_mask_storeu_ps(p + r * ld_p, keys, _mm512_mul_ps(_mm512_maskz_loadu_ps(keys, p + r * ld_p), s));
    }
  }
  for_row_blocks(st.rows, [&](int64_t r0, auto R) {
    constexpr int kR = decltype(R)::value;
    auto run = [&](int64_t c0, auto C) {
      constexpr int kC = decltype(C)::value;
      float* a = acc + r0 * st.D;
      const float* pr = p + r0 * ld_p;
      if (folded) {
        accumulate_chunks<kR, kC, true>(st, c0, a, pr, ld_p, v, ld_v, vs, ld_vs, n);
      } else {
        accumulate_chunks<kR, kC, false>(st, c0, a, pr, ld_p, v, ld_v, vs, ld_vs, n);
      }
    };
    int64_t c0 = 0;
    for (; c0 + 64 <= st.D; c0 += 64) run(c0, std::integral_constant<int, 4>{});
    for (; c0 < st.D; c0 += 16) run(c0, std::integral_constant<int, 1>{});
  });
}
#endif

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
  // an int8 cache read in place (fp32 accumulation): by VPDPBUSD, else with AVX2
  [[maybe_unused]] constexpr bool kInt8 = std::is_same_v<cache_t, int8_t> && std::is_same_v<A, float>;
#if KVGRAPH_INT8_VNNI
  // VPDPBUSD: runs of up to 16 keys (see scores_int8)
  const bool vnni = kInt8 && sv.int8_path == Int8Path::kAuto && has_vnni() && D % 4 == 0 && sv.group % 4 == 0;
  Int8Decode* st = vnni ? &int8_state() : nullptr;
  if constexpr (kInt8) {
    if (vnni) st->prepare(qf, rows, D, sv.group);
  }
#else
  const bool vnni = false;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  // else AVX2 (csrc/int8_decode_avx2.h): runs of a whole page
  const bool avx2 = kInt8 && !vnni && sv.int8_path != Int8Path::kTiles && int8_avx2::usable(D, sv.group);
#else
  const bool avx2 = false;
#endif
  // runs of consecutive positions in one page (at most kKeyTile when converting into kf / vf)
  auto run_end = [&](int64_t pos) {
    return std::min({kv_end, g.page_end(pos), vnni ? pos + 16 : kConvert && !avx2 ? pos + kKeyTile : kv_end});
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
  // Each pass asks for its own head's K or V rows and their scales kPrefetchKeys positions ahead:
  // the rows of a decode step lie in pages scattered over the pool, and the hardware prefetcher
  // does not follow the jump from one page to the next. Spread over every head's two passes, the
  // reads of a sequence overlap all of its work.
  int64_t fetched[2] = {kv_begin, kv_begin};  // per K / V: positions [kv_begin, fetched) asked for
  auto prefetch_to = [&](int64_t kv, int64_t until) {
    auto prefetch = [](const void* src, int64_t count, int64_t span, int64_t stride) {
      for (int64_t j = 0; j < count; ++j) {
        const char* row = static_cast<const char*>(src) + j * stride;
        for (int64_t c = 0; c < span; c += 64) __builtin_prefetch(row + c, 0, 2);
      }
    };
    for (int64_t& pos = fetched[kv]; pos < std::min(until, kv_end); pos = run_end(pos)) {
      const int64_t n = run_end(pos) - pos;
      prefetch(blocks + g.offset(lut, b, pos, kv, layer) + h * D, n, D * static_cast<int64_t>(sizeof(cache_t)),
               g.stride_slot * static_cast<int64_t>(sizeof(cache_t)));
      if constexpr (kQuantized<cache_t>) {
        // a run's scales are contiguous: n rows of hkv * (D / group) floats
        prefetch(sv.row(lut, b, pos, kv, layer, 0), 1, n * sv.g.stride_slot * static_cast<int64_t>(sizeof(float)), 0);
      }
    }
  };
  // -- pass 1: every score, page by page (scores[r * n_ctx + j] is position kv_begin + j) --
  for (int64_t pos = kv_begin; pos < kv_end;) {
    const int64_t n = run_end(pos) - pos;
    prefetch_to(0, pos + kPrefetchKeys);
    A* const sc = scores.data() + pos - kv_begin;
#if KVGRAPH_INT8_VNNI
    if constexpr (kInt8) {
      if (vnni) {
        scores_int8(*st, blocks + g.offset(lut, b, pos, 0, layer) + h * D, g.stride_slot,
                    sv.row(lut, b, pos, 0, layer, h), sv.g.stride_slot, n, sc, n_ctx);
        pos += n;
        continue;
      }
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (kInt8) {
      if (avx2) {
        int8_avx2::scores(qf, rows, D, sv.group, blocks + g.offset(lut, b, pos, 0, layer) + h * D, g.stride_slot,
                          sv.row(lut, b, pos, 0, layer, h), sv.g.stride_slot, n, sc, n_ctx);
        pos += n;
        continue;
      }
    }
#endif
    int64_t ld;
    const A* kt = rows_of(pos, n, 0, kf, ld);
    for (int64_t r = 0; r < rows; ++r) dots(qf + r * D, kt, ld, D, n, sc + r * n_ctx);
    pos += n;
  }
  prefetch_to(1, kv_begin + kPrefetchKeys);
  // -- pass 2: softmax numerators and their sums (of the capped scores: every key is visible) --
  for (int64_t r = 0; r < rows; ++r) {
    A* sr = scores.data() + r * n_ctx;
    if (softcap > 0) soft_cap(sr, softcap, n_ctx);
    l[r] = exp_and_sum(sr, max_of(sr, n_ctx), n_ctx);
  }
  // -- pass 3: acc = sum_j p_j v_j, page by page --
  for (int64_t pos = kv_begin; pos < kv_end;) {
    const int64_t n = run_end(pos) - pos;
    prefetch_to(1, pos + kPrefetchKeys);
    A* const sc = scores.data() + pos - kv_begin;
#if KVGRAPH_INT8_VNNI
    if constexpr (kInt8) {
      if (vnni) {
        accumulate_int8(*st, acc, sc, n_ctx, blocks + g.offset(lut, b, pos, 1, layer) + h * D, g.stride_slot,
                        sv.row(lut, b, pos, 1, layer, h), sv.g.stride_slot, n);
        pos += n;
        continue;
      }
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (kInt8) {
      if (avx2) {
        int8_avx2::accumulate(acc, rows, D, sv.group, sc, n_ctx, blocks + g.offset(lut, b, pos, 1, layer) + h * D,
                              g.stride_slot, sv.row(lut, b, pos, 1, layer, h), sv.g.stride_slot, n);
        pos += n;
        continue;
      }
    }
#endif
    int64_t ld;
    const A* vt = rows_of(pos, n, 1, vf, ld);
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
                  int64_t window, A softcap, const Tiles<A>& tiles) {
  constexpr bool kConvert = !std::is_same_v<cache_t, A>;
  const int64_t D = g.d;
#if defined(__AVX2__) && defined(__FMA__)
  // float32 sums and D % 16 == 0: every row at once, a tile as two small products
  // (csrc/prefill_tiles_avx2.h); m and l of the padding rows too, which the products fill
  const bool by_tiles = tiles.on && prefill_avx2::usable(D);
  if constexpr (std::is_same_v<A, float>) {
    if (by_tiles) {
      prefill_avx2::pack_queries(qf, rows, D, tiles.qt);
      std::fill(m + rows, m + prefill_avx2::padded(rows), -std::numeric_limits<A>::infinity());
      std::fill(l + rows, l + prefill_avx2::padded(rows), A(0));
    }
  }
#else
  const bool by_tiles = false;
#endif
  for (int64_t pos = kv_begin; pos < kv_end;) {
    // -- one tile of up to kKeyTile keys: fp32 pages are read in place (one page per tile) when
    //    the item has few rows or the page is long; otherwise the tile is gathered page by page
    //    (and converted from bf16/fp16, or dequantized) into a contiguous buffer, so per-tile work
    //    is amortized; the tiles' products read fp32 pages in place at any row count (from
    //    scattered pages a gather cost them more than tiles of one page) --
    const bool in_place = !kConvert && (by_tiles || rows < kGatherRows || g.page_end(pos) >= pos + kKeyTile);
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
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (std::is_same_v<A, float>) {
      if (by_tiles) {
        // token t = s0 + i sees tile keys [lo, hi): from its window's start to itself
        int64_t lo[kQueryBlock], hi[kQueryBlock];
        for (int64_t i = 0; i * G < rows; ++i) {
          const int64_t p = cached + s0 + i;
          hi[i] = std::min(n, p + 1 - pos);
          lo[i] = std::max<int64_t>(0, window_start(p, window) - pos);
        }
        prefill_avx2::tile(tiles.qt, rows, G, D, kt, vt, ld, n, lo, hi, softcap, tiles.st, acc, m, l, tiles.alpha);
        pos += n;
        continue;
      }
    }
#endif
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
            const int32_t* lut, int64_t layer, double scale, int64_t window, double softcap, bool tiles_on) {
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
  const bool any_block = std::any_of(items.begin(), items.end(), [](const WorkItem& it) { return it.s1 - it.s0 > 1; });
  std::atomic<int64_t> next{0};
  const int64_t n_workers = std::min<int64_t>(at::get_num_threads(), n_items);
  const int64_t chunk = static_cast<int64_t>(items.size()) >= 4 * n_workers ? g.hkv : 1;

  at::parallel_for(0, n_workers, 1, [&](int64_t, int64_t) {
    // per-thread scratch: queries (pre-scaled), accumulators, running max and sum, scores,
    // and one K and one V tile gathered from its pages in the accumulation type
    std::vector<A> qf(rows_max * D), acc(rows_max * D), m(rows_max), l(rows_max),
        scores(kKeyTile), kf(kKeyTile * D), vf(kKeyTile * D), context_scores;
    // the prompt tiles' scratch (rows_max = 16 G is a multiple of their 16 columns), for a step
    // with a prompt: a decode step's items have one token each
    const bool by_tiles = tiles_on && std::is_same_v<A, float> && any_block;
    std::vector<A> qt(by_tiles ? rows_max * D : 0), st(by_tiles ? kKeyTile * rows_max : 0),
        alpha(by_tiles ? rows_max : 0);
    const Tiles<A> tiles{by_tiles, qt.data(), st.data(), alpha.data()};
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
                     static_cast<A>(softcap), tiles);
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
  const bool tiles_on = prefill_tiles();
  const double softmax_scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(D));
  const ScaleView sv = kv_scales.has_value()
                           ? ScaleView{kv_scales->mutable_data_ptr<float>(), Geometry(*kv_scales, lut_t),
                                       D / kv_scales->size(5), int8_path()}
                           : ScaleView{nullptr, g, D};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "kvgraph_ragged_attention", [&] {
    auto run = [&](auto* blocks) {
      store_new_tokens<scalar_t>(k, 0, blocks, g, sv, seq_of_token, offs, cl, lut, layer_idx);
      store_new_tokens<scalar_t>(v, 1, blocks, g, sv, seq_of_token, offs, cl, lut, layer_idx);
      attend<scalar_t>(q, out, blocks, g, sv, items, offs, cl, lut, layer_idx, softmax_scale,
                       sliding_window.value_or(kNoWindow), softcap.value_or(0.0), tiles_on);
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
