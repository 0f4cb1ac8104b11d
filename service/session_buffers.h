// A session's shared buffers: resolved from the Attach descriptors against the
// session's spec (every shape, dtype, extent and overlap checked before any
// byte is touched), and read back as core/step.h inputs and outputs.
//
// Ownership: the bytes belong to the engine (shm, CUDA IPC) or to the
// MappingCache (inline buffers); SessionBuffers borrows them and must not
// outlive the cache it was resolved with.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/statusor.h"
#include "core/step.h"
#include "eps/v1/page_selector.pb.h"
#include "google/protobuf/repeated_field.h"
#include "service/descriptor.h"
#include "service/session_spec.h"

namespace eps::service {

struct SessionBuffers {
  HostTensor summary_pool, group_table, block_table, queries, visit_blocks, visit_count, flags;
  bool has_flags = false;
  // Free dimensions, fixed by the descriptors.
  int64_t num_slots = 0, max_seqs = 0, max_groups = 0, max_blocks = 0;
};

// Maps and validates every buffer of `buffers` for `spec`; a cuda session
// needs every buffer in device memory, a cpu session every one in host memory.
absl::StatusOr<SessionBuffers> ResolveSessionBuffers(const v1::SharedBuffers& buffers,
                                                     const SessionSpec& spec,
                                                     MappingCache& mappings);

// Copies a SelectPages call's writes into the inline input buffers. Every
// write is checked (target, inline, extent) before the first byte is copied.
absl::Status ApplyInlineWrites(const google::protobuf::RepeatedPtrField<v1::BufferWrite>& writes,
                               const SessionBuffers& buffers);

// The buffers as core/step.h inputs and outputs (host or device pointers).
StepInputs StepInputsOf(const SessionSpec& spec, const SessionBuffers& buffers,
                        std::span<const StepRow> rows);
StepOutputs StepOutputsOf(const SessionBuffers& buffers);

}  // namespace eps::service
