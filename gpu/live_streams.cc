#include "gpu/live_streams.h"

#include <utility>
#include <vector>

#include "absl/base/const_init.h"
#include "absl/synchronization/mutex.h"

namespace eps::gpu {
namespace {

struct LiveStream {
  int device;
  cudaStream_t stream;
  const std::atomic<int64_t>* wait_queued_ns;
};

ABSL_CONST_INIT absl::Mutex g_mu(absl::kConstInit);
std::vector<LiveStream>& Streams() {                     // guarded by g_mu
  static auto* streams = new std::vector<LiveStream>();  // never destroyed
  return *streams;
}
std::vector<std::pair<int, cudaStream_t>>& Abandoned() {  // guarded by g_mu
  static auto* streams = new std::vector<std::pair<int, cudaStream_t>>();
  return *streams;
}

}  // namespace

CaptureHold::CaptureHold() { g_mu.Lock(); }
CaptureHold::~CaptureHold() { g_mu.Unlock(); }

void AddLiveStream(int device, cudaStream_t stream, const std::atomic<int64_t>* wait_queued_ns) {
  absl::MutexLock lock(&g_mu);
  Streams().push_back({device, stream, wait_queued_ns});
}

void RemoveLiveStream(cudaStream_t stream) {
  absl::MutexLock lock(&g_mu);
  std::erase_if(Streams(), [stream](const LiveStream& s) { return s.stream == stream; });
}

void NoteAbandonedStream(int device, cudaStream_t stream) {
  if (stream == nullptr) return;
  absl::MutexLock lock(&g_mu);
  Abandoned().emplace_back(device, stream);
}

bool AbandonedStreamRunning(int device) {
  absl::MutexLock lock(&g_mu);
  std::vector<std::pair<int, cudaStream_t>>& streams = Abandoned();
  bool running = false;
  for (size_t i = 0; i < streams.size();) {
    const cudaError_t state = cudaStreamQuery(streams[i].second);
    if (state != cudaSuccess && state != cudaErrorNotReady) (void)cudaGetLastError();
    if (state == cudaErrorNotReady) {
      running |= streams[i].first == device;
      ++i;
    } else {  // drained (or broken): its work can touch nothing any more
      streams[i] = streams.back();
      streams.pop_back();
    }
  }
  return running;
}

OtherStreams CheckOtherLiveStreams(int device, cudaStream_t except,
                                   std::chrono::steady_clock::duration stale) {
  const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now().time_since_epoch())
                             .count();
  const int64_t stale_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(stale).count();
  OtherStreams out;
  absl::MutexLock lock(&g_mu);
  for (const LiveStream& s : Streams()) {
    if (s.device != device || s.stream == except) continue;
    const cudaError_t state = cudaStreamQuery(s.stream);
    if (state == cudaSuccess) continue;  // finished its work
    // Not ready, or an answer that is no "drained" (the last error cleared, so that a later
    // launch check on this thread does not report it): busy.
    if (state != cudaErrorNotReady) (void)cudaGetLastError();
    out.idle = false;
    const int64_t queued = s.wait_queued_ns->load(std::memory_order_relaxed);
    if (queued != 0 && now_ns - queued > stale_ns) out.stale_wait = true;
  }
  return out;
}

bool SafeToFreeOn(int device, cudaStream_t except, std::chrono::steady_clock::duration deferred,
                  std::chrono::steady_clock::duration stale) {
  if (AbandonedStreamRunning(device)) return false;  // may never end: keep, not block
  const OtherStreams others = CheckOtherLiveStreams(device, except, stale);
  return others.idle || (deferred >= stale && !others.stale_wait);
}

}  // namespace eps::gpu
