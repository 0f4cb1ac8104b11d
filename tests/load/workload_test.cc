#include "load/workload.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "gtest/gtest.h"
#include "load/buffer_set.h"
#include "load/load_config.h"

namespace eps::load {
namespace {

TEST(BuildWorkload, GivesEveryRowDistinctSlotsAndPermutedBlocks) {
  const ModelLayout model = *PresetModel("smollm2-135m");
  const WorkloadImage w = BuildWorkload(model, /*batch=*/3, /*max_context=*/1000, /*seed=*/5);
  EXPECT_EQ(w.max_blocks, 63);  // ceil(1000 / 16)
  EXPECT_EQ(w.max_groups, 8);   // ceil(63 / 8)
  EXPECT_EQ(w.shape.num_slots, 3 * 8);
  const std::set<int32_t> slots(w.group_table.begin(), w.group_table.end());
  EXPECT_EQ(slots.size(), w.group_table.size());
  std::vector<int32_t> blocks = w.block_table;
  std::sort(blocks.begin(), blocks.end());
  for (size_t i = 0; i < blocks.size(); ++i) ASSERT_EQ(blocks[i], static_cast<int32_t>(i));
  EXPECT_EQ(w.num_kv_blocks, static_cast<int64_t>(blocks.size()));
  EXPECT_NE(w.block_table, blocks) << "the block table should be shuffled";
}

TEST(BuildWorkload, WritesWellFormedRecordsForEveryGroup) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const ModelLayout model = *PresetModel("llama-3-70b-tp8");
  const int64_t context = 16 * 8 * 5 + 37;  // 5 full groups and a partial one
  const WorkloadImage w = BuildWorkload(model, /*batch=*/2, context, seed);
  const SummaryLayout layout = SummaryLayout::For(model);
  const int pairs = model.num_layers * model.num_kv_heads;
  ASSERT_EQ(w.summary_pool.size(),
            static_cast<size_t>(w.shape.num_slots) * pairs * layout.record_words);
  for (int64_t slot = 0; slot < w.shape.num_slots; ++slot) {
    const int64_t group = slot % w.max_groups;
    const float want_count = group < 5 ? 128.0f : 37.0f;
    for (int pair = 0; pair < pairs; ++pair) {
      const float* record = w.summary_pool.data() + (slot * pairs + pair) * layout.record_words;
      ASSERT_EQ(record[layout.count], want_count) << "slot " << slot << " pair " << pair;
      ASSERT_GT(record[layout.fro2], 0.0f);
      ASSERT_GT(record[layout.max_norm], 0.0f);
      // fro2 = Σ‖k‖² is at most count · max_norm².
      ASSERT_LE(record[layout.fro2],
                want_count * record[layout.max_norm] * record[layout.max_norm] * 1.0001f);
    }
  }
  for (float q : w.queries) ASSERT_TRUE(std::isfinite(q));
}

TEST(BuildWorkload, WithoutACoarseLevelHasNoCoarseImages) {
  const WorkloadImage w = BuildWorkload(*PresetModel("smollm2-135m"), 2, 1000, 3);
  EXPECT_EQ(w.max_coarse_groups, 0);
  EXPECT_EQ(w.shape.coarse_slots, 0);
  EXPECT_TRUE(w.coarse_pool.empty());
  EXPECT_TRUE(w.coarse_table.empty());
}

// The coarse records summarise the keys of their fine groups: counts and Σ‖k‖² add up.
TEST(BuildWorkload, CoarseRecordsSummariseTheSameKeysAsTheirGroups) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  ModelLayout model = *PresetModel("smollm2-135m");
  model.group_blocks = 2;
  model.coarse_blocks = 8;                  // 4 groups a coarse group
  const int64_t context = 16 * 8 * 3 + 50;  // 3 full coarse groups and a partial one
  const WorkloadImage w = BuildWorkload(model, /*batch=*/2, context, seed);
  ASSERT_EQ(w.max_coarse_groups, 4);
  ASSERT_EQ(w.shape.coarse_slots, 8);
  const SummaryLayout layout = SummaryLayout::For(model);
  const int pairs = model.num_layers * model.num_kv_heads;
  const int words = layout.record_words;
  ASSERT_EQ(w.coarse_pool.size(), static_cast<size_t>(8) * pairs * words);
  ASSERT_EQ(w.coarse_table.size(), static_cast<size_t>(2 * 4));
  const std::set<int32_t> slots(w.coarse_table.begin(), w.coarse_table.end());
  EXPECT_EQ(slots.size(), w.coarse_table.size());
  for (int row = 0; row < 2; ++row) {
    for (int64_t c = 0; c < 4; ++c) {
      const int32_t coarse_slot = w.coarse_table[row * 4 + c];
      for (int pair = 0; pair < pairs; ++pair) {
        const float* coarse = w.coarse_pool.data() + (coarse_slot * pairs + pair) * words;
        float count = 0, fro2 = 0;
        for (int64_t g = c * 4; g < std::min<int64_t>((c + 1) * 4, w.max_groups); ++g) {
          const int32_t slot = w.group_table[row * w.max_groups + g];
          const float* fine = w.summary_pool.data() + (slot * pairs + pair) * words;
          count += fine[layout.count];
          fro2 += fine[layout.fro2];
        }
        ASSERT_EQ(coarse[layout.count], count) << "row " << row << " coarse " << c;
        ASSERT_NEAR(coarse[layout.fro2], fro2, 1e-4f * fro2) << "row " << row << " coarse " << c;
      }
    }
  }
}

TEST(BufferSet, ShmBuffersTakeTheCoarseImagesOnlyWithACoarseLevel) {
  ModelLayout model = *PresetModel("smollm2-135m");
  model.num_layers = 2;
  model.group_blocks = 2;
  model.coarse_blocks = 8;
  const WorkloadImage w = BuildWorkload(model, 2, 600, 9);
  auto set = CreateBufferSet(service::BackendKind::kCpu, model, w.shape);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ((*set)->max_coarse_groups(), w.max_coarse_groups);
  ASSERT_TRUE(w.WriteTo(**set).ok());
  const v1::SharedBuffers d = (*set)->Descriptors();
  EXPECT_TRUE(d.has_coarse_pool() && d.has_coarse_table());
  EXPECT_EQ((*set)->WriteCoarseTable(std::vector<int32_t>(3)).code(),
            absl::StatusCode::kInvalidArgument);

  ModelLayout flat = model;
  flat.coarse_blocks = 0;
  const WorkloadImage f = BuildWorkload(flat, 2, 600, 9);
  auto flat_set = CreateBufferSet(service::BackendKind::kCpu, flat, f.shape);
  ASSERT_TRUE(flat_set.ok()) << flat_set.status();
  ASSERT_TRUE(f.WriteTo(**flat_set).ok());
  EXPECT_FALSE((*flat_set)->Descriptors().has_coarse_pool());
  EXPECT_EQ((*flat_set)->WriteCoarsePool(w.coarse_pool).code(),
            absl::StatusCode::kFailedPrecondition);
}

// The feedback image: in every (layer, row), the fed groups of any prefix number ⌊nF⌋ or
// ⌈nF⌉, every q head has the same ones, and a group's value is its keys' (the same in every row).
TEST(BuildWorkload, FeedbackImageFeedsAShareOfEveryPrefixTheSameForEveryHead) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  ModelLayout model = *PresetModel("smollm2-135m");
  model.num_layers = 3;
  const int batch = 3;
  const int64_t context = 16 * 8 * 20 + 5;  // 21 groups, the last partial
  const double share = 0.25;
  const WorkloadImage w = BuildWorkload(model, batch, context, seed, share);
  const int q = model.num_q_heads;
  const int64_t groups = w.max_groups;
  ASSERT_EQ(groups, 21);
  EXPECT_TRUE(w.shape.with_feedback);
  ASSERT_EQ(w.feedback.size(), static_cast<size_t>(model.num_layers) * batch * q * groups);
  auto at = [&](int layer, int row, int h, int64_t g) {
    return w.feedback[((static_cast<int64_t>(layer) * batch + row) * q + h) * groups + g];
  };
  for (int layer = 0; layer < model.num_layers; ++layer) {
    for (int row = 0; row < batch; ++row) {
      int64_t fed = 0;
      for (int64_t g = 0; g < groups; ++g) {
        const bool is_fed = std::isfinite(at(layer, row, 0, g));
        fed += is_fed;
        const double want = (g + 1) * share;
        ASSERT_GE(fed, std::floor(want)) << "layer " << layer << " row " << row << " g " << g;
        ASSERT_LE(fed, std::ceil(want)) << "layer " << layer << " row " << row << " g " << g;
        for (int h = 0; h < q; ++h) {
          ASSERT_EQ(std::isfinite(at(layer, row, h, g)), is_fed) << "head " << h << " g " << g;
          if (!is_fed) continue;
          for (int other = 0; other < batch; ++other) {  // the same keys and query in every row
            if (std::isfinite(at(layer, other, h, g))) {
              ASSERT_EQ(at(layer, other, h, g), at(layer, row, h, g));
            }
          }
        }
      }
    }
  }
  const WorkloadImage all = BuildWorkload(model, batch, context, seed, 1.0);
  for (float v : all.feedback) ASSERT_TRUE(std::isfinite(v));
}

TEST(BuildWorkload, FeedbackLeavesTheOtherImagesAsWithoutIt) {
  const ModelLayout model = *PresetModel("smollm2-135m");
  const WorkloadImage with = BuildWorkload(model, 2, 1000, 7, 0.5);
  const WorkloadImage without = BuildWorkload(model, 2, 1000, 7);
  EXPECT_TRUE(without.feedback.empty());
  EXPECT_FALSE(without.shape.with_feedback);
  EXPECT_EQ(with.summary_pool, without.summary_pool);
  EXPECT_EQ(with.block_table, without.block_table);
  EXPECT_EQ(with.queries, without.queries);
}

TEST(BufferSet, ShmBuffersWriteFeedbackOnlyWithinTheStepsRowsAndGroups) {
  ModelLayout model = *PresetModel("smollm2-135m");
  model.num_layers = 2;
  const WorkloadImage w = BuildWorkload(model, 2, 1000, 11, 1.0);  // 8 groups, all fed
  auto set = CreateBufferSet(service::BackendKind::kCpu, model, w.shape);
  ASSERT_TRUE(set.ok()) << set.status();
  BufferSet& b = **set;
  EXPECT_TRUE(b.Descriptors().has_feedback());
  EXPECT_EQ(b.WriteFeedback(std::vector<FeedbackRows>{{.row = 1, .groups = 3}}).code(),
            absl::StatusCode::kFailedPrecondition);  // before SetFeedbackPattern
  ASSERT_TRUE(b.SetFeedbackPattern(w.feedback).ok());
  ASSERT_TRUE(b.WriteFeedback(std::vector<FeedbackRows>{{.row = 1, .groups = 3}}).ok());
  for (int layer = 0; layer < model.num_layers; ++layer) {
    for (int h = 0; h < model.num_q_heads; ++h) {
      for (int64_t g = 0; g < w.max_groups; ++g) {
        const float image =
            w.feedback[((layer * 2 + 1) * model.num_q_heads + h) * w.max_groups + g];
        EXPECT_TRUE(std::isnan(*b.ReadFeedback(layer, 0, h, g)));  // row 0 was not stepped
        const float got = *b.ReadFeedback(layer, 1, h, g);
        if (g < 3) {
          EXPECT_EQ(got, image) << "layer " << layer << " head " << h << " group " << g;
        } else {
          EXPECT_TRUE(std::isnan(got)) << "past the context: group " << g;
        }
      }
    }
  }
  const absl::Status wide = b.WriteFeedback(std::vector<FeedbackRows>{{.row = 0, .groups = 9}});
  EXPECT_EQ(wide.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wide.message().find("groups=9"), std::string::npos) << wide;
  EXPECT_EQ(b.ReadFeedback(2, 0, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);

  const WorkloadImage none = BuildWorkload(model, 2, 1000, 11);
  auto plain = CreateBufferSet(service::BackendKind::kCpu, model, none.shape);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE((*plain)->Descriptors().has_feedback());
  EXPECT_EQ((*plain)->SetFeedbackPattern(w.feedback).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace eps::load
