// Attaches that race their own engine, the engine's live session or the server's limits
// while their sessions are built on the StepExecutor (service/session_service.h,
// StartAttach; service/session_registry.h, BeginBuild): a call that gives up during its
// build leaves the engine's session alone; one Attach of an engine builds at a time; the
// builds in flight count against --max-sessions and --max-sessions-per-user; a session
// built in the allowance of one that ended meanwhile leaves the server within
// --max-server-bytes, and is published when it fits beside another engine's replacement;
// and an Attach that fails after publishing takes its session back.
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "service/cpu_backend.h"
#include "service/session_service.h"
#include "tests/core/test_util.h"
#include "tests/service/forwarding_backend.h"
#include "tests/service/long_calls.h"
#include "tests/service/session_service_fixture.h"
#include "tests/service/slow_builds.h"
#include "tests/service/test_engine.h"

namespace eps::service {
namespace {

using eps::testing::TestEngine;

// Holds, once `armed`, each build of engine "a" and of engine "b" until that engine's
// release, counting it as started when it begins: after its charges are made.
struct EngineGates {
  std::atomic<bool> armed{false};
  held::LongCalls a, b;
};

BackendFactory GatedBuilds(EngineGates* gates) {
  return [gates](const SessionSpec& spec, const SessionBuffers&, const ServerConfig&,
                 std::unique_ptr<StepBackend>*) -> absl::StatusOr<std::unique_ptr<StepBackend>> {
    ASSIGN_OR_RETURN(std::unique_ptr<StepBackend> cpu, MakeCpuBackend(spec.model));
    if (!gates->armed.load()) return cpu;
    held::LongCalls* gate = spec.engine_id == "a"   ? &gates->a
                            : spec.engine_id == "b" ? &gates->b
                                                    : nullptr;
    if (gate == nullptr) return cpu;
    gate->Started();
    gate->release.WaitForNotification();
    return cpu;
  };
}

// An Attach started without waiting: its answer, once `done` is notified.
struct Answer {
  absl::Notification done;
  absl::Status status;
  v1::AttachResponse response;
};

void Start(SessionService& service, const v1::AttachRequest& request, const Peer& caller,
           Answer* answer, CallLiveness liveness = {}) {
  service.StartAttach(request, &answer->response, std::move(liveness), caller,
                      [answer](absl::Status s) {
                        answer->status = std::move(s);
                        answer->done.Notify();
                      });
}

// The test's own user: the engine's shm objects are its.
const Peer kUser{.known = true, .uid = geteuid(), .pid = getpid()};

// The test's engine: a small model, one sequence of 300 tokens.
class AttachRacesTest : public ::testing::Test {
 protected:
  AttachRacesTest()
      : engine_(eps::testing::SmallServiceModel(), /*max_seqs=*/1, /*max_context=*/512,
                /*max_batch=*/1, eps::testing::TestSeed()) {
    engine_.Fill(0, 0, 300);
  }

  TestEngine engine_;
};

// api.md's Attach row: "A failed Attach leaves an existing session of that engine_id in
// place". One whose client gave up during the build published its session all the same,
// replacing (retiring) the live one, and only then found its call dead and removed it.
TEST_F(AttachRacesTest, AnAttachWhoseClientGivesUpDuringItsBuildLeavesTheLiveSession) {
  std::atomic<int> built{0};
  held::LongCalls held;
  SessionService service(
      ServerConfig(), nullptr,
      [&](const SessionSpec& spec, const SessionBuffers&, const ServerConfig&,
          std::unique_ptr<StepBackend>*) -> absl::StatusOr<std::unique_ptr<StepBackend>> {
        if (built.fetch_add(1) > 0) {  // every build after the first waits for the test
          held.Started();
          held.release.WaitForNotification();
        }
        return MakeCpuBackend(spec.model);
      });
  v1::AttachResponse live;
  ASSERT_TRUE(service.Attach(engine_.Attach("e"), &live, kUser).ok());
  std::atomic<bool> gave_up{false};
  Answer second;
  const v1::AttachRequest request = engine_.Attach("e");
  Start(service, request, kUser, &second, {.cancelled = [&gave_up] { return gave_up.load(); }});
  ASSERT_TRUE(held.AwaitStarted(1));
  gave_up.store(true);  // the client gives up while the session is built
  held.release.Notify();
  second.done.WaitForNotification();
  EXPECT_TRUE(absl::IsCancelled(second.status)) << second.status;
  EXPECT_NE(service.session_for_test(live.session_id()), nullptr)
      << "the failed Attach ended the engine's live session";
  EXPECT_EQ(service.session_count(), 1u);
  EXPECT_EQ(service.charged_bytes(), service.session_for_test(live.session_id())->charged_bytes());
}

// A client whose Attach outlived its deadline retries while the first build still runs:
// the retry waits behind it (one build per engine), and the dead first call, which ends
// first, must not publish over the retry's session.
TEST_F(AttachRacesTest, ARetryWhileTheAbandonedAttachStillBuildsGetsTheEnginesSession) {
  held::LongCalls builds;
  SessionService service(ServerConfig(), nullptr, SlowBuilds(&builds));
  const v1::AttachRequest request = engine_.Attach("slow-e");
  std::atomic<bool> gave_up{false};
  Answer first, retry;
  Start(service, request, kUser, &first, {.cancelled = [&gave_up] { return gave_up.load(); }});
  ASSERT_TRUE(builds.AwaitStarted(1));
  gave_up.store(true);
  Start(service, request, kUser, &retry);
  EXPECT_FALSE(retry.done.HasBeenNotified());  // parked behind the first build
  EXPECT_EQ(builds.started(), 1);
  builds.release.Notify();
  first.done.WaitForNotification();
  retry.done.WaitForNotification();
  EXPECT_TRUE(absl::IsCancelled(first.status)) << first.status;
  ASSERT_TRUE(retry.status.ok()) << retry.status;
  EXPECT_NE(service.session_for_test(retry.response.session_id()), nullptr);
  EXPECT_EQ(service.session_count(), 1u);
}

// Several Attaches of one engine at once: one builds, the latest waits, and the ones it
// displaced are ABORTED at once; every OK answer but the last names a session the next
// replaced, so only one session is live.
TEST_F(AttachRacesTest, ALaterAttachOfAnEngineTakesTheWaitingOnesPlace) {
  held::LongCalls builds;
  SessionService service(ServerConfig(), nullptr, SlowBuilds(&builds));
  const v1::AttachRequest request = engine_.Attach("slow-e");
  constexpr int kN = 4;
  std::vector<std::unique_ptr<Answer>> answers;
  for (int i = 0; i < kN; ++i) {
    Start(service, request, kUser, answers.emplace_back(std::make_unique<Answer>()).get());
    if (i == 0) {
      ASSERT_TRUE(builds.AwaitStarted(1));
    }
  }
  for (int i = 1; i < kN - 1; ++i) {
    ASSERT_TRUE(answers[i]->done.HasBeenNotified()) << i;
    EXPECT_TRUE(absl::IsAborted(answers[i]->status)) << answers[i]->status;
  }
  EXPECT_EQ(builds.started(), 1);
  builds.release.Notify();
  for (auto& a : answers) a->done.WaitForNotification();
  ASSERT_TRUE(answers.front()->status.ok()) << answers.front()->status;
  ASSERT_TRUE(answers.back()->status.ok()) << answers.back()->status;
  EXPECT_EQ(service.session_for_test(answers.front()->response.session_id()), nullptr);
  EXPECT_NE(service.session_for_test(answers.back()->response.session_id()), nullptr);
  EXPECT_EQ(service.session_count(), 1u);
}

// --max-sessions-per-user bounded a user's published sessions, not its builds in flight:
// one user at its quota-to-be held the whole server budget with builds that could never
// all publish, and another user's Attach, which fits beside that user's one session, was
// refused RESOURCE_EXHAUSTED meanwhile.
TEST_F(AttachRacesTest, BuildsInFlightCountAgainstTheUsersQuota) {
  const Peer other{};  // unknown credentials (TCP): another owner
  uint64_t one = 0;
  {
    SessionService probe{ServerConfig()};
    v1::AttachResponse r;
    ASSERT_TRUE(probe.Attach(engine_.Attach("probe"), &r, kUser).ok());
    one = probe.charged_bytes();
  }
  ASSERT_GT(one, 0u);
  ServerConfig config;
  config.max_sessions = 8;
  config.max_sessions_per_user = 1;
  config.max_server_bytes = 2 * one;  // room for two sessions
  held::LongCalls builds;
  SessionService service(config, nullptr, SlowBuilds(&builds));
  constexpr int kA = 3;
  std::vector<v1::AttachRequest> requests;
  for (int i = 0; i < kA; ++i) requests.push_back(engine_.Attach(absl::StrCat("slow-", i)));
  std::vector<std::unique_ptr<Answer>> answers;
  for (int i = 0; i < kA; ++i) {
    Start(service, requests[i], kUser, answers.emplace_back(std::make_unique<Answer>()).get());
  }
  ASSERT_TRUE(builds.AwaitStarted(1));
  for (int i = 1; i < kA; ++i) {
    ASSERT_TRUE(answers[i]->done.HasBeenNotified()) << i;
    EXPECT_TRUE(absl::IsResourceExhausted(answers[i]->status)) << answers[i]->status;
    EXPECT_TRUE(absl::StrContains(answers[i]->status.message(),
                                  "--max-sessions-per-user=1 sessions (1 of them being attached)"))
        << answers[i]->status;
  }
  EXPECT_EQ(service.charged_bytes(), one);
  v1::AttachResponse other_response;
  const absl::Status b = service.Attach(engine_.Attach("b"), &other_response, other);
  EXPECT_TRUE(b.ok()) << "another user refused while this one's build runs: " << b;
  builds.release.Notify();
  answers.front()->done.WaitForNotification();
  EXPECT_TRUE(answers.front()->status.ok()) << answers.front()->status;
  EXPECT_EQ(service.session_count(), 2u);
}

// --max-sessions counts the builds in flight of engines with no live session.
TEST_F(AttachRacesTest, BuildsInFlightCountAgainstMaxSessions) {
  ServerConfig config;
  config.max_sessions = 2;
  held::LongCalls builds;
  SessionService service(config, nullptr, SlowBuilds(&builds));
  Answer building;
  const v1::AttachRequest slow = engine_.Attach("slow-0");  // lives until answered
  Start(service, slow, kUser, &building);
  ASSERT_TRUE(builds.AwaitStarted(1));
  v1::AttachResponse response;
  ASSERT_TRUE(service.Attach(engine_.Attach("e-1"), &response, kUser).ok());
  const absl::Status full = service.Attach(engine_.Attach("e-2"), &response, kUser);
  EXPECT_TRUE(absl::IsResourceExhausted(full)) << full;
  EXPECT_TRUE(absl::StrContains(full.message(),
                                "--max-sessions=2 sessions (1 of them being "
                                "attached)"))
      << full;
  // A re-attach of a live engine needs no slot.
  EXPECT_TRUE(service.Attach(engine_.Attach("e-1"), &response, kUser).ok());
  builds.release.Notify();
  building.done.WaitForNotification();
  EXPECT_TRUE(building.status.ok()) << building.status;
  EXPECT_EQ(service.session_count(), 2u);
}

// A backend whose Retire throws, once: an exception in the hand-over, after the new
// session was published.
class ThrowingRetire final : public ForwardingBackend {
 public:
  explicit ThrowingRetire(std::unique_ptr<StepBackend> inner)
      : ForwardingBackend(std::move(inner)) {}

 protected:
  absl::Status FinishQueued(bool) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) {
    if (!thrown_) {
      thrown_ = true;
      throw std::runtime_error("retire failed");
    }
    return absl::OkStatus();
  }

 private:
  bool thrown_ ABSL_GUARDED_BY(step_mu_) = false;
};

// An Attach that fails after it published its session (here: its hand-over throws) takes
// the session back: it was left published with its lease held, never to expire.
TEST_F(AttachRacesTest, AnAttachThatFailsAfterPublishingRemovesItsSession) {
  std::atomic<int> built{0};
  SessionService service(
      ServerConfig(), nullptr,
      [&](const SessionSpec& spec, const SessionBuffers&, const ServerConfig&,
          std::unique_ptr<StepBackend>*) -> absl::StatusOr<std::unique_ptr<StepBackend>> {
        ASSIGN_OR_RETURN(std::unique_ptr<StepBackend> cpu, MakeCpuBackend(spec.model));
        if (built.fetch_add(1) > 0) return cpu;
        return std::make_unique<ThrowingRetire>(std::move(cpu));  // the first session's
      });
  v1::AttachResponse first, second;
  ASSERT_TRUE(service.Attach(engine_.Attach("e"), &first, kUser).ok());
  const absl::Status failed = service.Attach(engine_.Attach("e"), &second, kUser);
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal) << failed;
  EXPECT_TRUE(second.session_id().empty());
  EXPECT_EQ(service.session_count(), 0u);
  EXPECT_EQ(service.charged_bytes(), 0u);
}

// Two replacing Attaches build at once, of engines a and b, each in the allowance of its
// engine's live session, and a's live session is detached during a's build. --max-server-bytes
// holds a's small session, b's big one and one more small one: a's new session fits beside
// b's. Add refused it all the same (RESOURCE_EXHAUSTED, "... ended while the new one was
// built in its bytes"): it checked the server's use less a's old bytes against the limit,
// and that use held b's new session, built in b's own allowance, which b's hand-over gives
// back. The server passes its limit by no more than b's allowance meanwhile, and is within
// it once both have answered.
TEST_F(AttachRacesTest, AReplacingAttachWhoseOldSessionEndsIsPublishedBesideAnotherReplacement) {
  uint64_t small = 0, big = 0;
  v1::AttachRequest big_request = engine_.Attach("b");
  InlineOutputs(big_request);  // its visit lists allocated by epsd and charged
  {
    SessionService probe{ServerConfig()};
    v1::AttachResponse r;
    ASSERT_TRUE(probe.Attach(engine_.Attach("a"), &r, kUser).ok());
    small = probe.charged_bytes();
    ASSERT_TRUE(probe.Attach(big_request, &r, kUser).ok());
    big = probe.charged_bytes() - small;
  }
  ASSERT_GT(big, small);
  ServerConfig config;
  config.max_server_bytes = 2 * small + big;
  std::printf("a small session charges %llu, a big one %llu, --max-server-bytes %llu\n",
              static_cast<unsigned long long>(small), static_cast<unsigned long long>(big),
              static_cast<unsigned long long>(config.max_server_bytes));
  EngineGates gates;
  SessionService service(config, nullptr, GatedBuilds(&gates));
  v1::AttachResponse a_live, b_live;
  ASSERT_TRUE(service.Attach(engine_.Attach("a"), &a_live, kUser).ok());
  ASSERT_TRUE(service.Attach(big_request, &b_live, kUser).ok());
  gates.armed.store(true);
  const v1::AttachRequest a_request = engine_.Attach("a");
  Answer a_new, b_new;
  Start(service, a_request, kUser, &a_new);
  ASSERT_TRUE(gates.a.AwaitStarted(1));  // a's new session charged, within the limit
  Start(service, big_request, kUser, &b_new);
  ASSERT_TRUE(gates.b.AwaitStarted(1));  // b's, in b's allowance
  EXPECT_EQ(service.charged_bytes(), config.max_server_bytes + big);
  v1::DetachRequest detach;
  detach.set_session_id(a_live.session_id());
  ASSERT_TRUE(service.Detach(detach, kUser).ok());
  gates.a.release.Notify();
  a_new.done.WaitForNotification();
  EXPECT_TRUE(a_new.status.ok()) << a_new.status;
  EXPECT_LE(service.charged_bytes(), config.max_server_bytes + big);
  gates.b.release.Notify();
  b_new.done.WaitForNotification();
  EXPECT_TRUE(b_new.status.ok()) << b_new.status;
  EXPECT_EQ(service.session_count(), 2u);
  EXPECT_EQ(service.charged_bytes(), small + big);
}

// A replacing Attach is let pass --max-server-bytes by what the session it replaces held
// when its build began (Session::Create's `replacing`), however long the build takes.
// When that session ended meanwhile (its Detach, its lease) before the build's later
// charges, the allowance was stale: the new session was published (as a new one) above
// the server's limit, and stayed there. The Detach lands at a different point of the
// build in each round; whatever the Attach answers, the server ends within its limit.
TEST(AttachAllowanceTest, AReplacedSessionThatEndsDuringTheBuildLeavesTheServerWithinItsBudget) {
  ModelLayout model = eps::testing::SmallServiceModel();
  model.num_layers = 16;
  TestEngine engine(model, /*max_seqs=*/1, /*max_context=*/1 << 20, /*max_batch=*/64,
                    eps::testing::TestSeed());
  ServerConfig base;
  base.max_session_bytes = uint64_t{8} << 30;
  base.max_server_bytes = uint64_t{16} << 30;
  base.max_message_bytes = 2000u << 20;
  v1::AttachRequest big = engine.Attach("e");
  InlineOutputs(big);  // the session's visit lists allocated by epsd and charged
  uint64_t small = 0, large = 0;
  {
    SessionService probe(base);
    v1::AttachResponse r;
    ASSERT_TRUE(probe.Attach(engine.Attach("e"), &r, kUser).ok());
    small = probe.charged_bytes();
  }
  {
    SessionService probe(base);
    v1::AttachResponse r;
    const absl::Status s = probe.Attach(big, &r, kUser);
    ASSERT_TRUE(s.ok()) << s;
    large = probe.charged_bytes();
  }
  ASSERT_GT(large, small);
  ServerConfig config = base;
  config.max_server_bytes = small + (1 << 20);  // the small session fits; the big one not
  std::printf("the small session charges %llu, the big one %llu, --max-server-bytes %llu\n",
              static_cast<unsigned long long>(small), static_cast<unsigned long long>(large),
              static_cast<unsigned long long>(config.max_server_bytes));
  for (int round = 0; round < 20; ++round) {
    SessionService service(config);
    v1::AttachResponse live;
    ASSERT_TRUE(service.Attach(engine.Attach("e"), &live, kUser).ok());
    Answer replacing;
    Start(service, big, kUser, &replacing);
    absl::SleepFor(absl::Microseconds(400 * round));  // not a synchronisation: a spread
    v1::DetachRequest detach;
    detach.set_session_id(live.session_id());
    (void)service.Detach(detach, kUser);
    replacing.done.WaitForNotification();
    EXPECT_LE(service.charged_bytes(), config.max_server_bytes)
        << "round " << round << ": " << replacing.status << ", " << service.session_count()
        << " session(s)";
    if (!replacing.status.ok()) {
      EXPECT_TRUE(absl::IsResourceExhausted(replacing.status)) << replacing.status;
    }
  }
}

}  // namespace
}  // namespace eps::service
