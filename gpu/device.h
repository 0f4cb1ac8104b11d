// Whether this process can use a CUDA device: tests skip, and binaries refuse
// the cuda backend, without one.
#pragma once

namespace eps::gpu {

// True when a CUDA device is usable by this process.
bool DeviceAvailable();

}  // namespace eps::gpu
