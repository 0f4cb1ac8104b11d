#include "core/bounds.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "core/half.h"
#include "core/summary.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace eps {
namespace {

using testing::GaussianVector;
using testing::MaxDot;
using testing::QuadForm;

// Keys of one group in one of several shapes the bounds must hold for.
std::vector<float> RandomGroup(std::mt19937_64& rng, int n, int d, int shape) {
  std::vector<float> keys = GaussianVector(rng, static_cast<size_t>(n) * d);
  if (shape == 1) {  // low rank: a shared direction plus small noise
    const std::vector<float> dir = GaussianVector(rng, d, 3.0f);
    for (int t = 0; t < n; ++t) {
      for (int i = 0; i < d; ++i) keys[t * d + i] = 0.1f * keys[t * d + i] + dir[i] * (t % 3 - 1);
    }
  } else if (shape == 2) {  // a large mean (as real keys have) and one outlier channel
    const std::vector<float> mean = GaussianVector(rng, d, 2.0f);
    for (int t = 0; t < n; ++t) {
      for (int i = 0; i < d; ++i) keys[t * d + i] += mean[i];
      keys[t * d] *= 8.0f;
    }
  }
  return keys;
}

class BoundsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = testing::TestSeed();
    rng_.seed(seed_);
    model_.num_layers = 1;
    model_.num_q_heads = 1;
    model_.num_kv_heads = 1;
    model_.head_dim = 64;
    model_.phi_seed = 5;
    model_.features = {.key_sum = true, .principal = true, .quest = true};
    phi_ = std::make_unique<PhiBank>(*PhiBank::Create(5, 1, 1, 64, 8));
    writer_ = std::make_unique<SummaryWriter>(model_, *phi_);
  }
  std::vector<float> Summarise(const std::vector<float>& keys, int n) {
    std::vector<float> record(writer_->layout().record_words);
    EXPECT_TRUE(writer_->Reset(record).ok());
    const KeyRows rows{keys.data(), DType::kFloat32, n, 0};
    EXPECT_TRUE(writer_->Append(record, 0, 0, rows).ok());
    EXPECT_TRUE(writer_->Seal(record, 0, 0, rows).ok());
    return record;
  }
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  ModelLayout model_;
  std::unique_ptr<PhiBank> phi_;
  std::unique_ptr<SummaryWriter> writer_;
};

TEST_F(BoundsTest, JlScoreIsSqrtOfSketchedQuadraticForm) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  const int d = 64, m = 8, n = 32;
  const std::vector<float> keys = RandomGroup(rng_, n, d, 0);
  const std::vector<float> record = Summarise(keys, n);
  const std::vector<float> q = GaussianVector(rng_, d);
  QueryTerms terms;
  terms.Prepare(*phi_, 0, 0, q);
  double quad = 0;
  for (int a = 0; a < m; ++a) {
    for (int b = 0; b < m; ++b) {
      quad += terms.z[a] * terms.z[b] * record[PackedIndex(m, std::min(a, b), std::max(a, b))];
    }
  }
  EXPECT_NEAR(JlScore(record, writer_->layout(), terms), std::sqrt(std::max(quad, 0.0)),
              1e-4 * std::sqrt(std::abs(quad)) + 1e-5);
}

TEST_F(BoundsTest, FroAndOnePcBoundTheQuadraticFormOnEveryShape) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  const int d = 64;
  for (int trial = 0; trial < 300; ++trial) {
    const int shape = trial % 3, n = 1 + trial % 128;
    const std::vector<float> keys = RandomGroup(rng_, n, d, shape);
    const std::vector<float> record = Summarise(keys, n);
    const std::vector<float> q = GaussianVector(rng_, d);
    QueryTerms terms;
    terms.Prepare(*phi_, 0, 0, q);
    const double exact = std::sqrt(QuadForm(keys, q, d));
    const double tolerance = 1e-4 * terms.norm * record[writer_->layout().max_norm] * std::sqrt(n);
    const float fro = FroBound(record, writer_->layout(), terms);
    const float pc = OnePcBound(record, writer_->layout(), terms);
    ASSERT_GE(fro + tolerance, exact) << "trial " << trial << " shape " << shape;
    ASSERT_GE(pc + tolerance, exact) << "trial " << trial << " shape " << shape;
    ASSERT_LE(pc, fro) << "1pc is never looser than fro";
  }
}

TEST_F(BoundsTest, OnePcIsTightForLowRankGroups) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  const int d = 64, n = 96;
  std::vector<double> ratios, fro_ratios;
  for (int trial = 0; trial < 51; ++trial) {
    const std::vector<float> keys = RandomGroup(rng_, n, d, 1);
    const std::vector<float> record = Summarise(keys, n);
    const std::vector<float> q = GaussianVector(rng_, d);
    QueryTerms terms;
    terms.Prepare(*phi_, 0, 0, q);
    const double exact = std::sqrt(QuadForm(keys, q, d));
    ratios.push_back(OnePcBound(record, writer_->layout(), terms) / exact);
    fro_ratios.push_back(FroBound(record, writer_->layout(), terms) / exact);
  }
  // Rank 1 plus 1% noise. Expected ratio ≈ 1 + sqrt(r²)‖q⊥‖ / (sqrt(λ1)|u1·q|) ≈ 1.5
  // at the median |u1·q|; fro's is ≈ sqrt(fro2)‖q‖ / sqrt(qᵀCq) ≈ 10.
  const double median = testing::Percentile(ratios, 0.5);
  const double fro_median = testing::Percentile(fro_ratios, 0.5);
  std::printf("bound/exact, median: 1pc %.3f, fro %.3f\n", median, fro_median);
  EXPECT_LT(median, 2.0);
  EXPECT_LT(median, 0.25 * fro_median);
}

TEST_F(BoundsTest, OnePcStaysABoundForExactlyRankOneGroups) {
  // fro2 − λ1 cancels to rounding noise here; the bound must still hold when q
  // is nearly orthogonal to the keys' direction.
  SCOPED_TRACE(testing::SeedTrace(seed_));
  const int d = 64;
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + trial % 128;
    const std::vector<float> dir = GaussianVector(rng_, d, 1.0f + trial % 7);
    std::vector<float> keys(static_cast<size_t>(n) * d);
    std::normal_distribution<float> coef(0.0f, 2.0f);
    for (int t = 0; t < n; ++t) {
      const float c = coef(rng_);
      for (int i = 0; i < d; ++i) keys[t * d + i] = c * dir[i];
    }
    const std::vector<float> record = Summarise(keys, n);
    // q = a random vector with its component along dir almost removed.
    std::vector<float> q = GaussianVector(rng_, d);
    double qd = 0, dd = 0;
    for (int i = 0; i < d; ++i) {
      qd += q[i] * dir[i];
      dd += dir[i] * dir[i];
    }
    for (int i = 0; i < d; ++i) q[i] -= static_cast<float>((1 - 1e-3) * qd / dd) * dir[i];
    QueryTerms terms;
    terms.Prepare(*phi_, 0, 0, q);
    const MaxScoreBracket b = BracketMaxScore(record, writer_->layout(), terms);
    const double truth = MaxDot(keys, q, d);
    ASSERT_GE(OnePcBound(record, writer_->layout(), terms), std::sqrt(QuadForm(keys, q, d)))
        << "trial " << trial;
    ASSERT_GE(b.upper, truth) << "trial " << trial;
    ASSERT_LE(b.lower, truth) << "trial " << trial;
  }
}

TEST_F(BoundsTest, QuestBoundsTheSignedMaxScore) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  const int d = 64;
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + trial % 64;
    const std::vector<float> keys = RandomGroup(rng_, n, d, trial % 3);
    const std::vector<float> record = Summarise(keys, n);
    const std::vector<float> q = GaussianVector(rng_, d);
    QueryTerms terms;
    terms.Prepare(*phi_, 0, 0, q);
    const double truth = MaxDot(keys, q, d);
    ASSERT_GE(QuestBound(record, writer_->layout(), terms) + 1e-4 * (1 + std::abs(truth)), truth)
        << "trial " << trial;
  }
}

// quest = q·c + Σ_j |q_j| w_j per channel; questclt replaces the sum by the root
// of the sum of squares, so it lies between the centre's score and quest, and
// equals quest when one channel carries the whole spread.
TEST_F(BoundsTest, QuestCltLiesBetweenTheCentreAndQuest) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  const int d = 64;
  const SummaryLayout& layout = writer_->layout();
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + trial % 64;
    const std::vector<float> keys = RandomGroup(rng_, n, d, trial % 3);
    const std::vector<float> record = Summarise(keys, n);
    const std::vector<float> q = GaussianVector(rng_, d);
    QueryTerms terms;
    terms.Prepare(*phi_, 0, 0, q);
    double centre = 0.0, spread = 0.0;
    for (int i = 0; i < d; ++i) {
      const double lo = QuestMin(record, layout, i), hi = QuestMax(record, layout, i);
      centre += q[i] * 0.5 * (lo + hi);
      spread += std::pow(q[i] * 0.5 * (hi - lo), 2);
    }
    const float clt = QuestCltScore(record, layout, terms);
    const double tol = 1e-4 * (1 + std::abs(centre) + std::sqrt(spread));
    ASSERT_NEAR(clt, centre + std::sqrt(spread), tol) << "trial " << trial;
    ASSERT_GE(clt + tol, centre) << "trial " << trial;
    ASSERT_LE(clt, QuestBound(record, layout, terms) + tol) << "trial " << trial;
    EXPECT_EQ(Score(Method::kQuestClt, record, layout, terms), clt);
  }
}

TEST_F(BoundsTest, QuestCltEqualsQuestWhenOneChannelSpreads) {
  const int d = 64, n = 8;
  std::vector<float> keys(static_cast<size_t>(n) * d, 0.5f);
  for (int t = 0; t < n; ++t) keys[t * d + 3] = static_cast<float>(t) - 2.0f;  // only channel 3
  const std::vector<float> record = Summarise(keys, n);
  const std::vector<float> q = GaussianVector(rng_, d);
  QueryTerms terms;
  terms.Prepare(*phi_, 0, 0, q);
  EXPECT_NEAR(QuestCltScore(record, writer_->layout(), terms),
              QuestBound(record, writer_->layout(), terms), 1e-4);
}

// With quest8 in the record questclt reads it: the score of the dequantized
// channels (code·scale), which lie outside the true min/max by less than a
// scale step, so it stays near the 16-bit part's score.
TEST_F(BoundsTest, QuestCltReadsQuest8WhenTheRecordHoldsIt) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  const int d = 64;
  ModelLayout both = model_;
  both.features.quest8 = true;
  SummaryWriter writer(both, *phi_);
  const SummaryLayout& layout = writer.layout();
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + trial % 64;
    const std::vector<float> keys = RandomGroup(rng_, n, d, trial % 3);
    std::vector<float> record(layout.record_words);
    EXPECT_TRUE(writer.Reset(record).ok());
    ASSERT_TRUE(writer.Append(record, 0, 0, {keys.data(), DType::kFloat32, n, 0}).ok());
    const std::vector<float> q = GaussianVector(rng_, d);
    QueryTerms terms;
    terms.Prepare(*phi_, 0, 0, q);
    const double s = Quest8Scale(record, layout);
    double centre = 0.0, spread = 0.0, qnorm1 = 0.0;
    for (int i = 0; i < d; ++i) {
      const double lo = Quest8MinCode(record, layout, i) * s;
      const double hi = Quest8MaxCode(record, layout, i) * s;
      centre += q[i] * 0.5 * (lo + hi);
      spread += std::pow(q[i] * 0.5 * (hi - lo), 2);
      qnorm1 += std::abs(q[i]);
    }
    const float clt = QuestCltScore(record, layout, terms);
    ASSERT_NEAR(clt, centre + std::sqrt(spread), 1e-4 * (1 + std::abs(centre) + std::sqrt(spread)))
        << "trial " << trial;
    EXPECT_EQ(Score(Method::kQuestClt, record, layout, terms), clt);
    // Each dequantized bound is within one step s of the true extreme, as the
    // binary16 one is within its rounding: the two scores differ by at most Σ|q|·s.
    ModelLayout only16 = model_;
    SummaryWriter w16(only16, *phi_);
    std::vector<float> r16(w16.layout().record_words);
    EXPECT_TRUE(w16.Reset(r16).ok());
    ASSERT_TRUE(w16.Append(r16, 0, 0, {keys.data(), DType::kFloat32, n, 0}).ok());
    ASSERT_NEAR(clt, QuestCltScore(r16, w16.layout(), terms), 1.1 * qnorm1 * s + 1e-3)
        << "trial " << trial;
    // quest (a bound) keeps reading the 16-bit part.
    EXPECT_EQ(QuestBound(record, layout, terms), QuestBound(r16, w16.layout(), terms));
  }
}

TEST_F(BoundsTest, BracketContainsTheTrueMaxScore) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  const int d = 64;
  for (int trial = 0; trial < 500; ++trial) {
    const int n = 1 + trial % 128;
    const std::vector<float> keys = RandomGroup(rng_, n, d, trial % 3);
    const std::vector<float> record = Summarise(keys, n);
    const std::vector<float> q = GaussianVector(rng_, d, trial % 2 ? 1.0f : 10.0f);
    QueryTerms terms;
    terms.Prepare(*phi_, 0, 0, q);
    const MaxScoreBracket b = BracketMaxScore(record, writer_->layout(), terms);
    const double truth = MaxDot(keys, q, d);
    ASSERT_LE(b.lower, truth) << "trial " << trial;
    ASSERT_GE(b.upper, truth) << "trial " << trial;
  }
}

// A key or query element at 2^e times a normal deviate, e in [lo, hi].
float ScaledDeviate(std::mt19937_64& rng, int lo, int hi) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  return normal(rng) * std::ldexp(1.0f, lo + static_cast<int>(rng() % (hi - lo + 1)));
}

// Keys at the edges of what the writer accepts: one magnitude for the whole group or one per
// element, from subnormal to the binary16 limit (beyond it without the quest part), signed
// zeros, groups of one key or of equal keys, stored as float32, float16 or bfloat16.
std::vector<float> EdgeGroup(std::mt19937_64& rng, int n, int d, float limit, DType dtype) {
  std::vector<float> keys(static_cast<size_t>(n) * d);
  const int shape = static_cast<int>(rng() % 5);
  const int exponent = -149 + static_cast<int>(rng() % 220);
  for (size_t e = 0; e < keys.size(); ++e) {
    float& x = keys[e];
    switch (shape) {
      case 0:  // one magnitude
        x = ScaledDeviate(rng, exponent, exponent);
        break;
      case 1:  // a magnitude per element
        x = ScaledDeviate(rng, -149, 70);
        break;
      case 2:  // the range's ends, signed zeros and subnormals
        x = std::array<float, 5>{limit, -limit, 0.0f, -0.0f,
                                 ScaledDeviate(rng, -149, -120)}[rng() % 5];
        break;
      case 3:  // every key the first
        x = e < static_cast<size_t>(d) ? ScaledDeviate(rng, exponent, exponent) : keys[e % d];
        break;
      default:  // mostly signed zeros
        x = rng() % 3 == 0 ? ScaledDeviate(rng, exponent, exponent) : (rng() % 2 ? 0.0f : -0.0f);
    }
    x = std::clamp(x, -limit, limit);
    if (dtype == DType::kFloat16) x = HalfToFloat(FloatToHalf(x));
    if (dtype == DType::kBFloat16) x = BFloat16ToFloat(FloatToBFloat16(x));
  }
  return keys;
}

// The bracket holds for every group the writer accepts and every query the step accepts,
// however far from 1 their magnitudes: squares below the float range (keys or a query
// under about 2^-75) used to give fro2 or ‖q‖ of 0, so a bracket of [0, 0] around a
// positive maximum (or a mean's 0 above a negative one).
TEST(BoundsEdgeTest, BracketHoldsForKeysAndQueriesAcrossTheFloatRange) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 4000; ++trial) {
    ModelLayout m;
    m.num_layers = m.num_q_heads = m.num_kv_heads = 1;
    m.head_dim = std::array<int, 4>{4, 8, 64, 128}[rng() % 4];
    m.sketch_dim = 1 + static_cast<int>(rng() % 8);
    m.phi_seed = rng();
    m.features = {.key_sum = rng() % 4 != 0,
                  .principal = rng() % 2 == 0,
                  .quest = rng() % 2 == 0,
                  .quest8 = rng() % 2 == 0};
    const int d = m.head_dim;
    const int n = 1 + static_cast<int>(rng() % (rng() % 2 ? 3 : 48));
    const DType dtype = static_cast<DType>(rng() % 3);  // float32, float16, bfloat16
    const float limit = m.features.quest || dtype == DType::kFloat16 ? kHalfMax : 1e30f;
    const std::vector<float> keys = EdgeGroup(rng, n, d, limit, dtype);
    const PhiBank phi = *PhiBank::Create(m.phi_seed, 1, 1, d, m.sketch_dim);
    const SummaryWriter writer(m, phi);
    std::vector<float> record(writer.layout().record_words);
    ASSERT_TRUE(writer.Reset(record).ok());
    const KeyRows rows{keys.data(), DType::kFloat32, n, 0};
    if (!writer.Append(record, 0, 0, rows).ok()) continue;  // sums beyond the float range
    if (m.features.principal && rng() % 2) {
      ASSERT_TRUE(writer.Seal(record, 0, 0, rows).ok());
    }
    std::vector<float> q(d);
    const int q_exponent = -149 + static_cast<int>(rng() % 210);
    for (float& x : q) {
      x = rng() % 2 ? ScaledDeviate(rng, q_exponent, q_exponent) : ScaledDeviate(rng, -149, 60);
      if (rng() % 8 == 0) x = -0.0f;
    }
    double norm2 = 0;
    for (float x : q) norm2 += double{x} * x;
    if (norm2 >= kMaxQueryNorm2) continue;  // the step refuses it
    QueryTerms terms;
    terms.Prepare(phi, 0, 0, q);
    // max_t q·k_t: products of floats are exact in long double, and the sums err by less
    // than 2^-60 of the sum of the terms' magnitudes (the tolerance).
    long double truth = -std::numeric_limits<long double>::infinity(), tolerance = 0;
    for (int t = 0; t < n; ++t) {
      long double dot = 0, magnitude = 0;
      for (int i = 0; i < d; ++i) {
        const long double term = static_cast<long double>(q[i]) * keys[t * d + i];
        dot += term;
        magnitude += std::fabs(term);
      }
      truth = std::max(truth, dot);
      tolerance = std::max(tolerance, std::ldexp(magnitude, -60));
    }
    const MaxScoreBracket b = BracketMaxScore(record, writer.layout(), terms);
    ASSERT_LE(b.lower, truth + tolerance)
        << "trial " << trial << ": " << m.DebugString() << ", n=" << n << ", |q|=" << terms.norm
        << ", max_norm=" << record[writer.layout().max_norm];
    ASSERT_GE(b.upper, truth - tolerance)
        << "trial " << trial << ": " << m.DebugString() << ", n=" << n << ", |q|=" << terms.norm
        << ", max_norm=" << record[writer.layout().max_norm];
  }
}

TEST_F(BoundsTest, BracketWithoutKeySumFallsBackToMinusAbsoluteBound) {
  ModelLayout bare = model_;
  bare.features = {.key_sum = false, .principal = false, .quest = true};
  SummaryWriter writer(bare, *phi_);
  std::vector<float> keys = RandomGroup(rng_, 16, 64, 0);
  std::vector<float> record(writer.layout().record_words);
  EXPECT_TRUE(writer.Reset(record).ok());
  ASSERT_TRUE(writer.Append(record, 0, 0, {keys.data(), DType::kFloat32, 16, 0}).ok());
  const std::vector<float> q = GaussianVector(rng_, 64);
  QueryTerms terms;
  terms.Prepare(*phi_, 0, 0, q);
  const MaxScoreBracket b = BracketMaxScore(record, writer.layout(), terms);
  EXPECT_LE(b.lower, -FroBound(record, writer.layout(), terms) * 0.999f);
  EXPECT_GE(b.upper, MaxDot(keys, q, 64));
}

TEST_F(BoundsTest, EmptyGroupHasNoScoreAndAnEmptyBracket) {
  std::vector<float> record(writer_->layout().record_words);
  EXPECT_TRUE(writer_->Reset(record).ok());
  const std::vector<float> q = GaussianVector(rng_, 64);
  QueryTerms terms;
  terms.Prepare(*phi_, 0, 0, q);
  EXPECT_EQ(JlScore(record, writer_->layout(), terms), 0.0f);
  EXPECT_EQ(FroBound(record, writer_->layout(), terms), 0.0f);
  EXPECT_EQ(QuestBound(record, writer_->layout(), terms), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(QuestCltScore(record, writer_->layout(), terms),
            -std::numeric_limits<float>::infinity());
  EXPECT_EQ(BracketMaxScore(record, writer_->layout(), terms).upper,
            -std::numeric_limits<float>::infinity());
}

TEST_F(BoundsTest, MethodsWithoutTheirRecordPartFallBackToFro) {
  ModelLayout bare = model_;
  bare.features = {.key_sum = false, .principal = false, .quest = false};
  SummaryWriter writer(bare, *phi_);
  std::vector<float> keys = RandomGroup(rng_, 16, 64, 2);
  std::vector<float> record(writer.layout().record_words);
  EXPECT_TRUE(writer.Reset(record).ok());
  ASSERT_TRUE(writer.Append(record, 0, 0, {keys.data(), DType::kFloat32, 16, 0}).ok());
  const std::vector<float> q = GaussianVector(rng_, 64);
  QueryTerms terms;
  terms.Prepare(*phi_, 0, 0, q);
  const float fro = FroBound(record, writer.layout(), terms);
  EXPECT_EQ(Score(Method::kOnePc, record, writer.layout(), terms), fro);
  EXPECT_EQ(Score(Method::kQuest, record, writer.layout(), terms), fro);
  EXPECT_EQ(Score(Method::kQuestClt, record, writer.layout(), terms), fro);
  EXPECT_EQ(Score(Method::kOff, record, writer.layout(), terms), 0.0f);
}

TEST(MethodNameTest, ParsesEveryMethodNameBack) {
  for (Method m : {Method::kOff, Method::kJl, Method::kOnePc, Method::kFro, Method::kQuest,
                   Method::kQuestClt}) {
    Method parsed;
    ASSERT_TRUE(ParseMethod(MethodName(m), &parsed));
    EXPECT_EQ(parsed, m);
  }
  Method unused;
  EXPECT_FALSE(ParseMethod("jl2", &unused));
}

}  // namespace
}  // namespace eps
