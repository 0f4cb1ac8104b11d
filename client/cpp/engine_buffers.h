// The shared buffers of one engine session, allocated by the client library
// (docs/design.md §5: never the engine's own tensors) in one POSIX shared-memory
// object that epsd maps. CPU mode; the CUDA allocator comes with the GPU backend.
//
// Ownership: EngineBuffers creates the object, maps it, holds a shared flock on it
// (below), and unlinks, unmaps and unlocks it in its destructor. Only the creating process
// unlinks: in a forked child the destructor unmaps the child's copy and closes its copy of
// the lock's descriptor, and the parent's object stays, held while the parent lives. Thread
// safety: none; the engine writes inputs before SelectPages and reads outputs after it.
//
// Stale objects (docs/api-memory.md §3.3): a process killed before its destructor runs
// leaves its object in /dev/shm, which in a pod is memory. The object must outlive
// nothing but its creator (epsd re-opens it by name at a re-attach), so the creator's
// lock tells a live one from a dead one's: every object Create makes is held with
// flock(LOCK_SH) for as long as its EngineBuffers lives, and the kernel drops the lock
// when the process dies, however it dies and whatever its pid namespace. Create first
// removes the objects of its tag that no one holds (ReapStaleShm).
//
// Indices are checked on every access (a few integer compares): an index outside the
// plan's shape (slot >= num_slots, row >= max_seqs, layer, batch position, head or
// list outside the model) gives an empty span, never memory outside the buffer, and
// VisitCount -1 ("attend densely", always a correct attention). The spans of
// VisitBlocks and Visits are at most max_blocks long whatever visit_count holds.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/cpp/buffer_plan.h"
#include "core/layout.h"
#include "eps/v1/page_selector.pb.h"

namespace eps::client {

// How long an object must have gone unchanged (its ctime and mtime) before a Create may
// remove it as stale: the creator locks its object just after making it, and an object in
// between must never be taken, however long its creator is descheduled there. 10 s is
// that, and no longer than Kubernetes' first restart back-off (10 s), so an engine restarted
// after a crash finds the crashed one's objects old enough. The Python client's
// STALE_SHM_GRACE_S is the same (a test compares them).
inline constexpr std::chrono::seconds kStaleShmGrace{10};

// Removes the stale objects of `tag` from /dev/shm and returns their names ('/'-prefixed):
// every entry named as Create names `tag`'s objects (`eps-<tag>-<pid>-<n>`: a pid of 1 to 7
// digits, a count of 1 to 10; or with a suffix `-<16 lower-case hex digits>`: one tag's names
// never read as another's, "a" and "a-1" alike), a regular file owned by this process's
// effective uid (checked before the entry is opened: nothing else is ever opened),
// unchanged for at least `grace`, that flock(LOCK_EX | LOCK_NB) can lock: its
// creator is gone. Everything else is left alone, quietly: another tag's, another
// user's, a held one (a live creator's, this process's own included), a younger one. Best
// effort: an entry that cannot be opened, locked or unlinked is skipped. Safe to run in
// several threads and processes at once (an object goes once, under its reaper's lock).
// A negative `grace` (it would take an object whose creator has not locked it yet) is
// INVALID_ARGUMENT, before anything is removed.
absl::StatusOr<std::vector<std::string>> ReapStaleShm(const std::string& tag,
                                                      std::chrono::seconds grace = kStaleShmGrace);

class EngineBuffers {
 public:
  // Reaps `tag`'s stale objects (ReapStaleShm with `stale_grace`; tests pass a shorter
  // one), then creates `/eps-<tag>-<pid>-<n>` sized for `model` and `shape` and locks it.
  // A negative `stale_grace` is INVALID_ARGUMENT, before anything is removed or created.
  static absl::StatusOr<std::unique_ptr<EngineBuffers>> Create(
      const ModelLayout& model, const BufferShape& shape, const std::string& tag,
      std::chrono::seconds stale_grace = kStaleShmGrace);
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
  int lock_fd_ = -1;    // the object, flock(LOCK_SH) held until the destructor closes it
  pid_t creator_ = -1;  // the process that unlinks the object (not a forked child)
  std::byte* base_ = nullptr;
  float* pool_ = nullptr;
};

}  // namespace eps::client
