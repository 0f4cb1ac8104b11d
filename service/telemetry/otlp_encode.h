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

// At least the bytes `span` adds to what EncodeSpans returns (exact but for empty fields,
// which proto3 leaves out, and ill-formed UTF-8, counted as if every byte became U+FFFD).
// A request of spans S is at most EncodeSpans(resource, {}).ByteSizeLong() +
// kEncodedRequestSlack + the sum of their bounds.
size_t EncodedSizeBound(const SpanRecord& span);
// The request's two enclosing messages (ResourceSpans, ScopeSpans) each have a length
// prefix that grows with the spans: at most 4 bytes more each.
inline constexpr size_t kEncodedRequestSlack = 8;

}  // namespace eps::telemetry
