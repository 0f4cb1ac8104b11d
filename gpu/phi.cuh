// Φ on the device: the same counter-based generator as core/phi.h, bit for bit
// (docs/phi.md), so kernels can build z = Φᵀq without a copy of Φ.
#pragma once

#include <cstdint>

namespace eps::gpu {

__host__ __device__ inline uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

__host__ __device__ inline uint64_t PhiHash(uint64_t seed, uint32_t layer, uint32_t kv_head,
                                            uint32_t index) {
  constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
  const uint64_t key = Mix64(seed + kGolden);
  const uint64_t counter =
      (static_cast<uint64_t>(layer) << 48) | (static_cast<uint64_t>(kv_head) << 32) | index;
  return Mix64(key ^ (counter * kGolden));
}

// Φ[layer, kv_head][i][j] with index = i*m + j; `scale` is 1/sqrt(m) computed on
// the host (core PhiScale), so the device never rounds it differently.
__host__ __device__ inline float PhiElement(uint64_t seed, uint32_t layer, uint32_t kv_head,
                                            uint32_t index, float scale) {
  return (PhiHash(seed, layer, kv_head, index) >> 63) ? -scale : scale;
}

}  // namespace eps::gpu
