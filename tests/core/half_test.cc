#include "core/half.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace eps {
namespace {

TEST(HalfTest, WidensKnownHalfValues) {
  EXPECT_EQ(HalfToFloat(0x3C00), 1.0f);
  EXPECT_EQ(HalfToFloat(0xC000), -2.0f);
  EXPECT_EQ(HalfToFloat(0x7BFF), 65504.0f);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(HalfToFloat(0x0400), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_TRUE(std::isinf(HalfToFloat(0x7C00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7E00)));
  EXPECT_TRUE(std::signbit(HalfToFloat(0x8000)));
}

// The binary16 definition read field by field (IEEE 754: sign, 5-bit exponent
// biased by 15, 10-bit mantissa; exponent 0 subnormal, 31 Inf/NaN), as the
// oracle of the branch-free HalfToFloat.
uint32_t WidenByFields(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return sign | 0x7F800000u | (mantissa << 13);
  if (exponent != 0) return sign | ((exponent + 112) << 23) | (mantissa << 13);
  const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // exact
  return sign | std::bit_cast<uint32_t>(magnitude);
}

TEST(HalfTest, EveryHalfWidensToTheBitsItsFieldsDefine) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    ASSERT_EQ(std::bit_cast<uint32_t>(HalfToFloat(h)), WidenByFields(h)) << std::hex << bits;
  }
}

TEST(HalfTest, EveryFiniteHalfRoundTripsExactly) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    if ((h & 0x7C00) == 0x7C00) continue;  // Inf/NaN
    ASSERT_EQ(FloatToHalf(HalfToFloat(h)), h) << "bits=0x" << std::hex << bits;
  }
}

TEST(HalfTest, NarrowingRoundsToNearestEven) {
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to the even mantissa (1.0).
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
  // 1 + 3·2^-11 is halfway between 1+2^-10 and 1+2^-9: ties to 1+2^-9 (even).
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
  EXPECT_EQ(FloatToHalf(70000.0f), 0x7C00);               // overflow to Inf
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -26)), 0x0000);  // below half the smallest subnormal
}

TEST(HalfTest, DirectedNarrowingBracketsTheValueWithAdjacentHalves) {
  std::mt19937_64 rng(testing::TestSeed());
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  for (int trial = 0; trial < 100000; ++trial) {
    const float x = unit(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 44) - 28);
    const uint16_t down = FloatToHalfDown(x), up = FloatToHalfUp(x);
    ASSERT_LE(HalfToFloat(down), x) << x;
    ASSERT_GE(HalfToFloat(up), x) << x;
    if (HalfToFloat(down) == x) {
      ASSERT_EQ(down, up) << x;
    } else {  // no half lies strictly between them
      ASSERT_GT(HalfToFloat(up), HalfToFloat(down)) << x;
      const float mid = 0.5f * (HalfToFloat(up) + HalfToFloat(down));
      ASSERT_TRUE(FloatToHalf(mid) == down || FloatToHalf(mid) == up) << x;
    }
  }
}

TEST(HalfTest, DirectedNarrowingAtZeroAndTheRangeEnds) {
  EXPECT_EQ(FloatToHalfDown(0.0f), 0x0000);
  EXPECT_EQ(FloatToHalfUp(0.0f), 0x0000);
  EXPECT_EQ(FloatToHalfDown(-1e-9f), 0x8001);  // below zero: the smallest negative subnormal
  EXPECT_EQ(FloatToHalfUp(1e-9f), 0x0001);
  EXPECT_EQ(FloatToHalfUp(-1e-9f), 0x8000);      // -0
  EXPECT_EQ(FloatToHalfDown(70000.0f), 0x7BFF);  // 65504
  EXPECT_EQ(FloatToHalfUp(70000.0f), 0x7C00);    // +inf
  EXPECT_EQ(FloatToHalfDown(-70000.0f), 0xFC00);
  EXPECT_EQ(FloatToHalfUp(1.0f + std::ldexp(1.0f, -12)), 0x3C01);
  EXPECT_EQ(FloatToHalfDown(1.0f + std::ldexp(1.0f, -12)), 0x3C00);
}

TEST(BFloat16Test, WidensAndRoundsToNearestEven) {
  EXPECT_EQ(BFloat16ToFloat(0x3F80), 1.0f);
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3F80);
  // 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties to even (1).
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
}

TEST(DTypeTest, SizesMatchTheContract) {
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4);
  EXPECT_EQ(DTypeSize(DType::kFloat16), 2);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2);
  EXPECT_EQ(DTypeSize(DType::kInt32), 4);
  EXPECT_EQ(DTypeSize(DType::kInt8), 1);
}

}  // namespace
}  // namespace eps
