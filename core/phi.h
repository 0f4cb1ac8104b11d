// Φ: the per-(layer, KV head) d×m random sign matrix of the JL sketch.
//
// Φ[i][j] = s(seed, layer, kv_head, i*m + j) / sqrt(m), where s is ±1 taken
// from the top bit of a counter-based hash (SplitMix64's finaliser). Every
// element is a pure function of its coordinates, so the C++, CUDA and Python
// implementations generate bit-identical matrices in any order, on any
// platform. docs/phi.md gives the algorithm and test vectors.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "core/layout.h"

namespace eps {

// SplitMix64's output function (Steele, Lea, Flood 2014): a bijective mixer.
constexpr uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 31;
  return x;
}

inline constexpr uint64_t kGolden64 = 0x9E3779B97F4A7C15ull;

// The 64-bit hash behind Φ[layer, kv_head][i][j] with index = i*m + j.
// Requires layer < 2^16, kv_head < 2^16, index < 2^32.
constexpr uint64_t PhiHash(uint64_t seed, uint32_t layer, uint32_t kv_head, uint32_t index) {
  const uint64_t key = Mix64(seed + kGolden64);
  const uint64_t counter =
      (static_cast<uint64_t>(layer) << 48) | (static_cast<uint64_t>(kv_head) << 32) | index;
  return Mix64(key ^ (counter * kGolden64));
}

// +1 or -1: the sign of one element of Φ.
constexpr int PhiSign(uint64_t seed, uint32_t layer, uint32_t kv_head, uint32_t index) {
  return (PhiHash(seed, layer, kv_head, index) >> 63) ? -1 : 1;
}

// 1/sqrt(m) rounded to float: IEEE sqrt and division are correctly rounded, so
// the value is the same everywhere.
float PhiScale(int m);

// Φ for every (layer, KV head) of a model, generated once.
// Thread safety: immutable after construction; safe to share.
class PhiBank {
 public:
  static absl::StatusOr<PhiBank> Create(uint64_t seed, int num_layers, int num_kv_heads,
                                        int head_dim, int sketch_dim);

  // Row-major d×m matrix of (layer, kv_head): element [i*m + j].
  std::span<const float> Matrix(int layer, int kv_head) const {
    const size_t size = static_cast<size_t>(head_dim_) * sketch_dim_;
    return {values_.data() + (static_cast<size_t>(layer) * num_kv_heads_ + kv_head) * size, size};
  }

  // z = Φᵀq for a query (or key) q of length d; z has length m.
  void Project(int layer, int kv_head, std::span<const float> q, std::span<float> z) const;

  uint64_t seed() const { return seed_; }
  int num_layers() const { return num_layers_; }
  int num_kv_heads() const { return num_kv_heads_; }
  int head_dim() const { return head_dim_; }
  int sketch_dim() const { return sketch_dim_; }

 private:
  PhiBank() = default;
  uint64_t seed_ = 0;
  int num_layers_ = 0, num_kv_heads_ = 0, head_dim_ = 0, sketch_dim_ = 0;
  std::vector<float> values_;
};

// OK when `phi` serves `model`: the same seed, d and m, and a matrix for each of its
// (layer, KV head) (a bank built for more layers or KV heads serves it too: each matrix
// depends only on the seed and its own indices).
absl::Status PhiCovers(const PhiBank& phi, const ModelLayout& model);

}  // namespace eps
