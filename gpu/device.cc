#include "gpu/device.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gpu/cuda_check.h"

namespace eps::gpu {

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    ClearFailedCall();  // no driver or no device: not a sticky error for later calls
    return 0;
  }
  return count;
}

absl::StatusOr<std::string> DeviceUuid(int device) {
  cudaDeviceProp prop;
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  return std::string(prop.uuid.bytes, sizeof(prop.uuid.bytes));
}

absl::StatusOr<int> DeviceWithUuid(std::string_view uuid) {
  const int count = DeviceCount();
  for (int d = 0; d < count; ++d) {
    absl::StatusOr<std::string> id = DeviceUuid(d);
    if (!id.ok()) return id.status();
    if (*id == uuid) return d;
  }
  return absl::InvalidArgumentError(absl::StrCat("device_uuid=", UuidText(uuid),
                                                 " is not one of epsd's ", count, " CUDA devices"));
}

std::string UuidText(std::string_view uuid) {
  std::string hex;
  for (unsigned char c : uuid) absl::StrAppendFormat(&hex, "%02x", c);
  if (uuid.size() != 16) return hex;
  return absl::StrCat("GPU-", hex.substr(0, 8), "-", hex.substr(8, 4), "-", hex.substr(12, 4), "-",
                      hex.substr(16, 4), "-", hex.substr(20));
}

bool DeviceAvailable() { return DeviceCount() > 0; }

bool PrimaryContextActive(int device) {
  using GetState = CUresult (*)(CUdevice, unsigned int*, int*);
  using GetDevice = CUresult (*)(CUdevice*, int);
  static const auto get_state =
      reinterpret_cast<GetState>(DriverFunction("cuDevicePrimaryCtxGetState"));
  static const auto get_device = reinterpret_cast<GetDevice>(DriverFunction("cuDeviceGet"));
  CUdevice handle = 0;
  unsigned int flags = 0;
  int active = 0;
  return get_state != nullptr && get_device != nullptr &&
         get_device(&handle, device) == CUDA_SUCCESS &&
         get_state(handle, &flags, &active) == CUDA_SUCCESS && active != 0;
}

}  // namespace eps::gpu
