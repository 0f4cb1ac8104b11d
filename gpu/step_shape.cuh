// What both kernels of the GPU pre-pass share (gpu/step.h): the step's shape,
// the row list, the report the host reads back, and the forced-group rule.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "core/feedback_entry.h"
#include "core/half.h"
#include "gpu/bounds.cuh"

namespace eps::gpu::kernels {

// The first error a kernel meets; the host turns it into a status. The coarse
// level's (gpu/coarse_select.cuh) name its table and pool.
enum ErrorCode : int {
  kOk = 0,
  kBadSlot = 1,
  kBadBlock = 2,
  kBadScore = 3,
  kBadQuery = 4,
  kBadCoarseSlot = 5,
  kBadCoarseScore = 6,
  // Not an input error: epsd's host released the step's wait for inputs_ready
  // (GpuSelector::Finish's timeout), so its queries are not the step's. Its lists
  // say "attend densely" and, the report failed, no feedback is consumed.
  kReleased = 7,
  // A scored query whose Σ q_j² reaches core kMaxQueryNorm2 (index: the
  // (layer, query head) as layer · q_heads + head).
  kQueryOverflow = 8
};
struct DeviceStatus {
  int code;
  int row, index, value;
};
// Step counters, summed with atomics. summary_records: with the coarse level
// only (its candidates decide which fine records are read; the host counts them
// without one).
struct DeviceStats {
  unsigned long long groups_visited, blocks_visited, visited_tokens, summary_records;
};
// What one step reports back: copied to the host in one transfer. The selector
// keeps two and alternates by step, so each step clears the other one for the
// next step instead of a memset before its kernels.
struct StepReport {
  DeviceStatus status;
  DeviceStats stats;
};
struct DeviceRow {
  int64_t table_row;
  int64_t context_tokens;
};

__device__ inline void Fail(DeviceStatus* status, int code, int row, int index, int value) {
  if (atomicCAS(&status->code, kOk, code) == kOk) {
    status->row = row;
    status->index = index;
    status->value = value;
  }
}

struct Shape {
  int layers, q_heads, kv_heads, d, m, record_words, block_size, group_blocks;
  RecordOffsets record;
  int64_t max_batch, max_seqs, max_groups, max_blocks, num_slots, num_physical_blocks;
  DType query_dtype;
  int lists;  // visit lists per (layer, row): 1 (union) or kv_heads (per KV head)
};

// KV blocks and groups of a row of `tokens`: by 32-bit unsigned divisions where
// the count allows (every row short of 2^31 tokens), else 64-bit ones, which
// nvcc emits with a range check and a call; every thread of a scoring block
// divides, and these divisions were 8 % of the fused kernel's instructions
// (ncu, 64 x 32k; docs/benchmarks/gpu-history-2026-11-26-sessions-8-11.md, tenth session).
__device__ inline int64_t BlocksOf(const Shape& s, int64_t tokens) {
  if (tokens >= 0 && tokens <= INT32_MAX) {
    return (static_cast<uint32_t>(tokens) + static_cast<uint32_t>(s.block_size) - 1u) /
           static_cast<uint32_t>(s.block_size);
  }
  return (tokens + s.block_size - 1) / s.block_size;
}
__device__ inline int GroupsOf(const Shape& s, int64_t tokens) {
  const int64_t nb = BlocksOf(s, tokens);
  if (nb <= INT32_MAX) {
    return static_cast<int>(
        (static_cast<uint32_t>(nb) + static_cast<uint32_t>(s.group_blocks) - 1u) /
        static_cast<uint32_t>(s.group_blocks));
  }
  return static_cast<int>((nb + s.group_blocks - 1) / s.group_blocks);
}

__device__ inline bool IsForced(int p, int n, int first_n, int last_n) {
  return p < first_n || p >= n - last_n || p == n - 1;
}

}  // namespace eps::gpu::kernels
