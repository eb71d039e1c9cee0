// kvgraph_cpu::packed_linear: kvgraph::linear's float32 CPU path (kvgraph/ops/linear.py says why):
// y = x @ W^T (+ bias) with W packed once, for up to max_packed_rows rows:
//   - on an AVX-512 build, into kvgraph's panels, multiplied by panel::linear
//     (csrc/panel_gemm_cpu.cpp: 1.3-1.5x MKL's packed GEMM at 8-16 rows, 1.1-1.3x at 32, within
//     10% of it at 1 and at 64-512 rows);
//   - on an AVX2 build, on a CPU not made by Intel, into the same panels: on a Zen 3, 0.51-0.58x
//     oneDNN's packed product's time at 1-16 rows, 0.77x at 32-64, 0.87x at 96, and with x blocked
//     for the caches 0.81-0.96x oneDNN's product with the plain weight at 96-2048 rows (x is packed
//     so from 16 rows now: csrc/panel_gemm_cpu.cpp);
//   - else, on a CPU not made by Intel, into oneDNN's blocked layout for pack_rows rows
//     (mkldnn::_reorder_linear_weight) and multiplied with mkldnn::_linear_pointwise: on a Zen 3
//     (AVX2) MKL's packed GEMM does not run its fast code, and oneDNN's JIT kernels were 1.6-2x as
//     fast at 3-64 rows, 1.3x at 128, equal from 512 (benchmarks/RESULTS.md);
//   - else by MKL for pack_rows rows (mkl::_mkl_reorder_linear_weight) and multiplied with
//     mkl::_mkl_linear, whose packed B serves any row count.
// KVGRAPH_PACKED_GEMM (auto, panels, onednn, mkl; read when a weight is packed) picks another
// product this build and CPU have. Other dtypes, autograd, no rows, more than max_packed_rows
// rows, and a build with none of them run at::linear.
//
// The pack of each weight is kept here, keyed by the weight's TensorImpl and valid while that
// tensor lives and its version counter has not moved (an inference tensor has none: packed once).
// A new pack is first compared with at::linear at kCheckRows rows (for MKL and oneDNN: not the
// rows it was packed for); a weight whose pack disagrees runs at::linear from then on, with a
// warning. A compiled graph calls this op as an extern kernel: no Python between the graph and
// the GEMM.

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
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvgraph {
namespace {

constexpr int64_t kCheckRows = 3;

// The packed products: kvgraph's panels, oneDNN's, MKL's, or none (at::linear).
enum class Gemm { kPanels, kOnednn, kMkl, kNone };

struct Pack {
  c10::weak_intrusive_ptr<c10::TensorImpl> owner;  // the weight this pack was made from
  int64_t version;                                 // its version then (-1: an inference tensor)
  Gemm gemm;                                       // the product it was packed for
  at::Tensor packed;                               // undefined: the packed product disagreed, use at::linear
};

bool intel_cpu() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  return __builtin_cpu_is("intel");
#else
  return false;
#endif
}

bool has_onednn() { return at::globalContext().hasMKLDNN() && at::globalContext().userEnabledMkldnn(); }

// Whether this build and CPU have the product g.
bool available(Gemm g) {
  switch (g) {
    case Gemm::kPanels: return panel::available();
    case Gemm::kOnednn: return has_onednn();
    case Gemm::kMkl: return at::globalContext().hasMKL();
    default: return true;
  }
}

bool avx512_build() {
#if defined(CPU_CAPABILITY_AVX512)
  return true;
#else
  return false;
#endif
}

// The product a weight packed now gets: KVGRAPH_PACKED_GEMM's, else the fastest this build and CPU
// have (see the top of this file).
Gemm gemm() {
  const char* env = std::getenv("KVGRAPH_PACKED_GEMM");
  const std::string choice = env && *env ? env : "auto";
  if (choice == "auto") {
    if (available(Gemm::kPanels) && (avx512_build() || !intel_cpu())) return Gemm::kPanels;
    if (!intel_cpu() && available(Gemm::kOnednn)) return Gemm::kOnednn;
    return available(Gemm::kMkl) ? Gemm::kMkl : Gemm::kNone;
  }
  TORCH_CHECK_VALUE(choice == "panels" || choice == "onednn" || choice == "mkl", "KVGRAPH_PACKED_GEMM=", choice,
                    " is not one of auto, panels, onednn, mkl");
  const Gemm g = choice == "panels" ? Gemm::kPanels : choice == "onednn" ? Gemm::kOnednn : Gemm::kMkl;
  TORCH_CHECK_VALUE(available(g), "KVGRAPH_PACKED_GEMM=", choice, " is not available in this build or on this CPU",
                    g == Gemm::kPanels ? " (kvgraph's panels need an AVX2 or AVX-512 build)" : "");
  return g;
}

const char* name_of(Gemm g) {
  switch (g) {
    case Gemm::kPanels: return "panels";
    case Gemm::kOnednn: return "onednn";
    case Gemm::kMkl: return "mkl";
    default: return "none";
  }
}

std::mutex packs_mutex;
std::unordered_map<const c10::TensorImpl*, Pack> packs;

at::Tensor onednn_reorder(const at::Tensor& weight, int64_t rows) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_reorder_linear_weight", "")
                       .typed<at::Tensor(const at::Tensor&, std::optional<int64_t>)>();
  return op.call(weight, rows);
}

// x [..., K] @ the oneDNN pack of a weight of n rows (+ bias) -> [..., n].
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<c10::Scalar>>,
                                         std::optional<c10::string_view>)>();
  const int64_t k = x.size(-1);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  const at::Tensor out = op.call(x.reshape({-1, k}).contiguous(), packed, bias, "none",
                                 c10::List<std::optional<c10::Scalar>>(), "");
  return out.view(shape);
}

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

// x [..., K] @ weight^T (+ bias) by the product g from weight's pack (g not kNone).
at::Tensor product(Gemm g, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias) {
  switch (g) {
    case Gemm::kPanels: return panel::linear(x, packed, weight.size(0), bias);
    case Gemm::kOnednn: return onednn_linear(x, packed, weight.size(0), bias);
    default: return mkl_linear(x, packed, weight, bias, x.numel() / x.size(-1));
  }
}

int64_t version_of(const at::Tensor& weight) { return weight.is_inference() ? -1 : weight._version(); }

// The pack of weight (packing it if it has none, or if it changed since): its product and the
// packed weight, undefined for at::linear.
std::pair<Gemm, at::Tensor> pack_of(const at::Tensor& weight, int64_t pack_rows) {
  const c10::TensorImpl* key = weight.unsafeGetTensorImpl();
  const int64_t version = version_of(weight);
  std::lock_guard<std::mutex> guard(packs_mutex);
  auto found = packs.find(key);
  if (found != packs.end() && !found->second.owner.expired() && found->second.version == version) {
    return {found->second.gemm, found->second.packed};
  }
  // drop the packs of weights that are gone (the key of one may be this weight's, reused)
  for (auto it = packs.begin(); it != packs.end();) {
    it = it->second.owner.expired() ? packs.erase(it) : std::next(it);
  }
  const Gemm g = gemm();
  at::Tensor packed;
  if (g != Gemm::kNone) {
    const at::Tensor w = weight.detach().contiguous();
    packed = g == Gemm::kPanels ? panel::pack(w) : g == Gemm::kOnednn ? onednn_reorder(w, pack_rows) : mkl_reorder(w, pack_rows);
    const at::Tensor x = at::sin(at::arange(kCheckRows * w.size(1), w.options())).view({kCheckRows, w.size(1)});
    const at::Tensor want = at::linear(x, w);
    const at::Tensor got = product(g, x, packed, w, std::nullopt);
    const double scale = std::max(want.abs().max().item<double>(), 1.0);
    if (!at::allclose(got, want, 1e-4, 1e-4 * scale)) {
      TORCH_WARN("the ", name_of(g), " packed GEMM with a weight of shape ", w.sizes(), " differs from F.linear at ",
                 kCheckRows, " rows; this weight uses F.linear instead");
      packed = at::Tensor();
    }
  }
  packs.insert_or_assign(key, Pack{c10::weak_intrusive_ptr<c10::TensorImpl>(weight.getIntrusivePtr()), version, g, packed});
  return {g, packed};
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         int64_t max_packed_rows, int64_t pack_rows) {
  const int64_t k = x.dim() > 0 ? x.size(-1) : 0;
  const int64_t rows = k > 0 ? x.numel() / k : 0;
  if (rows == 0 || rows > max_packed_rows || x.scalar_type() != at::kFloat || weight.scalar_type() != at::kFloat ||
      weight.dim() != 2 || !x.device().is_cpu() || !weight.device().is_cpu() || c10::GradMode::is_enabled()) {
    return at::linear(x, weight, bias);
  }
  const auto [g, packed] = pack_of(weight, pack_rows);
  if (!packed.defined()) {
    return at::linear(x, weight, bias);
  }
  return product(g, x, packed, weight, bias);
}

// Which product packed_linear multiplies a weight packed now with: "panels", "onednn", "mkl" or
// "none" (at::linear).
std::string packed_linear_gemm() { return name_of(gemm()); }

}  // namespace

TORCH_LIBRARY_IMPL(kvgraph_cpu, CPU, m) { m.impl("packed_linear", &packed_linear); }

TORCH_LIBRARY_IMPL(kvgraph_cpu, CatchAll, m) { m.impl("packed_linear_gemm", &packed_linear_gemm); }

}  // namespace kvgraph
