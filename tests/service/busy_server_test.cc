// epsd with more long steps than gRPC has callback threads: the steps run at once, other
// engines' calls are served, cancellations stop the steps, and SIGTERM's drain ends while
// Detach calls wait for them (service/step_gate.h, service/step_executor.h).
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "service/epsd_main.h"
#include "service/server.h"
#include "service/session_service.h"
#include "service/step_executor.h"
#include "tests/core/test_util.h"
#include "tests/service/forwarding_backend.h"
#include "tests/service/long_calls.h"
#include "tests/service/loopback_server.h"
#include "tests/service/run_epsd.h"
#include "tests/service/test_engine.h"

namespace eps::service {
namespace {

using eps::testing::TestEngine;

// Counts, across a server's sessions, the long steps UntilCancelledBackend ran.
using LongSteps = held::LongCalls;

// The cpu backend, but a session's first step runs until its caller gives up, as a cpu
// step of a large model runs for seconds and stops before its next (row, layer) once its
// caller has gone (or until the test releases it).
class UntilCancelledBackend final : public ForwardingBackend {
 public:
  UntilCancelledBackend(std::unique_ptr<StepBackend> inner, LongSteps* steps)
      : ForwardingBackend(std::move(inner)), steps_(steps) {}
  absl::Status Run(const BackendStep& step, StepOutcome* outcome) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) {
    if (!ran_long_) {
      ran_long_ = true;
      steps_->Started();
      while (!steps_->release.WaitForNotificationWithTimeout(absl::Milliseconds(1))) {
        if (absl::Status alive = step.stop(); !alive.ok()) {
          steps_->Stopped();
          return alive;
        }
      }
    }
    return RunInner(step, outcome);
  }

 private:
  LongSteps* steps_;
  bool ran_long_ ABSL_GUARDED_BY(step_mu_) = false;
};

// epsd on a loopback port whose sessions' first steps run until cancelled, with more such
// sessions than gRPC has callback threads, and one more session.
class BusyServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<LoopbackServer> epsd = StartLoopbackServer(
        WrapCpuBackend<UntilCancelledBackend>(&steps_),
        {absl::StrCat("--max-sessions=", kBusy + 1)});  // on any number of cores
    ASSERT_TRUE(epsd.ok()) << epsd.status();
    server_ = std::move(epsd->server);
    stub_ = std::move(epsd->stub);
    engine_.Fill(0, 0, 300);
    for (int i = 0; i <= kBusy; ++i) {
      v1::AttachResponse attached;
      const std::string engine_id = i < kBusy ? absl::StrCat("busy-", i) : "idle";
      const grpc::Status s = eps::testing::RawAttach(*stub_, engine_.Attach(engine_id), &attached);
      ASSERT_TRUE(s.ok()) << engine_id << ": " << s.error_message();
      if (i < kBusy) {
        busy_ids_.push_back(attached.session_id());
      } else {
        idle_ = attached.session_id();
      }
    }
  }
  void TearDown() override {
    if (!steps_.release.HasBeenNotified()) steps_.release.Notify();  // nothing waits for ever
    for (std::thread& call : calls_) call.join();
  }

  // Sends step `step` of `session` from a thread of its own; `*context` cancels it.
  void Send(const std::string& session, uint64_t step, grpc::ClientContext* context,
            grpc::Status* status) {
    context->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    calls_.emplace_back([this, session, step, context, status] {
      v1::SelectPagesResponse reply;
      *status = stub_->SelectPages(context, TestEngine::Step(session, step, rows_), &reply);
    });
  }
  grpc::Status Step(const std::string& session, uint64_t step) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::SelectPagesResponse reply;
    return stub_->SelectPages(&context, TestEngine::Step(session, step, rows_), &reply);
  }
  v1::SessionStats Stats(const std::string& session) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::GetStatsRequest request;
    request.set_session_id(session);
    v1::GetStatsResponse response;
    const grpc::Status s = stub_->GetStats(&context, request, &response);
    EXPECT_TRUE(s.ok() && response.sessions_size() == 1) << s.error_message();
    return response.sessions_size() == 1 ? response.sessions(0) : v1::SessionStats();
  }

  // Twice the callback threads gRPC 1.51 starts, and more.
  const int kBusy = 2 * StepExecutor::GrpcCallbackThreads() + 2;
  LongSteps steps_;
  TestEngine engine_{eps::testing::SmallServiceModel(), /*max_seqs=*/1, /*max_context=*/512,
                     /*max_batch=*/1, eps::testing::TestSeed()};
  const std::vector<v1::BatchRow> rows_ = {TestEngine::Row(0, 300)};
  std::unique_ptr<EpsServer> server_;
  std::unique_ptr<v1::PageSelector::Stub> stub_;
  std::vector<std::string> busy_ids_;
  std::string idle_;
  // What the calls on calls_ write to: kept until TearDown has joined them.
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts_;
  std::vector<grpc::Status> statuses_;
  std::vector<std::thread> calls_;
};

// Steps ran on gRPC's callback threads: with as many long steps as those threads, the
// steps of further sessions waited, another engine's Heartbeat waited 2.9-5.3 s, and the
// steps' cancellations, which gRPC processes only on a free callback thread, were never
// seen: two cpu steps of 2.7 s cancelled at 0.3 s ran to their end, their outputs written,
// their step numbers taken and counted as successes. Now at most half of those threads
// run steps (StepExecutor::DefaultInlineTurns) and the rest run on the StepExecutor: all
// of them run at once, the Heartbeat is answered while they run, and once cancelled they
// stop (the ones on callback threads too) and leave their step numbers free.
TEST_F(BusyServerTest, LongStepsOfMoreSessionsThanCallbackThreadsRunAtOnceAndStopWhenCancelled) {
  // The fixture's: a failed ASSERT returns while the calls run, and TearDown joins them.
  std::vector<std::unique_ptr<grpc::ClientContext>>& contexts = contexts_;
  std::vector<grpc::Status>& statuses = statuses_;
  statuses.resize(busy_ids_.size());
  for (size_t i = 0; i < busy_ids_.size(); ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    Send(busy_ids_[i], 7, contexts.back().get(), &statuses[i]);
  }
  ASSERT_TRUE(steps_.AwaitStarted(kBusy)) << "the steps of " << kBusy << " sessions never all ran";
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::HeartbeatRequest request;
    request.set_session_id(idle_);
    v1::HeartbeatResponse response;
    const grpc::Status s = stub_->Heartbeat(&context, request, &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(steps_.stopped(), 0);  // answered while every step still ran
  for (const std::unique_ptr<grpc::ClientContext>& context : contexts) context->TryCancel();
  EXPECT_TRUE(steps_.AwaitStopped(kBusy)) << steps_.stopped() << " of " << kBusy << " stopped";
  for (std::thread& call : calls_) call.join();
  calls_.clear();
  for (const grpc::Status& s : statuses) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  }
  for (const std::string& id : busy_ids_) {
    const v1::SessionStats before = Stats(id);
    EXPECT_EQ(before.steps(), 0u);
    EXPECT_EQ(before.errors(), 0u);
    const grpc::Status again = Step(id, 7);  // step 7 is still free
    EXPECT_TRUE(again.ok()) << again.error_message();
    EXPECT_EQ(Stats(id).last_step(), 7u);
  }
}

// SIGTERM while Detach calls wait for their sessions' long steps, with more such sessions
// than gRPC has callback threads: the drain cancels the steps at --drain-ms, they stop,
// the Detach calls end and epsd exits 0. The steps and the Detach waits held the callback
// threads, so the drain's cancellations were never seen: "drain timed out 6500 ms after
// the signal; exiting", exit 1 (3 of 3 runs, one cpu step and its Detach on 2 cores),
// against exit 0 in 0.57 s without the Detach. epsd's whole process (RunEpsd) in a child
// (a death test), since the signal is its own.
TEST(EpsdDrainDeathTest, SigtermWhileDetachCallsWaitForLongStepsEndsTheDrainWithExitZero) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto run = [] {
    BlockStopSignals();  // before the client's threads exist
    int status = 0;
    {  // the engine's shm objects are removed before the exit
      const std::string path = absl::StrCat("/tmp/epsd-test-busy-drain-", getpid(), ".sock");
      const int sessions = 2 * StepExecutor::GrpcCallbackThreads() + 2;
      TestEngine engine(eps::testing::SmallServiceModel(), /*max_seqs=*/1, /*max_context=*/512,
                        /*max_batch=*/1, eps::testing::TestSeed());
      engine.Fill(0, 0, 300);
      LongSteps steps;
      std::unique_ptr<v1::PageSelector::Stub> stub = StubFor(path);
      auto deadline = [](grpc::ClientContext& context, int seconds) {
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
      };
      std::vector<std::thread> calls;  // the client's calls, each on a thread of its own
      std::thread client([&] {
        std::vector<std::string> ids;
        for (int i = 0; i < sessions; ++i) {
          v1::AttachResponse attached;
          if (AttachOnceListening(*stub, engine.Attach(absl::StrCat("busy-", i)), &attached).ok()) {
            ids.push_back(attached.session_id());
          }
        }
        for (const std::string& id : ids) {
          calls.emplace_back([&, id] {
            grpc::ClientContext context;
            deadline(context, 60);
            v1::SelectPagesResponse reply;
            (void)stub->SelectPages(&context, TestEngine::Step(id, 1, {TestEngine::Row(0, 300)}),
                                    &reply);
          });
        }
        (void)steps.AwaitStarted(static_cast<int>(ids.size()));
        for (const std::string& id : ids) {
          calls.emplace_back([&, id] {
            grpc::ClientContext context;
            deadline(context, 60);
            v1::DetachRequest request;
            request.set_session_id(id);
            v1::DetachResponse reply;
            (void)stub->Detach(&context, request, &reply);
          });
        }
        // Every Detach has removed its session and waits for its step (10 s at most).
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (std::chrono::steady_clock::now() < give_up) {
          grpc::ClientContext context;
          deadline(context, 1);
          v1::GetStatsResponse stats;
          const grpc::Status s = stub->GetStats(&context, v1::GetStatsRequest(), &stats);
          if (s.ok() && stats.sessions_active() == 0) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        kill(getpid(), SIGTERM);
      });
      status = RunEpsd({"--listen=unix://" + path, "--metrics-listen=off", "--backend=cpu",
                        "--drain-ms=500", absl::StrCat("--max-sessions=", sessions)},
                       WrapCpuBackend<UntilCancelledBackend>(&steps));
      client.join();
      for (std::thread& call : calls) call.join();
      unlink((path + ".lock").c_str());
      unlink(path.c_str());  // epsd keeps it (service/unix_socket.h)
      std::fprintf(stderr, "long steps stopped by the drain: %d of %d (%s)\n", steps.stopped(),
                   sessions, steps.stopped() == sessions ? "all" : "not all");
      std::fflush(stderr);
    }
    std::_Exit(status);
  };
  // Exit 0, not the backstop's 1 at 500 + 6000 ms: the drain ended with its calls.
  EXPECT_EXIT(run(), ::testing::ExitedWithCode(0),
              "signal 15, draining for up to 500 ms.*epsd: stopped\n.*long steps stopped by the "
              "drain: [0-9]+ of [0-9]+ \\(all\\)");
}

}  // namespace
}  // namespace eps::service
