// What an engine attaches with, validated against the server's limits: the
// model layout, batch and lease, the backend and device, and the session's
// default policy. Built from an AttachRequest before any buffer is mapped.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "core/half.h"
#include "core/layout.h"
#include "core/select.h"
#include "eps/v1/page_selector.pb.h"
#include "service/backend_kind.h"
#include "service/config.h"

namespace eps::service {

struct SessionSpec {
  std::string engine_id;
  ModelLayout model;
  DType query_dtype = DType::kFloat32;
  uint32_t max_batch = 0;
  int64_t num_kv_blocks = -1;  // block ids must be below this; -1: not checked
  uint32_t lease_ms = 0;
  BackendKind backend = BackendKind::kCpu;  // never kAuto
  int device = 0;  // epsd's ordinal of a cuda session's device (device_uuid or the ordinals)
  // Union or per-KV-head lists, from the rank of the visit_blocks descriptor.
  Granularity output_granularity = Granularity::kUnion;
};

// Validates everything of `request` but its buffers and options, in the order
// clients see errors: engine_id, layout, query dtype, batch, block ids, lease,
// backend and device: the device fields (docs/api-memory.md §3.7), then
// FAILED_PRECONDITION when CUDA is asked for and absent, then the device's
// existence (INVALID_ARGUMENT); a cpu session naming a device is INVALID_ARGUMENT.
absl::StatusOr<SessionSpec> SessionSpecFromProto(const v1::AttachRequest& request,
                                                 const ServerConfig& config);

// The session's default policy: the server's, with the request's options
// applied and checked against the output buffers and the layout.
absl::StatusOr<SelectPolicy> SessionPolicy(const SessionSpec& spec,
                                           const v1::AttachRequest& request,
                                           const SelectPolicy& server_defaults);

}  // namespace eps::service
