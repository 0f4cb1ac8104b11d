// The engine-side client of epsd (docs/design.md §5-6).
//
// One SelectPages per decode step with a deadline (default 2 ms); a step never
// waits for anything else: re-attaching runs in the background. Fail open:
// on a miss, an error or an absent sidecar the step's result says `fallback`
// and the engine attends densely with its own block table; every fallback is
// counted by reason. After a sidecar restart (or lease expiry) the client
// re-attaches by itself (idempotent per engine_id) in the background, with
// attach_deadline and reattach_backoff, while steps fall back (client/cpp/reattach.h);
// after Detach() it does not, until Attach(). Unary or bidirectional-stream transport; the
// stream keeps one call open and is cancelled on a missed deadline or any other failed step
// (a fresh one carries the next step), so that epsd does not run steps the engine gave up
// on and a live stream holds only the step asked: a reply for another step than the one
// asked is an error.
//
// Options (client/cpp/client_options.h) are checked (ClientOptions::Validate):
// EpsClient::Create refuses invalid ones; a client constructed with them answers Attach and
// every step with that error. A traceparent or tracestate gRPC cannot carry (not W3C, a
// control character) costs the calls their trace headers only, logged once: never the
// call, never the process.
//
// Thread safety: the client is for one engine thread. SelectPages, Attach, Heartbeat and
// Detach must not run concurrently with each other (they share the session, the stream
// and the re-attach state without a lock); Ping may run from any thread, and counters()
// may be read from any thread at any time.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/cpp/client_options.h"
#include "client/cpp/reattach.h"
#include "eps/v1/page_selector.grpc.pb.h"

namespace eps::client {

struct StepResult {
  bool fallback = false;  // attend densely this step (fail-open only)
  absl::Status status;    // why, when fallback; the error when fail-closed
  v1::SelectPagesResponse response;
  double round_trip_us = 0;
};

struct ClientCounters {
  uint64_t steps = 0;
  uint64_t selected = 0;
  uint64_t fallback_deadline = 0;
  uint64_t fallback_unavailable = 0;
  uint64_t fallback_not_attached = 0;
  uint64_t fallback_error = 0;
  uint64_t reattaches = 0;
  uint64_t errors = 0;  // failed steps returned to a fail-closed engine (not fallbacks)
  uint64_t fallbacks() const {
    return fallback_deadline + fallback_unavailable + fallback_not_attached + fallback_error;
  }
};

class StreamCall;
struct UnaryCall;

class EpsClient {
 public:
  // Refuses options that do not Validate, with that error.
  static absl::StatusOr<std::unique_ptr<EpsClient>> Create(ClientOptions options,
                                                           v1::AttachRequest attach);
  // Does not fail: with options that do not Validate, Attach returns that error and every
  // SelectPages is an error step (a fallback counted as fallback_error when fail_open).
  EpsClient(ClientOptions options, v1::AttachRequest attach);
  // Cancels a background re-attach (it does not detach: call Detach first for that).
  ~EpsClient();

  // Attaches (or re-attaches); SelectPages also does this lazily. Within one
  // attach_deadline: a background re-attach in flight is waited for within it, and a
  // session that re-attach was granted is the answer (no second Attach replaces it).
  absl::Status Attach();
  StepResult SelectPages(uint64_t step, std::span<const v1::BatchRow> rows,
                         const v1::SelectOptions* options = nullptr);
  // Ends the session, also one a background re-attach is being granted (waiting for it),
  // all within one attach_deadline. Until Attach() is called again, every step is refused
  // with FAILED_PRECONDITION (a fallback counted in fallback_error when fail_open) and
  // nothing re-attaches by itself.
  absl::Status Detach();
  absl::Status Ping(std::chrono::microseconds deadline);
  // Renews the lease within attach_deadline. NOT_FOUND (epsd restarted, the lease expired)
  // forgets the session, as a step's NOT_FOUND does: the next step re-attaches.
  absl::Status Heartbeat();

  const std::string& session_id() const { return session_id_; }
  ClientCounters counters() const;
  v1::PageSelector::Stub& stub() { return *stub_; }

  // Starts a background re-attach (`attach`) on a thread of its own: std::async. A test
  // replaces it to make the start fail as std::async does when no thread can be created
  // (std::system_error); a step then falls back as not attached, never throws.
  using ReattachStarter = BackgroundAttach::Starter;
  void set_reattach_starter_for_test(ReattachStarter start) {
    reattach_.set_starter(std::move(start));
  }

 private:
  // A failed step: fail-open, a fallback counted in `counter` (and on_fallback called);
  // fail-closed, an error step counted in errors. `result` keeps what the call measured.
  StepResult Failed(uint64_t step, absl::Status status, std::atomic<uint64_t>& counter,
                    StepResult result = {});
  // One Attach on `context` (the background re-attach's, or the caller's). Thread-safe
  // (stub and attach_ only). `deadline`: the call's (steady clock), else attach_deadline
  // from now.
  absl::StatusOr<std::string> CallAttach(
      grpc::ClientContext& context,
      std::optional<std::chrono::steady_clock::time_point> deadline = std::nullopt) const;
  // Waits for a background re-attach in flight until `deadline`, and adopts its answer
  // (true when it granted a session); one not done by then is cancelled (false).
  bool TakePendingAttach(std::chrono::steady_clock::time_point deadline);
  // A granted session becomes the client's; a failed Attach starts the re-attach backoff.
  absl::Status Adopt(const absl::StatusOr<std::string>& attached);
  // epsd no longer knows the session (NOT_FOUND): drops it and its stream, so that the next
  // step re-attaches.
  void ForgetSession();
  // Not attached: BackgroundAttach::Poll, adopting the session it returns.
  absl::Status PollReattach();
  using Deadline = std::chrono::steady_clock::time_point;
  absl::Status CallUnary(const v1::SelectPagesRequest& request, Deadline deadline,
                         v1::SelectPagesResponse* response);
  absl::Status CallStream(const v1::SelectPagesRequest& request, Deadline deadline,
                          v1::SelectPagesResponse* response);
  void ReapAbandoned(bool wait);
  // The calls' trace metadata (key, value): options_' traceparent and tracestate when
  // valid, else what is (the first refusal logged to stderr).
  std::vector<std::pair<std::string, std::string>> TraceMetadata();

  ClientOptions options_;
  const absl::Status options_status_;  // options_.Validate()
  bool trace_refusal_logged_ = false;  // engine thread only
  v1::AttachRequest attach_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::PageSelector::Stub> stub_;
  std::string session_id_;
  bool attached_before_ = false;
  bool detached_ = false;  // Detach() ran and Attach() has not since: steps are refused
  // Its thread calls CallAttach: after stub_ and attach_, so that it is destroyed first.
  BackgroundAttach reattach_;
  std::unique_ptr<StreamCall> stream_;
  std::vector<std::unique_ptr<UnaryCall>> abandoned_;           // cancelled, callback pending
  std::vector<std::unique_ptr<StreamCall>> abandoned_streams_;  // cancelled, OnDone pending

  const uint64_t client_id_;  // names this client's fallback reports (random)
  ClientCounters reported_;   // fallbacks epsd has surely been told about (engine thread only)
  std::atomic<uint64_t> steps_{0}, selected_{0}, fb_deadline_{0}, fb_unavailable_{0},
      fb_not_attached_{0}, fb_error_{0}, reattaches_{0}, errors_{0};
};

}  // namespace eps::client
