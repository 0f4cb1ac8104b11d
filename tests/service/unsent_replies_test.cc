// UnsentReplies (service/unsent_replies.h): a session's replies held, parked and refused,
// places passed to the oldest parked reply, parked replies taken back, and the counts
// consistent under concurrent calls.
#include "service/unsent_replies.h"

#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace eps::service {
namespace {

using Hold = UnsentReplies::Hold;
constexpr int kHeld = UnsentReplies::kMaxUnsentReplies;
constexpr int kParked = UnsentReplies::kMaxParkedReplies;

struct Reply final : UnsentReplies::Parked {
  void Resume() override { resumed.fetch_add(1); }
  std::atomic<int> resumed{0};
};

TEST(UnsentRepliesTest, ASessionHoldsFourParksFourAndRefusesTheNext) {
  UnsentReplies u;
  std::vector<Reply> r(kHeld + kParked + 1);
  for (int i = 0; i < kHeld; ++i) EXPECT_EQ(u.TryHold("s", &r[i]), Hold::kHeld) << i;
  for (int i = kHeld; i < kHeld + kParked; ++i) EXPECT_EQ(u.TryHold("s", &r[i]), Hold::kParked);
  EXPECT_EQ(u.TryHold("s", &r.back()), Hold::kRefused);
  // Another session is not charged for this one's replies.
  Reply other;
  EXPECT_EQ(u.TryHold("t", &other), Hold::kHeld);
  for (const Reply& x : r) EXPECT_EQ(x.resumed.load(), 0);
}

TEST(UnsentRepliesTest, ADoneReplyGivesItsPlaceToTheOldestParkedOne) {
  UnsentReplies u;
  std::vector<Reply> r(kHeld + 2);
  for (Reply& x : r) u.TryHold("s", &x);  // four held, r[4] and r[5] parked
  u.Release("s");
  EXPECT_EQ(r[kHeld].resumed.load(), 1);
  EXPECT_EQ(r[kHeld + 1].resumed.load(), 0);
  // The place passed on: the session still has four held and one parked, so one more
  // parks and a fourth parked one would still fit; a place is free only once both go.
  Reply late;
  EXPECT_EQ(u.TryHold("s", &late), Hold::kParked);
  u.Release("s");
  u.Release("s");
  EXPECT_EQ(r[kHeld + 1].resumed.load(), 1);
  EXPECT_EQ(late.resumed.load(), 1);
  for (int i = 0; i < kHeld; ++i) u.Release("s");  // every place is free again
  Reply fresh;
  for (int i = 0; i < kHeld; ++i) EXPECT_EQ(u.TryHold("s", &fresh), Hold::kHeld) << i;
}

TEST(UnsentRepliesTest, AParkedReplyTakenBackIsNeverResumedAndFreesItsPlaceInLine) {
  UnsentReplies u;
  std::vector<Reply> r(kHeld + kParked);
  for (Reply& x : r) u.TryHold("s", &x);
  EXPECT_TRUE(u.Unpark("s", &r[kHeld]));   // the oldest parked, cancelled
  EXPECT_FALSE(u.Unpark("s", &r[kHeld]));  // not there twice
  Reply next;
  EXPECT_EQ(u.TryHold("s", &next), Hold::kParked);  // its place in line is free
  u.Release("s");
  EXPECT_EQ(r[kHeld].resumed.load(), 0);
  EXPECT_EQ(r[kHeld + 1].resumed.load(), 1);
  // Once resumed it holds a place: it cannot be taken back any more.
  EXPECT_FALSE(u.Unpark("s", &r[kHeld + 1]));
  EXPECT_FALSE(u.Unpark("unknown", &next));
}

// Threads hold, park, release and take back replies of a few sessions at once: every
// parked reply is resumed or taken back exactly once, and once every place is released no
// session keeps a count (each holds four again).
TEST(UnsentRepliesTest, ConcurrentCallsKeepEveryCountExact) {
  const uint64_t seed = testing::TestSeed();
  const std::vector<std::string> sessions = {"a", "b", "c"};
  // Places the test knows are held, per session: a kHeld answer or a Resume adds one.
  std::vector<std::atomic<int>> places(sessions.size());
  struct Tracked final : UnsentReplies::Parked {
    std::atomic<int>* places = nullptr;
    std::atomic<int> resumed{0}, parked{0}, taken_back{0};
    void Resume() override {
      resumed.fetch_add(1);
      places->fetch_add(1);
    }
  };
  UnsentReplies u;
  constexpr int kThreads = 8, kCalls = 3000;
  std::vector<std::vector<Tracked>> replies(kThreads);
  for (auto& v : replies) v = std::vector<Tracked>(kCalls);
  // Takes one known place of session s, if there is one, and releases it.
  auto release_one = [&](int s) {
    int n = places[s].load();
    while (n > 0 && !places[s].compare_exchange_weak(n, n - 1)) {
    }
    if (n > 0) u.Release(sessions[s]);
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed + t);
      std::vector<std::pair<int, Tracked*>> waiting;
      for (int i = 0; i < kCalls; ++i) {
        const int s = static_cast<int>(rng() % sessions.size());
        Tracked* r = &replies[t][i];
        r->places = &places[s];
        const Hold h = u.TryHold(sessions[s], r);
        if (h == Hold::kHeld) places[s].fetch_add(1);
        if (h == Hold::kParked) {
          r->parked.fetch_add(1);
          waiting.emplace_back(s, r);
        }
        if (rng() % 2 == 0) release_one(static_cast<int>(rng() % sessions.size()));
        if (!waiting.empty() && rng() % 3 == 0) {  // a parked call is cancelled
          const auto [ws, wr] = waiting.back();
          waiting.pop_back();
          if (u.Unpark(sessions[ws], wr)) wr->taken_back.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (size_t s = 0; s < sessions.size(); ++s) {
    while (places[s].load() > 0) release_one(static_cast<int>(s));  // resumes the rest
  }
  int parked = 0, resumed = 0;
  for (auto& v : replies) {
    for (Tracked& r : v) {
      parked += r.parked.load();
      resumed += r.resumed.load();
      ASSERT_EQ(r.resumed.load() + r.taken_back.load(), r.parked.load()) << "seed " << seed;
    }
  }
  EXPECT_GT(parked, 0) << "seed " << seed;  // the test parked replies at all
  EXPECT_GT(resumed, 0) << "seed " << seed;
  for (const std::string& s : sessions) {
    Reply fresh;
    for (int i = 0; i < kHeld; ++i) {
      EXPECT_EQ(u.TryHold(s, &fresh), Hold::kHeld) << s << " " << i << " seed " << seed;
    }
  }
}

}  // namespace
}  // namespace eps::service
