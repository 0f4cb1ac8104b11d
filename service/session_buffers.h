// A session's shared buffers: resolved from the Attach descriptors against the
// session's spec (every shape, dtype, extent and overlap checked before any
// byte is touched), and read back as core/step.h inputs and outputs.
//
// Ownership: the bytes belong to the engine (shm, CUDA IPC) or to the
// MappingCache (inline buffers); SessionBuffers borrows them and must not
// outlive the cache it was resolved with.
#pragma once

#include <array>
#include <cstdint>
#include <span>

#include "absl/status/statusor.h"
#include "core/buffer_contract.h"
#include "core/step.h"
#include "eps/v1/page_selector.pb.h"
#include "google/protobuf/repeated_field.h"
#include "service/descriptor.h"
#include "service/session_spec.h"

namespace eps::service {

struct SessionBuffers {
  // By SharedBuffer; flags and feedback empty when absent, the coarse pool and
  // table empty without a coarse level.
  std::array<MappedTensor, kSharedBuffers> tensors;
  bool has_flags = false;
  bool has_coarse_level = false;
  bool has_feedback = false;
  // The engine's choices, fixed by the descriptors (core/buffer_contract.h); the
  // coarse ones 0 without a coarse level.
  int64_t num_slots = 0, max_seqs = 0, max_groups = 0, max_blocks = 0;
  int64_t coarse_slots = 0, max_coarse_groups = 0;

  const MappedTensor& operator[](SharedBuffer buffer) const {
    return tensors[static_cast<int>(buffer)];
  }
  template <typename T>
  T* data(SharedBuffer buffer) const {
    return reinterpret_cast<T*>((*this)[buffer].data);
  }
};

// Maps and validates every buffer of `buffers` for `spec`, in the contract's
// order (core/buffer_contract.h); an engine-chosen dimension is fixed by the
// first buffer that has it. The coarse pool and table are required when the
// layout has a coarse level and refused when it has none; flags and feedback are
// optional in every session (feedback is writable: epsd consumes it). A cuda session needs every
// buffer in device memory, a cpu session every one in host memory.
absl::StatusOr<SessionBuffers> ResolveSessionBuffers(const v1::SharedBuffers& buffers,
                                                     const SessionSpec& spec,
                                                     MappingCache& mappings);

// The most bytes one SelectPages reply can take with inline visit lists (0 when the
// lists are shared): every list of every layer and row at max_blocks block ids, each a
// varint of at most 5 bytes (ids are ≥ 0), with its fields and framing, and the reply's
// own fields. Attach refuses a session whose bound exceeds --max-message-bytes.
int64_t InlineReplyBound(const SessionSpec& spec, const SessionBuffers& buffers);

// Copies a SelectPages call's writes into the inline input buffers. Every
// write is checked (target, inline, extent) before the first byte is copied.
absl::Status ApplyInlineWrites(const google::protobuf::RepeatedPtrField<v1::BufferWrite>& writes,
                               const SessionBuffers& buffers);

// The buffers as core/step.h inputs and outputs (host or device pointers).
StepInputs StepInputsOf(const SessionSpec& spec, const SessionBuffers& buffers,
                        std::span<const StepRow> rows);
StepOutputs StepOutputsOf(const SessionBuffers& buffers);

}  // namespace eps::service
