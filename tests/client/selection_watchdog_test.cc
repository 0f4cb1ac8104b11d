// client/cpp's SelectionWatchdog over a stand-in device (a counter and a release log, no
// GPU): a step that never completes is released at its due time, a completed one is not,
// a newer Arm supersedes an older one, destroying the watchdog finishes the armed step's
// watch (released at its due time, or not at all once done), and timeouts it cannot keep
// are refused.
#include "client/cpp/selection_watchdog.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace eps::client {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// selection_done and the releases, as the device's two functions see them.
struct FakeDevice {
  std::atomic<uint64_t> done{0};
  std::atomic<bool> read_fails{false};
  std::mutex mu;
  std::vector<uint64_t> released;  // guarded by mu

  SelectionWatchdog::Device Functions() {
    return {.read_done = [this]() -> absl::StatusOr<uint64_t> {
              if (read_fails) return absl::InternalError("the device is gone");
              return done.load();
            },
            .release_dense =
                [this](uint64_t step) {
                  std::lock_guard lock(mu);
                  released.push_back(step);
                  uint64_t now = done.load();
                  while (now < step && !done.compare_exchange_weak(now, step)) {
                  }
                  return absl::OkStatus();
                }};
  }
  std::vector<uint64_t> Released() {
    std::lock_guard lock(mu);
    return released;
  }
};

std::unique_ptr<SelectionWatchdog> Make(FakeDevice& device, milliseconds timeout) {
  auto made = SelectionWatchdog::Create(device.Functions(), timeout);
  EXPECT_TRUE(made.ok()) << made.status();
  return made.ok() ? *std::move(made) : nullptr;
}

bool WaitFor(const std::function<bool()>& what, milliseconds within) {
  const auto until = Clock::now() + within;
  while (!what()) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(milliseconds(1));
  }
  return true;
}

TEST(SelectionWatchdogTest, AStepThatNeverCompletesIsReleasedAtItsDueTimeAndACompletedOneIsNot) {
  FakeDevice device;
  auto dog = Make(device, milliseconds(20));
  device.done = 4;
  dog->Arm(4);  // completed before it is due
  std::this_thread::sleep_for(milliseconds(80));
  EXPECT_TRUE(device.Released().empty());
  const auto armed = Clock::now();
  dog->Arm(5);  // never completed
  ASSERT_TRUE(WaitFor([&] { return dog->releases() == 1; }, milliseconds(10000)));
  EXPECT_GE(Clock::now() - armed, milliseconds(20));
  EXPECT_EQ(device.Released(), std::vector<uint64_t>{5});
  EXPECT_EQ(device.done.load(), 5u);
}

TEST(SelectionWatchdogTest, ANewerArmSupersedesAnOlderOne) {
  FakeDevice device;
  auto dog = Make(device, milliseconds(60));
  dog->Arm(1);
  dog->Arm(2);
  ASSERT_TRUE(WaitFor([&] { return dog->releases() == 1; }, milliseconds(10000)));
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_EQ(device.Released(), std::vector<uint64_t>{2});  // one release, of the newer step
}

TEST(SelectionWatchdogTest, AFailedReadReleasesTheStep) {
  FakeDevice device;
  device.read_fails = true;
  auto dog = Make(device, milliseconds(10));
  dog->Arm(7);
  ASSERT_TRUE(WaitFor([&] { return dog->releases() == 1; }, milliseconds(10000)));
  EXPECT_EQ(device.Released(), std::vector<uint64_t>{7});
}

// The destroy once dropped the armed step: an engine shutting down while epsd was gone
// left its stream waiting on selection_done for good.
TEST(SelectionWatchdogTest, DestroyingItReleasesTheArmedStepAtItsDueTime) {
  FakeDevice device;
  auto dog = Make(device, milliseconds(100));
  const auto armed = Clock::now();
  dog->Arm(3);
  dog.reset();
  EXPECT_GE(Clock::now() - armed, milliseconds(100));  // not before it was due
  EXPECT_EQ(device.Released(), std::vector<uint64_t>{3});
}

TEST(SelectionWatchdogTest, DestroyingItReturnsOnceTheArmedStepCompletesWithoutReleasingIt) {
  FakeDevice device;
  auto dog = Make(device, milliseconds(60000));
  dog->Arm(9);
  std::thread epsd([&] {
    std::this_thread::sleep_for(milliseconds(30));
    device.done = 9;
  });
  const auto start = Clock::now();
  dog.reset();
  EXPECT_LT(Clock::now() - start, milliseconds(30000));  // far before the minute's due time
  epsd.join();
  EXPECT_TRUE(device.Released().empty());
}

TEST(SelectionWatchdogTest, DestroyingItWithNothingArmedTouchesNothing) {
  FakeDevice device;
  auto dog = Make(device, milliseconds(60000));
  const auto start = Clock::now();
  dog.reset();
  EXPECT_LT(Clock::now() - start, milliseconds(30000));
  EXPECT_TRUE(device.Released().empty());
}

TEST(SelectionWatchdogTest, TimeoutsItCannotKeepAndMissingFunctionsAreRefused) {
  FakeDevice device;
  for (const std::chrono::microseconds timeout :
       {std::chrono::microseconds(0), std::chrono::microseconds(-1),
        SelectionWatchdog::kMaxTimeout + std::chrono::microseconds(1),
        std::chrono::microseconds::max()}) {
    auto made = SelectionWatchdog::Create(device.Functions(), timeout);
    ASSERT_FALSE(made.ok()) << timeout.count();
    EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(made.status().message().find("must be in [1, 3600000000] us"), std::string::npos)
        << made.status();
  }
  EXPECT_TRUE(SelectionWatchdog::Create(device.Functions(), SelectionWatchdog::kMaxTimeout).ok());
  auto missing =
      SelectionWatchdog::Create({.read_done = nullptr, .release_dense = nullptr}, milliseconds(1));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace eps::client
