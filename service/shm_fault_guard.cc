#include "service/shm_fault_guard.h"

#include <signal.h>
#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace eps::service {
namespace {

// One covered mapping. `state` is the publication flag: the handler reads base
// and size only after an acquire load of kLive.
struct Region {
  enum : int { kFree = 0, kClaimed = 1, kLive = 2 };
  std::atomic<int> state{kFree};
  std::atomic<uintptr_t> base{0};
  std::atomic<size_t> size{0};
  std::atomic<bool> faulted{false};
};

Region g_regions[ShmFaultGuard::kMaxRegions];
struct sigaction g_previous;  // written once, before the handler is installed

// Async-signal-safe: atomics and mmap only (the technique Wayland compositors
// use for client shm pools that shrink).
void OnSigbus(int signal, siginfo_t* info, void* context) {
  const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
  for (Region& region : g_regions) {
    if (region.state.load(std::memory_order_acquire) != Region::kLive) continue;
    const uintptr_t base = region.base.load(std::memory_order_relaxed);
    const size_t size = region.size.load(std::memory_order_relaxed);
    if (address < base || address - base >= size) continue;
    // Private zero pages in place of the whole shared mapping: the faulting
    // instruction re-runs against them, and the engine's object is no longer
    // read or written (the session fails its step, then re-attaches).
    void* replaced = mmap(reinterpret_cast<void*>(base), size, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (replaced != MAP_FAILED) {
      region.faulted.store(true, std::memory_order_release);
      return;
    }
    break;  // cannot repair: fall through to the previous disposition
  }
  // Not ours: behave as if this handler were never installed.
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) {
      g_previous.sa_sigaction(signal, info, context);
      return;
    }
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(signal);
    return;
  }
  // Default: restore it and return; the access faults again and ends the process.
  sigaction(SIGBUS, &g_previous, nullptr);
}

absl::Status Install() {
  static std::once_flag once;
  static int error = 0;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, nullptr, &g_previous) != 0 || sigaction(SIGBUS, &action, nullptr) != 0) {
      error = errno;
    }
  });
  if (error != 0) {
    return absl::InternalError(absl::StrCat("sigaction(SIGBUS): ", std::strerror(error)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int> ShmFaultGuard::Register(void* base, size_t size) {
  if (absl::Status s = Install(); !s.ok()) return s;
  for (int i = 0; i < kMaxRegions; ++i) {
    int expected = Region::kFree;
    if (!g_regions[i].state.compare_exchange_strong(expected, Region::kClaimed,
                                                    std::memory_order_acq_rel)) {
      continue;
    }
    g_regions[i].base.store(reinterpret_cast<uintptr_t>(base), std::memory_order_relaxed);
    g_regions[i].size.store(size, std::memory_order_relaxed);
    g_regions[i].faulted.store(false, std::memory_order_relaxed);
    g_regions[i].state.store(Region::kLive, std::memory_order_release);
    return i;
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("epsd covers ", kMaxRegions, " shm mappings already"));
}

void ShmFaultGuard::Unregister(int region) {
  if (region < 0 || region >= kMaxRegions) return;
  g_regions[region].state.store(Region::kFree, std::memory_order_release);
}

bool ShmFaultGuard::Faulted(int region) {
  if (region < 0 || region >= kMaxRegions) return false;
  return g_regions[region].faulted.load(std::memory_order_acquire);
}

}  // namespace eps::service
