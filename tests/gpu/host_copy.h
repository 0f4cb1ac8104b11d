// Host-to-device copies in the GPU tests. cudaMemcpy from pageable host memory returns
// once the bytes are staged for DMA, possibly before they land on the device, and work on
// a non-blocking stream (a selector's, or another process's) is not ordered after it: a
// step could read the previous step's queries (GpuStepGraphTest saw a graph replay and
// direct launches of one step differ under load, 2026-11-27 and 2026-11-28). The tests
// copy with CopyToDeviceNow, which waits for the copy to land. Not a cudaDeviceSynchronize:
// some tests hold other streams on a counter while they copy.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace eps::testing {

inline cudaError_t CopyToDeviceNow(void* device, const void* host, size_t bytes) {
  if (const cudaError_t e = cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice);
      e != cudaSuccess) {
    return e;
  }
  return cudaStreamSynchronize(cudaStreamLegacy);
}

}  // namespace eps::testing
