#include "client/cpp/eps_client.h"

#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <random>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "client/cpp/deadline.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace eps::client {

namespace {

absl::Status FromGrpc(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace

// One open StreamSelectPages call. Replies are queued by the reactor and taken
// by the engine thread. A live stream holds only the step being asked (a step that
// misses its deadline or fails replaces it), so a reply for any other step is an error.
class StreamCall final
    : public grpc::ClientBidiReactor<v1::SelectPagesRequest, v1::SelectPagesResponse> {
 public:
  StreamCall(v1::PageSelector::Stub& stub,
             const std::vector<std::pair<std::string, std::string>>& metadata) {
    for (const auto& [key, value] : metadata) context_.AddMetadata(key, value);
    stub.async()->StreamSelectPages(&context_, this);
    StartRead(&incoming_);
    StartCall();
  }

  // Sends `request` once the previous write completed (its reply can arrive
  // before OnWriteDone); false if that takes past `deadline` or the call ended.
  bool Send(const v1::SelectPagesRequest& request, std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_until(lock, deadline, [&] { return !writing_ || done_ || read_closed_; })) {
      return false;
    }
    if (done_ || read_closed_) return false;
    writing_ = true;
    outgoing_ = request;
    StartWrite(&outgoing_);
    return true;
  }

  // Waits for the reply of `step` until `deadline`. The first reply is the answer, whatever
  // step it names: SelectPages refuses one for another step as INTERNAL at once
  // (docs/api-failures.md §5.7), rather than waiting for a reply that will not come.
  absl::Status Receive(uint64_t step, std::chrono::steady_clock::time_point deadline,
                       v1::SelectPagesResponse* response) {
    std::unique_lock lock(mu_);
    for (;;) {
      if (!replies_.empty()) {
        *response = std::move(replies_.front());
        replies_.pop_front();
        return absl::OkStatus();
      }
      if (done_) return final_status_;
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && replies_.empty() && !done_) {
        return absl::DeadlineExceededError(absl::StrCat("no reply for step ", step, " in time"));
      }
    }
  }

  bool done() {
    std::lock_guard lock(mu_);
    return done_ || read_closed_;
  }

  // Cancels the call if it is open, without waiting: epsd sees the stream end and
  // runs none of the requests it has not read yet.
  void Cancel() {
    std::lock_guard lock(mu_);
    if (!done_) context_.TryCancel();
  }

  // Whether gRPC is finished with this object (OnDone has run).
  bool Finished() {
    std::lock_guard lock(mu_);
    return finished_;
  }

  // Cancels the call if it is open and waits until gRPC is finished with this object.
  void Close() {
    Cancel();
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return finished_; });
  }

  void OnWriteDone(bool) override {
    {
      std::lock_guard lock(mu_);
      writing_ = false;
    }
    cv_.notify_all();
  }
  void OnReadDone(bool ok) override {
    if (!ok) {  // the stream ended; OnDone follows once no write is in flight
      std::lock_guard lock(mu_);
      read_closed_ = true;
      return;
    }
    {
      std::lock_guard lock(mu_);
      replies_.push_back(incoming_);
    }
    cv_.notify_all();
    StartRead(&incoming_);
  }
  void OnDone(const grpc::Status& status) override {
    std::lock_guard lock(mu_);
    done_ = true;
    final_status_ = status.ok() ? absl::UnavailableError("stream closed") : FromGrpc(status);
    finished_ = true;
    cv_.notify_all();
  }

 private:
  grpc::ClientContext context_;
  std::mutex mu_;
  std::condition_variable cv_;
  v1::SelectPagesRequest outgoing_;
  v1::SelectPagesResponse incoming_;
  std::deque<v1::SelectPagesResponse> replies_;
  bool writing_ = false, done_ = false, finished_ = false, read_closed_ = false;
  absl::Status final_status_;
};

namespace {

// A random, non-zero id for one client's fallback reports.
uint64_t NewClientId() {
  std::random_device device;
  uint64_t id = 0;
  while (id == 0) id = (static_cast<uint64_t>(device()) << 32) ^ device();
  return id;
}

}  // namespace

absl::StatusOr<std::unique_ptr<EpsClient>> EpsClient::Create(ClientOptions options,
                                                             v1::AttachRequest attach) {
  if (absl::Status s = options.Validate(); !s.ok()) return s;
  return std::make_unique<EpsClient>(std::move(options), std::move(attach));
}

EpsClient::EpsClient(ClientOptions options, v1::AttachRequest attach)
    : options_(std::move(options)),
      options_status_(options_.Validate()),
      attach_(std::move(attach)),
      reattach_([this](grpc::ClientContext& context) { return CallAttach(context); },
                options_.reattach_backoff),
      client_id_(NewClientId()) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  for (const auto& [key, value] : options_.channel_args) args.SetInt(key, value);
  channel_ = grpc::CreateCustomChannel(options_.target, grpc::InsecureChannelCredentials(), args);
  stub_ = v1::PageSelector::NewStub(channel_);
}

EpsClient::~EpsClient() {
  reattach_.Close();  // cancels it first, so that the wait is short even with epsd stopped
  if (stream_) stream_->Close();
  for (auto& stream : abandoned_streams_) stream->Close();  // cancelled: they end promptly
  ReapAbandoned(/*wait=*/true);                             // cancelled calls finish promptly
}

absl::StatusOr<std::string> EpsClient::CallAttach(
    grpc::ClientContext& context,
    std::optional<std::chrono::steady_clock::time_point> deadline) const {
  context.set_deadline(deadline ? SystemAfter(*deadline - std::chrono::steady_clock::now())
                                : SystemAfter(options_.attach_deadline));
  v1::AttachResponse response;
  const grpc::Status status = stub_->Attach(&context, attach_, &response);
  if (!status.ok()) return FromGrpc(status);
  // An empty id is no session: adopted, the client would read as attached while every step
  // went out with no id (NOT_FOUND), each one's re-attach counted as granted.
  if (response.session_id().empty()) {
    return absl::InternalError(
        "Attach: epsd answered OK but granted no session_id (AttachResponse.session_id is "
        "empty)");
  }
  return response.session_id();
}

absl::Status EpsClient::Adopt(const absl::StatusOr<std::string>& attached) {
  if (!attached.ok()) {
    reattach_.BackOff();
    return attached.status();
  }
  if (attached_before_) reattaches_.fetch_add(1);
  attached_before_ = true;
  session_id_ = *attached;
  return absl::OkStatus();
}

bool EpsClient::TakePendingAttach(std::chrono::steady_clock::time_point deadline) {
  const std::optional<BackgroundAttach::Result> attached = reattach_.Take(deadline);
  return attached.has_value() && Adopt(*attached).ok();
}

absl::Status EpsClient::Attach() {
  if (!options_status_.ok()) return options_status_;
  detached_ = false;  // whatever this call answers: steps may re-attach again
  const auto deadline = After(std::chrono::steady_clock::now(), options_.attach_deadline);
  if (TakePendingAttach(deadline)) return absl::OkStatus();
  if (std::chrono::steady_clock::now() >= deadline) {
    return absl::DeadlineExceededError(
        "Attach: attach_deadline passed waiting for a background re-attach");
  }
  grpc::ClientContext context;
  return Adopt(CallAttach(context, deadline));
}

// Not attached: the step falls back unless a finished background re-attach was granted a
// session (reattach.h).
absl::Status EpsClient::PollReattach() {
  const BackgroundAttach::Result attached = reattach_.Poll();
  if (!attached.ok()) return attached.status();
  return Adopt(attached);
}

absl::Status EpsClient::Detach() {
  detached_ = true;  // steps no longer re-attach by themselves: Attach() first
  // A background re-attach may be about to be granted a session: take it, so that it is
  // detached too rather than left to its lease; all within one attach_deadline.
  const auto deadline = After(std::chrono::steady_clock::now(), options_.attach_deadline);
  (void)TakePendingAttach(deadline);
  if (session_id_.empty()) return absl::OkStatus();
  if (stream_) {
    stream_->Close();
    stream_.reset();
  }
  grpc::ClientContext context;
  context.set_deadline(SystemAfter(deadline - std::chrono::steady_clock::now()));
  v1::DetachRequest request;
  request.set_session_id(session_id_);
  v1::DetachResponse response;
  session_id_.clear();
  return FromGrpc(stub_->Detach(&context, request, &response));
}

absl::Status EpsClient::Ping(std::chrono::microseconds deadline) {
  grpc::ClientContext context;
  context.set_deadline(SystemAfter(deadline));
  v1::PingRequest request;
  v1::PingResponse response;
  return FromGrpc(stub_->Ping(&context, request, &response));
}

absl::Status EpsClient::Heartbeat() {
  grpc::ClientContext context;
  context.set_deadline(SystemAfter(options_.attach_deadline));
  v1::HeartbeatRequest request;
  request.set_session_id(session_id_);
  v1::HeartbeatResponse response;
  const absl::Status status = FromGrpc(stub_->Heartbeat(&context, request, &response));
  // epsd no longer knows the session (restarted, lease expired): forgotten as a step's
  // NOT_FOUND forgets it, so that the next step re-attaches rather than naming it again.
  if (status.code() == absl::StatusCode::kNotFound) ForgetSession();
  return status;
}

void EpsClient::ForgetSession() {
  session_id_.clear();
  if (stream_) {
    stream_->Close();
    stream_.reset();
  }
}

std::vector<std::pair<std::string, std::string>> EpsClient::TraceMetadata() {
  std::vector<std::pair<std::string, std::string>> metadata;
  if (options_.traceparent.empty()) return metadata;
  // gRPC aborts the process on a metadata value it cannot carry (a control character):
  // what is not W3C is dropped here, costing the calls their trace context only.
  std::string refused;
  if (!ValidTraceparent(options_.traceparent)) {
    refused = absl::StrCat("traceparent '", absl::CEscape(options_.traceparent.substr(0, 80)),
                           "' is not a W3C traceparent");
  } else {
    metadata.emplace_back("traceparent", options_.traceparent);
    if (!options_.tracestate.empty()) {
      if (ValidTracestate(options_.tracestate)) {
        metadata.emplace_back("tracestate", options_.tracestate);
      } else {
        refused = absl::StrCat("tracestate '", absl::CEscape(options_.tracestate.substr(0, 80)),
                               "' is not printable ASCII of at most 512 characters");
      }
    }
  }
  if (!refused.empty() && !trace_refusal_logged_) {
    trace_refusal_logged_ = true;
    std::fprintf(stderr, "eps_client: calls go without trace context: %s (logged once)\n",
                 refused.c_str());
  }
  return metadata;
}

StepResult EpsClient::Failed(uint64_t step, absl::Status status, std::atomic<uint64_t>& counter,
                             StepResult result) {
  result.status = std::move(status);
  if (!options_.fail_open) {
    errors_.fetch_add(1);
    return result;
  }
  counter.fetch_add(1);
  if (options_.on_fallback) options_.on_fallback(step);
  result.fallback = true;
  result.response.Clear();  // nothing of a failed call's reply is this step's
  return result;
}

// One unary SelectPages in flight. The client owns it; gRPC's callback only
// signals, so the ClientContext is never destroyed on a gRPC thread.
struct UnaryCall {
  grpc::ClientContext context;
  v1::SelectPagesRequest request;
  v1::SelectPagesResponse response;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;

  bool Done() {
    std::lock_guard lock(mu);
    return done;
  }
};

void EpsClient::ReapAbandoned(bool wait) {
  std::erase_if(abandoned_streams_,
                [](const std::unique_ptr<StreamCall>& s) { return s->Finished(); });
  for (auto it = abandoned_.begin(); it != abandoned_.end();) {
    if (wait) {
      std::unique_lock lock((*it)->mu);
      (*it)->cv.wait(lock, [&] { return (*it)->done; });
    }
    if ((*it)->Done()) {
      it = abandoned_.erase(it);
    } else {
      ++it;
    }
  }
}

absl::Status EpsClient::CallUnary(const v1::SelectPagesRequest& request, Deadline deadline,
                                  v1::SelectPagesResponse* response) {
  ReapAbandoned(/*wait=*/false);
  // gRPC rounds deadlines up to whole milliseconds; the engine's deadline is
  // enforced here, to the microsecond, and a late call is cancelled.
  auto call = std::make_unique<UnaryCall>();
  call->request = request;
  call->context.set_deadline(
      SystemAfter(deadline - std::chrono::steady_clock::now() + std::chrono::milliseconds(1)));
  for (const auto& [key, value] : TraceMetadata()) call->context.AddMetadata(key, value);
  UnaryCall* raw = call.get();
  stub_->async()->SelectPages(&raw->context, &raw->request, &raw->response,
                              [raw](grpc::Status status) {
                                std::lock_guard lock(raw->mu);
                                raw->status = std::move(status);
                                raw->done = true;
                                raw->cv.notify_all();
                              });
  std::unique_lock lock(raw->mu);
  if (!raw->cv.wait_until(lock, deadline, [&] { return raw->done; })) {
    lock.unlock();
    raw->context.TryCancel();
    abandoned_.push_back(std::move(call));  // freed here once its callback has run
    return absl::DeadlineExceededError("SelectPages missed the client deadline");
  }
  if (raw->status.ok()) *response = std::move(raw->response);
  return FromGrpc(raw->status);
}

absl::Status EpsClient::CallStream(const v1::SelectPagesRequest& request, Deadline deadline,
                                   v1::SelectPagesResponse* response) {
  ReapAbandoned(/*wait=*/false);
  if (stream_ && stream_->done()) {
    stream_->Close();
    stream_.reset();
  }
  if (!stream_) stream_ = std::make_unique<StreamCall>(*stub_, TraceMetadata());
  if (!stream_->Send(request, deadline)) {
    return stream_->done()
               ? absl::UnavailableError("the stream closed")
               : absl::DeadlineExceededError("the previous request is still being written");
  }
  return stream_->Receive(request.step(), deadline, response);
}

StepResult EpsClient::SelectPages(uint64_t step, std::span<const v1::BatchRow> rows,
                                  const v1::SelectOptions* options) {
  steps_.fetch_add(1);
  const auto start = std::chrono::steady_clock::now();
  if (!options_status_.ok()) return Failed(step, options_status_, fb_error_);
  if (detached_) {
    // The engine ended the session: a step re-attaching behind its back would hold epsd's
    // memory again (as the Python client's steps after close() are refused).
    return Failed(step,
                  absl::FailedPreconditionError(
                      "the client detached: call Attach() to attach again before a step"),
                  fb_error_);
  }
  if (session_id_.empty()) {
    if (absl::Status s = PollReattach(); !s.ok()) return Failed(step, s, fb_not_attached_);
  }
  v1::SelectPagesRequest request;
  request.set_session_id(session_id_);
  request.set_step(step);
  request.mutable_rows()->Add(rows.begin(), rows.end());
  if (options != nullptr) *request.mutable_options() = *options;
  if (options_.reply_async) request.set_reply_mode(v1::REPLY_MODE_ASYNC);
  // The client's fallback totals ride on the step for epsd's metrics until the server has
  // surely seen them: until a reply other than UNAVAILABLE or DEADLINE_EXCEEDED, which may or
  // may not have reached it. Totals with this client's id, not deltas: epsd counts only their
  // increase, so a report that arrives twice counts once and none is lost.
  const ClientCounters now = counters();
  if (now.fallbacks() != reported_.fallbacks()) {
    v1::ClientFallbacks* fallbacks = request.mutable_fallbacks();
    fallbacks->set_client_id(client_id_);
    fallbacks->set_deadline(now.fallback_deadline);
    fallbacks->set_unavailable(now.fallback_unavailable);
    fallbacks->set_not_attached(now.fallback_not_attached);
    fallbacks->set_error(now.fallback_error);
  }
  StepResult result;
  const Deadline deadline = After(start, options_.deadline);
  absl::Status status = options_.use_stream ? CallStream(request, deadline, &result.response)
                                            : CallUnary(request, deadline, &result.response);
  if (status.ok() && result.response.step() != step) {
    // epsd echoes the step it ran: another step's reply says nothing of this one.
    status = absl::InternalError(
        absl::StrCat("epsd answered step ", result.response.step(), " for step ", step));
  }
  if (status.ok() && request.reply_mode() != v1::REPLY_MODE_ASYNC && !result.response.done()) {
    // A sync reply comes once the outputs are written: one that says otherwise would have
    // the engine read lists epsd has not finished (or has not written at all).
    status = absl::InternalError(absl::StrCat(
        "epsd answered step ", step, " with done=false, though the call asked for a sync reply"));
  }
  if (status.ok() && std::chrono::steady_clock::now() > deadline) {
    // A reply taken late (this thread was descheduled, say) is a miss: the
    // engine has moved on and must not use it.
    status = absl::DeadlineExceededError("SelectPages answered after the client deadline");
  }
  result.round_trip_us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
  // CANCELLED here is epsd's (the client cancels only what it has already given up on):
  // a call its draining server refused, which may not have been seen.
  if (status.code() != absl::StatusCode::kUnavailable &&
      status.code() != absl::StatusCode::kDeadlineExceeded &&
      status.code() != absl::StatusCode::kCancelled) {
    reported_ = now;
  }
  if (status.ok()) {
    selected_.fetch_add(1);
    return result;
  }
  // The transport's side of a failure, the same whether the engine falls back or not
  // (only the counting and the result differ below).
  std::atomic<uint64_t>* reason = &fb_error_;
  switch (status.code()) {
    case absl::StatusCode::kNotFound:  // sidecar restarted or lease expired
      ForgetSession();                 // re-attach next step
      reason = &fb_not_attached_;
      break;
    case absl::StatusCode::kCancelled:  // epsd shutting down (its drain cancels calls)
    case absl::StatusCode::kUnavailable:
      if (stream_) {
        stream_->Close();
        stream_.reset();
      }
      reason = &fb_unavailable_;
      break;
    case absl::StatusCode::kDeadlineExceeded:
      reason = &fb_deadline_;
      [[fallthrough]];
    default:
      if (stream_) {
        // The stream may still hold this step (and later ones) for epsd, which would run
        // them after the engine gave up on them, or it answered another step, or it ended
        // with this error: cancel it now (gRPC finishes it in the background) and open a
        // fresh one for the next step, so that a live stream only ever holds the step asked.
        stream_->Cancel();
        abandoned_streams_.push_back(std::move(stream_));
      }
      break;
  }
  return Failed(step, status, *reason, std::move(result));
}

ClientCounters EpsClient::counters() const {
  ClientCounters c;
  c.steps = steps_.load();
  c.selected = selected_.load();
  c.fallback_deadline = fb_deadline_.load();
  c.fallback_unavailable = fb_unavailable_.load();
  c.fallback_not_attached = fb_not_attached_.load();
  c.fallback_error = fb_error_.load();
  c.reattaches = reattaches_.load();
  c.errors = errors_.load();
  return c;
}

}  // namespace eps::client
