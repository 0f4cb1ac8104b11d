#include "service/telemetry/otel_config.h"

#include <algorithm>
#include <climits>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/status.h"

namespace eps::telemetry {
namespace {

std::string Get(const EnvLookup& env, const char* name) {
  const char* v = env(name);
  return v == nullptr ? std::string() : std::string(absl::StripAsciiWhitespace(v));
}

// The signal-specific variable wins over the general one: the name of the one that applies
// (the general one when neither is set), for values and errors alike.
std::string TracesName(const EnvLookup& env, const std::string& suffix) {
  std::string traces = "OTEL_EXPORTER_OTLP_TRACES_" + suffix;
  return Get(env, traces.c_str()).empty() ? "OTEL_EXPORTER_OTLP_" + suffix : traces;
}

std::string GetTraces(const EnvLookup& env, const std::string& suffix) {
  return Get(env, TracesName(env, suffix).c_str());
}

absl::StatusOr<std::string> PercentDecode(const std::string& name, const std::string& in) {
  std::string out;
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out.push_back(in[i]);
      continue;
    }
    int value = 0;
    if (i + 2 >= in.size() || !absl::SimpleHexAtoi(in.substr(i + 1, 2), &value)) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": bad %-escape in '", in, "'"));
    }
    out.push_back(static_cast<char>(value));
    i += 2;
  }
  return out;
}

// The longest duration an OTEL_* variable may set, in ms: 2^31 - 1, about 24.8 days, the
// most poll(2) waits at once. The processor adds these to steady_clock::now() in
// nanoseconds; a value near int64's end (one "large enough to mean never") wrapped there,
// to a deadline before the attempt began, and every export failed at once.
constexpr int64_t kMaxMillis = INT32_MAX;

void Millis(const EnvLookup& env, const char* name, std::chrono::milliseconds* out,
            std::vector<std::string>* warnings) {
  const std::string v = Get(env, name);
  if (v.empty()) return;
  int64_t ms = 0;
  if (!absl::SimpleAtoi(v, &ms) || ms < 0 || ms > kMaxMillis) {
    warnings->push_back(absl::StrCat(name, "=", v, " is not a duration in ms in [0, ", kMaxMillis,
                                     "]; using ", out->count()));
    return;
  }
  *out = std::chrono::milliseconds(ms);
}

// What gRPC metadata and an HTTP/1.1 header both carry: a key of lower-case letters,
// digits, '-', '_' and '.' (the key is lower-cased first), and a value of printable ASCII.
// gRPC aborts the process at the first export whose metadata breaks its rules (the call's
// start fails as an API misuse), and an HTTP header with a CR or LF in it splits the
// request; both are refused at start instead, naming the variable.
absl::Status CheckHeader(const std::string& name, const std::string& key,
                         const std::string& value) {
  const bool key_ok = !key.empty() && std::all_of(key.begin(), key.end(), [](char c) {
    return absl::ascii_islower(c) || absl::ascii_isdigit(c) || c == '-' || c == '_' || c == '.';
  });
  if (!key_ok) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": header name '", absl::CHexEscape(key),
                     "': want lower-case letters, digits, '-', '_' and '.' only"));
  }
  const bool value_ok = std::all_of(value.begin(), value.end(), [](char c) {
    return static_cast<unsigned char>(c) >= 0x20 && static_cast<unsigned char>(c) <= 0x7e;
  });
  if (!value_ok) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": the value of header '", key,
                                                   "': want printable ASCII only (no control "
                                                   "characters, no bytes above 0x7e)"));
  }
  return absl::OkStatus();
}

void Size(const EnvLookup& env, const char* name, size_t* out, std::vector<std::string>* warnings) {
  const std::string v = Get(env, name);
  if (v.empty()) return;
  size_t n = 0;
  if (!absl::SimpleAtoi(v, &n) || n == 0) {
    warnings->push_back(absl::StrCat(name, "=", v, " is not a positive integer; using ", *out));
    return;
  }
  *out = n;
}

absl::StatusOr<OtlpEndpoint> ParseEndpoint(const std::string& name, const std::string& url,
                                           OtlpProtocol protocol, bool append_path) {
  OtlpEndpoint e;
  absl::string_view rest = url;
  if (absl::ConsumePrefix(&rest, "https://")) {
    e.tls = true;
  } else if (!absl::ConsumePrefix(&rest, "http://")) {
    if (protocol == OtlpProtocol::kHttpProtobuf || rest.find("://") != absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, "=", url, ": want http://host:port or https://host:port"));
    }
  }
  const size_t slash = rest.find('/');
  absl::string_view authority = rest.substr(0, slash);
  std::string path = slash == absl::string_view::npos ? "" : std::string(rest.substr(slash));
  std::string port_text;
  if (absl::StartsWith(authority, "[")) {
    const size_t close = authority.find(']');
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(name, "=", url, ": unclosed [ in host"));
    }
    e.host = std::string(authority.substr(1, close - 1));
    if (close + 1 < authority.size()) {
      if (authority[close + 1] != ':') {
        return absl::InvalidArgumentError(
            absl::StrCat(name, "=", url, ": want ':' and a port or nothing after ']'"));
      }
      port_text = std::string(authority.substr(close + 2));
    }
  } else {
    const size_t colon = authority.rfind(':');
    e.host = std::string(authority.substr(0, colon));
    if (colon != absl::string_view::npos) port_text = std::string(authority.substr(colon + 1));
  }
  if (e.host.empty()) return absl::InvalidArgumentError(absl::StrCat(name, "=", url, ": no host"));
  // A host name, an IPv4 address or (bracketed) an IPv6 one; the path without spaces or
  // control characters. Anything else went into the OTLP/HTTP request line or Host header
  // as it was (a space made every request malformed, a CR/LF split it) or failed every
  // export's name lookup, each batch dropped in turn, instead of stopping epsd here.
  const bool bracketed = absl::StartsWith(authority, "[");
  const bool host_ok = std::all_of(e.host.begin(), e.host.end(), [bracketed](char c) {
    return absl::ascii_isalnum(c) || c == '.' || c == '-' || c == '_' ||
           (bracketed && (c == ':' || c == '%'));
  });
  if (!host_ok) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "=", absl::CHexEscape(url),
                     ": want a host name, an IPv4 address or a bracketed IPv6 address"));
  }
  if (!std::all_of(path.begin(), path.end(), [](char c) {
        return static_cast<unsigned char>(c) > 0x20 && static_cast<unsigned char>(c) < 0x7f;
      })) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "=", absl::CHexEscape(url),
                     ": want a path without spaces or control characters (%-encode them)"));
  }
  if (port_text.empty()) {
    e.port = protocol == OtlpProtocol::kGrpc ? 4317 : (e.tls ? 443 : 80);
  } else if (!absl::SimpleAtoi(port_text, &e.port) || e.port < 1 || e.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(name, "=", url, ": bad port '", port_text, "'"));
  }
  if (protocol == OtlpProtocol::kHttpProtobuf) {
    // The general endpoint is a base URL; the signal-specific one is used as is.
    if (append_path) {
      if (absl::EndsWith(path, "/")) path.pop_back();
      path += "/v1/traces";
    } else if (path.empty()) {
      path = "/";
    }
  }
  e.path = path;
  return e;
}

}  // namespace

EnvLookup ProcessEnv() {
  return [](const char* name) { return std::getenv(name); };
}

std::string OtlpEndpoint::authority() const {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                             : absl::StrCat(host, ":", port);
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseKeyValueList(
    const std::string& name, const std::string& text) {
  std::vector<std::pair<std::string, std::string>> out;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    const size_t eq = item.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": '", item, "' is not key=value"));
    }
    std::string key(absl::StripAsciiWhitespace(item.substr(0, eq)));
    if (key.empty()) return absl::InvalidArgumentError(absl::StrCat(name, ": empty key"));
    absl::StatusOr<std::string> value =
        PercentDecode(name, std::string(absl::StripAsciiWhitespace(item.substr(eq + 1))));
    if (!value.ok()) return value.status();
    out.emplace_back(std::move(key), *std::move(value));
  }
  return out;
}

absl::StatusOr<TraceConfig> TraceConfigFromEnv(const EnvLookup& env) {
  TraceConfig c;
  const std::string disabled = absl::AsciiStrToLower(Get(env, "OTEL_SDK_DISABLED"));
  const std::string exporter = absl::AsciiStrToLower(Get(env, "OTEL_TRACES_EXPORTER"));
  const std::string general = Get(env, "OTEL_EXPORTER_OTLP_ENDPOINT");
  const std::string traces = Get(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
  if (!exporter.empty() && exporter != "otlp" && exporter != "none") {
    return absl::InvalidArgumentError(
        absl::StrCat("OTEL_TRACES_EXPORTER=", exporter, ": epsd supports otlp or none"));
  }
  c.enabled = disabled != "true" && exporter != "none" &&
              (exporter == "otlp" || !general.empty() || !traces.empty());

  const std::string protocol = GetTraces(env, "PROTOCOL");
  if (protocol.empty() || protocol == "grpc") {
    c.protocol = OtlpProtocol::kGrpc;
  } else if (protocol == "http/protobuf") {
    c.protocol = OtlpProtocol::kHttpProtobuf;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(TracesName(env, "PROTOCOL"), "=", protocol,
                                                   ": epsd speaks grpc or http/protobuf"));
  }
  const char* endpoint_name =
      traces.empty() ? "OTEL_EXPORTER_OTLP_ENDPOINT" : "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
  std::string url = traces.empty() ? general : traces;
  if (url.empty()) {
    url = c.protocol == OtlpProtocol::kGrpc ? "http://localhost:4317" : "http://localhost:4318";
  }
  absl::StatusOr<OtlpEndpoint> endpoint =
      ParseEndpoint(endpoint_name, url, c.protocol, traces.empty());
  if (!endpoint.ok()) return endpoint.status();
  c.endpoint = *std::move(endpoint);
  if (c.enabled && c.protocol == OtlpProtocol::kHttpProtobuf && c.endpoint.tls) {
    return absl::InvalidArgumentError(absl::StrCat(
        endpoint_name, "=", url,
        ": OTLP/HTTP over TLS is not built in; use OTLP/gRPC (which does TLS) or a local "
        "collector"));
  }

  const std::string headers_name = TracesName(env, "HEADERS");
  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> headers =
      ParseKeyValueList(headers_name, GetTraces(env, "HEADERS"));
  if (!headers.ok()) return headers.status();
  c.headers = *std::move(headers);
  for (auto& [key, value] : c.headers) {
    key = absl::AsciiStrToLower(key);  // gRPC metadata keys
    RETURN_IF_ERROR(CheckHeader(headers_name, key, value));
  }

  const std::string timeout_name = TracesName(env, "TIMEOUT");
  Millis(env, timeout_name.c_str(), &c.timeout, &c.warnings);

  absl::StatusOr<std::vector<std::pair<std::string, std::string>>> resource =
      ParseKeyValueList("OTEL_RESOURCE_ATTRIBUTES", Get(env, "OTEL_RESOURCE_ATTRIBUTES"));
  if (!resource.ok()) return resource.status();
  std::string service_name = Get(env, "OTEL_SERVICE_NAME");
  for (const auto& [key, value] : *resource) {
    if (key == "service.name") {
      if (service_name.empty()) service_name = value;
    } else {
      c.resource.emplace_back(key, value);
    }
  }
  c.resource.insert(c.resource.begin(),
                    {"service.name", service_name.empty() ? "epsd" : service_name});

  absl::StatusOr<Sampler> sampler =
      Sampler::FromNames(Get(env, "OTEL_TRACES_SAMPLER"), Get(env, "OTEL_TRACES_SAMPLER_ARG"));
  if (!sampler.ok()) return sampler.status();
  c.sampler = *sampler;

  Millis(env, "OTEL_BSP_SCHEDULE_DELAY", &c.batch.schedule_delay, &c.warnings);
  // A delay of 0 would export every span alone, waking the worker for each; 1 ms is the floor.
  if (c.batch.schedule_delay < std::chrono::milliseconds(1)) {
    c.warnings.push_back(absl::StrCat("OTEL_BSP_SCHEDULE_DELAY=", c.batch.schedule_delay.count(),
                                      " is below 1 ms; using 1"));
    c.batch.schedule_delay = std::chrono::milliseconds(1);
  }
  Millis(env, "OTEL_BSP_EXPORT_TIMEOUT", &c.batch.export_timeout, &c.warnings);
  Size(env, "OTEL_BSP_MAX_QUEUE_SIZE", &c.batch.max_queue_size, &c.warnings);
  Size(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", &c.batch.max_export_batch_size, &c.warnings);
  if (c.batch.max_export_batch_size > c.batch.max_queue_size) {
    c.warnings.push_back(
        absl::StrCat("OTEL_BSP_MAX_EXPORT_BATCH_SIZE=", c.batch.max_export_batch_size,
                     " exceeds OTEL_BSP_MAX_QUEUE_SIZE; using the queue size"));
    c.batch.max_export_batch_size = c.batch.max_queue_size;
  }
  return c;
}

}  // namespace eps::telemetry
