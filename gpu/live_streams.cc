#include "gpu/live_streams.h"

#include <vector>

#include "absl/base/const_init.h"
#include "absl/synchronization/mutex.h"

namespace eps::gpu {
namespace {

struct LiveStream {
  int device;
  cudaStream_t stream;
  std::chrono::steady_clock::time_point wait_queued;  // {} when no wait is queued
};

ABSL_CONST_INIT absl::Mutex g_mu(absl::kConstInit);
std::vector<LiveStream>& Streams() {
  static auto* streams = new std::vector<LiveStream>();  // never destroyed
  return *streams;
}

void SetWait(cudaStream_t stream, std::chrono::steady_clock::time_point when) {
  absl::MutexLock lock(&g_mu);
  for (LiveStream& s : Streams()) {
    if (s.stream == stream) s.wait_queued = when;
  }
}

}  // namespace

void AddLiveStream(int device, cudaStream_t stream) {
  absl::MutexLock lock(&g_mu);
  Streams().push_back({device, stream, {}});
}

void RemoveLiveStream(cudaStream_t stream) {
  absl::MutexLock lock(&g_mu);
  std::erase_if(Streams(), [stream](const LiveStream& s) { return s.stream == stream; });
}

void NoteWaitQueued(cudaStream_t stream) { SetWait(stream, std::chrono::steady_clock::now()); }
void NoteWaitEnded(cudaStream_t stream) { SetWait(stream, {}); }

OtherStreams CheckOtherLiveStreams(int device, cudaStream_t except,
                                   std::chrono::steady_clock::duration stale) {
  const auto now = std::chrono::steady_clock::now();
  OtherStreams out;
  absl::MutexLock lock(&g_mu);
  for (const LiveStream& s : Streams()) {
    if (s.device != device || s.stream == except) continue;
    if (cudaStreamQuery(s.stream) != cudaErrorNotReady) continue;  // finished its work
    out.idle = false;
    const bool waiting = s.wait_queued != std::chrono::steady_clock::time_point{};
    if (waiting && now - s.wait_queued > stale) out.stale_wait = true;
  }
  return out;
}

}  // namespace eps::gpu
