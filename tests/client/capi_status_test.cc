// How libeps_engine's entry points report (client/cpp/capi_status.h): a code and the
// thread's last error, and no C++ exception across the C ABI. A huge n once sized a
// std::vector in eps_engine_summary_append, reset and queue_submit, whose bad_alloc or
// length_error went through the `extern "C"` frame and ended the engine's process.
// No device: the guard knows nothing of CUDA (engine_capi_errors_test drives the entry
// points themselves, on a GPU).
#include "client/cpp/capi_status.h"

#include <cstdint>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace eps::capi {
namespace {

std::string LastErrorText() { return LastError(); }

TEST(CapiStatusTest, AFailedAllocationIsResourceExhaustedNamingTheCall) {
  const int rc = Guarded("eps_engine_summary_reset", []() -> int { throw std::bad_alloc(); });
  EXPECT_EQ(rc, static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(LastErrorText(), "RESOURCE_EXHAUSTED: eps_engine_summary_reset: std::bad_alloc");
}

TEST(CapiStatusTest, AVectorOfAHugeCountIsCaughtNotThrownThroughTheAbi) {
  // What a caller's n did: past max_size(), the vector throws std::length_error.
  const int64_t n = INT64_MAX / 2;
  const int rc = Guarded("eps_engine_summary_append", [n] {
    const std::vector<double> huge(static_cast<size_t>(n));
    return static_cast<int>(huge.size() == 0);
  });
  // RESOURCE_EXHAUSTED, as for bad_alloc and as epsd's own call guard maps it: the sizes
  // asked for, not a bug of the library.
  EXPECT_EQ(rc, static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(LastErrorText().rfind("RESOURCE_EXHAUSTED: eps_engine_summary_append: ", 0), 0u)
      << LastErrorText();
}

TEST(CapiStatusTest, AnyOtherExceptionIsInternalWithItsText) {
  EXPECT_EQ(Guarded("eps_engine_preload", []() -> int { throw std::runtime_error("boom"); }),
            static_cast<int>(absl::StatusCode::kInternal));
  EXPECT_EQ(LastErrorText(), "INTERNAL: eps_engine_preload: boom");
  EXPECT_EQ(Guarded("eps_engine_preload", []() -> int { throw 7; }),
            static_cast<int>(absl::StatusCode::kInternal));
  EXPECT_EQ(LastErrorText(),
            "INTERNAL: eps_engine_preload: an exception that is no std::exception");
}

TEST(CapiStatusTest, ACountingCallThatThrowsReturnsZeroWithTheMessage) {
  EXPECT_EQ(GuardedCount("eps_engine_watchdog_releases",
                         []() -> uint64_t { throw std::logic_error("broken"); }),
            0u);
  EXPECT_EQ(LastErrorText(), "INTERNAL: eps_engine_watchdog_releases: broken");
}

TEST(CapiStatusTest, ABodyThatReturnsPassesItsResultAndLeavesTheMessage) {
  Refuse("eps_engine_wait_counter", "counter is null");
  EXPECT_EQ(Guarded("eps_engine_wait_counter", [] { return 0; }), 0);
  EXPECT_EQ(GuardedCount("eps_engine_summary_queue_errors", []() -> uint64_t { return 5; }), 5u);
  EXPECT_EQ(LastErrorText(), "INVALID_ARGUMENT: eps_engine_wait_counter: counter is null");
  EXPECT_EQ(Report(absl::OkStatus()), 0);
  EXPECT_EQ(Report(absl::FailedPreconditionError("cudaSetDevice(9999): invalid device ordinal")),
            static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(LastErrorText(), "FAILED_PRECONDITION: cudaSetDevice(9999): invalid device ordinal");
}

TEST(CapiStatusTest, TheLastErrorIsPerThread) {
  Refuse("eps_engine_wait_counter", "counter is null");
  std::string other;
  std::thread([&other] {
    Guarded("eps_engine_preload", []() -> int { throw std::bad_alloc(); });
    other = LastErrorText();
  }).join();
  EXPECT_EQ(other, "RESOURCE_EXHAUSTED: eps_engine_preload: std::bad_alloc");
  EXPECT_EQ(LastErrorText(), "INVALID_ARGUMENT: eps_engine_wait_counter: counter is null");
}

}  // namespace
}  // namespace eps::capi
