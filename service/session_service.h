// The service-side session manager, without its transport: attach, detach,
// select, heartbeat, stats and lease expiry over the eps.v1 messages. The gRPC
// layer (service/grpc_service.h) only forwards to it, so everything here is
// testable in-process and every error is an absl::Status with a canonical code.
//
// Thread safety: all methods may be called concurrently. Steps of one session
// are serialised, one running and one parked at most (service/step_gate.h). A step
// runs on a StepExecutor (service/step_executor.h), or on the thread that started it
// while fewer than the executor's bound of steps run so (half of gRPC's callback
// threads); the session builds of Attach, and the waits of Detach and of a replacing
// Attach for the old session's running step, always run on the executor: the Start*
// calls return at once, and the gRPC callback threads stay free, enough of them, for
// other calls and for cancellations. Steps of different sessions run in parallel. Detach, a
// replacing Attach and expiry retire the old session under its step lock before they answer.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <thread>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "eps/v1/page_selector.pb.h"
#include "service/backend_kind.h"
#include "service/call_guard.h"
#include "service/config.h"
#include "service/memory_budget.h"
#include "service/peer.h"
#include "service/session_janitor.h"
#include "service/session_registry.h"
#include "service/step_executor.h"
#include "service/unsent_replies.h"

namespace eps::service {

// Whether the caller still waits for a call's answer: a call cancelled or past
// its deadline is not run (its step is neither taken nor counted). Checked when
// the call arrives and again once it holds the session's step lock, where a
// call may wait behind a slow step.
struct CallLiveness {
  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;  // may be empty
  // CANCELLED or DEADLINE_EXCEEDED when the call is dead, naming `what`.
  absl::Status Check(const char* what) const;
};

class SessionService {
 public:
  // Called once, on the thread that ran the call that found it (a gRPC callback thread or
  // the StepExecutor's), with the first status marked
  // device-lost (core/status.h) that a step or an Attach returned: a CUDA context of
  // this process is unusable, and only a new process can use the device again.
  using DeviceLostHandler = absl::AnyInvocable<void(const absl::Status& status)>;
  // Also called, on the session janitor's thread, when work abandoned on a device has kept
  // its ended sessions from being freed for longer than AbandonedStreamLimit (config.h,
  // session_janitor.h): the device is as unusable as a lost one.
  // From the first device-lost status on, every Attach and step is UNAVAILABLE ("epsd
  // is restarting"): clients forget their sessions and re-attach to the next epsd.
  // `make_backend`: Session::Create's (tests pass their own). `executor`: where steps
  // and the waits for them run; its owner stops it once no call can arrive any more
  // (the gRPC server has shut down) and before this service is destroyed, since its
  // tasks use the service. Null: the service starts one of its own
  // (StepExecutor::ForSessions) and stops it first thing in its destructor (tests that
  // hold a service without a server).
  explicit SessionService(const ServerConfig& config, DeviceLostHandler on_device_lost = nullptr,
                          BackendFactory make_backend = MakeSessionBackend,
                          StepExecutor* executor = nullptr);
  // Stops its own executor if it has one (running the steps still queued), the lease
  // reaper, and retires every session, releasing their queued steps at once, before any
  // is destroyed (service/session_janitor.h).
  ~SessionService();
  SessionService(const SessionService&) = delete;
  SessionService& operator=(const SessionService&) = delete;

  // `caller`: who made the call (service/peer.h). A session belongs to the user
  // that attached it: calls from another user are PERMISSION_DENIED, an Attach
  // of its engine_id from another user does not replace it, and the listing
  // (GetStats without a session_id) shows only the caller's own sessions,
  // never a session id (docs/security.md). Root may inspect and detach any.
  // A call whose body throws answers with CallGuarded's status (call_guard.h) and, as
  // every failed call but one whose client gave up, counts in validation_failures_total.
  //
  // Called once with a call's status.
  using CallDone = absl::AnyInvocable<void(absl::Status status) &&>;
  // Attaches a session: checks here what needs no build (a lost device, the registry's
  // limits, which count the sessions being built), then builds the session on the
  // executor (maps its buffers, builds its backend), where, when it replaces a live
  // session of the engine, it also waits for that session's running step to end
  // (Session::Retire). One Attach of an engine builds at a time: a later one is parked
  // behind it, holding no thread, and admitted once it has published or failed; a third
  // takes the parked one's place, which is answered ABORTED (SessionRegistry::BeginBuild).
  // `done` is called on the executor, or here, before returning, for a call refused here
  // (or, for an Attach it displaced, the parked one's). A call whose client gave up
  // (`liveness`) before the build builds nothing; one that gave up during the build frees
  // what it built, publishing and replacing nothing; one that gave up while it waited for
  // the old session's step ends the session it built before answering (the old one has
  // ended all the same). `request` and `response` must live until `done` is called.
  void StartAttach(const v1::AttachRequest& request, v1::AttachResponse* response,
                   CallLiveness liveness, const Peer& caller, CallDone done);
  // Removes the session here, then retires it on the executor (waiting for its running
  // step) and calls `done` there; a call refused (NOT_FOUND, PERMISSION_DENIED) is
  // answered here.
  void StartDetach(const v1::DetachRequest& request, const Peer& caller, CallDone done);
  // StartAttach and StartDetach, waiting for `done` on this thread.
  absl::Status Attach(const v1::AttachRequest& request, v1::AttachResponse* response,
                      const Peer& caller = {});
  absl::Status Detach(const v1::DetachRequest& request, const Peer& caller = {});
  // Called once with a step's status, its session's backend kind (kCpu before the
  // session is found) and its session's unsent replies (unsent_replies.h; null before the
  // session is found), where a unary call holds its reply until the client has read it.
  using SelectDone = absl::AnyInvocable<void(absl::Status status, BackendKind backend,
                                             std::shared_ptr<UnsentReplies> replies) &&>;
  // Checks the call on this thread, then runs its step through the session's StepGate:
  // on this thread while the executor grants an inline turn (StepExecutor::TakeInlineTurn),
  // else on the executor; at once when no step of the session runs, or parked behind the
  // running one, holding no thread meanwhile, until that step has ended (the running
  // step's thread returns without waiting for it); a call beyond the one parked is
  // refused at once (RESOURCE_EXHAUSTED). A step whose caller gave up (cancelled,
  // deadline passed) by the time it holds the session's step lock is answered without
  // running, its step number left free; on the cpu backend one whose caller gives up
  // while it runs stops before its next (row, layer). `done` reports each outcome: on
  // this thread for a call refused at or before the gate or run inline, else on the
  // executor; `request` and
  // `response` must live until it is called. The session is held until the step has run.
  void StartSelectPages(const v1::SelectPagesRequest& request, v1::SelectPagesResponse* response,
                        CallLiveness liveness, const Peer& caller, SelectDone done);
  // StartSelectPages, waiting for `done` on this thread.
  // `backend` (may be null): set to the session's backend kind once the session is found.
  absl::Status SelectPages(const v1::SelectPagesRequest& request, v1::SelectPagesResponse* response,
                           BackendKind* backend = nullptr, const CallLiveness& liveness = {},
                           const Peer& caller = {});
  absl::Status Heartbeat(const v1::HeartbeatRequest& request, v1::HeartbeatResponse* response,
                         const Peer& caller = {});
  absl::Status GetStats(const v1::GetStatsRequest& request, v1::GetStatsResponse* response,
                        const Peer& caller = {});

  // Expires sessions whose lease ran out; the reaper thread calls this.
  void ExpireSessions();
  size_t session_count() const { return sessions_.size(); }
  // Bytes charged to --max-server-bytes by the live sessions.
  uint64_t charged_bytes() const { return budgets_.allocated.used(); }
  // Bytes of host_shm mappings charged to --max-server-mapped-bytes by the live sessions.
  uint64_t mapped_bytes() const { return budgets_.mapped.used(); }
  // Ended cuda sessions the janitor has not freed yet (session_janitor.h); their bytes are
  // still in charged_bytes().
  uint64_t sessions_ending() const { return janitor_.pending(); }
  // The session `id` names (null when none), for tests that hold its step gate or lock.
  std::shared_ptr<Session> session_for_test(const std::string& id) const {
    return sessions_.Find(id);
  }

 private:
  SessionLimits Limits() const {
    return {.max_sessions = config_.max_sessions, .max_per_user = config_.max_sessions_per_user};
  }
  absl::Status CountFailure(absl::Status status);
  // CallGuarded(what, body) (call_guard.h), counting a call whose body threw as a failed
  // call; the body counts the failures it returns itself.
  template <typename F>
  absl::Status Guarded(const char* what, F&& body);
  // Attach up to the publication of its session, unguarded: `*granted`, the new session
  // (lease held), and `*replaced`, the live session it replaced (null when none), which
  // the caller retires before the engine hears of the new one (HandOver). A call dead
  // (`liveness`) once the session is built publishes nothing. `engine`: the request's
  // engine_id in `caller`'s namespace (EngineKey::Of), as StartAttach admitted it.
  absl::Status PublishSession(const v1::AttachRequest& request, v1::AttachResponse* response,
                              const CallLiveness& liveness, const Peer& caller,
                              const EngineKey& engine, std::shared_ptr<Session>* granted,
                              std::shared_ptr<Session>* replaced);
  // The end of an Attach: retires `replaced` (when not null: a wait for its running step)
  // and starts `granted`'s lease; a call dead by then (`liveness`) fails, and
  // BuildAndHandOver removes and retires `granted`; unguarded.
  absl::Status HandOver(std::shared_ptr<Session> replaced, Session& granted,
                        const CallLiveness& liveness);
  // An Attach after StartAttach's checks, on the executor: PublishSession, then the end of
  // the engine's build (SessionRegistry::EndBuild), then HandOver; a session published by
  // an Attach that does not answer OK is removed and retired.
  absl::Status BuildAndHandOver(const v1::AttachRequest& request, v1::AttachResponse* response,
                                const CallLiveness& liveness, const Peer& caller,
                                const EngineKey& engine);
  // Heartbeat and GetStats, unguarded.
  absl::Status RenewLease(const v1::HeartbeatRequest& request, v1::HeartbeatResponse* response,
                          const Peer& caller);
  absl::Status CollectStats(const v1::GetStatsRequest& request, v1::GetStatsResponse* response,
                            const Peer& caller);
  // `status`, after calling on_device_lost_ if it is the first device-lost one. Every
  // status that may come from a CUDA call goes through it: a step's, an Attach's, and a
  // retired session's (Session::Retire), whoever retired it.
  absl::Status WatchDevice(absl::Status status);
  // UNAVAILABLE: what every Attach and step gets once a device is lost.
  static absl::Status Restarting();
  // The session `id` names, if `caller` may use it: NOT_FOUND or PERMISSION_DENIED.
  absl::StatusOr<std::shared_ptr<Session>> FindFor(const std::string& id, const Peer& caller,
                                                   const char* hint) const;
  // The session a SelectPages names, after the checks that need no step lock (reply
  // mode, batch size); sets `kind` once it is found.
  absl::StatusOr<std::shared_ptr<Session>> CheckSelect(const v1::SelectPagesRequest& request,
                                                       const Peer& caller, BackendKind* kind);
  // Runs one validated step under the session's step lock.
  absl::Status RunStep(Session& session, const v1::SelectPagesRequest& request,
                       std::span<const StepRow> rows, const SelectPolicy& policy,
                       const CallLiveness& liveness, v1::SelectPagesResponse* response);

  const ServerConfig config_;
  // Where steps and the waits for them run: the owner's, or (null when the owner passed
  // one) its own.
  std::unique_ptr<StepExecutor> own_executor_;
  StepExecutor* const executor_;
  ServerBudgets budgets_;  // outlives the sessions that charge it
  // Before the janitor, whose thread reports a device unusable through WatchDevice.
  DeviceLostHandler on_device_lost_;
  std::atomic<bool> device_lost_{false};
  Janitor<Session> janitor_;  // destroys cuda sessions; outlives the registry
  SessionRegistry sessions_;
  std::atomic<uint64_t> next_session_{1};
  std::atomic<uint64_t> attached_total_{0}, expired_total_{0}, steps_total_{0},
      validation_failures_{0};
  const BackendFactory make_backend_;
  absl::Notification stop_;
  std::thread reaper_;
};

// Defined here for the files that implement the service (session_service.cc,
// session_attach.cc).
template <typename F>
absl::Status SessionService::Guarded(const char* what, F&& body) {
  bool threw = true;
  absl::Status status = CallGuarded(what, [&] {
    absl::Status returned = body();
    threw = false;
    return returned;
  });
  // A call that failed inside epsd is a failed call too (api.md, validation_failures_total).
  return threw ? CountFailure(std::move(status)) : status;
}

}  // namespace eps::service
