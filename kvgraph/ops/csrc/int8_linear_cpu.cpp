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
// (kvgraph/ops/int8_linear.py says why), with the row thresholds given by the caller: the fused
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
#include <cstring>
#include <optional>
#include <vector>

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
                              int64_t matvec_rows, const std::optional<at::Tensor>& act_scales) {
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
}
