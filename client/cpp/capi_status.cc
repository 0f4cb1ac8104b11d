#include "client/cpp/capi_status.h"

#include <exception>
#include <new>
#include <stdexcept>

#include "absl/strings/str_cat.h"

namespace eps::capi {
namespace {

thread_local std::string last_error;

}  // namespace

const char* LastError() { return last_error.c_str(); }

int Report(const absl::Status& status) {
  if (status.ok()) return 0;
  last_error = status.ToString();
  return static_cast<int>(status.code());
}

int Refuse(const char* call, const std::string& what) {
  return Report(absl::InvalidArgumentError(absl::StrCat(call, ": ", what)));
}

int ReportCurrentException(const char* call) noexcept {
  const auto report = [call](absl::StatusCode code, const char* what) noexcept {
    try {
      last_error = absl::Status(code, absl::StrCat(call, ": ", what)).ToString();
    } catch (...) {
      last_error.clear();  // the code still says what happened
    }
    return static_cast<int>(code);
  };
  try {
    throw;
  } catch (const std::bad_alloc& e) {
    return report(absl::StatusCode::kResourceExhausted, e.what());
  } catch (const std::length_error& e) {  // a container asked for more than it can hold
    return report(absl::StatusCode::kResourceExhausted, e.what());
  } catch (const std::exception& e) {
    return report(absl::StatusCode::kInternal, e.what());
  } catch (...) {
    return report(absl::StatusCode::kInternal, "an exception that is no std::exception");
  }
}

}  // namespace eps::capi
