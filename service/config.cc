#include "service/config.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "cli/flags.h"
#include "core/status.h"
#include "service/flags.h"

namespace eps::service {
namespace {

// One of `names`, by the flag's value; an error naming the flag otherwise.
template <typename T>
absl::Status ReadChoice(const absl::Flag<std::string>& flag,
                        std::initializer_list<std::pair<const char*, T>> names, T* out) {
  const std::string value = absl::GetFlag(flag);
  std::string want;
  for (const auto& [name, choice] : names) {
    if (value == name) {
      *out = choice;
      return absl::OkStatus();
    }
    absl::StrAppend(&want, want.empty() ? "" : ", ", name);
  }
  return cli::Invalid(flag, absl::StrCat("one of ", want));
}

// host:port with a port in [0, 65535], or "off"/empty for none.
absl::Status ReadHostPort(const absl::Flag<std::string>& flag, std::string* out) {
  const std::string v = absl::GetFlag(flag);
  if (v.empty() || v == "off") {
    out->clear();
    return absl::OkStatus();
  }
  if (!cli::IsHostPort(v))
    return cli::Invalid(flag, "host:port (port in [0, 65535]), empty or off");
  *out = v;
  return absl::OkStatus();
}

// A float the policy holds, from a double flag: checked as the float it becomes, so that a
// value that narrows to 0 (--eps-top-p=1e-300) is refused here by the flag's name rather
// than by the policy's check, which knows no flag.
absl::Status ReadPositiveFloat(const absl::Flag<double>& flag, float hi, float* out) {
  const double value = absl::GetFlag(flag);
  const float narrowed = static_cast<float>(value);
  if (!(narrowed > 0.0f && value <= hi)) {
    const bool underflows = value > 0.0 && narrowed == 0.0f;
    return cli::Invalid(
        flag, absl::StrCat("a number in (0, ", hi, "]",
                           underflows ? " that is not 0 as a float (not below about 7e-46)" : ""));
  }
  *out = narrowed;
  return absl::OkStatus();
}

// --listen: unix:///path (an absolute path that fits a socket address) or host:port. gRPC's
// other spellings (unix:path, unix-abstract:name, dns:...) are refused: epsd binds and
// removes the socket file itself, by path (docs/cli.md). unix://relative.sock would bind a
// file in epsd's working directory that no client can dial: their unix://relative names
// an authority, not a path (cli::CheckDialTarget refuses it).
absl::Status ReadListen(std::string* out) {
  const std::string v = absl::GetFlag(FLAGS_listen);
  if (absl::StartsWith(v, "unix://")) {
    const std::string path = v.substr(7);
    if (path.size() < 2 || path[0] != '/') {
      return cli::Invalid(FLAGS_listen, "unix:///path: an absolute path after unix://");
    }
    RETURN_IF_ERROR(cli::CheckSocketPathLength(absl::GetFlagReflectionHandle(FLAGS_listen), path));
    *out = v;
    return absl::OkStatus();
  }
  if (!cli::IsHostPort(v)) {
    return cli::Invalid(FLAGS_listen,
                        "unix:///path or host:port with a port in [0, 65535] (unix:path and "
                        "unix-abstract: are not supported)");
  }
  *out = v;
  return absl::OkStatus();
}

// Octal digits only (no sign, no spaces, no 0x), at most 0777.
absl::Status ReadSocketMode(uint32_t* out) {
  const std::string mode = absl::GetFlag(FLAGS_socket_mode);
  const bool octal = !mode.empty() && std::all_of(mode.begin(), mode.end(),
                                                  [](char c) { return c >= '0' && c <= '7'; });
  uint32_t parsed = 0;
  for (char c : mode) {
    if (parsed > 0777) break;  // out of range already; no overflow from a long string
    parsed = parsed * 8 + static_cast<uint32_t>(c - '0');
  }
  if (!octal || parsed > 0777) return cli::Invalid(FLAGS_socket_mode, "octal digits, at most 0777");
  *out = parsed;
  return absl::OkStatus();
}

uint32_t Ms(absl::Duration d) { return static_cast<uint32_t>(absl::ToInt64Milliseconds(d)); }

// Reads the process's flags into a config, checking every range.
absl::StatusOr<ServerConfig> ReadFlags() {
  ServerConfig c;
  RETURN_IF_ERROR(ReadListen(&c.listen));
  c.allow_remote = absl::GetFlag(FLAGS_allow_remote);
  RETURN_IF_ERROR(ReadSocketMode(&c.socket_mode));
  RETURN_IF_ERROR(ReadHostPort(FLAGS_metrics_listen, &c.metrics_listen));
  // civetweb, as Debian builds it for prometheus-cpp, has no IPv6: [::1] or [::] passed
  // the syntax check and then failed to bind with "is the port in use?".
  if (absl::StartsWith(c.metrics_listen, "[")) {
    return cli::Invalid(FLAGS_metrics_listen,
                        "an IPv4 address or host name and a port: /metrics is served over IPv4 "
                        "only (0.0.0.0 for every interface)");
  }
  RETURN_IF_ERROR(ReadHostPort(FLAGS_health_listen, &c.health_listen));
  RETURN_IF_ERROR(ReadChoice<BackendKind>(
      FLAGS_backend,
      {{"cpu", BackendKind::kCpu}, {"cuda", BackendKind::kCuda}, {"auto", BackendKind::kAuto}},
      &c.backend));
  if (!ParseMethod(absl::GetFlag(FLAGS_eps_method), &c.policy.method)) {
    return cli::Invalid(FLAGS_eps_method, "off, jl, 1pc, fro, quest or questclt");
  }
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_eps_dim, 1, 64, &c.sketch_dim));
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_eps_group_blocks, 1, 1024, &c.group_blocks));
  double alpha = 0;
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_eps_alpha, 1.0, double{kMaxAlpha}, &alpha));
  c.policy.alpha = static_cast<float>(alpha);
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_eps_first_n, 0, 1 << 30, &c.policy.first_n));
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_eps_last_n, 0, 1 << 30, &c.policy.last_n));
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_eps_top_pages, 1, 1 << 30, &c.policy.top_pages));
  RETURN_IF_ERROR(ReadChoice<HeadMode>(
      FLAGS_eps_heads, {{"all", HeadMode::kAll}, {"retrieval", HeadMode::kRetrieval}},
      &c.policy.heads));
  c.policy.strict = absl::GetFlag(FLAGS_eps_strict);
  RETURN_IF_ERROR(ReadChoice<Budget>(FLAGS_eps_budget,
                                     {{"threshold", Budget::kThreshold},
                                      {"fixed", Budget::kFixed},
                                      {"top_p", Budget::kTopP},
                                      {"mass", Budget::kMass}},
                                     &c.policy.budget));
  RETURN_IF_ERROR(ReadPositiveFloat(FLAGS_eps_top_p, 1.0f, &c.policy.top_p));
  RETURN_IF_ERROR(ReadPositiveFloat(FLAGS_eps_budget_mass, 1.0f, &c.policy.mass_target));
  RETURN_IF_ERROR(
      ReadPositiveFloat(FLAGS_eps_mass_temperature, 1000.0f, &c.policy.mass_temperature));
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_eps_min_pages, 0, 1 << 30, &c.policy.min_pages));
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_eps_max_pages, 0, 1 << 30, &c.policy.max_pages));
  RETURN_IF_ERROR(ReadChoice<MassScope>(FLAGS_eps_mass_scope,
                                        {{"head", MassScope::kHead}, {"list", MassScope::kList}},
                                        &c.policy.mass_scope));
  const double coarse = absl::GetFlag(FLAGS_eps_coarse_candidates);
  if (!(coarse >= 1.0 && coarse <= 1024.0)) {
    return cli::Invalid(FLAGS_eps_coarse_candidates, "a number in [1, 1024]");
  }
  c.policy.coarse_candidates = static_cast<float>(coarse);
  // What no engine's layout can make valid (strict mode with another budget, a mass floor
  // above its ceiling) is refused here, not at every Attach; a layout with every record
  // part leaves to the Attach only what depends on the engine (a method whose part its
  // records lack, retrieval marks of its shape).
  ModelLayout any_layout;
  any_layout.features = {.key_sum = true, .principal = true, .quest = true, .quest8 = true};
  if (absl::Status s = c.policy.Validate(any_layout); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the --eps-* flags do not make a selection policy: ", s.message()));
  }

  absl::Duration d;
  RETURN_IF_ERROR(cli::ReadDuration(FLAGS_lease_ms, absl::Milliseconds(50), absl::Hours(1), &d));
  c.lease_ms = Ms(d);
  RETURN_IF_ERROR(
      cli::ReadDuration(FLAGS_inputs_timeout_ms, absl::Milliseconds(1), absl::Minutes(10), &d));
  c.inputs_timeout_ms = Ms(d);
  RETURN_IF_ERROR(cli::ReadDuration(FLAGS_drain_ms, absl::ZeroDuration(), absl::Minutes(10), &d));
  c.drain_ms = Ms(d);
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_max_sessions, 1u, 100000u, &c.max_sessions));
  RETURN_IF_ERROR(
      cli::ReadInRange(FLAGS_max_sessions_per_user, 0u, 100000u, &c.max_sessions_per_user));
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_max_batch, 1u, 1u << 20, &c.max_batch));
  RETURN_IF_ERROR(
      cli::ReadInRange(FLAGS_max_message_bytes, 1u << 10, 1u << 30, &c.max_message_bytes));
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_max_session_bytes, uint64_t{1} << 20, uint64_t{1} << 40,
                                   &c.max_session_bytes));
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_max_server_bytes, uint64_t{1} << 20, uint64_t{1} << 42,
                                   &c.max_server_bytes));
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_max_session_mapped_bytes, uint64_t{1} << 20,
                                   uint64_t{64} << 40, &c.max_session_mapped_bytes));
  RETURN_IF_ERROR(cli::ReadInRange(FLAGS_max_server_mapped_bytes, uint64_t{1} << 20,
                                   uint64_t{64} << 40, &c.max_server_mapped_bytes));
  c.step_log = absl::GetFlag(FLAGS_step_log);
  return c;
}

}  // namespace

std::chrono::milliseconds AbandonedStreamLimit(const ServerConfig& config) {
  if (config.abandoned_stream_limit_ms != 0) {
    return std::chrono::milliseconds(config.abandoned_stream_limit_ms);
  }
  return std::max(std::chrono::milliseconds(30000),
                  3 * std::chrono::milliseconds(config.inputs_timeout_ms));
}

const std::vector<std::string>& FlagNames() {
  static const auto* names = new std::vector<std::string>(cli::FlagNames());
  return *names;
}

std::string Usage() { return cli::Usage("epsd [flags]"); }

absl::Status CheckListenAddress(const std::string& flag, const std::string& address,
                                bool allow_remote) {
  if (absl::StartsWith(address, "unix://")) {
    if (!absl::StartsWith(address, "unix:///") || address.size() <= 8) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, "=", address, ": want unix:///path: an absolute path"));
    }
    return absl::OkStatus();
  }
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:")) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", address,
                     ": want unix:///path (unix:path and unix-abstract: are not "
                     "supported)"));
  }
  if (allow_remote) return absl::OkStatus();
  const size_t colon = address.rfind(':');
  std::string host = colon == std::string::npos ? address : address.substr(0, colon);
  if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]")) {
    host = host.substr(1, host.size() - 2);
  }
  // 127.* is an IPv4 address in 127/8, as inet_aton reads one (127.0.0.1, 127.1), never a
  // host name that merely starts so: "127.example.com" resolves to whatever DNS says, and
  // passed this check as text, binding a public address without --allow-remote.
  in_addr v4{};
  if (host == "localhost" || host == "::1" ||
      (inet_aton(host.c_str(), &v4) != 0 && (ntohl(v4.s_addr) >> 24) == 127)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", address,
                                                 " is not a Unix socket or a loopback address; "
                                                 "pass --allow-remote"));
}

absl::Status CheckListeners(const ServerConfig& config) {
  RETURN_IF_ERROR(CheckListenAddress("listen", config.listen, config.allow_remote));
  if (!config.metrics_listen.empty()) {
    RETURN_IF_ERROR(
        CheckListenAddress("metrics-listen", config.metrics_listen, config.allow_remote));
  }
  if (!config.health_listen.empty()) {
    if (absl::StartsWith(config.health_listen, "unix:")) {
      return absl::InvalidArgumentError(absl::StrCat("--health-listen=", config.health_listen,
                                                     ": want host:port (kubelet probes TCP)"));
    }
    RETURN_IF_ERROR(CheckListenAddress("health-listen", config.health_listen, config.allow_remote));
  }
  return absl::OkStatus();
}

absl::StatusOr<ServerConfig> ParseFlags(const std::vector<std::string>& args) {
  cli::CommandLine command_line;
  RETURN_IF_ERROR(cli::ParseArgs(args, &command_line));
  absl::StatusOr<ServerConfig> config = ReadFlags();
  if (!config.ok()) return config.status();
  RETURN_IF_ERROR(CheckListeners(*config));
  config->help = command_line.help;
  config->version = command_line.version;
  return config;
}

}  // namespace eps::service
