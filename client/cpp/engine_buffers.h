// The shared buffers of one engine session, allocated by the client library
// (DESIGN §5: never the engine's own tensors) in one POSIX shared-memory
// object that epsd maps. CPU mode; the CUDA allocator comes with the GPU backend.
//
// Ownership: EngineBuffers creates the object, maps it, and unlinks and unmaps
// it in its destructor. Thread safety: none; the engine writes inputs before
// SelectPages and reads outputs after it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "core/layout.h"
#include "core/select.h"
#include "eps/v1/page_selector.pb.h"

namespace eps::client {

struct BufferShape {
  int64_t num_slots = 0;   // summary records per (layer, kv head)
  int64_t max_seqs = 0;    // rows of the group and block tables
  int64_t max_context = 0; // tokens: fixes max_blocks and max_groups
  int64_t max_batch = 0;
  Granularity granularity = Granularity::kUnion;
  bool with_flags = true;
};

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
  std::span<float> summary_pool() { return {pool_, static_cast<size_t>(pool_words_)}; }
  std::span<int32_t> GroupRow(int64_t row);   // max_groups slots
  std::span<int32_t> BlockRow(int64_t row);   // max_blocks physical ids
  std::span<float> Query(int layer, int64_t batch_pos, int q_head);
  std::span<const int32_t> VisitBlocks(int layer, int64_t batch_pos, int list = 0) const;
  int32_t VisitCount(int layer, int64_t batch_pos, int list = 0) const;
  uint64_t selection_done() const;

  const ModelLayout& model() const { return model_; }
  const BufferShape& shape() const { return shape_; }
  int64_t max_blocks() const { return max_blocks_; }
  int64_t max_groups() const { return max_groups_; }
  const std::string& shm_name() const { return name_; }

 private:
  EngineBuffers() = default;
  v1::MemoryDescriptor Describe(uint64_t offset, std::initializer_list<int64_t> shape,
                                v1::DType dtype) const;

  ModelLayout model_;
  BufferShape shape_;
  std::string name_;
  std::byte* base_ = nullptr;
  uint64_t size_ = 0;
  int64_t max_blocks_ = 0, max_groups_ = 0, record_words_ = 0, lists_ = 1, pool_words_ = 0;
  uint64_t off_pool_ = 0, off_groups_ = 0, off_blocks_ = 0, off_queries_ = 0, off_visit_ = 0,
           off_count_ = 0, off_flags_ = 0;
  float* pool_ = nullptr;
};

}  // namespace eps::client
