// In-process tests of service/convert.h: eps.v1 messages <-> core/ and service types.
#include "service/convert.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace eps::service {
namespace {

using ::testing::HasSubstr;

TEST(ConvertTest, StatusKeepsItsCodeAndMessageOverGrpc) {
  const grpc::Status s = ToGrpcStatus(absl::FailedPreconditionError("step 3 is not after 4"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(s.error_message(), "step 3 is not after 4");
}

TEST(ConvertTest, EveryCoreDTypeRoundTrips) {
  for (DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kInt32, DType::kInt8,
                  DType::kUInt64}) {
    absl::StatusOr<DType> back = FromProto(ToProto(d));
    ASSERT_TRUE(back.ok()) << DTypeName(d);
    EXPECT_EQ(*back, d);
  }
  EXPECT_FALSE(FromProto(v1::DTYPE_UNSPECIFIED).ok());
}

// A valid layout with every field the server has no default for.
v1::ModelLayout SmallLayout() {
  v1::ModelLayout p;
  p.set_num_layers(2);
  p.set_num_q_heads(8);
  p.set_num_kv_heads(2);
  p.set_head_dim(64);
  p.set_block_size(16);
  return p;
}

TEST(ConvertTest, LayoutFillsServerDefaultsForUnsetFields) {
  v1::ModelLayout p = SmallLayout();
  absl::StatusOr<ModelLayout> m = LayoutFromProto(p, /*default_group_blocks=*/4,
                                                  /*default_sketch_dim=*/6);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->group_blocks, 4);
  EXPECT_EQ(m->sketch_dim, 6);
  EXPECT_EQ(m->kv_dtype, DType::kFloat16);
}

TEST(ConvertTest, LayoutErrorsNameTheFieldAndValue) {
  v1::ModelLayout p;
  p.set_num_layers(2000000);
  EXPECT_THAT(LayoutFromProto(p, 8, 8).status().message(),
              HasSubstr("layout.num_layers=2000000 is too large"));
  p = SmallLayout();
  p.set_kv_dtype(v1::DTYPE_INT32);
  EXPECT_THAT(LayoutFromProto(p, 8, 8).status().message(),
              HasSubstr("layout.kv_dtype=DTYPE_INT32 is not a KV type"));
}

// The record layout revision (core/layout.h): a client that writes the quest part
// where revision 1 put it is refused when that is not where epsd reads it, with both
// word offsets in the message; a layout that did not move is accepted from any client;
// a revision newer than epsd's is refused.
TEST(ConvertTest, LayoutRevisionMustMatchWhereTheRecordsWouldBeRead) {
  v1::ModelLayout p = SmallLayout();
  p.set_sketch_dim(8);  // 36 + 3 words before the quest part: revision 2 pads one
  p.mutable_features()->set_quest(true);
  for (uint32_t old_revision : {0u, 1u}) {
    p.set_summary_layout(old_revision);
    const absl::Status s = LayoutFromProto(p, 8, 8).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("quest part at word 39"));
    EXPECT_THAT(s.message(), HasSubstr("reads it at word 40"));
  }
  for (uint32_t revision : {2u, 3u}) {  // revision 3 added quest8 and moved nothing
    p.set_summary_layout(revision);
    EXPECT_TRUE(LayoutFromProto(p, 8, 8).ok()) << revision;
  }
  // quest8 is converted, and only a revision that knows the part may ask for it.
  p.mutable_features()->set_quest8(true);
  ASSERT_TRUE(LayoutFromProto(p, 8, 8).ok());
  EXPECT_TRUE(LayoutFromProto(p, 8, 8)->features.quest8);
  p.set_summary_layout(2);
  EXPECT_THAT(LayoutFromProto(p, 8, 8).status().message(), HasSubstr("quest8 needs"));
  p.mutable_features()->set_quest8(false);
  p.set_summary_layout(kSummaryLayoutRevision + 1);
  EXPECT_EQ(LayoutFromProto(p, 8, 8).status().code(), absl::StatusCode::kInvalidArgument);

  // Layouts that did not move: no quest part, or 4·k words before it (m = 1: 1 + 3 + 64).
  p.set_summary_layout(0);
  p.mutable_features()->set_quest(false);
  EXPECT_TRUE(LayoutFromProto(p, 8, 8).ok());
  p.mutable_features()->set_quest(true);
  p.mutable_features()->set_key_sum(true);
  p.set_sketch_dim(1);
  ASSERT_TRUE(LayoutFromProto(p, 8, 8).ok()) << LayoutFromProto(p, 8, 8).status();
  EXPECT_FALSE(LayoutDiffersFromRevision1(*LayoutFromProto(p, 8, 8)));
}

TEST(ConvertTest, OptionsReplaceOnlyTheFieldsTheySet) {
  SelectPolicy base;
  base.alpha = 0.25f;
  base.first_n = 3;
  v1::SelectOptions o;
  o.set_method(v1::METHOD_QUEST);
  o.set_top_pages(7);
  absl::StatusOr<SelectPolicy> p = MergeOptions(base, o);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->method, Method::kQuest);
  EXPECT_EQ(p->top_pages, 7);
  EXPECT_EQ(p->alpha, 0.25f);
  EXPECT_EQ(p->first_n, 3);
}

TEST(ConvertTest, UnknownOptionValuesAreErrorsNamingTheField) {
  v1::SelectOptions o;
  o.set_method(static_cast<v1::Method>(99));
  EXPECT_EQ(MergeOptions(SelectPolicy{}, o).status().message(), "options.method=99 is unknown");
  o.Clear();
  o.set_budget(static_cast<v1::Budget>(42));
  EXPECT_EQ(MergeOptions(SelectPolicy{}, o).status().message(), "options.budget=42 is unknown");
  o.Clear();
  o.set_mass_scope(static_cast<v1::MassScope>(3));
  EXPECT_EQ(MergeOptions(SelectPolicy{}, o).status().message(), "options.mass_scope=3 is unknown");
}

TEST(ConvertTest, EffectiveOptionsRoundTrip) {
  SelectPolicy p;
  p.method = Method::kOnePc;
  p.budget = Budget::kTopP;
  p.top_p = 0.9f;
  p.granularity = Granularity::kPerKvHead;
  absl::StatusOr<SelectPolicy> back = MergeOptions(SelectPolicy{}, ToProto(p));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->method, Method::kOnePc);
  EXPECT_EQ(back->budget, Budget::kTopP);
  EXPECT_EQ(back->top_p, 0.9f);
  EXPECT_EQ(back->granularity, Granularity::kPerKvHead);
}

TEST(ConvertTest, EveryMethodRoundTrips) {
  for (Method m : {Method::kOff, Method::kJl, Method::kOnePc, Method::kFro, Method::kQuest,
                   Method::kQuestClt}) {
    SelectPolicy p;
    p.method = m;
    absl::StatusOr<SelectPolicy> back = MergeOptions(SelectPolicy{}, ToProto(p));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->method, m) << MethodName(m);
  }
}

TEST(ConvertTest, MassBudgetOptionsRoundTrip) {
  SelectPolicy p;
  p.budget = Budget::kMass;
  p.mass_target = 0.8f;
  p.mass_temperature = 0.5f;
  p.min_pages = 3;
  p.max_pages = 40;
  p.mass_scope = MassScope::kList;
  absl::StatusOr<SelectPolicy> back = MergeOptions(SelectPolicy{}, ToProto(p));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->budget, Budget::kMass);
  EXPECT_EQ(back->mass_scope, MassScope::kList);
  EXPECT_EQ(back->mass_target, 0.8f);
  EXPECT_EQ(back->mass_temperature, 0.5f);
  EXPECT_EQ(back->min_pages, 3);
  EXPECT_EQ(back->max_pages, 40);
  // Unset in a request, the scope stays the session's.
  v1::SelectOptions unset;
  EXPECT_EQ(MergeOptions(*back, unset)->mass_scope, MassScope::kList);
}

TEST(ConvertTest, LayoutCoarseBlocksIsTheEnginesWithZeroForNone) {
  v1::ModelLayout p = SmallLayout();
  p.set_group_blocks(2);
  absl::StatusOr<ModelLayout> m = LayoutFromProto(p, 2, 8);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->coarse_blocks, 0);
  EXPECT_FALSE(m->has_coarse_level());
  p.set_coarse_blocks(16);
  m = LayoutFromProto(p, 2, 8);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->coarse_blocks, 16);
  EXPECT_EQ(m->coarse_ratio(), 8);
}

TEST(ConvertTest, LayoutCoarseBlocksErrorsNameTheField) {
  v1::ModelLayout p = SmallLayout();
  p.set_group_blocks(4);
  p.set_coarse_blocks(6);  // not a multiple of group_blocks
  absl::StatusOr<ModelLayout> m = LayoutFromProto(p, 2, 8);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("layout.coarse_blocks=6"));
  p.set_coarse_blocks(4);  // not above group_blocks
  EXPECT_THAT(LayoutFromProto(p, 2, 8).status().message(), HasSubstr("layout.coarse_blocks=4"));
  p.set_coarse_blocks(8192);  // above 4096
  EXPECT_THAT(LayoutFromProto(p, 2, 8).status().message(), HasSubstr("layout.coarse_blocks=8192"));
  p.set_coarse_blocks(3u << 20);
  EXPECT_THAT(LayoutFromProto(p, 2, 8).status().message(),
              HasSubstr("layout.coarse_blocks=3145728 is too large"));
}

TEST(ConvertTest, CoarseCandidatesRoundTripAndUnsetKeepsTheBase) {
  SelectPolicy p;
  p.coarse_candidates = 3.5f;
  absl::StatusOr<SelectPolicy> back = MergeOptions(SelectPolicy{}, ToProto(p));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->coarse_candidates, 3.5f);
  EXPECT_TRUE(ToProto(p).has_coarse_candidates());
  EXPECT_EQ(MergeOptions(*back, v1::SelectOptions{})->coarse_candidates, 3.5f);
}

SelectPolicy TwoLayerMassPolicy() {
  SelectPolicy p;
  p.budget = Budget::kMass;
  p.mass_layers = {{.target = 0.9f, .temperature = 0.5f, .min_pages = 1, .max_pages = 8},
                   {.target = 0.6f, .temperature = 2.0f, .min_pages = 0, .max_pages = 0}};
  return p;
}

TEST(ConvertTest, MassLayersReachThePolicyAndRoundTrip) {
  const SelectPolicy p = TwoLayerMassPolicy();
  const v1::SelectOptions o = ToProto(p);
  ASSERT_EQ(o.mass_layers_size(), 2);
  EXPECT_EQ(o.mass_layers(0).target(), 0.9f);
  EXPECT_EQ(o.mass_layers(0).max_pages(), 8u);
  absl::StatusOr<SelectPolicy> back = MergeOptions(SelectPolicy{}, o);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->mass_layers, p.mass_layers);
  EXPECT_EQ(back->MassFor(1).temperature, 2.0f);
}

TEST(ConvertTest, NoMassLayersEchoAsAnEmptyList) {
  EXPECT_EQ(ToProto(SelectPolicy{}).mass_layers_size(), 0);
}

TEST(ConvertTest, EmptyMassLayersKeepTheBasesAndAListReplacesThemWhole) {
  const SelectPolicy session = TwoLayerMassPolicy();
  // A step that sets other fields leaves the session's per-layer settings alone.
  v1::SelectOptions other;
  other.set_mass_target(0.5f);
  absl::StatusOr<SelectPolicy> kept = MergeOptions(session, other);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->mass_layers, session.mass_layers);
  // A list replaces the session's, every layer of it.
  v1::SelectOptions call;
  for (int layer = 0; layer < 2; ++layer) {
    v1::MassSetting* m = call.add_mass_layers();
    m->set_target(0.99f);
    m->set_temperature(1.0f);
    m->set_min_pages(static_cast<uint32_t>(layer));
  }
  absl::StatusOr<SelectPolicy> replaced = MergeOptions(session, call);
  ASSERT_TRUE(replaced.ok()) << replaced.status();
  const std::vector<MassSetting> want = {{0.99f, 1.0f, 0, 0}, {0.99f, 1.0f, 1, 0}};
  EXPECT_EQ(replaced->mass_layers, want);
}

TEST(ConvertTest, MassLayersOfTheWrongCountOrRangeAreRefusedWithCoresMessage) {
  ModelLayout model;
  model.num_layers = 2;
  SelectPolicy p = TwoLayerMassPolicy();
  v1::SelectOptions one;
  *one.add_mass_layers() = ToProto(p).mass_layers(0);
  absl::StatusOr<SelectPolicy> merged = MergeOptions(p, one);
  ASSERT_TRUE(merged.ok()) << merged.status();
  absl::Status s = merged->Validate(model);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "mass_layers has 1 settings, want one per layer (2) or none");

  v1::SelectOptions bad = ToProto(p);
  bad.mutable_mass_layers(1)->set_min_pages(5);
  bad.mutable_mass_layers(1)->set_max_pages(2);
  // A floor above its ceiling is refused as sent, by MergeOptions, in core's words.
  merged = MergeOptions(SelectPolicy{}, bad);
  EXPECT_EQ(merged.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(merged.status().message(),
            "mass_layers[1].min_pages=5 exceeds mass_layers[1].max_pages=2");
  // An unset target is 0 on the wire, not the policy's: refused, not defaulted.
  bad = ToProto(p);
  bad.mutable_mass_layers(0)->clear_target();
  s = MergeOptions(SelectPolicy{}, bad)->Validate(model);
  EXPECT_EQ(s.message(), "mass_layers[0].target=0 not in (0, 1]");
}

// Counts above 2^30 act as 2^30 (as many groups as there are), but the relation of a floor
// and its ceiling is checked on the values as sent: capped first, min_pages=2^31+5 and
// max_pages=2^31 both read 2^30, and a floor above its ceiling passed.
TEST(ConvertTest, AFloorAboveItsCeilingIsRefusedAsSentNotAsCapped) {
  v1::SelectOptions o;
  o.set_min_pages((1u << 31) + 5);
  o.set_max_pages(1u << 31);
  absl::StatusOr<SelectPolicy> merged = MergeOptions(SelectPolicy{}, o);
  EXPECT_EQ(merged.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(merged.status().message(), "min_pages=2147483653 exceeds max_pages=2147483648");

  v1::SelectOptions layers = ToProto(TwoLayerMassPolicy());
  layers.mutable_mass_layers(1)->set_min_pages(UINT32_MAX);
  layers.mutable_mass_layers(1)->set_max_pages(UINT32_MAX - 1);
  merged = MergeOptions(SelectPolicy{}, layers);
  EXPECT_EQ(merged.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(merged.status().message(),
            "mass_layers[1].min_pages=4294967295 exceeds mass_layers[1].max_pages=4294967294");
}

TEST(ConvertTest, CountsAboveTheCapActAsTheCapWhenTheirRelationHolds) {
  v1::SelectOptions o;
  o.set_first_n(UINT32_MAX);
  o.set_last_n(1u << 31);
  o.set_top_pages((1u << 30) + 1);
  o.set_min_pages(1u << 31);
  o.set_max_pages((1u << 31) + 5);
  v1::MassSetting* layer = o.add_mass_layers();
  layer->set_target(0.9f);
  layer->set_temperature(1.0f);
  layer->set_min_pages(UINT32_MAX);  // no ceiling
  absl::StatusOr<SelectPolicy> merged = MergeOptions(SelectPolicy{}, o);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->first_n, 1 << 30);
  EXPECT_EQ(merged->last_n, 1 << 30);
  EXPECT_EQ(merged->top_pages, 1 << 30);
  EXPECT_EQ(merged->min_pages, 1 << 30);
  EXPECT_EQ(merged->max_pages, 1 << 30);
  EXPECT_EQ(merged->mass_layers[0].min_pages, 1 << 30);
  EXPECT_EQ(merged->mass_layers[0].max_pages, 0);
  // A floor sent alone is checked against the base's ceiling after the cap (Validate).
  SelectPolicy base;
  base.max_pages = 8;
  v1::SelectOptions floor_only;
  floor_only.set_min_pages(1u << 31);
  merged = MergeOptions(base, floor_only);
  ASSERT_TRUE(merged.ok()) << merged.status();
  ModelLayout model;
  model.num_layers = 1;
  EXPECT_EQ(merged->Validate(model).message(), "min_pages=1073741824 exceeds max_pages=8");
}

TEST(ConvertTest, BackendUnspecifiedIsAutoAndUnknownIsAnError) {
  EXPECT_EQ(*BackendFromProto(v1::BACKEND_UNSPECIFIED), BackendKind::kAuto);
  EXPECT_EQ(*BackendFromProto(v1::BACKEND_CUDA), BackendKind::kCuda);
  EXPECT_EQ(ToProto(BackendKind::kCpu), v1::BACKEND_CPU);
  EXPECT_EQ(ToProto(BackendKind::kCuda), v1::BACKEND_CUDA);
  EXPECT_EQ(BackendFromProto(static_cast<v1::Backend>(7)).status().message(),
            "backend=7 is unknown");
}

TEST(ConvertTest, StepStatsCarryTheStepAndPrepassTime) {
  StepStats s;
  s.groups_total = 10;
  s.groups_visited = 4;
  s.blocks_total = 80;
  s.blocks_visited = 32;
  s.summary_bytes_read = 1234;
  v1::StepStats out;
  ToProto(s, 17, 55.5, &out);
  EXPECT_EQ(out.step(), 17u);
  EXPECT_EQ(out.groups_visited(), 4u);
  EXPECT_EQ(out.pages_total(), 80u);
  EXPECT_EQ(out.pages_visited(), 32u);
  EXPECT_EQ(out.bytes_summary_read(), 1234u);
  EXPECT_DOUBLE_EQ(out.prepass_us(), 55.5);
}

TEST(ConvertTest, VisitListsAreReadLayerMajorThenRowThenList) {
  // 2 layers, max_batch 3 (2 rows used), 2 lists per row, max_blocks 4.
  const int layers = 2, lists = 2;
  const int64_t max_batch = 3, max_blocks = 4;
  std::vector<int32_t> blocks(layers * max_batch * lists * max_blocks);
  std::vector<int32_t> counts(layers * max_batch * lists);
  for (size_t i = 0; i < counts.size(); ++i) {
    counts[i] = static_cast<int32_t>(i % 4);
    for (int b = 0; b < max_blocks; ++b)
      blocks[i * max_blocks + b] = static_cast<int32_t>(i * 10 + b);
  }
  const std::vector<StepRow> rows = {{.table_row = 0, .context_tokens = 64},
                                     {.table_row = 1, .context_tokens = 20}};
  v1::SelectPagesResponse response;
  AppendVisitLists({.blocks = blocks.data(),
                    .counts = counts.data(),
                    .num_layers = layers,
                    .max_batch = max_batch,
                    .lists = lists,
                    .max_blocks = max_blocks,
                    .block_size = 16},
                   rows, &response);
  ASSERT_EQ(response.visit_lists_size(), layers * 2 * lists);
  for (const v1::VisitList& v : response.visit_lists()) {
    const int64_t index = (v.layer() * max_batch + v.batch_index()) * lists + v.kv_head();
    ASSERT_EQ(v.blocks_size(), counts[index]);
    for (int b = 0; b < v.blocks_size(); ++b) EXPECT_EQ(v.blocks(b), index * 10 + b);
  }
  // Layer 1, row 1, list 1: index (1*3+1)*2+1 = 9, 1 block.
  const v1::VisitList& last = response.visit_lists(response.visit_lists_size() - 1);
  EXPECT_EQ(last.layer(), 1u);
  EXPECT_EQ(last.batch_index(), 1u);
  EXPECT_EQ(last.kv_head(), 1u);
  EXPECT_EQ(last.blocks_size(), 1);
}

TEST(ConvertTest, VisitListsNeverReadPastTheirRowWhateverTheCount) {
  // One layer, one row, one list of at most 4 blocks, followed in memory by another
  // row's blocks: a count beyond the row or below zero reads only the row's own.
  const int64_t max_blocks = 4;
  std::vector<int32_t> blocks = {1, 2, 3, 4, 50, 60, 70, 80};
  for (const int32_t count : {INT32_MAX, 5, 4, 0, -1, -7, INT32_MIN}) {
    SCOPED_TRACE(count);
    const int32_t counts[2] = {count, 4};
    const std::vector<StepRow> rows = {{.table_row = 0, .context_tokens = 64}};
    v1::SelectPagesResponse response;
    AppendVisitLists({.blocks = blocks.data(),
                      .counts = counts,
                      .num_layers = 1,
                      .max_batch = 2,
                      .lists = 1,
                      .max_blocks = max_blocks,
                      .block_size = 16},
                     rows, &response);
    ASSERT_EQ(response.visit_lists_size(), 1);
    const v1::VisitList& v = response.visit_lists(0);
    const int want = count < 0 ? 0 : std::min<int>(count, max_blocks);
    EXPECT_EQ(std::vector<int32_t>(v.blocks().begin(), v.blocks().end()),
              std::vector<int32_t>(blocks.begin(), blocks.begin() + want));
    EXPECT_LE(v.visited_tokens(), 64);
  }
}

TEST(ConvertTest, RowsKeepTableRowContextAndSeqId) {
  google::protobuf::RepeatedPtrField<v1::BatchRow> rows;
  v1::BatchRow* r = rows.Add();
  r->set_table_row(3);
  r->set_context_tokens(4097);
  r->set_seq_id(77);
  const std::vector<StepRow> out = RowsFromProto(rows);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].table_row, 3);
  EXPECT_EQ(out[0].context_tokens, 4097);
  EXPECT_EQ(out[0].seq_id, 77u);
}

}  // namespace
}  // namespace eps::service
