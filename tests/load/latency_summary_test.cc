#include "load/latency_summary.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "gtest/gtest.h"

namespace eps::load {
namespace {

TEST(NearestRank, MatchesTheTextbookDefinition) {
  const std::vector<double> v = {1, 2, 3, 4};
  EXPECT_EQ(NearestRank(v, 0.50), 2);
  EXPECT_EQ(NearestRank(v, 0.75), 3);
  EXPECT_EQ(NearestRank(v, 0.76), 4);
  EXPECT_EQ(NearestRank(v, 1.0), 4);
  std::vector<double> ten(10);
  for (int i = 0; i < 10; ++i) ten[i] = i + 1;
  EXPECT_EQ(NearestRank(ten, 0.9), 9);  // exactly 9 of 10 samples are <= 9
  EXPECT_EQ(NearestRank(ten, 0.999), 10);
}

TEST(LatencySamples, SummaryOfNoSamplesIsZero) {
  LatencySamples s;
  const LatencySummary sum = s.Summarize();
  EXPECT_EQ(sum.count, 0u);
  EXPECT_EQ(sum.p99_us, 0);
}

TEST(LatencySamples, PercentilesAgreeWithACountOfSmallerSamples) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> dist(5.0, 1.0);
  LatencySamples a, b;
  std::vector<double> all;
  const int n = 1 + static_cast<int>(rng() % 20000);
  for (int i = 0; i < n; ++i) {
    const double x = dist(rng);
    (i % 2 ? a : b).Record(x);
    all.push_back(x);
  }
  a.Merge(b);
  const LatencySummary s = a.Summarize();
  ASSERT_EQ(s.count, static_cast<uint64_t>(n));
  // The nearest-rank p-quantile is the smallest sample with at least p·n samples at or below it.
  const std::pair<double, double> quantiles[] = {
      {0.5, s.p50_us}, {0.9, s.p90_us}, {0.99, s.p99_us}, {0.999, s.p999_us}, {1.0, s.max_us}};
  for (const auto& [p, got] : quantiles) {
    const auto at_or_below =
        std::count_if(all.begin(), all.end(), [&](double x) { return x <= got; });
    const auto below = std::count_if(all.begin(), all.end(), [&](double x) { return x < got; });
    EXPECT_GE(at_or_below, std::ceil(p * n - 1e-9)) << "p=" << p;
    EXPECT_LT(below, std::ceil(p * n - 1e-9)) << "p=" << p;
  }
  double mean = 0;
  for (double x : all) mean += x;
  mean /= n;
  EXPECT_NEAR(s.mean_us, mean, 1e-9 * mean);
  EXPECT_EQ(s.min_us, *std::min_element(all.begin(), all.end()));
  EXPECT_EQ(a.CountAbove(s.p50_us),
            static_cast<uint64_t>(n - std::count_if(all.begin(), all.end(),
                                                    [&](double x) { return x <= s.p50_us; })));
}

}  // namespace
}  // namespace eps::load
