// The GPU pre-pass's captured graphs (gpu/step_launch.cuh CapturedSteps) against kernels
// launched one by one and the core/ reference, over one selector's many steps. Part of
// gpu_step_test; skips cleanly without a CUDA device.
#include <cuda_runtime.h>

#include <algorithm>
#include <random>
#include <span>
#include <vector>

#include "core/phi.h"
#include "core/summary.h"
#include "core/testing/synthetic.h"
#include "gpu/step.h"
#include "gtest/gtest.h"
#include "tests/core/step_fixture.h"
#include "tests/core/test_util.h"
#include "tests/gpu/device_step.h"
#include "tests/gpu/host_copy.h"

namespace eps {
namespace {

using testing::Download;
using testing::Upload;

// One selector over fixed device buffers for many steps, as a session runs:
// steps with equal shapes replay a captured graph (only the step number
// changes), others are captured anew. Every step's lists must equal those of
// kernels launched one by one, exactly, and core/'s up to ties at a cut.
TEST(GpuStepGraphTest, ReplayedStepsEqualDirectLaunchesAndTheReference) {
  SKIP_WITHOUT_DEVICE();
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  ModelLayout m;
  m.num_layers = 2;
  m.num_q_heads = 16;
  m.num_kv_heads = 4;
  m.head_dim = 64;
  m.phi_seed = rng();
  auto phi = PhiBank::Create(m.phi_seed, m.num_layers, m.num_kv_heads, m.head_dim, m.sketch_dim);
  auto reference = PageSelector::Create(m, *phi);
  SummaryWriter writer(m, *phi);
  const int max_batch = 4;
  testing::StepBuffers buffers(m, max_batch, 5000, max_batch, Granularity::kPerKvHead);
  std::vector<StepRow> all_rows;
  for (int r = 0; r < max_batch; ++r) {
    const int64_t tokens = 1000 + static_cast<int64_t>(rng() % 4000);
    testing::WriteSequence(buffers, writer, r, r, tokens, 2, testing::GroupShapes::kMixedRank, rng);
    all_rows.push_back({.table_row = r, .context_tokens = tokens, .seq_id = 0});
  }
  StepInputs in = buffers.Inputs(all_rows);
  const int64_t query_count = int64_t{m.num_layers} * max_batch * m.num_q_heads * m.head_dim;
  const int64_t list_count = int64_t{m.num_layers} * max_batch * m.num_kv_heads;
  float* pool = Upload(buffers.pool());
  int32_t* groups = Upload(buffers.group_table());
  int32_t* blocks = Upload(buffers.block_table());
  float* queries = Upload(std::vector<float>(query_count));
  int32_t* visit[2] = {Upload(std::vector<int32_t>(list_count * buffers.max_blocks(), -1)),
                       Upload(std::vector<int32_t>(list_count * buffers.max_blocks(), -1))};
  int32_t* count[2] = {Upload(std::vector<int32_t>(list_count, -1)),
                       Upload(std::vector<int32_t>(list_count, -1))};
  auto graphs = gpu::GpuSelector::Create(m, 0, max_batch, buffers.max_groups());
  auto direct = gpu::GpuSelector::Create(m, 0, max_batch, buffers.max_groups(), {.graphs = false});
  ASSERT_TRUE(graphs.ok() && direct.ok());
  gpu::GpuSelector* selectors[2] = {graphs->get(), direct->get()};
  const Budget budgets[4] = {Budget::kThreshold, Budget::kFixed, Budget::kTopP, Budget::kMass};
  for (int step = 0; step < 12; ++step) {
    // Fresh queries every step; the batch and the budget change every third step.
    for (int layer = 0; layer < m.num_layers; ++layer) {
      for (int b = 0; b < max_batch; ++b) {
        for (int h = 0; h < m.num_q_heads; ++h) {
          const std::vector<float> q = testing::GaussianVector(rng, m.head_dim);
          std::copy(q.begin(), q.end(), buffers.Query(layer, b, h).begin());
        }
      }
    }
    ASSERT_EQ(::eps::testing::CopyToDeviceNow(queries, in.queries, query_count * sizeof(float)),
              cudaSuccess);
    const int batch = 2 + (step / 3) % 3;
    const std::span<const StepRow> rows(all_rows.data(), batch);
    SelectPolicy policy;
    policy.granularity = Granularity::kPerKvHead;
    policy.budget = budgets[(step / 3) % 4];
    StepInputs device_in = buffers.Inputs(rows);
    device_in.summary_pool = pool;
    device_in.group_table = groups;
    device_in.block_table = blocks;
    device_in.queries = queries;
    StepStats stats[2];
    for (int k = 0; k < 2; ++k) {
      const absl::Status status =
          selectors[k]->Select(device_in, policy, {visit[k], count[k]}, &stats[k], nullptr);
      ASSERT_TRUE(status.ok()) << status << " step " << step;
    }
    ASSERT_TRUE(reference->Select(buffers.Inputs(rows), policy, buffers.Outputs(), nullptr).ok());
    const auto got_count = Download(count[0], list_count);
    EXPECT_EQ(got_count, Download(count[1], list_count)) << "step " << step;
    const auto got_visit = Download(visit[0], list_count * buffers.max_blocks());
    EXPECT_EQ(got_visit, Download(visit[1], list_count * buffers.max_blocks())) << "step " << step;
    EXPECT_EQ(stats[0].groups_visited, stats[1].groups_visited) << "step " << step;
    int differing = 0;
    for (int layer = 0; layer < m.num_layers; ++layer) {
      for (int b = 0; b < batch; ++b) {
        for (int list = 0; list < m.num_kv_heads; ++list) {
          const int64_t index = (int64_t{layer} * max_batch + b) * m.num_kv_heads + list;
          const std::vector<int32_t> got(
              got_visit.begin() + index * buffers.max_blocks(),
              got_visit.begin() + index * buffers.max_blocks() + got_count[index]);
          const auto want = buffers.VisitBlocks(layer, b, list);
          if (std::vector<int32_t>(want.begin(), want.end()) == got) continue;
          const int64_t n = GroupsFor(rows[b].context_tokens, m);
          const auto a = testing::VisitedGroups(buffers, b, want, n);
          const auto g = testing::VisitedGroups(buffers, b, got, n);
          for (size_t p = 0; p < a.size(); ++p) differing += a[p] != g[p];
        }
      }
    }
    EXPECT_LE(differing, 2) << "step " << step << ": more disagreements with core/ than ties";
  }
  for (void* p :
       {static_cast<void*>(pool), static_cast<void*>(groups), static_cast<void*>(blocks),
        static_cast<void*>(queries), static_cast<void*>(visit[0]), static_cast<void*>(visit[1]),
        static_cast<void*>(count[0]), static_cast<void*>(count[1])}) {
    cudaFree(p);
  }
}

}  // namespace
}  // namespace eps
