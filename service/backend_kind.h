// Which backend runs a session's steps. One enum for the --backend flag, the
// Attach reply (converted in service/convert.h), the metrics label and the
// step log, so the kind has one spelling everywhere.
#pragma once

namespace eps::service {

// kAuto is only a request (the server's --backend default): the session then
// takes the backend of its summary pool's memory kind. A session's backend is
// always kCpu or kCuda.
enum class BackendKind : int { kCpu, kCuda, kAuto };
inline constexpr int kSessionBackendKinds = 2;  // kCpu, kCuda

// "cpu", "cuda", "auto": the flag values and the metrics label values.
constexpr const char* BackendKindName(BackendKind kind) {
  switch (kind) {
    case BackendKind::kCpu:
      return "cpu";
    case BackendKind::kCuda:
      return "cuda";
    case BackendKind::kAuto:
      return "auto";
  }
  return "unknown";
}

}  // namespace eps::service
