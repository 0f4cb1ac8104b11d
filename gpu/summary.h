// Writing EPS summaries on the device, where the engine writes K (docs/design.md §3):
// the CUDA counterpart of core/summary.h's Append, on the same record layout.
//
// One warp per append: it checks the append's keys, then folds them in order
// into the record (y = Φᵀk, G += y yᵀ packed, fro2, max_norm, count, key sum,
// quest min/max in binary16 rounded outward, as core/ stores them; quest8's codes and scale) and
// clears a principal pair (a later Seal on the host or the core writer refits it). Sums run in
// another order than core/'s, so results match it to float rounding, not bit for bit; the quest
// and quest8 parts match bit for bit.
//
// Records are device memory of the pool's layout: 16-byte aligned (the pool contract,
// docs/api-memory.md §3.2) and at least record_words apart; keys aligned to their element size.
// Thread safety: appends of one call must target distinct, non-overlapping records
// (checked); calls on one stream are ordered. Append (the synchronous one) shares scratch
// memory between calls and serialises on a mutex; AppendAsync and Reset may be called from
// any thread and share only the writer's pinned staging (behind a mutex held for no wait).
// Neither waits for its stream: their arguments go up from pinned memory that the writer
// owns (a copy from pageable memory may wait for the stream, and the engine's stream may be
// held by a wait for epsd's lists), each staging slot reused only once its copy is done.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/half.h"
#include "core/layout.h"

namespace eps::gpu {

// Keys of one (layer, KV head) for one record; device pointers.
struct KeyAppend {
  float* record = nullptr;     // record_words floats in the summary pool
  const void* keys = nullptr;  // `count` keys, `stride` elements apart
  int64_t count = 0;
  int64_t stride = 0;  // 0: head_dim
  int layer = 0;
  int kv_head = 0;
};

// `records` consecutive records from `first`: a slot of a pool is one run of
// num_layers * num_kv_heads records.
struct RecordRun {
  float* first = nullptr;
  int64_t records = 0;
};

class DeviceSummaryWriter {
 public:
  // AppendAsync and Reset calls whose copies may be in flight at once (queued behind a
  // held stream) before a call adds pinned staging (cudaMallocHost, which CUDA may order
  // after the device's work); each of up to 6553 appends or 16384 runs (256 KiB).
  static constexpr int kStagingSlots = 8;
  // The most appends, and record runs, one call takes (more is INVALID_ARGUMENT): the append
  // kernel runs 32 threads an append and the reset kernel takes an int count, both in int.
  static constexpr int64_t kMaxAppends = INT32_MAX / 32;
  static constexpr int64_t kMaxRuns = INT32_MAX;

  static absl::StatusOr<std::unique_ptr<DeviceSummaryWriter>> Create(const ModelLayout& model,
                                                                     int device);
  ~DeviceSummaryWriter();
  DeviceSummaryWriter(const DeviceSummaryWriter&) = delete;
  DeviceSummaryWriter& operator=(const DeviceSummaryWriter&) = delete;

  // Applies `appends` on `stream` and waits. An append core's SummaryWriter refuses
  // (a non-finite key, one beyond binary16 with quest, keys whose squared norms would
  // take the record's sums out of the float range) is skipped whole and reported
  // (INVALID_ARGUMENT naming it); the others apply.
  absl::Status Append(const std::vector<KeyAppend>& appends, DType key_dtype,
                      cudaStream_t stream = nullptr);

  // Queues `appends` on `stream` and returns without waiting for the device or the stream, so
  // an engine can write summaries on its own stream, in order with its other
  // work, and never wait on another stream. The host-side checks fail the call
  // as Append's do (nothing is queued); an append with a bad key is skipped
  // whole on the device and counted in `*skipped` (a device counter, may be
  // null). Calls on different streams may overlap.
  absl::Status AppendAsync(const std::vector<KeyAppend>& appends, DType key_dtype,
                           cudaStream_t stream, unsigned long long* skipped);

  // Queues on `stream` the emptying of every record of `runs`: exactly the bytes core's
  // Reset writes (ResetRecord: zero sums, quest min +inf / max -inf, quest8 codes 127 /
  // -128, scale 0), without waiting. An engine resets a slot's records whenever the slot
  // is (re)assigned to a group, before the group's first append on the same stream: a
  // reused record would otherwise keep the old group's keys in every statistic. The runs
  // are checked as appends' records are (non-null, 16-byte aligned, disjoint); a refused
  // call queues nothing.
  absl::Status Reset(const std::vector<RecordRun>& runs, cudaStream_t stream);

 private:
  absl::Status Check(const std::vector<KeyAppend>& appends, DType key_dtype) const;
  // The message of a refused append: the key and element core's rules refuse, read back.
  std::string DescribeRefused(const KeyAppend& append, DType key_dtype, int index) const;
  absl::Status Launch(const KeyAppend* device_appends, int n, DType key_dtype, cudaStream_t stream,
                      int* bad, unsigned long long* skipped);

  struct Impl;
  explicit DeviceSummaryWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace eps::gpu
