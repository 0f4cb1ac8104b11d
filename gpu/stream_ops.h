// Stream memory operations for the cross-process step counters of docs/design.md §5:
// a stream waits until a 64-bit counter in device memory reaches a value, or
// writes one after its earlier work (cuStreamWaitValue64 / cuStreamWriteValue64).
//
// The driver API is reached through gpu::DriverFunction (cuda_check.h), as in
// ipc_mapping.cc, so that no binary links libcuda. Thread safety: the functions
// are safe to call from any thread; the stream's own rules apply.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <limits>

#include "absl/status/status.h"

namespace eps::gpu {

// Enqueues on `stream`: wait until *counter >= value in CUDA's cyclic order
// (CU_STREAM_WAIT_VALUE_GEQ passes when (int64_t)(*counter - value) >= 0): a
// counter at value + 2^63 or more reads as below value and holds the wait.
absl::Status StreamWaitCounter(cudaStream_t stream, const uint64_t* counter, uint64_t value);

// Enqueues on `stream`: *counter = value once the stream's earlier work is done,
// with a memory barrier, so a waiter that sees the value sees that work's writes.
absl::Status StreamWriteCounter(cudaStream_t stream, uint64_t* counter, uint64_t value);

// Enqueues on `stream`: *counter = value unless it is already at or past value
// in the waits' cyclic order, atomically (a compare-and-swap loop). The
// watchdogs release a wait with it: a plain write could move a counter that the
// other side already advanced backwards, and block its next step; an unsigned
// max would leave a counter at value + 2^63 or more (an engine's -1) where no
// GEQ wait for value ever passes.
absl::Status StreamRaiseCounter(cudaStream_t stream, uint64_t* counter, uint64_t value);

// Enqueues on `stream`: counts[0, n) = -1 ("attend densely"), then the counter
// raised to value as StreamRaiseCounter does: the engine's fail-open release.
absl::Status StreamReleaseDense(cudaStream_t stream, int32_t* counts, int64_t n, uint64_t* counter,
                                uint64_t value);

// The most floats whose bytes a size_t counts (cudaMemsetAsync's count).
inline constexpr int64_t kMaxFeedbackEntries =
    static_cast<int64_t>(std::numeric_limits<size_t>::max() / sizeof(float));

// Enqueues on `stream`: feedback[0, n) = NaN (all-ones bytes), the selection feedback a
// fail-open release clears before the released step's attention writes it
// (docs/api-memory.md, "Selection feedback"). n above kMaxFeedbackEntries is
// INVALID_ARGUMENT (its byte count would wrap).
absl::Status StreamClearFeedback(cudaStream_t stream, float* feedback, int64_t n);

// Loads the release kernels now. Under lazy module loading (CUDA's default) a
// kernel's first launch may wait for the context to go idle, which never
// happens while one of its streams waits on a counter that only this release
// would raise: a deadlock, seen on the H100. Call once per device, before any
// counter wait is queued.
absl::Status PreloadStreamOps();

}  // namespace eps::gpu
