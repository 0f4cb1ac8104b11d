// A Prometheus histogram whose Observe() takes no lock: observations land in one
// of a few cache-line-padded shards (chosen per thread) as relaxed atomic adds,
// and a scrape sums the shards. prometheus::Histogram takes a mutex per
// Observe, which every RPC thread would contend on.
//
// Thread safety: Observe() and Collect() may run concurrently from any threads.
// A scrape that races an Observe may see the bucket count before the sum (the
// usual Prometheus client trade-off); counts never go backwards.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "prometheus/client_metric.h"

namespace eps::telemetry {

class ShardedHistogram {
 public:
  // `bounds`: ascending finite upper bounds; +Inf is implicit.
  explicit ShardedHistogram(std::vector<double> bounds);
  ShardedHistogram(const ShardedHistogram&) = delete;
  ShardedHistogram& operator=(const ShardedHistogram&) = delete;

  void Observe(double value);
  // The cumulative buckets, count and sum, as prometheus-cpp serialises them.
  prometheus::ClientMetric::Histogram Snapshot() const;
  const std::vector<double>& bounds() const { return bounds_; }

 private:
  static constexpr int kShards = 8;
  struct alignas(64) Shard {
    std::unique_ptr<std::atomic<uint64_t>[]> buckets;  // bounds_.size() + 1, the last is +Inf
    std::atomic<double> sum{0};
  };
  std::vector<double> bounds_;
  Shard shards_[kShards];
};

// Latency buckets from a few microseconds up to 10 s (docs/design.md §7: microsecond-scale).
std::vector<double> LatencyBucketsSeconds();

}  // namespace eps::telemetry
