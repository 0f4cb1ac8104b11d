// Spans -> the OTLP ExportTraceServiceRequest (one resource, one scope). Every string it
// writes is valid UTF-8, as OTLP requires: an ill-formed sequence becomes U+FFFD.
#pragma once

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "opentelemetry/proto/collector/trace/v1/trace_service.pb.h"
#include "service/telemetry/span.h"

namespace eps::telemetry {

// The instrumentation scope epsd's spans carry.
inline constexpr const char* kScopeName = "epsd";
inline constexpr const char* kScopeVersion = "0.1.0";

opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest EncodeSpans(
    const std::vector<std::pair<std::string, std::string>>& resource,
    const std::vector<SpanRecord>& spans);

}  // namespace eps::telemetry
