#include "service/grpc_service.h"

#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/status.h"
#include "service/call_guard.h"
#include "service/convert.h"

namespace eps::service {
namespace {

using telemetry::RpcMethod;
using telemetry::Telemetry;

// What the session service needs to know of the call's life (not run once dead).
CallLiveness LivenessOf(grpc::CallbackServerContext& context) {
  return {.deadline = absl::FromChrono(context.deadline()),
          .cancelled = [&context] { return context.IsCancelled(); }};
}

// Finishes a unary call and records it. `refused`: a failure is the session service's refusal.
grpc::ServerUnaryReactor* Finish(grpc::CallbackServerContext* context, Telemetry& telemetry,
                                 const Telemetry::Call& call, const absl::Status& status,
                                 bool refused = true) {
  telemetry.EndCall(call, status, refused);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// The NOT_FOUND of a reply whose session ended before it was sent (unsent_replies.h).
absl::Status SessionEnded(const char* call, const std::string& session) {
  return absl::NotFoundError(absl::StrCat(
      call, ": session '", telemetry::SessionLabel(session),
      "' was detached, replaced or expired before this step's reply was sent: re-attach"));
}

// Where an OK reply stands once its step ended (TakePlace).
enum class Place { kHeld, kParked, kAnswer };

// Takes a place for `reply` (the call's reactor, as an UnsentReplies::Reply) in its session's
// `replies`, under the reactor's lock: kHeld (hand the reply to gRPC now), kParked (Resume
// or Drop comes from another thread), or kAnswer with `status` set to what the call answers
// instead (the session ended, its places are all taken, the call was cancelled while it was
// being parked, or the queue could not grow). `call` names the RPC in the messages.
Place TakePlace(UnsentReplies& replies, UnsentReplies::Reply* reply,
                grpc::CallbackServerContext& context, const char* call, const std::string& session,
                absl::Status& status) {
  UnsentReplies::Hold hold = UnsentReplies::Hold::kRefused;
  const absl::Status counted = CallGuarded(call, [&] {  // its queue allocates
    hold = replies.TryHold(reply);
    return absl::OkStatus();
  });
  if (!counted.ok()) {
    status = counted;  // nothing counted or parked
    return Place::kAnswer;
  }
  switch (hold) {
    case UnsentReplies::Hold::kHeld:
      return Place::kHeld;
    case UnsentReplies::Hold::kParked:
      // A call cancelled before it was parked gets no OnCancel now: take it back.
      if (!context.IsCancelled() || !replies.Unpark(reply)) return Place::kParked;
      status = absl::CancelledError(absl::StrCat(call, ": the call was cancelled"));
      return Place::kAnswer;
    case UnsentReplies::Hold::kEnded:
      status = SessionEnded(call, session);
      return Place::kAnswer;
    case UnsentReplies::Hold::kRefused:
      break;
  }
  // Its client has not read the session's last replies (on this call's connection or
  // others): this one would wait in epsd's memory as theirs do. The step has run.
  status = absl::ResourceExhaustedError(
      absl::StrCat(call, ": session '", telemetry::SessionLabel(session),
                   "': ", UnsentReplies::kMaxUnsentReplies + UnsentReplies::kMaxParkedReplies,
                   " replies of its earlier steps are not yet read by its client; read them"));
  return Place::kAnswer;
}

// A unary SelectPages call's reactor. Its reply holds a place in its session's
// UnsentReplies until the call is done (written, or dropped with its connection); a reply
// that finds no place is parked there and handed to gRPC when one frees, and the session's
// end cancels a held reply's call and answers a parked one without it (unsent_replies.h).
class SelectPagesReply final : public grpc::ServerUnaryReactor, public UnsentReplies::Reply {
 public:
  // Records the call's end (telemetry) and returns the status to finish it with.
  using Ending = std::function<absl::Status(absl::Status)>;

  explicit SelectPagesReply(grpc::CallbackServerContext& context) : context_(context) {}

  // The step ended with `status`; `ending` records the call and gives its final status.
  // An OK reply takes a place in its session's `replies`, or waits for one.
  void StepDone(const std::string& session, absl::Status status,
                std::shared_ptr<UnsentReplies> replies, Ending ending) {
    if (status.ok()) {
      absl::MutexLock lock(&mu_);
      session_ = session;
      replies_ = std::move(replies);
      ending_ = std::move(ending);
      const Place place = TakePlace(*replies_, this, context_, "SelectPages", session, status);
      if (place == Place::kParked) {
        parked_ = true;  // Resume, Drop or OnCancel finishes the call
        return;
      }
      held_ = place == Place::kHeld;
      ending = std::move(ending_);
    }
    Finish(ToGrpcStatus(ending(status)));
  }

  // A place freed for the parked reply (UnsentReplies::Release's thread).
  void Resume() override {
    Ending ending;
    {
      absl::MutexLock lock(&mu_);
      parked_ = false;
      held_ = true;
      ending = std::move(ending_);
    }
    Finish(ToGrpcStatus(ending(absl::OkStatus())));
  }

  // The session ended while the reply was parked (UnsentReplies::End's thread).
  void Drop() override {
    Ending ending;
    absl::Status status;
    {
      absl::MutexLock lock(&mu_);
      parked_ = false;
      ending = std::move(ending_);
      status = SessionEnded("SelectPages", session_);
    }
    Finish(ToGrpcStatus(ending(std::move(status))));
  }

  // The session ended while the reply was held: gRPC drops what it keeps for the call,
  // whose OnDone then releases its place.
  void Cancel() override { context_.TryCancel(); }

  void OnCancel() override {
    Ending ending;
    {
      absl::MutexLock lock(&mu_);
      // Not parked, or resuming, or dropped by the session's end.
      if (!parked_ || !replies_->Unpark(this)) return;
      parked_ = false;
      ending = std::move(ending_);
    }
    Finish(ToGrpcStatus(ending(absl::CancelledError("SelectPages: the call was cancelled"))));
  }

  void OnDone() override {
    bool held;
    std::shared_ptr<UnsentReplies> replies;
    {
      absl::MutexLock lock(&mu_);
      held = held_;
      replies = replies_;
    }
    if (held) replies->Release(this);
    delete this;
  }

 private:
  grpc::CallbackServerContext& context_;
  absl::Mutex mu_;
  std::string session_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<UnsentReplies> replies_ ABSL_GUARDED_BY(mu_);  // its session's
  Ending ending_ ABSL_GUARDED_BY(mu_);
  bool held_ ABSL_GUARDED_BY(mu_) = false;    // a place is this reply's: released at OnDone
  bool parked_ ABSL_GUARDED_BY(mu_) = false;  // waiting in replies_ for a place
};

// The end of a unary call answered later, from whichever thread the session service
// calls it on (service/session_service.h, CallDone): records the call and finishes it.
SessionService::CallDone FinishLater(grpc::ServerUnaryReactor* reactor, Telemetry& telemetry,
                                     const Telemetry::Call& call,
                                     google::protobuf::Message* response) {
  return [reactor, &telemetry, call, response](absl::Status status) {
    if (!status.ok()) response->Clear();
    telemetry.EndCall(call, status, /*refused=*/true);
    reactor->Finish(ToGrpcStatus(status));
  };
}

// One reply per request, in order. A failed step ends the stream with its
// status (the client falls back for that step and opens a new stream).
//
// A stream reads its next request only once its last reply is written, so it holds one
// reply at a time; but a client may open many streams of one session, and a reply waits in
// gRPC's transport until the client's window lets it out. So a reply takes a place in its
// session's UnsentReplies while it is written, as a unary one does from its step's end to
// its call's end (unsent_replies.h): parked when the session's places are taken, refused
// (the stream ends RESOURCE_EXHAUSTED) past those parked, and the session's end cancels
// the stream whose reply it holds and ends a parked one NOT_FOUND. Before, 60 streams of
// one session whose client never read held 60 replies (4.2 MB each: epsd's RSS grew by
// 250 MB), and they stayed after the session's Detach.
class SelectStream final
    : public grpc::ServerBidiReactor<v1::SelectPagesRequest, v1::SelectPagesResponse>,
      public UnsentReplies::Reply {
 public:
  SelectStream(SessionService& sessions, Telemetry& telemetry, grpc::CallbackServerContext& context,
               Peer caller)
      : sessions_(sessions),
        telemetry_(telemetry),
        context_(context),
        caller_(std::move(caller)),
        call_(telemetry.BeginCall(RpcMethod::kStreamSelectPages, context)) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      End(absl::OkStatus());  // the client closed its side
      return;
    }
    // Whatever happens in the step, the stream either writes a reply or ends. The
    // next read starts only after the write: one step of the stream at a time.
    Telemetry::Step step{};
    const absl::Status started = CallGuarded("StreamSelectPages", [&] {
      telemetry_.metrics().StreamMessageReceived();
      response_.Clear();
      step = telemetry_.BeginStep(request_);
      return absl::OkStatus();
    });
    if (!started.ok()) {
      End(started);
      return;
    }
    // Done here for a call refused at or before the gate or run inline (within the
    // executor's bound on such steps), else on the StepExecutor (step_gate.h).
    sessions_.StartSelectPages(
        request_, &response_, LivenessOf(context_), caller_,
        [this, step](absl::Status s, BackendKind backend, std::shared_ptr<UnsentReplies> replies) {
          StepDone(step, std::move(s), backend, std::move(replies));
        });
  }

  // The step ended: an OK reply takes a place in its session's `replies` (or waits for one)
  // before it is written.
  void StepDone(const Telemetry::Step& step, absl::Status s, BackendKind backend,
                std::shared_ptr<UnsentReplies> replies) {
    if (s.ok()) {
      absl::MutexLock lock(&mu_);
      step_ = step;
      backend_ = backend;
      replies_ = std::move(replies);
      const Place place =
          TakePlace(*replies_, this, context_, "StreamSelectPages", request_.session_id(), s);
      if (place == Place::kParked) {
        parked_ = true;  // Resume, Drop or OnCancel answers the step
        return;
      }
      held_ = place == Place::kHeld;
    }
    Answer(step, std::move(s), backend);
  }

  // A place freed for the parked reply (UnsentReplies::Release's thread).
  void Resume() override {
    Telemetry::Step step{};
    BackendKind backend = BackendKind::kCpu;
    {
      absl::MutexLock lock(&mu_);
      parked_ = false;
      held_ = true;
      step = step_;
      backend = backend_;
    }
    Answer(step, absl::OkStatus(), backend);
  }

  // The session ended while the reply was parked (UnsentReplies::End's thread).
  void Drop() override {
    Telemetry::Step step{};
    BackendKind backend = BackendKind::kCpu;
    absl::Status status;
    {
      absl::MutexLock lock(&mu_);
      parked_ = false;
      step = step_;
      backend = backend_;
      status = SessionEnded("StreamSelectPages", request_.session_id());
    }
    Answer(step, std::move(status), backend);
  }

  // The session ended while its reply was written: gRPC drops what it keeps for the
  // stream, and the write's end releases the place.
  void Cancel() override { context_.TryCancel(); }

  void OnCancel() override {
    Telemetry::Step step{};
    BackendKind backend = BackendKind::kCpu;
    {
      absl::MutexLock lock(&mu_);
      // Not parked, or resuming, or dropped by the session's end.
      if (!parked_ || !replies_->Unpark(this)) return;
      parked_ = false;
      step = step_;
      backend = backend_;
    }
    Answer(step, absl::CancelledError("StreamSelectPages: the call was cancelled"), backend);
  }

  void OnWriteDone(bool ok) override {
    std::shared_ptr<UnsentReplies> replies;
    {
      absl::MutexLock lock(&mu_);
      if (std::exchange(held_, false)) replies = replies_;
    }
    if (replies != nullptr) replies->Release(this);  // written, or dropped: its place is free
    if (!ok) {
      // A write fails when the client cancelled the stream (or its deadline passed) while
      // the step ran: the client went away, epsd did not fail. (A stream the client closes
      // between steps, as EpsClient does by cancelling it, ends at the read: OK.)
      End(context_.IsCancelled() ? absl::CancelledError("StreamSelectPages: the client cancelled "
                                                        "the stream during a step")
                                 : absl::UnavailableError("stream write failed"));
      return;
    }
    telemetry_.metrics().StreamMessageSent();
    StartRead(&request_);
  }
  void OnDone() override { delete this; }

 private:
  // Records the step with the status the stream answers it with, then writes its reply
  // (OK) or ends the stream with that status.
  void Answer(const Telemetry::Step& step, absl::Status s, BackendKind backend) {
    const absl::Status status = CallGuarded("StreamSelectPages", [&] {
      telemetry_.EndStep(call_, step, request_, response_, s, backend);
      return s;
    });
    if (!status.ok()) {
      // A place taken for a reply that is not written (its telemetry threw) is given back.
      std::shared_ptr<UnsentReplies> replies;
      {
        absl::MutexLock lock(&mu_);
        if (std::exchange(held_, false)) replies = replies_;
      }
      if (replies != nullptr) replies->Release(this);
      End(status);
      return;
    }
    StartWrite(&response_);
  }

  // The stream's own status; a failed step was already counted by EndStep.
  void End(const absl::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      if (ended_) return;  // Finish once, whatever called twice
      ended_ = true;
    }
    (void)CallGuarded("StreamSelectPages", [&] {
      telemetry_.EndCall(call_, status, /*refused=*/false);
      return absl::OkStatus();
    });
    Finish(ToGrpcStatus(status));
  }

  SessionService& sessions_;
  Telemetry& telemetry_;
  grpc::CallbackServerContext& context_;
  const Peer caller_;
  const Telemetry::Call call_;
  v1::SelectPagesRequest request_;
  v1::SelectPagesResponse response_;
  // gRPC serialises the reactor's own callbacks; Resume, Drop and Cancel come from other
  // threads (a parked reply's), as may OnCancel while the reply is parked.
  absl::Mutex mu_;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  std::shared_ptr<UnsentReplies> replies_ ABSL_GUARDED_BY(mu_);  // the last step's session's
  bool held_ ABSL_GUARDED_BY(mu_) = false;    // a place is this reply's: released at its write
  bool parked_ ABSL_GUARDED_BY(mu_) = false;  // waiting in replies_ for a place
  Telemetry::Step step_ ABSL_GUARDED_BY(mu_) = {};  // the parked reply's step, for telemetry
  BackendKind backend_ ABSL_GUARDED_BY(mu_) = BackendKind::kCpu;
};

}  // namespace

Peer PageSelectorService::CallerOf(const grpc::CallbackServerContext& context) const {
  return peers_ == nullptr ? Peer{} : peers_->Lookup(context.peer());
}

grpc::ServerUnaryReactor* PageSelectorService::Attach(grpc::CallbackServerContext* context,
                                                      const v1::AttachRequest* request,
                                                      v1::AttachResponse* response) {
  const Telemetry::Call call = telemetry_.BeginCall(RpcMethod::kAttach, *context);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  SessionService::CallDone done = FinishLater(reactor, telemetry_, call, response);
  Peer caller;
  const absl::Status arrived = CallGuarded("Attach", [&] {
    caller = CallerOf(*context);
    return LivenessOf(*context).Check("Attach");
  });
  if (!arrived.ok()) {
    std::move(done)(arrived);
    return reactor;
  }
  // Answered here when refused before any build, else from the StepExecutor, where the
  // session is built (and a replaced session's running step waited for): this callback
  // thread waits for neither.
  sessions_.StartAttach(*request, response, LivenessOf(*context), caller, std::move(done));
  return reactor;
}

grpc::ServerUnaryReactor* PageSelectorService::Detach(grpc::CallbackServerContext* context,
                                                      const v1::DetachRequest* request,
                                                      v1::DetachResponse* response) {
  const Telemetry::Call call = telemetry_.BeginCall(RpcMethod::kDetach, *context);
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  SessionService::CallDone done = FinishLater(reactor, telemetry_, call, response);
  Peer caller;
  const absl::Status arrived = CallGuarded("Detach", [&] {
    caller = CallerOf(*context);
    return LivenessOf(*context).Check("Detach");
  });
  if (!arrived.ok()) {
    std::move(done)(arrived);
    return reactor;
  }
  // Answered from the StepExecutor once the session's running step has ended (or here,
  // when refused): this callback thread does not wait for it.
  sessions_.StartDetach(*request, caller, std::move(done));
  return reactor;
}

grpc::ServerUnaryReactor* PageSelectorService::SelectPages(grpc::CallbackServerContext* context,
                                                           const v1::SelectPagesRequest* request,
                                                           v1::SelectPagesResponse* response) {
  const Telemetry::Call call = telemetry_.BeginCall(RpcMethod::kSelectPages, *context);
  Telemetry::Step step{};
  const absl::Status started = CallGuarded("SelectPages", [&] {
    step = telemetry_.BeginStep(*request);
    return absl::OkStatus();
  });
  if (!started.ok()) return Finish(context, telemetry_, call, started);
  auto* reactor = new SelectPagesReply(*context);
  // Finished where the step runs: here within the executor's bound on inline steps, else
  // on the StepExecutor (step_gate.h), this callback thread then returning at once, free
  // for other calls and for this one's cancellation, which a cpu step checks between its
  // (row, layer)s; or here for a call refused at or before the gate; or, for a reply parked
  // behind the session's unsent replies, where one of those is done (unsent_replies.h).
  sessions_.StartSelectPages(
      *request, response, LivenessOf(*context), CallerOf(*context),
      [this, request, response, reactor, call, step](absl::Status ran, BackendKind backend,
                                                     std::shared_ptr<UnsentReplies> replies) {
        // What the call answers: the step's status, or the reply's (unsent_replies.h).
        auto ending = [this, request, response, call, step, backend](absl::Status s) {
          const absl::Status status = CallGuarded("SelectPages", [&] {
            telemetry_.EndStep(call, step, *request, *response, s, backend);
            return s;
          });
          if (!status.ok()) response->Clear();
          (void)CallGuarded("SelectPages", [&] {
            telemetry_.EndCall(call, status, /*refused=*/false);  // EndStep counted it
            return absl::OkStatus();
          });
          return status;
        };
        try {  // nothing may leave the step's done callback (an allocation that fails)
          reactor->StepDone(request->session_id(), std::move(ran), std::move(replies),
                            std::move(ending));
        } catch (...) {  // StepDone finishes last: the call is not finished yet
          reactor->Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                                       "SelectPages: out of memory for the reply"));
        }
      });
  return reactor;
}

grpc::ServerBidiReactor<v1::SelectPagesRequest, v1::SelectPagesResponse>*
PageSelectorService::StreamSelectPages(grpc::CallbackServerContext* context) {
  return new SelectStream(sessions_, telemetry_, *context, CallerOf(*context));
}

grpc::ServerUnaryReactor* PageSelectorService::Heartbeat(grpc::CallbackServerContext* context,
                                                         const v1::HeartbeatRequest* request,
                                                         v1::HeartbeatResponse* response) {
  const Telemetry::Call call = telemetry_.BeginCall(RpcMethod::kHeartbeat, *context);
  const absl::Status status = CallGuarded("Heartbeat", [&] {
    RETURN_IF_ERROR(LivenessOf(*context).Check("Heartbeat"));
    return sessions_.Heartbeat(*request, response, CallerOf(*context));
  });
  return Finish(context, telemetry_, call, status);
}

grpc::ServerUnaryReactor* PageSelectorService::Ping(grpc::CallbackServerContext* context,
                                                    const v1::PingRequest*, v1::PingResponse*) {
  const Telemetry::Call call = telemetry_.BeginCall(RpcMethod::kPing, *context);
  return Finish(context, telemetry_, call, absl::OkStatus());
}

grpc::ServerUnaryReactor* PageSelectorService::GetStats(grpc::CallbackServerContext* context,
                                                        const v1::GetStatsRequest* request,
                                                        v1::GetStatsResponse* response) {
  const Telemetry::Call call = telemetry_.BeginCall(RpcMethod::kGetStats, *context);
  const absl::Status status = CallGuarded(
      "GetStats", [&] { return sessions_.GetStats(*request, response, CallerOf(*context)); });
  return Finish(context, telemetry_, call, status);
}

}  // namespace eps::service
