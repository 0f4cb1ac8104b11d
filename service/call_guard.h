// Every call ends with a precise status: what runs inside a call is guarded
// here, so that an exception (an allocation that fails, a bug) becomes a
// status naming the call instead of reaching gRPC, which would answer a unary
// call UNIMPLEMENTED with an empty message and leave a stream without an end
// (docs/security.md). std::bad_alloc and std::length_error (an allocation too
// large) are RESOURCE_EXHAUSTED; anything else INTERNAL with its what().
#pragma once

#include <cstdio>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace eps::service {

template <typename F>
absl::Status CallGuarded(const char* what, F&& body) {
  absl::Status status;
  try {
    status = body();
  } catch (const std::bad_alloc&) {
    status = absl::ResourceExhaustedError(absl::StrCat(what, ": epsd is out of memory"));
  } catch (const std::length_error& e) {
    status = absl::ResourceExhaustedError(
        absl::StrCat(what, ": an allocation too large for epsd (", e.what(), ")"));
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat(what, ": epsd failed: ", e.what()));
  } catch (...) {
    status = absl::InternalError(absl::StrCat(what, ": epsd failed with an unknown exception"));
  }
  if (status.code() == absl::StatusCode::kInternal) {
    std::fprintf(stderr, "epsd: %s\n", std::string(status.message()).c_str());
  }
  return status;
}

}  // namespace eps::service
