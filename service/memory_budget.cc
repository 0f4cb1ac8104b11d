#include "service/memory_budget.h"

#include <utility>

#include "absl/strings/str_format.h"

namespace eps::service {

MemoryCharge::MemoryCharge(MemoryCharge&& other) noexcept
    : budget_(std::exchange(other.budget_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

MemoryCharge& MemoryCharge::operator=(MemoryCharge&& other) noexcept {
  if (this != &other) {
    Release();
    budget_ = std::exchange(other.budget_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

MemoryCharge::~MemoryCharge() { Release(); }

void MemoryCharge::Release() {
  for (MemoryBudget* b = budget_; b != nullptr; b = b->parent_) b->Subtract(bytes_);
  budget_ = nullptr;
  bytes_ = 0;
}

bool MemoryBudget::TryAdd(uint64_t bytes, uint64_t allowance) {
  const uint64_t limit = SaturatingSum({limit_, allowance});
  uint64_t used = used_.load(std::memory_order_relaxed);
  do {
    if (bytes > limit || used > limit - bytes) return false;
  } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  return true;
}

void MemoryBudget::Subtract(uint64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }

absl::StatusOr<MemoryCharge> MemoryBudget::Charge(uint64_t bytes, std::string_view what) {
  const uint64_t allowance = parent_allowance_.load(std::memory_order_relaxed);
  for (MemoryBudget* b = this; b != nullptr; b = b->parent_) {
    if (b->TryAdd(bytes, b == this ? 0 : allowance)) continue;
    const uint64_t used = b->used();
    for (MemoryBudget* undo = this; undo != b; undo = undo->parent_) undo->Subtract(bytes);
    const char* whose = b->parent_ == nullptr && parent_ != nullptr ? " by all sessions" : "";
    return absl::ResourceExhaustedError(
        absl::StrFormat("%s needs %d bytes, but %s=%d and %d bytes are in use%s", what, bytes,
                        b->flag_, b->limit_, used, whose));
  }
  return MemoryCharge(this, bytes);
}

}  // namespace eps::service
