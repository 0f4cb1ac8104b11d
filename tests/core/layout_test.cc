#include "core/layout.h"

#include <optional>
#include <vector>

#include "gtest/gtest.h"

namespace eps {
namespace {

ModelLayout Llama8B() {
  ModelLayout m;
  m.num_layers = 32;
  m.num_q_heads = 32;
  m.num_kv_heads = 8;
  m.head_dim = 128;
  m.group_blocks = 8;
  return m;
}

TEST(LayoutTest, PackedIndexEnumeratesUpperTriangleRowMajor) {
  for (int m : {1, 4, 8, 16}) {
    int expected = 0;
    for (int i = 0; i < m; ++i) {
      for (int j = i; j < m; ++j) EXPECT_EQ(PackedIndex(m, i, j), expected++);
    }
    EXPECT_EQ(expected, PackedSize(m));
  }
}

TEST(LayoutTest, MinimalRecordHoldsGramAndNormsPaddedTo16Bytes) {
  ModelLayout m = Llama8B();
  m.features = {.key_sum = false, .principal = false, .quest = false};
  const SummaryLayout s = SummaryLayout::For(m);
  EXPECT_EQ(s.gram_words, 36);
  EXPECT_EQ(s.fro2, 36);
  EXPECT_EQ(s.max_norm, 37);
  EXPECT_EQ(s.count, 38);
  EXPECT_EQ(s.key_sum, -1);
  EXPECT_EQ(s.record_words, 40);
  EXPECT_EQ(s.record_bytes(), 160);
}

TEST(LayoutTest, OptionalPartsFollowInDocumentedOrder) {
  ModelLayout m = Llama8B();
  m.features = {.key_sum = true, .principal = true, .quest = true};
  const SummaryLayout s = SummaryLayout::For(m);
  EXPECT_EQ(s.key_sum, 39);
  EXPECT_EQ(s.quest_min, 39 + 128 + 1);  // one word of padding: a 16-byte boundary
  EXPECT_EQ(s.quest_max, 168 + 64);      // 128 binary16 minima in 64 words
  EXPECT_EQ(s.principal, 168 + 128);     // quest takes d words, 4·d bytes, not 8·d
  EXPECT_EQ(s.record_words % 4, 0);
  EXPECT_GE(s.record_words, s.principal + 3 + 32);
}

// The quest part starts on a 16-byte boundary (the GPU copies it 16 bytes at a
// time) whatever comes before it, and without the principal part the padding
// costs no record bytes.
TEST(LayoutTest, QuestPartStartsOnA16ByteBoundary) {
  for (int m_dim : {1, 2, 3, 4, 5, 8, 12, 16}) {
    for (bool key_sum : {false, true}) {
      ModelLayout m = Llama8B();
      m.sketch_dim = m_dim;
      m.features = {.key_sum = key_sum, .principal = false, .quest = true};
      const SummaryLayout s = SummaryLayout::For(m);
      EXPECT_EQ(s.quest_min % 4, 0) << "m " << m_dim << " key_sum " << key_sum;
      const int before = PackedSize(m_dim) + 3 + (key_sum ? m.head_dim : 0);
      EXPECT_EQ(s.record_words, (before + m.head_dim + 3) / 4 * 4) << "m " << m_dim;
    }
  }
}

// quest8 comes last, on a 16-byte boundary, so the parts before it keep their
// offsets (no new layout revision): d/4 words of minimum codes, d/4 of maximum
// codes, the scale.
TEST(LayoutTest, Quest8ComesLastOnA16ByteBoundary) {
  for (bool principal : {false, true}) {
    ModelLayout m = Llama8B();
    m.features = {.key_sum = true, .principal = principal, .quest = true, .quest8 = false};
    const SummaryLayout without = SummaryLayout::For(m);
    m.features.quest8 = true;
    const SummaryLayout s = SummaryLayout::For(m);
    EXPECT_EQ(s.key_sum, without.key_sum);
    EXPECT_EQ(s.quest_min, without.quest_min);
    EXPECT_EQ(s.principal, without.principal);
    EXPECT_EQ(s.quest8 % 4, 0);
    EXPECT_GE(s.quest8, without.record_words - 3);
    EXPECT_EQ(s.record_words, (s.quest8 + 128 / 2 + 1 + 3) / 4 * 4);
    EXPECT_EQ(without.quest8, -1);
  }
  ModelLayout alone = Llama8B();
  alone.features = {.key_sum = false, .principal = false, .quest = false, .quest8 = true};
  const SummaryLayout s = SummaryLayout::For(alone);
  EXPECT_EQ(s.quest8, 40);                 // after the Gram and norms (39 words), padded
  EXPECT_EQ(s.record_words, 40 + 68);      // 64 words of codes, the scale, padding
  EXPECT_EQ(s.record_bytes() - 160, 272);  // 2·d + 16 bytes against quest's 4·d
}

TEST(LayoutTest, BlocksAndGroupsRoundUp) {
  const ModelLayout m = Llama8B();  // 16-token blocks, 8 blocks per group
  EXPECT_EQ(BlocksFor(1, 16), 1);
  EXPECT_EQ(BlocksFor(16, 16), 1);
  EXPECT_EQ(BlocksFor(17, 16), 2);
  EXPECT_EQ(GroupsFor(128, m), 1);
  EXPECT_EQ(GroupsFor(129, m), 2);
  EXPECT_EQ(GroupsFor(32768, m), 256);
}

TEST(LayoutTest, ValidateNamesTheOffendingField) {
  ModelLayout m = Llama8B();
  EXPECT_TRUE(m.Validate().ok());
  m.num_q_heads = 30;
  EXPECT_EQ(m.Validate().message(), "num_q_heads=30 is not a multiple of num_kv_heads=8");
  m = Llama8B();
  m.sketch_dim = 0;
  EXPECT_EQ(m.Validate().message(), "sketch_dim=0 not in [1, 64]");
  m = Llama8B();
  m.head_dim = 66;
  EXPECT_FALSE(m.Validate().ok());
}

TEST(LayoutTest, CheckGivesValidatesReasonAndTheFieldsOfTheBrokenRule) {
  ModelLayout m = Llama8B();
  EXPECT_FALSE(m.Check().has_value());
  using Fields = std::vector<int ModelLayout::*>;
  m.sketch_dim = 65;
  std::optional<LayoutRefusal> r = m.Check();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->reason, m.Validate());
  EXPECT_EQ(r->reason.message(), "sketch_dim=65 not in [1, 64]");
  EXPECT_EQ(r->fields, Fields{&ModelLayout::sketch_dim});
  m = Llama8B();
  m.num_kv_heads = 5;
  r = m.Check();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->reason, m.Validate());
  EXPECT_EQ(r->fields, (Fields{&ModelLayout::num_q_heads, &ModelLayout::num_kv_heads}));
  m = Llama8B();
  m.coarse_blocks = m.group_blocks + 1;
  r = m.Check();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->fields, (Fields{&ModelLayout::coarse_blocks, &ModelLayout::group_blocks}));
  m = Llama8B();
  m.head_dim = 66;
  r = m.Check();
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->reason.message(), "head_dim=66 is not a multiple of 4");
  EXPECT_EQ(r->fields, Fields{&ModelLayout::head_dim});
}

TEST(LayoutTest, GqaMapsQueryHeadsToKvHeads) {
  const ModelLayout m = Llama8B();
  EXPECT_EQ(m.gqa_ratio(), 4);
  EXPECT_EQ(m.kv_head_of(0), 0);
  EXPECT_EQ(m.kv_head_of(3), 0);
  EXPECT_EQ(m.kv_head_of(4), 1);
  EXPECT_EQ(m.kv_head_of(31), 7);
}

}  // namespace
}  // namespace eps
