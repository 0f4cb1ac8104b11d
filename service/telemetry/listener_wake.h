#pragma once

#include <string>

#include "absl/functional/function_ref.h"

namespace eps::telemetry {

// civetweb (the web server behind prometheus-cpp's Exposer, which serves /metrics) looks at
// its stop flag only between two polls of its listening sockets, each up to 2 s long
// (civetweb 1.15's SOCKET_TIMEOUT_QUANTUM), so destroying an Exposer took 0.8-2 s: most of
// epsd's exit after SIGTERM. StopWhileWaking runs `stop` while another thread connects to
// host:port every few milliseconds and closes each connection at once: the connection wakes
// the poll, and the listener then sees the flag. A host of 0.0.0.0 (or empty) is reached on
// 127.0.0.1; one that does not resolve to IPv4 only runs `stop`.
void StopWhileWaking(const std::string& host, int port, absl::FunctionRef<void()> stop);

}  // namespace eps::telemetry
