#include "service/unsent_replies.h"

namespace eps::service {

bool UnsentReplies::TryHold(const std::string& session) {
  absl::MutexLock lock(&mu_);
  int& n = held_[session];
  if (n >= kMaxUnsentReplies) return false;
  ++n;
  return true;
}

void UnsentReplies::Release(const std::string& session) {
  absl::MutexLock lock(&mu_);
  const auto it = held_.find(session);
  if (it == held_.end()) return;
  if (--it->second <= 0) held_.erase(it);
}

}  // namespace eps::service
