// Helpers shared by the core tests: fresh seeds, random keys, exact references.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace eps::testing {

// A fresh seed per run, or EPS_TEST_SEED when set (to replay a failure). Tests
// put it in a SCOPED_TRACE so that a failure prints it.
inline uint64_t TestSeed() {
  if (const char* env = std::getenv("EPS_TEST_SEED")) return std::strtoull(env, nullptr, 10);
  std::random_device device;
  return (static_cast<uint64_t>(device()) << 32) ^ device();
}

inline std::string SeedTrace(uint64_t seed) {
  return "seed=" + std::to_string(seed) + " (replay with EPS_TEST_SEED=" + std::to_string(seed) +
         ")";
}

inline std::vector<float> GaussianVector(std::mt19937_64& rng, size_t n, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// Σ_i (q·k_i)² over keys [n, d], in double.
inline double QuadForm(std::span<const float> keys, std::span<const float> q, int d) {
  double sum = 0;
  for (size_t t = 0; t < keys.size() / d; ++t) {
    double dot = 0;
    for (int i = 0; i < d; ++i) dot += double{q[i]} * keys[t * d + i];
    sum += dot * dot;
  }
  return sum;
}

inline double MaxDot(std::span<const float> keys, std::span<const float> q, int d) {
  double best = -1e300;
  for (size_t t = 0; t < keys.size() / d; ++t) {
    double dot = 0;
    for (int i = 0; i < d; ++i) dot += double{q[i]} * keys[t * d + i];
    best = std::max(best, dot);
  }
  return best;
}

inline double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * (v.size() - 1))];
}

}  // namespace eps::testing
