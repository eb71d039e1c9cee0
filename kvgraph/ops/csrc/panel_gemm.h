// kvgraph's float32 GEMM (csrc/panel_gemm_cpu.cpp): the weight packed once into panels of 32 (AVX-512)
// or 16 (AVX2) columns; x read in place, each panel's next one prefetched while it is multiplied, at
// a few rows (on AVX2 below 16, with AVX-512 at any count), else x packed for the caches.
// kvgraph_cpu::packed_linear (csrc/packed_linear_cpu.cpp) calls it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace kvgraph {
namespace panel {

// Whether this build has the kernel: an AVX-512 or AVX2 build.
bool available();

// w [N, K] float32 -> [ceil(N / C), K, C], zero padded; C, the columns of a panel, is 32 on an
// AVX-512 build and 16 on an AVX2 build.
at::Tensor pack(const at::Tensor& w);

// x [..., K] float32 @ w^T (+ bias) -> [..., N], w as pack() returned it for a weight of N rows.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias);

}  // namespace panel
}  // namespace kvgraph
