// epsd --backend=auto on a GPU it sees but cannot use (a build without code for the GPU's
// architecture, a driver too old): the warm-up's failure takes CUDA out of service and epsd
// serves the cpu backend, refusing a cuda Attach FAILED_PRECONDITION with the reason, instead
// of exiting (an engine that waits for its sidecar would never start). --backend=cuda still
// ends epsd. DisableCuda is for the whole process, so each case runs in a child (EXPECT_EXIT).
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "service/cuda_backend.h"
#include "service/epsd_main.h"
#include "service/session_service.h"
#include "tests/core/test_util.h"
#include "tests/service/test_engine.h"

namespace eps::service {
namespace {

const std::function<absl::Status()> kFailingWarmUp = [] {
  return absl::InternalError("device 0: no kernel image is available for execution on the device");
};

TEST(CudaFallbackDeathTest, AFailedWarmUpUnderAutoServesTheCpuBackendAndRefusesCudaAttaches) {
  // Without CUDA a cuda Attach is refused for that reason (no_cuda_backend.cc): no warm-up.
  if (!CudaBackendBuilt()) GTEST_SKIP() << "built without CUDA";
  EXPECT_EXIT(
      {
        const absl::StatusOr<std::string> line = PrepareCuda(BackendKind::kAuto, kFailingWarmUp);
        if (!line.ok() || line->find("serves the cpu backend only") == std::string::npos ||
            line->find("no kernel image") == std::string::npos) {
          std::fprintf(stderr, "line: %s\n", line.ok() ? line->c_str() : "error");
          std::exit(1);
        }
        if (CudaDevicePresent()) std::exit(2);
        // A cuda Attach is refused with the reason; a cpu one is served.
        const eps::testing::TestEngine engine(eps::testing::SmallServiceModel(), /*max_seqs=*/2,
                                              /*max_context=*/512, /*max_batch=*/2,
                                              eps::testing::TestSeed());
        ServerConfig config;
        SessionService service(config);
        v1::AttachRequest cuda = engine.Attach("engine-cuda");
        cuda.set_backend(v1::BACKEND_CUDA);
        v1::AttachResponse response;
        const absl::Status refused = service.Attach(cuda, &response);
        if (refused.code() != absl::StatusCode::kFailedPrecondition ||
            refused.message().find("the CUDA warm-up failed at start") == std::string::npos) {
          std::fprintf(stderr, "cuda attach: %s\n", refused.ToString().c_str());
          std::exit(3);
        }
        const absl::Status served = service.Attach(engine.Attach("engine-cpu"), &response);
        if (!served.ok()) {
          std::fprintf(stderr, "cpu attach: %s\n", served.ToString().c_str());
          std::exit(4);
        }
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(CudaFallbackDeathTest, AFailedWarmUpUnderBackendCudaIsAnError) {
  EXPECT_EXIT(
      {
        const absl::StatusOr<std::string> line = PrepareCuda(BackendKind::kCuda, kFailingWarmUp);
        std::exit(!line.ok() && line.status().message().find("no kernel image") != std::string::npos
                      ? 0
                      : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(CudaFallbackTest, AWarmUpThatSucceedsReportsTheDevicesReady) {
  const absl::StatusOr<std::string> line =
      PrepareCuda(BackendKind::kAuto, [] { return absl::OkStatus(); });
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_EQ(line->rfind("CUDA ready on ", 0), 0u) << *line;
}

}  // namespace
}  // namespace eps::service
