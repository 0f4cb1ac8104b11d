// The streams of every live GpuSelector in this process, by device, the waits on
// engine memory queued on them, and the streams abandoned with work that may still run:
// whether freeing or unmapping memory now could wait for an engine, or let a kernel fault.
//
// cudaFree and cudaFreeHost wait for every stream on the device, and while they wait
// other threads' CUDA calls on that device wait behind them. An async step's stream
// holds a wait on its engine's inputs_ready until the engine writes it or epsd releases
// it (inputs_wait.h), and the release is itself a CUDA call: a free issued while a dead
// engine's wait is queued would block, and block the release that ends the wait
// (service/session_janitor.h). A healthy async engine, though, keeps a short wait
// queued nearly all the time, so "no wait queued" may never hold under load.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>

namespace eps::gpu {

// `wait_queued_ns`: when the wait on engine memory queued on `stream` was queued (steady
// clock, ns), 0 when none (InputsWait::queued_ns); it must outlive the registration.
void AddLiveStream(int device, cudaStream_t stream, const std::atomic<int64_t>* wait_queued_ns);
void RemoveLiveStream(cudaStream_t stream);

// The other live streams on `device` (all but `except`).
struct OtherStreams {
  bool idle = true;         // every one has finished its queued work (cudaStreamQuery)
  bool stale_wait = false;  // one still holds a wait queued more than `stale` ago
};
OtherStreams CheckOtherLiveStreams(int device, cudaStream_t except,
                                   std::chrono::steady_clock::duration stale);

// Held while a graph is captured on a live stream (gpu/step_launch.cuh): the checks
// above query every live stream under the same lock, and a query of a stream that
// another thread is capturing fails and invalidates that capture (its step then failed,
// and the stream read as drained while it may hold a wait on engine memory).
class CaptureHold {
 public:
  CaptureHold();
  ~CaptureHold();
  CaptureHold(const CaptureHold&) = delete;
  CaptureHold& operator=(const CaptureHold&) = delete;
};

// Records `stream` of `device` as abandoned by its owner while work queued on it may
// still run one day (a wait on engine memory that never passed: gpu/inputs_wait.h).
// Device memory that such work may touch must stay mapped: IpcMapping keeps its
// mapping open while AbandonedStreamRunning(device). A drained stream is forgotten.
void NoteAbandonedStream(int device, cudaStream_t stream);
bool AbandonedStreamRunning(int device);
// When the oldest stream abandoned on `device` whose work may still run was abandoned, or
// none. An abandoned stream drains only if its engine raises inputs_ready again; until it
// does, no memory of epsd's on the device can be freed (SafeToFreeOn), so the service
// treats one that stays running too long as a lost device (service/session_janitor.h).
std::optional<std::chrono::steady_clock::time_point> OldestAbandonment(int device);

// Whether the owner of `except` (a live stream, or null) may free its memory on `device`
// now, after putting it off for `deferred`: when the other live streams have finished
// their queued work, or once `deferred` reaches `stale` and none of them holds a wait
// on its engine queued more than `stale` ago (a healthy engine's waits are short; a
// dead engine's ages until its session's end releases it). Never while an abandoned
// stream on the device may still run.
bool SafeToFreeOn(int device, cudaStream_t except, std::chrono::steady_clock::duration deferred,
                  std::chrono::steady_clock::duration stale);

}  // namespace eps::gpu
