// The shared buffers of one simulated engine, behind a small interface so that
// eps-load runs the same load over host shared memory (the cpu backend) and
// device memory (the cuda backend).
//
// eps-load builds host images of every input buffer once and copies them in
// with the Write* calls before it attaches; the calls take row-major host
// arrays in the shapes of core/buffer_contract.h, and check their sizes
// against the client library's BufferPlan of that contract. Ownership: a BufferSet owns its memory
// and frees it in its destructor. Thread safety: none (one session each).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/statusor.h"
#include "client/cpp/buffer_plan.h"
#include "core/layout.h"
#include "eps/v1/page_selector.pb.h"
#include "load/load_config.h"

namespace eps::load {

struct BufferSetShape {
  int64_t num_slots = 0;
  int64_t max_seqs = 0;
  int64_t max_context = 0;
  int64_t max_batch = 0;
  int64_t coarse_slots = 0;    // coarse records per (layer, KV head): >= 1 with a coarse level
  bool with_feedback = false;  // the selection feedback buffer (docs/api-memory.md), NaN-filled
  // --reply=async (device sets): how long WaitSelection lets epsd take to raise
  // selection_done after an accepted reply before a SelectionWatchdog releases the step
  // densely (an epsd killed between its reply and its kernel would hang the run).
  std::chrono::microseconds selection_wait{std::chrono::seconds(10)};
};

// One stepped row's part of a feedback write: its table row and how many of its
// groups lie within this step's context (GroupsFor(context_tokens)).
struct FeedbackRows {
  int64_t row = 0;
  int64_t groups = 0;
};

class BufferSet {
 public:
  virtual ~BufferSet() = default;

  // Descriptors for AttachRequest.buffers, and the backend and device to attach with.
  virtual v1::SharedBuffers Descriptors() const = 0;
  virtual v1::Backend backend() const = 0;
  virtual int device() const { return 0; }
  // AttachRequest.device_uuid: the GPU's 16-byte UUID for device memory, empty for host's.
  virtual std::string device_uuid() const { return {}; }

  virtual int64_t max_groups() const = 0;
  virtual int64_t max_blocks() const = 0;

  // [num_slots, layers, kv_heads, record_words] float32
  virtual absl::Status WriteSummaryPool(std::span<const float> pool) = 0;
  // [max_seqs, max_groups] int32
  virtual absl::Status WriteGroupTable(std::span<const int32_t> table) = 0;
  // [max_seqs, max_blocks] int32
  virtual absl::Status WriteBlockTable(std::span<const int32_t> table) = 0;
  // [layers, max_batch, q_heads, head_dim] float32
  virtual absl::Status WriteQueries(std::span<const float> queries) = 0;
  // The coarse level's (ModelLayout.coarse_blocks > 0; FAILED_PRECONDITION without one):
  // [coarse_slots, layers, kv_heads, record_words] float32 and [max_seqs, max_coarse_groups]
  // int32.
  virtual int64_t max_coarse_groups() const = 0;
  virtual absl::Status WriteCoarsePool(std::span<const float> pool) = 0;
  virtual absl::Status WriteCoarseTable(std::span<const int32_t> table) = 0;

  // Selection feedback (BufferSetShape.with_feedback; FAILED_PRECONDITION without).
  // SetFeedbackPattern takes the image an engine's attention would leave,
  // [layers, max_seqs, q_heads, max_groups] float32 (NaN where it visited nothing); the
  // host set borrows it (it must outlive the set), the device set copies it to the device
  // once. WriteFeedback copies, for each of `rows`, the image's first `groups` entries of
  // every (layer, q head) into the shared buffer, and returns once they are there (the
  // device set: device-to-device copies on its own stream, waited for). ReadFeedback reads
  // one entry of the shared buffer back: eps-load's check that epsd consumed it.
  virtual absl::Status SetFeedbackPattern(std::span<const float> pattern) = 0;
  virtual absl::Status WriteFeedback(std::span<const FeedbackRows> rows) = 0;
  virtual absl::StatusOr<float> ReadFeedback(int layer, int64_t row, int q_head, int64_t group) = 0;

  // Async replies (--reply=async; device buffers only): the engine's side of one
  // step's fence on a stream of this set's own. SignalInputsReady queues
  // inputs_ready = step (the queries are in place), WaitSelection queues the wait
  // for selection_done >= step and waits for that stream, as an engine's forward
  // pass would before its next step, at most BufferSetShape::selection_wait (then the
  // step is released densely and the wait fails DEADLINE_EXCEEDED); ReleaseDense is
  // the client's fail-open path.
  virtual bool supports_async() const { return false; }
  virtual absl::Status SignalInputsReady(uint64_t step);
  virtual absl::Status WaitSelection(uint64_t step);
  virtual absl::Status ReleaseDense(uint64_t step);
};

// Host shared memory through client::EngineBuffers (cpu), or device memory on
// `device` through client::DeviceBuffers (cuda; FAILED_PRECONDITION without a
// device or in a build without CUDA). The cpu backend ignores `device`.
absl::StatusOr<std::unique_ptr<BufferSet>> CreateBufferSet(service::BackendKind backend,
                                                           const ModelLayout& model,
                                                           const BufferSetShape& shape,
                                                           int device = 0);
// Shared by both sets' feedback calls: FAILED_PRECONDITION without a feedback buffer (or,
// for WriteFeedback, before SetFeedbackPattern), INVALID_ARGUMENT naming a row, group
// count or entry outside the plan; FeedbackEntry gives the entry's element index.
absl::Status NoFeedbackBuffer();
absl::Status CheckFeedbackRows(std::span<const FeedbackRows> rows, const client::BufferPlan& plan,
                               bool have_pattern);
absl::StatusOr<int64_t> FeedbackEntry(const client::BufferPlan& plan, int layer, int64_t row,
                                      int q_head, int64_t group);

// The client library's shape for these buffers (union output, with flags).
client::BufferShape ClientShape(const BufferSetShape& shape);

absl::StatusOr<std::unique_ptr<BufferSet>> CreateDeviceBufferSet(const ModelLayout& model,
                                                                 const BufferSetShape& shape,
                                                                 int device);

// How many CUDA devices eps-load sees (0 without CUDA): rank r uses r mod this.
int DeviceCount();

}  // namespace eps::load
