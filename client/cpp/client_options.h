// How an EpsClient talks to epsd (ClientOptions: target, deadlines, fail-open, transport,
// trace context, fallback callback), checked by Validate, and the W3C trace context a client
// may send: the Python client's eps_client.client_options. client/cpp/eps_client.h includes
// it; include that.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace eps::client {

// $EPS_TARGET when set (the deploy manifests set it to epsd's --listen), else
// epsd's default listener, unix:///tmp/epsd.sock.
std::string DefaultTarget();

struct ClientOptions {
  std::string target = DefaultTarget();
  std::chrono::microseconds deadline{2000};         // per SelectPages; > 0
  std::chrono::milliseconds attach_deadline{500};   // Attach, Detach, re-attach; > 0
  std::chrono::milliseconds reattach_backoff{100};  // between re-attach attempts; >= 0
  bool fail_open = true;  // false: a failed step is an error for the engine
  bool use_stream = false;
  // W3C trace context to send, when set. One that is not a W3C traceparent
  // (ValidTraceparent) is not sent, and its tracestate with it (logged once).
  std::string traceparent;
  // Its vendor state, sent with a valid traceparent when set and ValidTracestate.
  std::string tracestate;
  // REPLY_MODE_ASYNC (cuda backend, flags buffer required): the reply comes once
  // the step is queued; the engine's stream waits on selection_done.
  bool reply_async = false;
  // Called with the step number whenever a step falls back (fail open), on the
  // engine's thread: e.g. DeviceBuffers::ReleaseDense, so that an engine stream
  // waiting on selection_done proceeds and attends densely.
  std::function<void(uint64_t step)> on_fallback;
  // Extra integer gRPC channel arguments (e.g. "grpc.enable_retries" = 0), set
  // after the client's own reconnect-backoff arguments; for tuning and benchmarks.
  std::vector<std::pair<std::string, int>> channel_args;

  // InvalidArgument naming the field and its value: an empty target, a deadline or
  // attach_deadline <= 0, a reattach_backoff < 0. Durations have no upper bound: one past
  // a century (milliseconds::max(), say) reads as "no deadline" rather than wrapping.
  absl::Status Validate() const;
};

// Whether `value` is a W3C traceparent (version-traceid-parentid-flags, lower-case hex, not
// all-zero ids, version ff refused, nothing after the flags for version 00): the
// Python client's valid_traceparent.
bool ValidTraceparent(std::string_view value);
// Whether `value` can be sent as a tracestate: at most 512 characters of printable ASCII
// (gRPC refuses control characters in metadata values).
bool ValidTracestate(std::string_view value);

}  // namespace eps::client
