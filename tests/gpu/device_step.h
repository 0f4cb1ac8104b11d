// Runs the GPU pre-pass on the contents of a testing::StepBuffers: copies the
// pool, tables and queries to the device, selects, and brings the lists back.
// For tests that compare the device with core/ on the same inputs.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "core/testing/synthetic.h"
#include "gpu/cuda_check.h"
#include "gpu/step.h"
#include "gtest/gtest.h"
#include "tests/gpu/host_copy.h"

namespace eps::testing {

#define SKIP_WITHOUT_DEVICE() \
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device"

// A model of the given shape with every summary part and a phi seed drawn from
// `rng` (its first draw), for the tests that compare the device with core/.
inline ModelLayout RandomModel(int layers, int q_heads, int kv_heads, int d, int group_blocks,
                               int sketch_dim, std::mt19937_64& rng) {
  ModelLayout m;
  m.num_layers = layers;
  m.num_q_heads = q_heads;
  m.num_kv_heads = kv_heads;
  m.head_dim = d;
  m.group_blocks = group_blocks;
  m.sketch_dim = sketch_dim;
  m.phi_seed = rng();
  m.features = {.key_sum = true, .principal = true, .quest = true};
  return m;
}

struct DeviceStep {
  absl::Status status;
  std::vector<int32_t> visit_blocks;  // [layers, max_batch, lists, max_blocks]
  std::vector<int32_t> visit_count;   // [layers, max_batch, lists]
  StepStats stats;
  float prepass_us = 0;

  // The visit list of (layer, batch position, list), as core's VisitBlocks.
  std::vector<int32_t> List(int64_t max_batch, int lists, int64_t max_blocks, int layer,
                            int64_t pos, int list) const {
    const int64_t index = (int64_t{layer} * max_batch + pos) * lists + list;
    const auto begin = visit_blocks.begin() + index * max_blocks;
    return {begin, begin + std::max(0, visit_count[index])};
  }
};

template <typename T>
absl::Status CopyToDevice(gpu::DeviceBuffer<T>& device, const T* host, int64_t count) {
  RETURN_IF_CUDA_ALLOC(device, count);
  CUDA_RETURN_IF_ERROR(::eps::testing::CopyToDeviceNow(device.get(), host, count * sizeof(T)));
  return absl::OkStatus();
}

// The coarse level's host buffers (StepInputs.coarse_*), for SelectOnDevice.
struct CoarseHost {
  const std::vector<float>* pool = nullptr;  // [slots, layers, kv_heads, record_words]
  int64_t slots = 0;
  const std::vector<int32_t>* table = nullptr;  // [max_seqs, max_coarse_groups]
  int64_t max_coarse_groups = 0;
};

// Queries narrowed to 16 bits (StepInputs::query_dtype binary16 or bfloat16), for
// SelectOnDevice: the device reads these instead of the buffers' fp32 queries.
struct NarrowQueries {
  DType dtype;
  const std::vector<uint16_t>* values;  // [layers, max_batch, q_heads, d]
};

// `max_batch` must be the one `buffers` was built with; the queries are fp32
// unless `narrow` gives 16-bit ones.
// `coarse`: the coarse level's buffers go to the device too. The outputs start
// at `fill` (visit_blocks and visit_count). `feedback` (StepInputs::feedback, [layers,
// max_seqs, q_heads, max_groups]): goes to the device, and comes back after the step.
// `unsignalled`: the step is queued behind a step fence whose inputs_ready the
// engine never writes, and finished with that timeout (Finish releases the wait).
inline DeviceStep SelectOnDevice(gpu::GpuSelector& selector, StepBuffers& buffers,
                                 int64_t max_batch, std::span<const StepRow> rows,
                                 const SelectPolicy& policy, const CoarseHost* coarse = nullptr,
                                 int32_t fill = -1, std::vector<float>* feedback = nullptr,
                                 std::chrono::microseconds unsignalled = {},
                                 const NarrowQueries* narrow = nullptr) {
  const ModelLayout& m = buffers.model();
  const int lists = policy.granularity == Granularity::kPerKvHead ? m.num_kv_heads : 1;
  StepInputs in = buffers.Inputs(rows);
  DeviceStep result;
  gpu::DeviceBuffer<float> pool, queries, coarse_pool, feedback_device;
  gpu::DeviceBuffer<uint16_t> narrow_queries;
  gpu::DeviceBuffer<int32_t> groups, blocks, visit, count, coarse_table;
  StepBuffers& b = buffers;  // read only
  const int64_t query_count = int64_t{m.num_layers} * max_batch * m.num_q_heads * m.head_dim;
  const int64_t list_count = int64_t{m.num_layers} * max_batch * lists;
  std::vector<int32_t> initial(list_count * buffers.max_blocks(), fill);
  for (absl::Status s :
       {CopyToDevice(pool, b.pool().data(), static_cast<int64_t>(b.pool().size())),
        CopyToDevice(groups, b.group_table().data(), static_cast<int64_t>(b.group_table().size())),
        CopyToDevice(blocks, b.block_table().data(), static_cast<int64_t>(b.block_table().size())),
        narrow != nullptr
            ? CopyToDevice(narrow_queries, narrow->values->data(), query_count)
            : CopyToDevice(queries, static_cast<const float*>(in.queries), query_count),
        CopyToDevice(visit, initial.data(), list_count * buffers.max_blocks()),
        CopyToDevice(count, initial.data(), list_count)}) {
    if (!s.ok()) {
      result.status = s;
      return result;
    }
  }
  if (coarse != nullptr) {
    for (absl::Status s : {CopyToDevice(coarse_pool, coarse->pool->data(),
                                        static_cast<int64_t>(coarse->pool->size())),
                           CopyToDevice(coarse_table, coarse->table->data(),
                                        static_cast<int64_t>(coarse->table->size()))}) {
      if (!s.ok()) {
        result.status = s;
        return result;
      }
    }
    in.coarse_pool = coarse_pool.get();
    in.coarse_slots = coarse->slots;
    in.coarse_table = coarse_table.get();
    in.max_coarse_groups = coarse->max_coarse_groups;
  }
  if (feedback != nullptr) {
    result.status =
        CopyToDevice(feedback_device, feedback->data(), static_cast<int64_t>(feedback->size()));
    if (!result.status.ok()) return result;
    in.feedback = feedback_device.get();
  }
  in.summary_pool = pool.get();
  in.group_table = groups.get();
  in.block_table = blocks.get();
  in.queries = queries.get();
  if (narrow != nullptr) {
    in.queries = narrow_queries.get();
    in.query_dtype = narrow->dtype;
  }
  if (unsignalled.count() > 0) {
    const uint64_t zero[2] = {0, 0};  // inputs_ready, selection_done
    gpu::DeviceBuffer<uint64_t> counters;
    result.status = CopyToDevice(counters, zero, 2);
    if (result.status.ok()) {
      result.status = selector.Enqueue(in, policy, {visit.get(), count.get()},
                                       {counters.get(), counters.get() + 1, 1});
    }
    if (result.status.ok()) {
      result.status = selector.Finish(unsignalled, &result.stats, &result.prepass_us);
    }
  } else {
    result.status =
        selector.Select(in, policy, {visit.get(), count.get()}, &result.stats, &result.prepass_us);
  }
  result.visit_blocks.resize(list_count * buffers.max_blocks());
  result.visit_count.resize(list_count);
  EXPECT_EQ(cudaMemcpy(result.visit_blocks.data(), visit.get(),
                       result.visit_blocks.size() * sizeof(int32_t), cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(cudaMemcpy(result.visit_count.data(), count.get(),
                       result.visit_count.size() * sizeof(int32_t), cudaMemcpyDeviceToHost),
            cudaSuccess);
  if (feedback != nullptr) {
    EXPECT_EQ(cudaMemcpy(feedback->data(), feedback_device.get(), feedback->size() * sizeof(float),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  return result;
}

// A device copy of `host` (cudaMalloc'd; at least one element), and a host copy of
// `count` device elements: the GPU tests' plain uploads and downloads.
template <typename T>
T* Upload(const std::vector<T>& host) {
  T* device = nullptr;
  EXPECT_EQ(cudaMalloc(&device, std::max<size_t>(1, host.size()) * sizeof(T)), cudaSuccess);
  EXPECT_EQ(::eps::testing::CopyToDeviceNow(device, host.data(), host.size() * sizeof(T)),
            cudaSuccess);
  return device;
}

template <typename T>
std::vector<T> Download(const T* device, size_t count) {
  std::vector<T> host(count);
  EXPECT_EQ(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

}  // namespace eps::testing
