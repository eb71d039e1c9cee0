// Memory for packed weights (csrc/pack_arena.cpp): packs made one after another lie next to each
// other, in 2 MB-aligned chunks that ask Linux for transparent huge pages.
#pragma once

#include <ATen/core/Tensor.h>

namespace kvgraph {
namespace arena {

// A zeroed float32 tensor of `sizes` from the arena, or from ATen's allocator when
// KVGRAPH_HUGE_PAGES=0 (read at every call). The tensor keeps its chunk alive.
at::Tensor zeros(at::IntArrayRef sizes);

}  // namespace arena
}  // namespace kvgraph
