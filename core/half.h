// Bit-exact conversions between IEEE binary16 / bfloat16 and float.
//
// Keys and queries arrive from engines in fp16 or bf16; core/ widens them to
// float with these functions so that every implementation (C++, CUDA, Python)
// sees the same float values. Widening is exact; narrowing rounds to nearest
// even, as the hardware converters do.
#pragma once

#include <bit>
#include <cstdint>

namespace eps {

enum class DType : uint8_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kInt32 = 3,
  kInt8 = 4,
  kUInt64 = 5,  // the step counters of the flags buffer only
};

// Size of one element of `dtype` in bytes.
constexpr int DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kInt8:
      return 1;
    case DType::kUInt64:
      return 8;
  }
  return 0;
}

const char* DTypeName(DType dtype);

// Exact widening of a binary16 value (normal, subnormal, zero, Inf and NaN with
// its payload). Inline and without branches on the value, as scoring loops read
// two per channel: the magnitude's bits shifted into a float's place are the
// value scaled by 2^-112 (subnormals included), so one multiply rescales them;
// an all-ones exponent becomes the float's all-ones exponent (Inf, NaN).
inline float HalfToFloat(uint16_t h) {
  const uint32_t magnitude = static_cast<uint32_t>(h & 0x7FFFu) << 13;
  const float scaled = std::bit_cast<float>(magnitude) * 0x1p112f;
  const uint32_t special = (h & 0x7C00u) == 0x7C00u ? 0x7F800000u | magnitude : 0u;
  const uint32_t bits = special != 0u ? special : std::bit_cast<uint32_t>(scaled);
  return std::bit_cast<float>(bits | (static_cast<uint32_t>(h & 0x8000u) << 16));
}
uint16_t FloatToHalf(float value);
// Directed narrowing: the largest binary16 value <= `value` (Down) and the
// smallest >= `value` (Up), as CUDA's __float2half_rd / __float2half_ru. Used
// where a stored 16-bit value must stay a bound (the quest min and max).
uint16_t FloatToHalfDown(float value);
uint16_t FloatToHalfUp(float value);
inline constexpr float kHalfMax = 65504.0f;
float BFloat16ToFloat(uint16_t bits);
uint16_t FloatToBFloat16(float value);

// Widens element `i` of a key or query vector stored as `dtype` (a float type).
inline float LoadAsFloat(const void* data, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(data)[i]);
    case DType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(data)[i]);
    default:
      return static_cast<const float*>(data)[i];
  }
}

}  // namespace eps
