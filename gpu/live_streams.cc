#include "gpu/live_streams.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/base/const_init.h"
#include "absl/synchronization/mutex.h"

namespace eps::gpu {
namespace {

ABSL_CONST_INIT absl::Mutex g_mu(absl::kConstInit);
std::vector<std::pair<int, cudaStream_t>>& Streams() {
  static auto* streams = new std::vector<std::pair<int, cudaStream_t>>();  // never destroyed
  return *streams;
}

}  // namespace

void AddLiveStream(int device, cudaStream_t stream) {
  absl::MutexLock lock(&g_mu);
  Streams().emplace_back(device, stream);
}

void RemoveLiveStream(cudaStream_t stream) {
  absl::MutexLock lock(&g_mu);
  std::erase_if(Streams(), [stream](const auto& s) { return s.second == stream; });
}

bool OtherLiveStreamsIdle(int device, cudaStream_t except) {
  absl::MutexLock lock(&g_mu);
  return std::none_of(Streams().begin(), Streams().end(), [&](const auto& s) {
    return s.first == device && s.second != except &&
           cudaStreamQuery(s.second) == cudaErrorNotReady;
  });
}

}  // namespace eps::gpu
