#include "service/telemetry/sharded_histogram.h"

#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace eps::telemetry {
namespace {

TEST(ShardedHistogramTest, BucketsAreCumulativeWithInclusiveUpperBounds) {
  ShardedHistogram h({1.0, 2.0, 4.0});
  for (double v : {0.5, 1.0, 1.5, 4.0, 9.0}) h.Observe(v);
  const auto s = h.Snapshot();
  ASSERT_EQ(s.bucket.size(), 4u);
  EXPECT_EQ(s.bucket[0].cumulative_count, 2u);  // 0.5 and 1.0 (le is inclusive)
  EXPECT_EQ(s.bucket[1].cumulative_count, 3u);
  EXPECT_EQ(s.bucket[2].cumulative_count, 4u);
  EXPECT_EQ(s.bucket[3].cumulative_count, 5u);
  EXPECT_TRUE(std::isinf(s.bucket[3].upper_bound));
  EXPECT_EQ(s.sample_count, 5u);
  EXPECT_DOUBLE_EQ(s.sample_sum, 16.0);
}

TEST(ShardedHistogramTest, ConcurrentObservationsAreAllCounted) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  ShardedHistogram h(LatencyBucketsSeconds());
  constexpr int kThreads = 12, kPerThread = 20000;
  std::vector<std::thread> threads;
  std::vector<double> sums(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed + t);
      std::uniform_int_distribution<int> micros(1, 5000);
      for (int i = 0; i < kPerThread; ++i) {
        const double v = micros(rng) * 1e-6;  // exact sums: multiples of 1 µs stay small
        h.Observe(v);
        sums[t] += v;
      }
    });
  }
  for (auto& t : threads) t.join();
  const auto s = h.Snapshot();
  EXPECT_EQ(s.sample_count, uint64_t{kThreads} * kPerThread);
  double expected = 0;
  for (double v : sums) expected += v;
  EXPECT_NEAR(s.sample_sum, expected, 1e-6);
}

TEST(ShardedHistogramTest, LatencyBucketsStartAtAFewMicroseconds) {
  const auto b = LatencyBucketsSeconds();
  EXPECT_LE(b.front(), 5e-6);
  EXPECT_GE(b.back(), 1.0);
  EXPECT_TRUE(std::is_sorted(b.begin(), b.end()));
}

}  // namespace
}  // namespace eps::telemetry
