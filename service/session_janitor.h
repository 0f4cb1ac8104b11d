// Where a cuda session is destroyed: on a thread of its own, not on the thread of the
// call or the lease reaper that dropped its last reference.
//
// Freeing a session's device and pinned memory (cudaFree, cudaFreeHost) waits for every
// stream on the device, another session's too, and an async session keeps a stream
// wait on its engine's inputs_ready queued between its calls, which only that session's
// next call, its Detach or its expiry releases (service/cuda_backend.cc). Destroyed on
// the caller's thread, engine B's Detach would wait for engine A's next step, and so
// would the lease reaper, which then never expires A: an engine that died mid-step held
// every other session's end, and every later expiry, for good. Here a session is
// destroyed once no other session's stream on its device has queued work, or, since a
// healthy async engine keeps short waits queued nearly all the time, once it has been
// put off for --inputs-timeout-ms and no other session holds a wait older than that
// (gpu/live_streams.h): a dead engine's wait ages past it, and until A's end releases
// it (its expiry, then --inputs-timeout-ms) no thread sits in a device-wide wait that
// could hold up that release. Meanwhile the session's memory stays allocated, mapped
// and charged to --max-server-bytes. Not proof against an engine that dies between the
// check and the free (a window of one healthy step).
//
// cpu sessions free no device memory: they are destroyed at once, where they were, so
// that their memory budget is returned before the call that ended them answers.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "service/session.h"

namespace eps::service {

class SessionJanitor {
 public:
  SessionJanitor();
  // Destroys every session still queued (those that would wait on an abandoned stream are
  // left to the process's exit), then joins its thread.
  ~SessionJanitor();
  SessionJanitor(const SessionJanitor&) = delete;
  SessionJanitor& operator=(const SessionJanitor&) = delete;

  // The deleter of a session's shared_ptr: a cuda session is queued for the thread,
  // any other destroyed here.
  void Dispose(Session* session);

 private:
  struct Ended {
    std::unique_ptr<Session> session;
    std::chrono::steady_clock::time_point ended;  // when it was queued
  };
  void Run();

  absl::Mutex mu_;
  std::deque<Ended> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace eps::service
