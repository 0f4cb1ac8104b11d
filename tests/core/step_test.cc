// Whole-step selection (core/step.h): output format, edge cases and validation.
#include "core/step.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "core/summary.h"
#include "core/testing/synthetic.h"
#include "core/visit_list.h"
#include "gtest/gtest.h"
#include "tests/core/step_fixture.h"
#include "tests/core/test_util.h"

namespace eps {
namespace {

using testing::StepBuffers;

ModelLayout Model(int d = 64, int q_heads = 4, int kv_heads = 2, int group_blocks = 4) {
  ModelLayout m;
  m.num_layers = 2;
  m.num_q_heads = q_heads;
  m.num_kv_heads = kv_heads;
  m.head_dim = d;
  m.block_size = 16;
  m.group_blocks = group_blocks;
  m.phi_seed = 3;
  m.features = {.key_sum = true, .principal = true, .quest = true};
  return m;
}

// A sequence whose keys are small noise except "needle" groups, whose keys
// align with every query of the (layer, KV head): the groups any method must find.
class StepTest : public ::testing::Test {
 protected:
  void Build(const ModelLayout& model, int64_t tokens, const std::vector<int64_t>& needle_groups,
             Granularity granularity = Granularity::kUnion) {
    seed_ = testing::TestSeed();
    rng_.seed(seed_);
    model_ = model;
    phi_ = std::make_unique<PhiBank>(*PhiBank::Create(
        model.phi_seed, model.num_layers, model.num_kv_heads, model.head_dim, model.sketch_dim));
    selector_ = std::make_unique<PageSelector>(*PageSelector::Create(model, *phi_));
    writer_ = std::make_unique<SummaryWriter>(model, *phi_);
    buffers_ = std::make_unique<StepBuffers>(model, 2, tokens, 2, granularity);
    tokens_ = tokens;
    buffers_->AssignRow(1, tokens, rng_());
    const int d = model.head_dim, gt = model.group_tokens();
    for (int layer = 0; layer < model.num_layers; ++layer) {
      for (int kvh = 0; kvh < model.num_kv_heads; ++kvh) {
        const std::vector<float> q = testing::GaussianVector(rng_, d);
        for (int r = 0; r < model.gqa_ratio(); ++r) {
          auto out = buffers_->Query(layer, 0, kvh * model.gqa_ratio() + r);
          for (int i = 0; i < d; ++i)
            out[i] = q[i] + 0.1f * (static_cast<float>(rng_() % 100) / 100);
        }
        std::vector<float> keys = testing::GaussianVector(rng_, tokens * d, 0.3f);
        for (int64_t g : needle_groups) {
          const int64_t t = g * gt + static_cast<int64_t>(rng_() % gt);
          if (t >= tokens) continue;
          for (int i = 0; i < d; ++i) keys[t * d + i] = 3.0f * q[i];
        }
        for (int64_t p = 0, begin = 0; begin < tokens; ++p, begin += gt) {
          const int64_t count = std::min<int64_t>(gt, tokens - begin);
          const KeyRows rows{keys.data() + begin * d, DType::kFloat32, count, d};
          auto record = buffers_->Record(buffers_->SlotOf(1, p), layer, kvh);
          EXPECT_TRUE(writer_->Reset(record).ok());
          ASSERT_TRUE(writer_->Append(record, layer, kvh, rows).ok());
          if (count == gt) {
            ASSERT_TRUE(writer_->Seal(record, layer, kvh, rows).ok());
          }
        }
      }
    }
    rows_ = {{.table_row = 1, .context_tokens = tokens, .seq_id = 77}};
  }

  absl::Status Run(const SelectPolicy& policy, StepStats* stats = nullptr) {
    StepStats local;
    return selector_->Select(buffers_->Inputs(rows_), policy, buffers_->Outputs(),
                             stats ? stats : &local);
  }
  std::vector<uint8_t> Visited(int layer, int list = 0) {
    return testing::VisitedGroups(*buffers_, 1, buffers_->VisitBlocks(layer, 0, list),
                                  GroupsFor(tokens_, model_));
  }

  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  ModelLayout model_;
  int64_t tokens_ = 0;
  std::unique_ptr<PhiBank> phi_;
  std::unique_ptr<PageSelector> selector_;
  std::unique_ptr<SummaryWriter> writer_;
  std::unique_ptr<StepBuffers> buffers_;
  std::vector<StepRow> rows_;
};

TEST_F(StepTest, VisitListIsInLogicalOrderWithTheLastBlockLast) {
  Build(Model(), 1000, {5, 9});  // 63 blocks, the last holding 8 tokens
  SCOPED_TRACE(testing::SeedTrace(seed_));
  ASSERT_TRUE(Run(SelectPolicy{}).ok());
  const auto block_row = buffers_->BlockRow(1);
  for (int layer = 0; layer < 2; ++layer) {
    const auto visit = buffers_->VisitBlocks(layer, 0);
    ASSERT_FALSE(visit.empty());
    int64_t previous = -1;
    for (int32_t block : visit) {
      const int64_t logical =
          std::find(block_row.begin(), block_row.end(), block) - block_row.begin();
      EXPECT_GT(logical, previous);
      previous = logical;
    }
    EXPECT_EQ(visit.back(), block_row[62]);
    EXPECT_EQ(VisitedTokens(static_cast<int64_t>(visit.size()), 1000, 16),
              (static_cast<int64_t>(visit.size()) - 1) * 16 + 8);
  }
}

TEST_F(StepTest, MethodOffVisitsEveryBlock) {
  Build(Model(), 777, {});
  SelectPolicy policy;
  policy.method = Method::kOff;
  StepStats stats;
  ASSERT_TRUE(Run(policy, &stats).ok());
  EXPECT_EQ(buffers_->VisitCount(0, 0), 49);
  EXPECT_EQ(stats.blocks_visited, stats.blocks_total);
  EXPECT_EQ(stats.kv_bytes_read_est, stats.kv_bytes_dense);
  EXPECT_EQ(stats.summary_bytes_read, 0);
}

TEST_F(StepTest, EveryMethodFindsNeedlesInDistantGroups) {
  Build(Model(), 64 * 60, {3, 4, 7, 11});  // 60 groups, needles far from the recent end
  SCOPED_TRACE(testing::SeedTrace(seed_));
  for (Method method :
       {Method::kJl, Method::kOnePc, Method::kFro, Method::kQuest, Method::kQuestClt}) {
    SelectPolicy policy;
    policy.method = method;
    policy.top_pages = 4;
    ASSERT_TRUE(Run(policy).ok());
    for (int layer = 0; layer < 2; ++layer) {
      const auto visited = Visited(layer);
      for (int64_t g : {3, 4, 7, 11}) EXPECT_TRUE(visited[g]) << MethodName(method) << " " << g;
    }
  }
}

TEST_F(StepTest, NeedlesAmongRecentGroupsAreVisited) {
  Build(Model(), 64 * 40, {36, 37, 38});
  SCOPED_TRACE(testing::SeedTrace(seed_));
  SelectPolicy policy;
  policy.top_pages = 3;
  policy.last_n = 0;
  ASSERT_TRUE(Run(policy).ok());
  const auto visited = Visited(0);
  for (int64_t g : {36, 37, 38, 39}) EXPECT_TRUE(visited[g]) << g;
}

TEST_F(StepTest, SingleGroupContextVisitsItsOnlyGroup) {
  Build(Model(), 5, {});
  ASSERT_TRUE(Run(SelectPolicy{}).ok());
  EXPECT_EQ(buffers_->VisitCount(0, 0), 1);
  EXPECT_EQ(buffers_->VisitBlocks(1, 0)[0], buffers_->BlockRow(1)[0]);
}

TEST_F(StepTest, GroupOfOneBlockSelectsSingleBlocks) {
  Build(Model(64, 4, 2, /*group_blocks=*/1), 16 * 100, {20, 50});
  SCOPED_TRACE(testing::SeedTrace(seed_));
  SelectPolicy policy;
  policy.top_pages = 2;
  ASSERT_TRUE(Run(policy).ok());
  const auto visited = Visited(0);
  EXPECT_TRUE(visited[20]);
  EXPECT_TRUE(visited[50]);
  EXPECT_LE(buffers_->VisitCount(0, 0), 2 * (policy.first_n + policy.last_n + 2));
}

struct ShapeCase {
  int d;
  int ratio;
};
class StepShapeTest : public StepTest, public ::testing::WithParamInterface<ShapeCase> {};

TEST_P(StepShapeTest, HeadDimAndGqaRatioSelectTheNeedles) {
  const auto [d, ratio] = GetParam();
  Build(Model(d, 2 * ratio, 2), 64 * 30, {8, 17});
  SCOPED_TRACE(testing::SeedTrace(seed_));
  SelectPolicy policy;
  policy.top_pages = 2;
  StepStats stats;
  ASSERT_TRUE(Run(policy, &stats).ok());
  for (int layer = 0; layer < 2; ++layer) {
    const auto visited = Visited(layer);
    EXPECT_TRUE(visited[8]);
    EXPECT_TRUE(visited[17]);
  }
  EXPECT_LT(stats.groups_visited, stats.groups_total);
}

INSTANTIATE_TEST_SUITE_P(Shapes, StepShapeTest,
                         ::testing::Values(ShapeCase{64, 1}, ShapeCase{128, 4}, ShapeCase{256, 8},
                                           ShapeCase{128, 1}, ShapeCase{64, 8}),
                         [](const auto& test_param) {
                           return "d" + std::to_string(test_param.param.d) + "_gqa" +
                                  std::to_string(test_param.param.ratio);
                         });

TEST_F(StepTest, PerKvHeadListsUniteToTheUnionList) {
  Build(Model(), 64 * 50, {5, 25}, Granularity::kPerKvHead);
  SCOPED_TRACE(testing::SeedTrace(seed_));
  SelectPolicy policy;
  policy.granularity = Granularity::kPerKvHead;
  ASSERT_TRUE(Run(policy).ok());
  std::vector<uint8_t> united(50, 0);
  for (int kvh = 0; kvh < 2; ++kvh) {
    const auto v = Visited(0, kvh);
    for (int p = 0; p < 50; ++p) united[p] |= v[p];
  }
  // Same inputs, union granularity, into fresh buffers of the union shape.
  StepBuffers union_buffers(model_, 2, tokens_, 2, Granularity::kUnion);
  union_buffers.pool() = buffers_->pool();
  union_buffers.block_table() = buffers_->block_table();
  union_buffers.group_table() = buffers_->group_table();
  for (int layer = 0; layer < 2; ++layer) {
    for (int h = 0; h < model_.num_q_heads; ++h) {
      const auto src = buffers_->Query(layer, 0, h);
      std::copy(src.begin(), src.end(), union_buffers.Query(layer, 0, h).begin());
    }
  }
  policy.granularity = Granularity::kUnion;
  StepStats stats;
  ASSERT_TRUE(
      selector_->Select(union_buffers.Inputs(rows_), policy, union_buffers.Outputs(), &stats).ok());
  EXPECT_EQ(testing::VisitedGroups(union_buffers, 1, union_buffers.VisitBlocks(0, 0), 50), united);
}

TEST_F(StepTest, LayersWithoutRetrievalHeadsVisitOnlySinksAndRecent) {
  Build(Model(), 64 * 40, {10});
  SelectPolicy policy;
  policy.heads = HeadMode::kRetrieval;
  policy.retrieval_heads = {1, 0, 0, 0, /*layer 1:*/ 0, 0, 0, 0};
  ASSERT_TRUE(Run(policy).ok());
  EXPECT_TRUE(Visited(0)[10]);
  // first_n sinks and last_n recent groups (the newest among them), nothing else.
  EXPECT_EQ(buffers_->VisitCount(1, 0), (policy.first_n + policy.last_n) * model_.group_blocks);
}

TEST_F(StepTest, FixedBudgetCountIsKnownBeforeTheStep) {
  Build(Model(), 64 * 40 + 5, {3});  // 41 groups, the last partial (1 block)
  SelectPolicy policy;
  policy.budget = Budget::kFixed;
  policy.top_pages = 6;
  ASSERT_TRUE(Run(policy).ok());
  // Sink group 0, recent groups 39 and 40 (the newest, one block) and 6 chosen groups.
  const int expected = (1 + 1 + 6) * model_.group_blocks + 1;
  ASSERT_EQ(policy.first_n, 1);
  ASSERT_EQ(policy.last_n, 2);
  EXPECT_EQ(buffers_->VisitCount(0, 0), expected);
  EXPECT_EQ(buffers_->VisitCount(1, 0), expected);
}

TEST_F(StepTest, TopPBudgetVisitsTheDominantNeedle) {
  Build(Model(), 64 * 40, {12});
  SelectPolicy policy;
  policy.budget = Budget::kTopP;
  policy.top_p = 0.5f;
  ASSERT_TRUE(Run(policy).ok());
  EXPECT_TRUE(Visited(0)[12]);
}

TEST_F(StepTest, MassBudgetVisitsTheDominantNeedleAndSkipsTheRest) {
  Build(Model(), 64 * 40, {12});
  SelectPolicy policy;
  policy.budget = Budget::kMass;
  policy.mass_target = 0.5f;
  ASSERT_TRUE(Run(policy).ok());
  const std::vector<uint8_t> visit = Visited(0);
  EXPECT_TRUE(visit[12]);
  EXPECT_LT(std::accumulate(visit.begin(), visit.end(), 0), static_cast<int>(visit.size()));
}

// Per-layer mass settings: each layer's lists equal those of a step whose policy holds
// that layer's setting for every layer, per head and over the list; validation names
// the layer and the field.
TEST_F(StepTest, MassLayersSelectEachLayerWithItsOwnSetting) {
  Build(Model(), 64 * 40, {3, 12, 30});
  // At most 2 groups a head against at least 25: the two settings select differently
  // whatever the keys (with {0.5, 1, 0, 0} and {0.99, 2, 3, 20} some seeds' keys made both
  // lists of layer 0 the same, and the swap below could not see which setting it took).
  const std::vector<MassSetting> settings = {{0.5f, 1.0f, 0, 2}, {0.99f, 2.0f, 25, 30}};
  for (MassScope scope : {MassScope::kHead, MassScope::kList}) {
    SelectPolicy per_layer;
    per_layer.budget = Budget::kMass;
    per_layer.mass_scope = scope;
    per_layer.mass_layers = settings;
    ASSERT_TRUE(Run(per_layer).ok());
    const std::vector<std::vector<uint8_t>> got = {Visited(0), Visited(1)};
    for (int layer = 0; layer < 2; ++layer) {
      SelectPolicy one = per_layer;
      one.mass_layers.clear();
      one.mass_target = settings[layer].target;
      one.mass_temperature = settings[layer].temperature;
      one.min_pages = settings[layer].min_pages;
      one.max_pages = settings[layer].max_pages;
      ASSERT_TRUE(Run(one).ok());
      EXPECT_EQ(got[layer], Visited(layer))
          << "layer " << layer << " scope " << MassScopeName(scope) << " seed " << seed_;
    }
    // The two settings select differently here, so the test sees which one a layer took.
    SelectPolicy swapped = per_layer;
    std::swap(swapped.mass_layers[0], swapped.mass_layers[1]);
    ASSERT_TRUE(Run(swapped).ok());
    EXPECT_NE(got[0], Visited(0)) << "seed " << seed_;
  }
  SelectPolicy bad;
  bad.budget = Budget::kMass;
  bad.mass_layers = {settings[0]};
  EXPECT_NE(
      std::string(Run(bad).message()).find("mass_layers has 1 settings, want one per layer (2)"),
      std::string::npos);
  bad.mass_layers = {settings[0], {0.9f, 1.0f, 5, 2}};
  EXPECT_NE(std::string(Run(bad).message())
                .find("mass_layers[1].min_pages=5 exceeds mass_layers[1].max_pages=2"),
            std::string::npos);
  bad.mass_layers = {{1.5f, 1.0f, 0, 0}, settings[1]};
  EXPECT_NE(std::string(Run(bad).message()).find("mass_layers[0].target=1.5 not in (0, 1]"),
            std::string::npos);
}

TEST_F(StepTest, HalfQueriesSelectLikeTheirWidenedFloats) {
  Build(Model(), 64 * 30, {4, 20});
  std::vector<float> widened;
  std::vector<uint16_t> half;
  for (int layer = 0; layer < 2; ++layer) {
    for (int b = 0; b < 2; ++b) {
      for (int h = 0; h < model_.num_q_heads; ++h) {
        for (float& x : buffers_->Query(layer, b, h)) {
          half.push_back(FloatToHalf(x));
          x = HalfToFloat(half.back());
        }
      }
    }
  }
  ASSERT_TRUE(Run(SelectPolicy{}).ok());
  const std::vector<uint8_t> from_float = Visited(0);
  StepInputs in = buffers_->Inputs(rows_);
  in.queries = half.data();
  in.query_dtype = DType::kFloat16;
  StepStats stats;
  ASSERT_TRUE(selector_->Select(in, SelectPolicy{}, buffers_->Outputs(), &stats).ok());
  EXPECT_EQ(Visited(0), from_float);
}

TEST_F(StepTest, StatsCountGroupsBlocksAndBytes) {
  Build(Model(), 64 * 20, {});
  StepStats stats;
  ASSERT_TRUE(Run(SelectPolicy{}, &stats).ok());
  EXPECT_EQ(stats.groups_total, 2 * 20);
  EXPECT_EQ(stats.blocks_total, 2 * 80);
  EXPECT_EQ(stats.kv_bytes_dense, 2 /*layers*/ * 1280 * 2 /*kv heads*/ * 2 * 64 * 2);
  EXPECT_EQ(stats.summary_bytes_read, 2 * 20 * 2 * SummaryLayout::For(model_).record_bytes());
  int64_t blocks = buffers_->VisitCount(0, 0) + buffers_->VisitCount(1, 0);
  EXPECT_EQ(stats.blocks_visited, blocks);
}

// ---- Bad input: a precise error, and no output written. ----

class StepValidationTest : public StepTest {
 protected:
  void SetUp() override { Build(Model(), 64 * 10, {}); }
  void ExpectRejected(const StepInputs& in, const std::string& fragment,
                      const SelectPolicy& policy = SelectPolicy{}) {
    StepStats stats;
    const absl::Status status = selector_->Select(in, policy, buffers_->Outputs(), &stats);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(status.message().find(fragment), std::string::npos) << status;
    EXPECT_EQ(buffers_->VisitCount(0, 0), -1) << "output written despite the error";
  }
};

TEST_F(StepValidationTest, NaNQueryIsRejectedNamingItsPlace) {
  buffers_->Query(1, 0, 3)[7] = std::nanf("");
  ExpectRejected(buffers_->Inputs(rows_), "query[layer 1][row 0][head 3][7] is nan");
}

TEST_F(StepValidationTest, InfiniteQueryIsRejected) {
  buffers_->Query(0, 0, 0)[0] = -std::numeric_limits<float>::infinity();
  ExpectRejected(buffers_->Inputs(rows_), "is -inf");
}

TEST_F(StepValidationTest, NaNSummaryInALaterLayerIsRejectedBeforeAnyOutput) {
  // Layer 0 is scored before the NaN in layer 1 is met: its lists must not leak out.
  // The NaN sits in the Gram, which jl reads (questclt, the default, would not).
  buffers_->Record(buffers_->SlotOf(1, 3), 1, 1)[0] = std::nanf("");
  SelectPolicy jl;
  jl.method = Method::kJl;
  ExpectRejected(buffers_->Inputs(rows_), "NaN or Inf", jl);
}

TEST_F(StepTest, FixedBudgetLayersWithoutRetrievalHeadsKeepSinksAndRecentOnly) {
  Build(Model(), 64 * 40, {10});
  SelectPolicy policy;
  policy.budget = Budget::kFixed;
  policy.heads = HeadMode::kRetrieval;
  policy.retrieval_heads = {1, 0, 0, 0, /*layer 1:*/ 0, 0, 0, 0};
  StepStats stats;
  ASSERT_TRUE(Run(policy, &stats).ok());
  EXPECT_EQ(buffers_->VisitCount(1, 0), (policy.first_n + policy.last_n) * model_.group_blocks);
  // Only layer 0's first KV head was scored: one head's records were read.
  EXPECT_EQ(stats.summary_bytes_read, 40 * SummaryLayout::For(model_).record_bytes());
}

TEST_F(StepValidationTest, TableRowOutOfRangeIsRejected) {
  rows_[0].table_row = 2;
  ExpectRejected(buffers_->Inputs(rows_), "rows[0].table_row=2 not in [0, 2)");
}

TEST_F(StepValidationTest, ContextLongerThanCapacityIsRejected) {
  rows_[0].context_tokens = 64 * 10 + 1;
  ExpectRejected(buffers_->Inputs(rows_), "rows[0].context_tokens=641");
  rows_[0].context_tokens = 0;
  ExpectRejected(buffers_->Inputs(rows_), "rows[0].context_tokens=0");
}

// A visit list's count is an int32: a row of more blocks is refused, whatever max_blocks
// the table claims (nothing is read: the check comes first).
TEST_F(StepValidationTest, ARowOfMoreBlocksThanAVisitCountHoldsIsRejected) {
  StepInputs in = buffers_->Inputs(rows_);
  in.max_blocks = int64_t{1} << 33;
  in.max_groups = int64_t{1} << 33;
  rows_[0].context_tokens = (int64_t{INT32_MAX} + 1) * model_.block_size;
  in.rows = rows_;
  ExpectRejected(in, absl::StrCat("rows[0].context_tokens=", rows_[0].context_tokens,
                                  " not in [1, ", int64_t{INT32_MAX} * model_.block_size, "]"));
}

TEST_F(StepValidationTest, SlotOutOfRangeIsRejected) {
  buffers_->group_table()[1 * buffers_->max_groups() + 4] =
      static_cast<int32_t>(buffers_->num_slots());
  ExpectRejected(buffers_->Inputs(rows_), "group_table[1][4]=");
}

TEST_F(StepValidationTest, NegativeBlockIdIsRejected) {
  buffers_->block_table()[1 * buffers_->max_blocks() + 9] = -3;
  ExpectRejected(buffers_->Inputs(rows_), "block_table[1][9]=-3");
}

TEST_F(StepValidationTest, BatchLargerThanMaxBatchIsRejected) {
  std::vector<StepRow> rows(3, rows_[0]);
  ExpectRejected(buffers_->Inputs(rows), "batch of 3 rows exceeds max_batch=2");
}

TEST(PageSelectorTest, CreateRejectsAPhiBankOfAnotherModel) {
  ModelLayout m = Model();
  auto phi =
      PhiBank::Create(m.phi_seed + 1, m.num_layers, m.num_kv_heads, m.head_dim, m.sketch_dim);
  const auto selector = PageSelector::Create(m, *phi);
  EXPECT_EQ(selector.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace eps
