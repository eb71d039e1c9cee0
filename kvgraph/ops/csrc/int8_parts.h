// A float row as three int8 parts for AVX-512 VNNI (VPDPBUSD), exact to float32: x / sq = h + m / 254
// + l / 254^2 with h, m, l int8 and sq = max|x| / 127, an error below 2^-23 of max|x|. Used by the
// int8 KV decode of csrc/ragged_attention_cpu.cpp (queries) and by int8_matvec in
// csrc/int8_linear_cpu.cpp (activations).
#pragma once

#include <cmath>
#include <cstdint>

namespace kvgraph {
namespace int8_parts {

constexpr int64_t kParts = 3;      // int8 parts of a row: h, m, l
constexpr double kRadix = 254.0;   // x / sq = h + m / kRadix + l / kRadix^2

// Whether this CPU runs VPDPBUSD (an AVX-512 build may run on one without it, e.g. Skylake-X).
inline bool has_vnni() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  static const bool ok = __builtin_cpu_supports("avx512vnni");
  return ok;
#else
  return false;
#endif
}

// rest[0:n] (a row divided by sq, in [-127, 127]) into its kParts parts: part p at parts + p * stride.
// rest is used up; scratch holds n doubles. Each part leaves a remainder in [-0.5, 0.5], the next
// part's unit (rounded apart from the int8 stores, which may alias anything, so that both loops
// vectorize).
inline void split(double* rest, double* scratch, int64_t n, int8_t* parts, int64_t stride) {
  for (int64_t p = 0; p < kParts; ++p) {
    for (int64_t i = 0; i < n; ++i) {
      scratch[i] = std::nearbyint(rest[i]);
      rest[i] = (rest[i] - scratch[i]) * kRadix;
    }
    int8_t* part = parts + p * stride;
    for (int64_t i = 0; i < n; ++i) part[i] = static_cast<int8_t>(scratch[i]);
  }
}

}  // namespace int8_parts
}  // namespace kvgraph
