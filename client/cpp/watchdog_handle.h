// A SelectionWatchdog behind a handle that any thread may call while one destroys it: the
// C ABI's eps_engine_watchdog_* (engine_capi.h), whose destroy may be called from any
// thread and may wait up to the armed step's due time (SelectionWatchdog's destructor
// finishes that step's watch). The watchdog once went while other threads still called it
// (its pointer cleared first, then the wait): an arm or a read meanwhile dereferenced null.
//
// Here a call runs on the watchdog under a shared lock, and Destroy takes the watchdog out
// of the handle under the exclusive one, so once Destroy has begun every call is refused with
// FailedPrecondition at once, without touching the watchdog, while the destroy waits out
// the watch; calls already running finish before the watchdog goes.
// Thread safety: Run from any thread, Destroy from any (once; later calls return at once).
// Ownership: the handle owns the watchdog. What the watchdog's Device borrows must outlive
// Destroy's return; a call made after this object is freed is the caller's bug (nothing
// can detect it).
#pragma once

#include <memory>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "client/cpp/selection_watchdog.h"

namespace eps::client {

class WatchdogHandle {
 public:
  explicit WatchdogHandle(std::unique_ptr<SelectionWatchdog> watchdog)
      : watchdog_(std::move(watchdog)) {}
  ~WatchdogHandle() { Destroy(); }
  WatchdogHandle(const WatchdogHandle&) = delete;
  WatchdogHandle& operator=(const WatchdogHandle&) = delete;

  // `call` on the watchdog and its status; FailedPrecondition naming `what` once Destroy
  // has begun (or with no watchdog), without running it.
  absl::Status Run(absl::string_view what,
                   absl::FunctionRef<absl::Status(SelectionWatchdog&)> call);
  // Refuses later calls, waits for those running, then destroys the watchdog (which may
  // wait up to the armed step's due time: see SelectionWatchdog).
  void Destroy();

 private:
  absl::Mutex mu_;  // shared by each Run, exclusive while Destroy takes the watchdog
  std::unique_ptr<SelectionWatchdog> watchdog_ ABSL_GUARDED_BY(mu_);  // null once Destroy began
};

}  // namespace eps::client
