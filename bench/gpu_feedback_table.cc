// Selection feedback's table of eps_gpu_bench (bench/gpu_feedback_table.h).
#include "bench/gpu_feedback_table.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "bench/gpu_bench_util.h"
#include "core/status.h"
#include "gpu/cuda_check.h"
#include "gpu/step.h"

namespace eps::bench {

using gpu::DeviceBuffer;

absl::Status MeasureFeedback(ModelLayout m, int batch, int64_t context, int top_pages) {
  m.features = {.key_sum = false, .principal = false, .quest = true};
  m.group_blocks = 2;
  m.coarse_blocks = 0;
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> uniform(-0.5f, 0.5f);
  std::vector<float> host_queries(int64_t{m.num_layers} * batch * m.num_q_heads * m.head_dim);
  for (float& q : host_queries) q = uniform(rng);
  DeviceBuffer<float> queries;
  RETURN_IF_ERROR(Upload(queries, host_queries.data(), static_cast<int64_t>(host_queries.size())));
  std::vector<StepRow> rows;
  for (int b = 0; b < batch; ++b) rows.push_back({.table_row = b, .context_tokens = context});
  LevelOnDevice level;
  RETURN_IF_ERROR(UploadLevel(m, batch, context, &level));
  const StepInputs plain = LevelInputs(level, batch, rows, queries.get());
  DeviceBuffer<int32_t> visit, count;
  RETURN_IF_CUDA_ALLOC(visit, int64_t{m.num_layers} * batch * level.max_blocks);
  RETURN_IF_CUDA_ALLOC(count, int64_t{m.num_layers} * batch);
  ASSIGN_OR_RETURN(auto selector, gpu::GpuSelector::Create(m, 0, batch, level.max_groups));
  SelectPolicy policy;
  policy.method = Method::kQuestClt;
  policy.top_pages = top_pages;
  // [layers, max_seqs, q_heads, max_groups]: NaN (not visited) but for `percent` of the
  // groups, drawn at random, whose entries are log-masses of a few units.
  const int64_t feedback_floats = int64_t{m.num_layers} * batch * m.num_q_heads * level.max_groups;
  DeviceBuffer<float> master, feedback;
  RETURN_IF_CUDA_ALLOC(master, feedback_floats);
  RETURN_IF_CUDA_ALLOC(feedback, feedback_floats);
  std::printf("%6s %8s  %-24s %9s %9s\n", "batch", "context", "feedback", "gpu_us", "added_us");
  double off_us = 0;
  for (const int percent : {-1, 0, 25, 100}) {  // -1: no feedback buffer
    if (percent >= 0) {
      std::vector<float> host(feedback_floats, std::numeric_limits<float>::quiet_NaN());
      std::normal_distribution<float> entry(3.0f, 2.0f);
      std::uniform_int_distribution<int> hundred(0, 99);
      for (float& e : host) {
        if (hundred(rng) < percent) e = entry(rng);
      }
      CUDA_RETURN_IF_ERROR(cudaMemcpy(master.get(), host.data(), feedback_floats * sizeof(float),
                                      cudaMemcpyHostToDevice));
    }
    StepInputs in = plain;
    in.feedback = percent >= 0 ? feedback.get() : nullptr;
    std::vector<float> gpu_us;
    for (int i = 0; i < 60; ++i) {
      if (percent >= 0) {  // the previous step consumed the entries
        CUDA_RETURN_IF_ERROR(cudaMemcpy(feedback.get(), master.get(),
                                        feedback_floats * sizeof(float), cudaMemcpyDeviceToDevice));
        CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
      }
      float us = 0;
      RETURN_IF_ERROR(selector->Select(in, policy, {visit.get(), count.get()}, nullptr, &us));
      if (i >= 10) gpu_us.push_back(us);  // warm-up excluded
    }
    const double us = Median(gpu_us);
    if (percent < 0) off_us = us;
    char name[32];
    std::snprintf(name, sizeof(name), percent < 0 ? "off" : "%d %% of groups fed", percent);
    std::printf("%6d %8lld  %-24s %9.1f %9.1f\n", batch, static_cast<long long>(context), name, us,
                us - off_us);
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

}  // namespace eps::bench
