// kvgraph_cpu::int8_linear_bf16: y [M, N] = (x [M, K] @ W^T) * scales (+ bias), x bfloat16, W int8
// [N, K] row-major with one float32 scale per output row, for up to kMaxRows rows (a decode step).
//
// The product is computed transposed, y^T = W x^T, so that W is read as it is stored: per block
// of kBlockRows output rows, the block's int8 values are converted to bfloat16 into a buffer
// that stays in the core's L2 (exact: |q| <= 127 has 7 significant bits, and the bfloat16 of an
// integer-valued float32 is its upper half), and multiplied by x^T with oneDNN's batch-reduce GEMM
// microkernel (at::native::cpublas::brgemm, AMX where the CPU has it). x^T is its B operand in the
// VNNI layout, pairs of consecutive K values per row: x viewed as int32 [M, K/2], transposed once
// per call. The float32 accumulators get the row's scale (and bias) and are stored transposed.
// Each weight is read once per call, one byte each, with no bfloat16 copy of the weight in memory.
//
// Only for AVX-512 builds (CPU_CAPABILITY_AVX512): elsewhere the op refuses and the Python side,
// kvgraph/ops/int8_linear.py, never calls it.
//
// kvgraph_cpu::int8_weight_linear: kvgraph::int8_weight_linear's CPU routing by row count
// (kvgraph/ops/int8_linear.py says why), with the row thresholds given by the caller:
// int8_matvec up to vnni_rows bfloat16 or float32 rows (below), the fused
// kernel for fused_min_rows..fused_max_rows bfloat16 rows with an even K, ATen's
// _weight_int8pack_mm up to matvec_rows (with act_scales, the scales already in x's dtype, when
// given), else a GEMM over the weight dequantized for the call.
// A compiled graph calls it as an extern kernel, with no Python between the graph and the kernel.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "int8_parts.h"

namespace kvgraph {
namespace {

constexpr int64_t kBlockRows = 64;  // weight rows (output features) per work item
constexpr int64_t kMaxRows = 64;    // rows of x in one call: one microkernel per (block rows, x rows, K)

#if defined(CPU_CAPABILITY_AVX512)
// dst[i] = bfloat16(src[i]) for int8 src: exact, no rounding.
void int8_to_bf16(const int8_t* src, uint16_t* dst, int64_t count) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) {
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    __m256i upper = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(f), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), upper);
  }
  for (; i < count; ++i) {
    float f = static_cast<float>(src[i]);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    dst[i] = static_cast<uint16_t>(bits >> 16);
  }
}
#endif

// -- kvgraph_cpu::int8_matvec: one row of x (a batch-1 decode step) with AVX-512 VNNI --
// y[0, n] = scales[n] * (x . w[n]) (+ bias[n]), x bfloat16 or float32 [1, K]. The row of x is split
// exactly enough for a float32 result: x / sq = h + m / 254 + l / 254^2 with h, m, l int8 (sq =
// max|x| / 127), an error below 2^-23 of max|x| (as the int8 KV decode of ragged_attention_cpu.cpp
// does). Each 64 weights are loaded once, read as unsigned (w + 128: VPDPBUSD multiplies u8 by s8,
// and 128 * sum(part) is taken off at the end) and multiplied by the three parts, four products
// summed per int32 lane. Each thread reads its rows one after another, front to back, so that its
// reads are one sequential stream; each load also asks for the same bytes kPrefetchRows rows further
// on. Four rows read side by side (64 bytes of each in turn, the first version) read llama-56m's 57
// layers (40 MB, benchmarks/int8_linear.py) at 26 GB/s on a Xeon but at 13-15 GB/s on Zen 4, where
// one row at a time reads them at 19-28 GB/s, 0.7-0.8 of a plain float sum over the same bytes
// (whole 64-weight steps loaded unmasked and the three sums folded together: 5-8% more; without
// the prefetch 5-7% less).
// At 2 rows and more ATen's _weight_int8pack_mm was as fast, so the op takes one row.
#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__)
#define KVGRAPH_MATVEC_VNNI 1
#define KVGRAPH_VNNI __attribute__((target("avx512vnni")))

using int8_parts::has_vnni;
using int8_parts::kParts;  // int8 parts of x: h, m, l (csrc/int8_parts.h)
using int8_parts::kRadix;
constexpr int64_t kMatvecGrain = 64;  // rows per share of the threads' work, at least
constexpr int64_t kPrefetchRows = 8;  // weight rows ahead each load asks for (0-16 measured alike on Zen 4)

// x split into its parts, padded with zeros to a multiple of 64 values; buffers reused across calls.
// The split is a function of x's bytes alone, so a call whose x has the bytes of the previous
// call's (q, k and v, or gate and up, of one layer read the same x) reuses it: a memcmp of 1-3 KB
// instead of about 2.5 us of scalar work at K = 512.
struct SplitRow {
  int64_t k = 0, kp = 0;
  std::vector<int8_t> parts;  // [kParts, kp]
  float sq = 0.0f;
  bool finite = true;         // every value finite; else the parts are not made (see int8_matvec)
  int32_t sums[kParts] = {};  // 128 * each part's sum: what reading W as W + 128 adds
  std::vector<double> rest;   // [2, k]: what the parts so far leave of x, and split's scratch
  std::vector<unsigned char> source;  // the bytes of the x split last, then sizeof(T) (empty: none)

  template <typename T>
  void split(const T* x, int64_t k_) {
    const auto* bytes = reinterpret_cast<const unsigned char*>(x);
    const size_t size = static_cast<size_t>(k_) * sizeof(T);
    if (k_ == k && source.size() == size + 1 && source[size] == sizeof(T) &&
        std::memcmp(source.data(), bytes, size) == 0) {
      return;
    }
    source.assign(bytes, bytes + size);
    source.push_back(static_cast<unsigned char>(sizeof(T)));  // bf16 and fp32 bytes never compare equal
    k = k_, kp = (k_ + 63) / 64 * 64;
    parts.assign(kParts * kp, 0);
    rest.resize(2 * k);
    float amax = 0.0f;
    for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::abs(static_cast<float>(x[i])));
    finite = std::isfinite(amax);
    for (int64_t i = 0; i < k && finite; ++i) finite = !std::isnan(static_cast<float>(x[i]));  // max skips a NaN
    if (!finite) return;
    sq = amax / 127.0f;
    const double inv = amax > 0.0f ? 127.0 / amax : 0.0;
    for (int64_t i = 0; i < k; ++i) rest[i] = static_cast<float>(x[i]) * inv;  // in [-127, 127]
    int8_parts::split(rest.data(), rest.data() + k, k, parts.data(), kp);
    for (int64_t p = 0; p < kParts; ++p) {
      int32_t total = 0;
      for (int64_t i = 0; i < k; ++i) total += parts[p * kp + i];
      sums[p] = 128 * total;
    }
  }
};

// One weight row's three VPDPBUSD sums (one per part of x), named rather than an array: GCC kept a
// loop-indexed array of them in memory and stored every sum at every step (on Zen 4, cache-hot,
// one core: 13 GB/s that way, 23 with the sums in registers).
struct PartSums {
  __m512i h = _mm512_setzero_si512(), m = _mm512_setzero_si512(), l = _mm512_setzero_si512();
};

// a += the 64 weights of row wr from kk (read as unsigned; kFull: all 64 lie before k, else those
// past k read as 0 ^ 0x80 = 128, times the parts' zero padding) times the parts of x there; the load
// also asks for the same bytes `ahead` bytes further on (0: none).
template <bool kFull>
KVGRAPH_VNNI inline __attribute__((always_inline)) void dot_step(PartSums& a, const SplitRow& x, const int8_t* wr,
                                                                 int64_t kk, int64_t ahead) {
  __m512i raw;
  if constexpr (kFull) {
    raw = _mm512_loadu_si512(wr + kk);
  } else {
    raw = _mm512_maskz_loadu_epi8((__mmask64{1} << (x.k - kk)) - 1, wr + kk);
  }
  const int8_t* xp = x.parts.data() + kk;
  const __m512i wv = _mm512_xor_si512(raw, _mm512_set1_epi8(static_cast<char>(0x80)));
  if (ahead != 0) _mm_prefetch(reinterpret_cast<const char*>(wr + kk + ahead), _MM_HINT_T0);
  a.h = _mm512_dpbusd_epi32(a.h, wv, _mm512_loadu_si512(xp));
  a.m = _mm512_dpbusd_epi32(a.m, wv, _mm512_loadu_si512(xp + x.kp));
  a.l = _mm512_dpbusd_epi32(a.l, wv, _mm512_loadu_si512(xp + 2 * x.kp));
}

// out[row] from the row's sums: x . w[row] exactly (in double), times x's and the row's scales.
template <typename out_t>
KVGRAPH_VNNI inline __attribute__((always_inline)) void finish_row(const SplitRow& x, const PartSums& a, int64_t row,
                                                                   const float* s, const float* bias, out_t* out) {
  static_assert(kParts == 3, "PartSums holds three parts");
  // fold each part to 4 lanes, then [H, M, L, L] with two horizontal adds
  auto fold = [](__m512i v) {
    const __m256i y = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
  };
  const __m128i h = fold(a.h), m = fold(a.m), l = fold(a.l);
  const __m128i hm = _mm_hadd_epi32(h, m), ll = _mm_hadd_epi32(l, l);
  const __m128i sums = _mm_hadd_epi32(hm, ll);  // [H, M, L, L]
  alignas(16) int32_t t[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(t), sums);
  double total = static_cast<double>(t[2]) - x.sums[2];
  total = total / kRadix + (t[1] - x.sums[1]);
  total = total / kRadix + (t[0] - x.sums[0]);
  const float v = static_cast<float>(total) * x.sq * s[row] + (bias != nullptr ? bias[row] : 0.0f);
  out[row] = static_cast<out_t>(v);
}

// One weight row, read front to back: two sets of sums (even and odd 64-weight steps), so that no
// VPDPBUSD waits for the one before it; whole steps are loaded plainly, a last partial one masked.
template <typename out_t>
KVGRAPH_VNNI void matvec_row(const SplitRow& x, const int8_t* w, int64_t row, int64_t n, const float* s,
                             const float* bias, out_t* out) {
  const int64_t ahead = row + kPrefetchRows < n ? kPrefetchRows * x.k : 0;
  const int8_t* wr = w + row * x.k;
  PartSums a, b;
  const int64_t full = x.k / 64 * 64;
  int64_t kk = 0;
  for (; kk + 128 <= full; kk += 128) {
    dot_step<true>(a, x, wr, kk, ahead);
    dot_step<true>(b, x, wr, kk + 64, ahead);
  }
  if (kk < full) dot_step<true>(a, x, wr, kk, ahead), kk += 64;
  if (kk < x.k) dot_step<false>(b, x, wr, kk, ahead);
  a.h = _mm512_add_epi32(a.h, b.h), a.m = _mm512_add_epi32(a.m, b.m), a.l = _mm512_add_epi32(a.l, b.l);
  finish_row(x, a, row, s, bias, out);
}
#endif

at::Tensor int8_matvec(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
#if !KVGRAPH_MATVEC_VNNI
  TORCH_CHECK(false, "int8_matvec: built without AVX-512; kvgraph::int8_weight_linear does not call it here");
#else
  TORCH_CHECK(has_vnni(), "int8_matvec: this CPU has no AVX-512 VNNI; kvgraph::int8_weight_linear does not call it here");
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) && x.dim() == 2 && x.size(0) == 1,
              "int8_matvec: x must be one row, a [1, K] bfloat16 or float32 tensor, got ", x.scalar_type(), " ",
              x.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(),
              "int8_matvec: weight must be a contiguous 2-D int8 tensor, got ", weight.scalar_type(), " ",
              weight.sizes());
  const int64_t k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "int8_matvec: x's K = ", k, " but the weight's is ", weight.size(1));
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n,
              "int8_matvec: scales must be a contiguous float32 of ", n, " values, got ", scales.scalar_type(), " ",
              scales.sizes());
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
              "int8_matvec: bias must be a contiguous float32 of ", n, " values");
  static thread_local SplitRow buffers;  // one call at a time per calling thread
  SplitRow& split = buffers;             // the workers read the caller's (a thread_local by name is their own)
  const at::Tensor xc = x.contiguous();
  if (xc.scalar_type() == at::kBFloat16) {
    split.split(xc.const_data_ptr<at::BFloat16>(), k);
  } else {
    split.split(xc.const_data_ptr<float>(), k);
  }
  if (!split.finite) {
    // a NaN or infinity in x: the float32 product of the dequantized weight, which carries it
    at::Tensor y = at::mm(xc.to(at::kFloat), weight.to(at::kFloat).mul_(scales.unsqueeze(1)).t());
    if (bias.has_value()) y.add_(*bias);
    return y.to(x.scalar_type());
  }
  at::Tensor y = at::empty({1, n}, x.options());
  const int8_t* w = weight.const_data_ptr<int8_t>();
  const float* s = scales.const_data_ptr<float>();
  const float* pb = bias.has_value() ? bias->const_data_ptr<float>() : nullptr;
  auto run = [&](auto* out) {
    using out_t = std::remove_pointer_t<decltype(out)>;
    at::parallel_for(0, n, kMatvecGrain, [&](int64_t row, int64_t end) {
      for (; row < end; ++row) matvec_row<out_t>(split, w, row, n, s, pb, out);
    });
  };
  if (x.scalar_type() == at::kBFloat16) {
    run(y.mutable_data_ptr<at::BFloat16>());
  } else {
    run(y.mutable_data_ptr<float>());
  }
  return y;
#endif
}

at::Tensor int8_linear_bf16(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                            const std::optional<at::Tensor>& bias) {
#if !defined(CPU_CAPABILITY_AVX512)
  TORCH_CHECK(false, "int8_linear_bf16: built without AVX-512; kvgraph::int8_weight_linear does not call it here");
#else
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "int8_linear_bf16: x must be a contiguous 2-D bfloat16 tensor, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(),
              "int8_linear_bf16: weight must be a contiguous 2-D int8 tensor, got ", weight.scalar_type(), " ",
              weight.sizes());
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "int8_linear_bf16: x's K = ", k, " but the weight's is ", weight.size(1));
  TORCH_CHECK(k % 2 == 0 && k > 0, "int8_linear_bf16: K must be even and positive (VNNI pairs), got ", k);
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "int8_linear_bf16: 1..", kMaxRows, " rows, got ", m);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n,
              "int8_linear_bf16: scales must be a contiguous float32 of ", n, " values, got ", scales.scalar_type(),
              " ", scales.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == n,
                "int8_linear_bf16: bias must be a contiguous bfloat16 of ", n, " values, got ", bias->sizes());
  }
  at::Tensor y = at::empty({m, n}, x.options());
  // B = x^T as VNNI pairs: int32 [K/2, M], each element two consecutive bfloat16 of one row of x
  // (a plain loop: a few thousand elements, where a strided ATen copy costs more than the move)
  const int64_t pairs = k / 2;
  at::Tensor xt = at::empty({pairs, m}, x.options().dtype(at::kInt));
  {
    const auto* src = reinterpret_cast<const int32_t*>(x.data_ptr<at::BFloat16>());
    int32_t* dst = xt.data_ptr<int32_t>();
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t p = 0; p < pairs; ++p) dst[p * m + i] = src[i * pairs + p];
    }
  }
  const auto* b = reinterpret_cast<const at::BFloat16*>(xt.data_ptr<int32_t>());
  const int8_t* w = weight.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  const at::BFloat16* pbias = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* out = y.data_ptr<at::BFloat16>();
  const int64_t blocks = (n + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    std::vector<at::BFloat16> a(kBlockRows * k);
    std::vector<float> acc(kBlockRows * m);
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t row0 = blk * kBlockRows;
      const int64_t rows = std::min(kBlockRows, n - row0);
      int8_to_bf16(w + row0 * k, reinterpret_cast<uint16_t*>(a.data()), rows * k);
      at::native::cpublas::brgemm(rows, m, k, k, m, m, false, a.data(), b, acc.data(), /*is_vnni=*/true);
      for (int64_t r = 0; r < rows; ++r) {
        const float scale = s[row0 + r];
        const float add = pbias != nullptr ? static_cast<float>(pbias[row0 + r]) : 0.0f;
        const float* row = acc.data() + r * m;
        for (int64_t i = 0; i < m; ++i) out[i * n + row0 + r] = at::BFloat16(row[i] * scale + add);
      }
    }
    at::native::cpublas::brgemm_release(/*is_vnni=*/true);
  });
  return y;
#endif
}

at::Tensor int8_weight_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                              const std::optional<at::Tensor>& bias, int64_t fused_min_rows, int64_t fused_max_rows,
                              int64_t matvec_rows, int64_t vnni_rows, const std::optional<at::Tensor>& act_scales) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2,
              "int8_weight_linear: weight must be a 2-D int8 tensor, got ", weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(x.dim() >= 1, "int8_weight_linear: x must have a feature dim, got shape ", x.sizes());
  const int64_t k = x.size(-1), n = weight.size(0);
  TORCH_CHECK(k == weight.size(1), "int8_weight_linear: x's last dim ", k, " is not the weight's K = ", weight.size(1));
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n, "int8_weight_linear: scales must have shape (", n,
              ",), got ", scales.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "int8_weight_linear: bias must have shape (", n, ",), got ",
                bias->sizes());
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = n;
  const at::Tensor x2d = x.reshape({-1, k}).contiguous();
  const int64_t rows = x2d.size(0);
  if (rows >= 1 && rows <= vnni_rows && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat)) {
    std::optional<at::Tensor> b;
    if (bias.has_value()) b = bias->to(at::kFloat).contiguous();
    return int8_matvec(x2d, weight.contiguous(), scales.to(at::kFloat).contiguous(), b).view(shape);
  }
  if (rows >= fused_min_rows && rows <= fused_max_rows && x.scalar_type() == at::kBFloat16 && k % 2 == 0) {
    std::optional<at::Tensor> b;
    if (bias.has_value()) b = bias->to(at::kBFloat16).contiguous();
    return int8_linear_bf16(x2d, weight.contiguous(), scales.to(at::kFloat).contiguous(), b).view(shape);
  }
  at::Tensor out;
  if (rows <= matvec_rows) {
    // ATen's kernel takes the scales in x's dtype: the layer's copy of them, converted once, if it has one
    const bool ready = act_scales.has_value() && act_scales->scalar_type() == x.scalar_type();
    out = at::_weight_int8pack_mm(x2d, weight, ready ? *act_scales : scales.to(x.scalar_type()));
  } else {
    // int8 times the row's float32 scale, rounded once to x's dtype: torchao's own dequantization
    const at::Tensor dequantized = weight.to(at::kFloat).mul_(scales.to(at::kFloat).unsqueeze(1)).to(x.scalar_type());
    out = at::mm(x2d, dequantized.t());
  }
  if (bias.has_value()) out.add_(bias->to(out.scalar_type()));
  return out.view(shape);
}

}  // namespace
}  // namespace kvgraph

TORCH_LIBRARY_IMPL(kvgraph_cpu, CPU, m) {
  m.impl("int8_linear_bf16", &kvgraph::int8_linear_bf16);
  m.impl("int8_weight_linear", &kvgraph::int8_weight_linear);
  m.impl("int8_matvec", &kvgraph::int8_matvec);
}
