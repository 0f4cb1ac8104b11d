#include "service/telemetry/trace_context.h"

#include <algorithm>
#include <random>
#include <vector>

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

bool IsLcAlpha(char c) { return c >= 'a' && c <= 'z'; }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }
// The characters a key may hold after its first: lcalpha / DIGIT / "_" / "-" / "*" / "/".
bool IsKeyChar(char c) {
  return IsLcAlpha(c) || IsDigit(c) || c == '_' || c == '-' || c == '*' || c == '/';
}

// key = simple-key / multi-tenant-key
// simple-key = lcalpha 0*255( keychar ); multi-tenant-key = tenant-id "@" system-id
// tenant-id = ( lcalpha / DIGIT ) 0*240( keychar ); system-id = lcalpha 0*13( keychar )
bool IsTracestateKey(std::string_view key) {
  const auto tail_ok = [](std::string_view s) {
    for (size_t i = 1; i < s.size(); ++i) {
      if (!IsKeyChar(s[i])) return false;
    }
    return true;
  };
  const size_t at = key.find('@');
  if (at == std::string_view::npos) {
    return !key.empty() && key.size() <= 256 && IsLcAlpha(key[0]) && tail_ok(key);
  }
  const std::string_view tenant = key.substr(0, at), system = key.substr(at + 1);
  return !tenant.empty() && tenant.size() <= 241 && (IsLcAlpha(tenant[0]) || IsDigit(tenant[0])) &&
         tail_ok(tenant) && !system.empty() && system.size() <= 14 && IsLcAlpha(system[0]) &&
         tail_ok(system);
}

// value = 0*255(chr) nblk-chr; chr = %x20 / nblk-chr;
// nblk-chr = %x21-2B / %x2D-3C / %x3E-7E (printable ASCII but ',' and '=')
bool IsTracestateValue(std::string_view value) {
  if (value.empty() || value.size() > 256 || value.back() == ' ') return false;
  for (const char c : value) {
    if (c < 0x20 || c > 0x7e || c == ',' || c == '=') return false;
  }
  return true;
}

std::string_view TrimOws(std::string_view s) {  // OWS = *( SP / HTAB )
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

}  // namespace

std::optional<std::string> ParseTracestate(std::string_view tracestate) {
  constexpr size_t kMaxMembers = 32;
  std::string out;
  std::vector<std::string_view> keys;
  for (size_t start = 0; start <= tracestate.size();) {
    size_t comma = tracestate.find(',', start);
    if (comma == std::string_view::npos) comma = tracestate.size();
    const std::string_view member = TrimOws(tracestate.substr(start, comma - start));
    start = comma + 1;
    if (member.empty()) continue;  // empty list-members are allowed, and not passed on
    const size_t eq = member.find('=');
    if (eq == std::string_view::npos) return std::nullopt;
    const std::string_view key = member.substr(0, eq);
    if (!IsTracestateKey(key) || !IsTracestateValue(member.substr(eq + 1))) return std::nullopt;
    if (std::find(keys.begin(), keys.end(), key) != keys.end()) return std::nullopt;
    if (keys.size() == kMaxMembers) return std::nullopt;
    keys.push_back(key);
    if (!out.empty()) out.push_back(',');
    out.append(member);
  }
  return out;
}

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
  if (std::optional<std::string> state = ParseTracestate(tracestate);
      state.has_value() && state->size() <= 512) {
    context.trace_state = *std::move(state);
  }
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
