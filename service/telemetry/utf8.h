// UTF-8 for what telemetry exports and logs. Every OTLP string field must be well-formed
// UTF-8: a strict receiver (the OpenTelemetry Collector, the official protobuf parsers)
// rejects the whole batch otherwise, other engines' spans with it. And what epsd shows of a
// request (a session id, a status message) is bounded, wherever it comes from.
//
// Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace eps::telemetry {

// Whether `text` is well-formed UTF-8 (Unicode, table 3-7: no overlong forms, no
// surrogates, nothing above U+10FFFF).
bool IsValidUtf8(std::string_view text);

// `text` with each ill-formed sequence (its maximal subpart, as Unicode recommends)
// replaced by U+FFFD; `text` itself when it is well-formed.
std::string ScrubUtf8(std::string_view text);

// `text` scrubbed as above and held to `max_bytes` (at least 3): a longer text is cut on a
// character boundary and ended with "…" (U+2026, 3 bytes), the whole within `max_bytes`.
// Reads only as much of `text` as it keeps.
std::string BoundedUtf8(std::string_view text, size_t max_bytes);

}  // namespace eps::telemetry
