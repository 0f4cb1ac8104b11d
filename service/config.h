// epsd's command-line configuration. The flags themselves are abseil flags defined in
// service/flags.cc; ParseFlags parses a command line into them and reads them into a
// ServerConfig. Each call starts from the defaults, so tests can call it any number of
// times (not concurrently).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/select.h"
#include "service/backend_kind.h"

namespace eps::service {

struct ServerConfig {
  std::string listen = "unix:///tmp/epsd.sock";  // unix:///path or host:port
  bool allow_remote = false;    // TCP beyond loopback only when set (every listener)
  uint32_t socket_mode = 0660;  // file mode of the Unix socket
  BackendKind backend = BackendKind::kAuto;
  SelectPolicy policy;        // --eps-* defaults for sessions
  int group_blocks = 8;       // --eps-group-blocks
  int sketch_dim = 8;         // --eps-dim
  uint32_t lease_ms = 10000;  // default session lease
  uint32_t max_sessions = 64;
  uint32_t max_sessions_per_user = 0;  // 0: no cap but max_sessions
  uint32_t max_batch = 1024;
  uint32_t max_message_bytes = 64u << 20;
  // What epsd may allocate for requests (inline buffers, Phi banks, step scratch,
  // device buffers): per session, and for all sessions together (docs/security.md).
  uint64_t max_session_bytes = uint64_t{512} << 20;
  uint64_t max_server_bytes = uint64_t{2} << 30;
  // The address space the sessions' host_shm objects take in epsd (their whole sizes,
  // mapped): per session, and for all sessions together (docs/security.md).
  uint64_t max_session_mapped_bytes = uint64_t{1} << 40;
  uint64_t max_server_mapped_bytes = uint64_t{32} << 40;
  uint32_t drain_ms = 5000;           // SIGTERM: how long in-flight calls may finish
  uint32_t inputs_timeout_ms = 1000;  // async steps: the watchdog on inputs_ready
  // How long a stream abandoned with work that may still run may keep a device's ended
  // sessions from being freed before epsd treats the device as lost
  // (service/session_janitor.h). Not a flag: 0 is AbandonedStreamLimit's default; tests
  // set a short one.
  uint32_t abandoned_stream_limit_ms = 0;
  std::string metrics_listen = "127.0.0.1:9464";  // Prometheus /metrics; empty: not served
  std::string health_listen;  // grpc.health.v1 over TCP (host:port); empty: not served
  std::string step_log;       // JSONL step log path; empty: off (RunEpsd opens it, else Start)
  bool help = false;
  bool version = false;
};

// `abandoned_stream_limit_ms` when set, else the larger of 30 s and 3 x --inputs-timeout-ms.
// An abandoned stream is one whose engine kept inputs_ready below its step for
// --inputs-timeout-ms and then 5 s more after epsd released the wait; a live engine that
// is merely late raises the counter with its next step (milliseconds), so it drains long
// before the bound. Past it the engine has exited or keeps the counter low on purpose, and
// a restart (every engine re-attaches, attending densely meanwhile) costs less than a
// device whose ended sessions are never freed.
std::chrono::milliseconds AbandonedStreamLimit(const ServerConfig& config);

// Parses --flag=value and --flag value forms; unknown flags, stray words and bad values
// are errors that name the flag and the value.
absl::StatusOr<ServerConfig> ParseFlags(const std::vector<std::string>& args);

// Every flag name epsd accepts (without "--"), for --help and deployment checks.
const std::vector<std::string>& FlagNames();
std::string Usage();

// Rejects a listener address that is not a Unix socket or loopback unless allow_remote;
// `flag` names the flag in the error ("listen", "metrics-listen", "health-listen").
absl::Status CheckListenAddress(const std::string& flag, const std::string& address,
                                bool allow_remote);
// Every listener of `config`, by that rule.
absl::Status CheckListeners(const ServerConfig& config);

}  // namespace eps::service
