// Exact latency percentiles from every recorded sample.
//
// A load run records at most a few million calls, so eps-load keeps every
// sample (8 bytes each) instead of an HDR histogram's buckets: percentiles are
// exact, with the nearest-rank definition (the p-th percentile of n sorted
// samples is the ceil(p·n)-th smallest; p50 of {1,2,3,4} is 2, max is the
// largest). Thread safety: none; each session records into its own
// LatencySamples and the run merges them after the sessions stopped.
#pragma once

#include <cstdint>
#include <vector>

namespace eps::load {

struct LatencySummary {
  uint64_t count = 0;
  double min_us = 0, p50_us = 0, p90_us = 0, p99_us = 0, p999_us = 0, max_us = 0;
  double mean_us = 0, stddev_us = 0;  // population standard deviation
};

class LatencySamples {
 public:
  void Record(double us) { samples_.push_back(us); }
  void Merge(const LatencySamples& other) {
    samples_.insert(samples_.end(), other.samples_.begin(), other.samples_.end());
  }
  uint64_t size() const { return samples_.size(); }
  uint64_t CountAbove(double us) const;
  // Sorts the samples (once) and computes every statistic; zeros when empty.
  LatencySummary Summarize();

 private:
  std::vector<double> samples_;
};

// The nearest-rank p-quantile (0 < p <= 1) of `sorted`, which must not be empty.
double NearestRank(const std::vector<double>& sorted, double p);

}  // namespace eps::load
