#include "bench/gpu_bench_util.h"

#include <algorithm>
#include <chrono>

#include "core/status.h"
#include "gpu/stream_ops.h"

namespace eps::bench {

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

absl::StatusOr<double> MeasureQueued(gpu::GpuSelector& selector, const StepInputs& in,
                                     const SelectPolicy& policy, const StepOutputs& out) {
  RETURN_IF_ERROR(gpu::PreloadStreamOps());
  gpu::DeviceBuffer<uint64_t> counter;
  RETURN_IF_CUDA_ALLOC(counter, 1);
  CUDA_RETURN_IF_ERROR(cudaMemset(counter.get(), 0, sizeof(uint64_t)));
  cudaStream_t release;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&release, cudaStreamNonBlocking));
  std::vector<float> gpu_us;
  absl::Status status;
  for (uint64_t step = 1; step <= 60 && status.ok(); ++step) {
    status = selector.Enqueue(in, policy, out, {.inputs_ready = counter.get(), .step = step});
    if (status.ok()) {
      status = gpu::StreamWriteCounter(release, counter.get(), step);
      if (!status.ok()) {  // nothing else would release the step
        cudaMemcpy(counter.get(), &step, sizeof(step), cudaMemcpyHostToDevice);
      }
      StepStats stats;
      float us = 0;
      const absl::Status finished = selector.Finish(std::chrono::microseconds::max(), &stats, &us);
      if (status.ok()) status = finished;
      if (step > 10) gpu_us.push_back(us);  // warm-up excluded
    }
  }
  cudaStreamDestroy(release);
  RETURN_IF_ERROR(status);
  return Median(gpu_us);
}

}  // namespace eps::bench
