#include "bench/gpu_bench_util.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <vector>

#include "core/status.h"
#include "core/testing/synthetic.h"
#include "gpu/stream_ops.h"

namespace eps::bench {

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

absl::Status UploadLevel(const ModelLayout& m, int batch, int64_t context, LevelOnDevice* level) {
  testing::StepBuffers one(m, 1, context, 1, Granularity::kUnion);
  one.AssignRow(0, context, 0);
  one.FillRandomSummaries(1);
  const int64_t row_floats = static_cast<int64_t>(one.pool().size());
  level->max_groups = one.max_groups();
  level->max_blocks = one.max_blocks();
  level->slots = batch * level->max_groups;
  RETURN_IF_CUDA_ALLOC(level->pool, row_floats * batch);
  CUDA_RETURN_IF_ERROR(cudaMemcpy(level->pool.get(), one.pool().data(), row_floats * sizeof(float),
                                  cudaMemcpyHostToDevice));
  std::vector<int32_t> table(batch * level->max_groups), blocks(batch * level->max_blocks);
  for (int b = 0; b < batch; ++b) {
    if (b > 0) {
      CUDA_RETURN_IF_ERROR(cudaMemcpy(level->pool.get() + b * row_floats, level->pool.get(),
                                      row_floats * sizeof(float), cudaMemcpyDeviceToDevice));
    }
    for (int64_t p = 0; p < level->max_groups; ++p) {
      table[b * level->max_groups + p] = static_cast<int32_t>(b * level->max_groups + p);
    }
    for (int64_t k = 0; k < level->max_blocks; ++k) {
      blocks[b * level->max_blocks + k] =
          static_cast<int32_t>(b * level->max_blocks) + one.block_table()[k];
    }
  }
  RETURN_IF_ERROR(Upload(level->table, table.data(), static_cast<int64_t>(table.size())));
  return Upload(level->blocks, blocks.data(), static_cast<int64_t>(blocks.size()));
}

StepInputs LevelInputs(const LevelOnDevice& level, int batch, std::span<const StepRow> rows,
                       const float* queries) {
  StepInputs in;
  in.summary_pool = level.pool.get();
  in.num_slots = level.slots;
  in.group_table = level.table.get();
  in.block_table = level.blocks.get();
  in.max_seqs = batch;
  in.max_groups = level.max_groups;
  in.max_blocks = level.max_blocks;
  in.num_physical_blocks = batch * level.max_blocks;
  in.queries = queries;
  in.max_batch = batch;
  in.rows = rows;
  return in;
}

namespace {
bool skip_queued = false;
}  // namespace

void SkipQueued() { skip_queued = true; }

absl::StatusOr<double> MeasureQueued(gpu::GpuSelector& selector, const StepInputs& in,
                                     const SelectPolicy& policy, const StepOutputs& out) {
  if (skip_queued) return std::numeric_limits<double>::quiet_NaN();
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
