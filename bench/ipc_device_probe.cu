// Which GPU the driver names for a CUDA IPC allocation of GPU 1 opened on GPU 0 and on
// GPU 1 (docs/api-memory.md, "Naming the GPU"): epsd cannot tell a peer-mapped allocation
// from its own if the answer is the opening GPU. Needs two GPUs with peer access.
//   eps_ipc_device_probe            exports an allocation of GPU 1, opens it in two children
//   eps_ipc_device_probe HEX DEV    (a child) opens handle HEX on device DEV
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

int Export(const char* self) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) {
    std::fprintf(stderr, "eps_ipc_device_probe: needs two CUDA devices\n");
    return 1;
  }
  void* p = nullptr;
  cudaIpcMemHandle_t h{};
  if (cudaSetDevice(1) != cudaSuccess || cudaMalloc(&p, 1 << 20) != cudaSuccess ||
      cudaIpcGetMemHandle(&h, p) != cudaSuccess) {
    std::fprintf(stderr, "eps_ipc_device_probe: export on device 1 failed\n");
    return 1;
  }
  std::string hex;
  for (char c : h.reserved) {
    char b[3];
    std::snprintf(b, sizeof(b), "%02x", static_cast<unsigned char>(c));
    hex += b;
  }
  std::printf("allocation on device 1, opened by a child on each device:\n");
  std::fflush(stdout);
  int failed = 0;
  for (const char* device : {"0", "1"}) {
    const std::string command = std::string(self) + " " + hex + " " + device;
    failed |= std::system(command.c_str());
  }
  return failed == 0 ? 0 : 1;
}

int Import(const char* hex, int device) {
  cudaIpcMemHandle_t h{};
  for (int i = 0; i < static_cast<int>(sizeof(h.reserved)); ++i) {
    unsigned v = 0;
    if (std::sscanf(hex + 2 * i, "%2x", &v) != 1) return 2;
    h.reserved[i] = static_cast<char>(v);
  }
  void* q = nullptr;
  if (cudaSetDevice(device) != cudaSuccess ||
      cudaIpcOpenMemHandle(&q, h, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
    std::printf("  opened on device %d: open failed\n", device);
    return 1;
  }
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, q);
  // The driver call through the runtime's entry points: no binary links libcuda.
  using GetAttribute = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
  void* f = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion("cuPointerGetAttribute", &f, 12000, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    return 1;
  }
  int ordinal = -1;
  const CUresult r = reinterpret_cast<GetAttribute>(f)(
      &ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, reinterpret_cast<CUdeviceptr>(q));
  std::printf(
      "  opened on device %d: cudaPointerGetAttributes %s device %d; "
      "cuPointerGetAttribute(DEVICE_ORDINAL) %d ordinal %d\n",
      device, cudaGetErrorString(e), a.device, static_cast<int>(r), ordinal);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3) return Import(argv[1], std::atoi(argv[2]));
  return Export(argv[0]);
}
