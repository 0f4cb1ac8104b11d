// Bounds on the memory epsd allocates because a request asked for it: inline
// buffers, a session's Φ bank, its step scratch and its device buffers. Each
// session charges its own budget (--max-session-bytes), which charges the
// server's (--max-server-bytes); a charge that would pass either limit is
// refused with RESOURCE_EXHAUSTED naming the flag, before anything is
// allocated (docs/security.md), but for a replacing Attach's new session, which
// may pass the server's by what the session it replaces holds
// (set_parent_allowance). Memory the engine owns (its shm objects, CUDA
// IPC allocations) is mapped, not allocated, and is not charged there; the address
// space its host_shm objects take in epsd is charged to budgets of its own
// (--max-session-mapped-bytes, --max-server-mapped-bytes), since an object of many
// TiB costs its owner nothing (tmpfs is sparse) but would take epsd's whole address
// space.
//
// Thread safety: Charge and the destructor of a MemoryCharge may run on any
// thread. A budget must outlive its charges and its child budgets.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "core/saturating.h"  // SaturatingProduct, SaturatingSum: the sizes of charges

namespace eps::service {

class MemoryBudget;

// Bytes held against a budget (and its parent) until destroyed. Move-only.
class MemoryCharge {
 public:
  MemoryCharge() = default;
  MemoryCharge(MemoryCharge&& other) noexcept;
  MemoryCharge& operator=(MemoryCharge&& other) noexcept;
  MemoryCharge(const MemoryCharge&) = delete;
  MemoryCharge& operator=(const MemoryCharge&) = delete;
  ~MemoryCharge();

  uint64_t bytes() const { return bytes_; }

 private:
  friend class MemoryBudget;
  MemoryCharge(MemoryBudget* budget, uint64_t bytes) : budget_(budget), bytes_(bytes) {}
  void Release();

  MemoryBudget* budget_ = nullptr;
  uint64_t bytes_ = 0;
};

class MemoryBudget {
 public:
  // `flag` names the limit in messages ("--max-session-bytes").
  MemoryBudget(std::string flag, uint64_t limit, MemoryBudget* parent = nullptr)
      : flag_(std::move(flag)), limit_(limit), parent_(parent) {}
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  // Reserves `bytes` here and in every parent; `what` says what for, in the
  // message of a refusal ("summary_pool inline buffer").
  absl::StatusOr<MemoryCharge> Charge(uint64_t bytes, std::string_view what);

  // Lets this budget's charges pass its parent's limit by up to `bytes` (0, the default:
  // not at all). A replacing Attach charges its new session so while the session it
  // replaces still holds the bytes it gives back once it has handed over
  // (SessionService::Attach): a parent's use then stays within its limit plus the
  // allowance, and within its limit once the replaced session is gone.
  void set_parent_allowance(uint64_t bytes) {
    parent_allowance_.store(bytes, std::memory_order_relaxed);
  }

  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t limit() const { return limit_; }
  const std::string& flag() const { return flag_; }

 private:
  friend class MemoryCharge;
  bool TryAdd(uint64_t bytes, uint64_t allowance);
  void Subtract(uint64_t bytes);

  const std::string flag_;
  const uint64_t limit_;
  MemoryBudget* const parent_;
  std::atomic<uint64_t> used_{0};
  std::atomic<uint64_t> parent_allowance_{0};
};

// The server's two budgets, which every session's own charge: what epsd allocates for
// requests, and the host_shm address space it maps.
struct ServerBudgets {
  MemoryBudget allocated;
  MemoryBudget mapped;
};

// Bytes held against each of a ServerBudgets.
struct ServerCharges {
  uint64_t allocated = 0;
  uint64_t mapped = 0;
};

}  // namespace eps::service
