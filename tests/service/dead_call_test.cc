// Hardening, class 7: calls that are already dead when epsd gets to them
// (cancelled, or past their deadline) are not run: no step is taken, no write
// applied, and the step number stays free for the engine's next call.
#include <signal.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "service/session_service.h"
#include "tests/core/test_util.h"
#include "tests/fuzz/fuzz_session.h"
#include "tests/service/epsd_process.h"
#include "tests/service/raw_calls.h"
#include "tests/service/test_engine.h"

namespace eps {
namespace {

using testing::EpsdProcess;
using testing::TestEngine;

uint64_t StepsTaken(v1::PageSelector::Stub& stub, const std::string& session) {
  grpc::ClientContext context;
  testing::SetDeadline(context, std::chrono::seconds(10));
  v1::GetStatsRequest request;
  request.set_session_id(session);
  v1::GetStatsResponse response;
  if (!stub.GetStats(&context, request, &response).ok() || response.sessions_size() != 1) {
    return ~uint64_t{0};
  }
  return response.sessions(0).steps();
}

// Waits (up to 5 s) until /proc says the process is in `state` ('T': stopped).
bool WaitForState(pid_t pid, char state) {
  for (int i = 0; i < 500; ++i) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const size_t paren = stat.rfind(')');
    if (paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == state) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// epsd is stopped (SIGSTOP) while the client sends a step and gives up on it:
// when epsd resumes, the request and its cancellation are both waiting. (gRPC
// itself drops such a call before dispatch; this guards that end to end.)
TEST(DeadCalls, AStepItsClientGaveUpOnBeforeEpsdReadItIsNotRun) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  auto epsd = EpsdProcess::Start(testing::UniqueSocket("dead"));
  ASSERT_NE(epsd, nullptr);
  auto stub = testing::RawStub(epsd->target());
  TestEngine engine(testing::SmallServiceModel(), 1, 1024, 1, seed);
  engine.Fill(0, 0, 1024);
  v1::AttachResponse attached;
  ASSERT_TRUE(testing::RawAttach(*stub, engine.Attach("engine-dead"), &attached).ok());
  const std::vector<v1::BatchRow> rows = {TestEngine::Row(0, 1000)};
  ASSERT_TRUE(testing::RawStep(*stub, testing::StepRequest(attached.session_id(), 1, rows)).ok());

  epsd->Signal(SIGSTOP);
  ASSERT_TRUE(WaitForState(epsd->pid(), 'T'));  // kill() returns before the stop takes hold
  const grpc::Status dead =
      testing::RawStep(*stub, testing::StepRequest(attached.session_id(), 2, rows), nullptr,
                       std::chrono::milliseconds(100));
  EXPECT_EQ(dead.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the cancellation is sent
  epsd->Signal(SIGCONT);
  // Nothing to wait on from outside: give epsd time to run the dead call if it would.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));

  // Step 2 never ran: the session took one step, and step 2 is still free.
  EXPECT_EQ(StepsTaken(*stub, attached.session_id()), 1u);
  const grpc::Status retry =
      testing::RawStep(*stub, testing::StepRequest(attached.session_id(), 2, rows));
  EXPECT_TRUE(retry.ok()) << retry.error_message();
  EXPECT_EQ(StepsTaken(*stub, attached.session_id()), 2u);
}

// In process: what the gRPC layer passes for a call that is dead when the session
// service gets it. The same check runs again once the call holds the session's
// step lock, where a call can die waiting behind a slow step.
class DeadCallsInProcess : public ::testing::Test {
 protected:
  void SetUp() override {
    v1::AttachResponse response;
    ASSERT_TRUE(service_.Attach(fuzz::SmallInlineAttach("engine-dead"), &response).ok());
    session_ = response.session_id();
  }
  uint64_t Steps() {
    v1::GetStatsRequest request;
    request.set_session_id(session_);
    v1::GetStatsResponse response;
    EXPECT_TRUE(service_.GetStats(request, &response).ok());
    return response.sessions_size() == 1 ? response.sessions(0).steps() : ~uint64_t{0};
  }
  v1::SelectPagesRequest Step(uint64_t step) {
    v1::BatchRow row;
    row.set_table_row(0);
    row.set_context_tokens(200);
    return testing::StepRequest(session_, step, {row});
  }
  service::SessionService service_{fuzz::FuzzConfig()};
  std::string session_;
};

TEST_F(DeadCallsInProcess, AStepPastItsDeadlineOnArrivalIsNotRun) {
  v1::SelectPagesResponse response;
  const absl::Status dead =
      service_.SelectPages(Step(1), &response, nullptr,
                           {.deadline = absl::Now() - absl::Milliseconds(1), .cancelled = {}});
  EXPECT_EQ(dead.code(), absl::StatusCode::kDeadlineExceeded) << dead;
  EXPECT_EQ(Steps(), 0u);
  EXPECT_TRUE(service_.SelectPages(Step(1), &response).ok());  // step 1 is still free
  EXPECT_EQ(Steps(), 1u);
}

TEST_F(DeadCallsInProcess, ACancelledStepIsNotRun) {
  v1::SelectPagesResponse response;
  ASSERT_TRUE(service_.SelectPages(Step(1), &response).ok());
  const absl::Status dead =
      service_.SelectPages(Step(2), &response, nullptr,
                           {.deadline = absl::InfiniteFuture(), .cancelled = [] { return true; }});
  EXPECT_EQ(dead.code(), absl::StatusCode::kCancelled) << dead;
  EXPECT_EQ(Steps(), 1u);
  EXPECT_TRUE(service_.SelectPages(Step(2), &response).ok());
}

}  // namespace
}  // namespace eps
