// kvgraph_cpu::argmax_rows: the index of each row's largest float32 logit, as torch.max(dim=-1)
// gives it (the first of tied maxima; a NaN counts as the largest, the first NaN wins), for the
// greedy rows of a step. Two passes over each row, both vectorized: its maximum (NaN-propagating,
// at::vec::maximum), then the first lane equal to it, while the row is still in the core's cache;
// rows are shared out over the threads. torch.max's reduction kept the index with every lane and
// read a 64 x 32000 step's logits at about 13 GB/s on this project's 2-core host.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace kvgraph {
namespace {

using Vec = at::vec::Vectorized<float>;

int64_t argmax_row(const float* x, int64_t n) {
  constexpr int64_t W = Vec::size();
  int64_t i = 0;
  float m = -INFINITY;
  if (n >= W) {
    Vec vm = Vec::loadu(x);
    for (i = W; i + W <= n; i += W) vm = at::vec::maximum(vm, Vec::loadu(x + i));
    float lanes[W];
    vm.store(lanes);
    for (int64_t j = 0; j < W; ++j) m = (std::isnan(lanes[j]) || lanes[j] > m) ? lanes[j] : m;
    if (std::isnan(m)) i = n;  // the tail is read below anyway
  }
  for (int64_t j = i; j < n && !std::isnan(m); ++j) m = (std::isnan(x[j]) || x[j] > m) ? x[j] : m;
  if (std::isnan(m)) {
    for (int64_t j = 0; j < n; ++j) {
      if (std::isnan(x[j])) return j;
    }
  }
  const Vec target(m);
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    // lanes equal to the maximum: not zero in (x == m)
    const int mask = ~(Vec::loadu(x + j) == target).zero_mask() & ((1 << W) - 1);
    if (mask != 0) return j + __builtin_ctz(static_cast<unsigned>(mask));
  }
  for (; j < n; ++j) {
    if (x[j] == m) return j;
  }
  return n - 1;  // unreachable for n >= 1: m is one of the values
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) >= 1,
              "argmax_rows: logits must be a 2-D float32 tensor with at least one column, got ",
              logits.scalar_type(), " ", logits.sizes());
  const at::Tensor x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* px = x.const_data_ptr<float>();
  int64_t* po = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) po[r] = argmax_row(px + r * ld, n);
  });
  return out;
}

}  // namespace
}  // namespace kvgraph

TORCH_LIBRARY_IMPL(kvgraph_cpu, CPU, m) {
  m.impl("argmax_rows", &kvgraph::argmax_rows);
}
