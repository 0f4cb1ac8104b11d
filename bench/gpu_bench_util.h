// What eps_gpu_bench's tables share (bench/gpu_select_bench.cc, bench/gpu_coarse_table.cc,
// bench/gpu_feedback_table.cc): the median of a sample, a host-to-device upload, a level's
// records on the device, and a step timed while held by a fence.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/layout.h"
#include "core/select.h"
#include "core/step.h"
#include "gpu/cuda_check.h"
#include "gpu/step.h"

namespace eps::bench {

float Median(std::vector<float> v);

// Allocates `d` for `count` elements and copies them from `host`.
template <typename T>
absl::Status Upload(gpu::DeviceBuffer<T>& d, const T* host, int64_t count) {
  RETURN_IF_CUDA_ALLOC(d, count);
  CUDA_RETURN_IF_ERROR(cudaMemcpy(d.get(), host, count * sizeof(T), cudaMemcpyHostToDevice));
  return absl::OkStatus();
}

// One level's records on the device for `batch` rows of `context` tokens under
// `m` (its groups of m.group_blocks blocks): one row's random records
// (FillRandomSummaries) copied to every row (a row's slots consecutive), and the
// rows' table and blocks. A whole batch's host pool at g = 1 would be 22 GB at
// 64 x 32k; the device reads the same bytes either way.
struct LevelOnDevice {
  gpu::DeviceBuffer<float> pool;
  gpu::DeviceBuffer<int32_t> table, blocks;
  int64_t slots = 0, max_groups = 0, max_blocks = 0;
};
absl::Status UploadLevel(const ModelLayout& m, int batch, int64_t context, LevelOnDevice* level);

// The step inputs of `rows` (table row = batch position) over `level` alone (no
// coarse level, no feedback), with `queries` [layers, batch, q_heads, d] on the device.
StepInputs LevelInputs(const LevelOnDevice& level, int batch, std::span<const StepRow> rows,
                       const float* queries);

// The step held on the selector's stream by an inputs_ready counter until its
// launch is queued, then released from another stream, as an engine's step
// fence holds it (docs/design.md §5): the p50 GPU µs of 50 steps (10 warm-up)
// without the host's launch inside it (Select's events bracket the host's graph
// launch on an idle GPU). NaN after SkipQueued().
absl::StatusOr<double> MeasureQueued(gpu::GpuSelector& selector, const StepInputs& in,
                                     const SelectPolicy& policy, const StepOutputs& out);

// Makes MeasureQueued measure nothing (NaN): under a profiler that serialises
// kernels (Nsight Compute) the held step waits for a release that cannot run
// beside it, and the profile stalls (scripts/gpu_profile.sh, 2026-11-26).
void SkipQueued();

}  // namespace eps::bench
