// Work a session abandoned on its device (gpu/live_streams.h) that never drains: past a
// bound (ServerConfig::abandoned_stream_limit_ms) the device counts as lost, through the
// same handler as a lost context (backend_fault_test.cc), since no later ended session on
// it could ever be freed. Stand-in backends on the cpu backend.
#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "core/status.h"
#include "gtest/gtest.h"
#include "service/config.h"
#include "service/session_service.h"
#include "tests/core/test_util.h"
#include "tests/service/forwarding_backend.h"
#include "tests/service/test_engine.h"

namespace eps::service {
namespace {

using eps::testing::TestEngine;

// Polls `done` for up to 10 s (a loaded machine); true when it held.
template <typename F>
bool Eventually(F done) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// Work abandoned on a device (an engine lowered inputs_ready below its step after epsd
// released the wait, gpu/step.cu): until it drains, which only its engine can make it do,
// no ended session on the device is safe to destroy. The state a cuda backend sees through
// gpu/live_streams.h, shared by the stand-ins of one device.
struct AbandonedDevice {
  absl::Mutex mu;
  std::optional<std::chrono::steady_clock::time_point> since ABSL_GUARDED_BY(mu);
  std::atomic<int> checked{0};  // SafeToDestroy calls
  std::atomic<int> asked{0};    // AbandonedWorkSince calls while work was abandoned

  void Abandon() {
    absl::MutexLock lock(&mu);
    since = std::chrono::steady_clock::now();
  }
  void Drain() {
    absl::MutexLock lock(&mu);
    since.reset();
  }
  std::optional<std::chrono::steady_clock::time_point> Since() {
    absl::MutexLock lock(&mu);
    return since;
  }
};

// A cuda-like session over the cpu backend whose end abandons its stream on `device`.
class AbandoningBackend final : public ForwardingBackend {
 public:
  AbandoningBackend(std::unique_ptr<StepBackend> inner, AbandonedDevice* device)
      : ForwardingBackend(std::move(inner)), device_(device) {}
  BackendKind kind() const override { return BackendKind::kCuda; }
  bool frees_device_memory() const override { return true; }
  bool SafeToDestroy(std::chrono::steady_clock::duration) const override {
    device_->checked.fetch_add(1);
    return !device_->Since().has_value();
  }
  std::optional<std::chrono::steady_clock::time_point> AbandonedWorkSince() const override {
    std::optional<std::chrono::steady_clock::time_point> since = device_->Since();
    if (since.has_value()) device_->asked.fetch_add(1);
    return since;
  }

 protected:
  // The end of a session (not epsd's shutdown, which releases at once): the release's
  // drain did not pass (gpu/inputs_wait.cu), and the stream is abandoned.
  absl::Status FinishQueued(bool release_now) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(step_mu_) {
    if (!release_now) device_->Abandon();
    return absl::OkStatus();
  }

 private:
  AbandonedDevice* device_;
};

class AbandonedStreamTest : public ::testing::Test {
 protected:
  // A service whose bound on abandoned work (ServerConfig::abandoned_stream_limit_ms) is
  // `limit_ms`.
  void Start(uint32_t limit_ms) {
    config_.abandoned_stream_limit_ms = limit_ms;
    service_ = std::make_unique<SessionService>(
        config_,
        [this](const absl::Status& s) {
          absl::MutexLock lock(&mu_);
          seen_.push_back(s);
        },
        WrapCpuBackend<AbandoningBackend>(&device_));
  }
  ~AbandonedStreamTest() override {
    device_.Drain();  // what is still queued is destroyed with the service
    service_.reset();
  }
  // Attaches engine `id` and detaches it: its end abandons its stream.
  void AttachAndDetach(const std::string& id) {
    v1::AttachResponse attached;
    ASSERT_TRUE(service_->Attach(engine_.Attach(id), &attached).ok());
    v1::DetachRequest detach;
    detach.set_session_id(attached.session_id());
    ASSERT_TRUE(service_->Detach(detach).ok());
  }
  std::vector<absl::Status> seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

  TestEngine engine_{eps::testing::SmallServiceModel(), 2, 512, 2, eps::testing::TestSeed()};
  AbandonedDevice device_;
  ServerConfig config_;
  absl::Mutex mu_;
  std::vector<absl::Status> seen_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<SessionService> service_;
};

// Past the bound the device counts as lost: the handler (epsd: NOT_SERVING, drain, exit 1
// so that the supervisor restarts it) runs once, naming the device, and Attaches are
// refused as restarting. Before, epsd kept every later session's memory for good.
TEST_F(AbandonedStreamTest, WorkAbandonedPastTheBoundCallsTheHandlerOnceAndRefusesAttaches) {
  Start(/*limit_ms=*/100);
  AttachAndDetach("engine-a");
  EXPECT_EQ(service_->sessions_ending(), 1u);
  ASSERT_TRUE(Eventually([&] { return !seen().empty(); }));
  const std::vector<absl::Status> lost = seen();
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_TRUE(IsDeviceLost(lost[0])) << lost[0];
  EXPECT_NE(lost[0].message().find("device 0"), std::string_view::npos) << lost[0];
  EXPECT_NE(lost[0].message().find("abandoned"), std::string_view::npos) << lost[0];
  v1::AttachResponse response;
  const absl::Status refused = service_->Attach(engine_.Attach("engine-b"), &response);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_NE(refused.message().find("restarting"), std::string_view::npos) << refused;
  // The janitor goes on checking (the session is still unsafe) without reporting again.
  const int checked = device_.checked.load();
  ASSERT_TRUE(Eventually([&] { return device_.checked.load() > checked + 3; }));
  EXPECT_EQ(seen().size(), 1u);
}

// An abandoned stream of a live engine may still drain (the engine raises its counter
// again): within the bound nothing fires, and the ended session is freed once it has.
TEST_F(AbandonedStreamTest, WorkThatDrainsWithinTheBoundStopsNothing) {
  Start(/*limit_ms=*/600000);
  AttachAndDetach("engine-a");
  EXPECT_EQ(service_->sessions_ending(), 1u);
  // The janitor has asked about the abandoned work, more than once, and let it run on.
  ASSERT_TRUE(Eventually([&] { return device_.asked.load() > 3; }));
  device_.Drain();
  EXPECT_TRUE(Eventually([&] { return service_->sessions_ending() == 0; }));
  EXPECT_TRUE(seen().empty());
  v1::AttachResponse response;
  EXPECT_TRUE(service_->Attach(engine_.Attach("engine-b"), &response).ok());
}

}  // namespace
}  // namespace eps::service
