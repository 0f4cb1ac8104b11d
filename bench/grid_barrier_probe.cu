// What the structure of a step costs on an empty GPU, before any work: one
// empty kernel, three empty kernels replayed as a graph (the three-kernel
// step's shape), and one cooperative kernel with 0 and 3 grid-wide barriers
// (the cooperative step's shape, gpu/cooperative_step.cuh), for a few grid
// sizes. GPU time between CUDA events, median of 200 launches after 20 of
// warm-up; blocks of 256 threads.
//
// Usage: eps_grid_barrier_probe        (prints one table)
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

namespace {

__global__ void Empty() {}

template <int kBarriers>
__global__ void Barriers() {
  for (int i = 0; i < kBarriers; ++i) cooperative_groups::this_grid().sync();
}

#define CHECK(x)                                                   \
  do {                                                             \
    const cudaError_t e = (x);                                     \
    if (e != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); \
      std::exit(1);                                                \
    }                                                              \
  } while (0)

template <typename Launch>
float MedianUs(cudaStream_t stream, Launch launch) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::vector<float> us;
  for (int i = 0; i < 220; ++i) {
    CHECK(cudaEventRecord(start, stream));
    launch();
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 20) us.push_back(ms * 1000.0f);
  }
  std::sort(us.begin(), us.end());
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  return us[us.size() / 2];
}

void Cooperative(const void* kernel, unsigned blocks, cudaStream_t stream) {
  cudaLaunchAttribute together{};
  together.id = cudaLaunchAttributeCooperative;
  together.val.cooperative = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(256);
  config.stream = stream;
  config.attrs = &together;
  config.numAttrs = 1;
  CHECK(cudaLaunchKernelExC(&config, kernel, nullptr));
}

}  // namespace

int main() {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Three empty kernels captured as one graph.
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int k = 0; k < 3; ++k) Empty<<<256, 256, 0, stream>>>();
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, reinterpret_cast<const void*>(&Barriers<3>), 256, 0));
  std::printf("device: %s, %d SMs; empty GPU, blocks of 256 threads, median of 200 (us)\n",
              prop.name, prop.multiProcessorCount);
  std::printf("%-44s %8s\n", "launch", "gpu_us");
  std::printf("%-44s %8.1f\n", "1 empty kernel, 256 blocks",
              MedianUs(stream, [&] { Empty<<<256, 256, 0, stream>>>(); }));
  std::printf("%-44s %8.1f\n", "3 empty kernels as a graph, 256 blocks each",
              MedianUs(stream, [&] { CHECK(cudaGraphLaunch(exec, stream)); }));
  const unsigned most = static_cast<unsigned>(std::min(per_sm, 3) * prop.multiProcessorCount);
  for (const unsigned blocks : {32u, 132u, 256u, most}) {
    std::printf("cooperative, %4u blocks, 0 barriers %16.1f\n", blocks, MedianUs(stream, [&] {
                  Cooperative(reinterpret_cast<const void*>(&Barriers<0>), blocks, stream);
                }));
    std::printf("cooperative, %4u blocks, 3 barriers %16.1f\n", blocks, MedianUs(stream, [&] {
                  Cooperative(reinterpret_cast<const void*>(&Barriers<3>), blocks, stream);
                }));
  }
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return 0;
}
