// UnsentReplies (service/unsent_replies.h): a session's replies held, parked and refused,
// places passed to the oldest parked reply, parked replies taken back, the session's end
// (held replies cancelled, parked ones dropped), and the counts consistent under concurrent
// calls.
#include "service/unsent_replies.h"

#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace eps::service {
namespace {

using Hold = UnsentReplies::Hold;
constexpr int kHeld = UnsentReplies::kMaxUnsentReplies;
constexpr int kParked = UnsentReplies::kMaxParkedReplies;

struct Reply final : UnsentReplies::Reply {
  void Resume() override { resumed.fetch_add(1); }
  void Drop() override { dropped.fetch_add(1); }
  void Cancel() override { cancelled.fetch_add(1); }
  std::atomic<int> resumed{0}, dropped{0}, cancelled{0};
};

TEST(UnsentRepliesTest, ASessionHoldsFourParksFourAndRefusesTheNext) {
  UnsentReplies u;
  std::vector<Reply> r(kHeld + kParked + 1);
  for (int i = 0; i < kHeld; ++i) EXPECT_EQ(u.TryHold(&r[i]), Hold::kHeld) << i;
  for (int i = kHeld; i < kHeld + kParked; ++i) EXPECT_EQ(u.TryHold(&r[i]), Hold::kParked);
  EXPECT_EQ(u.TryHold(&r.back()), Hold::kRefused);
  // Another session is not charged for this one's replies.
  UnsentReplies other;
  Reply o;
  EXPECT_EQ(other.TryHold(&o), Hold::kHeld);
  for (const Reply& x : r) EXPECT_EQ(x.resumed.load(), 0);
}

TEST(UnsentRepliesTest, ADoneReplyGivesItsPlaceToTheOldestParkedOne) {
  UnsentReplies u;
  std::vector<Reply> r(kHeld + 2);
  for (Reply& x : r) u.TryHold(&x);  // four held, r[4] and r[5] parked
  u.Release(&r[0]);
  EXPECT_EQ(r[kHeld].resumed.load(), 1);
  EXPECT_EQ(r[kHeld + 1].resumed.load(), 0);
  // The place passed on: the session still has four held and one parked, so one more
  // parks and a fourth parked one would still fit; a place is free only once both go.
  Reply late;
  EXPECT_EQ(u.TryHold(&late), Hold::kParked);
  u.Release(&r[1]);
  u.Release(&r[kHeld]);  // the resumed one holds a place
  EXPECT_EQ(r[kHeld + 1].resumed.load(), 1);
  EXPECT_EQ(late.resumed.load(), 1);
  for (Reply* x : {&r[2], &r[3], &r[kHeld + 1], &late}) u.Release(x);  // every place is free
  std::vector<Reply> fresh(kHeld);
  for (Reply& x : fresh) EXPECT_EQ(u.TryHold(&x), Hold::kHeld);
}

TEST(UnsentRepliesTest, AParkedReplyTakenBackIsNeverResumedAndFreesItsPlaceInLine) {
  UnsentReplies u;
  std::vector<Reply> r(kHeld + kParked);
  for (Reply& x : r) u.TryHold(&x);
  EXPECT_TRUE(u.Unpark(&r[kHeld]));   // the oldest parked, cancelled
  EXPECT_FALSE(u.Unpark(&r[kHeld]));  // not there twice
  Reply next;
  EXPECT_EQ(u.TryHold(&next), Hold::kParked);  // its place in line is free
  u.Release(&r[0]);
  EXPECT_EQ(r[kHeld].resumed.load(), 0);
  EXPECT_EQ(r[kHeld + 1].resumed.load(), 1);
  // Once resumed it holds a place: it cannot be taken back any more.
  EXPECT_FALSE(u.Unpark(&r[kHeld + 1]));
}

// A session's end: its held replies are cancelled (each released later, by its call's
// OnDone), its parked ones dropped, and nothing of it is held or parked after.
TEST(UnsentRepliesTest, TheSessionsEndCancelsItsHeldRepliesAndDropsItsParkedOnes) {
  UnsentReplies u;
  std::vector<Reply> r(kHeld + kParked);
  for (Reply& x : r) u.TryHold(&x);
  u.End();
  for (int i = 0; i < kHeld + kParked; ++i) {
    EXPECT_EQ(r[i].cancelled.load(), i < kHeld ? 1 : 0) << i;
    EXPECT_EQ(r[i].dropped.load(), i < kHeld ? 0 : 1) << i;
    EXPECT_EQ(r[i].resumed.load(), 0) << i;
  }
  EXPECT_FALSE(u.Unpark(&r[kHeld]));  // dropped: not parked any more
  Reply late;
  EXPECT_EQ(u.TryHold(&late), Hold::kEnded);                // a step that ends after the session
  for (int i = 0; i < kHeld; ++i) u.Release(&r[i]);         // the cancelled calls' OnDone
  for (const Reply& x : r) EXPECT_EQ(x.resumed.load(), 0);  // a freed place resumes nothing
  EXPECT_EQ(u.TryHold(&late), Hold::kEnded);
  u.End();  // a second end (two Detach at once) cancels what is still held: nothing
  EXPECT_EQ(r[0].cancelled.load(), 1);
}

// End cancels held replies while their calls end on other threads: a reply is never
// cancelled once its Release has returned (its reactor is destroyed then), and each held
// reply is cancelled, or released before the end, exactly once.
TEST(UnsentRepliesTest, AHeldReplyIsNeverCancelledAfterItsReleaseReturned) {
  const uint64_t seed = testing::TestSeed();
  struct Call final : UnsentReplies::Reply {
    std::atomic<bool> released{false};
    std::atomic<int> cancelled_after_release{0}, cancelled{0};
    void Resume() override {}
    void Drop() override {}
    void Cancel() override {
      cancelled.fetch_add(1);
      if (released.load()) cancelled_after_release.fetch_add(1);
      std::this_thread::yield();  // widen the window a Release could slip into
      if (released.load()) cancelled_after_release.fetch_add(1);
    }
  };
  std::mt19937_64 rng(seed);
  for (int round = 0; round < 300; ++round) {
    UnsentReplies u;
    std::vector<Call> calls(kHeld);
    for (Call& c : calls) ASSERT_EQ(u.TryHold(&c), Hold::kHeld);
    std::vector<std::thread> done;
    const size_t first = rng() % (kHeld + 1);  // some are done before the end starts
    for (size_t i = 0; i < first; ++i) {
      u.Release(&calls[i]);
      calls[i].released.store(true);
    }
    for (size_t i = first; i < calls.size(); ++i) {
      done.emplace_back([&u, c = &calls[i]] {
        u.Release(c);
        c->released.store(true);
      });
    }
    u.End();
    for (std::thread& t : done) t.join();
    for (size_t i = 0; i < calls.size(); ++i) {
      ASSERT_EQ(calls[i].cancelled_after_release.load(), 0) << i << " seed " << seed;
      ASSERT_LE(calls[i].cancelled.load(), 1) << i << " seed " << seed;
      if (i < first) {
        ASSERT_EQ(calls[i].cancelled.load(), 0) << i << " seed " << seed;
      }
    }
  }
}

// Threads hold, park, release and take back replies of a few sessions at once: every
// parked reply is resumed or taken back exactly once, and once every place is released no
// session keeps a count (each holds four again).
TEST(UnsentRepliesTest, ConcurrentCallsKeepEveryCountExact) {
  const uint64_t seed = testing::TestSeed();
  constexpr int kSessions = 3;
  std::vector<UnsentReplies> sessions(kSessions);
  // Replies the test knows hold a place, per session: a kHeld answer or a Resume adds one.
  struct Tracked final : UnsentReplies::Reply {
    std::vector<Tracked*>* places = nullptr;
    absl::Mutex* mu = nullptr;
    std::atomic<int> resumed{0}, parked{0}, taken_back{0};
    void Resume() override {
      resumed.fetch_add(1);
      absl::MutexLock lock(mu);
      places->push_back(this);
    }
    void Drop() override {}
    void Cancel() override {}
  };
  std::vector<std::vector<Tracked*>> places(kSessions);
  std::vector<absl::Mutex> mus(kSessions);
  constexpr int kThreads = 8, kCalls = 3000;
  std::vector<std::vector<Tracked>> replies(kThreads);
  for (auto& v : replies) v = std::vector<Tracked>(kCalls);
  // Takes one known place of session s, if there is one, and releases it.
  auto release_one = [&](int s) {
    Tracked* r = nullptr;
    {
      absl::MutexLock lock(&mus[s]);
      if (places[s].empty()) return false;
      r = places[s].back();
      places[s].pop_back();
    }
    sessions[s].Release(r);
    return true;
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed + t);
      std::vector<std::pair<int, Tracked*>> waiting;
      for (int i = 0; i < kCalls; ++i) {
        const int s = static_cast<int>(rng() % kSessions);
        Tracked* r = &replies[t][i];
        r->places = &places[s];
        r->mu = &mus[s];
        const Hold h = sessions[s].TryHold(r);
        if (h == Hold::kHeld) {
          absl::MutexLock lock(&mus[s]);
          places[s].push_back(r);
        }
        if (h == Hold::kParked) {
          r->parked.fetch_add(1);
          waiting.emplace_back(s, r);
        }
        if (rng() % 2 == 0) release_one(static_cast<int>(rng() % kSessions));
        if (!waiting.empty() && rng() % 3 == 0) {  // a parked call is cancelled
          const auto [ws, wr] = waiting.back();
          waiting.pop_back();
          if (sessions[ws].Unpark(wr)) wr->taken_back.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int s = 0; s < kSessions; ++s) {
    while (release_one(s)) {
    }  // resumes the rest
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
  for (int s = 0; s < kSessions; ++s) {
    std::vector<Reply> fresh(kHeld);
    for (Reply& x : fresh) {
      EXPECT_EQ(sessions[s].TryHold(&x), Hold::kHeld) << s << " seed " << seed;
    }
  }
}

}  // namespace
}  // namespace eps::service
