// libeps_engine's C ABI and the caller's thread (docs/api-memory.md §3.8): no CUDA error
// left pending or taken, the caller's current device kept, and no context made on a GPU the
// caller never chose. Skips without a device (some cases without two).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <thread>

#include "client/cpp/engine_capi.h"
#include "gtest/gtest.h"
#include "tests/client/engine_capi_fixture.h"
#include "tests/gpu/pending_error.h"

namespace {

using eps::capi_testing::Addr;
using eps::capi_testing::EngineCapiTest;

// A failed call leaves no CUDA error of its own pending on the caller's thread, and the
// caller's current device as it was. Two views of "pending": the thread's last error as this
// binary's CUDA runtime reads it (the engine's PyTorch checks its launches with it; this
// sees the library's error only where the library shares the caller's runtime, as a build
// against the shared cudart does), and as the library's own static runtime holds it
// (eps_engine_peek_cuda_error: the view that fails where a failed call leaves its error);
// then the next call of the library on the thread still succeeds.
// One device suffices: device 0 is made current, and a call on a device past the last must
// leave it so (with two devices, EveryEntryPointLeavesTheCallersCurrentDevice sees a change).
TEST_F(EngineCapiTest, AFailedCallLeavesNoErrorPendingAndTheCallersDevice) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  const int32_t absent = count;  // no such device: cudaSetDevice fails, not stickily
  int32_t* counts = Alloc<int32_t>(4);
  uint64_t* flags = Alloc<uint64_t>(2);
  float* feedback = Alloc<float>(4);
  float* pool = Alloc<float>(RecordWords());
  EpsSummaryWriter* next = nullptr;  // the next call's: a reset launches a kernel
  ASSERT_EQ(eps_engine_summary_writer_create(&model_, 0, &next), 0) << eps_engine_last_error();
  const EpsRecordRun run{Addr(pool), 1};
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  auto expect_clean = [&](const char* call, int rc) {
    EXPECT_NE(rc, 0) << call;
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << call << " left an error pending";
    EXPECT_EQ(eps_engine_peek_cuda_error(), 0)
        << call << " left an error pending in the library's own runtime";
    int current = -1;
    ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
    EXPECT_EQ(current, 0) << call << " left device " << current << " current";
    EXPECT_EQ(eps_engine_summary_reset(next, &run, 1, 0), 0)
        << "the call after " << call << ": " << eps_engine_last_error();
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  };
  expect_clean("preload", eps_engine_preload(absent));
  expect_clean("release_dense",
               eps_engine_release_dense(absent, Addr(counts), 4, Addr(flags), 1, 0));
  expect_clean("clear_feedback", eps_engine_clear_feedback(absent, Addr(feedback), 4, 0));
  EpsEngineWatchdog* dog = nullptr;
  expect_clean("watchdog_create",
               eps_engine_watchdog_create(absent, Addr(counts), 4, Addr(flags), 1000, &dog));
  EXPECT_EQ(dog, nullptr);
  EpsSummaryWriter* writer = nullptr;
  expect_clean("summary_writer_create", eps_engine_summary_writer_create(&model_, absent, &writer));
  EXPECT_EQ(writer, nullptr);
  expect_clean("release_dense (misaligned)",
               eps_engine_release_dense(0, Addr(counts), 4, Addr(flags) + 4, 1, 0));
  eps_engine_summary_writer_destroy(next);
}

// An error the caller left pending is not reported by the entry points that launch kernels
// (they checked their `<<<>>>` launches with cudaGetLastError, which returned it). The
// caller's error reaches the library only where the two share a CUDA runtime (above);
// gpu_summary_test and engine_outputs_test check the same in one runtime whatever the build.
TEST_F(EngineCapiTest, ACallersPendingErrorIsNotReportedAsTheLibrarys) {
  const int words = RecordWords(), d = model_.head_dim;
  float* pool = Alloc<float>(words + d);
  ASSERT_EQ(cudaMemset(pool, 0, sizeof(float) * (words + d)), cudaSuccess);
  int32_t* counts = Alloc<int32_t>(4);
  uint64_t* flags = Alloc<uint64_t>(2);
  ASSERT_NO_FATAL_FAILURE(eps::testing::LeaveErrorPending());
  EpsSummaryWriter* writer = nullptr;
  ASSERT_EQ(eps_engine_summary_writer_create(&model_, 0, &writer), 0) << eps_engine_last_error();
  (void)cudaGetLastError();
  const EpsRecordRun run{Addr(pool), 1};
  ASSERT_NO_FATAL_FAILURE(eps::testing::LeaveErrorPending());
  EXPECT_EQ(eps_engine_summary_reset(writer, &run, 1, 0), 0) << eps_engine_last_error();
  (void)cudaGetLastError();
  const EpsKeyAppend append{Addr(pool), Addr(pool + words), 1, 0, 0, 0};
  ASSERT_NO_FATAL_FAILURE(eps::testing::LeaveErrorPending());
  EXPECT_EQ(eps_engine_summary_append(writer, &append, 1, EPS_ENGINE_FLOAT32, 0), 0)
      << eps_engine_last_error();
  (void)cudaGetLastError();
  ASSERT_NO_FATAL_FAILURE(eps::testing::LeaveErrorPending());
  EXPECT_EQ(eps_engine_release_dense(0, Addr(counts), 4, Addr(flags), 1, 0), 0)
      << eps_engine_last_error();
  (void)cudaGetLastError();
  ExpectReleasedDensely(counts, 4, flags, 1);
  eps_engine_summary_writer_destroy(writer);
}

TEST_F(EngineCapiTest, EveryEntryPointLeavesTheCallersCurrentDevice) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  if (count < 2) GTEST_SKIP() << "needs two devices to see the current device change";
  int32_t* counts = Alloc<int32_t>(4);
  uint64_t* flags = Alloc<uint64_t>(2);
  ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  auto expect_device_1 = [](const char* call) {
    int current = -1;
    ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
    EXPECT_EQ(current, 1) << call << " left device " << current << " current";
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
  };
  ASSERT_EQ(eps_engine_release_dense(0, Addr(counts), 4, Addr(flags), 1, 0), 0)
      << eps_engine_last_error();
  expect_device_1("release_dense");
  // Every other entry point on a device-0 handle, too.
  ASSERT_EQ(eps_engine_preload(0), 0) << eps_engine_last_error();
  expect_device_1("preload");
  EpsEngineWatchdog* watchdog = nullptr;
  ASSERT_EQ(eps_engine_watchdog_create(0, Addr(counts), 4, Addr(flags), 1000000, &watchdog), 0)
      << eps_engine_last_error();
  expect_device_1("watchdog_create");
  eps_engine_watchdog_destroy(watchdog);
  expect_device_1("watchdog_destroy");
  EpsSummaryWriter* writer = nullptr;
  ASSERT_EQ(eps_engine_summary_writer_create(&model_, 0, &writer), 0) << eps_engine_last_error();
  expect_device_1("summary_writer_create");
  EpsSummaryQueue* queue = nullptr;
  ASSERT_EQ(eps_engine_summary_queue_create(writer, 0, &queue), 0) << eps_engine_last_error();
  expect_device_1("summary_queue_create");
  ASSERT_EQ(eps_engine_summary_queue_drain(queue), 0) << eps_engine_last_error();
  expect_device_1("summary_queue_drain");
  char errors[64] = {};
  EXPECT_EQ(eps_engine_summary_queue_errors(queue, errors, sizeof errors), 0u) << errors;
  expect_device_1("summary_queue_errors");
  eps_engine_summary_queue_destroy(queue);
  expect_device_1("summary_queue_destroy");
  eps_engine_summary_writer_destroy(writer);
  expect_device_1("summary_writer_destroy");
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
}

// A thread that never chose a device reads as device 0; a call on GPU 1 from it must not
// make GPU 0 current at its end, which would create GPU 0's context in a process that never
// used GPU 0. In a fresh process (a death test, re-executed), where nothing made one yet.
TEST(EngineCapiFreshThreadDeathTest, ACallOnGpuOneFromAFreshThreadMakesNoContextOnGpuZero) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count < 2) {
    (void)cudaGetLastError();
    GTEST_SKIP() << count << " CUDA device(s): needs 2";
  }
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // The driver's own answer, asked here (not through the library under test).
  const auto gpu0_context = [] {
    using GetState = int (*)(int, unsigned int*, int*);
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    unsigned int flags = 0;
    int active = 0;
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess ||
        reinterpret_cast<GetState>(f)(0, &flags, &active) != 0) {
      std::_Exit(3);  // unknown
    }
    return active != 0;
  };
  EXPECT_EXIT(
      {
        if (gpu0_context()) std::_Exit(2);  // nothing to check
        std::thread([] { (void)eps_engine_preload(1); }).join();
        std::_Exit(gpu0_context() ? 1 : 0);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
