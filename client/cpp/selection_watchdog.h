// The engine-side watchdog of docs/design.md §6: a step that epsd accepted
// asynchronously holds the engine's stream on selection_done >= step; if the
// sidecar dies (or stalls) before it writes that counter, the watchdog
// releases the stream after `timeout` with DeviceBuffers::ReleaseDense (every
// list "attend densely"), so no GPU wait on the sidecar is ever unbounded.
//
// Arm the step after each accepted async reply; a newer step supersedes an
// older one (releasing the newer also releases the older wait, the counter
// being monotonic). Thread safety: Arm and releases() from any thread; the
// watchdog thread is joined in the destructor. Ownership: borrows `buffers`, which
// must outlive the watchdog.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/cpp/device_buffers.h"

namespace eps::client {

class SelectionWatchdog {
 public:
  // InvalidArgument for a timeout <= 0 (one would release every armed step at once,
  // while epsd may still be writing its lists).
  static absl::StatusOr<std::unique_ptr<SelectionWatchdog>> Create(
      DeviceBuffers& buffers, std::chrono::microseconds timeout);
  ~SelectionWatchdog();
  SelectionWatchdog(const SelectionWatchdog&) = delete;
  SelectionWatchdog& operator=(const SelectionWatchdog&) = delete;

  void Arm(uint64_t step);
  uint64_t releases() const;  // steps the watchdog released

 private:
  SelectionWatchdog(DeviceBuffers& buffers, std::chrono::microseconds timeout);
  void Loop();

  DeviceBuffers& buffers_;
  const std::chrono::microseconds timeout_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t armed_step_ ABSL_GUARDED_BY(mu_) = 0;  // 0: nothing armed
  std::chrono::steady_clock::time_point armed_at_ ABSL_GUARDED_BY(mu_);
  uint64_t releases_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace eps::client
