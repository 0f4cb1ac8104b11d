#include "service/session.h"

#include <chrono>

#include "core/status.h"
#include "service/cpu_backend.h"
#include "service/cuda_backend.h"

namespace eps::service {

int64_t SteadyNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

absl::StatusOr<std::unique_ptr<Session>> Session::Create(const v1::AttachRequest& request,
                                                         const ServerConfig& config) {
  std::unique_ptr<Session> s(new Session());
  ASSIGN_OR_RETURN(s->spec_, SessionSpecFromProto(request, config));
  const SessionSpec& spec = s->spec_;
  if (spec.backend == BackendKind::kCuda) {
    s->mappings_.set_cuda_ipc_opener(MakeCudaIpcOpener(spec.device));
  }
  ASSIGN_OR_RETURN(s->buffers_, ResolveSessionBuffers(request.buffers(), spec, s->mappings_));
  ASSIGN_OR_RETURN(s->policy_, SessionPolicy(spec, request, config.policy));
  if (spec.backend == BackendKind::kCuda) {
    if (s->policy_.budget == Budget::kMass) {
      return absl::UnimplementedError(
          "the cuda backend serves the threshold, fixed and top-p budgets and strict mode; the "
          "mass budget runs on the cpu backend");
    }
    ASSIGN_OR_RETURN(
        s->backend_,
        MakeCudaBackend(spec.model, spec.device, spec.max_batch, s->buffers_.max_groups,
                        std::chrono::milliseconds(config.inputs_timeout_ms)));
  } else {
    ASSIGN_OR_RETURN(s->backend_, MakeCpuBackend(spec.model));
  }
  return s;
}

void Session::Touch() { last_active_ms.store(SteadyNowMs()); }

void Session::CountStep(const StepStats& stats) {
  steps.fetch_add(1);
  groups_total.fetch_add(stats.groups_total);
  groups_visited.fetch_add(stats.groups_visited);
  bytes_dense.fetch_add(stats.kv_bytes_dense);
  bytes_read.fetch_add(stats.kv_bytes_read_est);
}

}  // namespace eps::service
