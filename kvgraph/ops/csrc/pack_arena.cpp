// kvgraph's arena for packed weights.
//
// A decode step reads every weight once, one GEMM after the other, so a step streams the packs
// in the order the graph first multiplied them, which is the order they were packed in. Carved one
// after another from large chunks, they form one run of memory instead of one allocation each;
// each chunk is aligned to 2 MB and advised MADV_HUGEPAGE (Linux), so that with transparent huge
// pages on `madvise` (a common default) the reads of a step take a TLB miss per 2 MB instead of
// per 4 KB. On a 2-core Zen 3 VM the 56 GEMMs of a llama-56m decode step took 0.94-0.98x the time
// at 8-32 rows with their packs so placed (0.99 at 64), and a decode-heavy run, with the cache pool
// in huge pages too (kvgraph/cache/pool_memory.py), 0.91x (benchmarks/RESULTS.md).

#include "pack_arena.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvgraph {
namespace arena {
namespace {

constexpr int64_t kHuge = int64_t{2} << 20;  // bytes of a transparent huge page on x86-64
constexpr int64_t kChunk = int64_t{32} << 20;  // bytes of a chunk, unless one pack needs more
constexpr int64_t kAlign = 4096;  // each pack starts on a page of its own

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

bool enabled() {
  const char* env = std::getenv("KVGRAPH_HUGE_PAGES");
  return env == nullptr || std::string(env) != "0";
}

struct Arena {
  std::mutex mutex;
  at::Tensor chunk;  // bytes, from ATen's allocator; packs carved from it hold it too
  char* base = nullptr;  // its first 2 MB boundary
  int64_t size = 0, used = 0;
};

Arena& arena() {
  static Arena* a = new Arena();  // never destroyed: packs may outlive static destruction
  return *a;
}

}  // namespace

at::Tensor zeros(at::IntArrayRef sizes) {
  const at::TensorOptions options = at::TensorOptions().dtype(at::kFloat);
  if (!enabled()) return at::zeros(sizes, options);
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  const int64_t bytes = round_up(std::max<int64_t>(numel, 1) * static_cast<int64_t>(sizeof(float)), kAlign);
  Arena& a = arena();
  std::lock_guard<std::mutex> guard(a.mutex);
  if (!a.chunk.defined() || a.used + bytes > a.size) {
    a.size = std::max(kChunk, round_up(bytes, kHuge));
    a.chunk = at::empty({a.size + kHuge}, at::TensorOptions().dtype(at::kByte));  // not touched yet
    const auto start = reinterpret_cast<std::uintptr_t>(a.chunk.data_ptr());
    a.base = reinterpret_cast<char*>(round_up(static_cast<int64_t>(start), kHuge));
    a.used = 0;
#if defined(MADV_HUGEPAGE)
    madvise(a.base, a.size, MADV_HUGEPAGE);  // advice: where THP is off, the pages stay 4 KB
#endif
  }
  char* ptr = a.base + a.used;
  a.used += bytes;
  std::memset(ptr, 0, bytes);
  at::Tensor chunk = a.chunk;
  return at::from_blob(ptr, sizes, [chunk](void*) mutable { chunk.reset(); }, options);
}

}  // namespace arena
}  // namespace kvgraph

// kvgraph_cpu::pack_arena_zeros: the arena's allocation as an op, for tests to see where packs land.
TORCH_LIBRARY_IMPL(kvgraph_cpu, CatchAll, m) { m.impl("pack_arena_zeros", &kvgraph::arena::zeros); }
