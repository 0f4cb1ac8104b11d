// SessionService's Attach (service/session_service.h): the cheap admission on the caller's
// thread, then on the StepExecutor the build between the registry's BeginBuild and EndBuild
// (one build per engine, counted against the session limits), the publication and the
// hand-over from a replaced session.
#include <sys/random.h>

#include <string>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_format.h"
#include "core/status.h"
#include "service/convert.h"
#include "service/session_service.h"

namespace eps::service {
namespace {

// A capability: 128 bits from the kernel's CSPRNG, returned only to the attacher
// (docs/security.md). The counter only makes a collision with a live id impossible.
std::string NewSessionId(uint64_t counter) {
  uint64_t random[2] = {0, 0};
  size_t filled = 0;
  while (filled < sizeof(random)) {
    const ssize_t n =
        getrandom(reinterpret_cast<char*>(random) + filled, sizeof(random) - filled, 0);
    if (n > 0) filled += static_cast<size_t>(n);
  }
  return absl::StrFormat("s-%x-%016x%016x", counter, random[0], random[1]);
}

}  // namespace

void SessionService::StartAttach(const v1::AttachRequest& request, v1::AttachResponse* response,
                                 CallLiveness liveness, const Peer& caller, CallDone done) {
  // Refused here, on the caller's thread, when it would be without a build: these checks
  // cost a lookup. Admitted, it holds the engine's build (one at a time per engine) and,
  // for an engine with no live session, a slot of the limits, until it publishes or fails.
  const EngineKey engine = EngineKey::Of(caller, request.engine_id());
  auto start = [this, &request, response, liveness = std::move(liveness), caller, engine,
                done = std::move(done)](absl::Status admitted) mutable {
    if (!admitted.ok()) {
      // A call parked behind another build of its engine may have died meanwhile.
      absl::Status alive = liveness.Check("Attach");
      std::move(done)(alive.ok() ? CountFailure(std::move(admitted)) : std::move(alive));
      return;
    }
    // The build (mapping the engine's shared memory, opening its CUDA IPC handles,
    // allocating) and, for a replacing Attach, the wait for the old session's running step
    // run on the executor, as a step does, not on this thread (a gRPC callback thread):
    // Attaches of several engines at once, or one whose buffers map slowly, held every
    // callback thread, and every other engine's calls waited.
    executor_->Submit([this, &request, response, liveness = std::move(liveness), caller,
                       engine = std::move(engine), done = std::move(done)]() mutable {
      std::move(done)(BuildAndHandOver(request, response, liveness, caller, engine));
    });
  };
  if (device_lost_.load()) {
    std::move(start)(Restarting());
    return;
  }
  sessions_.BeginBuild(engine, Limits(), std::move(start));
}

absl::Status SessionService::BuildAndHandOver(const v1::AttachRequest& request,
                                              v1::AttachResponse* response,
                                              const CallLiveness& liveness, const Peer& caller,
                                              const EngineKey& engine) {
  std::shared_ptr<Session> granted, replaced;
  // Unless the Attach answers OK, no engine hears of the session it published: it goes
  // now, whatever failed (or threw) after Add, rather than stay published with its lease
  // held, for good.
  absl::Cleanup unpublish = [&] {
    if (granted == nullptr) return;
    response->Clear();
    if (const std::shared_ptr<Session> removed = sessions_.Remove(granted->id());
        removed != nullptr) {
      (void)WatchDevice(removed->Retire());
    }
  };
  // A call whose client gave up while it was queued builds nothing (not counted as a
  // failure, as a step found dead is not).
  absl::Status status = Guarded("Attach", [&]() -> absl::Status {
    RETURN_IF_ERROR(liveness.Check("Attach"));
    return PublishSession(request, response, liveness, caller, engine, &granted, &replaced);
  });
  // Published or failed, the engine's build has ended: its next Attach may build.
  absl::Status ended = Guarded("Attach", [&] {
    sessions_.EndBuild(engine, Limits());
    return absl::OkStatus();
  });
  if (!status.ok()) return status;
  if (!ended.ok()) return ended;
  // The replaced session's step, if one runs, ends before the engine hears of the new
  // session (both may share the engine's buffers).
  status = Guarded("Attach", [&] { return HandOver(std::move(replaced), *granted, liveness); });
  if (status.ok()) std::move(unpublish).Cancel();
  return status;
}

absl::Status SessionService::PublishSession(const v1::AttachRequest& request,
                                            v1::AttachResponse* response,
                                            const CallLiveness& liveness, const Peer& caller,
                                            const EngineKey& engine,
                                            std::shared_ptr<Session>* granted,
                                            std::shared_ptr<Session>* replaced) {
  if (device_lost_.load()) return CountFailure(Restarting());
  // A session this Attach replaces gives its bytes back once the Attach has retired it
  // below: the new one may be built in them, so an engine that restarts with the server's
  // budgets nearly full re-attaches at once rather than after the old lease. Held here
  // until this returns, the old session's charges (which only grow while it lives) stay
  // while the new one is built in them, even if it is detached or expires meanwhile, so
  // every charge made in the allowance is made beside them: once they are freed the server
  // is within its limits again, whether the new session is published or not (let go with a
  // detached session, they once left the build's later charges past the limits, for good).
  // While replacing builds run, the server's use stays within its limits plus the largest
  // of their allowances (one session's charges at most). Only an Attach that Add would let
  // replace it got here (BeginBuild refused the others, a live session attached over TCP
  // among them, before any mapping or allocation: a loop of such calls once kept the
  // budget full and refused other engines).
  const std::shared_ptr<Session> replacing_session = sessions_.Live(engine);
  const ServerCharges replacing =
      replacing_session != nullptr ? replacing_session->server_charges() : ServerCharges{};
  std::unique_ptr<Session> remains;
  absl::StatusOr<std::unique_ptr<Session>> built =
      Session::Create(request, config_, budgets_, caller, make_backend_, &remains, replacing);
  // What a failed backend allocated is freed as an ended session's is, not here.
  if (remains != nullptr) janitor_.Dispose(remains.release());
  if (!built.ok()) return CountFailure(WatchDevice(built.status()));
  // Its last reference, wherever dropped, hands it to the janitor (session_janitor.h).
  Janitor<Session>* const janitor = &janitor_;
  std::shared_ptr<Session> session((*built).release(),
                                   [janitor](Session* s) { janitor->Dispose(s); });
  // Its client gave up during the build: it publishes nothing and replaces nothing (the
  // engine keeps its live session), and what it built goes at once.
  if (absl::Status alive = liveness.Check("Attach"); !alive.ok()) {
    (void)WatchDevice(session->Retire());
    return alive;
  }
  session->set_id(NewSessionId(next_session_.fetch_add(1)));
  session->set_owner(caller);
  session->HoldLease();  // until the hand-over below has ended
  // Published as a new session, within the session limits, if the one it was built to
  // replace went meanwhile.
  absl::StatusOr<std::shared_ptr<Session>> added = sessions_.Add(session, Limits());
  if (!added.ok()) {
    (void)WatchDevice(session->Retire());
    return CountFailure(added.status());
  }
  // Kept until the reply: a concurrent Attach of the engine may replace it meanwhile.
  *granted = session;
  *replaced = *std::move(added);
  response->set_session_id(session->id());
  response->set_lease_ms(session->spec().lease_ms);
  *response->mutable_effective_options() = ToProto(session->policy());
  response->set_backend(ToProto(session->backend().kind()));
  response->set_record_words(SummaryLayout::For(session->spec().model).record_words);
  response->set_server_version("epsd 0.1.0");
  return absl::OkStatus();
}

absl::Status SessionService::HandOver(std::shared_ptr<Session> replaced, Session& granted,
                                      const CallLiveness& liveness) {
  // Ending the replaced session's queued step may find the device lost (an async step
  // that hit an illegal address): the new session is of no use then, and the engine
  // re-attaches to the next epsd. BuildAndHandOver removes and retires the new session.
  if (replaced != nullptr && IsDeviceLost(WatchDevice(replaced->Retire()))) {
    return CountFailure(Restarting());
  }
  // Its client gave up while it waited for the old step (PublishSession checked the call
  // once the session was built, before it replaced anything): no engine will hear of the
  // session, so it goes now rather than at the end of a lease (its memory and its charges
  // against the server's budgets held meanwhile); the session it replaced has ended all
  // the same.
  RETURN_IF_ERROR(liveness.Check("Attach"));
  // The lease runs from the reply: the wait for the old step may have taken longer.
  granted.StartLease();
  attached_total_.fetch_add(1);
  return absl::OkStatus();
}

}  // namespace eps::service
