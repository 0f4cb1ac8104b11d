// JL preservation: the sketched quadratic form zᵀGz tracks qᵀCq = Σ_i (q·k_i)².
//
// Theory (Achlioptas 2003). For Φ with i.i.d. ±1/sqrt(m) entries and fixed a, b,
// ⟨Φᵀa, Φᵀb⟩ is unbiased for a·b with variance
//     (‖a‖²‖b‖² + (a·b)² − 2 Σ_j a_j² b_j²) / m  ≤  2 ‖a‖²‖b‖² / m.
// Let x_i = q·k_i and x̂_i = ⟨Φᵀq, Φᵀk_i⟩, so jl = ‖x̂‖ and sqrt(qᵀCq) = ‖x‖.
// Since |‖x̂‖ − ‖x‖| ≤ ‖x̂ − x‖ and E‖x̂ − x‖² = Σ_i Var(x̂_i) ≤ 2‖q‖² fro2 / m,
// the error normalised by the fro bound, r = |jl − sqrt(qᵀCq)| / (‖q‖ sqrt(fro2)),
// obeys E[r²] ≤ 2/m, and by Markov's inequality
//     median(r) ≤ sqrt(2 · 2/m),   p95(r) ≤ sqrt(20 · 2/m).
// The test asserts all three on fresh Φ seeds and fresh key groups.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "core/bounds.h"
#include "core/summary.h"
#include "core/testing/synthetic.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace eps {
namespace {

struct JlCase {
  int m;
  bool realistic;  // synthetic RoPE keys (drift, outliers) instead of Gaussian keys
};

class JlPreservationTest : public ::testing::TestWithParam<JlCase> {};

TEST_P(JlPreservationTest, NormalisedErrorMatchesJlTheory) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  const auto [m, realistic] = GetParam();
  const int d = 128, n = 128, trials = 1200;
  std::mt19937_64 rng(seed);
  ModelLayout model;
  model.num_layers = model.num_q_heads = model.num_kv_heads = 1;
  model.head_dim = d;
  model.sketch_dim = m;
  model.features = {.key_sum = false, .principal = false, .quest = false};

  std::vector<double> errors, relative;
  double sum_r2 = 0;
  for (int trial = 0; trial < trials; ++trial) {
    model.phi_seed = rng();  // a fresh Φ every trial
    auto phi = PhiBank::Create(model.phi_seed, 1, 1, d, m);
    ASSERT_TRUE(phi.ok());
    SummaryWriter writer(model, *phi);
    std::vector<float> keys, q;
    if (realistic) {
      testing::SyntheticConfig config;
      config.tokens = n;
      config.num_needles = trial % 2;
      config.num_spans = 0;
      config.num_sinks = 0;
      config.seed = rng();
      testing::SyntheticHead head = testing::MakeSyntheticHead(config);
      keys = std::move(head.keys);
      q = std::move(head.queries);
    } else {
      keys = testing::GaussianVector(rng, n * d);
      q = testing::GaussianVector(rng, d);
    }
    std::vector<float> record(writer.layout().record_words);
    EXPECT_TRUE(writer.Reset(record).ok());
    ASSERT_TRUE(writer.Append(record, 0, 0, {keys.data(), DType::kFloat32, n, d}).ok());
    QueryTerms terms;
    terms.Prepare(*phi, 0, 0, q);
    const double exact = std::sqrt(testing::QuadForm(keys, q, d));
    const double jl = JlScore(record, writer.layout(), terms);
    const double r = std::abs(jl - exact) / (terms.norm * std::sqrt(record[writer.layout().fro2]));
    errors.push_back(r);
    relative.push_back(std::abs(jl - exact) / exact);
    sum_r2 += r * r;
  }
  const double mean_r2 = sum_r2 / trials;
  const double median = testing::Percentile(errors, 0.5);
  const double p95 = testing::Percentile(errors, 0.95);
  const double theory = 2.0 / m;
  std::printf(
      "m=%d %s: mean r^2=%.4f (theory <= %.4f), median r=%.4f (<= %.4f), "
      "p95 r=%.4f (<= %.4f); relative to sqrt(qCq): median %.3f p95 %.3f\n",
      m, realistic ? "rope-keys" : "gaussian", mean_r2, theory, median, std::sqrt(2 * theory), p95,
      std::sqrt(20 * theory), testing::Percentile(relative, 0.5),
      testing::Percentile(relative, 0.95));
  // 1200 trials: the sample mean of r² is within ~15% of its expectation.
  EXPECT_LE(mean_r2, 1.15 * theory);
  EXPECT_LE(median, std::sqrt(2 * theory));
  EXPECT_LE(p95, std::sqrt(20 * theory));
}

INSTANTIATE_TEST_SUITE_P(SketchDims, JlPreservationTest,
                         ::testing::Values(JlCase{4, false}, JlCase{8, false}, JlCase{16, false},
                                           JlCase{4, true}, JlCase{8, true}, JlCase{16, true}),
                         [](const auto& test_param) {
                           return "m" + std::to_string(test_param.param.m) +
                                  (test_param.param.realistic ? "_rope_keys" : "_gaussian_keys");
                         });

TEST(JlPreservationTrendTest, ErrorShrinksAsSketchGrows) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const int d = 64, n = 64, trials = 400;
  std::vector<double> mean_r2;
  for (int m : {4, 16, 64}) {
    ModelLayout model;
    model.num_layers = model.num_q_heads = model.num_kv_heads = 1;
    model.head_dim = d;
    model.sketch_dim = m;
    double sum = 0;
    for (int trial = 0; trial < trials; ++trial) {
      model.phi_seed = rng();
      auto phi = PhiBank::Create(model.phi_seed, 1, 1, d, m);
      SummaryWriter writer(model, *phi);
      const std::vector<float> keys = testing::GaussianVector(rng, n * d);
      const std::vector<float> q = testing::GaussianVector(rng, d);
      std::vector<float> record(writer.layout().record_words);
      EXPECT_TRUE(writer.Reset(record).ok());
      ASSERT_TRUE(writer.Append(record, 0, 0, {keys.data(), DType::kFloat32, n, d}).ok());
      QueryTerms terms;
      terms.Prepare(*phi, 0, 0, q);
      const double r =
          (JlScore(record, writer.layout(), terms) - std::sqrt(testing::QuadForm(keys, q, d))) /
          (terms.norm * std::sqrt(record[writer.layout().fro2]));
      sum += r * r;
    }
    mean_r2.push_back(sum / trials);
  }
  EXPECT_GT(mean_r2[0], 2 * mean_r2[1]);
  EXPECT_GT(mean_r2[1], 2 * mean_r2[2]);
}

}  // namespace
}  // namespace eps
