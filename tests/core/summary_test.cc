#include "core/summary.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/half.h"
#include "core/layout.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace eps {
namespace {

using testing::GaussianVector;

ModelLayout SmallModel(int d = 32, int m = 8) {
  ModelLayout model;
  model.num_layers = 2;
  model.num_q_heads = 4;
  model.num_kv_heads = 2;
  model.head_dim = d;
  model.sketch_dim = m;
  model.phi_seed = 11;
  model.features = {.key_sum = true, .principal = true, .quest = true};
  return model;
}

class SummaryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = testing::TestSeed();
    rng_.seed(seed_);
  }
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

TEST_F(SummaryTest, GramEqualsSketchOfKeyCovariance) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  const ModelLayout model = SmallModel();
  auto phi = PhiBank::Create(model.phi_seed, 2, 2, model.head_dim, model.sketch_dim);
  ASSERT_TRUE(phi.ok());
  SummaryWriter writer(model, *phi);
  std::vector<float> record(writer.layout().record_words);
  EXPECT_TRUE(writer.Reset(record).ok());
  const int n = 50, d = model.head_dim, m = model.sketch_dim;
  const std::vector<float> keys = GaussianVector(rng_, n * d);
  ASSERT_TRUE(writer.Append(record, 1, 1, {keys.data(), DType::kFloat32, n, d}).ok());
  const auto mat = phi->Matrix(1, 1);
  for (int a = 0; a < m; ++a) {
    for (int b = a; b < m; ++b) {
      double expected = 0;
      for (int t = 0; t < n; ++t) {
        double ya = 0, yb = 0;
        for (int i = 0; i < d; ++i) {
          ya += mat[i * m + a] * keys[t * d + i];
          yb += mat[i * m + b] * keys[t * d + i];
        }
        expected += ya * yb;
      }
      EXPECT_NEAR(record[PackedIndex(m, a, b)], expected, 1e-4 * (1 + std::abs(expected)));
    }
  }
}

TEST_F(SummaryTest, NormsCountSumAndQuestRangeMatchKeys) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  const ModelLayout model = SmallModel();
  auto phi = PhiBank::Create(model.phi_seed, 2, 2, model.head_dim, model.sketch_dim);
  SummaryWriter writer(model, *phi);
  const SummaryLayout& s = writer.layout();
  std::vector<float> record(s.record_words);
  EXPECT_TRUE(writer.Reset(record).ok());
  const int n = 37, d = model.head_dim;
  const std::vector<float> keys = GaussianVector(rng_, n * d, 2.0f);
  ASSERT_TRUE(writer.Append(record, 0, 0, {keys.data(), DType::kFloat32, n, d}).ok());
  double fro2 = 0, max_norm = 0;
  for (int t = 0; t < n; ++t) {
    double n2 = 0;
    for (int i = 0; i < d; ++i) n2 += double{keys[t * d + i]} * keys[t * d + i];
    fro2 += n2;
    max_norm = std::max(max_norm, std::sqrt(n2));
  }
  EXPECT_NEAR(record[s.fro2], fro2, 1e-4 * fro2);
  EXPECT_NEAR(record[s.max_norm], max_norm, 1e-5 * max_norm);
  EXPECT_EQ(record[s.count], n);
  for (int i = 0; i < d; ++i) {
    double sum = 0;
    float lo = std::numeric_limits<float>::infinity(), hi = -lo;
    for (int t = 0; t < n; ++t) {
      sum += keys[t * d + i];
      lo = std::min(lo, keys[t * d + i]);
      hi = std::max(hi, keys[t * d + i]);
    }
    EXPECT_NEAR(record[s.key_sum + i], sum, 1e-4 * (1 + std::abs(sum)));
    // binary16, rounded outward: the nearest half at or beyond the true extreme.
    EXPECT_EQ(QuestMin(record, s, i), HalfToFloat(FloatToHalfDown(lo)));
    EXPECT_EQ(QuestMax(record, s, i), HalfToFloat(FloatToHalfUp(hi)));
    EXPECT_LE(QuestMin(record, s, i), lo);
    EXPECT_GE(QuestMax(record, s, i), hi);
  }
}

TEST_F(SummaryTest, AppendingInPiecesEqualsAppendingAtOnce) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  const ModelLayout model = SmallModel();
  auto phi = PhiBank::Create(model.phi_seed, 2, 2, model.head_dim, model.sketch_dim);
  SummaryWriter writer(model, *phi);
  const int d = model.head_dim;
  const std::vector<float> keys = GaussianVector(rng_, 20 * d);
  std::vector<float> once(writer.layout().record_words), pieces(once.size());
  EXPECT_TRUE(writer.Reset(once).ok());
  EXPECT_TRUE(writer.Reset(pieces).ok());
  ASSERT_TRUE(writer.Append(once, 0, 1, {keys.data(), DType::kFloat32, 20, d}).ok());
  for (int t = 0; t < 20; ++t) {  // one token at a time, as decode writes them
    ASSERT_TRUE(writer.Append(pieces, 0, 1, {keys.data() + t * d, DType::kFloat32, 1, d}).ok());
  }
  EXPECT_EQ(once, pieces);  // same order of float additions: bit-identical
}

// The quest8 part of keys quantized at once at the scale of the largest channel
// magnitude: what an incremental writer must arrive at, whatever the order.
struct Quest8Expected {
  float scale = 0.0f;
  std::vector<int> lo, hi;
};
Quest8Expected OfflineQuest8(const std::vector<float>& keys, int n, int d) {
  Quest8Expected e;
  float amax = 0.0f;
  for (int t = 0; t < n * d; ++t) amax = std::max(amax, std::abs(keys[t]));
  e.scale = amax > 0.0f ? Quest8ScaleFor(amax) : 0.0f;
  e.lo.assign(d, 127);
  e.hi.assign(d, -128);
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < d; ++i) {
      // In double: exact, even where the float quotient falls below the float range.
      const double x = e.scale > 0.0f ? double{keys[t * d + i]} / e.scale : 0.0;
      e.lo[i] = std::min(e.lo[i], static_cast<int>(std::floor(x)));
      e.hi[i] = std::max(e.hi[i], static_cast<int>(std::ceil(x)));
    }
  }
  return e;
}

TEST(Quest8ScaleTest, IsTheSmallestPowerOfTwoThatCovers) {
  for (float amax : {1e-30f, 0.3f, 1.0f, 126.9f, 127.0f, 127.1f, 254.0f, 254.5f, 3e38f}) {
    const float s = Quest8ScaleFor(amax);
    int e = 0;
    EXPECT_EQ(std::frexp(s, &e), 0.5f) << amax;  // a power of two
    EXPECT_GE(127.0f * s, amax) << amax;
    EXPECT_LT(127.0f * (s / 2), amax) << amax;
  }
  EXPECT_EQ(Quest8ScaleFor(127.0f), 1.0f);
  EXPECT_EQ(Quest8ScaleFor(127.5f), 2.0f);
  EXPECT_EQ(Quest8ScaleFor(1e-45f), std::ldexp(1.0f, -149));  // the smallest float
}

// One key at a time, in random orders and with keys that grow (so the scale
// steps up several times, by one and by many powers of two), the quest8 part
// equals the offline quantization bit for bit, and brackets every key.
TEST_F(SummaryTest, Quest8AppendedInAnyOrderEqualsTheOfflineQuantization) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  ModelLayout model = SmallModel();
  model.features.quest8 = true;
  auto phi = PhiBank::Create(model.phi_seed, 2, 2, model.head_dim, model.sketch_dim);
  SummaryWriter writer(model, *phi);
  const SummaryLayout& s = writer.layout();
  const int d = model.head_dim;
  for (int trial = 0; trial < 48; ++trial) {
    const int n = 1 + trial % 32;
    std::vector<float> keys = GaussianVector(rng_, n * d);
    for (int t = 0; t < n; ++t) {  // magnitudes from 1e-3 to 1e4, some keys zero
      const float grow = std::pow(10.0f, -3.0f + 7.0f * t / n) * (trial % 5 == 0 ? 0.0f : 1.0f);
      for (int i = 0; i < d; ++i) keys[t * d + i] *= t % 7 == 3 ? 0.0f : grow;
    }
    if (trial >= 40) {  // channels whose quotient by the scale falls below the float range
      for (int t = 0; t < n; ++t) {
        for (int i = 0; i < d; ++i) keys[t * d + i] *= 1e-30f;
      }
      keys[0] = trial % 2 ? 6e4f : -5e4f;  // within the 16-bit part's range
      keys[1] = trial % 2 ? -3e-43f : 2e-44f;
    }
    const Quest8Expected want = OfflineQuest8(keys, n, d);
    std::vector<int> order(n);
    for (int t = 0; t < n; ++t) order[t] = t;
    for (int shuffle = 0; shuffle < 3; ++shuffle) {
      if (shuffle == 1) std::reverse(order.begin(), order.end());
      if (shuffle == 2) std::shuffle(order.begin(), order.end(), rng_);
      std::vector<float> record(s.record_words);
      EXPECT_TRUE(writer.Reset(record).ok());
      for (int t : order) {
        ASSERT_TRUE(writer.Append(record, 0, 1, {keys.data() + t * d, DType::kFloat32, 1, d}).ok());
      }
      ASSERT_EQ(Quest8Scale(record, s), want.scale) << "trial " << trial;
      for (int i = 0; i < d; ++i) {
        ASSERT_EQ(Quest8MinCode(record, s, i), want.lo[i]) << "trial " << trial << " i " << i;
        ASSERT_EQ(Quest8MaxCode(record, s, i), want.hi[i]) << "trial " << trial << " i " << i;
        for (int t = 0; t < n; ++t) {
          ASSERT_LE(Quest8MinCode(record, s, i) * want.scale, keys[t * d + i]);
          ASSERT_GE(Quest8MaxCode(record, s, i) * want.scale, keys[t * d + i]);
        }
      }
      // The parts before quest8 are those of a record without it.
      ASSERT_GE(Quest8MinCode(record, s, 0), -127);
    }
  }
}

// Both quest parts contain every key the writer accepts, in exact arithmetic, at every
// magnitude: subnormal floats (below binary16's least subnormal, so rounded out to ±2^-24),
// signed zeros, the binary16 limit ±65504, and for quest8 alone keys far beyond it, as
// float32, float16 or bfloat16 keys appended in runs of any length.
TEST_F(SummaryTest, QuestPartsContainEveryAcceptedKeyAtEveryMagnitude) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int trial = 0; trial < 300; ++trial) {
    ModelLayout model = SmallModel(8 << (trial % 3), 4);
    const bool half_part = trial % 2 == 0;
    model.features = {.key_sum = false, .principal = false, .quest = half_part, .quest8 = true};
    auto phi = PhiBank::Create(model.phi_seed, 2, 2, model.head_dim, model.sketch_dim);
    const SummaryWriter writer(model, *phi);
    const SummaryLayout& s = writer.layout();
    const int d = model.head_dim;
    const int n = 1 + static_cast<int>(rng_() % 40);
    const float limit = half_part ? kHalfMax : 1e15f;
    const DType dtype = static_cast<DType>(rng_() % 3);
    std::vector<float> keys(static_cast<size_t>(n) * d);
    for (float& x : keys) {
      const int pick = static_cast<int>(rng_() % 6);
      x = pick == 0   ? (rng_() % 2 ? limit : -limit)
          : pick == 1 ? (rng_() % 2 ? 0.0f : -0.0f)
                      : normal(rng_) * std::ldexp(1.0f, -149 + static_cast<int>(rng_() % 200));
      x = std::clamp(x, -limit, limit);
      if (dtype == DType::kFloat16) x = HalfToFloat(FloatToHalf(x));
      if (dtype == DType::kBFloat16) x = BFloat16ToFloat(FloatToBFloat16(x));
      if (std::abs(x) > limit) x = std::copysign(65280.0f, x);  // bfloat16 rounded 65504 up
    }
    std::vector<float> record(s.record_words);
    ASSERT_TRUE(writer.Reset(record).ok());
    for (int t = 0; t < n;) {
      const int run = std::min(n - t, 1 + static_cast<int>(rng_() % 8));
      ASSERT_TRUE(writer.Append(record, 1, 0, {keys.data() + t * d, DType::kFloat32, run, 0}).ok())
          << "trial " << trial;
      t += run;
    }
    const double scale = Quest8Scale(record, s);
    for (int t = 0; t < n; ++t) {
      for (int i = 0; i < d; ++i) {
        const double k = keys[t * d + i];
        ASSERT_LE(Quest8MinCode(record, s, i) * scale, k) << "trial " << trial << " key " << t;
        ASSERT_GE(Quest8MaxCode(record, s, i) * scale, k) << "trial " << trial << " key " << t;
        if (half_part) {
          ASSERT_LE(QuestMin(record, s, i), k) << "trial " << trial << " key " << t;
          ASSERT_GE(QuestMax(record, s, i), k) << "trial " << trial << " key " << t;
        }
      }
    }
  }
}

// quest8 carries no binary16 limit: with the 16-bit part off, keys beyond
// ±65504 are summarised (and the scale covers them).
TEST_F(SummaryTest, Quest8AloneTakesKeysBeyondTheHalfRange) {
  ModelLayout model = SmallModel();
  model.features = {.key_sum = true, .principal = false, .quest = false, .quest8 = true};
  auto phi = PhiBank::Create(model.phi_seed, 2, 2, model.head_dim, model.sketch_dim);
  SummaryWriter writer(model, *phi);
  const int d = model.head_dim;
  std::vector<float> keys(2 * d, 1.0f);
  keys[d + 3] = -70000.0f;
  std::vector<float> record(writer.layout().record_words);
  EXPECT_TRUE(writer.Reset(record).ok());
  ASSERT_TRUE(writer.Append(record, 1, 0, {keys.data(), DType::kFloat32, 2, d}).ok());
  const SummaryLayout& s = writer.layout();
  EXPECT_EQ(Quest8Scale(record, s), 1024.0f);   // 127·512 < 70000 <= 127·1024
  EXPECT_EQ(Quest8MinCode(record, s, 3), -69);  // floor(-70000 / 1024)
  EXPECT_EQ(Quest8MaxCode(record, s, 3), 1);    // ceil(1 / 1024)
  EXPECT_EQ(Quest8MinCode(record, s, 4), 0);
}

TEST_F(SummaryTest, HalfAndBFloat16KeysEqualTheirWidenedFloats) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  const ModelLayout model = SmallModel();
  auto phi = PhiBank::Create(model.phi_seed, 2, 2, model.head_dim, model.sketch_dim);
  SummaryWriter writer(model, *phi);
  const int n = 16, d = model.head_dim;
  const std::vector<float> keys = GaussianVector(rng_, n * d);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    std::vector<uint16_t> narrow(keys.size());
    std::vector<float> widened(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      narrow[i] = dtype == DType::kFloat16 ? FloatToHalf(keys[i]) : FloatToBFloat16(keys[i]);
      widened[i] = dtype == DType::kFloat16 ? HalfToFloat(narrow[i]) : BFloat16ToFloat(narrow[i]);
    }
    std::vector<float> a(writer.layout().record_words), b(a.size());
    EXPECT_TRUE(writer.Reset(a).ok());
    EXPECT_TRUE(writer.Reset(b).ok());
    ASSERT_TRUE(writer.Append(a, 0, 0, {narrow.data(), dtype, n, d}).ok());
    ASSERT_TRUE(writer.Append(b, 0, 0, {widened.data(), DType::kFloat32, n, d}).ok());
    EXPECT_EQ(a, b) << DTypeName(dtype);
  }
}

TEST_F(SummaryTest, StridedKeysAreReadWithTheirStride) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  const ModelLayout model = SmallModel();
  auto phi = PhiBank::Create(model.phi_seed, 2, 2, model.head_dim, model.sketch_dim);
  SummaryWriter writer(model, *phi);
  const int n = 8, d = model.head_dim, stride = 2 * d;  // e.g. [tokens, kv_heads=2, d]
  const std::vector<float> interleaved = GaussianVector(rng_, n * stride);
  std::vector<float> dense(n * d);
  for (int t = 0; t < n; ++t) {
    std::copy_n(interleaved.begin() + t * stride + d, d, dense.begin() + t * d);
  }
  std::vector<float> a(writer.layout().record_words), b(a.size());
  EXPECT_TRUE(writer.Reset(a).ok());
  EXPECT_TRUE(writer.Reset(b).ok());
  ASSERT_TRUE(writer.Append(a, 0, 1, {interleaved.data() + d, DType::kFloat32, n, stride}).ok());
  ASSERT_TRUE(writer.Append(b, 0, 1, {dense.data(), DType::kFloat32, n, d}).ok());
  EXPECT_EQ(a, b);
}

TEST_F(SummaryTest, NonFiniteKeysAreRejectedWithoutTouchingTheRecord) {
  const ModelLayout model = SmallModel();
  auto phi = PhiBank::Create(model.phi_seed, 2, 2, model.head_dim, model.sketch_dim);
  SummaryWriter writer(model, *phi);
  const int d = model.head_dim;
  std::vector<float> keys(3 * d, 1.0f);
  std::vector<float> record(writer.layout().record_words);
  EXPECT_TRUE(writer.Reset(record).ok());
  const std::vector<float> before = record;
  for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity()}) {
    keys[2 * d + 5] = bad;
    const absl::Status status = writer.Append(record, 0, 0, {keys.data(), DType::kFloat32, 3, d});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("key 2 element 5"), std::string::npos) << status;
    EXPECT_EQ(record, before);
  }
}

TEST_F(SummaryTest, KeysBeyondTheHalfRangeAreRejectedWhenQuestIsOn) {
  ModelLayout model = SmallModel();
  auto phi = PhiBank::Create(model.phi_seed, 2, 2, model.head_dim, model.sketch_dim);
  const int d = model.head_dim;
  std::vector<float> keys(2 * d, 1.0f);
  keys[d + 3] = -70000.0f;
  SummaryWriter writer(model, *phi);
  std::vector<float> record(writer.layout().record_words);
  EXPECT_TRUE(writer.Reset(record).ok());
  const std::vector<float> before = record;
  const absl::Status status = writer.Append(record, 1, 0, {keys.data(), DType::kFloat32, 2, d});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("key 1 element 3 is -70000"), std::string::npos) << status;
  EXPECT_EQ(record, before);
  model.features.quest = false;  // without quest the float sums take such keys
  SummaryWriter plain(model, *phi);
  std::vector<float> other(plain.layout().record_words);
  EXPECT_TRUE(plain.Reset(other).ok());
  EXPECT_TRUE(plain.Append(other, 1, 0, {keys.data(), DType::kFloat32, 2, d}).ok());
}

TEST_F(SummaryTest, AppendRejectsBadHeadsDtypesAndStrides) {
  const ModelLayout model = SmallModel();
  auto phi = PhiBank::Create(model.phi_seed, 2, 2, model.head_dim, model.sketch_dim);
  SummaryWriter writer(model, *phi);
  std::vector<float> keys(model.head_dim, 1.0f);
  std::vector<float> record(writer.layout().record_words);
  EXPECT_FALSE(writer.Append(record, 2, 0, {keys.data(), DType::kFloat32, 1, 0}).ok());
  EXPECT_FALSE(writer.Append(record, 0, -1, {keys.data(), DType::kFloat32, 1, 0}).ok());
  EXPECT_FALSE(writer.Append(record, 0, 0, {keys.data(), DType::kInt32, 1, 0}).ok());
  EXPECT_FALSE(writer.Append(record, 0, 0, {keys.data(), DType::kFloat32, 1, 3}).ok());
  std::vector<float> short_record(3);
  EXPECT_FALSE(writer.Append(short_record, 0, 0, {keys.data(), DType::kFloat32, 1, 0}).ok());
}

TEST_F(SummaryTest, SealFindsTheDominantDirectionOfLowRankKeys) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  const ModelLayout model = SmallModel(64);
  auto phi = PhiBank::Create(model.phi_seed, 2, 2, model.head_dim, model.sketch_dim);
  SummaryWriter writer(model, *phi);
  const SummaryLayout& s = writer.layout();
  const int n = 128, d = model.head_dim;
  std::vector<float> dir = GaussianVector(rng_, d);
  double dn = 0;
  for (float x : dir) dn += x * x;
  for (float& x : dir) x /= std::sqrt(dn);
  std::vector<float> keys = GaussianVector(rng_, n * d, 0.05f);
  std::normal_distribution<float> coef(0.0f, 3.0f);
  for (int t = 0; t < n; ++t) {
    const float c = coef(rng_);
    for (int i = 0; i < d; ++i) keys[t * d + i] += c * dir[i];
  }
  std::vector<float> record(s.record_words);
  EXPECT_TRUE(writer.Reset(record).ok());
  const KeyRows rows{keys.data(), DType::kFloat32, n, d};
  ASSERT_TRUE(writer.Append(record, 0, 0, rows).ok());
  ASSERT_TRUE(writer.Seal(record, 0, 0, rows).ok());
  const float scale = record[s.principal + 2];
  double cos = 0;
  for (int i = 0; i < d; ++i) cos += PrincipalComponent(record, s, i) * scale * dir[i];
  EXPECT_GT(std::abs(cos), 0.99);
  EXPECT_GT(record[s.principal], 0.95 * record[s.fro2]);  // λ1 holds most of the energy
  EXPECT_NEAR(record[s.principal] + record[s.principal + 1], record[s.fro2], 1e-3 * record[s.fro2]);
}

TEST_F(SummaryTest, SealRejectsKeysThatAreNotTheRecordsAndAppendClearsThePair) {
  const ModelLayout model = SmallModel();
  auto phi = PhiBank::Create(model.phi_seed, 2, 2, model.head_dim, model.sketch_dim);
  SummaryWriter writer(model, *phi);
  const SummaryLayout& s = writer.layout();
  const int d = model.head_dim;
  const std::vector<float> keys = GaussianVector(rng_, 6 * d);
  std::vector<float> record(s.record_words);
  EXPECT_TRUE(writer.Reset(record).ok());
  ASSERT_TRUE(writer.Append(record, 0, 0, {keys.data(), DType::kFloat32, 5, d}).ok());
  EXPECT_EQ(writer.Seal(record, 0, 0, {keys.data(), DType::kFloat32, 4, d}).code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(writer.Seal(record, 0, 0, {keys.data(), DType::kFloat32, 5, d}).ok());
  EXPECT_NE(record[s.principal + 2], 0.0f);
  ASSERT_TRUE(writer.Append(record, 0, 0, {keys.data() + 5 * d, DType::kFloat32, 1, d}).ok());
  EXPECT_EQ(record[s.principal + 2], 0.0f) << "a stale principal pair would not bound key 6";
}

TEST_F(SummaryTest, SealOfZeroKeysLeavesNoPrincipalPair) {
  const ModelLayout model = SmallModel();
  auto phi = PhiBank::Create(model.phi_seed, 2, 2, model.head_dim, model.sketch_dim);
  SummaryWriter writer(model, *phi);
  const SummaryLayout& s = writer.layout();
  std::vector<float> keys(4 * model.head_dim, 0.0f);
  std::vector<float> record(s.record_words);
  EXPECT_TRUE(writer.Reset(record).ok());
  const KeyRows rows{keys.data(), DType::kFloat32, 4, 0};
  ASSERT_TRUE(writer.Append(record, 0, 0, rows).ok());
  ASSERT_TRUE(writer.Seal(record, 0, 0, rows).ok());
  EXPECT_EQ(record[s.principal + 2], 0.0f);  // scale 0 marks "no pair"
}

}  // namespace
}  // namespace eps
