// Built instead of cuda_backend.cc when nvcc is absent.
#include "service/cuda_backend.h"

namespace eps::service {

bool CudaBackendBuilt() { return false; }
uint64_t CudaBackendDeviceBytes(const ModelLayout&, int64_t, int64_t, int64_t) { return 0; }
bool CudaSafeToFree(int, std::chrono::steady_clock::duration, std::chrono::steady_clock::duration) {
  return true;
}
std::optional<std::chrono::steady_clock::time_point> CudaAbandonedWorkSince(int) {
  return std::nullopt;
}
bool CudaDevicePresent() { return false; }
void DisableCuda(std::string) {}
std::string CudaUnavailableReason() { return "epsd was built without CUDA"; }
CudaIpcOpener MakeCudaIpcOpener(int) { return nullptr; }
int CudaDeviceCount() { return 0; }
absl::Status WarmUpCuda() { return absl::OkStatus(); }
absl::StatusOr<int> CudaDeviceWithUuid(std::string_view) {
  return absl::FailedPreconditionError("this epsd was built without CUDA");
}

absl::StatusOr<std::unique_ptr<StepBackend>> MakeCudaBackend(const ModelLayout&, int, int64_t,
                                                             int64_t, std::chrono::microseconds,
                                                             std::unique_ptr<StepBackend>*) {
  return absl::FailedPreconditionError("this epsd was built without CUDA");
}

}  // namespace eps::service
