#include "core/half.h"

#include <bit>
#include <cstring>

namespace eps {

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt32:
      return "int32";
    case DType::kInt8:
      return "int8";
    case DType::kUInt64:
      return "uint64";
  }
  return "unknown";
}

uint16_t FloatToHalf(float value) {
  const uint32_t f = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (f >> 16) & 0x8000u;
  const uint32_t abs = f & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u) {  // Inf or NaN.
    return static_cast<uint16_t>(sign | 0x7C00u | (abs > 0x7F800000u ? 0x200u : 0u));
  }
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // Overflow.
  if (abs < 0x38800000u) {                                               // Subnormal half or zero.
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);           // Rounds to zero.
    const uint32_t exponent = abs >> 23;
    const uint32_t mantissa = (abs & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - exponent;  // 14..24
    uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = ((abs >> 13) - (112u << 10));
  const uint32_t rest = abs & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(sign | half);
}

// The neighbours of a binary16 value in its bit pattern: positive values grow
// with their bits, negative ones shrink; ±0 step to the smallest subnormal.
uint16_t FloatToHalfDown(float value) {
  const uint16_t h = FloatToHalf(value);
  if (!(HalfToFloat(h) > value)) return h;  // exact, below, or NaN
  if (h == 0x0000u || h == 0x8000u) return 0x8001u;
  return (h & 0x8000u) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h - 1);
}

uint16_t FloatToHalfUp(float value) {
  const uint16_t h = FloatToHalf(value);
  if (!(HalfToFloat(h) < value)) return h;
  if (h == 0x0000u || h == 0x8000u) return 0x0001u;
  return (h & 0x8000u) ? static_cast<uint16_t>(h - 1) : static_cast<uint16_t>(h + 1);
}

float BFloat16ToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

uint16_t FloatToBFloat16(float value) {
  const uint32_t f = std::bit_cast<uint32_t>(value);
  if ((f & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((f >> 16) | 0x40u);  // NaN
  const uint32_t rounding = 0x7FFFu + ((f >> 16) & 1u);
  return static_cast<uint16_t>((f + rounding) >> 16);
}

}  // namespace eps
