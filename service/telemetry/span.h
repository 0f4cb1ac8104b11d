// One finished span as the exporter sends it: the subset of the OTLP span
// model epsd produces (ids, parent, kind, timings, attributes, status).
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

#include "service/telemetry/trace_context.h"

namespace eps::telemetry {

enum class SpanKind { kInternal = 1, kServer = 2 };

struct SpanAttribute {
  std::string key;
  std::variant<std::string, int64_t, double, bool> value;
};

struct SpanRecord {
  TraceId trace_id{};
  SpanId span_id{};
  SpanId parent_span_id{};  // all zero: a root span
  bool parent_is_remote = false;
  uint8_t trace_flags = 1;  // W3C flags (sampled)
  std::string trace_state;
  std::string name;
  SpanKind kind = SpanKind::kInternal;
  uint64_t start_unix_ns = 0;
  uint64_t end_unix_ns = 0;
  std::vector<SpanAttribute> attributes;
  bool error = false;  // OTLP status ERROR (with status_message) or UNSET
  std::string status_message;
};

}  // namespace eps::telemetry
