// Fault tests: a dead, slow, restarted or absent sidecar never hangs the
// engine; a dead engine never holds the sidecar's resources past its lease.
#include <fcntl.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

#include "client/cpp/eps_client.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/service/epsd_process.h"
#include "tests/service/test_engine.h"

namespace eps {
namespace {

using testing::EpsdProcess;
using testing::TestEngine;

class FaultTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    seed_ = testing::TestSeed();
    engine_ = std::make_unique<TestEngine>(testing::SmallServiceModel(), 2, 2048, 2, seed_);
    engine_->Fill(0, 0, 2048);
    engine_->Fill(1, 1, 2048);
  }
  client::ClientOptions Options(const std::string& target) {
    client::ClientOptions o;
    o.target = target;
    o.deadline = std::chrono::milliseconds(2000);
    // Generous: an Attach that is not about deadlines must not fail on a loaded CI machine.
    o.attach_deadline = std::chrono::seconds(5);
    o.reattach_backoff = std::chrono::milliseconds(20);
    o.use_stream = GetParam();
    return o;
  }
  std::vector<v1::BatchRow> Rows(int step) {
    return {TestEngine::Row(0, 1500 + step), TestEngine::Row(1, 700 + step)};
  }
  uint64_t seed_ = 0;
  std::unique_ptr<TestEngine> engine_;
};

TEST_P(FaultTest, DeadlineMissFallsBackAndIsCounted) {
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("deadline"));
  ASSERT_NE(epsd, nullptr);
  client::ClientOptions o = Options(epsd->target());
  client::EpsClient client(o, engine_->Attach("engine-deadline"));
  ASSERT_TRUE(client.Attach().ok());
  o.deadline = std::chrono::microseconds(1);  // no selection fits in 1 µs
  client::EpsClient hurried(o, engine_->Attach("engine-deadline-2"));
  ASSERT_TRUE(hurried.Attach().ok());
  const client::StepResult r = hurried.SelectPages(1, Rows(1));
  EXPECT_TRUE(r.fallback);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kDeadlineExceeded) << r.status;
  EXPECT_EQ(hurried.counters().fallback_deadline, 1u);
}

TEST_P(FaultTest, AStoppedSidecarRunsNoneOfTheStepsTheEngineGaveUpOn) {
  // epsd stopped (alive, silent) while the engine takes 20 steps: each falls back at its
  // deadline. Resumed, epsd must not then run those steps (they would write lists and
  // counters the engine no longer waits for), and selection resumes at once. On the
  // stream, the client cancels the stream at each miss; before, every queued step ran.
  SCOPED_TRACE(testing::SeedTrace(seed_));
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("stopped"));
  ASSERT_NE(epsd, nullptr);
  client::ClientOptions o = Options(epsd->target());
  client::EpsClient client(o, engine_->Attach("engine-stopped"));
  ASSERT_TRUE(client.Attach().ok());
  ASSERT_FALSE(client.SelectPages(1, Rows(1)).fallback);
  o.deadline = std::chrono::milliseconds(30);
  client::EpsClient hurried(o, engine_->Attach("engine-stopped"));  // replaces it (same user)
  ASSERT_TRUE(hurried.Attach().ok());
  // The first steps of the 30 ms client may miss on a loaded machine (one scheduling
  // delay): step until one selects, so that the session and its stream are live before
  // epsd stops. A step that missed may still have run on epsd: what epsd ran from here on
  // is counted from the GetStats below.
  int step = 0;
  bool live = false;
  while (step < 100 && !live) {
    ++step;
    live = !hurried.SelectPages(step, Rows(step)).fallback;
  }
  ASSERT_TRUE(live) << "no step of the 30 ms client selected in " << step;
  auto ran_now = [&] {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::GetStatsRequest request;
    request.set_session_id(hurried.session_id());
    v1::GetStatsResponse stats;
    const grpc::Status status = hurried.stub().GetStats(&context, request, &stats);
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_EQ(stats.sessions_size(), 1);
    return stats.sessions_size() == 1 ? stats.sessions(0).steps() : uint64_t{0};
  };
  const uint64_t ran_before = ran_now();
  const uint64_t selected_before = hurried.counters().selected;
  epsd->Signal(SIGSTOP);
  // kill returns before the process has stopped: wait until the kernel says it has.
  const std::string stat = "/proc/" + std::to_string(epsd->pid()) + "/stat";
  for (int i = 0; i < 2000; ++i) {
    std::ifstream file(stat);
    std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    const size_t paren = text.rfind(')');
    if (paren != std::string::npos && paren + 2 < text.size() && text[paren + 2] == 'T') break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const int first_stopped = step + 1;
  for (int i = 0; i < 20; ++i) {
    ++step;
    const client::StepResult r = hurried.SelectPages(step, Rows(step));
    EXPECT_TRUE(r.fallback) << "step " << step;
    EXPECT_LT(r.round_trip_us, 1e6) << "step " << step;  // a hang guard
  }
  epsd->Signal(SIGCONT);
  const uint64_t missed_before = hurried.counters().fallback_deadline;
  const int first_resumed = step + 1;
  bool selected = false;
  while (step < first_resumed + 100 && !selected) {
    ++step;
    selected = !hurried.SelectPages(step, Rows(step)).fallback;
  }
  ASSERT_TRUE(selected);
  // A step after SIGCONT that missed its 30 ms on a loaded machine may still have run on
  // epsd: each such miss may add one step that `selected` does not count.
  const uint64_t missed_resumed = hurried.counters().fallback_deadline - missed_before;
  const uint64_t ran = ran_now() - ran_before;
  const uint64_t selected_since = hurried.counters().selected - selected_before;
  // The step that selected, and the resumed steps that missed, plus at most the few already
  // in epsd's hands when it stopped or while it resumed: not the 20 of steps
  // first_stopped..first_resumed - 1.
  EXPECT_LE(ran, selected_since + missed_resumed + 3)
      << "since stopping, epsd ran " << ran << " steps, the client selected " << selected_since
      << " (steps " << first_stopped << "-" << first_resumed - 1 << " were given up on while "
      << "it was stopped; " << missed_resumed << " of the " << step - first_resumed + 1
      << " after SIGCONT missed)";
}

TEST_P(FaultTest, AbsentSidecarFallsBackWithoutWaiting) {
  client::EpsClient client(Options(testing::UniqueSocket("absent")), engine_->Attach("engine-x"));
  for (int step = 1; step <= 5; ++step) {
    const client::StepResult r = client.SelectPages(step, Rows(step));
    EXPECT_TRUE(r.fallback);
    // A hang guard, not a latency target: an absent peer must not cost the deadline.
    EXPECT_LT(r.round_trip_us, 1e6);
  }
  EXPECT_EQ(client.counters().fallbacks(), 5u);
  EXPECT_EQ(client.counters().selected, 0u);
}

TEST_P(FaultTest, KilledSidecarFallsBackAtOnceThenReattachesWhenItReturns) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  const std::string socket = testing::UniqueSocket("kill");
  auto epsd = EpsdProcess::Start(socket);
  ASSERT_NE(epsd, nullptr);
  client::EpsClient client(Options(socket), engine_->Attach("engine-kill"));
  ASSERT_TRUE(client.Attach().ok());
  int step = 0;
  for (; step < 5; ++step) ASSERT_FALSE(client.SelectPages(step + 1, Rows(step + 1)).fallback);

  epsd->Signal(SIGKILL);
  ASSERT_EQ(epsd->Wait(), 128 + SIGKILL);
  ++step;
  const client::StepResult during = client.SelectPages(step, Rows(step));
  EXPECT_TRUE(during.fallback);
  EXPECT_LT(during.round_trip_us, 1e6) << "a dead sidecar must not hold the engine";

  auto restarted = EpsdProcess::Start(socket);
  ASSERT_NE(restarted, nullptr);
  bool selected = false;
  for (int tries = 0; tries < 500 && !selected; ++tries) {
    ++step;
    const client::StepResult r = client.SelectPages(step, Rows(step));
    selected = !r.fallback;
    if (selected) {
      EXPECT_TRUE(engine_->MatchesReference(Rows(step)));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));  // the channel reconnecting
    }
  }
  EXPECT_TRUE(selected) << "never re-attached; counters: fallbacks="
                        << client.counters().fallbacks();
  EXPECT_EQ(client.counters().reattaches, 1u);
}

TEST_P(FaultTest, FailClosedReportsTheErrorInsteadOfFallingBack) {
  client::ClientOptions o = Options(testing::UniqueSocket("closed"));
  o.fail_open = false;
  auto epsd = EpsdProcess::Start(o.target);
  ASSERT_NE(epsd, nullptr);
  client::EpsClient client(o, engine_->Attach("engine-closed"));
  ASSERT_TRUE(client.Attach().ok());
  ASSERT_FALSE(client.SelectPages(1, Rows(1)).fallback);
  const client::StepResult replay = client.SelectPages(1, Rows(1));  // a replayed step
  EXPECT_FALSE(replay.fallback);
  EXPECT_EQ(replay.status.code(), absl::StatusCode::kFailedPrecondition) << replay.status;
  EXPECT_EQ(client.counters().errors, 1u);
  EXPECT_EQ(client.counters().fallbacks(), 0u) << "a fail-closed error is not a fallback";
}

TEST_P(FaultTest, SecondServerRefusesALiveSocket) {
  const std::string socket = testing::UniqueSocket("live");
  auto first = EpsdProcess::Start(socket);
  ASSERT_NE(first, nullptr);
  auto second = EpsdProcess::Start(socket);
  EXPECT_EQ(second, nullptr) << "a second epsd took over a live socket";
  ASSERT_TRUE(first->Running()) << first->Log();
  client::EpsClient client(Options(socket), engine_->Attach("engine-live"));
  ASSERT_TRUE(client.Attach().ok());
  EXPECT_FALSE(client.SelectPages(1, Rows(1)).fallback) << "the first server must keep serving";
}

INSTANTIATE_TEST_SUITE_P(Transports, FaultTest, ::testing::Values(false, true),
                         [](const auto& p) { return p.param ? "Stream" : "Unary"; });

TEST(FaultEngineDeathTest, KilledEngineSessionExpiresAndItsMemoryIsUnmapped) {
  // A 2 s lease: one the demo, stepping every 2 ms, keeps renewing however loaded the
  // machine (a 200 ms one expired under load while it lived, and it re-attached: 2 expiries).
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("death"), {"--lease-ms=2000"});
  ASSERT_NE(epsd, nullptr);
  // The engine is a real eps-demo process, killed with SIGKILL mid-run.
  std::vector<std::string> args = {EPS_DEMO_PATH,   "--target=" + epsd->target(),
                                   "--steps=20000", "--context=1024",
                                   "--batch=1",     "--pace-ms=2"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  pid_t engine = -1;
  ASSERT_EQ(posix_spawn(&engine, EPS_DEMO_PATH, &actions, nullptr, argv.data(), environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  const std::string shm_name = "/eps-demo-" + std::to_string(engine) + "-0";
  struct KillOnExit {  // never leave the engine running, whatever fails below
    pid_t pid;
    ~KillOnExit() {
      if (pid > 0 && kill(pid, SIGKILL) == 0) waitpid(pid, nullptr, 0);  // never kill(-1)
    }
  } guard{engine};

  auto stub = v1::PageSelector::NewStub(
      grpc::CreateChannel(epsd->target(), grpc::InsecureChannelCredentials()));
  auto stats_now = [&] {
    grpc::ClientContext context;
    v1::GetStatsResponse stats;
    EXPECT_TRUE(stub->GetStats(&context, v1::GetStatsRequest(), &stats).ok());
    return stats;
  };
  bool stepping = false;
  for (int i = 0; i < 1000 && !stepping; ++i) {  // up to 10 s for the demo to attach and step
    stepping = stats_now().steps_total() > 2;
    if (!stepping) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(stepping) << "eps-demo never stepped";
  EXPECT_NE(epsd->Maps().find(shm_name.substr(1)), std::string::npos) << "mapped while attached";
  kill(engine, SIGKILL);
  waitpid(engine, nullptr, 0);
  guard.pid = 0;  // reaped

  v1::GetStatsResponse stats;
  for (int i = 0; i < 1500; ++i) {  // the lease is 2 s (reaped every 200 ms); allow 15 s
    stats = stats_now();
    if (stats.sessions_active() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(stats.sessions_active(), 0u);
  EXPECT_EQ(stats.sessions_expired_total(), 1u);
  EXPECT_EQ(epsd->Maps().find(shm_name.substr(1)), std::string::npos) << "still mapped";
  shm_unlink(shm_name.c_str());  // a killed engine cannot clean up after itself
}

TEST(FaultSignalTest, SigtermDrainsAndExitsCleanly) {
  const std::string socket = testing::UniqueSocket("term");
  auto epsd = EpsdProcess::Start(socket);
  ASSERT_NE(epsd, nullptr);
  epsd->Signal(SIGTERM);
  EXPECT_EQ(epsd->Wait(), 0) << epsd->Log();
  EXPECT_NE(epsd->Log().find("stopped"), std::string::npos);
  EXPECT_NE(access(socket.substr(7).c_str(), F_OK), 0) << "socket file left behind";
}

}  // namespace
}  // namespace eps
