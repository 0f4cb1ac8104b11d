// Deadlines of EpsClient's calls from ClientOptions' durations, which have no upper bound
// (ClientOptions::Validate): a duration past a century reads as a century, "no deadline",
// rather than wrapping the clock into the past. Shared by eps_client.cc and reattach.cc;
// internal to client/cpp.
#pragma once

#include <chrono>

namespace eps::client {

// `start + d`, with a `d` past a century read as a century: a duration such as
// milliseconds::max() would otherwise wrap the clock's nanoseconds into the past (every
// call then fails at once). The comparison is in the coarser of the two units.
template <typename TimePoint, typename Rep, typename Period>
TimePoint After(TimePoint start, std::chrono::duration<Rep, Period> d) {
  constexpr std::chrono::hours kCentury(24 * 365 * 100);
  if (d > kCentury) return start + kCentury;
  return start + std::chrono::duration_cast<typename TimePoint::duration>(d);
}

// A deadline for gRPC (system clock) `d` from now.
template <typename Rep, typename Period>
std::chrono::system_clock::time_point SystemAfter(std::chrono::duration<Rep, Period> d) {
  return After(std::chrono::system_clock::now(), d);
}

}  // namespace eps::client
