#include "load/latency_summary.h"

#include <algorithm>
#include <cmath>

namespace eps::load {

double NearestRank(const std::vector<double>& sorted, double p) {
  // The small epsilon keeps p·n that is an integer in exact arithmetic (0.9 × 10)
  // from rounding up past it in binary floating point.
  const double rank = std::ceil(p * static_cast<double>(sorted.size()) - 1e-9);
  const size_t index = static_cast<size_t>(std::clamp(rank, 1.0, double(sorted.size()))) - 1;
  return sorted[index];
}

uint64_t LatencySamples::CountAbove(double us) const {
  return static_cast<uint64_t>(
      std::count_if(samples_.begin(), samples_.end(), [us](double s) { return s > us; }));
}

LatencySummary LatencySamples::Summarize() {
  LatencySummary s;
  s.count = samples_.size();
  if (samples_.empty()) return s;
  std::sort(samples_.begin(), samples_.end());
  s.min_us = samples_.front();
  s.max_us = samples_.back();
  s.p50_us = NearestRank(samples_, 0.50);
  s.p90_us = NearestRank(samples_, 0.90);
  s.p99_us = NearestRank(samples_, 0.99);
  s.p999_us = NearestRank(samples_, 0.999);
  double sum = 0;
  for (double v : samples_) sum += v;
  s.mean_us = sum / static_cast<double>(s.count);
  double sq = 0;
  for (double v : samples_) sq += (v - s.mean_us) * (v - s.mean_us);
  s.stddev_us = std::sqrt(sq / static_cast<double>(s.count));
  return s;
}

}  // namespace eps::load
