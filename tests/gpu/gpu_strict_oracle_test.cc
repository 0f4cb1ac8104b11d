// The strict-mode oracle on the device: for random sequences, the GPU pre-pass's
// visited set of every (sequence, layer, list) contains, for every query head,
// the true top-M groups ranked by max_i q·k_i (ties at the M-th score
// included), as tests/core/strict_oracle_test.cc checks for core/. Skips
// without a CUDA device.
#include <algorithm>
#include <cstdio>
#include <random>
#include <span>
#include <vector>

#include "core/step.h"
#include "core/summary.h"
#include "gtest/gtest.h"
#include "tests/core/step_fixture.h"
#include "tests/core/test_util.h"
#include "tests/gpu/device_step.h"

namespace eps {
namespace {

// Groups whose true max score reaches the top_pages-th largest one.
std::vector<uint8_t> TrueTopM(const std::vector<double>& best, int top_pages) {
  std::vector<double> sorted = best;
  std::sort(sorted.rbegin(), sorted.rend());
  const double floor = sorted[std::min<size_t>(top_pages, sorted.size()) - 1];
  std::vector<uint8_t> top(best.size());
  for (size_t p = 0; p < best.size(); ++p) top[p] = best[p] >= floor;
  return top;
}

TEST(GpuStrictOracleTest, StrictModeReturnsSupersetOfTrueTopMOnTheDevice) {
  SKIP_WITHOUT_DEVICE();
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  const int trials = 300;
  int64_t visited = 0, total = 0;
  for (int trial = 0; trial < trials; ++trial) {
    ModelLayout m;
    m.num_layers = 1 + static_cast<int>(rng() % 2);
    m.num_kv_heads = 1 + static_cast<int>(rng() % 2);
    m.num_q_heads = m.num_kv_heads * (1 << (rng() % 3));  // GQA 1, 2, 4
    m.head_dim = 16 * (1 + static_cast<int>(rng() % 2));
    m.block_size = 1 << (rng() % 3);
    m.group_blocks = 1 << (rng() % 4);
    m.sketch_dim = 4 << (rng() % 2);
    m.phi_seed = rng();
    m.features.key_sum = rng() % 4 != 0;
    m.features.principal = rng() % 2;
    m.features.quest = rng() % 2;
    m.features.quest8 = rng() % 2;  // records with it, or of it alone, bracket the same way
    const int64_t tokens = 1 + static_cast<int64_t>(rng() % 400);
    const int needles = static_cast<int>(rng() % 5);
    SelectPolicy policy;
    policy.strict = true;
    policy.method = rng() % 2 ? Method::kJl : Method::kQuest;  // strict ignores the method
    policy.first_n = static_cast<int>(rng() % 3);
    policy.last_n = static_cast<int>(rng() % 3);
    policy.top_pages = 1 + static_cast<int>(rng() % 12);
    policy.granularity = rng() % 2 ? Granularity::kUnion : Granularity::kPerKvHead;
    const bool per_head = policy.granularity == Granularity::kPerKvHead;
    const int lists = per_head ? m.num_kv_heads : 1;

    auto phi = PhiBank::Create(m.phi_seed, m.num_layers, m.num_kv_heads, m.head_dim, m.sketch_dim);
    ASSERT_TRUE(phi.ok());
    SummaryWriter writer(m, *phi);
    testing::StepBuffers buffers(m, 2, tokens, 1, policy.granularity);
    const auto shapes =
        trial % 2 ? testing::GroupShapes::kMixedRank : testing::GroupShapes::kSynthetic;
    const testing::SequenceKeys seq =
        testing::WriteSequence(buffers, writer, 1, 0, tokens, needles, shapes, rng);
    const StepRow rows[] = {{.table_row = 1, .context_tokens = tokens, .seq_id = 9}};
    auto selector = gpu::GpuSelector::Create(m, 0, 1, buffers.max_groups());
    ASSERT_TRUE(selector.ok()) << selector.status();
    const testing::DeviceStep got = testing::SelectOnDevice(**selector, buffers, 1, rows, policy);
    ASSERT_TRUE(got.status.ok()) << got.status << "; trial " << trial;
    visited += got.stats.groups_visited;
    total += got.stats.groups_total;
    const int64_t groups = GroupsFor(tokens, m);
    for (int layer = 0; layer < m.num_layers; ++layer) {
      for (int h = 0; h < m.num_q_heads; ++h) {
        const int kvh = m.kv_head_of(h);
        std::vector<float> q(buffers.Query(layer, 0, h).begin(), buffers.Query(layer, 0, h).end());
        const std::vector<uint8_t> top =
            TrueTopM(testing::GroupMaxScore(seq.Of(m, layer, kvh), q, m.head_dim, m.group_tokens()),
                     policy.top_pages);
        const std::vector<int32_t> list =
            got.List(1, lists, buffers.max_blocks(), layer, 0, per_head ? kvh : 0);
        const std::vector<uint8_t> hit = testing::VisitedGroups(buffers, 1, list, groups);
        for (int64_t p = 0; p < groups; ++p) {
          ASSERT_TRUE(!top[p] || hit[p])
              << "trial " << trial << ": group " << p << " of " << groups << " is in the true top-"
              << policy.top_pages << " of layer " << layer << " head " << h
              << " but the device skipped it; model " << m.DebugString() << "; policy "
              << policy.DebugString();
        }
      }
    }
  }
  std::printf("device strict mode visited %.1f%% of %lld groups over %d random sequences\n",
              100.0 * visited / total, static_cast<long long>(total), trials);
}

// As core's FloatRangeTest case: every key and the query inside the accepted range and
// every q·k finite, but q·Σk of group 0's 128 large keys overflows. Its mean's lower
// bound was +inf, the bracket [inf, inf], and the true top group 1 was skipped.
TEST(GpuStrictOracleTest, StrictKeepsTheTrueTopGroupWhenTheMeanKeysDotOverflows) {
  SKIP_WITHOUT_DEVICE();
  ModelLayout m;
  m.num_layers = m.num_q_heads = m.num_kv_heads = 1;
  m.head_dim = 16;
  m.block_size = 16;
  m.group_blocks = 8;
  m.features = {.key_sum = true, .principal = false, .quest = false, .quest8 = false};
  const int64_t gt = m.group_tokens(), tokens = 3 * gt;
  auto phi = PhiBank::Create(m.phi_seed, m.num_layers, m.num_kv_heads, m.head_dim, m.sketch_dim);
  ASSERT_TRUE(phi.ok());
  SummaryWriter writer(m, *phi);
  testing::StepBuffers buffers(m, 2, tokens, 1, Granularity::kUnion);
  std::mt19937_64 rng(testing::TestSeed());
  buffers.AssignRow(1, tokens, rng());
  for (int64_t p = 0; p < 3; ++p) {
    std::vector<float> keys(gt * m.head_dim, 0.0f);
    if (p == 0) {
      for (int64_t t = 0; t < gt; ++t) keys[t * m.head_dim] = 4.0e17f;
    } else if (p == 1) {
      keys[0] = 4.5e18f;
    }
    const KeyRows rows{keys.data(), DType::kFloat32, gt, m.head_dim};
    const std::span<float> record = buffers.Record(buffers.SlotOf(1, p), 0, 0);
    ASSERT_TRUE(writer.Reset(record).ok());
    ASSERT_TRUE(writer.Append(record, 0, 0, rows).ok());
    ASSERT_TRUE(writer.Seal(record, 0, 0, rows).ok());
  }
  std::fill(buffers.Query(0, 0, 0).begin(), buffers.Query(0, 0, 0).end(), 0.0f);
  buffers.Query(0, 0, 0)[0] = 1.8e19f;
  SelectPolicy policy;
  policy.strict = true;
  policy.first_n = policy.last_n = 0;
  policy.top_pages = 1;
  const StepRow rows[] = {{.table_row = 1, .context_tokens = tokens, .seq_id = 9}};
  auto selector = gpu::GpuSelector::Create(m, 0, 1, buffers.max_groups());
  ASSERT_TRUE(selector.ok()) << selector.status();
  const testing::DeviceStep got = testing::SelectOnDevice(**selector, buffers, 1, rows, policy);
  ASSERT_TRUE(got.status.ok()) << got.status;
  const std::vector<uint8_t> hit =
      testing::VisitedGroups(buffers, 1, got.List(1, 1, buffers.max_blocks(), 0, 0, 0), 3);
  EXPECT_TRUE(hit[1]) << "the true top group was skipped";
}

}  // namespace
}  // namespace eps
