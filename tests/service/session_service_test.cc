// In-process tests of the session service (no epsd process, no gRPC): attach
// validation through the buffer contract, steps against the core/ reference,
// and the refusals a step can meet.
#include "service/session_service.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "core/buffer_contract.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/cuda_backend.h"
#include "tests/core/test_util.h"
#include "tests/fuzz/fuzz_session.h"
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
    return TestEngine::Step(session, step, rows_);
  }

  uint64_t seed_;
  TestEngine engine_;
  ServerConfig config_;
  SessionService service_{config_};
  const std::vector<v1::BatchRow> rows_ = {TestEngine::Row(0, 300), TestEngine::Row(1, 200)};
};

// The visit lists and counts inline (the lists then come back in each reply), no flags.
void InlineOutputs(v1::AttachRequest& request) {
  for (v1::MemoryDescriptor* d : {request.mutable_buffers()->mutable_visit_blocks(),
                                  request.mutable_buffers()->mutable_visit_count()}) {
    d->mutable_inline_bytes()->set_data("");
    d->set_offset(0);
  }
  request.mutable_buffers()->clear_flags();
}

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

// GetStats' validation_failures_total counts every failed call (observability.md), failed
// GetStats calls too, as eps_validation_failures_total does: it once left them out, so the
// field counted fewer failures than the metric.
TEST_F(SessionServiceTest, AFailedGetStatsCountsInValidationFailuresTotal) {
  const Peer owner{.known = true, .uid = geteuid(), .pid = getpid()};  // may open the shm
  const Peer other{.known = true, .uid = geteuid() + 1, .pid = 1};
  v1::AttachResponse attached;
  ASSERT_TRUE(service_.Attach(engine_.Attach("engine-a"), &attached, owner).ok());
  v1::GetStatsRequest unknown, not_theirs;
  unknown.set_session_id("s-none");
  not_theirs.set_session_id(attached.session_id());
  v1::GetStatsResponse stats;
  EXPECT_EQ(service_.GetStats(unknown, &stats, owner).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(service_.GetStats(not_theirs, &stats, other).code(),
            absl::StatusCode::kPermissionDenied);
  stats.Clear();
  ASSERT_TRUE(service_.GetStats(v1::GetStatsRequest(), &stats, owner).ok());
  EXPECT_EQ(stats.validation_failures_total(), 2u);
}

// A call's options are checked before its step order and its writes (api-failures.md §4):
// an alpha below 1 with a stale step number was FAILED_PRECONDITION (the step order came
// first), and with writes the refused call's writes stayed applied.
TEST_F(SessionServiceTest, BadCallOptionsAreRefusedBeforeTheStepOrderAndTheWrites) {
  const std::string id = Attach(engine_.Attach("engine-a"));
  v1::SelectPagesResponse response;
  ASSERT_TRUE(service_.SelectPages(Step(id, 5), &response).ok());
  v1::SelectPagesRequest stale = Step(id, 3);
  stale.mutable_options()->set_alpha(0.5f);
  const absl::Status s = service_.SelectPages(stale, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("alpha=0.5"));
  v1::SelectPagesRequest mass = Step(id, 6);
  mass.mutable_options()->set_budget(v1::BUDGET_MASS);
  mass.mutable_options()->set_mass_target(2.0f);  // beyond (0, 1]
  EXPECT_EQ(service_.SelectPages(mass, &response).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(service_.SelectPages(Step(id, 6), &response).ok());  // step 6 is still free
  EXPECT_TRUE(engine_.MatchesReference(rows_));
}

// A cpu step whose client gives up while it runs stops between its (row, layer)s: it once
// ran to the end, holding a callback thread other engines' calls (heartbeats included)
// waited for. The call fails CANCELLED, the outputs stay as they were, nothing is counted,
// and the step number stays free.
TEST_F(SessionServiceTest, AStepWhoseClientGivesUpWhileItRunsStopsAndLeavesTheOutputs) {
  const std::string id = Attach(engine_.Attach("engine-a"));
  v1::SelectPagesResponse response;
  ASSERT_TRUE(service_.SelectPages(Step(id, 1), &response).ok());
  std::atomic<int> checks{0};
  CallLiveness liveness;
  // Alive when the call arrives and when it takes the step lock, gone from the first
  // (row, layer) on.
  liveness.cancelled = [&checks] { return ++checks > 2; };
  const absl::Status s = service_.SelectPages(Step(id, 2), &response, nullptr, liveness);
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  // Stopped at its first (row, layer), not after all of them; the fourth check is the
  // one that finds the failed step's caller gone (so nothing is counted).
  EXPECT_EQ(checks.load(), 4);
  EXPECT_EQ(engine_.buffers().selection_done(), 1u);
  v1::GetStatsResponse stats;
  ASSERT_TRUE(service_.GetStats(v1::GetStatsRequest(), &stats).ok());
  EXPECT_EQ(stats.sessions(0).errors(), 0u);
  EXPECT_EQ(stats.validation_failures_total(), 0u);
  ASSERT_TRUE(service_.SelectPages(Step(id, 2), &response).ok());  // step 2 is still free
  EXPECT_TRUE(engine_.MatchesReference(rows_));
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

// The caller's id was once quoted whole: with an 8 MB id every NOT_FOUND carried 8 MB on
// into traces and the step log. The message names the session by its label: bounded, and
// without the capability part of an id of ours.
TEST_F(SessionServiceTest, ANotFoundMessageNamesTheSessionByItsBoundedLabel) {
  const std::string huge(1 << 20, 'x');
  v1::SelectPagesResponse selected;
  const absl::Status step = service_.SelectPages(Step(huge, 1), &selected);
  v1::DetachRequest detach;
  detach.set_session_id(huge);
  v1::GetStatsRequest stats_request;
  stats_request.set_session_id(huge);
  v1::GetStatsResponse stats;
  v1::HeartbeatRequest heartbeat_request;
  heartbeat_request.set_session_id(huge);
  v1::HeartbeatResponse heartbeat;
  for (const absl::Status& s :
       {step, service_.Detach(detach), service_.GetStats(stats_request, &stats),
        service_.Heartbeat(heartbeat_request, &heartbeat)}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s.message().substr(0, 200);
    EXPECT_LE(s.message().size(), 200u);
  }
  const std::string ours = "s-9-" + std::string(32, 'f');
  const absl::Status gone = service_.SelectPages(Step(ours, 1), &selected);
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(gone.message(), HasSubstr("session 's-9' not found"));
  EXPECT_THAT(gone.message(), ::testing::Not(HasSubstr(std::string(32, 'f'))));
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

TEST_F(SessionServiceTest, MaxSessionsRefusesANewEngineUntilOneDetaches) {
  ServerConfig two = config_;
  two.max_sessions = 2;
  SessionService service(two);
  v1::AttachResponse response;
  ASSERT_TRUE(service.Attach(engine_.Attach("engine-a"), &response).ok());
  ASSERT_TRUE(service.Attach(engine_.Attach("engine-b"), &response).ok());
  const std::string b_id = response.session_id();
  const absl::Status third = service.Attach(engine_.Attach("engine-c"), &response);
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.message(), HasSubstr("--max-sessions=2"));
  // Freed by a Detach, the place takes a new engine.
  v1::DetachRequest detach;
  detach.set_session_id(b_id);
  ASSERT_TRUE(service.Detach(detach).ok());
  EXPECT_TRUE(service.Attach(engine_.Attach("engine-c"), &response).ok());
}

TEST_F(SessionServiceTest, InlineListsNeedInlineCounts) {
  // Inline lists come back in the reply, as many blocks as visit_count says: counts in
  // memory the engine shares (and can rewrite) beside inline lists are refused, and the
  // other way round too.
  for (const bool inline_blocks : {true, false}) {
    SCOPED_TRACE(inline_blocks);
    v1::AttachRequest request = engine_.Attach("engine-a");
    v1::MemoryDescriptor* d = inline_blocks ? request.mutable_buffers()->mutable_visit_blocks()
                                            : request.mutable_buffers()->mutable_visit_count();
    d->mutable_inline_bytes()->set_data("");
    d->set_offset(0);
    request.mutable_buffers()->clear_flags();
    v1::AttachResponse response;
    const absl::Status s = service_.Attach(request, &response);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("visit_blocks and visit_count must both be inline_bytes"));
  }
}

TEST_F(SessionServiceTest, InlineListsThatCouldOutgrowAReplyAreRefusedAtAttach) {
  // The bound (session_buffers.h): every list at max_blocks ids of 5 bytes, 41 bytes of
  // fields a list, 1,024 for the reply's own. At the bound the session attaches and its
  // replies fit; one byte below, Attach names the flag (before, each step ran, then
  // failed to send, and used up its step number).
  v1::AttachRequest request = engine_.Attach("engine-a");
  InlineOutputs(request);
  request.mutable_options()->set_method(v1::METHOD_OFF);  // every block: the longest lists
  const v1::MemoryDescriptor& blocks = request.buffers().visit_blocks();
  ASSERT_EQ(blocks.shape_size(), 3);  // [layers, max_batch, max_blocks]: union lists
  const int64_t bound = blocks.shape(0) * blocks.shape(1) * (41 + 5 * blocks.shape(2)) + 1024;
  ServerConfig at = config_;
  at.max_message_bytes = static_cast<uint32_t>(bound);
  SessionService fits(at);
  v1::AttachResponse attached;
  ASSERT_TRUE(fits.Attach(request, &attached).ok());
  v1::SelectPagesResponse reply;
  ASSERT_TRUE(fits.SelectPages(Step(attached.session_id(), 1), &reply).ok());
  ASSERT_GT(reply.visit_lists_size(), 0);
  EXPECT_GT(reply.visit_lists(0).blocks_size(), 0);
  EXPECT_LE(static_cast<int64_t>(reply.ByteSizeLong()), bound);
  ServerConfig below = config_;
  below.max_message_bytes = static_cast<uint32_t>(bound - 1);
  SessionService refuses(below);
  v1::AttachResponse refused;
  const absl::Status s = refuses.Attach(request, &refused);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("more than --max-message-bytes=" + std::to_string(bound - 1)));
}

TEST_F(SessionServiceTest, InlineOutputsComeBackInTheReply) {
  SCOPED_TRACE(eps::testing::SeedTrace(seed_));
  v1::AttachRequest request = engine_.Attach("engine-a");
  InlineOutputs(request);
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

}  // namespace
}  // namespace eps::service

namespace eps::service {
namespace {

// A step longer than the lease neither loses its session under it nor holds up the reaper:
// the reaper took such a session, then waited on its step lock while every other lease ran
// out unchecked (a 4 s step kept an idle session with a 200 ms lease registered, so
// --max-sessions refused a third engine).
TEST(SessionLeaseTest, ASessionWhoseStepRunsPastItsLeaseIsNotExpiredUntilTheStepEnds) {
  ServerConfig config;
  config.lease_ms = 50;  // the reaper looks every 10 ms
  SessionService service(config);
  TestEngine engine(eps::testing::SmallServiceModel(), 2, 512, 2, eps::testing::TestSeed());
  v1::AttachResponse busy_attached, idle_attached;
  ASSERT_TRUE(service.Attach(engine.Attach("engine-busy"), &busy_attached).ok());
  ASSERT_TRUE(service.Attach(engine.Attach("engine-idle"), &idle_attached).ok());
  std::shared_ptr<Session> busy = service.session_for_test(busy_attached.session_id());
  {
    absl::MutexLock running(&busy->backend().step_mu());  // a step of it runs for 400 ms
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    // The idle one expired meanwhile; the running one did not.
    EXPECT_EQ(service.session_for_test(idle_attached.session_id()), nullptr);
    EXPECT_NE(service.session_for_test(busy_attached.session_id()), nullptr);
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (service.session_count() > 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(service.session_count(), 0u);  // once its step ended and its lease ran out
}

}  // namespace
}  // namespace eps::service

namespace eps::service {
namespace {

// A replacing Attach builds its session in the bytes of the session it replaces, which
// that one gives back once the Attach has retired it: an engine that restarts re-attaches
// at once with the server's budgets nearly full, not only after its old lease ran out,
// and the budgets still bound the server once the hand-over is done.
TEST(SessionBudgetTest, AnEngineReattachesAtOnceWhenTheServerBudgetsHoldOnlyItsSession) {
  const Peer user{.known = true, .uid = geteuid(), .pid = getpid()};
  TestEngine engine(eps::testing::SmallServiceModel(), /*max_seqs=*/2, /*max_context=*/512,
                    /*max_batch=*/2, eps::testing::TestSeed());
  uint64_t allocated = 0, mapped = 0;  // one session's charges
  {
    SessionService probe{ServerConfig{}};
    v1::AttachResponse attached;
    ASSERT_TRUE(probe.Attach(engine.Attach("engine-a"), &attached, user).ok());
    allocated = probe.charged_bytes();
    mapped = probe.mapped_bytes();
  }
  ASSERT_GT(allocated, 0u);
  ASSERT_GT(mapped, 0u);
  for (const bool bound_mapped : {false, true}) {
    const char* flag = bound_mapped ? "--max-server-mapped-bytes" : "--max-server-bytes";
    SCOPED_TRACE(flag);
    ServerConfig config;
    // Room for one session and half of another.
    if (bound_mapped) {
      config.max_server_mapped_bytes = mapped + mapped / 2;
    } else {
      config.max_server_bytes = allocated + allocated / 2;
    }
    SessionService service(config);
    v1::AttachResponse first, second, third, other;
    ASSERT_TRUE(service.Attach(engine.Attach("engine-a"), &first, user).ok());
    const absl::Status again = service.Attach(engine.Attach("engine-a"), &second, user);
    ASSERT_TRUE(again.ok()) << again;
    EXPECT_NE(second.session_id(), first.session_id());
    // The old session gave its bytes back: one session's charges are held.
    EXPECT_EQ(service.charged_bytes(), allocated);
    EXPECT_EQ(service.mapped_bytes(), mapped);
    // Another engine gets no such room.
    const absl::Status b = service.Attach(engine.Attach("engine-b"), &other, user);
    EXPECT_EQ(b.code(), absl::StatusCode::kResourceExhausted) << b;
    EXPECT_THAT(b.message(), HasSubstr(flag));
    EXPECT_EQ(service.charged_bytes(), allocated);
    ASSERT_TRUE(service.Attach(engine.Attach("engine-a"), &third, user).ok());
    EXPECT_EQ(service.session_count(), 1u);
  }
}

// Over TCP an Attach naming a live session's engine_id is refused (ALREADY_EXISTS). It
// was refused only when it published, after it had built a whole session in the live
// one's bytes (the replacing Attach's allowance): a loop of such calls kept the server's
// budget over its limit, and another engine's Attach that fitted was refused
// RESOURCE_EXHAUSTED (6107 of 6140 tries). The refused call now builds nothing.
TEST(SessionBudgetTest, AnAttachRefusedOverTcpBuildsNothingSoAnotherEngineStillFits) {
  const Peer tcp;          // a caller of unknown credentials
  uint64_t allocated = 0;  // one session's charges
  {
    SessionService probe{fuzz::FuzzConfig()};
    v1::AttachResponse attached;
    ASSERT_TRUE(probe.Attach(fuzz::SmallInlineAttach("engine-a"), &attached, tcp).ok());
    allocated = probe.charged_bytes();
  }
  ASSERT_GT(allocated, 0u);
  ServerConfig config = fuzz::FuzzConfig();
  config.max_server_bytes = 2 * allocated + allocated / 2;  // two sessions, not three
  // The second build of engine-a (the refused Attach, if it builds) holds its charges
  // until the test has attached engine-b; 10 s at most, should nothing release it.
  std::atomic<int> builds_of_a{0};
  absl::Notification second_build_of_a, release;
  BackendFactory make_backend = [&](const SessionSpec& spec, const SessionBuffers& buffers,
                                    const ServerConfig& server,
                                    std::unique_ptr<StepBackend>* remains) {
    if (spec.engine_id == "engine-a" && builds_of_a.fetch_add(1) == 1) {
      second_build_of_a.Notify();
      release.WaitForNotificationWithTimeout(absl::Seconds(10));
    }
    return MakeSessionBackend(spec, buffers, server, remains);
  };
  SessionService service(config, nullptr, make_backend);
  v1::AttachResponse owner, taken, other;
  ASSERT_TRUE(service.Attach(fuzz::SmallInlineAttach("engine-a"), &owner, tcp).ok());
  absl::Status refused;
  absl::Notification refused_done;
  std::thread attacker([&] {
    refused = service.Attach(fuzz::SmallInlineAttach("engine-a"), &taken, tcp);
    refused_done.Notify();
  });
  while (!refused_done.HasBeenNotified() && !second_build_of_a.HasBeenNotified()) {
    std::this_thread::yield();
  }
  const absl::Status fits = service.Attach(fuzz::SmallInlineAttach("engine-b"), &other, tcp);
  release.Notify();
  attacker.join();
  EXPECT_EQ(refused.code(), absl::StatusCode::kAlreadyExists) << refused;
  EXPECT_TRUE(fits.ok()) << fits;
  EXPECT_EQ(builds_of_a.load(), 1);  // the refused Attach built nothing
  EXPECT_EQ(service.charged_bytes(), 2 * allocated);
}
}  // namespace
}  // namespace eps::service
