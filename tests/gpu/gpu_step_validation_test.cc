// The GPU pre-pass's refusals and its own bounds: a bad slot or a non-finite
// query fails the step by name on every way of scoring and writes no list; a
// row that fills the table stays inside the selection's shared memory (run
// under memcheck by scripts/gpu_check.sh). Skips without a CUDA device.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "core/layout.h"
#include "core/phi.h"
#include "core/step.h"
#include "core/testing/synthetic.h"
#include "gpu/step.h"
#include "gtest/gtest.h"
#include "tests/core/step_fixture.h"
#include "tests/gpu/device_step.h"

namespace eps {
namespace {

// A failed step reports the first bad input by name and leaves every count at -1
// (SelectOnDevice starts them there): `buffers` holds the bad input, `want` the message.
void ExpectEveryPathRefuses(testing::StepBuffers& buffers, std::span<const StepRow> rows,
                            std::initializer_list<std::pair<Method, bool>> paths,
                            const std::string& want) {
  const ModelLayout& m = buffers.model();
  auto selector = gpu::GpuSelector::Create(m, 0, 1, buffers.max_groups());
  ASSERT_TRUE(selector.ok()) << selector.status();
  for (const auto& [method, strict] : paths) {
    SelectPolicy policy;
    policy.method = method;
    policy.strict = strict;
    const testing::DeviceStep r = testing::SelectOnDevice(**selector, buffers, 1, rows, policy);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
    EXPECT_NE(r.status.message().find(want), std::string::npos) << r.status;
    EXPECT_EQ(r.visit_count, (std::vector<int32_t>(m.num_layers, -1)));
  }
}

// core/'s answer to one step of `policy` over `buffers` (its lists land in buffers.Outputs()).
absl::Status SelectInCore(testing::StepBuffers& buffers, std::span<const StepRow> rows,
                          const SelectPolicy& policy) {
  const ModelLayout& m = buffers.model();
  auto phi = PhiBank::Create(m.phi_seed, m.num_layers, m.num_kv_heads, m.head_dim, m.sketch_dim);
  auto reference = PageSelector::Create(m, *phi);
  return reference->Select(buffers.Inputs(rows), policy, buffers.Outputs(), nullptr);
}

// One layer's visited groups of row 0's union list, as core/ and as the device chose them.
struct LayerGroups {
  std::vector<uint8_t> core, device;
};

// One step of `policy` on the device and in core/ (both must succeed): each layer's groups.
std::vector<LayerGroups> VisitedOnBoth(testing::StepBuffers& buffers, std::span<const StepRow> rows,
                                       const SelectPolicy& policy) {
  const ModelLayout& m = buffers.model();
  auto selector = gpu::GpuSelector::Create(m, 0, 1, buffers.max_groups());
  EXPECT_TRUE(selector.ok()) << selector.status();
  if (!selector.ok()) return {};
  const testing::DeviceStep got = testing::SelectOnDevice(**selector, buffers, 1, rows, policy);
  EXPECT_TRUE(got.status.ok()) << got.status;
  const absl::Status core = SelectInCore(buffers, rows, policy);
  EXPECT_TRUE(core.ok()) << core;
  if (!got.status.ok() || !core.ok()) return {};
  std::vector<LayerGroups> layers;
  for (int layer = 0; layer < m.num_layers; ++layer) {
    layers.push_back(
        {testing::VisitedGroups(buffers, 0, buffers.VisitBlocks(layer, 0, 0), buffers.max_groups()),
         testing::VisitedGroups(buffers, 0, got.List(1, 1, buffers.max_blocks(), layer, 0, 0),
                                buffers.max_groups())});
  }
  return layers;
}

ModelLayout ValidationModel() {
  ModelLayout m;
  m.num_layers = 2;
  m.num_q_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 64;
  return m;
}

TEST(GpuStepValidationTest, BadSlotFailsTheStepAndWritesNothing) {
  SKIP_WITHOUT_DEVICE();
  testing::StepBuffers buffers(ValidationModel(), 1, 4096, 1, Granularity::kUnion);
  buffers.AssignRow(0, 4096, 1);
  buffers.FillRandomSummaries(2);
  buffers.group_table()[5] = 1 << 30;
  const StepRow rows[] = {{.table_row = 0, .context_tokens = 4096, .seq_id = 0}};
  // Each way of reading records: quest's warp sums, jl's staged copies, strict
  // mode's warp sums; the bad slot's lane reads nothing while its warp reads.
  ExpectEveryPathRefuses(buffers, rows,
                         {{Method::kQuest, false}, {Method::kJl, false}, {Method::kJl, true}},
                         "group_table[0][5]=1073741824");
}

// A Create that fails after allocating hands what it allocated to its caller (who
// frees it once that cannot wait for another engine's queued step), and leaves no
// error behind for the next Create on the same thread.
TEST(GpuStepValidationTest, AFailedCreateHandsOverWhatItAllocatedAndTheNextOneWorks) {
  SKIP_WITHOUT_DEVICE();
  const ModelLayout m = ValidationModel();
  std::unique_ptr<gpu::GpuSelector> remains;
  // More groups than the select kernel holds are refused before anything is allocated.
  auto wide = gpu::GpuSelector::Create(m, 0, 1, 8193, {}, &remains);
  EXPECT_EQ(wide.status().code(), absl::StatusCode::kInvalidArgument) << wide.status();
  EXPECT_NE(wide.status().message().find("exceeds the GPU pre-pass limit of 8192"),
            std::string::npos)
      << wide.status();
  EXPECT_EQ(remains, nullptr);
  // The scores' scratch alone would be 4096 x 32 x 64 x 8192 floats (275 GB).
  ModelLayout big = m;
  big.num_layers = 32;
  big.num_q_heads = 64;
  big.num_kv_heads = 8;
  auto failed = gpu::GpuSelector::Create(big, 0, 4096, 8192, {}, &remains);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted) << failed.status();
  ASSERT_NE(remains, nullptr);
  EXPECT_TRUE(remains->SafeToFree(std::chrono::seconds(0), std::chrono::seconds(1)));  // alone
  remains.reset();
  testing::StepBuffers buffers(m, 1, 4096, 1, Granularity::kUnion);
  buffers.AssignRow(0, 4096, 1);
  buffers.FillRandomSummaries(2);
  auto selector = gpu::GpuSelector::Create(m, 0, 1, buffers.max_groups());
  ASSERT_TRUE(selector.ok()) << selector.status();
  const StepRow rows[] = {{.table_row = 0, .context_tokens = 4096, .seq_id = 0}};
  EXPECT_TRUE(testing::SelectOnDevice(**selector, buffers, 1, rows, SelectPolicy{}).status.ok());
}

// The query check runs once per (row, layer, head) in the terms kernel: a NaN
// in a scored head's query fails the step, for every way of scoring.
TEST(GpuStepValidationTest, NonFiniteQueryFailsTheStepAndWritesNothing) {
  SKIP_WITHOUT_DEVICE();
  testing::StepBuffers buffers(ValidationModel(), 1, 4096, 1, Granularity::kUnion);
  buffers.AssignRow(0, 4096, 1);
  buffers.FillRandomSummaries(2);
  buffers.Query(1, 0, 3)[17] = std::nanf("");
  const int bad =
      (1 * 4 + 3) * 64 + 17;  // layer 1, head 3, element 17 of [layers, batch, heads, d]
  const StepRow rows[] = {{.table_row = 0, .context_tokens = 4096, .seq_id = 0}};
  ExpectEveryPathRefuses(
      buffers, rows,
      {{Method::kQuest, false}, {Method::kJl, false}, {Method::kJl, true}, {Method::kOff, false}},
      "element " + std::to_string(bad) + " is not finite");
}

// The fixed budget's rank loop reads the selection's shared words four at a
// time; a row that fills the table with a group count that is not a multiple
// of 4 (625 groups) read past the allocation until it was padded (memcheck,
// 2026-11-26). Lists equal core/'s up to a tie; run under memcheck by gpu_check.sh.
TEST(GpuStepValidationTest, FixedBudgetOverAFullTableStaysInItsSharedMemory) {
  SKIP_WITHOUT_DEVICE();
  ModelLayout m = ValidationModel();
  m.features = {.key_sum = true, .principal = true, .quest = true};
  const int64_t tokens = 20000;  // 1,250 blocks, 625 groups of 2 blocks: the table's width
  testing::StepBuffers buffers(m, 1, tokens, 1, Granularity::kUnion);
  buffers.AssignRow(0, tokens, 1);
  buffers.FillRandomSummaries(5);
  ASSERT_EQ(buffers.max_groups() % 4, 1);
  const StepRow rows[] = {{.table_row = 0, .context_tokens = tokens, .seq_id = 0}};
  SelectPolicy policy;
  policy.budget = Budget::kFixed;
  policy.top_pages = 40;
  const std::vector<LayerGroups> layers = VisitedOnBoth(buffers, rows, policy);
  ASSERT_EQ(layers.size(), static_cast<size_t>(m.num_layers));
  for (int layer = 0; layer < m.num_layers; ++layer) {
    const auto& [want, have] = layers[layer];
    int differing = 0;
    for (size_t p = 0; p < want.size(); ++p) differing += want[p] != have[p];
    EXPECT_LE(differing, 2) << "layer " << layer;  // a tie at the 40th rank moves one group
  }
}

// Grids put (layer, KV head) pairs and rows on y and z, at most 65535 each: a
// shape beyond is refused at Create by name, before any device is touched, so
// this runs without one (the old Create failed at cudaSetDevice here, or
// launched grids the driver refused at the first step on a GPU).
TEST(GpuStepValidationTest, AShapeBeyondCudasGridLimitsIsRefusedAtCreate) {
  ModelLayout m = ValidationModel();
  m.num_layers = 4096;
  m.num_q_heads = 32;
  m.num_kv_heads = 32;  // 131072 (layer, KV head) pairs
  auto selector = gpu::GpuSelector::Create(m, 0, 1, 64);
  EXPECT_EQ(selector.status().code(), absl::StatusCode::kInvalidArgument) << selector.status();
  EXPECT_NE(selector.status().message().find("num_layers * num_kv_heads = 4096 * 32 = 131072"),
            std::string::npos)
      << selector.status();
  selector = gpu::GpuSelector::Create(ValidationModel(), 0, 70000, 64);
  EXPECT_EQ(selector.status().code(), absl::StatusCode::kInvalidArgument) << selector.status();
  EXPECT_NE(selector.status().message().find("max_batch=70000"), std::string::npos)
      << selector.status();
}

// A query whose Σ q² leaves the float range (1e19 in every channel: 6.4e39) is
// refused by name as core/ refuses it, for every method: before, questclt (the
// default) selected from it and jl blamed a summary.
TEST(GpuStepValidationTest, AQueryBeyondTheFloatRangeIsRefusedAsCoreRefusesIt) {
  SKIP_WITHOUT_DEVICE();
  ModelLayout m = ValidationModel();
  m.features = {.key_sum = true, .principal = true, .quest = true};
  testing::StepBuffers buffers(m, 1, 4096, 1, Granularity::kUnion);
  buffers.AssignRow(0, 4096, 1);
  buffers.FillRandomSummaries(2);
  for (int layer = 0; layer < m.num_layers; ++layer) {
    for (int h = 0; h < m.num_q_heads; ++h) {
      for (float& x : buffers.Query(layer, 0, h)) x = 1e19f;
    }
  }
  const StepRow rows[] = {{.table_row = 0, .context_tokens = 4096, .seq_id = 0}};
  for (Method method : {Method::kJl, Method::kQuestClt, Method::kQuest, Method::kOnePc}) {
    SelectPolicy policy;
    policy.method = method;
    const absl::Status core = SelectInCore(buffers, rows, policy);
    EXPECT_EQ(core.code(), absl::StatusCode::kInvalidArgument) << core;
    EXPECT_NE(core.message().find("|q|^2"), std::string::npos) << core;
  }
  ExpectEveryPathRefuses(buffers, rows,
                         {{Method::kJl, false},
                          {Method::kQuestClt, false},
                          {Method::kQuest, false},
                          {Method::kOnePc, false},
                          {Method::kJl, true}},
                         "] has |q|^2 >= ");
}

// Records malformed but finite score alike on both backends: quest ranges
// inverted (min > max) select the same groups as core/ (the GPU's sign-split sum
// and core/'s old max form reversed the ranking); a NaN λ1 fails 1pc on both
// (the GPU's fmaxf dropped it and scored fro).
TEST(GpuStepValidationTest, MalformedRecordsScoreAsCoreScoresThem) {
  SKIP_WITHOUT_DEVICE();
  ModelLayout m = ValidationModel();
  m.features = {.key_sum = true, .principal = true, .quest = true};
  const int64_t tokens = 4096;
  testing::StepBuffers buffers(m, 1, tokens, 1, Granularity::kUnion);
  buffers.AssignRow(0, tokens, 1);
  buffers.FillRandomSummaries(3);
  const SummaryLayout l = SummaryLayout::For(m);
  const int64_t slots = buffers.num_slots();
  for (int64_t slot = 0; slot < slots; ++slot) {
    for (int layer = 0; layer < m.num_layers; ++layer) {
      for (int kvh = 0; kvh < m.num_kv_heads; ++kvh) {
        std::span<float> r = buffers.Record(slot, layer, kvh);
        for (int w = 0; w < m.head_dim / 2; ++w) std::swap(r[l.quest_min + w], r[l.quest_max + w]);
      }
    }
  }
  const StepRow rows[] = {{.table_row = 0, .context_tokens = tokens, .seq_id = 0}};
  SelectPolicy policy;
  policy.method = Method::kQuest;
  policy.top_pages = 16;
  const std::vector<LayerGroups> layers = VisitedOnBoth(buffers, rows, policy);
  ASSERT_EQ(layers.size(), static_cast<size_t>(m.num_layers));
  for (int layer = 0; layer < m.num_layers; ++layer) {
    const auto& [want, have] = layers[layer];
    int differing = 0;
    for (size_t p = 0; p < want.size(); ++p) differing += want[p] != have[p];
    EXPECT_LE(differing, 2) << "layer " << layer;  // a tie at the cut moves one group
  }
  // A NaN λ1 in the record of group 3 (layer 1, KV head 0).
  const int32_t slot = buffers.SlotOf(0, 3);
  std::span<float> r = buffers.Record(slot, 1, 0);
  r[l.principal] = std::nanf("");  // sealed (scale != 0), as FillRandomSummaries leaves none
  r[l.principal + 1] = 1.0f;
  r[l.principal + 2] = 1.0f / 127.0f;
  policy.method = Method::kOnePc;
  const absl::Status core = SelectInCore(buffers, rows, policy);
  EXPECT_EQ(core.code(), absl::StatusCode::kInvalidArgument) << core;
  EXPECT_NE(core.message().find("holds NaN or Inf"), std::string::npos) << core;
  ExpectEveryPathRefuses(buffers, rows, {{Method::kOnePc, false}},
                         "summary of slot " + std::to_string(slot));
}

// core fails a step whose record holds keys and an infinite quest half (core/step.cc): quest
// scored a -inf maximum met by a positive q_j as -inf, an empty group's score, and the step
// passed without the group. The GPU fails it too, naming the summary, on quest and questclt.
TEST(GpuStepValidationTest, AnInfiniteQuestHalfInARecordWithKeysFailsTheStepAsInCore) {
  SKIP_WITHOUT_DEVICE();
  ModelLayout m = ValidationModel();
  m.features = {.key_sum = true, .principal = false, .quest = true};
  testing::StepBuffers buffers(m, 1, 4096, 1, Granularity::kUnion);
  buffers.AssignRow(0, 4096, 1);
  buffers.FillRandomSummaries(4);
  const SummaryLayout l = SummaryLayout::For(m);
  const int32_t slot = buffers.SlotOf(0, 3);
  for (int layer = 0; layer < m.num_layers; ++layer) {
    for (int kvh = 0; kvh < m.num_kv_heads; ++kvh) {
      // -inf as channel 0's maximum: Reset's value, the range of no key.
      reinterpret_cast<uint16_t*>(buffers.Record(slot, layer, kvh).data() + l.quest_max)[0] =
          0xFC00;
    }
    for (int h = 0; h < m.num_q_heads; ++h) {
      for (float& x : buffers.Query(layer, 0, h)) x = 0.5f;
    }
  }
  const StepRow rows[] = {{.table_row = 0, .context_tokens = 4096, .seq_id = 0}};
  const std::string named = "summary of slot " + std::to_string(slot);
  for (Method method : {Method::kQuest, Method::kQuestClt}) {
    SelectPolicy policy;
    policy.method = method;
    const absl::Status core = SelectInCore(buffers, rows, policy);
    EXPECT_EQ(core.code(), absl::StatusCode::kInvalidArgument) << core;
    EXPECT_NE(core.message().find(named), std::string::npos) << core;
  }
  ExpectEveryPathRefuses(buffers, rows, {{Method::kQuest, false}, {Method::kQuestClt, false}},
                         named);
}

// A query whose squares fall below the float range (elements near 1e-25) leaves strict mode
// no bound on any group (core/bounds.cc's floors): every group is a candidate and the list
// holds them all, on the GPU as in core. Before, fro and the slack, scaled by a ‖q‖ that read
// 0, bracketed groups at [0, 0] and strict mode could skip the true top group.
TEST(GpuStepValidationTest, StrictModeWithAQueryBelowTheSquaresRangeVisitsEveryGroupAsCore) {
  SKIP_WITHOUT_DEVICE();
  ModelLayout m = ValidationModel();
  m.features = {.key_sum = true, .principal = true, .quest = true};
  const int64_t tokens = 4096;
  testing::StepBuffers buffers(m, 1, tokens, 1, Granularity::kUnion);
  buffers.AssignRow(0, tokens, 1);
  buffers.FillRandomSummaries(5);
  for (int layer = 0; layer < m.num_layers; ++layer) {
    for (int h = 0; h < m.num_q_heads; ++h) {
      for (float& x : buffers.Query(layer, 0, h)) x *= 1e-25f;
    }
  }
  const StepRow rows[] = {{.table_row = 0, .context_tokens = tokens, .seq_id = 0}};
  SelectPolicy policy;
  policy.strict = true;
  policy.top_pages = 4;
  const std::vector<LayerGroups> layers = VisitedOnBoth(buffers, rows, policy);
  ASSERT_EQ(layers.size(), static_cast<size_t>(m.num_layers));
  for (int layer = 0; layer < m.num_layers; ++layer) {
    const auto& [want, have] = layers[layer];
    EXPECT_EQ(have, want) << "layer " << layer;
    EXPECT_EQ(std::count(have.begin(), have.end(), true), static_cast<std::ptrdiff_t>(have.size()))
        << "layer " << layer;
  }
}

}  // namespace
}  // namespace eps

namespace eps {
namespace {

// A session is charged gpu::GpuSelector::DeviceBytes for its selector (service/session.cc).
// The service's own formula undercounted shapes of few heads and groups 3.5 times (the
// per-(row, layer) fused masks and arrivals, the terms' padding): here the charge must
// cover what Create allocates, up to the allocator's rounding of each buffer.
TEST(GpuSelectorDeviceBytesTest, TheChargeCoversWhatCreateAllocates) {
  SKIP_WITHOUT_DEVICE();
  ModelLayout m;
  m.num_layers = 4096;
  m.num_q_heads = m.num_kv_heads = 1;
  m.head_dim = 16;
  m.sketch_dim = 1;
  const int64_t batch = 1024, groups = 1;
  ASSERT_TRUE(gpu::GpuSelector::WarmUp(0).ok());  // the context and kernels, outside
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  size_t free_before = 0, free_after = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  auto selector = gpu::GpuSelector::Create(m, 0, batch, groups);
  ASSERT_TRUE(selector.ok()) << selector.status();
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  const uint64_t allocated = free_before - free_after;
  const uint64_t charged = gpu::GpuSelector::DeviceBytes(m, batch, groups, 0);
  std::printf("Create allocated %llu bytes; the charge is %llu\n",
              static_cast<unsigned long long>(allocated), static_cast<unsigned long long>(charged));
  EXPECT_GT(charged, uint64_t{200} << 20);  // the old charge was 67 MB for this shape
  EXPECT_LE(allocated, charged + (uint64_t{32} << 20)) << "32 MiB: each buffer's rounding";
}

}  // namespace
}  // namespace eps
