// Hardening, class 3: no exception or failure leaves a call without a status.
// Every unary call and every stream ends with a precise status (never
// UNIMPLEMENTED or UNKNOWN with an empty message), and SIGTERM's drain ends
// within --drain-ms even with stuck, slow and idle clients.
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/service/epsd_process.h"
#include "tests/service/raw_calls.h"
#include "tests/service/test_engine.h"

namespace eps {
namespace {

using testing::EpsdProcess;
using testing::TestEngine;
using Stream = grpc::ClientReaderWriter<v1::SelectPagesRequest, v1::SelectPagesResponse>;

constexpr int64_t kOverflowingContext = std::numeric_limits<int64_t>::max();

class EveryCallEndsWithStatus : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> flags = {}) {
    seed_ = testing::TestSeed();
    epsd_ = EpsdProcess::Start(testing::UniqueSocket("status"), std::move(flags));
    ASSERT_NE(epsd_, nullptr);
    stub_ = testing::RawStub(epsd_->target());
    engine_ = std::make_unique<TestEngine>(testing::SmallServiceModel(), 1, 1024, 1, seed_);
    engine_->Fill(0, 0, 1024);
    v1::AttachResponse response;
    ASSERT_TRUE(testing::RawAttach(*stub_, engine_->Attach("engine-status"), &response).ok());
    session_ = response.session_id();
  }
  uint64_t seed_ = 0;
  std::unique_ptr<EpsdProcess> epsd_;
  std::unique_ptr<v1::PageSelector::Stub> stub_;
  std::unique_ptr<TestEngine> engine_;
  std::string session_;
};

TEST_F(EveryCallEndsWithStatus, AUnaryStepThatOnceThrewGetsAPreciseStatus) {
  Start();
  SCOPED_TRACE(testing::SeedTrace(seed_));
  const grpc::Status status = testing::RawStep(
      *stub_, testing::StepRequest(session_, 1, {TestEngine::Row(0, kOverflowingContext)}));
  EXPECT_NE(status.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_NE(status.error_code(), grpc::StatusCode::UNKNOWN);
  EXPECT_NE(status.error_code(), grpc::StatusCode::OK);
  EXPECT_FALSE(status.error_message().empty());
}

TEST_F(EveryCallEndsWithStatus, AStreamWhoseStepFailsEndsWithThatStepsStatus) {
  Start();
  SCOPED_TRACE(testing::SeedTrace(seed_));
  grpc::ClientContext context;
  testing::SetDeadline(context, std::chrono::seconds(10));
  std::unique_ptr<Stream> stream = stub_->StreamSelectPages(&context);
  ASSERT_TRUE(
      stream->Write(testing::StepRequest(session_, 1, {TestEngine::Row(0, kOverflowingContext)})));
  v1::SelectPagesResponse reply;
  EXPECT_FALSE(stream->Read(&reply));  // no reply for a failed step: the stream ends
  const grpc::Status status = stream->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_FALSE(status.error_message().empty());
}

// Opens a Unix-socket connection and sends half an HTTP/2 preface, then nothing.
int HalfSentConnection(const std::string& target) {
  const std::string path = target.substr(std::strlen("unix://"));
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return -1;
  }
  const char kHalfPreface[] = "PRI * HTTP/2.0\r\n";
  (void)!write(fd, kHalfPreface, sizeof(kHalfPreface) - 1);
  return fd;
}

TEST_F(EveryCallEndsWithStatus, SigtermEndsWithinDrainMsWithStuckSlowAndIdleClients) {
  Start({"--drain-ms=300"});
  SCOPED_TRACE(testing::SeedTrace(seed_));
  // Stuck: a stream whose step failed in a way that once left it without a status.
  grpc::ClientContext stuck_context;
  std::unique_ptr<Stream> stuck = stub_->StreamSelectPages(&stuck_context);
  ASSERT_TRUE(
      stuck->Write(testing::StepRequest(session_, 1, {TestEngine::Row(0, kOverflowingContext)})));
  // Slow: a stream that sends steps and never reads a reply.
  grpc::ClientContext slow_context;
  std::unique_ptr<Stream> slow = stub_->StreamSelectPages(&slow_context);
  for (uint64_t step = 2; step < 40; ++step) {
    if (!slow->Write(testing::StepRequest(session_, step, {TestEngine::Row(0, 900)}))) break;
  }
  // Idle: an open stream that sends nothing; and a connection stuck in its preface.
  grpc::ClientContext idle_context;
  std::unique_ptr<Stream> idle = stub_->StreamSelectPages(&idle_context);
  const int half = HalfSentConnection(epsd_->target());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let epsd take them all in

  const auto start = std::chrono::steady_clock::now();
  epsd_->Signal(SIGTERM);
  // A hang guard, not a latency target: 300 ms of drain plus generous slack for a loaded machine.
  const auto until = start + std::chrono::seconds(5);
  while (epsd_->Running() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const bool exited = !epsd_->Running();
  if (!exited) epsd_->Signal(SIGKILL);
  if (half >= 0) close(half);
  stuck_context.TryCancel();
  slow_context.TryCancel();
  idle_context.TryCancel();
  EXPECT_TRUE(exited) << "epsd did not exit within 5 s of SIGTERM with --drain-ms=300\n"
                      << epsd_->Log();
  EXPECT_NE(epsd_->Log().find("stopped"), std::string::npos) << epsd_->Log();
  EXPECT_EQ(epsd_->Log().find("drain timed out"), std::string::npos) << epsd_->Log();
}

}  // namespace
}  // namespace eps
