// Unary SelectPages replies queued for a client that has not read them yet, per session.
// A step frees its session's gate once it has run (step_gate.h); its reply then waits in
// gRPC's transport until the client's HTTP/2 window lets it out. A client that never opens
// its window (never reads) would so make epsd hold every reply of every step it sends,
// charged to no budget (docs/security.md, "replies never read"). A session may have at most
// kMaxUnsentReplies replies waiting; a step that ends beyond them answers RESOURCE_EXHAUSTED,
// a status without a message body, which HTTP/2 sends without flow-control window.
//
// Thread safety: all methods may be called concurrently.
#pragma once

#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace eps::service {

class UnsentReplies {
 public:
  // A normal client has at most two calls of a session in flight (step_gate.h) and reads
  // each reply before its next step; four leave room for a reply whose write has not yet
  // been reported done when the client's next call arrives.
  static constexpr int kMaxUnsentReplies = 4;

  // Counts one more waiting reply of `session`, when it has fewer than kMaxUnsentReplies;
  // false (nothing counted) otherwise.
  bool TryHold(const std::string& session);
  // The reply TryHold counted for `session` has been written or dropped (the call is done).
  void Release(const std::string& session);

 private:
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, int> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace eps::service
