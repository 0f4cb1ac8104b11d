#include "core/buffer_contract.h"

#include <gtest/gtest.h>

namespace eps {
namespace {

ModelLayout Model() {
  ModelLayout m;
  m.num_layers = 3;
  m.num_q_heads = 8;
  m.num_kv_heads = 2;
  m.head_dim = 64;
  return m;
}

TEST(BufferContractTest, TableIsInSharedBufferOrder) {
  for (int i = 0; i < kSharedBuffers; ++i) {
    EXPECT_EQ(static_cast<int>(kBufferContract[i].id), i) << kBufferContract[i].name;
  }
}

TEST(BufferContractTest, UnionListsDropTheListsDimension) {
  BufferDims dims = BufferDims::For(Model(), Granularity::kUnion);
  dims[Dim::kMaxBatch] = 4;
  dims[Dim::kMaxBlocks] = 100;
  EXPECT_EQ(ShapeOf(SpecOf(SharedBuffer::kVisitBlocks), dims, Granularity::kUnion),
            (std::vector<int64_t>{3, 4, 100}));
  EXPECT_EQ(ShapeOf(SpecOf(SharedBuffer::kVisitCount), dims, Granularity::kUnion),
            (std::vector<int64_t>{3, 4}));
}

TEST(BufferContractTest, PerKvHeadListsHaveOneListPerKvHead) {
  BufferDims dims = BufferDims::For(Model(), Granularity::kPerKvHead);
  dims[Dim::kMaxBatch] = 4;
  dims[Dim::kMaxBlocks] = 100;
  EXPECT_EQ(ShapeOf(SpecOf(SharedBuffer::kVisitBlocks), dims, Granularity::kPerKvHead),
            (std::vector<int64_t>{3, 4, 2, 100}));
}

TEST(BufferContractTest, EngineChosenDimsAreUnknownUntilSet) {
  const BufferDims dims = BufferDims::For(Model(), Granularity::kUnion);
  EXPECT_EQ(ShapeOf(SpecOf(SharedBuffer::kSummaryPool), dims, Granularity::kUnion),
            (std::vector<int64_t>{-1, 3, 2, SummaryLayout::For(Model()).record_words}));
  EXPECT_EQ(ShapeOf(SpecOf(SharedBuffer::kFlags), dims, Granularity::kUnion),
            (std::vector<int64_t>{2}));
}

TEST(BufferContractTest, CoarseBuffersApplyOnlyWithACoarseLevel) {
  ModelLayout coarse = Model();
  coarse.coarse_blocks = 8;
  for (const BufferSpec& spec : kBufferContract) {
    const bool coarse_buffer =
        spec.id == SharedBuffer::kCoarsePool || spec.id == SharedBuffer::kCoarseTable;
    EXPECT_EQ(BufferApplies(spec, Model()), !coarse_buffer) << spec.name;
    EXPECT_TRUE(BufferApplies(spec, coarse)) << spec.name;
  }
}

TEST(BufferContractTest, CoarseBuffersComeAfterFlagsAndAreRequiredWhenTheyApply) {
  EXPECT_GT(static_cast<int>(SharedBuffer::kCoarsePool), static_cast<int>(SharedBuffer::kFlags));
  EXPECT_FALSE(SpecOf(SharedBuffer::kCoarsePool).optional);
  EXPECT_FALSE(SpecOf(SharedBuffer::kCoarseTable).optional);
}

TEST(BufferContractTest, CoarsePoolHasTheSummaryRecordLayout) {
  ModelLayout model = Model();
  model.coarse_blocks = 8;
  BufferDims dims = BufferDims::For(model, Granularity::kUnion);
  EXPECT_EQ(ShapeOf(SpecOf(SharedBuffer::kCoarsePool), dims, Granularity::kUnion),
            (std::vector<int64_t>{-1, 3, 2, SummaryLayout::For(model).record_words}));
  dims[Dim::kMaxSeqs] = 5;
  dims[Dim::kMaxCoarseGroups] = 7;
  EXPECT_EQ(ShapeOf(SpecOf(SharedBuffer::kCoarseTable), dims, Granularity::kUnion),
            (std::vector<int64_t>{5, 7}));
  EXPECT_EQ(SpecOf(SharedBuffer::kCoarseTable).dtype, DType::kInt32);
}

TEST(BufferContractTest, FeedbackIsLastOptionalWrittenByEpsdAndAppliesToEverySession) {
  const BufferSpec& spec = SpecOf(SharedBuffer::kFeedback);
  EXPECT_EQ(static_cast<int>(SharedBuffer::kFeedback), kSharedBuffers - 1);
  EXPECT_STREQ(spec.name, "feedback");
  EXPECT_TRUE(spec.optional);
  EXPECT_TRUE(spec.output);
  EXPECT_FALSE(spec.coarse_level);
  EXPECT_EQ(spec.dtype, DType::kFloat32);
  ModelLayout coarse = Model();
  coarse.coarse_blocks = 8;
  EXPECT_TRUE(BufferApplies(spec, Model()));
  EXPECT_TRUE(BufferApplies(spec, coarse));
}

TEST(BufferContractTest, FeedbackIsByLayerTableRowQueryHeadAndGroup) {
  for (Granularity g : {Granularity::kUnion, Granularity::kPerKvHead}) {
    BufferDims dims = BufferDims::For(Model(), g);
    dims[Dim::kMaxSeqs] = 5;
    dims[Dim::kMaxGroups] = 7;
    dims[Dim::kMaxBatch] = 2;  // not a dim of feedback: rows are table rows
    EXPECT_EQ(ShapeOf(SpecOf(SharedBuffer::kFeedback), dims, g),
              (std::vector<int64_t>{3, 5, 8, 7}));
  }
}

}  // namespace
}  // namespace eps
