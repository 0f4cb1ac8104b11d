#pragma once

#include <netinet/in.h>

#include <optional>
#include <string>

#include "absl/functional/function_ref.h"

namespace eps::telemetry {

// civetweb (the web server behind prometheus-cpp's Exposer, which serves /metrics) looks at
// its stop flag only between two polls of its listening sockets, each up to 2 s long
// (civetweb 1.15's SOCKET_TIMEOUT_QUANTUM), so destroying an Exposer took 0.8-2 s: most of
// epsd's exit after SIGTERM. StopWhileWaking runs `stop` while another thread connects to
// the listener every few milliseconds and closes each connection at once: the connection
// wakes the poll, and the listener then sees the flag.

// The address to connect to for a listener on host:port (0.0.0.0 or an empty host: reached
// on 127.0.0.1), resolved once, when the server starts (not at exit, where a resolver's
// timeouts would delay it); none for a host that does not resolve to IPv4 or a port < 1.
std::optional<sockaddr_in> ListenerAddress(const std::string& host, int port);

// Runs `stop` once, with the listener at `address` woken meanwhile (none: `stop` alone, as
// also when no thread can be started).
void StopWhileWaking(const std::optional<sockaddr_in>& address, absl::FunctionRef<void()> stop);

}  // namespace eps::telemetry
