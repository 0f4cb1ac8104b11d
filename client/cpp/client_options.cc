#include "client/cpp/client_options.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace eps::client {

std::string DefaultTarget() {
  const char* env = std::getenv("EPS_TARGET");
  return env != nullptr && env[0] != '\0' ? env : "unix:///tmp/epsd.sock";
}

namespace {

bool LowerHex(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

}  // namespace

bool ValidTraceparent(std::string_view v) {
  // version "-" trace-id "-" parent-id "-" flags [ "-" future fields (versions > 00) ]
  if (v.size() < 55 || v[2] != '-' || v[35] != '-' || v[52] != '-') return false;
  const std::string_view version = v.substr(0, 2), trace_id = v.substr(3, 32),
                         parent_id = v.substr(36, 16), flags = v.substr(53, 2);
  if (!LowerHex(version) || !LowerHex(trace_id) || !LowerHex(parent_id) || !LowerHex(flags)) {
    return false;
  }
  if (version == "ff" || trace_id == std::string(32, '0') || parent_id == std::string(16, '0')) {
    return false;
  }
  if (v.size() == 55) return true;
  // More only after a '-', from a version above 00, in printable ASCII without spaces.
  return version != "00" && v[55] == '-' &&
         std::all_of(v.begin() + 56, v.end(), [](char c) { return c >= '!' && c <= '~'; });
}

bool ValidTracestate(std::string_view v) {
  return v.size() <= 512 &&
         std::all_of(v.begin(), v.end(), [](char c) { return c >= ' ' && c <= '~'; });
}

absl::Status ClientOptions::Validate() const {
  if (target.empty()) return absl::InvalidArgumentError("ClientOptions.target is empty");
  if (deadline.count() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions.deadline=", deadline.count(), "us must be > 0"));
  }
  if (attach_deadline.count() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ClientOptions.attach_deadline=", attach_deadline.count(), "ms must be > 0"));
  }
  if (reattach_backoff.count() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ClientOptions.reattach_backoff=", reattach_backoff.count(), "ms must be >= 0"));
  }
  return absl::OkStatus();
}

}  // namespace eps::client
