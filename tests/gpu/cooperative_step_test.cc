// The cooperative step (gpu/cooperative_step.cuh) against the three kernels on
// the same inputs: the same scores, cuts and compaction, so lists, counts and
// statistics must be equal bit for bit, and both within fp32 ties of core/.
// Fresh random inputs each run (seed printed on failure). Skips without a
// CUDA device; runs on the lent H100 as part of gpu_step_test.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/phi.h"
#include "core/summary.h"
#include "core/testing/synthetic.h"
#include "gpu/step.h"
#include "gtest/gtest.h"
#include "tests/core/step_fixture.h"
#include "tests/core/test_util.h"
#include "tests/gpu/device_session.h"
#include "tests/gpu/device_step.h"

namespace eps {
namespace {

struct CooperativeCase {
  Method method;
  int d, q_heads, kv_heads, group_blocks;
  int sketch_dim = 8;
  Granularity granularity = Granularity::kUnion;
  bool retrieval = false;
  int batch = 4;
  int64_t most_groups = 700;  // rows of 1 .. most_groups groups (several scoring blocks)
  bool quest8 = false;        // records with the quest8 part: questclt reads it
};

void ExpectSameSteps(const testing::DeviceStep& got, const testing::DeviceStep& want) {
  EXPECT_EQ(got.visit_count, want.visit_count);
  EXPECT_EQ(got.visit_blocks, want.visit_blocks);
  EXPECT_EQ(got.stats.groups_visited, want.stats.groups_visited);
  EXPECT_EQ(got.stats.blocks_visited, want.stats.blocks_visited);
  EXPECT_EQ(got.stats.kv_bytes_read_est, want.stats.kv_bytes_read_est);
  EXPECT_EQ(got.stats.summary_bytes_read, want.stats.summary_bytes_read);
  EXPECT_EQ(got.stats.groups_total, want.stats.groups_total);
}

class CooperativeStepTest : public ::testing::TestWithParam<CooperativeCase> {};

TEST_P(CooperativeStepTest, ListsEqualTheThreeKernelsBitForBit) {
  SKIP_WITHOUT_DEVICE();
  const CooperativeCase c = GetParam();
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  ModelLayout m =
      testing::RandomModel(3, c.q_heads, c.kv_heads, c.d, c.group_blocks, c.sketch_dim, rng);
  m.features.quest8 = c.quest8;
  auto phi = PhiBank::Create(m.phi_seed, m.num_layers, m.num_kv_heads, m.head_dim, m.sketch_dim);
  auto reference = PageSelector::Create(m, *phi);
  SummaryWriter writer(m, *phi);
  const int64_t most = c.most_groups * m.group_tokens();
  testing::StepBuffers buffers(m, c.batch, most, c.batch, c.granularity);
  std::vector<StepRow> rows;
  for (int r = 0; r < c.batch; ++r) {
    // Row 0 is one token; row 1 the longest; the others random.
    const int64_t tokens = r == 0 ? 1 : r == 1 ? most : 1 + static_cast<int64_t>(rng() % most);
    testing::WriteSequence(buffers, writer, r, r, tokens, 1 + r % 3,
                           testing::GroupShapes::kMixedRank, rng);
    rows.push_back({.table_row = r, .context_tokens = tokens, .seq_id = 0});
  }
  SelectPolicy policy;
  policy.method = c.method;
  policy.top_pages = 8;
  policy.alpha = 1.25f;
  policy.granularity = c.granularity;
  if (c.retrieval) {
    policy.heads = HeadMode::kRetrieval;
    for (int i = 0; i < m.num_layers * m.num_q_heads; ++i) {
      policy.retrieval_heads.push_back(rng() % 2);
    }
  }
  auto cooperative =
      gpu::GpuSelector::Create(m, 0, c.batch, buffers.max_groups(), {.cooperative = true});
  auto kernels = gpu::GpuSelector::Create(m, 0, c.batch, buffers.max_groups());
  ASSERT_TRUE(cooperative.ok() && kernels.ok());
  const testing::DeviceStep got =
      testing::SelectOnDevice(**cooperative, buffers, c.batch, rows, policy);
  ASSERT_TRUE(got.status.ok()) << got.status;
  EXPECT_TRUE((*cooperative)->last_step_cooperative()) << "the case never runs cooperatively";
  const testing::DeviceStep want = testing::SelectOnDevice(**kernels, buffers, c.batch, rows, policy);
  ASSERT_TRUE(want.status.ok()) << want.status;
  EXPECT_FALSE((*kernels)->last_step_cooperative());
  ExpectSameSteps(got, want);

  // And core/'s lists, up to groups within fp32 rounding of a cut.
  ASSERT_TRUE(reference->Select(buffers.Inputs(rows), policy, buffers.Outputs(), nullptr).ok());
  const int lists = c.granularity == Granularity::kPerKvHead ? m.num_kv_heads : 1;
  int near_cut = 0, unforced_lists = 0;
  for (int layer = 0; layer < m.num_layers; ++layer) {
    for (int b = 0; b < c.batch; ++b) {
      const int64_t n = GroupsFor(rows[b].context_tokens, m);
      for (int list = 0; list < lists; ++list) {
        const auto core_list = buffers.VisitBlocks(layer, b, list);
        const std::vector<int32_t> list_blocks =
            got.List(c.batch, lists, buffers.max_blocks(), layer, b, list);
        unforced_lists += n > 3;
        if (std::vector<int32_t>(core_list.begin(), core_list.end()) == list_blocks) continue;
        const auto a = testing::VisitedGroups(buffers, b, core_list, n);
        const auto g = testing::VisitedGroups(buffers, b, list_blocks, n);
        int differing = 0;
        for (size_t p = 0; p < a.size(); ++p) differing += a[p] != g[p];
        near_cut += differing;
        EXPECT_LE(differing, 1) << "layer " << layer << " row " << b << " list " << list;
      }
    }
  }
  EXPECT_LE(near_cut, 4) << "more disagreements with core/ than fp32 ties explain";
  EXPECT_GT(unforced_lists, 0) << "no row with a group to cut";
  if (c.method == Method::kOff) {
    EXPECT_EQ(got.stats.groups_visited, got.stats.groups_total) << "off visits every group";
  }
}

std::string CooperativeCaseName(const ::testing::TestParamInfo<CooperativeCase>& p) {
  const CooperativeCase& c = p.param;
  std::string name = std::string(MethodName(c.method)) == "1pc" ? "onepc" : MethodName(c.method);
  name += "_h" + std::to_string(c.q_heads) + "_kv" + std::to_string(c.kv_heads) + "_d" +
          std::to_string(c.d) + "_g" + std::to_string(c.group_blocks) + "_m" +
          std::to_string(c.sketch_dim) + "_b" + std::to_string(c.batch) + "_n" +
          std::to_string(c.most_groups);
  if (c.granularity == Granularity::kPerKvHead) name += "_per_kv_head";
  if (c.retrieval) name += "_retrieval";
  if (c.quest8) name += "_quest8";
  return name;
}

void PrintTo(const CooperativeCase& c, std::ostream* os) {
  *os << CooperativeCaseName(::testing::TestParamInfo<CooperativeCase>(c, 0));
}

constexpr Granularity kUnion = Granularity::kUnion, kPerKvHead = Granularity::kPerKvHead;

// Every kind of instance: jl with m 4, 8, 16 and generic (m 12), 1pc, fro, off,
// quest and questclt with passes of 4 and 8 heads, questclt's octet path at d 64,
// 128 and 256 over the 16-bit and the quest8 part and its general path (d 96);
// union and per-KV-head lists, retrieval heads, rows from one token to several
// scoring blocks, more scoring blocks than resident ones (batch 24 x 600 groups)
// and fewer.
INSTANTIATE_TEST_SUITE_P(
    Cooperative, CooperativeStepTest,
    ::testing::Values(
        CooperativeCase{Method::kJl, 128, 32, 8, 8},
        CooperativeCase{Method::kJl, 128, 32, 8, 8, 8, kPerKvHead, true},
        CooperativeCase{Method::kJl, 64, 4, 4, 2, 4},
        CooperativeCase{Method::kJl, 128, 8, 2, 4, 16, kPerKvHead},
        CooperativeCase{Method::kJl, 128, 8, 2, 4, 12, kUnion, true},
        CooperativeCase{Method::kOnePc, 128, 8, 2, 4}, CooperativeCase{Method::kFro, 128, 8, 2, 8},
        CooperativeCase{Method::kOff, 128, 8, 2, 8, 8, kPerKvHead},
        CooperativeCase{Method::kQuest, 128, 8, 2, 2, 8, kUnion, true},
        CooperativeCase{Method::kQuest, 128, 16, 2, 2, 8, kPerKvHead},
        CooperativeCase{Method::kQuestClt, 128, 32, 8, 2},
        CooperativeCase{Method::kQuestClt, 128, 32, 8, 2, 8, kPerKvHead, true, 4, 700, true},
        CooperativeCase{Method::kQuestClt, 64, 9, 3, 1, 8, kUnion, false, 4, 700, true},
        CooperativeCase{Method::kQuestClt, 256, 4, 1, 1},
        CooperativeCase{Method::kQuestClt, 256, 16, 2, 4, 8, kPerKvHead, false, 4, 700, true},
        CooperativeCase{Method::kQuestClt, 96, 8, 2, 2, 8, kUnion, true},
        CooperativeCase{Method::kJl, 128, 8, 2, 1, 8, kUnion, false, 24, 600}),
    CooperativeCaseName);

ModelLayout SmallModel() {
  ModelLayout m;
  m.num_layers = 2;
  m.num_q_heads = 8;
  m.num_kv_heads = 2;
  m.head_dim = 64;
  m.features = {.key_sum = true, .principal = true, .quest = true};
  return m;
}

TEST(CooperativeStepPathTest, OnlyTheThresholdBudgetRunsCooperatively) {
  SKIP_WITHOUT_DEVICE();
  const ModelLayout m = SmallModel();
  testing::StepBuffers buffers(m, 2, 20000, 2, Granularity::kPerKvHead);
  buffers.AssignRow(0, 20000, 1);
  buffers.FillRandomSummaries(7);
  auto selector =
      gpu::GpuSelector::Create(m, 0, 2, buffers.max_groups(), {.cooperative = true});
  ASSERT_TRUE(selector.ok());
  const StepRow rows[] = {{.table_row = 0, .context_tokens = 20000, .seq_id = 0}};
  auto cooperative = [&](const SelectPolicy& policy) {
    const testing::DeviceStep got = testing::SelectOnDevice(**selector, buffers, 2, rows, policy);
    EXPECT_TRUE(got.status.ok()) << got.status << " " << policy.DebugString();
    return (*selector)->last_step_cooperative();
  };
  SelectPolicy threshold;
  EXPECT_TRUE(cooperative(threshold));
  for (auto edit : {+[](SelectPolicy& p) { p.granularity = Granularity::kPerKvHead; },
                    +[](SelectPolicy& p) { p.method = Method::kOff; },
                    +[](SelectPolicy& p) { p.method = Method::kJl; }}) {
    SelectPolicy other = threshold;
    edit(other);
    EXPECT_TRUE(cooperative(other)) << other.DebugString();
  }
  for (auto edit : {+[](SelectPolicy& p) { p.budget = Budget::kFixed; },
                    +[](SelectPolicy& p) { p.budget = Budget::kTopP; },
                    +[](SelectPolicy& p) { p.budget = Budget::kMass; },
                    +[](SelectPolicy& p) { p.strict = true; }}) {
    SelectPolicy other = threshold;
    edit(other);
    EXPECT_FALSE(cooperative(other)) << other.DebugString();
  }
}

// Many fenced steps, as a session runs: batches that grow and shrink, union and
// per-KV-head lists, fresh queries each step; each equals the three kernels'
// and writes selection_done.
TEST(CooperativeStepSessionTest, FencedStepsEqualTheThreeKernels) {
  SKIP_WITHOUT_DEVICE();
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  ModelLayout m;  // the benchmark's shape, 2 layers
  m.num_layers = 2;
  m.num_q_heads = 32;
  m.num_kv_heads = 8;
  m.head_dim = 128;
  m.phi_seed = rng();
  m.features = {.key_sum = false, .principal = false, .quest = true};
  const int max_batch = 4;
  const int64_t most = 600 * m.group_tokens();
  testing::StepBuffers buffers(m, max_batch, most, max_batch, Granularity::kPerKvHead);
  std::vector<StepRow> all_rows;
  for (int r = 0; r < max_batch; ++r) {
    const int64_t tokens = r == 0 ? most : 1 + static_cast<int64_t>(rng() % most);
    buffers.AssignRow(r, tokens, rng());
    all_rows.push_back({.table_row = r, .context_tokens = tokens, .seq_id = 0});
  }
  buffers.FillRandomSummaries(rng());
  testing::DeviceSession device;
  ASSERT_TRUE(device.Upload(buffers, max_batch).ok());
  testing::DeviceLists lists[2];
  ASSERT_TRUE(lists[0].Allocate(device).ok() && lists[1].Allocate(device).ok());
  gpu::DeviceBuffer<uint64_t> counters;  // inputs_ready, selection_done
  ASSERT_TRUE(counters.Allocate(2).ok());
  const uint64_t initial[2] = {std::numeric_limits<uint64_t>::max() / 2, 0};
  ASSERT_EQ(cudaMemcpy(counters.get(), initial, sizeof initial, cudaMemcpyHostToDevice),
            cudaSuccess);
  auto cooperative =
      gpu::GpuSelector::Create(m, 0, max_batch, buffers.max_groups(), {.cooperative = true});
  auto kernels = gpu::GpuSelector::Create(m, 0, max_batch, buffers.max_groups());
  ASSERT_TRUE(cooperative.ok() && kernels.ok());
  const int batches[] = {4, 4, 2, 2, 3, 3, 1, 1, 4, 4, 2, 2};
  for (int step = 0; step < 12; ++step) {
    std::vector<float> q(device.query_count);
    for (float& x : q) x = std::normal_distribution<float>(0.0f, 1.0f)(rng);
    ASSERT_EQ(cudaMemcpy(device.queries.get(), q.data(), q.size() * sizeof(float),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
    SelectPolicy policy;  // questclt, the default
    policy.granularity = (step / 2) % 2 == 0 ? Granularity::kUnion : Granularity::kPerKvHead;
    const std::span<const StepRow> rows(all_rows.data(), batches[step]);
    const StepInputs in = device.Inputs(buffers, rows);
    ASSERT_TRUE(lists[0].Fill(-1).ok() && lists[1].Fill(-1).ok());
    const gpu::GpuSelector::StepFence fence{counters.get(), counters.get() + 1,
                                            static_cast<uint64_t>(step + 1)};
    StepStats stats[2];
    absl::Status status = (*cooperative)->Enqueue(in, policy, lists[0].outputs(), fence);
    ASSERT_TRUE(status.ok()) << status << " step " << step;
    status = (*cooperative)->Finish(std::chrono::microseconds::max(), &stats[0], nullptr);
    ASSERT_TRUE(status.ok()) << status << " step " << step;
    EXPECT_TRUE((*cooperative)->last_step_cooperative()) << "step " << step;
    status = (*kernels)->Select(in, policy, lists[1].outputs(), &stats[1], nullptr);
    ASSERT_TRUE(status.ok()) << status << " step " << step;
    EXPECT_EQ(lists[0].Counts(), lists[1].Counts()) << "step " << step;
    EXPECT_EQ(lists[0].Blocks(), lists[1].Blocks()) << "step " << step;
    EXPECT_EQ(stats[0].groups_visited, stats[1].groups_visited) << "step " << step;
    EXPECT_EQ(stats[0].blocks_visited, stats[1].blocks_visited) << "step " << step;
    EXPECT_EQ(stats[0].kv_bytes_read_est, stats[1].kv_bytes_read_est) << "step " << step;
    uint64_t done = 0;
    ASSERT_EQ(cudaMemcpy(&done, counters.get() + 1, sizeof done, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(done, static_cast<uint64_t>(step + 1));
  }
}

// A bad slot in one row of three fails the step as the three kernels fail it:
// INVALID_ARGUMENT naming the entry; with a fence every count -1 (attend
// densely), without one nothing written; a step the engine already released
// (selection_done >= step) writes nothing either. The next good step equals
// the three kernels'.
TEST(CooperativeStepFailureTest, BadSlotAndReleasedStepsAsTheThreeKernels) {
  SKIP_WITHOUT_DEVICE();
  const ModelLayout m = SmallModel();
  const int max_batch = 3;
  testing::StepBuffers buffers(m, max_batch, 4096, max_batch, Granularity::kPerKvHead);
  std::vector<StepRow> rows;
  for (int r = 0; r < max_batch; ++r) {
    const int64_t tokens = 1024 * (r + 2);
    buffers.AssignRow(r, tokens, r + 1);
    rows.push_back({.table_row = r, .context_tokens = tokens, .seq_id = 0});
  }
  buffers.FillRandomSummaries(3);
  testing::DeviceSession device;
  ASSERT_TRUE(device.Upload(buffers, max_batch).ok());
  testing::DeviceLists lists[2];
  ASSERT_TRUE(lists[0].Allocate(device).ok() && lists[1].Allocate(device).ok());
  gpu::DeviceBuffer<uint64_t> counters;
  ASSERT_TRUE(counters.Allocate(2).ok());
  const uint64_t initial[2] = {std::numeric_limits<uint64_t>::max() / 2, 0};
  ASSERT_EQ(cudaMemcpy(counters.get(), initial, sizeof initial, cudaMemcpyHostToDevice),
            cudaSuccess);
  auto cooperative =
      gpu::GpuSelector::Create(m, 0, max_batch, buffers.max_groups(), {.cooperative = true});
  auto kernels = gpu::GpuSelector::Create(m, 0, max_batch, buffers.max_groups());
  ASSERT_TRUE(cooperative.ok() && kernels.ok());
  const StepInputs in = device.Inputs(buffers, rows);
  std::vector<int32_t> bad = device.host_groups;
  bad[1 * buffers.max_groups() + 5] = 1 << 30;
  uint64_t step = 0;
  for (const Granularity granularity : {Granularity::kUnion, Granularity::kPerKvHead}) {
    const int per_list = granularity == Granularity::kPerKvHead ? m.num_kv_heads : 1;
    const int64_t used = int64_t{m.num_layers} * max_batch * per_list;
    for (const bool with_fence : {false, true}) {
      SCOPED_TRACE(std::string(GranularityName(granularity)) + (with_fence ? " fence" : ""));
      SelectPolicy policy;
      policy.granularity = granularity;
      ASSERT_EQ(cudaMemcpy(device.groups.get(), bad.data(), bad.size() * sizeof(int32_t),
                           cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_TRUE(lists[0].Fill(7).ok());
      gpu::GpuSelector::StepFence fence;
      if (with_fence) fence = {counters.get(), counters.get() + 1, ++step};
      absl::Status status = (*cooperative)->Enqueue(in, policy, lists[0].outputs(), fence);
      ASSERT_TRUE(status.ok()) << status;
      status = (*cooperative)->Finish(std::chrono::microseconds::max(), nullptr, nullptr);
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_NE(status.message().find("group_table[1][5]=1073741824"), std::string::npos) << status;
      EXPECT_TRUE((*cooperative)->last_step_cooperative());
      const std::vector<int32_t> counts = lists[0].Counts();
      EXPECT_EQ(std::vector<int32_t>(counts.begin(), counts.begin() + used),
                std::vector<int32_t>(used, with_fence ? -1 : 7));

      // The slot repaired, but the step already released by the engine: nothing written.
      ASSERT_EQ(cudaMemcpy(device.groups.get(), device.host_groups.data(),
                           device.host_groups.size() * sizeof(int32_t), cudaMemcpyHostToDevice),
                cudaSuccess);
      if (with_fence) {
        ASSERT_TRUE(lists[0].Fill(7).ok());
        fence.step = ++step;
        ASSERT_EQ(cudaMemcpy(counters.get() + 1, &step, sizeof step, cudaMemcpyHostToDevice),
                  cudaSuccess);
        ASSERT_TRUE((*cooperative)->Enqueue(in, policy, lists[0].outputs(), fence).ok());
        ASSERT_TRUE(
            (*cooperative)->Finish(std::chrono::microseconds::max(), nullptr, nullptr).ok());
        EXPECT_EQ(lists[0].Counts(), std::vector<int32_t>(lists[0].lists, 7));
        EXPECT_EQ(lists[0].Blocks(), std::vector<int32_t>(lists[0].blocks, 7));
      }

      // The next step: the three kernels' lists.
      ASSERT_TRUE(lists[0].Fill(-1).ok() && lists[1].Fill(-1).ok());
      if (with_fence) fence.step = ++step;
      status = (*cooperative)->Enqueue(in, policy, lists[0].outputs(), fence);
      ASSERT_TRUE(status.ok()) << status;
      ASSERT_TRUE((*cooperative)->Finish(std::chrono::microseconds::max(), nullptr, nullptr).ok());
      ASSERT_TRUE((*kernels)->Select(in, policy, lists[1].outputs(), nullptr, nullptr).ok());
      EXPECT_EQ(lists[0].Counts(), lists[1].Counts());
      EXPECT_EQ(lists[0].Blocks(), lists[1].Blocks());
    }
  }
}

}  // namespace
}  // namespace eps
