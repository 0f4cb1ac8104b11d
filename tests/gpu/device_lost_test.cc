// A CUDA error that loses the context (gpu/cuda_check.h ContextLost) comes out of the
// GPU selector marked device-lost (core/status.h), so that epsd stops serving and
// restarts (service/session_service.h); an ordinary CUDA error does not.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
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
