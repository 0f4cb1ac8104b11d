// A StepBuffers' inputs kept on the device across many steps, and the device
// lists they fill: for GPU tests that run a session's steps over the same
// buffers (tests/gpu/fused_select_test.cc, cooperative_step_test.cc).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <iterator>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "core/status.h"
#include "core/testing/synthetic.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "gtest/gtest.h"
#include "tests/gpu/device_step.h"

namespace eps::testing {

// A StepBuffers' inputs on the device, and room for per-KV-head lists, for
// tests that run many steps over the same buffers.
struct DeviceSession {
  gpu::DeviceBuffer<float> pool, queries;
  gpu::DeviceBuffer<int32_t> groups, blocks;
  std::vector<int32_t> host_groups;
  int64_t query_count = 0, list_count = 0, max_blocks = 0;

  absl::Status Upload(StepBuffers& b, int64_t max_batch) {
    const ModelLayout& m = b.model();
    query_count = int64_t{m.num_layers} * max_batch * m.num_q_heads * m.head_dim;
    list_count = int64_t{m.num_layers} * max_batch * m.num_kv_heads;
    max_blocks = b.max_blocks();
    host_groups = b.group_table();
    RETURN_IF_ERROR(CopyToDevice(pool, b.pool().data(), std::ssize(b.pool())));
    RETURN_IF_ERROR(CopyToDevice(groups, host_groups.data(), std::ssize(host_groups)));
    RETURN_IF_ERROR(
        CopyToDevice(blocks, b.block_table().data(), std::ssize(b.block_table())));
    const StepRow none[1] = {};
    return CopyToDevice(queries, static_cast<const float*>(b.Inputs(none).queries),
                                 query_count);
  }
  StepInputs Inputs(StepBuffers& b, std::span<const StepRow> rows) const {
    StepInputs in = b.Inputs(rows);
    in.summary_pool = pool.get();
    in.group_table = groups.get();
    in.block_table = blocks.get();
    in.queries = queries.get();
    return in;
  }
};

// Lists on the device: [layers, max_batch, lists, max_blocks] and counts.
struct DeviceLists {
  gpu::DeviceBuffer<int32_t> visit, count;
  int64_t lists = 0, blocks = 0;

  absl::Status Allocate(const DeviceSession& d) {
    lists = d.list_count;
    blocks = d.list_count * d.max_blocks;
    RETURN_IF_CUDA_ALLOC(visit, blocks);
    RETURN_IF_CUDA_ALLOC(count, lists);
    return Fill(-1);
  }
  absl::Status Fill(int32_t value) {
    const std::vector<int32_t> host(blocks, value);
    CUDA_RETURN_IF_ERROR(
        cudaMemcpy(visit.get(), host.data(), blocks * sizeof(int32_t), cudaMemcpyHostToDevice));
    CUDA_RETURN_IF_ERROR(
        cudaMemcpy(count.get(), host.data(), lists * sizeof(int32_t), cudaMemcpyHostToDevice));
    return absl::OkStatus();
  }
  StepOutputs outputs() const { return {visit.get(), count.get()}; }
  std::vector<int32_t> Counts() const { return Download(count.get(), lists); }
  std::vector<int32_t> Blocks() const { return Download(visit.get(), blocks); }
  static std::vector<int32_t> Download(const int32_t* device, int64_t n) {
    std::vector<int32_t> host(n);
    EXPECT_EQ(cudaMemcpy(host.data(), device, n * sizeof(int32_t), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }
};

}  // namespace eps::testing
