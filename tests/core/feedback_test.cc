// Selection feedback (core/select.h ApplyFeedback, core/step.h StepInputs::feedback):
// the rule on hand-made scores, and whole steps against the same steps without it.
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <vector>

#include "core/select.h"
#include "core/step.h"
#include "core/summary.h"
#include "core/testing/synthetic.h"
#include "gtest/gtest.h"
#include "tests/core/step_fixture.h"
#include "tests/core/test_util.h"

namespace eps {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(ApplyFeedbackTest, FedGroupsTakeTheirMassOthersTheMedianShift) {
  // d = 4: √d = 2. Fed groups 1 and 2: 2·1 − 5 = −3 and 2·3 − 7 = −1, median −2.
  std::vector<float> scores = {10, 5, 7, 3, -kInf};
  const std::vector<float> entry = {kNaN, 1, 3, kNaN, kNaN};
  ApplyFeedback(entry, 4, scores);
  EXPECT_EQ(scores, (std::vector<float>{8, 2, 6, 1, -kInf}));
}

TEST(ApplyFeedbackTest, OddCountTakesTheMiddleDifference) {
  std::vector<float> scores = {0, 0, 0, 4};
  const std::vector<float> entry = {1, 5, 2, kNaN};  // √d = 1: differences 1, 5, 2
  ApplyFeedback(entry, 1, scores);
  EXPECT_EQ(scores, (std::vector<float>{1, 5, 2, 6}));
}

TEST(ApplyFeedbackTest, NoFeedbackChangesNothingAndUnscoredFedGroupsCount) {
  std::vector<float> scores = {1, 2, 3};
  ApplyFeedback(std::vector<float>{kNaN, kNaN, kInf}, 64, scores);
  EXPECT_EQ(scores, (std::vector<float>{1, 2, 3}));
  // A fed group whose score is −∞ (outside the coarse candidates) takes its mass; it
  // gives no difference for the shift (0 here, no other fed group).
  std::vector<float> coarse = {-kInf, 2};
  ApplyFeedback(std::vector<float>{0.5f, kNaN}, 16, coarse);
  EXPECT_EQ(coarse, (std::vector<float>{2, 2}));
}

ModelLayout Model(int coarse_blocks) {
  ModelLayout m;
  m.num_layers = 2;
  m.num_q_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 64;
  m.group_blocks = 1;
  m.coarse_blocks = coarse_blocks;
  m.phi_seed = 9;
  m.features = {.key_sum = true, .principal = false, .quest = true, .quest8 = true};
  return m;
}

// Two sequences (table rows 0 and 1) of synthetic keys, and a feedback buffer.
class FeedbackStepTest : public ::testing::Test {
 protected:
  void Build(Granularity granularity = Granularity::kUnion) {
    seed_ = testing::TestSeed();
    rng_.seed(seed_);
    model_ = Model(0);
    phi_ = std::make_unique<PhiBank>(*PhiBank::Create(model_.phi_seed, model_.num_layers,
                                                      model_.num_kv_heads, model_.head_dim, 8));
    writer_ = std::make_unique<SummaryWriter>(model_, *phi_);
    buffers_ = std::make_unique<testing::StepBuffers>(model_, 2, 16 * 400, 2, granularity);
    for (int32_t row = 0; row < 2; ++row) {
      testing::WriteSequence(*buffers_, *writer_, row, row, row == 0 ? 16 * 400 : 16 * 150 + 3, 4,
                             testing::GroupShapes::kSynthetic, rng_);
      rows_.push_back({.table_row = row,
                       .context_tokens = row == 0 ? 16 * 400 : 16 * 150 + 3,
                       .seq_id = 5u + row});
    }
    feedback_.assign(
        static_cast<size_t>(model_.num_layers) * 2 * model_.num_q_heads * buffers_->max_groups(),
        kNaN);
  }
  float& Entry(int layer, int32_t row, int h, int64_t p) {
    return feedback_[((static_cast<size_t>(layer) * 2 + row) * model_.num_q_heads + h) *
                         buffers_->max_groups() +
                     p];
  }
  // Visited groups of (layer, batch position) after a step with `feedback` (or none).
  std::vector<std::vector<uint8_t>> Run(const SelectPolicy& policy, bool with_feedback,
                                        absl::Status* status = nullptr) {
    const PageSelector selector = *PageSelector::Create(model_, *phi_);
    StepInputs in = buffers_->Inputs(rows_);
    if (with_feedback) in.feedback = feedback_.data();
    const absl::Status s = selector.Select(in, policy, buffers_->Outputs(), nullptr);
    if (status != nullptr) *status = s;
    std::vector<std::vector<uint8_t>> out;
    if (!s.ok()) return out;
    for (int layer = 0; layer < model_.num_layers; ++layer) {
      for (int i = 0; i < 2; ++i) {
        const auto v = buffers_->VisitBlocks(layer, i);
        out.push_back(testing::VisitedGroups(*buffers_, rows_[i].table_row,
                                             v.first(buffers_->VisitCount(layer, i)),
                                             GroupsFor(rows_[i].context_tokens, model_)));
      }
    }
    return out;
  }

  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  ModelLayout model_;
  std::unique_ptr<PhiBank> phi_;
  std::unique_ptr<SummaryWriter> writer_;
  std::unique_ptr<testing::StepBuffers> buffers_;
  std::vector<StepRow> rows_;
  std::vector<float> feedback_;
};

TEST_F(FeedbackStepTest, AllNaNFeedbackSelectsAsWithout) {
  Build();
  SelectPolicy policy;
  policy.top_pages = 12;
  EXPECT_EQ(Run(policy, true), Run(policy, false)) << "seed=" << seed_;
}

TEST_F(FeedbackStepTest, FedMassesDecideTheirGroupsAndAreConsumed) {
  Build();
  SelectPolicy policy;
  policy.top_pages = 12;
  const auto before = Run(policy, false);
  // Layer 1, row 0: the estimate's best unforced group gets a mass far below every other
  // fed group's, and an unvisited group one far above; every head says so.
  const int64_t n = GroupsFor(rows_[0].context_tokens, model_);
  const auto& visited = before[2];  // layer 1, batch position 0
  int64_t best = -1, skipped = -1;
  for (int64_t p = 1; p + 2 < n; ++p) {
    if (visited[p] && best < 0) best = p;
    if (!visited[p]) skipped = p;
  }
  ASSERT_GE(best, 0);
  ASSERT_GE(skipped, 0);
  for (int h = 0; h < model_.num_q_heads; ++h) {
    for (int64_t p = 0; p < n; ++p) {
      if (visited[p]) Entry(1, 0, h, p) = 0.0f;  // the previous list: all fed, equal mass
    }
    Entry(1, 0, h, best) = -1000.0f;
    Entry(1, 0, h, skipped) = 1000.0f;
  }
  const auto after = Run(policy, true);
  EXPECT_FALSE(after[2][best]) << "seed=" << seed_;
  EXPECT_TRUE(after[2][skipped]) << "seed=" << seed_;
  EXPECT_EQ(after[0], before[0]);  // layer 0 had no feedback
  EXPECT_EQ(after[1], before[1]);
  for (float e : feedback_) ASSERT_TRUE(std::isnan(e)) << "feedback not consumed";
}

// A strict step ranks without the feedback but consumes it, so that a later step of
// another policy (a per-call strict) never reads entries two attentions old.
TEST_F(FeedbackStepTest, AFailedStepLeavesTheFeedbackAndStrictIgnoresButConsumesIt) {
  Build();
  Entry(0, 1, 2, 7) = 3.0f;
  int32_t& slot = buffers_->group_table()[1 * buffers_->max_groups() + 4];
  const int32_t kept = slot;
  slot = -1;
  absl::Status status;
  Run(SelectPolicy{}, true, &status);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Entry(0, 1, 2, 7), 3.0f);
  slot = kept;
  SelectPolicy strict;
  strict.strict = true;
  strict.top_pages = 10;
  const auto fed = Run(strict, true);
  EXPECT_TRUE(std::isnan(Entry(0, 1, 2, 7))) << "a strict step consumes the feedback";
  EXPECT_EQ(fed, Run(strict, false)) << "and ranks without it";
}

}  // namespace
}  // namespace eps
