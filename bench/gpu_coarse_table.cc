// The coarse level's table of eps_gpu_bench (bench/gpu_coarse_table.h).
#include "bench/gpu_coarse_table.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench/gpu_bench_util.h"
#include "core/status.h"
#include "core/testing/synthetic.h"
#include "gpu/cuda_check.h"
#include "gpu/step.h"

namespace eps::bench {

using gpu::DeviceBuffer;

absl::Status MeasureCoarse(eps::ModelLayout m, int batch, int64_t context, int top_pages) {
  m.features = {.key_sum = false, .principal = false, .quest = true};
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> uniform(-0.5f, 0.5f);
  std::vector<float> host_queries(int64_t{m.num_layers} * batch * m.num_q_heads * m.head_dim);
  for (float& q : host_queries) q = uniform(rng);
  DeviceBuffer<float> queries;
  RETURN_IF_ERROR(Upload(queries, host_queries.data(), static_cast<int64_t>(host_queries.size())));
  std::vector<eps::StepRow> rows;
  for (int b = 0; b < batch; ++b) rows.push_back({.table_row = b, .context_tokens = context});
  // Flat at g = 2 and at g = 1 (what the fine level alone costs), then the level.
  for (const auto& [group_blocks, coarse] : {std::pair{2, false}, {1, false}, {1, true}}) {
    m.group_blocks = group_blocks;
    m.coarse_blocks = coarse ? 4 : 0;
    LevelOnDevice fine, coarse_level;
    RETURN_IF_ERROR(UploadLevel(m, batch, context, &fine));
    if (coarse) {
      eps::ModelLayout coarse_model = m;
      coarse_model.group_blocks = m.coarse_blocks;
      coarse_model.coarse_blocks = 0;
      RETURN_IF_ERROR(UploadLevel(coarse_model, batch, context, &coarse_level));
    }
    eps::StepInputs in = LevelInputs(fine, batch, rows, queries.get());
    in.coarse_pool = coarse_level.pool.get();
    in.coarse_slots = coarse_level.slots;
    in.coarse_table = coarse_level.table.get();
    in.max_coarse_groups = coarse_level.max_groups;
    DeviceBuffer<int32_t> visit, count;
    const int64_t lists = int64_t{m.num_layers} * batch * m.num_kv_heads;  // per-KV-head's
    RETURN_IF_CUDA_ALLOC(visit, lists * fine.max_blocks);
    RETURN_IF_CUDA_ALLOC(count, lists);
    ASSIGN_OR_RETURN(auto selector, eps::gpu::GpuSelector::Create(m, 0, batch, fine.max_groups));
    for (const eps::Granularity granularity :
         {eps::Granularity::kUnion, eps::Granularity::kPerKvHead}) {
      eps::SelectPolicy policy;
      policy.method = eps::Method::kQuestClt;
      policy.top_pages = top_pages;
      policy.granularity = granularity;
      policy.coarse_candidates = 2.0f;
      std::vector<float> gpu_us;
      eps::StepStats stats;
      for (int i = 0; i < 60; ++i) {
        float us = 0;
        RETURN_IF_ERROR(selector->Select(in, policy, {visit.get(), count.get()}, &stats, &us));
        if (i >= 10) gpu_us.push_back(us);
      }
      ASSIGN_OR_RETURN(const double queued_us,
                       MeasureQueued(*selector, in, policy, {visit.get(), count.get()}));
      const std::string name =
          (coarse ? std::string("coarse g=1 gc=4 c=2") : "flat g=" + std::to_string(group_blocks)) +
          (granularity == eps::Granularity::kUnion ? " union" : " per_kv_head");
      std::printf("%6d %8lld  %-32s %10.1f %9.1f %10.1f %8.1f%%\n", batch,
                  static_cast<long long>(context), name.c_str(),
                  static_cast<double>(stats.summary_bytes_read) / 1e6, Median(gpu_us), queued_us,
                  100.0 * stats.groups_visited / stats.groups_total);
      std::fflush(stdout);
    }
  }
  return absl::OkStatus();
}

}  // namespace eps::bench
