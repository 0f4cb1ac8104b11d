#include "load/workload.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "gtest/gtest.h"
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

}  // namespace
}  // namespace eps::load
