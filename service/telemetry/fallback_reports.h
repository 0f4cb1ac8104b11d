// Turns the clients' fallback reports (SelectPagesRequest.fallbacks) into the
// increments of eps_client_fallbacks_total, so that each fallback counts once.
// A report with a client_id carries that client's totals: only their increase
// over the largest totals seen from the same client_id is new (a report sent
// again after a missed deadline adds nothing). A report without one carries
// deltas, added as they are (older clients).
//
// Thread safety: Increase may be called from any thread. Memory: at most
// kMaxClients clients are remembered; the oldest is forgotten first (its next
// report then counts its totals again, once).
#pragma once

#include <array>
#include <cstdint>
#include <deque>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "eps/v1/page_selector.pb.h"

namespace eps::telemetry {

class FallbackReports {
 public:
  static constexpr size_t kMaxClients = 4096;
  // deadline, unavailable, not_attached, error: the order of the proto's fields.
  using Counts = std::array<uint64_t, 4>;

  // The fallbacks `report` adds, by reason.
  Counts Increase(const v1::ClientFallbacks& report);

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Counts> totals_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> arrival_ ABSL_GUARDED_BY(mu_);  // client ids, oldest first
};

}  // namespace eps::telemetry
