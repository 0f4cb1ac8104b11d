#include "service/unsent_replies.h"

#include <algorithm>

namespace eps::service {

UnsentReplies::Hold UnsentReplies::TryHold(const std::string& session, Parked* parked) {
  absl::MutexLock lock(&mu_);
  Entry& e = sessions_[session];
  if (e.held < kMaxUnsentReplies && e.parked.empty()) {
    ++e.held;
    return Hold::kHeld;
  }
  if (static_cast<int>(e.parked.size()) < kMaxParkedReplies) {
    e.parked.push_back(parked);
    return Hold::kParked;
  }
  return Hold::kRefused;
}

void UnsentReplies::Release(const std::string& session) {
  Parked* next = nullptr;
  {
    absl::MutexLock lock(&mu_);
    const auto it = sessions_.find(session);
    if (it == sessions_.end()) return;
    Entry& e = it->second;
    if (!e.parked.empty()) {  // the place passes to the oldest parked reply
      next = e.parked.front();
      e.parked.pop_front();
    } else if (--e.held <= 0) {
      sessions_.erase(it);
    }
  }
  if (next != nullptr) next->Resume();
}

bool UnsentReplies::Unpark(const std::string& session, Parked* parked) {
  absl::MutexLock lock(&mu_);
  const auto it = sessions_.find(session);
  if (it == sessions_.end()) return false;
  Entry& e = it->second;
  const auto p = std::find(e.parked.begin(), e.parked.end(), parked);
  if (p == e.parked.end()) return false;
  e.parked.erase(p);
  if (e.held <= 0 && e.parked.empty()) sessions_.erase(it);
  return true;
}

}  // namespace eps::service
