// Byte counts that stop at the type's maximum instead of wrapping: a request's shape can
// ask for more than 2^64 bytes of charges, and a context of up to 2^35 tokens has KV bytes
// (tokens x heads x layers x bytes a token) past 2^63 (signed overflow, undefined, in the
// step's statistics).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>

namespace eps {

// a * b * ... and a + b + ..., at most UINT64_MAX: the sizes of memory charges (a saturated
// one is refused by any limit).
inline uint64_t SaturatingProduct(std::initializer_list<uint64_t> factors) {
  uint64_t product = 1;
  for (const uint64_t f : factors) {
    if (__builtin_mul_overflow(product, f, &product)) return std::numeric_limits<uint64_t>::max();
  }
  return product;
}
inline uint64_t SaturatingSum(std::initializer_list<uint64_t> terms) {
  uint64_t sum = 0;
  for (const uint64_t t : terms) {
    if (__builtin_add_overflow(sum, t, &sum)) return std::numeric_limits<uint64_t>::max();
  }
  return sum;
}

// acc + the product of `factors`, all non-negative, at most INT64_MAX.
inline int64_t SaturatingMulAdd(int64_t acc, std::initializer_list<int64_t> factors) {
  int64_t product = 1;
  for (const int64_t f : factors) {
    if (__builtin_mul_overflow(product, f, &product)) return std::numeric_limits<int64_t>::max();
  }
  int64_t sum = 0;
  if (__builtin_add_overflow(acc, product, &sum)) return std::numeric_limits<int64_t>::max();
  return sum;
}

}  // namespace eps
