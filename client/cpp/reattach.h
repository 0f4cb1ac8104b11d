// EpsClient's re-attach after epsd restarted or the session was lost (docs/api-failures.md
// §5.4): a step with no session never attaches inline. It polls this, which starts one
// Attach on a thread of its own once reattach_backoff has passed since the last failure,
// and falls back at once; a later step collects the session that Attach was granted. An
// explicit Attach() or Detach() waits for the one in flight within its own deadline (Take);
// destroying the client cancels it (Close), so that neither waits out a stalled Attach. The
// Python client's eps_client.reattach does the same.
//
// Thread safety: Poll, Take, BackOff and set_starter are for the client's engine thread, as
// EpsClient's calls are; the Attach call runs on the started thread and shares only the
// fields `mu_` guards with it. Close runs in the client's destructor (and this one's).
#pragma once

#include <chrono>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "grpcpp/client_context.h"

namespace eps::client {

class BackgroundAttach {
 public:
  // The session id an Attach was granted, or why it failed.
  using Result = absl::StatusOr<std::string>;
  // Starts `attach` on a thread of its own: std::async unless set_starter replaced it
  // (EpsClient::ReattachStarter).
  using Starter = std::function<std::future<Result>(std::function<Result()> attach)>;
  // One Attach call on `context`, which sets its deadline (EpsClient::CallAttach).
  using AttachCall = std::function<Result(grpc::ClientContext& context)>;

  BackgroundAttach(AttachCall attach, std::chrono::milliseconds backoff);
  ~BackgroundAttach() { Close(); }
  BackgroundAttach(const BackgroundAttach&) = delete;
  BackgroundAttach& operator=(const BackgroundAttach&) = delete;

  void set_starter(Starter start) { start_ = std::move(start); }

  // Not attached: collects a finished re-attach, or starts one when the backoff allows. Never
  // waits. Returns the session granted, else UNAVAILABLE saying why the step falls back: one
  // in progress, one that failed (naming its error; the backoff then applies), the backoff,
  // one just started, or one that could not start (no thread for it; the backoff applies).
  Result Poll();
  // Waits for the re-attach in flight until `deadline` and returns its answer; nullopt when
  // none is in flight. One not done by then is cancelled (and a thread that has not started
  // its call yet does not start it), its answer then CANCELLED.
  std::optional<Result> Take(std::chrono::steady_clock::time_point deadline);
  // No re-attach starts before reattach_backoff from now: after a failed Attach.
  void BackOff();
  // Cancels the re-attach in flight and refuses later ones, then waits for its thread (a
  // cancelled call returns promptly, even with epsd stopped).
  void Close();

 private:
  // The started thread's: the Attach, unless Close ran or Take gave up on it first.
  Result Run();

  const AttachCall attach_;
  const std::chrono::milliseconds backoff_;
  // The engine thread's only.
  Starter start_;
  std::chrono::steady_clock::time_point next_try_{};  // no re-attach starts before it
  std::future<Result> pending_;                       // the re-attach in flight, when valid
  // Shared with the re-attach thread.
  std::mutex mu_;
  grpc::ClientContext* context_ ABSL_GUARDED_BY(mu_) = nullptr;  // the running Attach's
  bool closing_ ABSL_GUARDED_BY(mu_) = false;                    // set by Close
  // Set when the caller gave up on the Attach before its thread had started the call: the
  // thread then does not start it. Cleared as each re-attach starts.
  bool abandoned_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace eps::client
