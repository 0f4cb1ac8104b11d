// The janitor's deferral (service/session_janitor.h) with a stand-in for Session: what
// frees no device memory is destroyed at once, what does waits until it is safe and is
// told how long it has been put off, and at shutdown what is still unsafe is left.
#include "service/session_janitor.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "gtest/gtest.h"

namespace eps::service {
namespace {

using Clock = std::chrono::steady_clock;

struct Item {
  bool defers = true;
  std::atomic<bool>* safe = nullptr;
  std::atomic<int>* destroyed = nullptr;
  // What CheckDeviceUsable answers (OK when null), and how often it was asked.
  const absl::Status* usable = nullptr;
  mutable std::atomic<int> asked{0};
  mutable std::atomic<int64_t> longest_put_off_ms{-1};  // the largest `put_off` seen, finite

  ~Item() { destroyed->fetch_add(1); }
  bool DefersDestruction() const { return defers; }
  bool SafeToDestroy(Clock::duration put_off) const {
    if (put_off != Clock::duration::max()) {
      const int64_t ms = std::chrono::duration_cast<std::chrono::milliseconds>(put_off).count();
      if (ms > longest_put_off_ms.load()) longest_put_off_ms.store(ms);
    }
    return safe->load();
  }
  absl::Status CheckDeviceUsable(Clock::duration) const {
    asked.fetch_add(1);
    return usable == nullptr ? absl::OkStatus() : *usable;
  }
};

// Polls `done` for up to 10 s (a loaded machine); true when it held.
template <typename F>
bool Eventually(F done) {
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

TEST(JanitorTest, WhatFreesNoDeviceMemoryIsDestroyedWhereItWasDropped) {
  std::atomic<bool> safe{false};
  std::atomic<int> destroyed{0};
  Janitor<Item> janitor;
  janitor.Dispose(new Item{.defers = false, .safe = &safe, .destroyed = &destroyed});
  EXPECT_EQ(destroyed.load(), 1);  // before Dispose returned, unsafe or not
  EXPECT_EQ(janitor.pending(), 0u);
}

TEST(JanitorTest, AnItemWaitsUntilItIsSafeAndIsToldHowLongItWasPutOff) {
  std::atomic<bool> safe{false};
  std::atomic<int> destroyed{0};
  Janitor<Item> janitor;
  auto* item = new Item{.safe = &safe, .destroyed = &destroyed};
  janitor.Dispose(item);
  EXPECT_EQ(destroyed.load(), 0);
  EXPECT_EQ(janitor.pending(), 1u);
  // Checked again and again, with a growing put-off, and never destroyed while unsafe.
  ASSERT_TRUE(Eventually([&] { return item->longest_put_off_ms.load() >= 100; }));
  EXPECT_EQ(destroyed.load(), 0);
  safe.store(true);
  ASSERT_TRUE(Eventually([&] { return destroyed.load() == 1; }));
  // The count drops after the item's destructor returns, on the janitor's thread.
  EXPECT_TRUE(Eventually([&] { return janitor.pending() == 0u; }));
}

TEST(JanitorTest, OneUnsafeItemDoesNotHoldUpTheOthers) {
  std::atomic<bool> never{false}, safe{true};
  std::atomic<int> stuck_destroyed{0}, destroyed{0};
  auto* stuck = new Item{.safe = &never, .destroyed = &stuck_destroyed};
  {
    Janitor<Item> janitor;
    janitor.Dispose(stuck);
    janitor.Dispose(new Item{.safe = &safe, .destroyed = &destroyed});
    janitor.Dispose(new Item{.safe = &safe, .destroyed = &destroyed});
    ASSERT_TRUE(Eventually([&] { return destroyed.load() == 2; }));
    EXPECT_EQ(stuck_destroyed.load(), 0);
    EXPECT_TRUE(Eventually([&] { return janitor.pending() == 1; }));
    // Shutdown: what is still unsafe even now is left to the exit, not waited for.
  }
  EXPECT_EQ(stuck_destroyed.load(), 0);
  delete stuck;  // the exit's part, here
}

// Work abandoned on a device past the bound: reported once, however often the janitor
// finds the item still unsafe afterwards.
TEST(JanitorTest, AnUnusableDeviceIsReportedOnceWhileItsItemWaits) {
  std::atomic<bool> safe{false};
  std::atomic<int> destroyed{0};
  const absl::Status unusable = absl::UnavailableError("device 0: a stream abandoned");
  std::atomic<int> reported{0};
  auto* item = new Item{.safe = &safe, .destroyed = &destroyed, .usable = &unusable};
  {
    Janitor<Item> janitor(std::chrono::milliseconds(1), [&](const absl::Status& s) {
      EXPECT_EQ(s, unusable);
      reported.fetch_add(1);
    });
    janitor.Dispose(item);
    ASSERT_TRUE(Eventually([&] { return item->asked.load() >= 1 && reported.load() == 1; }));
    ASSERT_TRUE(Eventually([&] { return item->longest_put_off_ms.load() >= 100; }));
    EXPECT_EQ(reported.load(), 1);
    safe.store(true);
  }
  EXPECT_EQ(destroyed.load(), 1);
}

// An item that is safe at its first check never makes the janitor ask about its device.
TEST(JanitorTest, ASafeItemIsNotAskedAboutItsDevice) {
  std::atomic<bool> safe{true};
  std::atomic<int> destroyed{0};
  const absl::Status unusable = absl::UnavailableError("device 0: a stream abandoned");
  std::atomic<int> reported{0};
  Janitor<Item> janitor(std::chrono::milliseconds(1),
                        [&](const absl::Status&) { reported.fetch_add(1); });
  auto* item = new Item{.safe = &safe, .destroyed = &destroyed, .usable = &unusable};
  janitor.Dispose(item);
  ASSERT_TRUE(Eventually([&] { return destroyed.load() == 1; }));
  EXPECT_EQ(reported.load(), 0);
}

TEST(JanitorTest, ShutdownDestroysWhatIsSafeByThen) {
  std::atomic<bool> safe{false};
  std::atomic<int> destroyed{0};
  {
    Janitor<Item> janitor;
    for (int i = 0; i < 3; ++i) {
      janitor.Dispose(new Item{.safe = &safe, .destroyed = &destroyed});
    }
    EXPECT_EQ(destroyed.load(), 0);
    safe.store(true);  // as ~SessionService makes it, releasing every queued step first
  }
  EXPECT_EQ(destroyed.load(), 3);
}

}  // namespace
}  // namespace eps::service
