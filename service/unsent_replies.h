// Unary SelectPages replies queued for a client that has not read them yet, per session.
// A step frees its session's gate once it has run (step_gate.h); its reply then waits in
// gRPC's transport until the client's HTTP/2 window lets it out. A client that never opens
// its window (never reads) would so make epsd hold every reply of every step it sends,
// charged to no budget (docs/security.md, "replies never read").
//
// A session may have kMaxUnsentReplies replies handed to gRPC and not yet done. A reply
// beyond them is parked: it waits, not handed to gRPC, until one of those is done, and then
// takes its place. Done is reported by gRPC's OnDone, which can run well after the client
// has read the reply (a loaded host runs the callback late), so a client that reads every
// reply before its next step can still find four not yet done: parked, its reply comes
// as late as that callback, never refused. At most kMaxParkedReplies replies of a session
// are parked; a step that ends beyond them answers RESOURCE_EXHAUSTED, a status without a
// message body, which HTTP/2 sends without flow-control window. A session's replies in
// epsd's memory are so at most kMaxUnsentReplies + kMaxParkedReplies.
//
// Thread safety: all methods may be called concurrently. A parked reply's Resume is called
// from the Release that frees its place, on that caller's thread, with no lock held.
#pragma once

#include <deque>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace eps::service {

class UnsentReplies {
 public:
  // A normal client has at most two calls of a session in flight (step_gate.h) and reads
  // each reply before its next step; four leave room for replies whose OnDone has not yet
  // run when the client's next calls arrive, and parked replies wait out longer delays.
  static constexpr int kMaxUnsentReplies = 4;
  static constexpr int kMaxParkedReplies = 4;

  // A reply that may wait for a place (the call's reactor).
  class Parked {
   public:
    virtual ~Parked() = default;
    // The reply now holds a place (Release will be called for it): hand it to gRPC.
    virtual void Resume() = 0;
  };

  enum class Hold {
    kHeld,     // counted: hand the reply to gRPC now
    kParked,   // waits: `parked->Resume()` comes with a place, unless Unpark takes it back
    kRefused,  // the session has its maximum of replies held and parked: nothing counted
  };

  // Counts one more reply of `session`, or parks `parked` (not null) until a place is free.
  Hold TryHold(const std::string& session, Parked* parked);
  // A reply that held a place is done (written, or dropped with its connection): the place
  // goes to the session's oldest parked reply, if any (its Resume is called here).
  void Release(const std::string& session);
  // Takes back a parked reply whose call ended (cancelled): true when it was still parked
  // (no Resume will come); false when a Release has already given it a place (its Resume
  // comes or came, and it must then be released as a held reply).
  bool Unpark(const std::string& session, Parked* parked);

 private:
  struct Entry {
    int held = 0;
    std::deque<Parked*> parked;  // oldest first
  };
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> sessions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace eps::service
