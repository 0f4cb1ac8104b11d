// What the structure of a step costs on an empty GPU, before any work: one
// empty kernel, three empty kernels replayed as a graph (the three-kernel
// step's shape), and one cooperative kernel with 0 and 3 grid-wide barriers
// (the shape of a cooperative step, tried and removed:
// docs/benchmarks/gpu-history-2026-11-25-26.md), for a few grid sizes. GPU
// time between CUDA events, median of 200 launches after 20 of warm-up; blocks
// of 256 threads.
//
// Usage: eps_grid_barrier_probe        (prints one table)
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "gpu/cuda_check.h"

namespace {

__global__ void Empty() {}

template <int kBarriers>
__global__ void Barriers() {
  for (int i = 0; i < kBarriers; ++i) cooperative_groups::this_grid().sync();
}

// GPU µs between events around `launch` (returns cudaError_t): the median of 200
// after 20 of warm-up.
template <typename Launch>
absl::StatusOr<float> MedianUs(cudaStream_t stream, Launch launch) {
  cudaEvent_t start, stop;
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  std::vector<float> us;
  for (int i = 0; i < 220; ++i) {
    CUDA_RETURN_IF_ERROR(cudaEventRecord(start, stream));
    CUDA_RETURN_IF_ERROR(launch());
    CUDA_RETURN_IF_ERROR(cudaEventRecord(stop, stream));
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 20) us.push_back(ms * 1000.0f);
  }
  CUDA_RETURN_IF_ERROR(cudaEventDestroy(start));
  CUDA_RETURN_IF_ERROR(cudaEventDestroy(stop));
  std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
  return us[us.size() / 2];
}

cudaError_t Cooperative(const void* kernel, unsigned blocks, cudaStream_t stream) {
  cudaLaunchAttribute together{};
  together.id = cudaLaunchAttributeCooperative;
  together.val.cooperative = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(256);
  config.stream = stream;
  config.attrs = &together;
  config.numAttrs = 1;
  return cudaLaunchKernelExC(&config, kernel, nullptr);
}

absl::Status PrintTable() {
  cudaDeviceProp prop;
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Three empty kernels captured as one graph.
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_RETURN_IF_ERROR(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int k = 0; k < 3; ++k) Empty<<<256, 256, 0, stream>>>();
  CUDA_RETURN_IF_ERROR(cudaStreamEndCapture(stream, &graph));
  CUDA_RETURN_IF_ERROR(cudaGraphInstantiate(&exec, graph, 0));
  int per_sm = 0;
  CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, reinterpret_cast<const void*>(&Barriers<3>), 256, 0));
  std::printf("device: %s, %d SMs; empty GPU, blocks of 256 threads, median of 200 (us)\n",
              prop.name, prop.multiProcessorCount);
  std::printf("%-44s %8s\n", "launch", "gpu_us");
  auto row = [&](const std::string& name, auto launch) -> absl::Status {
    ASSIGN_OR_RETURN(const float us, MedianUs(stream, launch));
    std::printf("%-44s %8.1f\n", name.c_str(), us);
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(row("1 empty kernel, 256 blocks", [&] {
    Empty<<<256, 256, 0, stream>>>();
    return cudaGetLastError();
  }));
  RETURN_IF_ERROR(row("3 empty kernels as a graph, 256 blocks each",
                      [&] { return cudaGraphLaunch(exec, stream); }));
  const unsigned most = static_cast<unsigned>(std::min(per_sm, 3) * prop.multiProcessorCount);
  for (const unsigned blocks : {32u, 132u, 256u, most}) {
    for (const int barriers : {0, 3}) {
      const void* kernel = barriers == 0 ? reinterpret_cast<const void*>(&Barriers<0>)
                                         : reinterpret_cast<const void*>(&Barriers<3>);
      RETURN_IF_ERROR(row(absl::StrCat("cooperative, ", blocks, " blocks, ", barriers, " barriers"),
                          [&] { return Cooperative(kernel, blocks, stream); }));
    }
  }
  CUDA_RETURN_IF_ERROR(cudaGraphExecDestroy(exec));
  CUDA_RETURN_IF_ERROR(cudaGraphDestroy(graph));
  return absl::OkStatus();
}

}  // namespace

int main() {
  if (const absl::Status s = PrintTable(); !s.ok()) {
    std::fprintf(stderr, "error: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
