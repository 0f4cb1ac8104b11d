#include "service/unsent_replies.h"

#include <algorithm>
#include <array>
#include <utility>

namespace eps::service {

UnsentReplies::UnsentReplies() { held_.reserve(kMaxUnsentReplies); }

UnsentReplies::Hold UnsentReplies::TryHold(Reply* reply) {
  absl::MutexLock lock(&mu_);
  if (ended_) return Hold::kEnded;
  if (static_cast<int>(held_.size()) < kMaxUnsentReplies && parked_.empty()) {
    held_.push_back(reply);  // within the capacity reserved: no allocation
    return Hold::kHeld;
  }
  if (static_cast<int>(parked_.size()) < kMaxParkedReplies) {
    parked_.push_back(reply);
    return Hold::kParked;
  }
  return Hold::kRefused;
}

void UnsentReplies::Release(Reply* reply) {
  Reply* next = nullptr;
  {
    absl::MutexLock lock(&mu_);
    // End may be calling this reply's Cancel: it must not be destroyed under that call.
    mu_.Await(absl::Condition(
        +[](int* cancelling) { return *cancelling == 0; }, &cancelling_));
    const auto it = std::find(held_.begin(), held_.end(), reply);
    if (it == held_.end()) return;
    if (!parked_.empty()) {  // the place passes to the oldest parked reply
      next = parked_.front();
      parked_.pop_front();
      *it = next;
    } else {
      held_.erase(it);
    }
  }
  if (next != nullptr) next->Resume();
}

bool UnsentReplies::Unpark(Reply* reply) {
  absl::MutexLock lock(&mu_);
  const auto p = std::find(parked_.begin(), parked_.end(), reply);
  if (p == parked_.end()) return false;
  parked_.erase(p);
  return true;
}

void UnsentReplies::End() {
  // Copied into arrays: a session's end (Session::Retire) allocates nothing, so cannot fail.
  std::array<Reply*, kMaxUnsentReplies> held{};
  std::array<Reply*, kMaxParkedReplies> parked{};
  size_t num_held = 0, num_parked = 0;
  {
    absl::MutexLock lock(&mu_);
    ended_ = true;
    num_held = held_.size();
    std::copy(held_.begin(), held_.end(), held.begin());
    num_parked = parked_.size();
    std::copy(parked_.begin(), parked_.end(), parked.begin());
    parked_.clear();
    ++cancelling_;  // their Release waits: they stay alive until Cancel returns
  }
  // Parked replies hold no place, and nothing else finishes them once taken from parked_.
  for (size_t i = 0; i < num_parked; ++i) parked[i]->Drop();
  for (size_t i = 0; i < num_held; ++i) held[i]->Cancel();
  absl::MutexLock lock(&mu_);
  --cancelling_;
}

}  // namespace eps::service
