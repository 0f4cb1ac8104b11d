#include <cuda.h>

#include "absl/strings/str_cat.h"
#include "gpu/cuda_check.h"
#include "gpu/stream_ops.h"

namespace eps::gpu {
namespace {

using StreamValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

StreamValueFn Lookup(const char* name) {
  return reinterpret_cast<StreamValueFn>(DriverFunction(name));
}

absl::Status Call(const char* name, StreamValueFn fn, cudaStream_t stream, const uint64_t* at,
                  uint64_t value, unsigned flags) {
  if (fn == nullptr) return absl::FailedPreconditionError(absl::StrCat(name, " is not available"));
  const CUresult r =
      fn(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(at), value, flags);
  if (r != CUDA_SUCCESS) {
    // The driver's codes of the errors that lose a context are the runtime's.
    return CudaStatus(absl::StrCat(name, "(value=", value, "): CUresult ", static_cast<int>(r)),
                      static_cast<cudaError_t>(r));
  }
  return absl::OkStatus();
}

// *counter = value unless it is at or past value in the wait's own order
// (cuStreamWaitValue64 with GEQ compares cyclically: (int64_t)(*counter - value)
// >= 0). An unsigned max would leave a counter the engine set at value + 2^63 or
// more (UINT64_MAX, an engine that starts at -1) where the wait never passes;
// this sets it to exactly value, which every wait for value or less then passes.
__device__ inline void RaiseCyclic(unsigned long long* counter, unsigned long long value) {
  unsigned long long seen = *reinterpret_cast<volatile unsigned long long*>(counter);
  while (static_cast<long long>(seen - value) < 0) {
    const unsigned long long was = atomicCAS(counter, seen, value);
    if (was == seen) break;
    seen = was;
  }
}

__global__ void RaiseCounterKernel(unsigned long long* counter, unsigned long long value) {
  RaiseCyclic(counter, value);
}

// counts[0, n) = -1, then the counter raised to value (RaiseCyclic). One block,
// so that the barrier orders every count before the counter.
__global__ void ReleaseDenseKernel(int32_t* counts, int64_t n, unsigned long long* counter,
                                   unsigned long long value) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) counts[i] = -1;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) RaiseCyclic(counter, value);
}

}  // namespace

// Launched through cudaLaunchKernel, whose result is this launch's own: a `<<<>>>` launch
// checked with cudaGetLastError reported any earlier failed call of the thread (an
// engine's, or ours) as its own.
absl::Status StreamRaiseCounter(cudaStream_t stream, uint64_t* counter, uint64_t value) {
  auto* target = reinterpret_cast<unsigned long long*>(counter);
  auto raised = static_cast<unsigned long long>(value);
  void* args[] = {&target, &raised};
  const cudaError_t err = cudaLaunchKernel(reinterpret_cast<const void*>(&RaiseCounterKernel),
                                           dim3(1), dim3(1), args, 0, stream);
  return err == cudaSuccess ? absl::OkStatus() : CudaFailure("RaiseCounterKernel", err);
}

absl::Status StreamReleaseDense(cudaStream_t stream, int32_t* counts, int64_t n, uint64_t* counter,
                                uint64_t value) {
  auto* target = reinterpret_cast<unsigned long long*>(counter);
  auto raised = static_cast<unsigned long long>(value);
  void* args[] = {&counts, &n, &target, &raised};
  const cudaError_t err = cudaLaunchKernel(reinterpret_cast<const void*>(&ReleaseDenseKernel),
                                           dim3(1), dim3(1024), args, 0, stream);
  return err == cudaSuccess ? absl::OkStatus() : CudaFailure("ReleaseDenseKernel", err);
}

absl::Status StreamClearFeedback(cudaStream_t stream, float* feedback, int64_t n) {
  if (n <= 0) return absl::OkStatus();
  if (n > kMaxFeedbackEntries) {
    return absl::InvalidArgumentError(absl::StrCat(
        "StreamClearFeedback: n=", n,
        " floats are more bytes than an address space holds (at most ", kMaxFeedbackEntries, ")"));
  }
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(feedback, 0xFF, n * sizeof(float), stream));
  return absl::OkStatus();
}

absl::Status PreloadStreamOps() {
  cudaFuncAttributes attributes;
  for (const void* kernel : {reinterpret_cast<const void*>(&RaiseCounterKernel),
                             reinterpret_cast<const void*>(&ReleaseDenseKernel)}) {
    CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, kernel));
  }
  return absl::OkStatus();
}

absl::Status StreamWaitCounter(cudaStream_t stream, const uint64_t* counter, uint64_t value) {
  static const StreamValueFn fn = Lookup("cuStreamWaitValue64");
  return Call("cuStreamWaitValue64", fn, stream, counter, value, CU_STREAM_WAIT_VALUE_GEQ);
}

absl::Status StreamWriteCounter(cudaStream_t stream, uint64_t* counter, uint64_t value) {
  static const StreamValueFn fn = Lookup("cuStreamWriteValue64");
  return Call("cuStreamWriteValue64", fn, stream, counter, value, CU_STREAM_WRITE_VALUE_DEFAULT);
}

}  // namespace eps::gpu
