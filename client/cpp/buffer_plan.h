// Where each shared buffer of a session lives inside one allocation, for the
// shared-memory (EngineBuffers) and the device-memory (DeviceBuffers) forms
// alike, and the eps.v1 descriptors of that layout (docs/api-memory.md).
//
// The buffers, their shapes, element types and order are core/buffer_contract.h's
// table; every part starts at a multiple of kBufferAlignment (256 bytes), so
// device loads stay aligned whatever the model shape. Thread safety: an
// immutable value.
#pragma once

#include <array>
#include <cstdint>

#include "absl/status/statusor.h"
#include "core/buffer_contract.h"
#include "core/layout.h"
#include "core/select.h"
#include "eps/v1/page_selector.pb.h"

namespace eps::client {

struct BufferShape {
  int64_t num_slots = 0;    // summary records per (layer, kv head)
  int64_t max_seqs = 0;     // rows of the group and block tables
  int64_t max_context = 0;  // tokens: fixes max_blocks and max_groups
  int64_t max_batch = 0;
  Granularity granularity = Granularity::kUnion;
  bool with_flags = true;
  // Coarse records per (layer, kv head): >= 1 when the layout has a coarse level
  // (ModelLayout.coarse_blocks > 0), 0 without one.
  int64_t coarse_slots = 0;
  // Selection feedback (docs/api-memory.md): when set the allocation holds the feedback
  // buffer [layers, max_seqs, q_heads, max_groups] float32 and Descriptors() names
  // it; unset, it has no bytes and epsd gets no descriptor.
  bool with_feedback = false;
};

struct BufferPlan {
  ModelLayout model;
  BufferShape shape;
  BufferDims dims;  // every dim of the contract, fixed by `model` and `shape`
  // Bytes and elements by SharedBuffer; 0 for a buffer that does not apply to the
  // layout (the coarse ones without a coarse level: core/buffer_contract.h) and for
  // feedback without shape.with_feedback.
  std::array<uint64_t, kSharedBuffers> offsets{};
  std::array<int64_t, kSharedBuffers> elements{};
  int64_t max_blocks = 0, max_groups = 0, record_words = 0, lists = 1, pool_words = 0;
  int64_t max_coarse_groups = 0, coarse_pool_words = 0;  // 0 without a coarse level
  // offsets[] by name, for the buffers' accessors.
  uint64_t pool = 0, groups = 0, blocks = 0, queries = 0, visit = 0, count = 0, flags = 0;
  uint64_t coarse_pool = 0, coarse_table = 0;
  uint64_t feedback = 0;  // offsets[kFeedback]; 0 without shape.with_feedback
  uint64_t size = 0;      // bytes of the whole allocation

  static absl::StatusOr<BufferPlan> For(const ModelLayout& model, const BufferShape& shape);

  // The descriptors of every buffer of the layout; `memory` names the allocation (its oneof
  // `memory` is copied into each descriptor).
  v1::SharedBuffers Descriptors(const v1::MemoryDescriptor& memory) const;

  int64_t ElementsOf(SharedBuffer buffer) const { return elements[static_cast<int>(buffer)]; }

  // Element offsets (not bytes) of one record, group row, query and output list.
  int64_t RecordIndex(int64_t slot, int layer, int kv_head) const {
    return ((slot * model.num_layers + layer) * model.num_kv_heads + kv_head) * record_words;
  }
  int64_t QueryIndex(int layer, int64_t batch_pos, int q_head) const {
    return ((layer * shape.max_batch + batch_pos) * model.num_q_heads + q_head) * model.head_dim;
  }
  int64_t ListIndex(int layer, int64_t batch_pos, int list) const {
    return (layer * shape.max_batch + batch_pos) * lists + list;
  }
  // The first of a feedback row's max_groups entries (by table row, not batch position).
  int64_t FeedbackIndex(int layer, int64_t row, int q_head) const {
    return ((layer * shape.max_seqs + row) * model.num_q_heads + q_head) * max_groups;
  }
};

}  // namespace eps::client
