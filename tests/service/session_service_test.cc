// In-process tests of the session service's steps (no epsd process, no gRPC): steps
// against the core/ reference, the refusals a step can meet, per-layer and per-call
// options, and the lease of a session whose step runs long. Attach's validation and
// admission are in session_attach_test.cc.
#include "service/session_service.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/service/session_service_fixture.h"
#include "tests/service/test_engine.h"

namespace eps::service {
namespace {

using eps::testing::TestEngine;
using ::testing::HasSubstr;

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

// A reply counted in a session's UnsentReplies, which records how the session's end met it.
struct CountedReply final : UnsentReplies::Reply {
  void Resume() override { resumed.fetch_add(1); }
  void Drop() override { dropped.fetch_add(1); }
  void Cancel() override { cancelled.fetch_add(1); }
  std::atomic<int> resumed{0}, dropped{0}, cancelled{0};
};

// The unsent replies of `step`'s session, as the step's done callback gets them; holds
// kMaxUnsentReplies of `replies` there and parks the rest.
std::shared_ptr<UnsentReplies> HoldReplies(SessionService& service,
                                           const v1::SelectPagesRequest& step,
                                           std::vector<CountedReply>& replies,
                                           const Peer& caller = {}) {
  std::shared_ptr<UnsentReplies> unsent;
  absl::Notification done;
  v1::SelectPagesResponse response;
  service.StartSelectPages(step, &response, {}, caller,
                           [&](absl::Status s, BackendKind, std::shared_ptr<UnsentReplies> r) {
                             EXPECT_TRUE(s.ok()) << s;
                             unsent = std::move(r);
                             done.Notify();
                           });
  done.WaitForNotification();
  if (unsent == nullptr) return nullptr;
  for (size_t i = 0; i < replies.size(); ++i) {
    EXPECT_EQ(unsent->TryHold(&replies[i]), i < UnsentReplies::kMaxUnsentReplies
                                                ? UnsentReplies::Hold::kHeld
                                                : UnsentReplies::Hold::kParked);
  }
  return unsent;
}

// What a session's end must have done to the replies HoldReplies counted.
void ExpectEnded(UnsentReplies& unsent, const std::vector<CountedReply>& replies) {
  for (size_t i = 0; i < replies.size(); ++i) {
    const bool held = i < UnsentReplies::kMaxUnsentReplies;
    EXPECT_EQ(replies[i].cancelled.load(), held ? 1 : 0) << i;
    EXPECT_EQ(replies[i].dropped.load(), held ? 0 : 1) << i;
    EXPECT_EQ(replies[i].resumed.load(), 0) << i;
  }
  CountedReply late;
  EXPECT_EQ(unsent.TryHold(&late), UnsentReplies::Hold::kEnded);
}

// A session's replies its client has not read end with it (unsent_replies.h): a client
// that detached or re-attached, over and over, kept every ended session's replies.
TEST_F(SessionServiceTest, DetachAndAReplacingAttachEndTheSessionsUnsentReplies) {
  // A caller of known user: only its sessions are replaced by its next Attach (not TCP's).
  const Peer owner{.known = true, .uid = geteuid(), .pid = getpid()};
  for (const bool detach : {true, false}) {
    SCOPED_TRACE(detach ? "Detach" : "a replacing Attach");
    v1::AttachResponse attached;
    ASSERT_TRUE(service_.Attach(engine_.Attach("engine-a"), &attached, owner).ok());
    const std::string& id = attached.session_id();
    std::vector<CountedReply> replies(UnsentReplies::kMaxUnsentReplies + 2);
    std::shared_ptr<UnsentReplies> unsent = HoldReplies(service_, Step(id, 1), replies, owner);
    ASSERT_NE(unsent, nullptr);
    for (const CountedReply& r : replies) EXPECT_EQ(r.cancelled.load() + r.dropped.load(), 0);
    if (detach) {
      v1::DetachRequest request;
      request.set_session_id(id);
      ASSERT_TRUE(service_.Detach(request, owner).ok());
    } else {
      v1::AttachResponse replacing;
      ASSERT_TRUE(service_.Attach(engine_.Attach("engine-a"), &replacing, owner).ok());
      ASSERT_NE(replacing.session_id(), id);
    }
    ExpectEnded(*unsent, replies);
  }
}

TEST(SessionLeaseTest, AnExpiredSessionsUnsentRepliesEndWithIt) {
  ServerConfig config;
  config.lease_ms = 50;  // the reaper looks every 10 ms
  SessionService service(config);
  TestEngine engine(eps::testing::SmallServiceModel(), 2, 512, 2, eps::testing::TestSeed());
  engine.Fill(0, 0, 300);
  v1::AttachResponse attached;
  ASSERT_TRUE(service.Attach(engine.Attach("engine-a"), &attached).ok());
  std::vector<CountedReply> replies(UnsentReplies::kMaxUnsentReplies + 1);
  std::shared_ptr<UnsentReplies> unsent = HoldReplies(
      service, TestEngine::Step(attached.session_id(), 1, {TestEngine::Row(0, 300)}), replies);
  ASSERT_NE(unsent, nullptr);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (service.session_count() > 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(service.session_count(), 0u);
  ExpectEnded(*unsent, replies);
}

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
