#include "core/phi.h"

#include <bit>
#include <cmath>
#include <cstdint>

#include "gtest/gtest.h"

namespace eps {
namespace {

// The test vectors of docs/phi.md; the CUDA and Python generators check the same.
struct PhiVector {
  uint64_t seed;
  uint32_t layer, kv_head, index;
  uint64_t hash;
  int sign;
};
constexpr PhiVector kVectors[] = {
    {0ull, 0, 0, 0u, 0x48218226FF3CD4BFull, 1},
    {0ull, 0, 0, 1u, 0x0397AB29740681D9ull, 1},
    {42ull, 3, 1, 17u, 0xD24484C827FE9E72ull, -1},
    {42ull, 31, 7, 1023u, 0x23451177BAC1C419ull, 1},
    {3735928559ull, 65535, 65535, 4294967295u, 0xFB6FB5EB66C208D4ull, -1},
    {1ull, 1, 0, 5u, 0x88FA9F207C4DADDDull, -1},
    {123456789ull, 12, 3, 511u, 0x4DF00F40D90D3A4Aull, 1},
    {18446744073709551615ull, 0, 2, 63u, 0xE29B1B53F03F928Cull, -1},
};

TEST(PhiTest, HashMatchesTestVectorsBitExactly) {
  for (const PhiVector& v : kVectors) {
    EXPECT_EQ(PhiHash(v.seed, v.layer, v.kv_head, v.index), v.hash)
        << "seed=" << v.seed << " layer=" << v.layer << " kv_head=" << v.kv_head
        << " index=" << v.index;
    EXPECT_EQ(PhiSign(v.seed, v.layer, v.kv_head, v.index), v.sign);
  }
}

TEST(PhiTest, SignPatternMatchesTestVector) {
  // Signs of Φ(seed=42, layer 0, kv_head 0), indices 0..31 (rows 0-3 for m=8).
  const char* expected = "--+----+-+-+-+-++-+++-++++--+++-";
  for (uint32_t i = 0; i < 32; ++i) {
    EXPECT_EQ(PhiSign(42, 0, 0, i), expected[i] == '+' ? 1 : -1) << "index " << i;
  }
}

TEST(PhiTest, ScaleIsCorrectlyRoundedInverseSqrt) {
  EXPECT_EQ(std::bit_cast<uint32_t>(PhiScale(4)), std::bit_cast<uint32_t>(0.5f));
  EXPECT_EQ(std::bit_cast<uint32_t>(PhiScale(8)), 0x3EB504F3u);  // 0x1.6a09e6p-2
  EXPECT_EQ(std::bit_cast<uint32_t>(PhiScale(16)), std::bit_cast<uint32_t>(0.25f));
}

TEST(PhiTest, BankHoldsScaledSignsInRowMajorOrder) {
  auto bank = PhiBank::Create(42, 2, 3, 16, 8);
  ASSERT_TRUE(bank.ok()) << bank.status();
  for (int layer = 0; layer < 2; ++layer) {
    for (int head = 0; head < 3; ++head) {
      const auto phi = bank->Matrix(layer, head);
      ASSERT_EQ(phi.size(), 16u * 8u);
      for (uint32_t i = 0; i < phi.size(); ++i) {
        EXPECT_EQ(phi[i], PhiSign(42, layer, head, i) * PhiScale(8));
      }
    }
  }
}

TEST(PhiTest, SignsAreBalancedAndDifferAcrossHeads) {
  auto bank = PhiBank::Create(7, 1, 2, 128, 16);
  ASSERT_TRUE(bank.ok());
  const auto a = bank->Matrix(0, 0);
  const auto b = bank->Matrix(0, 1);
  int positive = 0, same = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    positive += a[i] > 0;
    same += a[i] == b[i];
  }
  // 2048 fair coins: mean 1024, sd 22.6; 6 sd either way.
  EXPECT_NEAR(positive, 1024, 136);
  EXPECT_NEAR(same, 1024, 136);
}

TEST(PhiTest, ProjectComputesPhiTransposeTimesQuery) {
  auto bank = PhiBank::Create(3, 1, 1, 8, 4);
  ASSERT_TRUE(bank.ok());
  const float q[8] = {1, -2, 3, 0.5f, 0, 1, -1, 2};
  float z[4];
  bank->Project(0, 0, q, z);
  const auto phi = bank->Matrix(0, 0);
  for (int j = 0; j < 4; ++j) {
    double expected = 0;
    for (int i = 0; i < 8; ++i) expected += phi[i * 4 + j] * q[i];
    EXPECT_NEAR(z[j], expected, 1e-5);
  }
}

TEST(PhiTest, CreateRejectsOutOfRangeShapes) {
  EXPECT_FALSE(PhiBank::Create(0, 0, 1, 64, 8).ok());
  EXPECT_FALSE(PhiBank::Create(0, 1, 70000, 64, 8).ok());
  EXPECT_FALSE(PhiBank::Create(0, 1, 1, 0, 8).ok());
  const auto bad = PhiBank::Create(0, 1, 1, 64, 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("sketch_dim=0"), std::string::npos) << bad.status();
}

}  // namespace
}  // namespace eps
