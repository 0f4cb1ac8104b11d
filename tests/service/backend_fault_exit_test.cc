// epsd's whole process (RunEpsd, what main runs) meeting backend faults, each in a child
// process (a death test), since epsd signals its own process and ends it: a lost CUDA
// device drains the server and exits 1, and a step that never ends meets the drain's
// backstop within its bound. The session service's side of the same faults is in
// backend_fault_test.cc.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "eps/v1/page_selector.grpc.pb.h"
#include "gtest/gtest.h"
#include "service/config.h"
#include "service/epsd_main.h"
#include "service/session.h"
#include "tests/core/test_util.h"
#include "tests/service/run_epsd.h"
#include "tests/service/test_engine.h"

namespace eps::service {
namespace {

using eps::testing::TestEngine;

// epsd's whole process (RunEpsd, what main runs) after a lost device: it drains as on a
// signal and exits 1, saying why. In a child process (a death test), since epsd signals
// its own process; the stand-in backend's Attach reports the device lost.
TEST(EpsdDeviceLostDeathTest, ALostDeviceDrainsTheServerAndExitsOne) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto run = [] {
    BlockStopSignals();  // before the client's thread exists
    int status = 0;
    {  // the engine's shm objects are removed before the exit
      const std::string path = absl::StrCat("/tmp/epsd-test-lost-", getpid(), ".sock");
      TestEngine engine(eps::testing::SmallServiceModel(), 2, 512, 2, eps::testing::TestSeed());
      grpc::StatusCode attach_code = grpc::StatusCode::OK;
      std::atomic<bool> stopped{false};
      std::thread client([&] {
        v1::AttachResponse attached;
        attach_code =
            AttachOnceListening(*StubFor(path), engine.Attach("engine-a"), &attached).error_code();
        // Should epsd keep serving (the loss unnoticed), end it as an operator would, so
        // that the test fails on its exit status instead of hanging.
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        while (!stopped.load() && std::chrono::steady_clock::now() < until) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        if (!stopped.load()) kill(getpid(), SIGINT);
      });
      status = RunEpsd(
          {"--listen=unix://" + path, "--metrics-listen=off", "--backend=cpu", "--drain-ms=200"},
          [](const SessionSpec&, const SessionBuffers&, const ServerConfig&,
             std::unique_ptr<StepBackend>*) -> absl::StatusOr<std::unique_ptr<StepBackend>> {
            return MarkDeviceLost(absl::InternalError("cudaMalloc: an illegal memory access"));
          });
      stopped = true;
      client.join();
      unlink((path + ".lock").c_str());
      unlink(path.c_str());  // connected: the socket serves on  // epsd keeps it
                             // (service/unix_socket.h)
      std::fprintf(stderr, "attach answered %d\n", static_cast<int>(attach_code));
      std::fflush(stderr);
    }
    std::_Exit(status);
  };
  // The Attach that met the loss answers its own INTERNAL (13); the process drains, then
  // says why it stopped and exits 1.
  EXPECT_EXIT(run(), ::testing::ExitedWithCode(1),
              "stopping \\(.*illegal memory access.*\\), draining.*"
              "stopped \\(a CUDA device was lost: exit 1\\).*attach answered 13");
}

// A step that never ends, whatever its caller does (a backend stuck in a driver call).
class StuckBackend final : public StepBackend {
 public:
  explicit StuckBackend(std::atomic<bool>* entered) : entered_(entered) {}
  BackendKind kind() const override { return BackendKind::kCpu; }
  absl::Status Run(const BackendStep&, StepOutcome*) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) {
    entered_->store(true);
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return absl::OkStatus();
  }

 private:
  std::atomic<bool>* entered_;
};

// The drain's backstop runs from the signal: it was armed only once the server's Shutdown
// returned, and Shutdown waits for every call to end, so a call that outlived its cancel
// held the backstop off with it (epsd exited 0 after the call, past the documented bound).
TEST(EpsdDrainDeathTest, AStepThatNeverEndsMeetsTheBackstopWithinItsBound) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto run = [] {
    static const std::string path = absl::StrCat("/tmp/epsd-test-stuck-", getpid(), ".sock");
    BlockStopSignals();
    static TestEngine engine(eps::testing::SmallServiceModel(), 2, 512, 2,
                             eps::testing::TestSeed());
    static std::atomic<bool> entered{false};
    std::thread([] {
      auto stub = StubFor(path);
      v1::AttachResponse attached;
      if (!AttachOnceListening(*stub, engine.Attach("engine-a"), &attached).ok()) return;
      // The process ends in epsd's backstop (_Exit), so what it leaves is removed now:
      // the engine's shm object (epsd has it mapped) and epsd's socket lock file.
      shm_unlink(engine.buffers().shm_name().c_str());
      unlink((path + ".lock").c_str());
      unlink(path.c_str());  // connected: the socket serves on
      std::thread([&stub, &attached] {
        grpc::ClientContext c;
        v1::SelectPagesResponse r;
        (void)stub->SelectPages(
            &c, TestEngine::Step(attached.session_id(), 1, {TestEngine::Row(0, 300)}), &r);
      }).detach();
      while (!entered.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      kill(getpid(), SIGTERM);
      std::this_thread::sleep_for(std::chrono::seconds(120));  // keeps stub alive
    }).detach();
    const int status =
        RunEpsd({"--listen=unix://" + path, "--metrics-listen=off", "--backend=cpu", "--drain-ms=0",
                 "--inputs-timeout-ms=1ms"},
                [](const SessionSpec&, const SessionBuffers&, const ServerConfig&,
                   std::unique_ptr<StepBackend>*) -> absl::StatusOr<std::unique_ptr<StepBackend>> {
                  return std::make_unique<StuckBackend>(&entered);
                });
    std::_Exit(status);  // not reached: the backstop exits first
  };
  const auto start = std::chrono::steady_clock::now();
  // --drain-ms=0 and --inputs-timeout-ms=1ms: the bound is 0 + max(4 s, 1 ms + 5 s).
  EXPECT_EXIT(run(), ::testing::ExitedWithCode(1), "drain timed out 5001 ms after the signal");
  // Well before the step's 60 s: the backstop came from the signal.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
}

}  // namespace
}  // namespace eps::service
