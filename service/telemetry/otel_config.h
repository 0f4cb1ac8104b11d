// The OpenTelemetry SDK environment variables epsd honours, read once at start
// (docs/observability-traces.md lists them with their defaults):
//   OTEL_SDK_DISABLED, OTEL_TRACES_EXPORTER (otlp | none)
//   OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _PROTOCOL (grpc | http/protobuf), _HEADERS, _TIMEOUT
//   OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG
//   OTEL_BSP_SCHEDULE_DELAY, _EXPORT_TIMEOUT, _MAX_QUEUE_SIZE, _MAX_EXPORT_BATCH_SIZE
// Parsing is a pure function of a lookup, so tests need no process environment.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "service/telemetry/sampler.h"

namespace eps::telemetry {

using EnvLookup = std::function<const char*(const char*)>;  // null when unset
EnvLookup ProcessEnv();

enum class OtlpProtocol { kGrpc, kHttpProtobuf };

struct BatchConfig {  // the spec's OTEL_BSP_* defaults
  std::chrono::milliseconds schedule_delay{5000};
  std::chrono::milliseconds export_timeout{30000};
  size_t max_queue_size = 2048;
  size_t max_export_batch_size = 512;
  // Bytes, as the spans encode (EncodedSizeBound), which no OTEL_* variable sets: the queue
  // holds at most max_queue_bytes; an export request is at most max_export_batch_bytes,
  // well under the 4 MiB a gRPC server (the Collector's OTLP receiver) accepts by default.
  size_t max_queue_bytes = 4u << 20;
  size_t max_export_batch_bytes = 1u << 20;
};

struct OtlpEndpoint {
  bool tls = false;  // https://
  std::string host;  // without brackets for IPv6
  int port = 0;
  std::string path;  // HTTP only: the request path, /v1/traces unless given
  // host:port, an IPv6 host in brackets: grpc::CreateChannel's target and HTTP's Host.
  std::string authority() const;
};

struct TraceConfig {
  // Traces are exported only when asked for: an OTLP endpoint variable is set or
  // OTEL_TRACES_EXPORTER=otlp; never when OTEL_SDK_DISABLED=true or _EXPORTER=none.
  bool enabled = false;
  OtlpProtocol protocol = OtlpProtocol::kGrpc;
  OtlpEndpoint endpoint;
  std::vector<std::pair<std::string, std::string>> headers;
  std::chrono::milliseconds timeout{10000};                   // per export attempt
  std::vector<std::pair<std::string, std::string>> resource;  // service.name first
  Sampler sampler;
  BatchConfig batch;
  std::vector<std::string> warnings;  // values ignored (the spec: warn, use the default)
};

// Errors only for settings that cannot work as asked (an unsupported protocol,
// https for OTLP/HTTP, an endpoint that does not parse); bad numbers warn.
absl::StatusOr<TraceConfig> TraceConfigFromEnv(const EnvLookup& env);

// "k1=v1,k2=v2" with %-encoded values (OTEL_RESOURCE_ATTRIBUTES, _HEADERS).
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseKeyValueList(
    const std::string& name, const std::string& text);

}  // namespace eps::telemetry
