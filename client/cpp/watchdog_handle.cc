#include "client/cpp/watchdog_handle.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace eps::client {

absl::Status WatchdogHandle::Run(absl::string_view what,
                                 absl::FunctionRef<absl::Status(SelectionWatchdog&)> call) {
  absl::ReaderMutexLock lock(&mu_);
  if (watchdog_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the watchdog is being destroyed (or was)"));
  }
  return call(*watchdog_);
}

void WatchdogHandle::Destroy() {
  std::unique_ptr<SelectionWatchdog> watchdog;
  {
    absl::MutexLock lock(&mu_);  // after every Run holding the watchdog
    watchdog = std::move(watchdog_);
  }
  // Off the lock: the watch may take up to its timeout, and a Run meanwhile is refused at
  // once rather than waiting for it.
  watchdog.reset();
}

}  // namespace eps::client
