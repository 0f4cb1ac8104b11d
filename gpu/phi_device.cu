// Φ generated on the device for one (layer, KV head), copied to the host: what the
// pre-pass's Φ bank holds (gpu/phi.cuh), for tests against core/'s PhiBank.
#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/cuda_check.h"
#include "gpu/launch.cuh"
#include "gpu/phi.cuh"
#include "gpu/step.h"

namespace eps::gpu {

absl::Status GeneratePhiOnDevice(uint64_t seed, int layer, int kv_head, int head_dim, int m,
                                 float* host_out) {
  const int per_matrix = head_dim * m;
  DeviceBuffer<float> all;
  RETURN_IF_CUDA_ALLOC(all, int64_t{layer + 1} * (kv_head + 1) * per_matrix);
  CUDA_RETURN_IF_ERROR(LaunchKernel(GeneratePhiKernel, 64, 256, 0, nullptr, seed, layer + 1,
                                    kv_head + 1, per_matrix, PhiScale(m), all.get()));
  const int64_t offset = (int64_t{layer} * (kv_head + 1) + kv_head) * per_matrix;
  CUDA_RETURN_IF_ERROR(
      cudaMemcpy(host_out, all.get() + offset, per_matrix * sizeof(float), cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

}  // namespace eps::gpu
