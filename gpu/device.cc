#include "gpu/device.h"

#include <cuda_runtime.h>

namespace eps::gpu {

bool DeviceAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

}  // namespace eps::gpu
