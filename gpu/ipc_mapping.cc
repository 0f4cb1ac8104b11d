#include "gpu/ipc_mapping.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gpu/cuda_check.h"
#include "gpu/live_streams.h"

namespace eps::gpu {
namespace {

// cuMemGetAddressRange through the runtime's driver entry point, so that no
// binary links libcuda (absent where no driver is installed, as on CI).
using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

GetAddressRange AddressRangeFunction() {
  static const auto fn = reinterpret_cast<GetAddressRange>(DriverFunction("cuMemGetAddressRange"));
  return fn;
}

}  // namespace

absl::StatusOr<std::unique_ptr<IpcMapping>> IpcMapping::Open(
    const std::string& handle, int device, std::unique_ptr<IpcMapping>* unusable) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat("cuda_ipc.handle has ", handle.size(),
                                                   " bytes, want ", sizeof(cudaIpcMemHandle_t)));
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    ClearFailedCall();  // no driver or no device: answered below as no such device
    count = 0;
  }
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda_ipc.device=", device, " is not one of this host's ", count, " devices"));
  }
  RETURN_IF_ERROR(SetDevice(device));
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* ptr = nullptr;
  const cudaError_t err = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
  if (ContextLost(err)) return CudaStatus("cudaIpcOpenMemHandle", err);  // not the handle's fault
  if (err != cudaSuccess) {
    ClearFailedCall();
    return absl::InvalidArgumentError(
        absl::StrCat("cudaIpcOpenMemHandle on device ", device, ": ", cudaGetErrorString(err),
                     " (a handle of a freed allocation, of another GPU than this one without "
                     "peer access to it, or not a handle)"));
  }
  auto mapping = std::unique_ptr<IpcMapping>(new IpcMapping());
  mapping->data_ = static_cast<std::byte*>(ptr);
  mapping->device_ = device;
  // cudaIpcMemLazyEnablePeerAccess maps another GPU's allocation too, and nothing here can
  // tell: cudaPointerGetAttributes and cuPointerGetAttribute(DEVICE_ORDINAL) name the device
  // that opened the handle, not the one the memory lives on (2 x H200, 2026-11-28). A rank
  // names its GPU by device_uuid (docs/api-memory.md, "Naming the GPU").
  CUdeviceptr base = 0;
  size_t size = 0;
  const GetAddressRange range = AddressRangeFunction();
  if (range == nullptr || range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) {
    if (unusable != nullptr) *unusable = std::move(mapping);
    return absl::InternalError("cuMemGetAddressRange failed on an opened IPC handle");
  }
  // The handle maps the start of its allocation; bytes before ptr are not ours.
  mapping->size_ = static_cast<uint64_t>(base + size - reinterpret_cast<CUdeviceptr>(ptr));
  return mapping;
}

IpcMapping::~IpcMapping() {
  // A selector abandoned a stream on this device whose queued work may still
  // run and read or write this mapping (gpu/inputs_wait.h): leave it mapped,
  // since a kernel touching an unmapped address would fault the whole context.
  if (data_ != nullptr && !AbandonedStreamRunning(device_)) {
    (void)TrySetDevice(device_);
    if (cudaIpcCloseMemHandle(data_) != cudaSuccess) ClearFailedCall();
  }
}

absl::StatusOr<uint64_t> ReadCounter(int device, const uint64_t* at) {
  RETURN_IF_ERROR(SetDevice(device));
  uint64_t value = 0;
  CUDA_RETURN_IF_ERROR(cudaMemcpy(&value, at, sizeof(value), cudaMemcpyDeviceToHost));
  return value;
}

}  // namespace eps::gpu
