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
  std::string trace_state;  // passed on as ParseTracestate returns it; empty: none
  bool sampled() const { return (flags & 1) != 0; }
};

// Parses a traceparent header; nullopt when it is malformed (the spec says to
// then start a new trace). Accepts future versions as the spec asks.
// `tracestate` (several headers joined with ',', as the spec combines them) is kept as
// ParseTracestate returns it when that is at most 512 bytes; an invalid or longer one is
// dropped, the traceparent still used.
std::optional<TraceContext> ParseTraceparent(std::string_view traceparent,
                                             std::string_view tracestate = {});

// A tracestate header checked against the W3C grammar: at most 32 list-members
// `key=value`, keys (lower-case simple or tenant@system keys) unique, values of printable
// ASCII without ',' and '='. Returns the members joined with ',' (optional whitespace and
// empty members removed), or nullopt when any member is invalid: the spec drops the whole
// header then, and it must not reach an OTLP string field (a byte that is not UTF-8 made
// a strict receiver refuse the whole batch).
std::optional<std::string> ParseTracestate(std::string_view tracestate);
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
