// SelectPages replies of one session queued for a client that has not read them yet: a
// unary call's, and a stream's while it is written (grpc_service.cc, SelectStream).
// A step frees its session's gate once it has run (step_gate.h); its reply then waits in
// gRPC's transport until the client's HTTP/2 window lets it out. A client that never opens
// its window (never reads) would so make epsd hold every reply of every step it sends,
// charged to no budget (docs/security.md, "replies never read"); a stream holds one reply
// at a time, but a client may open many streams of a session.
//
// A session may have kMaxUnsentReplies replies handed to gRPC and not yet done. A reply
// beyond them is parked: it waits, not handed to gRPC, until one of those is done, and then
// takes its place. Done is reported by gRPC's OnDone for a unary call, by the write's
// OnWriteDone for a stream's reply (the stream then lives on and may hold a place again for
// its next step); either can run well after the client
// has read the reply (a loaded host runs the callback late), so a client that reads every
// reply before its next step can still find four not yet done: parked, its reply comes
// as late as that callback, never refused. At most kMaxParkedReplies replies of a session
// are parked; a step that ends beyond them answers RESOURCE_EXHAUSTED, a status without a
// message body, which HTTP/2 sends without flow-control window. A session's replies in
// epsd's memory are so at most kMaxUnsentReplies + kMaxParkedReplies.
//
// The session owns its UnsentReplies (Session::unsent_replies), and its end (End, from
// Session::Retire) ends them: the held replies' calls are cancelled, which drops what gRPC
// keeps for them, and the parked ones are answered without their reply. Only the live
// sessions, which the session limits bound, hold replies: a client that ended its session
// and attached another, over and over, kept each ended session's eight.
//
// Thread safety: all methods may be called concurrently. Reply's methods are called with no
// lock of this class held: Resume from the Release that frees the place, Drop and Cancel
// from End. A held reply's Release (its call's OnDone, or a stream's OnWriteDone, before the
// reply is destroyed) waits while End cancels it.
#pragma once

#include <deque>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace eps::service {

class UnsentReplies {
 public:
  // A normal client has at most two calls of a session in flight (step_gate.h) and reads
  // each reply before its next step; four leave room for replies whose OnDone has not yet
  // run when the client's next calls arrive, and parked replies wait out longer delays.
  static constexpr int kMaxUnsentReplies = 4;
  static constexpr int kMaxParkedReplies = 4;

  // One call's reply (the call's reactor: a unary call's, or a stream's for its current step).
  class Reply {
   public:
    virtual ~Reply() = default;
    // The parked reply now holds a place (Release will be called for it): hand it to gRPC.
    virtual void Resume() = 0;
    // The session ended while the reply was parked: answer the call without it. It holds
    // no place (no Release for it).
    virtual void Drop() = 0;
    // The session ended while the reply was held: cancel the call. Its Release still comes
    // (a unary call's OnDone, a stream's OnWriteDone), and it is not destroyed before.
    virtual void Cancel() = 0;
  };

  enum class Hold {
    kHeld,     // counted: hand the reply to gRPC now, and Release it once it is done (a
               // unary call's end, a stream's write's end)
    kParked,   // waits: Resume comes with a place, or Drop with the session's end, unless
               // Unpark takes it back first
    kRefused,  // the session has its maximum of replies held and parked: nothing counted
    kEnded,    // the session has ended (End): nothing counted
  };

  UnsentReplies();
  UnsentReplies(const UnsentReplies&) = delete;
  UnsentReplies& operator=(const UnsentReplies&) = delete;

  // Counts `reply` as held, or parks it until a place is free.
  Hold TryHold(Reply* reply);
  // A held reply is done (written, or dropped with its connection): its place goes to the
  // oldest parked reply, if any (its Resume is called here). Waits while End cancels it.
  void Release(Reply* reply);
  // Takes back a parked reply whose call ended (cancelled): true when it was still parked
  // (no Resume or Drop will come); false when a Release has already given it a place (its
  // Resume comes or came, and it must then be released as a held reply), or End took it
  // (its Drop comes or came).
  bool Unpark(Reply* reply);
  // The session has ended: cancels the held replies, drops the parked ones, and every later
  // TryHold is kEnded. Returns once each has been called. Idempotent.
  void End();

 private:
  absl::Mutex mu_;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Reply*> held_ ABSL_GUARDED_BY(mu_);   // at most kMaxUnsentReplies
  std::deque<Reply*> parked_ ABSL_GUARDED_BY(mu_);  // oldest first
  int cancelling_ ABSL_GUARDED_BY(mu_) = 0;         // End calls running Cancel
};

}  // namespace eps::service
