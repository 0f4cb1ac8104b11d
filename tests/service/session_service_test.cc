// In-process tests of the session service (no epsd process, no gRPC): attach
// validation through the buffer contract, steps against the core/ reference,
// and the refusals a step can meet.
#include "service/session_service.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/buffer_contract.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/cuda_backend.h"
#include "tests/core/test_util.h"
#include "tests/service/test_engine.h"

namespace eps::service {
namespace {

using eps::testing::TestEngine;
using ::testing::HasSubstr;

class SessionServiceTest : public ::testing::Test {
 protected:
  SessionServiceTest()
      : seed_(eps::testing::TestSeed()),
        engine_(eps::testing::SmallServiceModel(), /*max_seqs=*/2, /*max_context=*/512,
                /*max_batch=*/2, seed_) {
    engine_.Fill(0, 0, 300);
    engine_.Fill(1, 1, 200);
  }

  std::string Attach(const v1::AttachRequest& request) {
    v1::AttachResponse response;
    const absl::Status s = service_.Attach(request, &response);
    EXPECT_TRUE(s.ok()) << s;
    return response.session_id();
  }

  v1::SelectPagesRequest Step(const std::string& session, uint64_t step) {
    v1::SelectPagesRequest r;
    r.set_session_id(session);
    r.set_step(step);
    for (const v1::BatchRow& row : rows_) *r.add_rows() = row;
    return r;
  }

  uint64_t seed_;
  TestEngine engine_;
  ServerConfig config_;
  SessionService service_{config_};
  const std::vector<v1::BatchRow> rows_ = {TestEngine::Row(0, 300), TestEngine::Row(1, 200)};
};

TEST(BufferContractNamesTest, EveryContractBufferIsASharedBuffersMessageField) {
  for (const BufferSpec& spec : kBufferContract) {
    const google::protobuf::FieldDescriptor* field =
        v1::SharedBuffers::descriptor()->FindFieldByName(spec.name);
    ASSERT_NE(field, nullptr) << spec.name;
    EXPECT_EQ(field->message_type(), v1::MemoryDescriptor::descriptor()) << spec.name;
  }
  EXPECT_EQ(v1::SharedBuffers::descriptor()->field_count(), kSharedBuffers);
}

TEST_F(SessionServiceTest, AStepWritesTheCoreReferenceListsAndReportsTheCpuBackend) {
  SCOPED_TRACE(eps::testing::SeedTrace(seed_));
  v1::AttachResponse attached;
  ASSERT_TRUE(service_.Attach(engine_.Attach("engine-a"), &attached).ok());
  EXPECT_EQ(attached.backend(), v1::BACKEND_CPU);
  v1::SelectPagesResponse response;
  BackendKind backend = BackendKind::kAuto;
  const absl::Status s = service_.SelectPages(Step(attached.session_id(), 1), &response, &backend);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(backend, BackendKind::kCpu);
  EXPECT_TRUE(response.done());
  EXPECT_GT(response.stats().groups_total(), 0u);
  EXPECT_TRUE(engine_.MatchesReference(rows_));
  EXPECT_EQ(engine_.buffers().selection_done(), 1u);
}

TEST_F(SessionServiceTest, AReplayedStepIsRefusedAndCountedAsAnError) {
  const std::string id = Attach(engine_.Attach("engine-a"));
  v1::SelectPagesResponse response;
  ASSERT_TRUE(service_.SelectPages(Step(id, 5), &response).ok());
  const absl::Status replay = service_.SelectPages(Step(id, 5), &response);
  EXPECT_EQ(replay.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(replay.message(), "step 5 is not after the session's last step 5");
  v1::GetStatsResponse stats;
  ASSERT_TRUE(service_.GetStats(v1::GetStatsRequest(), &stats).ok());
  ASSERT_EQ(stats.sessions_size(), 1);
  EXPECT_EQ(stats.sessions(0).steps(), 1u);
  EXPECT_EQ(stats.sessions(0).errors(), 1u);
  EXPECT_EQ(stats.validation_failures_total(), 1u);
}

TEST_F(SessionServiceTest, AsyncRepliesOnTheCpuBackendAreUnimplemented) {
  const std::string id = Attach(engine_.Attach("engine-a"));
  v1::SelectPagesRequest request = Step(id, 1);
  request.set_reply_mode(v1::REPLY_MODE_ASYNC);
  v1::SelectPagesResponse response;
  const absl::Status s = service_.SelectPages(request, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr("the cpu backend answers sync"));
}

TEST_F(SessionServiceTest, AnUnknownSessionIsNotFound) {
  v1::SelectPagesResponse response;
  EXPECT_EQ(service_.SelectPages(Step("s-none", 1), &response).code(), absl::StatusCode::kNotFound);
}

TEST_F(SessionServiceTest, ABlockTableOfOtherRowsNamesTheGroupTable) {
  v1::AttachRequest request = engine_.Attach("engine-a");
  request.mutable_buffers()->mutable_block_table()->set_shape(0, 1);
  v1::AttachResponse response;
  EXPECT_EQ(service_.Attach(request, &response).message(),
            "block_table.shape[0]=1 does not match group_table.shape[0]=2");
}

TEST_F(SessionServiceTest, VisitListsWiderThanTheBlockTableNameIt) {
  v1::AttachRequest request = engine_.Attach("engine-a");
  v1::MemoryDescriptor* visit = request.mutable_buffers()->mutable_visit_blocks();
  visit->set_shape(2, visit->shape(2) + 1);
  v1::AttachResponse response;
  EXPECT_THAT(service_.Attach(request, &response).message(),
              HasSubstr("visit_blocks.shape[2]=" + std::to_string(visit->shape(2)) +
                        " does not match block_table.shape[1]="));
}

TEST_F(SessionServiceTest, InlineOutputsComeBackInTheReply) {
  SCOPED_TRACE(eps::testing::SeedTrace(seed_));
  v1::AttachRequest request = engine_.Attach("engine-a");
  for (v1::MemoryDescriptor* d : {request.mutable_buffers()->mutable_visit_blocks(),
                                  request.mutable_buffers()->mutable_visit_count()}) {
    d->mutable_inline_bytes()->set_data("");
    d->set_offset(0);
  }
  request.mutable_buffers()->clear_flags();
  const std::string id = Attach(request);
  v1::SelectPagesResponse response;
  ASSERT_TRUE(service_.SelectPages(Step(id, 1), &response).ok());
  const int layers = engine_.model().num_layers;
  ASSERT_EQ(response.visit_lists_size(), layers * 2);
  // The same step over the shared outputs of a second session gives the same lists.
  const std::string shared = Attach(engine_.Attach("engine-b"));
  v1::SelectPagesResponse ignored;
  ASSERT_TRUE(service_.SelectPages(Step(shared, 1), &ignored).ok());
  for (const v1::VisitList& v : response.visit_lists()) {
    const auto want = engine_.buffers().VisitBlocks(v.layer(), v.batch_index(), 0);
    EXPECT_EQ(std::vector<int32_t>(v.blocks().begin(), v.blocks().end()),
              std::vector<int32_t>(want.begin(), want.end()))
        << "layer " << v.layer() << " row " << v.batch_index();
  }
}

// Per-layer mass settings far apart (layer 0 keeps at most one unforced group per head,
// layer 1 nearly all its mass), so that lists from one shared setting would differ.
SelectPolicy PerLayerMassPolicy() {
  SelectPolicy p;
  p.budget = Budget::kMass;
  p.mass_layers = {{.target = 0.5f, .temperature = 1.0f, .min_pages = 0, .max_pages = 1},
                   {.target = 0.99f, .temperature = 2.0f, .min_pages = 2, .max_pages = 0}};
  return p;
}

void SetMassOptions(const SelectPolicy& p, v1::SelectOptions* o) {
  o->set_budget(v1::BUDGET_MASS);
  for (const MassSetting& m : p.mass_layers) {
    v1::MassSetting* out = o->add_mass_layers();
    out->set_target(m.target);
    out->set_temperature(m.temperature);
    out->set_min_pages(static_cast<uint32_t>(m.min_pages));
    out->set_max_pages(static_cast<uint32_t>(m.max_pages));
  }
}

TEST_F(SessionServiceTest, AStepWithPerLayerMassSettingsSelectsAsCoreWithTheSame) {
  SCOPED_TRACE(eps::testing::SeedTrace(seed_));
  const SelectPolicy policy = PerLayerMassPolicy();
  v1::AttachRequest request = engine_.Attach("engine-a");
  request.set_backend(v1::BACKEND_CPU);
  SetMassOptions(policy, request.mutable_options());
  v1::AttachResponse attached;
  const absl::Status a = service_.Attach(request, &attached);
  ASSERT_TRUE(a.ok()) << a;
  ASSERT_EQ(attached.effective_options().mass_layers_size(), 2);
  EXPECT_EQ(attached.effective_options().mass_layers(1).target(), 0.99f);
  v1::SelectPagesResponse response;
  const absl::Status s = service_.SelectPages(Step(attached.session_id(), 1), &response);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(engine_.MatchesReference(rows_, policy));
  SelectPolicy shared = policy;
  shared.mass_layers.clear();
  EXPECT_FALSE(engine_.MatchesReference(rows_, shared)) << "the settings made no difference";
}

TEST_F(SessionServiceTest, PerLayerMassSettingsOfTheWrongCountOrRangeRefuseTheAttach) {
  v1::AttachRequest request = engine_.Attach("engine-a");
  request.set_backend(v1::BACKEND_CPU);
  SetMassOptions(PerLayerMassPolicy(), request.mutable_options());
  request.mutable_options()->mutable_mass_layers()->RemoveLast();
  v1::AttachResponse response;
  absl::Status s = service_.Attach(request, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "mass_layers has 1 settings, want one per layer (2) or none");

  request = engine_.Attach("engine-a");
  request.set_backend(v1::BACKEND_CPU);
  SetMassOptions(PerLayerMassPolicy(), request.mutable_options());
  request.mutable_options()->mutable_mass_layers(1)->set_min_pages(5);
  request.mutable_options()->mutable_mass_layers(1)->set_max_pages(2);
  s = service_.Attach(request, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "mass_layers[1].min_pages=5 exceeds mass_layers[1].max_pages=2");
}

TEST_F(SessionServiceTest, PerCallMassLayersReplaceTheSessionsForThatCallOnly) {
  SCOPED_TRACE(eps::testing::SeedTrace(seed_));
  const SelectPolicy session = PerLayerMassPolicy();
  v1::AttachRequest request = engine_.Attach("engine-a");
  request.set_backend(v1::BACKEND_CPU);
  SetMassOptions(session, request.mutable_options());
  const std::string id = Attach(request);
  v1::SelectPagesResponse response;

  // Options that leave mass_layers empty keep the session's.
  v1::SelectPagesRequest keep = Step(id, 1);
  keep.mutable_options()->set_first_n(1);
  ASSERT_TRUE(service_.SelectPages(keep, &response).ok());
  SelectPolicy kept = session;
  kept.first_n = 1;
  EXPECT_TRUE(engine_.MatchesReference(rows_, kept));

  // A list replaces them for that call.
  SelectPolicy swapped = session;
  std::swap(swapped.mass_layers[0], swapped.mass_layers[1]);
  v1::SelectPagesRequest over = Step(id, 2);
  SetMassOptions(swapped, over.mutable_options());
  ASSERT_TRUE(service_.SelectPages(over, &response).ok());
  EXPECT_TRUE(engine_.MatchesReference(rows_, swapped));
  EXPECT_FALSE(engine_.MatchesReference(rows_, session)) << "the override made no difference";

  // A bad list fails that call with core's message; the next step selects as the session.
  v1::SelectPagesRequest bad = Step(id, 3);
  SetMassOptions(swapped, bad.mutable_options());
  bad.mutable_options()->mutable_mass_layers(0)->set_target(1.5f);
  const absl::Status s = service_.SelectPages(bad, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("mass_layers[0].target=1.5 not in (0, 1]"));
  ASSERT_TRUE(service_.SelectPages(Step(id, 4), &response).ok());
  EXPECT_TRUE(engine_.MatchesReference(rows_, session));
}

TEST_F(SessionServiceTest, ACpuSessionNamingACudaDeviceIsInvalidArgument) {
  v1::AttachRequest by_ordinal = engine_.Attach("engine-a");
  by_ordinal.set_device(3);
  v1::AttachResponse response;
  absl::Status s = service_.Attach(by_ordinal, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("device=3 names a CUDA device"));

  v1::AttachRequest by_uuid = engine_.Attach("engine-b");
  by_uuid.set_device_uuid(std::string(16, '\x01'));
  s = service_.Attach(by_uuid, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("device_uuid"));
  EXPECT_EQ(service_.session_count(), 0u);
}

// Checked before epsd looks for a device, so these hold with or without one.
TEST_F(SessionServiceTest, ACudaSessionNamesOneDeviceForAllItsBuffers) {
  v1::AttachRequest split = engine_.Attach("engine-a");
  split.set_backend(v1::BACKEND_CUDA);
  split.mutable_buffers()->mutable_summary_pool()->mutable_cuda_ipc()->set_device(0);
  split.mutable_buffers()->mutable_queries()->mutable_cuda_ipc()->set_device(1);
  v1::AttachResponse response;
  absl::Status s = service_.Attach(split, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("buffers.queries.cuda_ipc.device=1 differs from the "
                                     "session's device 0"));

  v1::AttachRequest disagree = engine_.Attach("engine-b");
  disagree.set_backend(v1::BACKEND_CUDA);
  disagree.set_device(2);
  disagree.mutable_buffers()->mutable_summary_pool()->mutable_cuda_ipc()->set_device(1);
  s = service_.Attach(disagree, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(),
              HasSubstr("device=2 differs from buffers.summary_pool.cuda_ipc.device=1"));

  v1::AttachRequest negative = engine_.Attach("engine-c");
  negative.set_backend(v1::BACKEND_CUDA);
  negative.set_device(-1);
  s = service_.Attach(negative, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("device=-1 is negative"));

  v1::AttachRequest short_uuid = engine_.Attach("engine-d");
  short_uuid.set_backend(v1::BACKEND_CUDA);
  short_uuid.set_device_uuid("abcd");
  s = service_.Attach(short_uuid, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("device_uuid has 4 bytes, want 16"));
  EXPECT_EQ(service_.session_count(), 0u);
}

TEST_F(SessionServiceTest, CudaWithoutADeviceIsAFailedPrecondition) {
  if (CudaBackendBuilt() && CudaDevicePresent()) GTEST_SKIP() << "a CUDA device is present";
  v1::AttachRequest request = engine_.Attach("engine-a");
  request.set_backend(v1::BACKEND_CUDA);
  v1::AttachResponse response;
  const absl::Status s = service_.Attach(request, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("backend BACKEND_CUDA is not available"));
}

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
    v1::SelectPagesRequest r;
    r.set_session_id(session);
    r.set_step(step);
    for (const v1::BatchRow& row : rows_) *r.add_rows() = row;
    return r;
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

// A session with the selection-feedback buffer (docs/api.md), flat or with a coarse
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
    v1::SelectPagesRequest r;
    r.set_session_id(session);
    r.set_step(step);
    for (const v1::BatchRow& row : rows_) *r.add_rows() = row;
    return r;
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

  v1::AttachRequest dtype = Attach("engine-e");
  dtype.mutable_buffers()->mutable_feedback()->set_dtype(v1::DTYPE_INT32);
  s = service_.Attach(dtype, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("feedback.dtype=DTYPE_INT32"));
  EXPECT_EQ(service_.session_count(), 0u);
}

INSTANTIATE_TEST_SUITE_P(FlatAndCoarse, FeedbackSessionServiceTest, ::testing::Values(0, 1),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return info.param == 0 ? std::string("Flat") : std::string("Coarse");
                         });

}  // namespace
}  // namespace eps::service
