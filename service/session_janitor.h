// Where a cuda session is destroyed: on a thread of its own, not on the thread of the
// call or the lease reaper that dropped its last reference.
//
// Freeing a session's device and pinned memory (cudaFree, cudaFreeHost) waits for every
// stream on the device, another session's too, and holds the device's other CUDA calls
// meanwhile; an async session keeps a stream wait on its engine's inputs_ready queued
// between its calls, which only that session's next call, its Detach or its expiry
// releases (service/cuda_backend.cc), itself through CUDA calls. Destroyed on the
// caller's thread, engine B's Detach would wait for engine A's next step, and so would
// the lease reaper, which then never expires A: an engine that died mid-step held every
// other session's end, every later expiry and every Attach, for good.
//
// Here a session is destroyed once its backend says it is safe (StepBackend::
// SafeToDestroy, given how long it has been put off): for the cuda backend, once no
// other stream on its device has queued work, or once it has been put off for
// --inputs-timeout-ms and no other stream holds a wait queued longer ago than that
// (gpu/live_streams.h: a dead engine's wait ages past it; a healthy engine's lasts a
// step). Until A's end releases its wait (its expiry, then --inputs-timeout-ms) no
// thread sits in a device-wide wait that could hold up that release. Meanwhile the
// session's memory stays allocated, mapped and charged to --max-server-bytes. Not proof
// against an engine that dies between the check and the free (a window of one step).
//
// One wait has no end of its own: a stream abandoned with work that may still run (an
// engine lowered inputs_ready below its step after epsd released the wait: gpu/step.cu,
// gpu/live_streams.h) drains only if that engine raises the counter again, and until it
// does no session on its device is safe to destroy. Such an engine may exit and never do
// so; then every later session on the device would keep its memory, mappings and budget
// for good, for every user. So while an item waits, the janitor asks it
// (CheckDeviceUsable) whether such work on its device has run past `abandoned_limit`,
// and reports the first such status, once, to `on_unusable`: the service treats it as a
// lost device (it stops serving, drains and exits so that its supervisor restarts it).
//
// Sessions whose backend frees no device memory (cpu) are destroyed at once, where
// they were, so that their memory budget is returned before the call that ended them
// answers. A template only so that its tests can use a stand-in for Session.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace eps::service {

// T: `bool DefersDestruction() const` (destroy on the janitor's thread),
// `bool SafeToDestroy(std::chrono::steady_clock::duration put_off) const` and
// `absl::Status CheckDeviceUsable(std::chrono::steady_clock::duration limit) const` (not
// OK once work abandoned on its device has run longer than `limit`).
template <typename T>
class Janitor {
 public:
  using UnusableHandler = absl::AnyInvocable<void(const absl::Status& status)>;
  // `on_unusable` (may be null) is called on the janitor's thread, at most once; it must
  // stay callable until the janitor is destroyed.
  explicit Janitor(std::chrono::steady_clock::duration abandoned_limit =
                       std::chrono::steady_clock::duration::max(),
                   UnusableHandler on_unusable = nullptr)
      : abandoned_limit_(abandoned_limit),
        on_unusable_(std::move(on_unusable)),
        thread_([this] { Run(); }) {}
  // Destroys every item still queued, except those not safe to destroy even now (an
  // abandoned stream: left to the process's exit rather than block it); joins.
  ~Janitor() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  Janitor(const Janitor&) = delete;
  Janitor& operator=(const Janitor&) = delete;

  // The deleter of an item's shared_ptr.
  void Dispose(T* item) {
    std::unique_ptr<T> owned(item);
    if (owned == nullptr || !owned->DefersDestruction()) return;  // destroyed here
    absl::MutexLock lock(&mu_);
    queue_.push_back({std::move(owned), std::chrono::steady_clock::now()});
    ++pending_;
  }

  // Items handed over and not yet destroyed (nor left to the exit).
  size_t pending() const {
    absl::MutexLock lock(&mu_);
    return pending_;
  }

 private:
  struct Ended {
    std::unique_ptr<T> item;
    std::chrono::steady_clock::time_point ended;  // when it was queued
  };

  void Run() {
    bool reported_unusable = false;  // on_unusable_ was called
    for (;;) {
      Ended next;
      bool stopping = false;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &Janitor::Ready));
        if (queue_.empty()) return;  // stopping, and nothing left
        next = std::move(queue_.front());
        queue_.pop_front();
        stopping = stop_;
      }
      // At shutdown every queued step was released before the sessions were dropped
      // (~SessionService): what is still unsafe then is left to the exit.
      const auto put_off = stopping ? std::chrono::steady_clock::duration::max()
                                    : std::chrono::steady_clock::now() - next.ended;
      const bool safe = next.item->SafeToDestroy(put_off);
      if (!safe && !stopping) {
        if (!reported_unusable) {
          absl::Status usable = next.item->CheckDeviceUsable(abandoned_limit_);
          if (!usable.ok()) {
            reported_unusable = true;
            if (on_unusable_) on_unusable_(usable);
          }
        }
        {
          absl::MutexLock lock(&mu_);
          queue_.push_back(std::move(next));
        }
        absl::SleepFor(absl::Milliseconds(10));
        continue;
      }
      if (!safe) (void)next.item.release();  // NOLINT(bugprone-unused-return-value): intended
      next.item.reset();                     // outside the lock
      absl::MutexLock lock(&mu_);
      --pending_;
    }
  }
  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); }

  const std::chrono::steady_clock::duration abandoned_limit_;
  UnusableHandler on_unusable_;  // used by Run's thread only
  mutable absl::Mutex mu_;
  std::deque<Ended> queue_ ABSL_GUARDED_BY(mu_);
  size_t pending_ ABSL_GUARDED_BY(mu_) = 0;  // in queue_, or being checked by Run
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace eps::service
