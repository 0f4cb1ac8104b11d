// client/cpp's WatchdogHandle, the C ABI's eps_engine_watchdog_* handle, over a stand-in
// device (no GPU): a call that overlaps a destroy is refused at once while the destroy
// finishes the armed step's watch, and a call already running when the destroy begins
// finishes on a live watchdog first. (The C ABI once cleared its watchdog pointer and then
// waited out the watch: an arm meanwhile dereferenced null.)
#include "client/cpp/watchdog_handle.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "tests/client/fake_watchdog_device.h"

namespace eps::client {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

std::unique_ptr<WatchdogHandle> MakeHandle(testing::FakeWatchdogDevice& device,
                                           milliseconds timeout) {
  auto made = SelectionWatchdog::Create(device.Functions(), timeout);
  EXPECT_TRUE(made.ok()) << made.status();
  if (!made.ok()) return nullptr;
  return std::make_unique<WatchdogHandle>(*std::move(made));
}

absl::Status Arm(WatchdogHandle& handle, uint64_t step) {
  return handle.Run("arm", [&](SelectionWatchdog& dog) { return dog.Arm(step); });
}

absl::Status ReadReleases(WatchdogHandle& handle, uint64_t* releases) {
  return handle.Run("releases", [&](SelectionWatchdog& dog) {
    *releases = dog.releases();
    return absl::OkStatus();
  });
}

TEST(WatchdogHandleTest, CallsOverlappingADestroyAreRefusedWhileItFinishesTheWatch) {
  testing::FakeWatchdogDevice device;  // epsd is gone: step 1 never completes
  auto handle = MakeHandle(device, milliseconds(300));
  ASSERT_TRUE(Arm(*handle, 1).ok());
  std::atomic<bool> destroyed{false};
  std::thread destroyer([&] {
    handle->Destroy();  // waits up to step 1's due time
    destroyed = true;
  });
  // Until the destroy has begun a read succeeds; from then on it is refused.
  absl::Status read;
  const auto until = Clock::now() + std::chrono::seconds(10);
  do {
    uint64_t releases = 0;
    read = ReadReleases(*handle, &releases);
  } while (read.ok() && Clock::now() < until);
  EXPECT_EQ(read.code(), absl::StatusCode::kFailedPrecondition) << read;
  EXPECT_NE(read.message().find("releases: the watchdog is being destroyed"), std::string::npos)
      << read;
  const absl::Status arm = Arm(*handle, 2);
  EXPECT_EQ(arm.code(), absl::StatusCode::kFailedPrecondition) << arm;
  destroyer.join();
  EXPECT_TRUE(destroyed);
  EXPECT_EQ(device.Released(), std::vector<uint64_t>{1});  // the refused arm armed nothing
  EXPECT_EQ(Arm(*handle, 3).code(), absl::StatusCode::kFailedPrecondition);  // and after it
}

TEST(WatchdogHandleTest, ACallRunningWhenADestroyBeginsFinishesOnALiveWatchdogFirst) {
  testing::FakeWatchdogDevice device;
  auto handle = MakeHandle(device, milliseconds(20));
  std::atomic<bool> in_call{false}, leave_call{false}, destroyed{false};
  std::thread caller([&] {
    const absl::Status s = handle->Run("arm", [&](SelectionWatchdog& dog) {
      in_call = true;
      while (!leave_call) std::this_thread::yield();
      return dog.Arm(4);  // the destroy has begun meanwhile: the watchdog must still be there
    });
    EXPECT_TRUE(s.ok()) << s;
  });
  while (!in_call) std::this_thread::yield();
  std::thread destroyer([&] {
    handle->Destroy();
    destroyed = true;
  });
  // A bounded look only lets a wrong order show: the destroy must not end under the call.
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_FALSE(destroyed);
  leave_call = true;
  caller.join();
  destroyer.join();
  EXPECT_EQ(device.Released(), std::vector<uint64_t>{4});  // the call's arm was watched
}

// A second destroy while the first still finishes an armed step's watch returns without
// waiting for that watch (it finds the watchdog gone); the first still ends it.
TEST(WatchdogHandleTest, ASecondDestroyReturnsAtOnceWhileTheFirstFinishesTheWatch) {
  testing::FakeWatchdogDevice device;  // epsd is gone: step 1 never completes
  auto handle = MakeHandle(device, milliseconds(3000));
  ASSERT_TRUE(Arm(*handle, 1).ok());
  std::atomic<bool> first_returned{false};
  std::thread first([&] {
    handle->Destroy();  // waits up to step 1's due time, 3 s
    first_returned = true;
  });
  const auto until = Clock::now() + std::chrono::seconds(10);
  uint64_t releases = 0;
  while (ReadReleases(*handle, &releases).ok() && Clock::now() < until) {
  }  // until the first destroy has begun (a call is refused)
  handle->Destroy();
  EXPECT_FALSE(first_returned);  // the second did not wait out the 3 s watch
  first.join();
  EXPECT_EQ(device.Released(), std::vector<uint64_t>{1});
  EXPECT_EQ(Arm(*handle, 3).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace eps::client
