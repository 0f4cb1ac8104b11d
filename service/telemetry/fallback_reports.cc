#include "service/telemetry/fallback_reports.h"

#include <algorithm>

namespace eps::telemetry {

FallbackReports::Counts FallbackReports::Increase(const v1::ClientFallbacks& report) {
  const Counts reported = {report.deadline(), report.unavailable(), report.not_attached(),
                           report.error()};
  if (report.client_id() == 0) return reported;
  absl::MutexLock lock(&mu_);
  auto [it, inserted] = totals_.try_emplace(report.client_id(), Counts{});
  if (inserted) {
    arrival_.push_back(report.client_id());
    if (arrival_.size() > kMaxClients) {
      totals_.erase(arrival_.front());
      arrival_.pop_front();
    }
  }
  Counts added{};
  for (size_t i = 0; i < added.size(); ++i) {
    if (reported[i] > it->second[i]) {
      added[i] = reported[i] - it->second[i];
      it->second[i] = reported[i];
    }
  }
  return added;
}

}  // namespace eps::telemetry
