// libeps_engine's C ABI (client/cpp/engine_capi.h) on failures that are no malformed
// argument: one code for a device that cannot be made current, whichever entry point is
// asked, and a count too large for one call refused before anything is sized by it.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "client/cpp/engine_capi.h"
#include "gtest/gtest.h"
#include "tests/client/engine_capi_fixture.h"

namespace {

using eps::capi_testing::EngineCapiTest;
using eps::capi_testing::ExpectRefused;

// No process has a device of this ordinal: cudaSetDevice fails for it on a GPU machine
// (invalid device ordinal) as on one without a driver or a device, so these tests run on both.
constexpr int32_t kAbsent = 9999;

// What CUDA says when this process makes `device` current, taken off the thread's last error.
std::string SetDeviceError(int device) {
  const cudaError_t err = cudaSetDevice(device);
  EXPECT_NE(err, cudaSuccess);
  (void)cudaGetLastError();
  return cudaGetErrorString(err);
}

// FAILED_PRECONDITION (9) with the ordinal and CUDA's error.
void ExpectCannotMakeCurrent(const char* call, int rc) {
  EXPECT_EQ(rc, 9) << call << ": " << eps_engine_last_error();
  EXPECT_EQ(std::string(eps_engine_last_error()),
            "FAILED_PRECONDITION: cudaSetDevice(9999): " + SetDeviceError(kAbsent))
      << call;
}

// Every entry point that takes a device answers the same when it cannot be made current:
// the watchdog's and the summary writer's create said INTERNAL (13) where the step counters'
// calls said FAILED_PRECONDITION, the writer's with `cudaSetDevice(device): …` and no ordinal.
// Stand-in addresses: nothing reaches them before the device is made current.
TEST(EngineCapiDevice, ADeviceThatCannotBeMadeCurrentIsFailedPreconditionEverywhere) {
  constexpr uint64_t kSome = 0x1000;
  ExpectCannotMakeCurrent("preload", eps_engine_preload(kAbsent));
  ExpectCannotMakeCurrent("release_dense",
                          eps_engine_release_dense(kAbsent, kSome, 4, kSome, 1, 0));
  ExpectCannotMakeCurrent("clear_feedback", eps_engine_clear_feedback(kAbsent, kSome, 4, 0));
  EpsEngineWatchdog* dog = nullptr;
  ExpectCannotMakeCurrent("watchdog_create",
                          eps_engine_watchdog_create(kAbsent, kSome, 4, kSome, 1000, &dog));
  EXPECT_EQ(dog, nullptr);
  const EpsEngineModel model{2, 4, 2, 64, 16, 8, 8, 1, 1, 0, 1, 0};
  EpsSummaryWriter* writer = nullptr;
  ExpectCannotMakeCurrent("summary_writer_create",
                          eps_engine_summary_writer_create(&model, kAbsent, &writer));
  EXPECT_EQ(writer, nullptr);
}

// A feedback count whose bytes wrap a size_t (n * 4 past 2^64) is refused before any device
// is asked: it cleared a few bytes, or none, and answered 0. Stand-in addresses.
TEST(EngineCapiDevice, AFeedbackCountWhoseBytesWrapIsRefused) {
  constexpr uint64_t kSome = 0x1000;
  constexpr int64_t kWraps = (int64_t{1} << 62) + 1;  // * 4 = 2^64 + 4: 4 bytes
  ExpectRefused(eps_engine_clear_feedback(kAbsent, kSome, kWraps, 0),
                "floats are more bytes than an address space holds");
  ExpectRefused(eps_engine_watchdog_clear_feedback(nullptr, kSome, kWraps),
                "floats are more bytes than an address space holds");
}

// The queue is made for a writer, which needs a device.
TEST_F(EngineCapiTest, AQueueOnADeviceThatCannotBeMadeCurrentIsFailedPrecondition) {
  EpsSummaryWriter* writer = nullptr;
  ASSERT_EQ(eps_engine_summary_writer_create(&model_, 0, &writer), 0) << eps_engine_last_error();
  EpsSummaryQueue* queue = nullptr;
  ExpectCannotMakeCurrent("summary_queue_create",
                          eps_engine_summary_queue_create(writer, kAbsent, &queue));
  EXPECT_EQ(queue, nullptr);
  eps_engine_summary_writer_destroy(writer);
}

// A count past what one call takes (the writer's kernels count in int) is refused before a
// host array is sized by it: std::vector(n) of a huge n threw through the C ABI and ended
// the process. The arrays hold one element: nothing reads past it.
TEST_F(EngineCapiTest, ACountTooLargeForOneCallIsRefusedBeforeAnythingIsSizedByIt) {
  EpsSummaryWriter* writer = nullptr;
  ASSERT_EQ(eps_engine_summary_writer_create(&model_, 0, &writer), 0) << eps_engine_last_error();
  EpsSummaryQueue* queue = nullptr;
  ASSERT_EQ(eps_engine_summary_queue_create(writer, 0, &queue), 0) << eps_engine_last_error();
  const EpsKeyAppend one{};
  const EpsRecordRun run{};
  ExpectRefused(eps_engine_summary_append(writer, &one, INT64_MAX, EPS_ENGINE_FLOAT32, 0),
                "n=9223372036854775807 exceeds the 67108863 appends of one call");
  ExpectRefused(eps_engine_summary_append(writer, &one, 67108864, EPS_ENGINE_FLOAT32, 0),
                "n=67108864 exceeds");
  ExpectRefused(
      eps_engine_summary_queue_submit(queue, &one, INT64_MAX / 40, EPS_ENGINE_FLOAT32, 0, 1),
      "exceeds the 67108863 appends of one call");
  // The refused submit still raised the counter to its step: a stream waiting for step 1
  // goes on (it waited for ever when the refusal came before the queue's raise).
  ASSERT_EQ(eps_engine_summary_queue_wait(queue, 0, 1), 0) << eps_engine_last_error();
  bool done = false;
  for (int i = 0; i < 5000 && !done; ++i) {  // 5 s: the raise is queued on the same stream
    done = cudaStreamQuery(nullptr) == cudaSuccess;
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(done) << "a wait for the refused step's counter never ended";
  ExpectRefused(eps_engine_summary_reset(writer, &run, INT64_MAX, 0),
                "n=9223372036854775807 exceeds the 2147483647 runs of one call");
  ExpectRefused(eps_engine_summary_reset(writer, &run, int64_t{1} << 31, 0),
                "n=2147483648 exceeds");
  eps_engine_summary_queue_destroy(queue);
  eps_engine_summary_writer_destroy(writer);
}

}  // namespace
