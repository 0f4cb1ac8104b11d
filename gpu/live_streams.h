// The streams of every live GpuSelector in this process, by device: whether freeing
// memory now would wait for another selector's queued work.
//
// cudaFree and cudaFreeHost wait for every stream on the device, and while they wait
// other threads' CUDA calls on that device can wait behind them. An async step's stream
// holds a wait on its engine's inputs_ready until the engine writes it or epsd releases
// it (inputs_wait.h); a free issued while a dead engine's wait is queued would block, and
// could block the very release that ends the wait (service/session_janitor.h).
#pragma once

#include <cuda_runtime.h>

namespace eps::gpu {

void AddLiveStream(int device, cudaStream_t stream);
void RemoveLiveStream(cudaStream_t stream);
// True when every live stream on `device` but `except` has finished its queued work
// (cudaStreamQuery), so that a free now waits for no engine.
bool OtherLiveStreamsIdle(int device, cudaStream_t except);

}  // namespace eps::gpu
