// The engine-side counter protocol with every stream of the process in ONE
// hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1, set before CUDA starts): a
// stream memory wait then blocks every command queued after it in the process,
// whatever its stream. The summary queue and a dense release on the engine's
// stream must still complete; the control shows that two
// streams really share the queue here (else nothing is tested). Not covered, because
// it fails here by construction: a release queued on another stream of the process
// after the wait (the watchdog's, when epsd dies mid-step) waits behind it too.
// A stuck stream cannot be recovered, so a timeout fails the test and exits.
// Skips without a device.
#include <cuda_runtime.h>
#include <stdlib.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "client/cpp/engine_capi.h"
#include "gpu/device.h"
#include "gpu/stream_ops.h"
#include "gtest/gtest.h"
#include "tests/client/device_memory.h"

namespace {

uint64_t Addr(const void* p) { return reinterpret_cast<uint64_t>(p); }

// Polls `stream` for up to `timeout`; true when it drained.
bool Drains(cudaStream_t stream, std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    const cudaError_t q = cudaStreamQuery(stream);
    if (q == cudaSuccess) return true;
    if (q != cudaErrorNotReady) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

void DrainsOrExit(cudaStream_t stream, const char* what) {
  if (!Drains(stream, std::chrono::seconds(10))) {
    std::fprintf(stderr, "FAILED: %s did not drain within 10 s (deadlock)\n", what);
    std::_Exit(1);  // the stuck stream would hang teardown
  }
}

class OneQueueTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!eps::gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
    ASSERT_EQ(cudaStreamCreateWithFlags(&engine_, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(eps_engine_preload(0), 0) << eps_engine_last_error();
  }
  void TearDown() override {
    if (engine_ != nullptr) cudaStreamDestroy(engine_);
  }
  template <typename T>
  T* Alloc(size_t n) {
    return memory_.Alloc<T>(n);
  }
  cudaStream_t engine_ = nullptr;
  eps::testing::DeviceMemory memory_;
};

// The control: another stream's command really queues behind the engine stream's
// wait here. The wait is on host-mapped memory, so a CPU store can end it (no stream
// could: each would queue behind it too).
TEST_F(OneQueueTest, ControlAnotherStreamQueuesBehindTheWaitUntilACpuStoreEndsIt) {
  uint64_t* host_counter = nullptr;
  ASSERT_EQ(
      cudaHostAlloc(reinterpret_cast<void**>(&host_counter), sizeof(uint64_t), cudaHostAllocMapped),
      cudaSuccess);
  *host_counter = 0;
  uint64_t* mapped = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped), host_counter, 0),
            cudaSuccess);
  uint64_t* scratch = Alloc<uint64_t>(1);
  cudaStream_t other = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), cudaSuccess);
  const absl::Status waited = eps::gpu::StreamWaitCounter(engine_, mapped, 1);
  ASSERT_TRUE(waited.ok()) << waited;
  ASSERT_TRUE(eps::gpu::StreamRaiseCounter(other, scratch, 1).ok());
  EXPECT_FALSE(Drains(other, std::chrono::milliseconds(300)))
      << "two streams did not share a hardware queue: CUDA_DEVICE_MAX_CONNECTIONS=1 had no "
         "effect, so the other tests here check nothing";
  __atomic_store_n(host_counter, uint64_t{1}, __ATOMIC_RELEASE);
  DrainsOrExit(engine_, "the engine stream after the CPU store");
  DrainsOrExit(other, "the other stream after the CPU store");
  cudaStreamDestroy(other);
  cudaFreeHost(host_counter);
}

TEST_F(OneQueueTest, SummaryQueueAndDenseReleaseOnTheEngineStreamComplete) {
  const EpsEngineModel model{2, 4, 2, 64, 16, 8, 8, 0x5EEDULL, 1, 0, 1, 0};
  EpsSummaryWriter* writer = nullptr;
  ASSERT_EQ(eps_engine_summary_writer_create(&model, 0, &writer), 0) << eps_engine_last_error();
  EpsSummaryQueue* queue = nullptr;
  ASSERT_EQ(eps_engine_summary_queue_create(writer, 0, &queue), 0) << eps_engine_last_error();
  const int words = 4096, d = model.head_dim, lists = 8;
  float* pool = Alloc<float>(4 * words);
  float* keys = Alloc<float>(4 * d);
  int32_t* counts = Alloc<int32_t>(lists);
  uint64_t* flags = Alloc<uint64_t>(2);
  for (uint64_t step = 1; step <= 50; ++step) {
    // the engine's step: its dense release (a fallback) and its wait for the lists,
    // then the summary appends of its keys and the wait for them before the next inputs
    ASSERT_EQ(eps_engine_release_dense(0, Addr(counts), lists, Addr(flags), step, Addr(engine_)), 0)
        << eps_engine_last_error();
    ASSERT_EQ(eps_engine_wait_selection(Addr(engine_), Addr(flags), step), 0);
    std::vector<EpsKeyAppend> appends;
    for (int r = 0; r < 4; ++r) {
      appends.push_back({Addr(pool + r * words), Addr(keys + r * d), 1, 0, r % 2, r / 2});
    }
    ASSERT_EQ(eps_engine_summary_queue_submit(queue, appends.data(), 4, EPS_ENGINE_FLOAT32,
                                              Addr(engine_), step),
              0)
        << eps_engine_last_error();
    ASSERT_EQ(eps_engine_summary_queue_wait(queue, Addr(engine_), step), 0);
    ASSERT_EQ(eps_engine_signal_inputs_ready(Addr(engine_), Addr(flags), step + 1), 0);
  }
  DrainsOrExit(engine_, "the engine stream");
  ASSERT_EQ(eps_engine_summary_queue_drain(queue), 0);
  EXPECT_EQ(eps_engine_summary_queue_errors(queue, nullptr, 0), 0u);
  std::vector<float> record(words);
  cudaMemcpy(record.data(), pool, sizeof(float) * words, cudaMemcpyDeviceToHost);
  bool wrote = false;
  for (float w : record) wrote |= w != 0.0f;
  EXPECT_TRUE(wrote) << "the appends were not applied";
  eps_engine_summary_queue_destroy(queue);
  eps_engine_summary_writer_destroy(writer);
}

}  // namespace

int main(int argc, char** argv) {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1", 1);  // before any CUDA call
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
