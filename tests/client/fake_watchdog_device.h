// A stand-in for SelectionWatchdog's device (no GPU): selection_done as a counter, and a
// log of the steps released (each release raises the counter to its step, as the device's
// does; release_failures makes the next releases fail). Shared by selection_watchdog_test.cc and
// watchdog_handle_test.cc.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/cpp/selection_watchdog.h"

namespace eps::client::testing {

struct FakeWatchdogDevice {
  std::atomic<uint64_t> done{0};
  std::atomic<bool> read_fails{false};
  std::atomic<int> release_failures{0};  // releases to refuse before the next succeeds
  std::atomic<int> release_calls{0};
  std::mutex mu;
  std::vector<uint64_t> released;  // guarded by mu

  SelectionWatchdog::Device Functions() {
    return {.read_done = [this]() -> absl::StatusOr<uint64_t> {
              if (read_fails) return absl::InternalError("the device is gone");
              return done.load();
            },
            .release_dense =
                [this](uint64_t step) {
                  ++release_calls;
                  if (release_failures > 0) {
                    --release_failures;
                    return absl::InternalError("cudaLaunchKernel: launch out of resources");
                  }
                  std::lock_guard lock(mu);
                  released.push_back(step);
                  uint64_t now = done.load();
                  while (now < step && !done.compare_exchange_weak(now, step)) {
                  }
                  return absl::OkStatus();
                }};
  }
  std::vector<uint64_t> Released() {
    std::lock_guard lock(mu);
    return released;
  }
};

}  // namespace eps::client::testing
