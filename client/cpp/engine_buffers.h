// The shared buffers of one engine session, allocated by the client library
// (docs/design.md §5: never the engine's own tensors) in one POSIX shared-memory
// object that epsd maps. CPU mode; the CUDA allocator comes with the GPU backend.
//
// Ownership: EngineBuffers creates the object, maps it, and unlinks and unmaps
// it in its destructor. Thread safety: none; the engine writes inputs before
// SelectPages and reads outputs after it.
//
// Indices are checked on every access (a few integer compares): an index outside the
// plan's shape (slot >= num_slots, row >= max_seqs, layer, batch position, head or
// list outside the model) gives an empty span, never memory outside the buffer, and
// VisitCount -1 ("attend densely", always a correct attention). The spans of
// VisitBlocks and Visits are at most max_blocks long whatever visit_count holds.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "client/cpp/buffer_plan.h"
#include "core/layout.h"
#include "eps/v1/page_selector.pb.h"

namespace eps::client {

class EngineBuffers {
 public:
  // Creates `/eps-<tag>-<pid>-<n>` sized for `model` and `shape`.
  static absl::StatusOr<std::unique_ptr<EngineBuffers>> Create(const ModelLayout& model,
                                                               const BufferShape& shape,
                                                               const std::string& tag);
  ~EngineBuffers();
  EngineBuffers(const EngineBuffers&) = delete;
  EngineBuffers& operator=(const EngineBuffers&) = delete;

  // Descriptors of every buffer, for AttachRequest.buffers.
  v1::SharedBuffers Descriptors() const;

  std::span<float> Record(int64_t slot, int layer, int kv_head);
  std::span<float> summary_pool() { return {pool_, static_cast<size_t>(plan_.pool_words)}; }
  std::span<int32_t> GroupRow(int64_t row);  // max_groups slots
  std::span<int32_t> BlockRow(int64_t row);  // max_blocks physical ids
  std::span<float> Query(int layer, int64_t batch_pos, int q_head);
  // The coarse level's (ModelLayout.coarse_blocks > 0; empty spans without one):
  // a coarse record (same layout as Record's) and a coarse-table row of
  // max_coarse_groups slots (coarse group -> coarse slot).
  std::span<float> CoarseRecord(int64_t slot, int layer, int kv_head);
  std::span<int32_t> CoarseRow(int64_t row);
  // Selection feedback (BufferShape.with_feedback; empty without): the max_groups
  // entries of one (layer, table row, q head), NaN from Create on. The engine writes
  // each visited group's log-sum-exp there; epsd sets the step's rows to NaN again
  // after a step that succeeded (docs/api-memory.md).
  std::span<float> FeedbackRow(int layer, int64_t row, int q_head);
  // The visit list of (layer, batch position, list): VisitCount entries, clamped to
  // max_blocks. Empty both for an empty list and for "attend densely" (count -1): use
  // Visits, or VisitCount < 0, to tell them apart.
  std::span<const int32_t> VisitBlocks(int layer, int64_t batch_pos, int list = 0) const;
  // The same list, or nullopt when the engine must attend densely (count < 0: a
  // fallback or a released step; or an index outside the shape). The Python client's
  // visits() (None for dense).
  std::optional<std::span<const int32_t>> Visits(int layer, int64_t batch_pos, int list = 0) const;
  // visit_count of the list: -1 "attend densely", else the blocks to visit.
  int32_t VisitCount(int layer, int64_t batch_pos, int list = 0) const;
  uint64_t selection_done() const;

  const ModelLayout& model() const { return plan_.model; }
  const BufferShape& shape() const { return plan_.shape; }
  const BufferPlan& plan() const { return plan_; }
  int64_t max_blocks() const { return plan_.max_blocks; }
  int64_t max_groups() const { return plan_.max_groups; }
  int64_t max_coarse_groups() const { return plan_.max_coarse_groups; }
  const std::string& shm_name() const { return name_; }

 private:
  explicit EngineBuffers(BufferPlan plan) : plan_(std::move(plan)) {}
  template <typename T>
  T* At(uint64_t offset) const {
    return reinterpret_cast<T*>(base_ + offset);
  }
  // Whether the indices name an entry of the plan's shape.
  bool InModel(int layer, int kv_head) const;
  bool InBatch(int layer, int64_t batch_pos, int list) const;

  const BufferPlan plan_;
  std::string name_;
  std::byte* base_ = nullptr;
  float* pool_ = nullptr;
};

}  // namespace eps::client
