// Byte counts of a step that stop at INT64_MAX instead of wrapping: a request may name
// a context of up to 2^35 tokens, and its KV bytes (tokens x heads x layers x bytes a
// token) can pass 2^63 (signed overflow, undefined, in the step's statistics).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>

namespace eps {

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
