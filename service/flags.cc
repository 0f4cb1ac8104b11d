// Every flag epsd accepts (docs/api-server.md lists them with their ranges; config.cc checks them).
#include "service/flags.h"

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, listen, "unix:///tmp/epsd.sock",
          "the gRPC API: unix:///path (absolute, at most 107 bytes), or host:port with a port in "
          "[0, 65535] "
          "(0: any; loopback unless --allow-remote); unix:path and unix-abstract: are refused");
ABSL_FLAG(bool, allow_remote, false,
          "let --listen, --metrics-listen and --health-listen bind a non-loopback address");
ABSL_FLAG(std::string, socket_mode, "0660",
          "file mode of the Unix socket: octal digits, at most 0777");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "host:port of the Prometheus /metrics endpoint, IPv4 only (port 0 picks one; off or "
          "empty: not served; loopback unless --allow-remote)");
ABSL_FLAG(std::string, health_listen, "",
          "host:port where grpc.health.v1 (and reflection, never the API) is served over TCP, "
          "for kubelet's native gRPC probes (off or empty: not served; loopback unless "
          "--allow-remote)");

ABSL_FLAG(std::string, backend, "auto",
          "cpu | cuda | auto (per session: cuda when its buffers are cuda_ipc handles)");
ABSL_FLAG(
    std::string, eps_method, "questclt",
    "off | jl | 1pc | fro | quest | questclt (questclt: the default, an estimate from quest's "
    "record that ranks better on real keys; quest: the bound; docs/policy.md)");
ABSL_FLAG(int, eps_dim, 8, "sketch dimension m, in [1, 64]");
ABSL_FLAG(int, eps_group_blocks, 2, "blocks per summary group g, in [1, 1024]");
ABSL_FLAG(double, eps_alpha, 1.0, "visit groups scoring >= T/alpha, in [1, 1e6]");
ABSL_FLAG(int, eps_first_n, 1, "attention-sink groups always visited, in [0, 2^30]");
ABSL_FLAG(int, eps_last_n, 2, "recent groups always visited, the newest among them, in [0, 2^30]");
ABSL_FLAG(int, eps_top_pages, 64, "top_pages M, in [1, 2^30]");
ABSL_FLAG(std::string, eps_heads, "all", "all | retrieval");
ABSL_FLAG(bool, eps_strict, false, "guarantee a superset of the true top-M");
ABSL_FLAG(std::string, eps_budget, "threshold", "threshold | fixed | top_p | mass");
ABSL_FLAG(double, eps_top_p, 0.95,
          "estimated attention mass to cover with --eps-budget=top_p, in (0, 1]");
ABSL_FLAG(double, eps_budget_mass, 0.95,
          "estimated attention mass p to reach with --eps-budget=mass, in (0, 1] "
          "(docs/policy-selection.md, Mass budget)");
ABSL_FLAG(double, eps_mass_temperature, 1.0,
          "calibration temperature of the mass estimate with --eps-budget=mass, in (0, 1000]");
ABSL_FLAG(int, eps_min_pages, 0,
          "with --eps-budget=mass: unforced groups always kept per head (per list with "
          "--eps-mass-scope=list), in [0, 2^30]");
ABSL_FLAG(
    int, eps_max_pages, 0,
    "with --eps-budget=mass: unforced groups kept per head (list) at most (0: no ceiling), in "
    "[0, 2^30]");
ABSL_FLAG(std::string, eps_mass_scope, "head",
          "with --eps-budget=mass: head (every head reaches p of its own mass) | list (the list "
          "reaches p of its heads' mean mass; fewer groups)");
ABSL_FLAG(double, eps_coarse_candidates, 2.0,
          "with a coarse level (the engine's layout.coarse_blocks): each scored head's "
          "ceil(c * top_pages / r) best coarse groups are the candidates whose groups are "
          "scored, in [1, 1024] (docs/api.md, SelectOptions.coarse_candidates)");

ABSL_FLAG(eps::cli::Millis, lease_ms, {absl::Milliseconds(10000)},
          "session lease, renewed by Attach, SelectPages and Heartbeat, in [50ms, 1h]");
ABSL_FLAG(int64_t, max_sessions, 64,
          "sessions at once, in [1, 100000]; also bounds the step threads (one per session "
          "stepping at once, plus one per core)");
ABSL_FLAG(int64_t, max_sessions_per_user, 0,
          "sessions at once of one user (by the Unix socket's peer uid; the callers over TCP "
          "are one user), in [0, 100000]; 0: no cap but --max-sessions");
ABSL_FLAG(eps::cli::Size, max_batch, {1024}, "rows per step, in [1, 1M]");
ABSL_FLAG(eps::cli::Size, max_message_bytes, {64 << 20}, "largest gRPC message, in [1k, 1G]");
ABSL_FLAG(eps::cli::Size, max_session_bytes, {int64_t{512} << 20},
          "bytes epsd may allocate for one session (inline buffers, its Phi bank, step "
          "scratch, device buffers); an Attach past it is RESOURCE_EXHAUSTED, in [1M, 1T] "
          "(docs/security.md)");
ABSL_FLAG(eps::cli::Size, max_server_bytes, {int64_t{2} << 30},
          "bytes epsd may allocate for all sessions together, in [1M, 4T] (docs/security.md)");
ABSL_FLAG(eps::cli::Size, max_session_mapped_bytes, {int64_t{1} << 40},
          "address space one session's host_shm objects may take in epsd (their sizes); an "
          "Attach past it is RESOURCE_EXHAUSTED, in [1M, 64T] (docs/security.md)");
ABSL_FLAG(eps::cli::Size, max_server_mapped_bytes, {int64_t{32} << 40},
          "address space all sessions' host_shm objects may take together, in [1M, 64T]");
ABSL_FLAG(eps::cli::Millis, inputs_timeout_ms, {absl::Milliseconds(1000)},
          "cuda backend, async replies: how long a queued step waits for the engine's "
          "inputs_ready before epsd releases it and fails the step, in [1ms, 10m]");
ABSL_FLAG(eps::cli::Millis, drain_ms, {absl::Milliseconds(5000)},
          "on SIGTERM, how long in-flight calls may finish, in [0, 10m]");

ABSL_FLAG(std::string, step_log, "",
          "append one JSON line per SelectPages step to this file (empty: off)");
