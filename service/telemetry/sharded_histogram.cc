#include "service/telemetry/sharded_histogram.h"

#include <algorithm>
#include <limits>

namespace eps::telemetry {
namespace {

// Threads take shards round-robin on first use, so up to kShards busy threads never share one.
int ThisThreadShard(int shards) {
  static std::atomic<int> next{0};
  thread_local const int shard = next.fetch_add(1, std::memory_order_relaxed);
  return shard % shards;
}

}  // namespace

ShardedHistogram::ShardedHistogram(std::vector<double> bounds) : bounds_(std::move(bounds)) {
  for (Shard& s : shards_) {
    s.buckets = std::make_unique<std::atomic<uint64_t>[]>(bounds_.size() + 1);
    for (size_t i = 0; i <= bounds_.size(); ++i) s.buckets[i].store(0, std::memory_order_relaxed);
  }
}

void ShardedHistogram::Observe(double value) {
  // le is inclusive: the first bound >= value.
  const size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  Shard& s = shards_[ThisThreadShard(kShards)];
  s.buckets[bucket].fetch_add(1, std::memory_order_relaxed);
  double sum = s.sum.load(std::memory_order_relaxed);
  while (!s.sum.compare_exchange_weak(sum, sum + value, std::memory_order_relaxed)) {
  }
}

prometheus::ClientMetric::Histogram ShardedHistogram::Snapshot() const {
  prometheus::ClientMetric::Histogram h;
  std::vector<uint64_t> counts(bounds_.size() + 1, 0);
  for (const Shard& s : shards_) {
    for (size_t i = 0; i < counts.size(); ++i) {
      counts[i] += s.buckets[i].load(std::memory_order_relaxed);
    }
    h.sample_sum += s.sum.load(std::memory_order_relaxed);
  }
  uint64_t cumulative = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    cumulative += counts[i];
    prometheus::ClientMetric::Bucket b;
    b.cumulative_count = cumulative;
    b.upper_bound = i < bounds_.size() ? bounds_[i] : std::numeric_limits<double>::infinity();
    h.bucket.push_back(b);
  }
  h.sample_count = cumulative;
  return h;
}

std::vector<double> LatencyBucketsSeconds() {
  return {2e-6, 5e-6,   1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
          1e-2, 2.5e-2, 5e-2, 0.1,    0.25, 0.5,  1.0,    2.5,  5.0,  10.0};
}

}  // namespace eps::telemetry
