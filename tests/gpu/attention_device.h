// The attention tests' device side: device copies of a host AttentionCase
// (attention_case.h), run through eps_attn_paged_decode, outputs read back.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "gpu/attention/paged_attention.h"
#include "tests/gpu/attention_case.h"

namespace eps::attention::testing {

inline bool HaveDevice() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

template <typename T>
struct DeviceArray {
  T* ptr = nullptr;
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) {
    EXPECT_EQ(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  explicit DeviceArray(size_t n) {
    EXPECT_EQ(cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
  }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  std::vector<T> Read(size_t n) const {
    std::vector<T> host(n);
    EXPECT_EQ(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
};

struct GpuResult {
  int32_t code = EPS_ATTN_OK;       // of the launch
  int32_t list_code = EPS_ATTN_OK;  // of eps_attn_read_error
  std::string message;
  std::vector<uint16_t> out;
  std::vector<float> lse;
  std::vector<float> feedback;  // with c.feedback_group_blocks: the buffer after the call
};

// Runs the case on the device: the same params with every pointer moved there.
inline GpuResult RunOnDevice(const AttentionCase& c) {
  DeviceArray<uint16_t> q(c.q), kv(c.kv), out(c.OutElements());
  DeviceArray<int32_t> lists(c.lists), lengths(c.lengths), table(c.table), context(c.context);
  DeviceArray<float> lse(c.LseElements());
  DeviceArray<int32_t> error_word(std::vector<int32_t>(EPS_ATTN_ERROR_WORDS, 0));
  DeviceArray<int32_t> positions(c.positions), feedback_rows(c.feedback_rows);
  DeviceArray<float> feedback(c.feedback);
  // Poison the outputs: a kernel that skips a write leaves NaN behind.
  EXPECT_EQ(cudaMemset(out.ptr, 0xff, c.OutElements() * 2), cudaSuccess);
  EXPECT_EQ(cudaMemset(lse.ptr, 0xff, c.LseElements() * 4), cudaSuccess);
  EpsAttnParams p = c.params;
  p.q = q.ptr;
  p.k_cache = kv.ptr;
  p.v_cache = kv.ptr + c.kv.size() / 2;
  p.lists = lists.ptr;
  p.lengths = lengths.ptr;
  p.dense_table = table.ptr;
  p.context_lens = context.ptr;
  p.out = out.ptr;
  p.lse = lse.ptr;
  p.error_word = error_word.ptr;
  if (c.feedback_group_blocks > 0) {
    p.feedback = feedback.ptr;
    p.block_positions = positions.ptr;
    p.feedback_rows = feedback_rows.ptr;
  }
  GpuResult r;
  uint64_t bytes = 0;
  r.code = eps_attn_workspace_bytes(&p, &bytes);
  if (r.code != EPS_ATTN_OK) {
    r.message = eps_attn_last_error();
    return r;
  }
  DeviceArray<uint8_t> workspace(bytes);
  p.workspace = bytes ? workspace.ptr : nullptr;
  p.workspace_bytes = bytes;
  r.code = eps_attn_paged_decode(&p, nullptr);
  if (r.code != EPS_ATTN_OK) {
    r.message = eps_attn_last_error();
    return r;
  }
  r.list_code = eps_attn_read_error(error_word.ptr, nullptr, 1);
  r.message = eps_attn_last_error();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  r.out = out.Read(c.OutElements());
  r.lse = lse.Read(c.LseElements());
  if (c.feedback_group_blocks > 0) r.feedback = feedback.Read(c.feedback.size());
  return r;
}

}  // namespace eps::attention::testing

#define SKIP_WITHOUT_DEVICE() \
  if (!::eps::attention::testing::HaveDevice()) GTEST_SKIP() << "no CUDA device"

#define CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call
