// Status propagation macros for absl::Status / absl::StatusOr, and the mark of a
// status whose device is lost.
//
// abseil 20220623 (Debian bookworm) ships neither RETURN_IF_ERROR nor
// ASSIGN_OR_RETURN, so the project defines its own. Both evaluate their argument
// exactly once.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/cord.h"

#define EPS_STATUS_CONCAT_INNER_(a, b) a##b
#define EPS_STATUS_CONCAT_(a, b) EPS_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                  \
  do {                                         \
    ::absl::Status eps_status_ = (expr);       \
    if (!eps_status_.ok()) return eps_status_; \
  } while (false)

// `ASSIGN_OR_RETURN(T x, MakeT());` declares x from an absl::StatusOr<T>, or
// returns its error from the enclosing function.
#define ASSIGN_OR_RETURN(lhs, expr) \
  EPS_ASSIGN_OR_RETURN_IMPL_(EPS_STATUS_CONCAT_(eps_statusor_, __LINE__), lhs, expr)

#define EPS_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                               \
  if (!statusor.ok()) return statusor.status();         \
  lhs = std::move(statusor).value()

namespace eps {

// The device a status's work ran on is lost to this process: a CUDA error that
// leaves the context unusable, so that every later call on it fails the same way
// and only a new process can use the device again (gpu/cuda_check.h decides which
// errors are such). The service stops serving and exits on one (docs/api-failures.md).
inline constexpr char kDeviceLostPayload[] = "type.eps/device-lost";

inline absl::Status MarkDeviceLost(absl::Status status) {
  if (!status.ok()) status.SetPayload(kDeviceLostPayload, absl::Cord("1"));
  return status;
}

inline bool IsDeviceLost(const absl::Status& status) {
  return !status.ok() && status.GetPayload(kDeviceLostPayload).has_value();
}

}  // namespace eps
