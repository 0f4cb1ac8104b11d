// The fused selection (gpu/fused_select.cuh) against the separate selection
// kernel on the same inputs: the same scores and cuts, so lists, counts and
// statistics must be equal bit for bit, and both within fp32 ties of core/.
// Fresh random inputs each run (seed printed on failure). Skips without a
// CUDA device; runs on the lent H100 as part of gpu_step_test.
#include <cuda_runtime.h>

#include <algorithm>
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
#include "core/status.h"
#include "core/summary.h"
#include "core/testing/synthetic.h"
#include "gpu/stage_clocks.h"
#include "gpu/step.h"
#include "gtest/gtest.h"
#include "tests/core/step_fixture.h"
#include "tests/core/test_util.h"
#include "tests/gpu/device_step.h"
#include "tests/gpu/host_copy.h"

namespace eps {
namespace {

using Fusion = gpu::GpuSelectorOptions::Fusion;

constexpr int kBlockGroups = 256;  // groups of one scoring block: the fused path's limit

// The rows' contexts of a case.
enum class Contexts {
  kRandom,      // 1 .. 256 groups
  kForcedOnly,  // at most first_n + last_n = 3 groups: every group forced
  kMixed,       // 1 token, exactly 256 groups, 4 groups (one unforced), random
};

struct FusedCase {
  Method method;
  int d, q_heads, kv_heads, group_blocks;
  int sketch_dim = 8;
  Granularity granularity = Granularity::kUnion;
  bool retrieval = false;
  Contexts contexts = Contexts::kRandom;
  // Above kHeldRank (32) the cut ranks by histograms, which jl's staged path keeps
  // where its records were staged (fused_select.cuh).
  int top_pages = 8;
};

std::vector<int64_t> ContextsOf(Contexts c, const ModelLayout& m, int batch, std::mt19937_64& rng) {
  const int64_t group = m.group_tokens(), most = kBlockGroups * group;
  std::vector<int64_t> tokens;
  for (int r = 0; r < batch; ++r) {
    switch (c) {
      case Contexts::kRandom:
        tokens.push_back(1 + static_cast<int64_t>(rng() % most));
        break;
      case Contexts::kForcedOnly:
        tokens.push_back(1 + static_cast<int64_t>(rng() % (3 * group)));
        break;
      case Contexts::kMixed: {
        const int64_t fixed[] = {1, most, 3 * group + 1};
        tokens.push_back(r < 3 ? fixed[r] : 1 + static_cast<int64_t>(rng() % most));
        break;
      }
    }
  }
  return tokens;
}

// Counts, lists and statistics of two runs on the same inputs, exactly.
void ExpectSameSteps(const testing::DeviceStep& fused, const testing::DeviceStep& separate) {
  EXPECT_EQ(fused.visit_count, separate.visit_count);
  EXPECT_EQ(fused.visit_blocks, separate.visit_blocks);
  EXPECT_EQ(fused.stats.groups_visited, separate.stats.groups_visited);
  EXPECT_EQ(fused.stats.blocks_visited, separate.stats.blocks_visited);
  EXPECT_EQ(fused.stats.kv_bytes_read_est, separate.stats.kv_bytes_read_est);
  EXPECT_EQ(fused.stats.summary_bytes_read, separate.stats.summary_bytes_read);
  EXPECT_EQ(fused.stats.groups_total, separate.stats.groups_total);
}

class FusedSelectTest : public ::testing::TestWithParam<FusedCase> {};

TEST_P(FusedSelectTest, ListsEqualTheSelectionKernelsBitForBit) {
  SKIP_WITHOUT_DEVICE();
  const FusedCase c = GetParam();
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const ModelLayout m =
      testing::RandomModel(2, c.q_heads, c.kv_heads, c.d, c.group_blocks, c.sketch_dim, rng);
  auto phi = PhiBank::Create(m.phi_seed, m.num_layers, m.num_kv_heads, m.head_dim, m.sketch_dim);
  auto reference = PageSelector::Create(m, *phi);
  SummaryWriter writer(m, *phi);
  const int batch = 4;
  const std::vector<int64_t> contexts = ContextsOf(c.contexts, m, batch, rng);
  testing::StepBuffers buffers(m, batch, kBlockGroups * m.group_tokens(), batch, c.granularity);
  std::vector<StepRow> rows;
  for (int r = 0; r < batch; ++r) {
    testing::WriteSequence(buffers, writer, r, r, contexts[r], 1 + r % 3,
                           testing::GroupShapes::kMixedRank, rng);
    rows.push_back({.table_row = r, .context_tokens = contexts[r], .seq_id = 0});
  }
  SelectPolicy policy;
  policy.method = c.method;
  policy.top_pages = c.top_pages;
  policy.alpha = 1.25f;
  policy.granularity = c.granularity;
  if (c.retrieval) {
    policy.heads = HeadMode::kRetrieval;
    for (int i = 0; i < m.num_layers * m.num_q_heads; ++i) {
      policy.retrieval_heads.push_back(rng() % 2);
    }
  }
  auto fused =
      gpu::GpuSelector::Create(m, 0, batch, buffers.max_groups(), {.fusion = Fusion::kAlways});
  auto separate =
      gpu::GpuSelector::Create(m, 0, batch, buffers.max_groups(), {.fusion = Fusion::kNever});
  ASSERT_TRUE(fused.ok() && separate.ok());
  const testing::DeviceStep got = testing::SelectOnDevice(**fused, buffers, batch, rows, policy);
  ASSERT_TRUE(got.status.ok()) << got.status;
  EXPECT_TRUE((*fused)->last_step_fused()) << "the case never reaches the fused path";
  const testing::DeviceStep want =
      testing::SelectOnDevice(**separate, buffers, batch, rows, policy);
  ASSERT_TRUE(want.status.ok()) << want.status;
  EXPECT_FALSE((*separate)->last_step_fused());
  ExpectSameSteps(got, want);
  if (c.method == Method::kJl && c.sketch_dim <= 8) {
    // The terms from the terms kernel (runs of three (row, head) pairs across rows,
    // and a shorter last one) instead of the blocks' own: a head's terms are the
    // same bit for bit (terms_held.cuh: the same sums in the same order), so are
    // the lists, whatever the batch. (From m = 16 the blocks build them by
    // HeadTerms, whose sums run in another order: BlockHoldsPhi.)
    auto kernel_terms =
        gpu::GpuSelector::Create(m, 0, batch, buffers.max_groups(),
                                 {.fusion = Fusion::kAlways, .terms_kernel = true, .terms_run = 3});
    ASSERT_TRUE(kernel_terms.ok()) << kernel_terms.status();
    const testing::DeviceStep from_kernel =
        testing::SelectOnDevice(**kernel_terms, buffers, batch, rows, policy);
    ASSERT_TRUE(from_kernel.status.ok()) << from_kernel.status;
    SCOPED_TRACE("terms from the terms kernel");
    ExpectSameSteps(from_kernel, got);
  }

  // And core/'s lists, up to groups within fp32 rounding of a cut.
  ASSERT_TRUE(reference->Select(buffers.Inputs(rows), policy, buffers.Outputs(), nullptr).ok());
  const int lists = c.granularity == Granularity::kPerKvHead ? m.num_kv_heads : 1;
  int near_cut = 0, unforced_lists = 0;
  for (int layer = 0; layer < m.num_layers; ++layer) {
    for (int b = 0; b < batch; ++b) {
      const int64_t n = GroupsFor(rows[b].context_tokens, m);
      for (int list = 0; list < lists; ++list) {
        const auto core_list = buffers.VisitBlocks(layer, b, list);
        const std::vector<int32_t> list_blocks =
            got.List(batch, lists, buffers.max_blocks(), layer, b, list);
        unforced_lists += n > 3;
        if (std::vector<int32_t>(core_list.begin(), core_list.end()) == list_blocks) continue;
        const auto a = testing::VisitedGroups(buffers, b, core_list, n);
        const auto g = testing::VisitedGroups(buffers, b, list_blocks, n);
        const testing::GroupDifference d = testing::DifferingGroups(a, g);
        near_cut += d.total();
        EXPECT_TRUE(d.NearCut()) << "layer " << layer << " row " << b << " list " << list;
      }
    }
  }
  EXPECT_LE(near_cut, 4) << "more disagreements with core/ than fp32 ties explain";
  if (c.contexts == Contexts::kForcedOnly) {
    EXPECT_EQ(got.stats.groups_visited, got.stats.groups_total) << "every group is forced";
  } else {
    EXPECT_GT(unforced_lists, 0) << "no row with a group to cut";
  }
}

std::string FusedCaseName(const ::testing::TestParamInfo<FusedCase>& p) {
  const FusedCase& c = p.param;
  std::string name = std::string(MethodName(c.method)) == "1pc" ? "onepc" : MethodName(c.method);
  name += "_h" + std::to_string(c.q_heads) + "_kv" + std::to_string(c.kv_heads) + "_d" +
          std::to_string(c.d) + "_g" + std::to_string(c.group_blocks) + "_m" +
          std::to_string(c.sketch_dim);
  if (c.granularity == Granularity::kPerKvHead) name += "_per_kv_head";
  if (c.retrieval) name += "_retrieval";
  if (c.contexts == Contexts::kForcedOnly) name += "_forced_only";
  if (c.contexts == Contexts::kMixed) name += "_mixed";
  if (c.top_pages != 8) name += "_top" + std::to_string(c.top_pages);
  return name;
}

void PrintTo(const FusedCase& c, std::ostream* os) {
  *os << FusedCaseName(::testing::TestParamInfo<FusedCase>(c, 0));
}

constexpr Granularity kUnion = Granularity::kUnion, kPerKvHead = Granularity::kPerKvHead;

// Every fused kernel (jl with m 4, 8, 16 and generic; 1pc; fro; questclt; quest with 4
// and 8 heads per pass), union and per-KV-head lists, retrieval heads, more
// query heads per KV head than warps (16), rows of one token, rows of exactly
// 256 groups, and rows whose groups are all forced.
INSTANTIATE_TEST_SUITE_P(
    Fused, FusedSelectTest,
    ::testing::Values(
        FusedCase{Method::kJl, 128, 32, 8, 8}, FusedCase{Method::kJl, 128, 32, 8, 8, 8, kPerKvHead},
        FusedCase{Method::kJl, 128, 32, 8, 8, 8, kUnion, true, Contexts::kMixed},
        FusedCase{Method::kJl, 128, 32, 8, 8, 8, kPerKvHead, true, Contexts::kMixed},
        FusedCase{Method::kJl, 128, 32, 8, 8, 8, kUnion, false, Contexts::kForcedOnly},
        FusedCase{Method::kJl, 128, 32, 8, 8, 8, kPerKvHead, false, Contexts::kForcedOnly},
        FusedCase{Method::kJl, 64, 4, 4, 2, 4},
        FusedCase{Method::kJl, 128, 8, 2, 4, 16, kPerKvHead},
        FusedCase{Method::kJl, 128, 8, 2, 4, 12, kUnion, true},
        FusedCase{Method::kOnePc, 128, 8, 2, 4}, FusedCase{Method::kFro, 128, 8, 2, 8},
        FusedCase{Method::kQuest, 128, 8, 2, 2, 8, kUnion, true, Contexts::kMixed},
        FusedCase{Method::kQuest, 128, 16, 2, 2, 8, kPerKvHead},
        FusedCase{Method::kQuestClt, 128, 8, 2, 2, 8, kUnion, true, Contexts::kMixed},
        FusedCase{Method::kQuestClt, 256, 16, 4, 4, 8, kPerKvHead},
        FusedCase{Method::kJl, 64, 32, 2, 4, 8, kUnion, true, Contexts::kMixed},
        FusedCase{Method::kJl, 128, 32, 8, 8, 8, kUnion, false, Contexts::kMixed, 40},
        FusedCase{Method::kJl, 128, 32, 8, 8, 4, kPerKvHead, false, Contexts::kMixed, 40},
        FusedCase{Method::kQuest, 128, 8, 2, 2, 8, kUnion, false, Contexts::kMixed, 40}),
    FusedCaseName);

ModelLayout SmallModel() {
  ModelLayout m;
  m.num_layers = 2;
  m.num_q_heads = 8;
  m.num_kv_heads = 2;
  m.head_dim = 64;
  m.features = {.key_sum = true, .principal = true, .quest = true};
  return m;
}

TEST(FusedSelectPathTest, OnlyTheThresholdBudgetWithRowsOfOneBlockFuses) {
  SKIP_WITHOUT_DEVICE();
  const ModelLayout m = SmallModel();
  const int64_t most = kBlockGroups * m.group_tokens();
  testing::StepBuffers buffers(m, 2, most + m.group_tokens(), 2, Granularity::kPerKvHead);
  buffers.AssignRow(0, most, 1);
  buffers.AssignRow(1, most + 1, 2);
  buffers.FillRandomSummaries(7);
  auto selector =
      gpu::GpuSelector::Create(m, 0, 2, buffers.max_groups(), {.fusion = Fusion::kAlways});
  ASSERT_TRUE(selector.ok());
  const StepRow fits[] = {{.table_row = 0, .context_tokens = most, .seq_id = 0}};
  const StepRow both[] = {{.table_row = 0, .context_tokens = most, .seq_id = 0},
                          {.table_row = 1, .context_tokens = most + 1, .seq_id = 0}};
  auto fuses = [&](std::span<const StepRow> rows, const SelectPolicy& policy) {
    const testing::DeviceStep got = testing::SelectOnDevice(**selector, buffers, 2, rows, policy);
    EXPECT_TRUE(got.status.ok()) << got.status << " " << policy.DebugString();
    return (*selector)->last_step_fused();
  };
  SelectPolicy threshold;
  threshold.method = Method::kJl;
  EXPECT_TRUE(fuses(fits, threshold));
  EXPECT_FALSE(fuses(both, threshold)) << "a row of 257 groups needs two scoring blocks";
  SelectPolicy per_head = threshold;
  per_head.granularity = Granularity::kPerKvHead;
  EXPECT_TRUE(fuses(fits, per_head));
  for (auto edit : {+[](SelectPolicy& p) { p.budget = Budget::kFixed; },
                    +[](SelectPolicy& p) { p.budget = Budget::kTopP; },
                    +[](SelectPolicy& p) { p.budget = Budget::kMass; },
                    +[](SelectPolicy& p) { p.strict = true; },
                    +[](SelectPolicy& p) { p.method = Method::kOff; }}) {
    SelectPolicy other = threshold;
    edit(other);
    EXPECT_FALSE(fuses(fits, other)) << other.DebugString();
  }
}

// Fusion::kAuto (gpu/step.h): jl's staged path fuses at every batch, from one
// row to more scoring blocks than the GPU holds at once (up to 4 fused blocks an
// SM), with the same lists as the two kernels; quest and jl without a staged
// path (m = 12) keep the two kernels.
TEST(FusedSelectPathTest, AutoFusesJlsStagedPathAtEveryBatch) {
  SKIP_WITHOUT_DEVICE();
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  for (const int sketch : {8, 12}) {
    ModelLayout m = testing::RandomModel(32, 32, 8, 64, 1, sketch, rng);
    m.features = {.key_sum = true, .principal = true, .quest = true};
    const int64_t per_row = int64_t{m.num_layers} * m.num_kv_heads;  // scoring blocks
    const int many = static_cast<int>((int64_t{2} * 4 * sms + per_row - 1) / per_row);  // 2 waves
    auto phi = PhiBank::Create(m.phi_seed, m.num_layers, m.num_kv_heads, m.head_dim, m.sketch_dim);
    SummaryWriter writer(m, *phi);
    testing::StepBuffers buffers(m, many, 40 * m.group_tokens(), many, Granularity::kUnion);
    std::vector<StepRow> rows;
    for (int r = 0; r < many; ++r) {
      const int64_t tokens = 1 + static_cast<int64_t>(rng() % (40 * m.group_tokens()));
      testing::WriteSequence(buffers, writer, r, r, tokens, 1 + r % 3,
                             testing::GroupShapes::kMixedRank, rng);
      rows.push_back({.table_row = r, .context_tokens = tokens, .seq_id = 0});
    }
    auto automatic = gpu::GpuSelector::Create(m, 0, many, buffers.max_groups());
    auto separate =
        gpu::GpuSelector::Create(m, 0, many, buffers.max_groups(), {.fusion = Fusion::kNever});
    ASSERT_TRUE(automatic.ok() && separate.ok());
    for (const Method method : {Method::kJl, Method::kQuest}) {
      SelectPolicy policy;
      policy.method = method;
      policy.top_pages = 4;
      const bool fuses = method == Method::kJl && sketch == 8;
      for (const int batch : {1, many}) {
        SCOPED_TRACE(::testing::Message() << MethodName(method) << " m " << sketch << " batch "
                                          << batch << " of " << sms << " SMs");
        const std::span<const StepRow> step(rows.data(), batch);
        const testing::DeviceStep got =
            testing::SelectOnDevice(**automatic, buffers, many, step, policy);
        ASSERT_TRUE(got.status.ok()) << got.status;
        EXPECT_EQ((*automatic)->last_step_fused(), fuses);
        const testing::DeviceStep want =
            testing::SelectOnDevice(**separate, buffers, many, step, policy);
        ASSERT_TRUE(want.status.ok()) << want.status;
        ExpectSameSteps(got, want);
      }
    }
  }
}

// A StepBuffers' inputs on the device, and room for per-KV-head lists, for
// tests that run many steps over the same buffers.
struct DeviceSession {
  gpu::DeviceBuffer<float> pool, queries;
  gpu::DeviceBuffer<int32_t> groups, blocks;
  std::vector<int32_t> host_groups;
  int64_t query_count = 0, list_count = 0, max_blocks = 0;

  absl::Status Upload(testing::StepBuffers& b, int64_t max_batch) {
    const ModelLayout& m = b.model();
    query_count = int64_t{m.num_layers} * max_batch * m.num_q_heads * m.head_dim;
    list_count = int64_t{m.num_layers} * max_batch * m.num_kv_heads;
    max_blocks = b.max_blocks();
    host_groups = b.group_table();
    RETURN_IF_ERROR(testing::CopyToDevice(pool, b.pool().data(), std::ssize(b.pool())));
    RETURN_IF_ERROR(testing::CopyToDevice(groups, host_groups.data(), std::ssize(host_groups)));
    RETURN_IF_ERROR(
        testing::CopyToDevice(blocks, b.block_table().data(), std::ssize(b.block_table())));
    const StepRow none[1] = {};
    return testing::CopyToDevice(queries, static_cast<const float*>(b.Inputs(none).queries),
                                 query_count);
  }
  StepInputs Inputs(testing::StepBuffers& b, std::span<const StepRow> rows) const {
    StepInputs in = b.Inputs(rows);
    in.summary_pool = pool.get();
    in.group_table = groups.get();
    in.block_table = blocks.get();
    in.queries = queries.get();
    return in;
  }
};

// Lists on the device: [layers, max_batch, lists, max_blocks] and counts.
struct DeviceLists {
  gpu::DeviceBuffer<int32_t> visit, count;
  int64_t lists = 0, blocks = 0;

  absl::Status Allocate(const DeviceSession& d) {
    lists = d.list_count;
    blocks = d.list_count * d.max_blocks;
    RETURN_IF_CUDA_ALLOC(visit, blocks);
    RETURN_IF_CUDA_ALLOC(count, lists);
    return Fill(-1);
  }
  absl::Status Fill(int32_t value) {
    const std::vector<int32_t> host(blocks, value);
    CUDA_RETURN_IF_ERROR(
        ::eps::testing::CopyToDeviceNow(visit.get(), host.data(), blocks * sizeof(int32_t)));
    CUDA_RETURN_IF_ERROR(
        ::eps::testing::CopyToDeviceNow(count.get(), host.data(), lists * sizeof(int32_t)));
    return absl::OkStatus();
  }
  StepOutputs outputs() const { return {visit.get(), count.get()}; }
  std::vector<int32_t> Counts() const { return Download(count.get(), lists); }
  std::vector<int32_t> Blocks() const { return Download(visit.get(), blocks); }
  static std::vector<int32_t> Download(const int32_t* device, int64_t n) {
    std::vector<int32_t> host(n);
    EXPECT_EQ(cudaMemcpy(host.data(), device, n * sizeof(int32_t), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }
};

// Many steps through captured graphs, as a session runs: steps in pairs of
// equal shapes and policy, so the second of each pair replays the first's graph
// with a new step number (the fused node carries it: a stale one would make
// the kernel see its step as released and write nothing), batches that grow
// and shrink (the per-(row, layer) counters and masks must be reset for any
// set of rows), union and per-KV-head lists, with a step fence.
TEST(FusedSelectGraphTest, ReplayedFencedStepsEqualTheSelectionKernels) {
  SKIP_WITHOUT_DEVICE();
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  ModelLayout m;  // the benchmark's shape, 2 layers: the m = 8 staged fused kernel
  m.num_layers = 2;
  m.num_q_heads = 32;
  m.num_kv_heads = 8;
  m.head_dim = 128;
  m.phi_seed = rng();
  m.features = {.key_sum = false, .principal = false, .quest = false};
  const int max_batch = 4;
  const int64_t most = kBlockGroups * m.group_tokens();
  testing::StepBuffers buffers(m, max_batch, most, max_batch, Granularity::kPerKvHead);
  std::vector<StepRow> all_rows;
  for (int r = 0; r < max_batch; ++r) {
    const int64_t tokens = r == 0 ? most : 1 + static_cast<int64_t>(rng() % most);
    buffers.AssignRow(r, tokens, rng());
    all_rows.push_back({.table_row = r, .context_tokens = tokens, .seq_id = 0});
  }
  buffers.FillRandomSummaries(rng());
  DeviceSession device;
  ASSERT_TRUE(device.Upload(buffers, max_batch).ok());
  DeviceLists lists[2];
  ASSERT_TRUE(lists[0].Allocate(device).ok() && lists[1].Allocate(device).ok());
  gpu::DeviceBuffer<uint64_t> counters;  // inputs_ready, selection_done
  ASSERT_TRUE(counters.Allocate(2).ok());
  const uint64_t initial[2] = {std::numeric_limits<uint64_t>::max() / 2, 0};
  ASSERT_EQ(::eps::testing::CopyToDeviceNow(counters.get(), initial, sizeof initial), cudaSuccess);
  auto fused =
      gpu::GpuSelector::Create(m, 0, max_batch, buffers.max_groups(), {.fusion = Fusion::kAlways});
  auto separate = gpu::GpuSelector::Create(m, 0, max_batch, buffers.max_groups(),
                                           {.graphs = false, .fusion = Fusion::kNever});
  ASSERT_TRUE(fused.ok() && separate.ok());
  const int batches[] = {4, 4, 2, 2, 3, 3, 1, 1, 4, 4, 2, 2};
  for (int step = 0; step < 12; ++step) {
    std::vector<float> q(device.query_count);
    for (float& x : q) x = std::normal_distribution<float>(0.0f, 1.0f)(rng);
    ASSERT_EQ(
        ::eps::testing::CopyToDeviceNow(device.queries.get(), q.data(), q.size() * sizeof(float)),
        cudaSuccess);
    SelectPolicy policy;
    policy.method = Method::kJl;
    policy.granularity = (step / 2) % 2 == 0 ? Granularity::kUnion : Granularity::kPerKvHead;
    const std::span<const StepRow> rows(all_rows.data(), batches[step]);
    const StepInputs in = device.Inputs(buffers, rows);
    ASSERT_TRUE(lists[0].Fill(-1).ok() && lists[1].Fill(-1).ok());
    const gpu::GpuSelector::StepFence fence{counters.get(), counters.get() + 1,
                                            static_cast<uint64_t>(step + 1)};
    StepStats stats[2];
    absl::Status status = (*fused)->Enqueue(in, policy, lists[0].outputs(), fence);
    ASSERT_TRUE(status.ok()) << status << " step " << step;
    status = (*fused)->Finish(std::chrono::microseconds::max(), &stats[0], nullptr);
    ASSERT_TRUE(status.ok()) << status << " step " << step;
    EXPECT_TRUE((*fused)->last_step_fused()) << "step " << step;
    status = (*separate)->Select(in, policy, lists[1].outputs(), &stats[1], nullptr);
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

// A bad slot in one row of three: a fused step may have written other rows'
// lists before the block that reads it fails, so the step ends with every
// count -1, with a fence or without, and the selector's scratch is left clean:
// the next good step equals the selection kernels'.
TEST(FusedSelectFailureTest, BadSlotInOneRowSetsEveryCountDenseAndTheNextStepRecovers) {
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
  DeviceSession device;
  ASSERT_TRUE(device.Upload(buffers, max_batch).ok());
  DeviceLists lists[2];
  ASSERT_TRUE(lists[0].Allocate(device).ok() && lists[1].Allocate(device).ok());
  gpu::DeviceBuffer<uint64_t> counters;
  ASSERT_TRUE(counters.Allocate(2).ok());
  const uint64_t initial[2] = {std::numeric_limits<uint64_t>::max() / 2, 0};
  ASSERT_EQ(::eps::testing::CopyToDeviceNow(counters.get(), initial, sizeof initial), cudaSuccess);
  auto fused =
      gpu::GpuSelector::Create(m, 0, max_batch, buffers.max_groups(), {.fusion = Fusion::kAlways});
  auto separate =
      gpu::GpuSelector::Create(m, 0, max_batch, buffers.max_groups(), {.fusion = Fusion::kNever});
  ASSERT_TRUE(fused.ok() && separate.ok());
  const StepInputs in = device.Inputs(buffers, rows);
  std::vector<int32_t> bad = device.host_groups;
  bad[1 * buffers.max_groups() + 5] = 1 << 30;
  uint64_t step = 0;
  for (const Granularity granularity : {Granularity::kUnion, Granularity::kPerKvHead}) {
    const int per_list = granularity == Granularity::kPerKvHead ? m.num_kv_heads : 1;
    const int64_t used = int64_t{m.num_layers} * max_batch * per_list;
    for (const bool with_fence : {false, true}) {
      SCOPED_TRACE(std::string(GranularityName(granularity)) + (with_fence ? " fence" : ""));
      SelectPolicy policy;  // questclt, the default method: its warp-read sums
      policy.granularity = granularity;
      ASSERT_EQ(::eps::testing::CopyToDeviceNow(device.groups.get(), bad.data(),
                                                bad.size() * sizeof(int32_t)),
                cudaSuccess);
      ASSERT_TRUE(lists[0].Fill(7).ok());
      gpu::GpuSelector::StepFence fence;
      if (with_fence) fence = {counters.get(), counters.get() + 1, ++step};
      absl::Status status = (*fused)->Enqueue(in, policy, lists[0].outputs(), fence);
      ASSERT_TRUE(status.ok()) << status;
      status = (*fused)->Finish(std::chrono::microseconds::max(), nullptr, nullptr);
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_NE(status.message().find("group_table[1][5]=1073741824"), std::string::npos) << status;
      EXPECT_TRUE((*fused)->last_step_fused());
      const std::vector<int32_t> counts = lists[0].Counts();
      EXPECT_EQ(std::vector<int32_t>(counts.begin(), counts.begin() + used),
                std::vector<int32_t>(used, -1));

      // The same selector, the slot repaired: the selection kernels' lists.
      ASSERT_EQ(::eps::testing::CopyToDeviceNow(device.groups.get(), device.host_groups.data(),
                                                device.host_groups.size() * sizeof(int32_t)),
                cudaSuccess);
      ASSERT_TRUE(lists[0].Fill(-1).ok() && lists[1].Fill(-1).ok());
      if (with_fence) fence.step = ++step;
      status = (*fused)->Enqueue(in, policy, lists[0].outputs(), fence);
      ASSERT_TRUE(status.ok()) << status;
      ASSERT_TRUE((*fused)->Finish(std::chrono::microseconds::max(), nullptr, nullptr).ok());
      ASSERT_TRUE((*separate)->Select(in, policy, lists[1].outputs(), nullptr, nullptr).ok());
      EXPECT_EQ(lists[0].Counts(), lists[1].Counts());
      EXPECT_EQ(lists[0].Blocks(), lists[1].Blocks());
    }
  }
}

// epsd's host released the step's inputs wait (the engine never wrote
// inputs_ready): the fused step too writes every list -1, attend densely.
TEST(FusedSelectFailureTest, AReleasedStepWritesDenseLists) {
  SKIP_WITHOUT_DEVICE();
  const ModelLayout m = SmallModel();
  testing::StepBuffers buffers(m, 2, 4096, 2, Granularity::kPerKvHead);
  std::vector<StepRow> rows;
  for (int r = 0; r < 2; ++r) {
    buffers.AssignRow(r, 2048 * (r + 1), r + 1);
    rows.push_back({.table_row = r, .context_tokens = 2048 * (r + 1), .seq_id = 0});
  }
  buffers.FillRandomSummaries(4);
  auto fused = gpu::GpuSelector::Create(m, 0, 2, buffers.max_groups(), {.fusion = Fusion::kAlways});
  ASSERT_TRUE(fused.ok());
  for (const Granularity granularity : {Granularity::kUnion, Granularity::kPerKvHead}) {
    SelectPolicy policy;
    policy.granularity = granularity;
    const testing::DeviceStep got = testing::SelectOnDevice(
        **fused, buffers, 2, rows, policy, nullptr, 7, nullptr, std::chrono::milliseconds(50));
    EXPECT_EQ(got.status.code(), absl::StatusCode::kDeadlineExceeded) << got.status;
    EXPECT_TRUE((*fused)->last_step_fused());
    EXPECT_EQ(got.visit_count, std::vector<int32_t>(got.visit_count.size(), -1))
        << GranularityName(granularity);
  }
}

// The default build has no stage clocks (gpu/stage_clocks.cuh): asking for them
// says how to build them in, and needs no device.
#ifndef EPS_STAGE_CLOCKS
TEST(StageClocksTest, TheDefaultBuildSaysHowToTurnThemOn) {
  const absl::StatusOr<std::string> clocks = gpu::FusedStageClocks(1);
  ASSERT_FALSE(clocks.ok());
  EXPECT_EQ(clocks.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(clocks.status().message().find("EPS_STAGE_CLOCKS=ON"), std::string::npos)
      << clocks.status();
}
#endif

}  // namespace
}  // namespace eps
