// How libeps_engine's C entry points (engine_capi.h) report an outcome: a canonical status
// code as the return value and the message in the calling thread's last error
// (eps_engine_last_error), and never a C++ exception. One thrown through an `extern "C"`
// frame ends the engine's process (std::terminate): a std::vector of a caller's n, say,
// throws std::bad_alloc or std::length_error for a huge n. So every entry point that does
// more than return a constant or run destructors (the *_destroy calls: noexcept) runs its
// body in Guarded or GuardedCount.
//
// Thread safety: the last error is per thread; everything here is safe from any thread.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace eps::capi {

// The calling thread's message of its last failed call ("" before the first).
const char* LastError();

// Sets the thread's last error to `status`'s text; its code (0 when ok).
int Report(const absl::Status& status);

// Report(INVALID_ARGUMENT "<call>: <what>"): a handle, pointer or count the call refuses
// before anything is dereferenced or queued.
int Refuse(const char* call, const std::string& what);

// Called inside a catch block: the exception in flight as a code, with "<call>: <what()>" as
// the thread's last error. std::bad_alloc and std::length_error (the host cannot hold what
// the caller's sizes ask for; epsd's call guard maps them alike) are RESOURCE_EXHAUSTED; any
// other exception is INTERNAL (a bug of the library). Never
// throws: were even the message's copy to fail, the last error is left empty.
int ReportCurrentException(const char* call) noexcept;

// `body()`, a canonical code; an exception it throws is ReportCurrentException's code.
template <typename Body>
int Guarded(const char* call, Body&& body) noexcept {
  try {
    return body();
  } catch (...) {
    return ReportCurrentException(call);
  }
}

// `body()`, a count; 0 when it throws (the code is lost, the message is the last error's).
template <typename Body>
uint64_t GuardedCount(const char* call, Body&& body) noexcept {
  try {
    return body();
  } catch (...) {
    ReportCurrentException(call);
    return 0;
  }
}

}  // namespace eps::capi
