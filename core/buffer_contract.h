// The shared buffers of a session, written once: name, shape in terms of the
// layout and the session's sizes, element type, direction, and the alignment
// of the one allocation that holds them all (docs/api-memory.md, docs/design.md).
//
// Read by descriptor validation (service/session_buffers.cc), the engine-side
// plan (client/cpp/buffer_plan.cc), the load generator (load/buffer_set.cc),
// and compared with the Python client's table by
// client/python/tests/test_buffers.py. All buffers are row-major and
// contiguous. Thread safety: constants and pure functions.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "core/half.h"
#include "core/layout.h"
#include "core/select.h"

namespace eps {

// Where a buffer starts inside the one allocation of a BufferPlan (and of the
// Python client's buffers): every part starts at a multiple of this, so device
// loads stay aligned whatever the model shape.
inline constexpr uint64_t kBufferAlignment = 256;

// The summary pool starts at a multiple of this many bytes of its allocation: the GPU
// pre-pass copies records (whose sizes are multiples of 16 bytes, core/layout.h) 16
// bytes at a time, and a misaligned copy would fault the kernel, and with it every
// session of epsd's CUDA context. Attach refuses any other offset.
inline constexpr uint64_t kSummaryPoolAlignment = 16;

// A device allocation holding the buffers is a whole number of these (2 MiB pages):
// mapped in epsd through CUDA IPC, an allocation of any other size was read up to
// 2.4 times slower by its pre-pass (docs/design.md §5, "Allocate whole 2 MiB pages").
inline constexpr uint64_t kRegionAlignment = uint64_t{2} << 20;
inline constexpr uint64_t RegionBytes(uint64_t bytes) {
  return (bytes + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment;
}

// In allocation order.
enum class SharedBuffer : int {
  kSummaryPool,
  kGroupTable,
  kBlockTable,
  kQueries,
  kVisitBlocks,
  kVisitCount,
  kFlags,
  // The coarse level's (ModelLayout.coarse_blocks > 0): after flags, so that the
  // offsets of the buffers above keep their meaning in every plan.
  kCoarsePool,
  kCoarseTable,
  // Selection feedback (core/step.h StepInputs::feedback), optional in every
  // session: after the coarse level's, for the same reason.
  kFeedback,
};
inline constexpr int kSharedBuffers = 10;

// A dimension of a buffer's shape, by what fixes it.
enum class Dim : int {
  kSlots,            // summary records per (layer, KV head): the engine's choice
  kNumLayers,        // ModelLayout
  kNumKvHeads,       // ModelLayout
  kRecordWords,      // SummaryLayout::For(model).record_words
  kMaxSeqs,          // rows of the group and block tables: the engine's choice
  kMaxGroups,        // groups per table row: the engine's choice
  kMaxBlocks,        // blocks per table row and per visit list: the engine's choice
  kMaxBatch,         // rows per step (AttachRequest.max_batch)
  kNumQHeads,        // ModelLayout
  kHeadDim,          // ModelLayout
  kLists,            // visit lists per (layer, row): present only per KV head (= num_kv_heads)
  kCounters,         // 2: inputs_ready, selection_done
  kCoarseSlots,      // coarse records per (layer, KV head): the engine's choice
  kMaxCoarseGroups,  // coarse groups per table row: the engine's choice
};
inline constexpr int kDims = 14;
const char* DimName(Dim dim);  // "slots", "num_layers", ...

struct BufferSpec {
  SharedBuffer id;
  const char* name;  // the SharedBuffers field name
  DType dtype;       // queries: float32 here; a session may attach fp16 or bf16 queries
  int rank;          // the number of dims (kLists included)
  std::array<Dim, 4> dims;
  bool output;    // written by epsd (feedback: by the engine too)
  bool optional;  // may be absent (flags, feedback)
  // Belongs to a session only when its layout has a coarse level: required then,
  // refused otherwise (BufferApplies).
  bool coarse_level = false;
};

inline constexpr std::array<BufferSpec, kSharedBuffers> kBufferContract = {{
    {SharedBuffer::kSummaryPool,
     "summary_pool",
     DType::kFloat32,
     4,
     {Dim::kSlots, Dim::kNumLayers, Dim::kNumKvHeads, Dim::kRecordWords},
     false,
     false},
    {SharedBuffer::kGroupTable,
     "group_table",
     DType::kInt32,
     2,
     {Dim::kMaxSeqs, Dim::kMaxGroups},
     false,
     false},
    {SharedBuffer::kBlockTable,
     "block_table",
     DType::kInt32,
     2,
     {Dim::kMaxSeqs, Dim::kMaxBlocks},
     false,
     false},
    {SharedBuffer::kQueries,
     "queries",
     DType::kFloat32,
     4,
     {Dim::kNumLayers, Dim::kMaxBatch, Dim::kNumQHeads, Dim::kHeadDim},
     false,
     false},
    {SharedBuffer::kVisitBlocks,
     "visit_blocks",
     DType::kInt32,
     4,
     {Dim::kNumLayers, Dim::kMaxBatch, Dim::kLists, Dim::kMaxBlocks},
     true,
     false},
    {SharedBuffer::kVisitCount,
     "visit_count",
     DType::kInt32,
     3,
     {Dim::kNumLayers, Dim::kMaxBatch, Dim::kLists},
     true,
     false},
    {SharedBuffer::kFlags, "flags", DType::kUInt64, 1, {Dim::kCounters}, true, true},
    {SharedBuffer::kCoarsePool,
     "coarse_pool",
     DType::kFloat32,
     4,
     {Dim::kCoarseSlots, Dim::kNumLayers, Dim::kNumKvHeads, Dim::kRecordWords},
     false,
     false,
     true},
    {SharedBuffer::kCoarseTable,
     "coarse_table",
     DType::kInt32,
     2,
     {Dim::kMaxSeqs, Dim::kMaxCoarseGroups},
     false,
     false,
     true},
    // Written by the engine's attention (the log-sum-exp of each group it visited,
    // NaN elsewhere) and by epsd, which sets the step's rows to NaN after a step
    // that succeeded (consumed); hence an output. Any session may give it.
    {SharedBuffer::kFeedback,
     "feedback",
     DType::kFloat32,
     4,
     {Dim::kNumLayers, Dim::kMaxSeqs, Dim::kNumQHeads, Dim::kMaxGroups},
     true,
     true},
}};

constexpr const BufferSpec& SpecOf(SharedBuffer buffer) {
  return kBufferContract[static_cast<int>(buffer)];
}

// Whether `spec` is one of `model`'s buffers: every buffer is, except the coarse
// level's without one. Every reader of kBufferContract skips the others (their
// dims are not defined for the session).
constexpr bool BufferApplies(const BufferSpec& spec, const ModelLayout& model) {
  return !spec.coarse_level || model.has_coarse_level();
}

// The dims of one buffer for `granularity`: kLists only per KV head.
std::vector<Dim> DimsOf(const BufferSpec& spec, Granularity granularity);

// Values of every dim for one session; -1 where not known yet (the engine's
// choices before its descriptors are read).
struct BufferDims {
  std::array<int64_t, kDims> value;

  // The layout's dims, kLists for `granularity` and kCounters; the rest -1.
  static BufferDims For(const ModelLayout& model, Granularity granularity);
  int64_t& operator[](Dim dim) { return value[static_cast<int>(dim)]; }
  int64_t operator[](Dim dim) const { return value[static_cast<int>(dim)]; }
};

// The shape of `spec` under `dims` (entries -1 where a dim is not known).
std::vector<int64_t> ShapeOf(const BufferSpec& spec, const BufferDims& dims,
                             Granularity granularity);

}  // namespace eps
