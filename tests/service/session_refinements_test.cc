// In-process tests of the session service's opt-in refinements (no epsd process, no
// gRPC): sessions with a coarse level and with selection feedback against core/, and the
// refusals of their buffers.
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/buffer_contract.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/session_service.h"
#include "tests/core/test_util.h"
#include "tests/service/test_engine.h"

namespace eps::service {
namespace {

using eps::testing::TestEngine;
using ::testing::HasSubstr;

// A session with a coarse level (4 groups of 2 blocks per coarse group) whose policy
// leaves most groups out, so that the coarse candidates decide what is scored.
ModelLayout CoarseServiceModel() {
  ModelLayout m = eps::testing::SmallServiceModel();
  m.coarse_blocks = 8;
  return m;
}

class CoarseSessionServiceTest : public ::testing::Test {
 protected:
  CoarseSessionServiceTest()
      : seed_(eps::testing::TestSeed()),
        engine_(CoarseServiceModel(), /*max_seqs=*/2, /*max_context=*/2048, /*max_batch=*/2,
                seed_) {
    engine_.Fill(0, 0, 1900);
    engine_.Fill(1, 1, 1300);
    // A head names ceil(1 · 4 / 4) = 1 coarse group: 4 heads and the (at most 3) forced
    // ones name at most 7 of a row's 15 or 11 coarse groups, 28 groups, so fewer records
    // are read than flat whatever the heads choose (at 1.5, up to 11 of 11 could be named
    // and the level read more than flat).
    policy_.top_pages = 4;
    policy_.coarse_candidates = 1.0f;
  }

  v1::AttachRequest Attach(const std::string& engine_id) const {
    v1::AttachRequest request = engine_.Attach(engine_id);
    request.mutable_options()->set_top_pages(policy_.top_pages);
    request.mutable_options()->set_coarse_candidates(policy_.coarse_candidates);
    return request;
  }

  v1::SelectPagesRequest Step(const std::string& session, uint64_t step) const {
    return TestEngine::Step(session, step, rows_);
  }

  uint64_t seed_;
  TestEngine engine_;
  SelectPolicy policy_;
  ServerConfig config_;
  SessionService service_{config_};
  const std::vector<v1::BatchRow> rows_ = {TestEngine::Row(0, 1900), TestEngine::Row(1, 1300)};
};

TEST_F(CoarseSessionServiceTest, AStepWithACoarseLevelWritesTheCoreReferenceLists) {
  SCOPED_TRACE(eps::testing::SeedTrace(seed_));
  v1::AttachResponse attached;
  const absl::Status a = service_.Attach(Attach("engine-a"), &attached);
  ASSERT_TRUE(a.ok()) << a;
  EXPECT_EQ(attached.effective_options().coarse_candidates(), 1.0f);  // not the default 2
  v1::SelectPagesResponse response;
  const absl::Status s = service_.SelectPages(Step(attached.session_id(), 1), &response);
  ASSERT_TRUE(s.ok()) << s;
  // The reference reads the coarse pool and table through the same memory: equal lists
  // mean epsd handed the core selector the engine's coarse records.
  EXPECT_TRUE(engine_.MatchesReference(rows_, policy_));
  // Fewer records than one per group and head were read: the coarse level pruned.
  const int64_t groups = response.stats().groups_total();
  const int64_t record_bytes = SummaryLayout::For(engine_.model()).record_bytes();
  EXPECT_LT(response.stats().bytes_summary_read(),
            groups * engine_.model().num_kv_heads * record_bytes);
}

TEST_F(CoarseSessionServiceTest, PerCallCoarseCandidatesChangeTheStepAndAreChecked) {
  SCOPED_TRACE(eps::testing::SeedTrace(seed_));
  v1::AttachResponse attached;
  ASSERT_TRUE(service_.Attach(Attach("engine-a"), &attached).ok());
  v1::SelectPagesRequest wide = Step(attached.session_id(), 1);
  wide.mutable_options()->set_coarse_candidates(1024.0f);
  v1::SelectPagesResponse response;
  ASSERT_TRUE(service_.SelectPages(wide, &response).ok());
  SelectPolicy p = policy_;
  p.coarse_candidates = 1024.0f;
  EXPECT_TRUE(engine_.MatchesReference(rows_, p));

  v1::SelectPagesRequest bad = Step(attached.session_id(), 2);
  bad.mutable_options()->set_coarse_candidates(0.5f);
  const absl::Status s = service_.SelectPages(bad, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("coarse_candidates=0.5"));
  // The session goes on with its own setting.
  ASSERT_TRUE(service_.SelectPages(Step(attached.session_id(), 3), &response).ok());
  EXPECT_TRUE(engine_.MatchesReference(rows_, policy_));
}

TEST_F(CoarseSessionServiceTest, AttachWithoutTheCoarseBuffersIsRefusedNamingThem) {
  for (const char* name : {"coarse_pool", "coarse_table"}) {
    v1::AttachRequest request = Attach("engine-a");
    v1::SharedBuffers* b = request.mutable_buffers();
    b->GetReflection()->ClearField(b, b->GetDescriptor()->FindFieldByName(name));
    v1::AttachResponse response;
    const absl::Status s = service_.Attach(request, &response);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(s.message(), absl::StrCat(name,
                                        " is required: layout.coarse_blocks=8 has a coarse "
                                        "level"));
  }
  EXPECT_EQ(service_.session_count(), 0u);
}

TEST_F(CoarseSessionServiceTest, CoarseBuffersWithoutACoarseLevelAreRefused) {
  v1::AttachRequest request = Attach("engine-a");
  request.mutable_layout()->set_coarse_blocks(0);
  v1::AttachResponse response;
  absl::Status s = service_.Attach(request, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), "coarse_pool is set, but layout.coarse_blocks=0 (no coarse level)");
  request.mutable_buffers()->clear_coarse_pool();
  s = service_.Attach(request, &response);
  EXPECT_EQ(s.message(), "coarse_table is set, but layout.coarse_blocks=0 (no coarse level)");
  EXPECT_EQ(service_.session_count(), 0u);
}

TEST_F(CoarseSessionServiceTest, CoarseBufferShapesAreCheckedAgainstTheContract) {
  v1::AttachResponse response;
  v1::AttachRequest rows = Attach("engine-a");
  rows.mutable_buffers()->mutable_coarse_table()->set_shape(0, 3);
  EXPECT_EQ(service_.Attach(rows, &response).message(),
            "coarse_table.shape[0]=3 does not match group_table.shape[0]=2");

  v1::AttachRequest words = Attach("engine-b");
  words.mutable_buffers()->mutable_coarse_pool()->set_shape(3, 5);
  EXPECT_THAT(service_.Attach(words, &response).message(),
              HasSubstr("coarse_pool.shape[3]=5 does not match record_words="));

  v1::AttachRequest dtype = Attach("engine-c");
  dtype.mutable_buffers()->mutable_coarse_table()->set_dtype(v1::DTYPE_FLOAT32);
  const absl::Status s = service_.Attach(dtype, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("coarse_table.dtype=DTYPE_FLOAT32"));
  EXPECT_EQ(service_.session_count(), 0u);
}

TEST_F(CoarseSessionServiceTest, ABadCoarseSlotFailsTheStepNamingItAndWritesNothing) {
  SCOPED_TRACE(eps::testing::SeedTrace(seed_));
  v1::AttachResponse attached;
  ASSERT_TRUE(service_.Attach(Attach("engine-a"), &attached).ok());
  v1::SelectPagesResponse response;
  ASSERT_TRUE(service_.SelectPages(Step(attached.session_id(), 1), &response).ok());
  const int32_t count_before = engine_.buffers().VisitCount(0, 0);
  const int32_t good = engine_.buffers().CoarseRow(0)[1];
  engine_.buffers().CoarseRow(0)[1] = 1 << 20;
  absl::Status s = service_.SelectPages(Step(attached.session_id(), 2), &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("coarse_table[0][1]=1048576"));
  EXPECT_EQ(engine_.buffers().selection_done(), 1u);
  EXPECT_EQ(engine_.buffers().VisitCount(0, 0), count_before);
  engine_.buffers().CoarseRow(0)[1] = good;
  ASSERT_TRUE(service_.SelectPages(Step(attached.session_id(), 2), &response).ok());
  EXPECT_TRUE(engine_.MatchesReference(rows_, policy_));
}

TEST_F(CoarseSessionServiceTest, AContextBeyondTheCoarseTableIsRefused) {
  v1::AttachRequest request = Attach("engine-a");
  // One coarse group per row fewer than max_context needs (the descriptor stays in the
  // allocation: a narrower table).
  request.mutable_buffers()->mutable_coarse_table()->set_shape(1, 14);
  v1::AttachResponse attached;
  ASSERT_TRUE(service_.Attach(request, &attached).ok());
  v1::SelectPagesResponse response;
  const absl::Status s = service_.SelectPages(Step(attached.session_id(), 1), &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("needs 15 coarse groups, max_coarse_groups=14"));
}

// A session with the selection-feedback buffer (docs/api-memory.md), flat or with a coarse
// level; three table rows, the step reads rows 0 and 1 (row 2 is another sequence's).
class FeedbackSessionServiceTest : public ::testing::TestWithParam<int> {
 protected:
  FeedbackSessionServiceTest()
      : seed_(eps::testing::TestSeed()),
        engine_(Model(), /*max_seqs=*/3, /*max_context=*/2048, /*max_batch=*/2, seed_,
                Granularity::kUnion, /*with_feedback=*/true) {
    engine_.Fill(2, 0, 700);  // its queries are overwritten by row 0's next
    engine_.Fill(0, 0, 1900);
    engine_.Fill(1, 1, 1300);
    policy_.top_pages = 4;
    policy_.coarse_candidates = 1.5f;
  }

  ModelLayout Model() const {
    return GetParam() == 0 ? eps::testing::SmallServiceModel() : CoarseServiceModel();
  }

  v1::AttachRequest Attach(const std::string& engine_id) const {
    v1::AttachRequest request = engine_.Attach(engine_id);
    request.mutable_options()->set_top_pages(policy_.top_pages);
    if (engine_.model().has_coarse_level()) {
      request.mutable_options()->set_coarse_candidates(policy_.coarse_candidates);
    }
    return request;
  }

  v1::SelectPagesRequest Step(const std::string& session, uint64_t step) const {
    return TestEngine::Step(session, step, rows_);
  }

  // Every entry of (layer, row, q head) below group `from` is NaN; those from it on equal `want`'s.
  ::testing::AssertionResult ConsumedBelow(const std::vector<float>& want, int32_t row,
                                           int64_t from) {
    const client::BufferPlan& plan = engine_.buffers().plan();
    for (int layer = 0; layer < engine_.model().num_layers; ++layer) {
      for (int h = 0; h < engine_.model().num_q_heads; ++h) {
        auto got = engine_.buffers().FeedbackRow(layer, row, h);
        for (int64_t p = 0; p < plan.max_groups; ++p) {
          const float before = want[plan.FeedbackIndex(layer, row, h) + p];
          const bool ok = p < from ? std::isnan(got[p])
                                   : (std::isnan(before) ? std::isnan(got[p]) : got[p] == before);
          if (!ok) {
            return ::testing::AssertionFailure()
                   << "layer " << layer << " row " << row << " head " << h << " group " << p << ": "
                   << got[p] << ", before the step " << before;
          }
        }
      }
    }
    return ::testing::AssertionSuccess();
  }

  uint64_t seed_;
  TestEngine engine_;
  SelectPolicy policy_;
  ServerConfig config_;
  SessionService service_{config_};
  const std::vector<v1::BatchRow> rows_ = {TestEngine::Row(0, 1900), TestEngine::Row(1, 1300)};
};

TEST_P(FeedbackSessionServiceTest, AStepSelectsAsCoreWithTheSameFeedbackAndConsumesItsRows) {
  SCOPED_TRACE(eps::testing::SeedTrace(seed_));
  v1::AttachRequest request = Attach("engine-a");
  ASSERT_TRUE(request.buffers().has_feedback());
  v1::AttachResponse attached;
  const absl::Status a = service_.Attach(request, &attached);
  ASSERT_TRUE(a.ok()) << a;
  for (int32_t row : {0, 1, 2}) engine_.FillFeedback(row, 1900);
  const std::vector<float> before = engine_.Feedback();
  v1::SelectPagesResponse response;
  const absl::Status s = service_.SelectPages(Step(attached.session_id(), 1), &response);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(engine_.MatchesReference(rows_, policy_, before));
  // The feedback was read: core without it selects otherwise.
  EXPECT_FALSE(engine_.MatchesReference(rows_, policy_));
  // Consumed: the step's rows up to their groups (1900 tokens: 60 groups, 1300: 41), not
  // beyond, and not row 2, which the step did not read.
  const ModelLayout& m = engine_.model();
  EXPECT_TRUE(ConsumedBelow(before, 0, GroupsFor(1900, m)));
  EXPECT_TRUE(ConsumedBelow(before, 1, GroupsFor(1300, m)));
  EXPECT_TRUE(ConsumedBelow(before, 2, 0));

  // A next step without new feedback selects as core without any.
  ASSERT_TRUE(service_.SelectPages(Step(attached.session_id(), 2), &response).ok());
  EXPECT_TRUE(engine_.MatchesReference(rows_, policy_));
}

TEST_P(FeedbackSessionServiceTest, NaNFeedbackOrNoneSelectsAsWithoutFeedback) {
  SCOPED_TRACE(eps::testing::SeedTrace(seed_));
  v1::AttachResponse with, without;
  ASSERT_TRUE(service_.Attach(Attach("engine-a"), &with).ok());
  v1::AttachRequest plain = Attach("engine-b");
  plain.mutable_buffers()->clear_feedback();
  ASSERT_TRUE(service_.Attach(plain, &without).ok());
  v1::SelectPagesResponse response;
  ASSERT_TRUE(service_.SelectPages(Step(with.session_id(), 1), &response).ok());
  EXPECT_TRUE(engine_.MatchesReference(rows_, policy_));
  // Without the buffer epsd neither reads nor writes it.
  for (int32_t row : {0, 1}) engine_.FillFeedback(row, 1900);
  const std::vector<float> before = engine_.Feedback();
  ASSERT_TRUE(service_.SelectPages(Step(without.session_id(), 1), &response).ok());
  EXPECT_TRUE(engine_.MatchesReference(rows_, policy_));
  EXPECT_TRUE(ConsumedBelow(before, 0, 0));
  EXPECT_TRUE(ConsumedBelow(before, 1, 0));
}

TEST_P(FeedbackSessionServiceTest, AFailedStepLeavesTheFeedback) {
  SCOPED_TRACE(eps::testing::SeedTrace(seed_));
  v1::AttachResponse attached;
  ASSERT_TRUE(service_.Attach(Attach("engine-a"), &attached).ok());
  for (int32_t row : {0, 1}) engine_.FillFeedback(row, 1900);
  const std::vector<float> before = engine_.Feedback();
  const int32_t good = engine_.buffers().GroupRow(1)[3];
  engine_.buffers().GroupRow(1)[3] = 1 << 20;
  v1::SelectPagesResponse response;
  const absl::Status s = service_.SelectPages(Step(attached.session_id(), 1), &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(ConsumedBelow(before, 0, 0));
  EXPECT_TRUE(ConsumedBelow(before, 1, 0));
  engine_.buffers().GroupRow(1)[3] = good;
  ASSERT_TRUE(service_.SelectPages(Step(attached.session_id(), 2), &response).ok());
  EXPECT_TRUE(engine_.MatchesReference(rows_, policy_, before));
}

TEST_P(FeedbackSessionServiceTest, FeedbackShapesAreCheckedAgainstTheContract) {
  v1::AttachResponse response;
  v1::AttachRequest rows = Attach("engine-a");
  rows.mutable_buffers()->mutable_feedback()->set_shape(1, 2);
  absl::Status s = service_.Attach(rows, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), "feedback.shape[1]=2 does not match group_table.shape[0]=3");

  v1::AttachRequest heads = Attach("engine-b");
  heads.mutable_buffers()->mutable_feedback()->set_shape(2, 2);
  EXPECT_EQ(service_.Attach(heads, &response).message(),
            "feedback.shape[2]=2 does not match num_q_heads=4");

  v1::AttachRequest groups = Attach("engine-c");
  groups.mutable_buffers()->mutable_feedback()->set_shape(3, 7);
  EXPECT_THAT(service_.Attach(groups, &response).message(),
              HasSubstr("feedback.shape[3]=7 does not match group_table.shape[1]="));

  v1::AttachRequest rank = Attach("engine-d");
  rank.mutable_buffers()->mutable_feedback()->mutable_shape()->RemoveLast();
  s = service_.Attach(rank, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("feedback"));

  // Inline: nothing could write it after Attach, and its zero-filled rest read as
  // feedback 0 for every group (a zero is a visited group's log mass).
  v1::AttachRequest inline_feedback = Attach("engine-f");
  inline_feedback.mutable_buffers()->mutable_feedback()->mutable_inline_bytes()->set_data("");
  inline_feedback.mutable_buffers()->mutable_feedback()->set_offset(0);
  s = service_.Attach(inline_feedback, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("feedback must be engine memory"));

  v1::AttachRequest dtype = Attach("engine-e");
  dtype.mutable_buffers()->mutable_feedback()->set_dtype(v1::DTYPE_INT32);
  s = service_.Attach(dtype, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("feedback.dtype=DTYPE_INT32"));
  EXPECT_EQ(service_.session_count(), 0u);
}

INSTANTIATE_TEST_SUITE_P(FlatAndCoarse, FeedbackSessionServiceTest, ::testing::Values(0, 1),
                         [](const ::testing::TestParamInfo<int>& param) {
                           return param.param == 0 ? std::string("Flat") : std::string("Coarse");
                         });

}  // namespace
}  // namespace eps::service
