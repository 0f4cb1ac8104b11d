// The engine-side watchdog of docs/design.md §6: a step that epsd accepted
// asynchronously holds the engine's stream on selection_done >= step; if the
// sidecar dies (or stalls) before it writes that counter, the watchdog
// releases the stream after `timeout` (every list "attend densely", then
// selection_done = step), so no GPU wait on the sidecar is ever unbounded.
//
// Arm the step after each accepted async reply; a newer step supersedes an
// older one (releasing the newer also releases the older wait, selection_done
// being raised to the step, never lowered), and an older step than the one armed
// leaves it armed, with its due time: two threads arming out of order, or a late
// Arm, must not drop the watch of the newer step. A release that fails (a device call
// refused) leaves the step armed, due one timeout later, so that it is tried again (it was
// once dropped, and the engine's wait with it). Destroying the watchdog
// finishes the armed step's watch rather than dropping it: the destructor
// returns once selection_done reaches the step, or at the step's due time after
// releasing it (one try). An engine that shuts down while epsd is gone would otherwise
// leave its stream waiting for good, and its buffers' teardown
// (cudaDeviceSynchronize) with it.
//
// The device work goes through a `Device`: DeviceBuffers' (client/cpp's) or the
// C ABI's raw pointers (engine_capi.cc), so one watchdog serves both, and its
// timing is tested without a GPU (tests/client/selection_watchdog_test.cc).
// Thread safety: Arm and releases() from any thread; the Device's functions run
// on the watchdog's thread, and in the destructor on the destroying thread.
// Ownership: the DeviceBuffers form shares the buffers' ownership, so they outlive the
// watchdog whatever order the engine drops them in (its thread reads selection_done at an
// armed step's due time, and a release writes -1s, NaNs and the counter: freed memory, or
// another allocation's, were the buffers gone). What a Device's functions borrow must
// outlive the watchdog.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace eps::client {

class DeviceBuffers;

class SelectionWatchdog {
 public:
  // The two device operations the watchdog needs.
  struct Device {
    std::function<absl::StatusOr<uint64_t>()> read_done;       // selection_done now
    std::function<absl::Status(uint64_t step)> release_dense;  // done when it returns
  };
  // The longest timeout: the engine's stream waits up to this long for epsd, so a
  // longer one bounds nothing an engine can use (and past about 292 years the due
  // time would wrap into the past, releasing every step at once).
  static constexpr std::chrono::microseconds kMaxTimeout = std::chrono::hours(1);

  // InvalidArgument for a timeout <= 0 (one would release every armed step at once,
  // while epsd may still be writing its lists) or above kMaxTimeout, or a Device
  // without both functions.
  static absl::StatusOr<std::unique_ptr<SelectionWatchdog>> Create(
      Device device, std::chrono::microseconds timeout);
  // DeviceBuffers' ReadSelectionDone and ReleaseDense(step) (defined in device_buffers.cc);
  // the watchdog holds `buffers` until it is destroyed. InvalidArgument for null buffers.
  static absl::StatusOr<std::unique_ptr<SelectionWatchdog>> Create(
      std::shared_ptr<DeviceBuffers> buffers, std::chrono::microseconds timeout);
  ~SelectionWatchdog();
  SelectionWatchdog(const SelectionWatchdog&) = delete;
  SelectionWatchdog& operator=(const SelectionWatchdog&) = delete;

  // Watches `step` from now on, unless a newer step is armed (then nothing changes).
  // InvalidArgument for step 0, which means "nothing armed" (the armed step's watch
  // would be dropped).
  absl::Status Arm(uint64_t step);
  uint64_t releases() const;  // steps the watchdog released
  std::chrono::microseconds timeout() const { return timeout_; }

 private:
  SelectionWatchdog(Device device, std::chrono::microseconds timeout);
  void Loop();
  // Reads selection_done and releases `step` unless it reached it: true if released, false
  // if it had no need, the release's error if it failed.
  absl::StatusOr<bool> CheckAndRelease(uint64_t step);

  const Device device_;
  const std::chrono::microseconds timeout_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t armed_step_ ABSL_GUARDED_BY(mu_) = 0;  // 0: nothing armed
  std::chrono::steady_clock::time_point armed_at_ ABSL_GUARDED_BY(mu_);
  uint64_t releases_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace eps::client
