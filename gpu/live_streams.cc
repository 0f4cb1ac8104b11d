#include "gpu/live_streams.h"

#include <optional>
#include <utility>
#include <vector>

#include "absl/base/const_init.h"
#include "absl/base/thread_annotations.h"
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
struct AbandonedStream {
  int device;
  cudaStream_t stream;
  std::chrono::steady_clock::time_point since;  // when its owner abandoned it
};
std::vector<AbandonedStream>& Abandoned() {  // guarded by g_mu
  static auto* streams = new std::vector<AbandonedStream>();
  return *streams;
}

// Forgets the abandoned streams that have drained (or broke: their work can touch nothing
// any more) and returns when the oldest one left on `device` was abandoned.
std::optional<std::chrono::steady_clock::time_point> OldestRunning(int device)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_mu) {
  std::vector<AbandonedStream>& streams = Abandoned();
  std::optional<std::chrono::steady_clock::time_point> oldest;
  for (size_t i = 0; i < streams.size();) {
    const cudaError_t state = cudaStreamQuery(streams[i].stream);
    if (state != cudaSuccess && state != cudaErrorNotReady) (void)cudaGetLastError();
    if (state == cudaErrorNotReady) {
      if (streams[i].device == device && (!oldest || streams[i].since < *oldest)) {
        oldest = streams[i].since;
      }
      ++i;
    } else {
      streams[i] = streams.back();
      streams.pop_back();
    }
  }
  return oldest;
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
  Abandoned().push_back({device, stream, std::chrono::steady_clock::now()});
}

bool AbandonedStreamRunning(int device) { return OldestAbandonment(device).has_value(); }

std::optional<std::chrono::steady_clock::time_point> OldestAbandonment(int device) {
  absl::MutexLock lock(&g_mu);
  return OldestRunning(device);
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
