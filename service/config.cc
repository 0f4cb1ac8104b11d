#include "service/config.h"

#include <functional>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace eps::service {
namespace {

using Setter = std::function<absl::Status(const std::string&, ServerConfig&)>;

struct Flag {
  std::string help;
  Setter set;
  bool is_bool = false;
};

absl::Status Bad(const std::string& flag, const std::string& value, const std::string& want) {
  return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", value, ": want ", want));
}

template <typename T>
Setter Number(const std::string& flag, T ServerConfig::*field, T lo, T hi) {
  return [=](const std::string& v, ServerConfig& c) -> absl::Status {
    T parsed{};
    if (!absl::SimpleAtoi(v, &parsed) || parsed < lo || parsed > hi) {
      return Bad(flag, v, absl::StrCat("an integer in [", lo, ", ", hi, "]"));
    }
    c.*field = parsed;
    return absl::OkStatus();
  };
}

Setter PolicyInt(const std::string& flag, int SelectPolicy::*field, int lo) {
  return [=](const std::string& v, ServerConfig& c) -> absl::Status {
    int parsed = 0;
    if (!absl::SimpleAtoi(v, &parsed) || parsed < lo) {
      return Bad(flag, v, absl::StrCat("an integer >= ", lo));
    }
    c.policy.*field = parsed;
    return absl::OkStatus();
  };
}

absl::Status ParseBool(const std::string& flag, const std::string& v, bool* out) {
  if (v.empty() || v == "true" || v == "1") {
    *out = true;
  } else if (v == "false" || v == "0") {
    *out = false;
  } else {
    return Bad(flag, v, "true or false");
  }
  return absl::OkStatus();
}

const std::map<std::string, Flag>& Flags() {
  static const auto* flags = new std::map<std::string, Flag>{
      {"listen",
       {"unix:///path (default unix:///tmp/epsd.sock) or host:port (loopback unless --allow-remote)",
        [](const std::string& v, ServerConfig& c) {
          if (v.empty()) return Bad("listen", v, "unix:///path or host:port");
          c.listen = v;
          return absl::OkStatus();
        }}},
      {"allow-remote",
       {"accept a non-loopback TCP --listen address",
        [](const std::string& v, ServerConfig& c) { return ParseBool("allow-remote", v, &c.allow_remote); },
        true}},
      {"socket-mode",
       {"octal file mode of the Unix socket (default 0660)",
        [](const std::string& v, ServerConfig& c) {
          char* end = nullptr;
          const unsigned long mode = std::strtoul(v.c_str(), &end, 8);
          if (v.empty() || *end != '\0' || mode > 0777) return Bad("socket-mode", v, "octal <= 0777");
          c.socket_mode = static_cast<uint32_t>(mode);
          return absl::OkStatus();
        }}},
      {"backend",
       {"cpu | cuda | auto (per session: cuda when its buffers are cuda_ipc handles; default auto)",
        [](const std::string& v, ServerConfig& c) {
          if (v == "cpu") c.backend = BackendKind::kCpu;
          else if (v == "cuda") c.backend = BackendKind::kCuda;
          else if (v == "auto") c.backend = BackendKind::kAuto;
          else return Bad("backend", v, "cpu, cuda or auto");
          return absl::OkStatus();
        }}},
      {"eps-method",
       {"off | jl | 1pc | fro | quest (default jl)",
        [](const std::string& v, ServerConfig& c) {
          if (!ParseMethod(v, &c.policy.method)) return Bad("eps-method", v, "off, jl, 1pc, fro or quest");
          return absl::OkStatus();
        }}},
      {"eps-dim", {"sketch dimension m (default 8)", Number<int>("eps-dim", &ServerConfig::sketch_dim, 1, 64)}},
      {"eps-group-blocks",
       {"blocks per summary group g (default 8)",
        Number<int>("eps-group-blocks", &ServerConfig::group_blocks, 1, 1024)}},
      {"eps-alpha",
       {"visit groups scoring >= T/alpha (default 1.0)",
        [](const std::string& v, ServerConfig& c) {
          float a = 0;
          if (!absl::SimpleAtof(v, &a) || !(a >= 1.0f) || a > 1e6f) return Bad("eps-alpha", v, "a number >= 1");
          c.policy.alpha = a;
          return absl::OkStatus();
        }}},
      {"eps-first-n", {"attention-sink groups always visited (default 1)", PolicyInt("eps-first-n", &SelectPolicy::first_n, 0)}},
      {"eps-last-n", {"recent groups always visited, the newest among them (default 2)", PolicyInt("eps-last-n", &SelectPolicy::last_n, 0)}},
      {"eps-top-pages", {"top_pages M (default 16)", PolicyInt("eps-top-pages", &SelectPolicy::top_pages, 1)}},
      {"eps-heads",
       {"all | retrieval (default all)",
        [](const std::string& v, ServerConfig& c) {
          if (v == "all") c.policy.heads = HeadMode::kAll;
          else if (v == "retrieval") c.policy.heads = HeadMode::kRetrieval;
          else return Bad("eps-heads", v, "all or retrieval");
          return absl::OkStatus();
        }}},
      {"eps-strict",
       {"guarantee a superset of the true top-M (default false)",
        [](const std::string& v, ServerConfig& c) { return ParseBool("eps-strict", v, &c.policy.strict); },
        true}},
      {"eps-budget",
       {"threshold | fixed | top_p (default threshold)",
        [](const std::string& v, ServerConfig& c) {
          if (v == "threshold") c.policy.budget = Budget::kThreshold;
          else if (v == "fixed") c.policy.budget = Budget::kFixed;
          else if (v == "top_p") c.policy.budget = Budget::kTopP;
          else return Bad("eps-budget", v, "threshold, fixed or top_p");
          return absl::OkStatus();
        }}},
      {"eps-top-p",
       {"estimated attention mass to cover with --eps-budget=top_p (default 0.95)",
        [](const std::string& v, ServerConfig& c) {
          float p = 0;
          if (!absl::SimpleAtof(v, &p) || !(p > 0.0f && p <= 1.0f)) return Bad("eps-top-p", v, "a number in (0, 1]");
          c.policy.top_p = p;
          return absl::OkStatus();
        }}},
      {"lease-ms", {"session lease in ms, renewed by Attach, SelectPages and Heartbeat (default 10000)", Number<uint32_t>("lease-ms", &ServerConfig::lease_ms, 50, 3600000)}},
      {"max-sessions", {"sessions at once (default 64)", Number<uint32_t>("max-sessions", &ServerConfig::max_sessions, 1, 100000)}},
      {"max-batch", {"rows per step (default 1024)", Number<uint32_t>("max-batch", &ServerConfig::max_batch, 1, 1u << 20)}},
      {"max-session-bytes", {"bytes epsd may allocate for one session: inline buffers, its Phi bank, step scratch, device buffers; an Attach past it is RESOURCE_EXHAUSTED (default 536870912 = 512 MiB)", Number<uint64_t>("max-session-bytes", &ServerConfig::max_session_bytes, 1u << 20, uint64_t{1} << 40)}},
      {"max-server-bytes", {"bytes epsd may allocate for all sessions together (default 2147483648 = 2 GiB)", Number<uint64_t>("max-server-bytes", &ServerConfig::max_server_bytes, 1u << 20, uint64_t{1} << 42)}},
      {"max-message-bytes", {"largest gRPC message (default 64 MiB)", Number<uint32_t>("max-message-bytes", &ServerConfig::max_message_bytes, 1024, 1u << 30)}},
      {"inputs-timeout-ms", {"cuda backend, async replies: how long a queued step waits for the engine's inputs_ready before epsd releases it and fails the step (default 1000)", Number<uint32_t>("inputs-timeout-ms", &ServerConfig::inputs_timeout_ms, 1, 600000)}},
      {"metrics-listen",
       {"host:port of the Prometheus /metrics endpoint (default 127.0.0.1:9464; port 0 picks "
        "one; empty or off: not served)",
        [](const std::string& v, ServerConfig& c) {
          if (v.empty() || v == "off") {
            c.metrics_listen.clear();
            return absl::OkStatus();
          }
          const size_t colon = v.rfind(':');
          int port = -1;
          if (colon == std::string::npos || colon == 0 ||
              !absl::SimpleAtoi(v.substr(colon + 1), &port) || port < 0 || port > 65535) {
            return Bad("metrics-listen", v, "host:port (port in [0, 65535]), empty or off");
          }
          c.metrics_listen = v;
          return absl::OkStatus();
        }}},
      {"step-log",
       {"append one JSON line per SelectPages step to this file (default: off)",
        [](const std::string& v, ServerConfig& c) {
          if (v.empty()) return Bad("step-log", v, "a file path");
          c.step_log = v;
          return absl::OkStatus();
        }}},
      {"drain-ms", {"on SIGTERM, how long in-flight calls may finish (default 5000)", Number<uint32_t>("drain-ms", &ServerConfig::drain_ms, 0, 600000)}},
  };
  return *flags;
}

}  // namespace

const std::vector<std::string>& FlagNames() {
  static const auto* names = [] {
    auto* v = new std::vector<std::string>{"help"};
    for (const auto& [name, flag] : Flags()) v->push_back(name);
    return v;
  }();
  return *names;
}

std::string Usage() {
  std::string out = "usage: epsd [flags]\n";
  for (const auto& [name, flag] : Flags()) absl::StrAppend(&out, "  --", name, "  ", flag.help, "\n");
  return out;
}

absl::StatusOr<ServerConfig> ParseFlags(const std::vector<std::string>& args) {
  ServerConfig config;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--help" || arg == "-h") {
      config.help = true;
      continue;
    }
    if (arg.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", arg, "'"));
    }
    std::string name = arg.substr(2), value;
    bool has_value = false;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    const auto it = Flags().find(name);
    if (it == Flags().end()) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
    if (!has_value && !it->second.is_bool) {
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      }
      value = args[++i];
    }
    if (absl::Status s = it->second.set(value, config); !s.ok()) return s;
  }
  return config;
}

}  // namespace eps::service
