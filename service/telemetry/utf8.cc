#include "service/telemetry/utf8.h"

namespace eps::telemetry {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD
constexpr std::string_view kEllipsis = "\xE2\x80\xA6";     // U+2026

// The sequence at text[i]: its length (1-4) when well-formed; otherwise, negated, the
// length of its maximal ill-formed subpart (what one U+FFFD replaces). The lead byte fixes
// how many continuation bytes follow and, for E0, ED, F0 and F4, a narrower range for the
// first of them (which excludes overlong forms, surrogates and code points past U+10FFFF).
int Sequence(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  if (lead < 0x80) return 1;
  int continuations = 0;
  unsigned char lo = 0x80, hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    continuations = 1;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    continuations = 2;
    if (lead == 0xE0) lo = 0xA0;
    if (lead == 0xED) hi = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    continuations = 3;
    if (lead == 0xF0) lo = 0x90;
    if (lead == 0xF4) hi = 0x8F;
  } else {
    return -1;  // a continuation byte, C0, C1 or F5-FF: never a lead
  }
  for (int k = 1; k <= continuations; ++k) {
    if (i + k >= text.size()) return -k;
    const unsigned char c = byte(i + k);
    if (c < lo || c > hi) return -k;
    lo = 0x80;
    hi = 0xBF;
  }
  return continuations + 1;
}

}  // namespace

bool IsValidUtf8(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const int n = Sequence(text, i);
    if (n < 0) return false;
    i += static_cast<size_t>(n);
  }
  return true;
}

std::string ScrubUtf8(std::string_view text) {
  if (IsValidUtf8(text)) return std::string(text);
  std::string out;
  out.reserve(text.size() + 8);
  for (size_t i = 0; i < text.size();) {
    const int n = Sequence(text, i);
    if (n > 0) {
      out.append(text.substr(i, static_cast<size_t>(n)));
      i += static_cast<size_t>(n);
    } else {
      out.append(kReplacement);
      i += static_cast<size_t>(-n);
    }
  }
  return out;
}

std::string BoundedUtf8(std::string_view text, size_t max_bytes) {
  if (max_bytes < kEllipsis.size()) return std::string();
  std::string out;
  size_t cut = 0;  // out's length at the last boundary that leaves room for the ellipsis
  for (size_t i = 0; i < text.size();) {
    const int n = Sequence(text, i);
    const std::string_view piece = n > 0 ? text.substr(i, static_cast<size_t>(n)) : kReplacement;
    if (out.size() + piece.size() > max_bytes) {  // longer than allowed: cut, and say so
      out.resize(cut);
      out.append(kEllipsis);
      return out;
    }
    out.append(piece);
    if (out.size() + kEllipsis.size() <= max_bytes) cut = out.size();
    i += static_cast<size_t>(n > 0 ? n : -n);
  }
  return out;
}

}  // namespace eps::telemetry
