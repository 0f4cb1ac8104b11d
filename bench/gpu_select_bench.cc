// The GPU pre-pass for one decode step of a Llama-3-8B shape (32 layers, 32 q
// heads, 8 KV heads, d = 128, g = 8, m = 8, 160-byte records), timed with CUDA
// events, next to its floor: summary bytes ÷ the device's memory bandwidth.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "core/testing/synthetic.h"
#include "gpu/step.h"

int main() {
  if (!eps::gpu::DeviceAvailable()) {
    std::printf("no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  int clock_khz = 0, bus_bits = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, 0);
  cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0);
  const double peak_gbs = 2.0 * clock_khz * 1e3 * (bus_bits / 8) / 1e9;
  std::printf("device: %s, theoretical memory bandwidth %.0f GB/s\n", prop.name, peak_gbs);
  std::printf("%6s %8s %12s %12s %12s %10s %10s %9s %9s\n", "batch", "context", "summary MB",
              "jl p50 us", "floor us", "GB/s", "visited%", "fro us", "off us");
  eps::ModelLayout m;
  m.num_layers = 32;
  m.num_q_heads = 32;
  m.num_kv_heads = 8;
  m.head_dim = 128;
  m.features = {.key_sum = false, .principal = false, .quest = false};
  for (int batch : {1, 8, 32}) {
    for (int64_t context : {8192, 32768, 131072}) {
      eps::testing::StepBuffers buffers(m, batch, context, batch, eps::Granularity::kUnion);
      std::vector<eps::StepRow> rows;
      for (int b = 0; b < batch; ++b) {
        buffers.AssignRow(b, context, b);
        rows.push_back({.table_row = b, .context_tokens = context, .seq_id = 0});
      }
      buffers.FillRandomSummaries(1);
      eps::StepInputs in = buffers.Inputs(rows);
      auto upload = [](const auto& v) {
        void* d = nullptr;
        cudaMalloc(&d, v.size() * sizeof(v[0]));
        cudaMemcpy(d, v.data(), v.size() * sizeof(v[0]), cudaMemcpyHostToDevice);
        return d;
      };
      const size_t qcount = size_t{32} * batch * 32 * 128;
      std::vector<float> q(static_cast<const float*>(in.queries), static_cast<const float*>(in.queries) + qcount);
      void* pool = upload(buffers.pool());
      void* groups = upload(buffers.group_table());
      void* blocks = upload(buffers.block_table());
      void* queries = upload(q);
      void *visit = nullptr, *count = nullptr;
      cudaMalloc(&visit, size_t{32} * batch * buffers.max_blocks() * 4);
      cudaMalloc(&count, size_t{32} * batch * 4);
      in.summary_pool = static_cast<const float*>(pool);
      in.group_table = static_cast<const int32_t*>(groups);
      in.block_table = static_cast<const int32_t*>(blocks);
      in.queries = queries;
      auto selector = eps::gpu::GpuSelector::Create(m, 0, batch, buffers.max_groups());
      // jl is the product; off (no scoring) and fro (one word read per record)
      // split the time into its parts by subtraction.
      float p50_by_method[3] = {0, 0, 0};
      eps::StepStats stats;
      const eps::Method methods[3] = {eps::Method::kJl, eps::Method::kFro, eps::Method::kOff};
      for (int k = 0; k < 3; ++k) {
        eps::SelectPolicy policy;
        policy.method = methods[k];
        std::vector<float> times;
        eps::StepStats method_stats;
        for (int i = 0; i < 60; ++i) {
          float us = 0;
          const absl::Status s = (*selector)->Select(in, policy, {static_cast<int32_t*>(visit), static_cast<int32_t*>(count)}, &method_stats, &us);
          if (!s.ok()) {
            std::printf("error: %s\n", s.ToString().c_str());
            return 1;
          }
          if (i >= 10) times.push_back(us);  // warm-up excluded
        }
        std::sort(times.begin(), times.end());
        p50_by_method[k] = times[times.size() / 2];
        if (k == 0) stats = method_stats;
      }
      const double mb = stats.summary_bytes_read / 1e6;
      const double p50 = p50_by_method[0];
      std::printf("%6d %8lld %12.1f %12.1f %12.1f %10.0f %9.1f%% %9.1f %9.1f\n", batch, static_cast<long long>(context), mb,
                  p50, mb * 1e6 / (peak_gbs * 1e9) * 1e6, mb * 1e6 / (p50 * 1e-6) / 1e9,
                  100.0 * stats.groups_visited / stats.groups_total, p50_by_method[1], p50_by_method[2]);
      for (void* p : {pool, groups, blocks, queries, visit, count}) cudaFree(p);
    }
  }
  return 0;
}
