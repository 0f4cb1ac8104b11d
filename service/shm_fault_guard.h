// Keeps a SIGBUS in an engine's shared memory from killing epsd.
//
// An engine owns the POSIX shm objects epsd maps; if it shrinks one after
// Attach (ftruncate), the next read or write of the lost pages raises SIGBUS,
// whose default action would end epsd and every other engine's session. A
// region registered here is covered by a process-wide SIGBUS handler: a fault
// inside it replaces the whole region with private zero pages (so the faulting
// access completes harmlessly) and marks the region faulted; the session then
// fails its step with the shm object's name (docs/security.md). A fault outside
// every region goes to the handler that was installed before, as if this one
// were not there.
//
// Thread safety: Register, Unregister and Faulted may be called from any
// thread; the signal handler reads the region table without locks.
#pragma once

#include <cstddef>

#include "absl/status/statusor.h"

namespace eps::service {

class ShmFaultGuard {
 public:
  // The most regions covered at once (each host_shm object of each session is one).
  static constexpr int kMaxRegions = 4096;

  // Covers [base, base + size), a MAP_SHARED mapping of a shm object; installs
  // the handler on first use. RESOURCE_EXHAUSTED when kMaxRegions are covered.
  static absl::StatusOr<int> Register(void* base, size_t size);
  // Stops covering the region (before it is unmapped).
  static void Unregister(int region);
  // True once a fault hit the region; its pages then read as zeros.
  static bool Faulted(int region);
};

}  // namespace eps::service
