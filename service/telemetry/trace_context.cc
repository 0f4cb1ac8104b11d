#include "service/telemetry/trace_context.h"

#include <random>

namespace eps::telemetry {
namespace {

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;  // upper case is invalid in traceparent
}

template <size_t N>
bool ParseHex(std::string_view text, std::array<uint8_t, N>* out) {
  if (text.size() != 2 * N) return false;
  bool nonzero = false;
  for (size_t i = 0; i < N; ++i) {
    const int hi = HexDigit(text[2 * i]), lo = HexDigit(text[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    (*out)[i] = static_cast<uint8_t>(hi << 4 | lo);
    nonzero |= (*out)[i] != 0;
  }
  return nonzero;  // all-zero ids are invalid
}

std::mt19937_64& Generator() {
  thread_local std::mt19937_64 rng([] {
    std::random_device device;
    return (static_cast<uint64_t>(device()) << 32) ^ device();
  }());
  return rng;
}

template <size_t N>
std::array<uint8_t, N> RandomId() {
  std::array<uint8_t, N> id{};
  do {
    for (size_t i = 0; i < N; i += 8) {
      const uint64_t r = Generator()();
      for (size_t j = 0; j < 8 && i + j < N; ++j) id[i + j] = static_cast<uint8_t>(r >> (8 * j));
    }
  } while (id == std::array<uint8_t, N>{});
  return id;
}

}  // namespace

std::optional<TraceContext> ParseTraceparent(std::string_view header, std::string_view tracestate) {
  // version "-" trace-id "-" parent-id "-" flags: 2 + 1 + 32 + 1 + 16 + 1 + 2 = 55 characters.
  if (header.size() < 55) return std::nullopt;
  uint8_t version = 0;
  {
    const int hi = HexDigit(header[0]), lo = HexDigit(header[1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    version = static_cast<uint8_t>(hi << 4 | lo);
  }
  if (version == 0xff) return std::nullopt;
  if (version == 0 && header.size() != 55) return std::nullopt;
  if (version != 0 && header.size() > 55 && header[55] != '-') return std::nullopt;
  if (header[2] != '-' || header[35] != '-' || header[52] != '-') return std::nullopt;
  TraceContext context;
  if (!ParseHex(header.substr(3, 32), &context.trace_id)) return std::nullopt;
  if (!ParseHex(header.substr(36, 16), &context.span_id)) return std::nullopt;
  const int hi = HexDigit(header[53]), lo = HexDigit(header[54]);
  if (hi < 0 || lo < 0) return std::nullopt;
  context.flags = static_cast<uint8_t>(hi << 4 | lo);
  if (tracestate.size() <= 512) context.trace_state = std::string(tracestate);
  return context;
}

std::string FormatTraceparent(const TraceId& trace_id, const SpanId& span_id, uint8_t flags) {
  return "00-" + Hex(trace_id) + "-" + Hex(span_id) + "-" + Hex(&flags, 1);
}

TraceId NewTraceId() { return RandomId<16>(); }
SpanId NewSpanId() { return RandomId<8>(); }

std::string Hex(const uint8_t* bytes, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = kDigits[bytes[i] >> 4];
    out[2 * i + 1] = kDigits[bytes[i] & 15];
  }
  return out;
}

}  // namespace eps::telemetry
