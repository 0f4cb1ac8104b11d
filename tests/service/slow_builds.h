// Session builds that wait for the test (an engine's buffers slow to map, its CUDA IPC
// handles slow to open), for the tests of Attach on the StepExecutor (slow_attach_test.cc,
// attach_races_test.cc).
#pragma once

#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "core/status.h"
#include "service/cpu_backend.h"
#include "service/session.h"
#include "tests/service/forwarding_backend.h"
#include "tests/service/long_calls.h"

namespace eps::service {

// The cpu backend, counting its destruction as the end of the build that made it.
class CountedBackend final : public ForwardingBackend {
 public:
  CountedBackend(std::unique_ptr<StepBackend> inner, held::LongCalls* builds)
      : ForwardingBackend(std::move(inner)), builds_(builds) {}
  ~CountedBackend() override { builds_->Stopped(); }

 private:
  held::LongCalls* builds_;
};

// Builds the sessions of engines named "slow-*" only once `builds->release` is notified,
// counting each as started when it begins and as stopped when its backend is destroyed
// (`builds` outlives the sessions). Other engines' sessions are built at once.
inline BackendFactory SlowBuilds(held::LongCalls* builds) {
  return [builds](const SessionSpec& spec, const SessionBuffers&, const ServerConfig&,
                  std::unique_ptr<StepBackend>*) -> absl::StatusOr<std::unique_ptr<StepBackend>> {
    ASSIGN_OR_RETURN(std::unique_ptr<StepBackend> cpu, MakeCpuBackend(spec.model));
    if (!absl::StartsWith(spec.engine_id, "slow-")) return cpu;
    builds->Started();
    builds->release.WaitForNotification();
    return std::unique_ptr<StepBackend>(new CountedBackend(std::move(cpu), builds));
  };
}

}  // namespace eps::service
