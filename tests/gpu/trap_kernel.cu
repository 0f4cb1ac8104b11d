// A kernel that traps, for the tests of a lost CUDA context (device_lost_test.cc).
#include <cuda_runtime.h>

namespace eps::testing {
namespace {

__global__ void TrapKernel() { __trap(); }

}  // namespace

// Launches one thread that traps on the current device's default stream; the
// context is lost once it runs (cudaErrorLaunchFailure at the next sync).
void LaunchTrapKernel() { TrapKernel<<<1, 1>>>(); }

}  // namespace eps::testing
