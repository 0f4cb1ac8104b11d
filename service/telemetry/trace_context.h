// W3C Trace Context (https://www.w3.org/TR/trace-context/): the `traceparent`
// and `tracestate` headers an engine sends as gRPC metadata, and fresh ids.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace eps::telemetry {

using TraceId = std::array<uint8_t, 16>;
using SpanId = std::array<uint8_t, 8>;

struct TraceContext {
  TraceId trace_id{};
  SpanId span_id{};         // the caller's span: our server span's parent
  uint8_t flags = 0;        // bit 0: sampled
  std::string trace_state;  // passed through unchanged
  bool sampled() const { return (flags & 1) != 0; }
};

// Parses a traceparent header; nullopt when it is malformed (the spec says to
// then start a new trace). Accepts future versions as the spec asks.
// `tracestate` is kept when it is at most 512 bytes, dropped otherwise.
std::optional<TraceContext> ParseTraceparent(std::string_view traceparent,
                                             std::string_view tracestate = {});
std::string FormatTraceparent(const TraceId& trace_id, const SpanId& span_id, uint8_t flags);

// Random, never all-zero ids from a per-thread generator seeded by the OS.
TraceId NewTraceId();
SpanId NewSpanId();
std::string Hex(const uint8_t* bytes, size_t n);
template <size_t N>
std::string Hex(const std::array<uint8_t, N>& id) {
  return Hex(id.data(), N);
}

}  // namespace eps::telemetry
