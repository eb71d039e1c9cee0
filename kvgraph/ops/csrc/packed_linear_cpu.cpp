// kvgraph_cpu::packed_linear: kvgraph::linear's float32 CPU path (kvgraph/ops/linear.py says why):
// y = x @ W^T (+ bias) with W packed once, for up to max_packed_rows rows:
//   - on an AVX-512 build, into kvgraph's panels, multiplied by panel::linear
//     (csrc/panel_gemm_cpu.cpp: 1.3-1.5x MKL's packed GEMM at 8-16 rows, 1.1-1.3x at 32, within
//     10% of it at 1 and at 64-512 rows);
//   - else by MKL for pack_rows rows (mkl::_mkl_reorder_linear_weight) and multiplied with
//     mkl::_mkl_linear, whose packed B serves any row count.
// Other dtypes, autograd, no rows, more than max_packed_rows rows, and a build with neither run
// at::linear.
//
// The pack of each weight is kept here, keyed by the weight's TensorImpl and valid while that
// tensor lives and its version counter has not moved (an inference tensor has none: packed once).
// A new pack is first compared with at::linear at kCheckRows rows (for MKL: not the rows it was
// packed for); a weight whose pack disagrees runs at::linear from then on, with a warning. A
// compiled graph calls this op as an extern kernel: no Python between the graph and the GEMM.

#include "panel_gemm.h"

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/sin.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <algorithm>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

namespace kvgraph {
namespace {

constexpr int64_t kCheckRows = 3;

struct Pack {
  c10::weak_intrusive_ptr<c10::TensorImpl> owner;  // the weight this pack was made from
  int64_t version;                                 // its version then (-1: an inference tensor)
  at::Tensor packed;                               // undefined: the packed product disagreed, use at::linear
};

// The packed product of this build: kvgraph's panels where it has them, else MKL's pack, else
// none (at::linear).
enum class Gemm { kPanels, kMkl, kNone };

Gemm gemm() {
  return panel::available() ? Gemm::kPanels : at::globalContext().hasMKL() ? Gemm::kMkl : Gemm::kNone;
}

std::mutex packs_mutex;
std::unordered_map<const c10::TensorImpl*, Pack> packs;

at::Tensor mkl_reorder(const at::Tensor& weight, int64_t rows) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkl::_mkl_reorder_linear_weight", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t)>();
  return op.call(weight, rows);
}

at::Tensor mkl_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias, int64_t rows) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkl::_mkl_linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, int64_t)>();
  return op.call(x, packed, weight, bias, rows);
}

int64_t version_of(const at::Tensor& weight) { return weight.is_inference() ? -1 : weight._version(); }

// The pack of weight (packing it if it has none, or if it changed since), or an undefined tensor.
at::Tensor pack_of(const at::Tensor& weight, int64_t pack_rows) {
  const c10::TensorImpl* key = weight.unsafeGetTensorImpl();
  const int64_t version = version_of(weight);
  std::lock_guard<std::mutex> guard(packs_mutex);
  auto found = packs.find(key);
  if (found != packs.end() && !found->second.owner.expired() && found->second.version == version) {
    return found->second.packed;
  }
  // drop the packs of weights that are gone (the key of one may be this weight's, reused)
  for (auto it = packs.begin(); it != packs.end();) {
    it = it->second.owner.expired() ? packs.erase(it) : std::next(it);
  }
  const at::Tensor w = weight.detach().contiguous();
  const bool panels = gemm() == Gemm::kPanels;
  at::Tensor packed = panels ? panel::pack(w) : mkl_reorder(w, pack_rows);
  const at::Tensor x = at::sin(at::arange(kCheckRows * w.size(1), w.options())).view({kCheckRows, w.size(1)});
  const at::Tensor want = at::linear(x, w);
  const at::Tensor got = panels ? panel::linear(x, packed, w.size(0), std::nullopt)
                                : mkl_linear(x, packed, w, std::nullopt, kCheckRows);
  const double scale = std::max(want.abs().max().item<double>(), 1.0);
  if (!at::allclose(got, want, 1e-4, 1e-4 * scale)) {
    TORCH_WARN(panels ? "kvgraph's panel GEMM" : "MKL's packed GEMM", " with a weight of shape ", w.sizes(),
               " differs from F.linear at ", kCheckRows, " rows; this weight uses F.linear instead");
    packed = at::Tensor();
  }
  packs.insert_or_assign(key, Pack{c10::weak_intrusive_ptr<c10::TensorImpl>(weight.getIntrusivePtr()), version, packed});
  return packed;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         int64_t max_packed_rows, int64_t pack_rows) {
  const int64_t k = x.dim() > 0 ? x.size(-1) : 0;
  const int64_t rows = k > 0 ? x.numel() / k : 0;
  if (rows == 0 || rows > max_packed_rows || x.scalar_type() != at::kFloat || weight.scalar_type() != at::kFloat ||
      weight.dim() != 2 || !x.device().is_cpu() || !weight.device().is_cpu() || c10::GradMode::is_enabled() ||
      gemm() == Gemm::kNone) {
    return at::linear(x, weight, bias);
  }
  const at::Tensor packed = pack_of(weight, pack_rows);
  if (!packed.defined()) {
    return at::linear(x, weight, bias);
  }
  if (gemm() == Gemm::kPanels) {
    return panel::linear(x, packed, weight.size(0), bias);
  }
  return mkl_linear(x, packed, weight, bias, rows);
}

// Which product packed_linear multiplies with in this build: "panels", "mkl" or "none" (at::linear).
std::string packed_linear_gemm() {
  switch (gemm()) {
    case Gemm::kPanels: return "panels";
    case Gemm::kMkl: return "mkl";
    default: return "none";
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(kvgraph_cpu, CPU, m) { m.impl("packed_linear", &packed_linear); }

TORCH_LIBRARY_IMPL(kvgraph_cpu, CatchAll, m) { m.impl("packed_linear_gemm", &packed_linear_gemm); }

}  // namespace kvgraph
