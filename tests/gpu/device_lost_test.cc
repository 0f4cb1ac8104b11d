// A CUDA error that loses the context (gpu/cuda_check.h ContextLost) comes out of the
// GPU selector marked device-lost (core/status.h), so that epsd stops serving and
// restarts (service/session_service.h); an ordinary CUDA error does not, and a device that
// cannot be made current is FAILED_PRECONDITION naming its ordinal.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/testing/synthetic.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "gpu/ipc_mapping.h"
#include "gpu/step.h"
#include "gtest/gtest.h"
#include "tests/core/step_fixture.h"
#include "tests/gpu/device_step.h"

namespace eps {
namespace testing {
void LaunchTrapKernel();  // trap_kernel.cu
}  // namespace testing
namespace {

TEST(CudaStatusTest, ErrorsThatLoseTheContextAreMarkedAndOthersAreNot) {
  for (cudaError_t lost : {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorAssert,
                           cudaErrorIllegalInstruction, cudaErrorMisalignedAddress,
                           cudaErrorECCUncorrectable, cudaErrorContained}) {
    const absl::Status s = gpu::CudaStatus("cudaStreamQuery", lost);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_TRUE(IsDeviceLost(s)) << s;
    EXPECT_NE(s.message().find("cudaStreamQuery: "), std::string_view::npos) << s;
  }
  for (cudaError_t ordinary : {cudaErrorMemoryAllocation, cudaErrorInvalidValue, cudaErrorNotReady,
                               cudaErrorInvalidDevice}) {
    const absl::Status s = gpu::CudaStatus("cudaMalloc", ordinary);
    EXPECT_FALSE(s.ok());
    EXPECT_FALSE(IsDeviceLost(s)) << s;
  }
  EXPECT_FALSE(IsDeviceLost(absl::OkStatus()));
  EXPECT_TRUE(MarkDeviceLost(absl::OkStatus()).ok());  // nothing to mark
}

// No process has a device of ordinal 9999: cudaSetDevice fails for it on a GPU machine
// (invalid device ordinal) as on one without a driver or a device, with an error that leaves
// the context usable. Every call of epsd's that makes a device current answers it as the
// engine library's calls do (gpu::SetDevice): FAILED_PRECONDITION naming the ordinal and
// CUDA's error; they said INTERNAL `cudaSetDevice(device): …`, without the ordinal. The
// failed call's error is not left on the thread. Runs with or without a device.
TEST(CudaStatusTest, ADeviceThatCannotBeMadeCurrentIsFailedPreconditionNamingTheOrdinal) {
  constexpr int kAbsent = 9999;
  const cudaError_t err = cudaSetDevice(kAbsent);
  ASSERT_NE(err, cudaSuccess);
  ASSERT_FALSE(gpu::ContextLost(err)) << cudaGetErrorString(err);
  (void)cudaGetLastError();
  // What the thread's last error reads with nothing left on it: cudaSuccess where a driver
  // is installed; without one every call, cudaGetLastError too, returns the missing
  // driver's error, so there the check below can only pass (a GPU machine runs it).
  const cudaError_t clear = cudaGetLastError();
  const std::string want = std::string("cudaSetDevice(9999): ") + cudaGetErrorString(err);
  const auto expect_named = [&](const char* call, const absl::Status& s) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << call << ": " << s;
    EXPECT_EQ(s.message(), want) << call;
    EXPECT_FALSE(IsDeviceLost(s)) << call;
    EXPECT_EQ(cudaGetLastError(), clear) << call << " left its error on the thread";
  };
  ModelLayout m;
  m.num_layers = 2;
  m.num_q_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 64;
  expect_named("WarmUp", gpu::GpuSelector::WarmUp(kAbsent));
  std::unique_ptr<gpu::GpuSelector> remains;
  expect_named("Create", gpu::GpuSelector::Create(m, kAbsent, 1, 64, {}, &remains).status());
  EXPECT_EQ(remains, nullptr) << "nothing was allocated";
  const uint64_t* const counter = nullptr;  // not read: the device is made current first
  expect_named("ReadCounter", gpu::ReadCounter(kAbsent, counter).status());
}

// The trap runs in a child process (gtest's threadsafe death test starts the binary
// anew, so the child has a fresh context to lose): the selector's next step fails
// with a status marked device-lost, and so does creating another selector.
TEST(DeviceLostDeathTest, AStepAfterTheContextIsLostFailsMarkedDeviceLost) {
  SKIP_WITHOUT_DEVICE();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto child = [] {
    ModelLayout m;
    m.num_layers = 2;
    m.num_q_heads = 4;
    m.num_kv_heads = 2;
    m.head_dim = 64;
    testing::StepBuffers buffers(m, 1, 4096, 1, Granularity::kUnion);
    buffers.AssignRow(0, 4096, 1);
    buffers.FillRandomSummaries(2);
    auto selector = gpu::GpuSelector::Create(m, 0, 1, buffers.max_groups());
    if (!selector.ok()) std::exit(10);
    const StepRow rows[] = {{.table_row = 0, .context_tokens = 4096, .seq_id = 0}};
    // The step's buffers on the device, kept for the step after the trap.
    StepInputs in = buffers.Inputs(rows);
    const std::vector<float> queries(
        static_cast<const float*>(in.queries),
        static_cast<const float*>(in.queries) + m.num_layers * m.num_q_heads * m.head_dim);
    in.summary_pool = testing::Upload(buffers.pool());
    in.group_table = testing::Upload(buffers.group_table());
    in.block_table = testing::Upload(buffers.block_table());
    in.queries = testing::Upload(queries);
    const std::vector<int32_t> lists(m.num_layers * buffers.max_blocks(), -1);
    const StepOutputs out{testing::Upload(lists), testing::Upload(std::vector<int32_t>(2, -1))};
    StepStats stats;
    float us = 0;
    if (absl::Status s = (*selector)->Select(in, SelectPolicy{}, out, &stats, &us); !s.ok()) {
      std::fprintf(stderr, "the step before the trap: %s\n", s.ToString().c_str());
      std::exit(11);
    }
    testing::LaunchTrapKernel();
    const absl::Status trapped = gpu::CudaStatus("the trap", cudaDeviceSynchronize());
    if (!IsDeviceLost(trapped)) std::exit(12);
    const absl::Status after = (*selector)->Select(in, SelectPolicy{}, out, &stats, &us);
    if (!IsDeviceLost(after)) {
      std::fprintf(stderr, "the step after the trap: %s\n", after.ToString().c_str());
      std::exit(13);
    }
    auto another = gpu::GpuSelector::Create(m, 0, 1, buffers.max_groups());
    if (another.ok() || !IsDeviceLost(another.status())) std::exit(14);
    // An engine's handle (here, none that is valid) cannot be mapped either; the error
    // names the lost device, not the handle.
    auto mapping = gpu::IpcMapping::Open(std::string(sizeof(cudaIpcMemHandle_t), '\0'), 0);
    if (mapping.ok() || !IsDeviceLost(mapping.status())) std::exit(15);
    std::exit(0);
  };
  EXPECT_EXIT(child(), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace eps
