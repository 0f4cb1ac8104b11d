// The coarse level (ModelLayout.coarse_blocks, SelectPolicy.coarse_candidates):
// coarse-to-fine selection in core/step.h against selections without the level
// and against the candidates computed here from the coarse records.
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "core/bounds.h"
#include "core/status.h"
#include "core/step.h"
#include "core/summary.h"
#include "core/testing/synthetic.h"
#include "gtest/gtest.h"
#include "tests/core/coarse_policies.h"
#include "tests/core/step_fixture.h"
#include "tests/core/test_util.h"

namespace eps {
namespace {

using testing::StepBuffers;

ModelLayout CoarseModel(int group_blocks, int coarse_blocks) {
  ModelLayout m;
  m.num_layers = 2;
  m.num_q_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 64;
  m.block_size = 16;
  m.group_blocks = group_blocks;
  m.coarse_blocks = coarse_blocks;
  m.phi_seed = 5;
  m.features = {.key_sum = true, .principal = true, .quest = true, .quest8 = true};
  return m;
}

// Two sequences (table rows 0 and 1, batch positions 0 and 1) with fine records in
// StepBuffers and coarse records, written from the same keys, in a second pool.
class CoarseStepTest : public ::testing::Test {
 protected:
  void Build(const ModelLayout& model, std::vector<int64_t> tokens,
             Granularity granularity = Granularity::kUnion) {
    seed_ = testing::TestSeed();
    rng_.seed(seed_);
    model_ = model;
    granularity_ = granularity;
    phi_ = std::make_unique<PhiBank>(*PhiBank::Create(
        model.phi_seed, model.num_layers, model.num_kv_heads, model.head_dim, model.sketch_dim));
    writer_ = std::make_unique<SummaryWriter>(model, *phi_);
    const int64_t max_context = *std::max_element(tokens.begin(), tokens.end());
    buffers_ = std::make_unique<StepBuffers>(model, 2, max_context, 2, granularity);
    max_coarse_ = CoarseGroupsFor(max_context, model);
    const int words = SummaryLayout::For(model).record_words;
    coarse_slots_ = 2 * max_coarse_;
    coarse_pool_.assign(coarse_slots_ * model.num_layers * model.num_kv_heads * words, 0.0f);
    coarse_table_.assign(2 * max_coarse_, 0);
    rows_.clear();
    for (int32_t row = 0; row < 2; ++row) {
      const testing::SequenceKeys seq = testing::WriteSequence(
          *buffers_, *writer_, row, row, tokens[row], 6, testing::GroupShapes::kMixedRank, rng_);
      const int64_t nc = CoarseGroupsFor(tokens[row], model);
      // Coarse slots in reverse order, so a slot is never its group's index.
      for (int64_t c = 0; c < nc; ++c) coarse_table_[row * max_coarse_ + c] = SlotFor(row, nc, c);
      const int64_t ct = int64_t{model.coarse_blocks} * model.block_size;
      for (int layer = 0; layer < model.num_layers; ++layer) {
        for (int kvh = 0; kvh < model.num_kv_heads; ++kvh) {
          const std::vector<float>& keys = seq.Of(model, layer, kvh);
          for (int64_t c = 0; c < nc; ++c) {
            const int64_t begin = c * ct, count = std::min(ct, tokens[row] - begin);
            const KeyRows rows{keys.data() + begin * model.head_dim, DType::kFloat32, count,
                               model.head_dim};
            const std::span<float> record = CoarseRecord(SlotFor(row, nc, c), layer, kvh);
            EXPECT_TRUE(writer_->Reset(record).ok());
            ASSERT_TRUE(writer_->Append(record, layer, kvh, rows).ok());
            if (count == ct) {
              ASSERT_TRUE(writer_->Seal(record, layer, kvh, rows).ok());
            }
          }
        }
      }
      rows_.push_back({.table_row = row, .context_tokens = tokens[row], .seq_id = 10u + row});
    }
  }

  int32_t SlotFor(int32_t row, int64_t nc, int64_t c) const {
    return static_cast<int32_t>(row * max_coarse_ + (nc - 1 - c));
  }
  std::span<float> CoarseRecord(int64_t slot, int layer, int kvh) {
    const int words = SummaryLayout::For(model_).record_words;
    const int64_t index = (slot * model_.num_layers + layer) * model_.num_kv_heads + kvh;
    return {coarse_pool_.data() + index * words, static_cast<size_t>(words)};
  }

  StepInputs Inputs() const {
    StepInputs in = buffers_->Inputs(rows_);
    in.coarse_pool = coarse_pool_.data();
    in.coarse_slots = coarse_slots_;
    in.coarse_table = coarse_table_.data();
    in.max_coarse_groups = max_coarse_;
    return in;
  }

  // The lists of one step: [layer][row][list] → visited groups.
  using Lists = std::vector<std::vector<uint8_t>>;
  absl::Status Run(const ModelLayout& model, const SelectPolicy& policy, const StepInputs& in,
                   Lists* lists, StepStats* stats = nullptr) {
    absl::StatusOr<PageSelector> selector = PageSelector::Create(model, *phi_);
    if (!selector.ok()) return selector.status();
    RETURN_IF_ERROR(selector->Select(in, policy, buffers_->Outputs(), stats));
    lists->clear();
    const int count = policy.granularity == Granularity::kPerKvHead ? model.num_kv_heads : 1;
    for (int layer = 0; layer < model.num_layers; ++layer) {
      for (size_t i = 0; i < rows_.size(); ++i) {
        for (int list = 0; list < count; ++list) {
          const auto visit = buffers_->VisitBlocks(layer, static_cast<int64_t>(i), list);
          lists->push_back(testing::VisitedGroups(
              *buffers_, rows_[i].table_row,
              visit.first(buffers_->VisitCount(layer, static_cast<int64_t>(i), list)),
              GroupsFor(rows_[i].context_tokens, model)));
        }
      }
    }
    return absl::OkStatus();
  }

  // The candidate coarse groups of (row i, layer, list), computed here from the
  // coarse records: the forced ones and each scored head's best `want` others.
  std::vector<uint8_t> Candidates(const SelectPolicy& policy, size_t i, int layer, int list) {
    const ModelLayout& m = model_;
    const SummaryLayout layout = SummaryLayout::For(m);
    const int64_t n = GroupsFor(rows_[i].context_tokens, m);
    const int64_t nc = CoarseGroupsFor(rows_[i].context_tokens, m);
    std::vector<uint8_t> forced(n, 0), out(nc, 0);
    MarkForced(policy, forced);
    for (int64_t p = 0; p < n; ++p) out[p / m.coarse_ratio()] |= forced[p];
    const int want = policy.CoarseCandidates(m);
    const bool per_head = policy.granularity == Granularity::kPerKvHead;
    QueryTerms terms;
    for (int h = 0; h < m.num_q_heads; ++h) {
      const int kvh = m.kv_head_of(h);
      if ((per_head && kvh != list) || !policy.HeadIsScored(m, layer, h)) continue;
      const auto q = buffers_->Query(layer, static_cast<int64_t>(i), h);
      terms.Prepare(*phi_, layer, kvh, std::vector<float>(q.begin(), q.end()));
      std::vector<std::pair<float, int64_t>> ranked;
      for (int64_t c = 0; c < nc; ++c) {
        const int32_t slot = coarse_table_[rows_[i].table_row * max_coarse_ + c];
        const float s = Score(policy.method, CoarseRecord(slot, layer, kvh), layout, terms);
        bool is_forced = false;
        for (int64_t p = c * m.coarse_ratio(); p < std::min(n, (c + 1) * m.coarse_ratio()); ++p) {
          is_forced |= forced[p] != 0;
        }
        if (!is_forced) ranked.push_back({s, c});
      }
      std::sort(ranked.begin(), ranked.end(), [](auto a, auto b) { return a.first > b.first; });
      // Ties at the cut are all candidates (the threshold rule keeps score >= T).
      const size_t take = std::min(ranked.size(), static_cast<size_t>(want));
      for (size_t k = 0; k < ranked.size(); ++k) {
        if (k < take || (take > 0 && ranked[k].first >= ranked[take - 1].first)) {
          out[ranked[k].second] = 1;
        }
      }
    }
    return out;
  }

  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  Granularity granularity_ = Granularity::kUnion;
  ModelLayout model_;
  std::unique_ptr<PhiBank> phi_;
  std::unique_ptr<SummaryWriter> writer_;
  std::unique_ptr<StepBuffers> buffers_;
  int64_t max_coarse_ = 0, coarse_slots_ = 0;
  std::vector<float> coarse_pool_;
  std::vector<int32_t> coarse_table_;
  std::vector<StepRow> rows_;
};

// Every budget over both granularities, with the coarse_candidates each test sets.
std::vector<SelectPolicy> EveryBudget() {
  std::vector<SelectPolicy> out;
  for (Granularity gr : {Granularity::kUnion, Granularity::kPerKvHead}) {
    for (const SelectPolicy& p : testing::CoarsePolicies(gr, 2.0f)) out.push_back(p);
  }
  return out;
}

TEST(CoarseLayoutTest, CoarseBlocksMustBeAMultipleOfTheGroupAboveIt) {
  for (int coarse : {0, 4, 8, 64}) {
    EXPECT_TRUE(CoarseModel(2, coarse).Validate().ok()) << coarse;
  }
  for (int coarse : {-2, 2, 1, 5, 4098}) {
    const absl::Status s = CoarseModel(2, coarse).Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << coarse;
    EXPECT_NE(s.message().find("coarse_blocks"), std::string::npos) << s;
  }
  const ModelLayout m = CoarseModel(2, 8);
  EXPECT_EQ(m.coarse_ratio(), 4);
  EXPECT_EQ(CoarseGroupsFor(16 * 8, m), 1);
  EXPECT_EQ(CoarseGroupsFor(16 * 8 + 1, m), 2);
  EXPECT_EQ(CoarseGroupsFor(0, m), 0);
  EXPECT_EQ(CoarseGroupsFor(100, CoarseModel(2, 0)), 0);
}

TEST(CoarsePolicyTest, CandidateWidthIsCheckedAndRoundedUp) {
  const ModelLayout m = CoarseModel(1, 4);
  SelectPolicy p;
  p.top_pages = 10;
  p.coarse_candidates = 2.0f;
  EXPECT_EQ(p.CoarseCandidates(m), 5);  // 2 · 10 groups / 4 per coarse group
  p.coarse_candidates = 1.1f;
  EXPECT_EQ(p.CoarseCandidates(m), 3);  // 2.75 rounded up
  for (float bad : {0.5f, 0.0f, -1.0f, 2000.0f, std::nanf("")}) {
    p.coarse_candidates = bad;
    const absl::Status s = p.Validate(m);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("coarse_candidates"), std::string::npos) << s;
  }
  p.coarse_candidates = 2.0f;
  EXPECT_TRUE(p.UsesCoarseLevel(m));
  p.strict = true;
  EXPECT_FALSE(p.UsesCoarseLevel(m));
  p.strict = false;
  p.method = Method::kOff;
  EXPECT_FALSE(p.UsesCoarseLevel(m));
  EXPECT_FALSE(SelectPolicy{}.UsesCoarseLevel(CoarseModel(1, 0)));
}

TEST(CoarsePolicyTest, CoarseForcedHoldsEveryForcedGroup) {
  const std::vector<uint8_t> forced = {1, 0, 0, 0, 0, 0, 0, 0, 0, 1};
  std::vector<uint8_t> coarse(3, 0);
  MarkCoarseForced(forced, 4, coarse);
  EXPECT_EQ(coarse, (std::vector<uint8_t>{1, 0, 1}));
}

// With every coarse group a candidate the level changes nothing but the bytes.
TEST_F(CoarseStepTest, EveryCoarseGroupACandidateSelectsAsWithoutTheLevel) {
  for (auto [g, gc] : {std::pair{1, 4}, std::pair{2, 8}, std::pair{1, 2}}) {
    for (const SelectPolicy& base : EveryBudget()) {
      if (model_.coarse_blocks != gc || model_.group_blocks != g ||
          granularity_ != base.granularity) {
        Build(CoarseModel(g, gc), {16 * 300 + 5, 16 * 77}, base.granularity);
      }
      SelectPolicy policy = base;
      policy.coarse_candidates = 1024.0f;  // 1024 · 6 / r coarse groups: all of them
      ModelLayout flat = model_;
      flat.coarse_blocks = 0;
      Lists with, without;
      ASSERT_TRUE(Run(model_, policy, Inputs(), &with).ok()) << policy.DebugString();
      ASSERT_TRUE(Run(flat, policy, buffers_->Inputs(rows_), &without).ok());
      EXPECT_EQ(with, without) << policy.DebugString() << " g=" << g << " gc=" << gc
                               << " seed=" << seed_;
    }
  }
}

// Every visited group is forced or lies in a candidate coarse group computed here;
// and the selection differs from the flat one (the level does something).
TEST_F(CoarseStepTest, VisitedGroupsLieInTheCandidateCoarseGroups) {
  int differ = 0, cases = 0;
  for (auto [g, gc] : {std::pair{1, 4}, std::pair{2, 8}}) {
    for (const SelectPolicy& base : EveryBudget()) {
      if (model_.coarse_blocks != gc || model_.group_blocks != g ||
          granularity_ != base.granularity) {
        Build(CoarseModel(g, gc), {16 * 600, 16 * 333 + 1}, base.granularity);
      }
      SelectPolicy policy = base;
      policy.coarse_candidates = 1.5f;
      Lists with, without;
      ASSERT_TRUE(Run(model_, policy, Inputs(), &with).ok()) << policy.DebugString();
      ModelLayout flat = model_;
      flat.coarse_blocks = 0;
      ASSERT_TRUE(Run(flat, policy, buffers_->Inputs(rows_), &without).ok());
      const int lists = policy.granularity == Granularity::kPerKvHead ? model_.num_kv_heads : 1;
      size_t k = 0;
      for (int layer = 0; layer < model_.num_layers; ++layer) {
        for (size_t i = 0; i < rows_.size(); ++i) {
          for (int list = 0; list < lists; ++list, ++k) {
            const std::vector<uint8_t> cand = Candidates(policy, i, layer, list);
            for (size_t p = 0; p < with[k].size(); ++p) {
              if (with[k][p]) {
                EXPECT_TRUE(cand[p / model_.coarse_ratio()])
                    << "group " << p << " outside the candidates; " << policy.DebugString()
                    << " seed=" << seed_;
              }
            }
          }
        }
      }
      differ += with != without;
      ++cases;
    }
  }
  EXPECT_GT(differ, cases / 2) << "the coarse level changed too few selections";
}

// Inside the candidates the rules rank by the fine records: with the threshold
// budget, a candidate group at least as high as the top_pages-th candidate score is kept.
TEST_F(CoarseStepTest, CandidateGroupsAreRankedByTheirFineRecords) {
  Build(CoarseModel(1, 4), {16 * 512, 16 * 200});
  SelectPolicy policy;
  policy.top_pages = 8;
  policy.coarse_candidates = 2.0f;
  Lists with;
  ASSERT_TRUE(Run(model_, policy, Inputs(), &with).ok());
  const SummaryLayout layout = SummaryLayout::For(model_);
  QueryTerms terms;
  size_t k = 0;
  for (int layer = 0; layer < model_.num_layers; ++layer) {
    for (size_t i = 0; i < rows_.size(); ++i, ++k) {
      const std::vector<uint8_t> cand = Candidates(policy, i, layer, 0);
      const int64_t n = GroupsFor(rows_[i].context_tokens, model_);
      std::vector<uint8_t> forced(n, 0);
      MarkForced(policy, forced);
      for (int h = 0; h < model_.num_q_heads; ++h) {
        const int kvh = model_.kv_head_of(h);
        const auto q = buffers_->Query(layer, static_cast<int64_t>(i), h);
        terms.Prepare(*phi_, layer, kvh, std::vector<float>(q.begin(), q.end()));
        std::vector<std::pair<float, int64_t>> ranked;
        for (int64_t p = 0; p < n; ++p) {
          if (forced[p] || !cand[p / model_.coarse_ratio()]) continue;
          ranked.push_back(
              {Score(policy.method,
                     buffers_->Record(buffers_->SlotOf(rows_[i].table_row, p), layer, kvh), layout,
                     terms),
               p});
        }
        std::sort(ranked.begin(), ranked.end(), [](auto a, auto b) { return a.first > b.first; });
        ASSERT_GT(ranked.size(), static_cast<size_t>(policy.top_pages));
        for (int r = 0; r < policy.top_pages; ++r) {
          EXPECT_TRUE(with[k][ranked[r].second]) << "head " << h << " rank " << r << " group "
                                                 << ranked[r].second << " seed=" << seed_;
        }
      }
    }
  }
}

TEST_F(CoarseStepTest, SummaryBytesCountCoarseRecordsAndTheCandidatesFineOnes) {
  Build(CoarseModel(1, 4), {16 * 400, 16 * 64});
  SelectPolicy policy;
  policy.top_pages = 5;
  policy.coarse_candidates = 2.0f;
  Lists with;
  StepStats stats;
  ASSERT_TRUE(Run(model_, policy, Inputs(), &with, &stats).ok());
  int64_t records = 0;
  for (int layer = 0; layer < model_.num_layers; ++layer) {
    for (size_t i = 0; i < rows_.size(); ++i) {
      const std::vector<uint8_t> cand = Candidates(policy, i, layer, 0);
      const int64_t n = GroupsFor(rows_[i].context_tokens, model_);
      int64_t fine = 0;
      for (int64_t p = 0; p < n; ++p) fine += cand[p / model_.coarse_ratio()];
      records += (static_cast<int64_t>(cand.size()) + fine) * model_.num_kv_heads;
    }
  }
  EXPECT_EQ(stats.summary_bytes_read, records * SummaryLayout::For(model_).record_bytes());
  ModelLayout flat = model_;
  flat.coarse_blocks = 0;
  StepStats flat_stats;
  ASSERT_TRUE(Run(flat, policy, buffers_->Inputs(rows_), &with, &flat_stats).ok());
  EXPECT_LT(stats.summary_bytes_read, flat_stats.summary_bytes_read);
  EXPECT_EQ(stats.blocks_total, flat_stats.blocks_total);
}

TEST_F(CoarseStepTest, StrictAndOffIgnoreTheCoarseLevel) {
  Build(CoarseModel(1, 4), {16 * 300, 16 * 90});
  ModelLayout flat = model_;
  flat.coarse_blocks = 0;
  for (bool strict : {true, false}) {
    SelectPolicy policy;
    policy.strict = strict;
    policy.method = strict ? Method::kQuestClt : Method::kOff;
    Lists with, without;
    // No coarse buffers at all: neither needs them.
    ASSERT_TRUE(Run(model_, policy, buffers_->Inputs(rows_), &with).ok());
    ASSERT_TRUE(Run(flat, policy, buffers_->Inputs(rows_), &without).ok());
    EXPECT_EQ(with, without) << strict;
  }
}

TEST_F(CoarseStepTest, MissingOrBadCoarseBuffersAreRejectedAndLeaveTheOutputs) {
  Build(CoarseModel(1, 4), {16 * 300, 16 * 90});
  absl::StatusOr<PageSelector> selector = PageSelector::Create(model_, *phi_);
  ASSERT_TRUE(selector.ok());
  SelectPolicy policy;
  StepOutputs out = buffers_->Outputs();
  const int32_t sentinel = -7;
  std::fill_n(out.visit_count, 2, sentinel);
  auto expect_error = [&](const StepInputs& in, const std::string& needle) {
    const absl::Status s = selector->Select(in, policy, out, nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s;
    EXPECT_EQ(out.visit_count[0], sentinel);
    EXPECT_EQ(out.visit_count[1], sentinel);
  };
  expect_error(buffers_->Inputs(rows_), "coarse_pool");
  StepInputs in = Inputs();
  in.max_coarse_groups = 2;
  expect_error(in, "max_coarse_groups");
  coarse_table_[max_coarse_ + 3] = static_cast<int32_t>(coarse_slots_);
  expect_error(Inputs(), "coarse_table[1][3]");
  coarse_table_[max_coarse_ + 3] = SlotFor(1, CoarseGroupsFor(rows_[1].context_tokens, model_), 3);
  CoarseRecord(coarse_table_[7], 1, 1)[SummaryLayout::For(model_).fro2] = std::nanf("");
  expect_error(Inputs(), "coarse summary");
  SelectPolicy off;
  off.method = Method::kOff;
  ASSERT_TRUE(selector->Select(Inputs(), off, out, nullptr).ok());
}

}  // namespace
}  // namespace eps
