// The last stage of every selection on the GPU (gpu/select_kernel.cuh and
// gpu/fused_select.cuh): one list's visit flags become its blocks in
// visit_blocks and its count in visit_count, and the list's statistics are
// added to the step's report. One contract, so the two paths' lists and
// statistics are the same by construction.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/step_shape.cuh"

namespace eps::gpu::kernels {

// The row's block-table entries a thread writes in CompactVisitList (block t of
// the row for t = threadIdx.x + k·blockDim.x), loaded into registers before the
// compaction's scan and barriers so that their round trip to memory overlaps
// them, where the row has at most kHeld·blockDim.x blocks (`held`); otherwise
// the compaction reads the table itself. kHeld = 0: never held.
template <int kHeld>
struct HeldTableRow {
  int32_t id[kHeld > 0 ? kHeld : 1];
  bool held = false;
};

template <int kHeld>
__device__ __forceinline__ HeldTableRow<kHeld> LoadTableRow(const Shape& s, int n, int64_t tokens,
                                                            const int32_t* block_table,
                                                            int64_t table_row) {
  HeldTableRow<kHeld> r;
  if constexpr (kHeld > 0) {
    const int64_t row_blocks = min(int64_t{n} * s.group_blocks, BlocksOf(s, tokens));
    r.held = row_blocks <= int64_t{kHeld} * blockDim.x;
    if (r.held) {
      const int32_t* block_row = block_table + table_row * s.max_blocks;
#pragma unroll
      for (int k = 0; k < kHeld; ++k) {
        const int64_t t = threadIdx.x + int64_t{k} * blockDim.x;
        r.id[k] = t < row_blocks ? block_row[t] : 0;
      }
    }
  }
  return r;
}

// Every thread of the block calls it (blockDim.x a multiple of 32, at most
// 1024). Per-group output offsets by a block-wide scan over contiguous chunks, then a
// thread per block of the row writes those of visited groups, so block-table reads
// and visit-list writes are coalesced across the warp.
//
// visit [n] flags and offset [n] words in shared memory, counts [blockDim.x / 32]
// words in shared memory; list_out [max_blocks] and *count_out: the list's
// place in the outputs. The row's table row is read only after the scan, as a
// register held across it spills in the 1024-thread selection kernel.
// `table`: the row's entries if LoadTableRow held them.
template <int kHeld = 0>
__device__ __forceinline__ void CompactVisitList(const Shape& s, int n, int64_t tokens,
                                                 const unsigned char* visit, unsigned* offset,
                                                 unsigned* counts, const int32_t* block_table,
                                                 const DeviceRow* row, int32_t* list_out,
                                                 int32_t* count_out, DeviceStats* stats,
                                                 const HeldTableRow<kHeld>& table = {}) {
  const int64_t nb = BlocksOf(s, tokens);
  const int lane = threadIdx.x % 32;
  const int chunk = (n + blockDim.x - 1) / blockDim.x;
  const int begin = min(n, static_cast<int>(threadIdx.x) * chunk), end = min(n, begin + chunk);
  auto blocks_of = [&](int p) {
    return static_cast<unsigned>(min(nb, int64_t{p + 1} * s.group_blocks) -
                                 int64_t{p} * s.group_blocks);
  };
  unsigned mine = 0, groups = 0;
  for (int p = begin; p < end; ++p) {
    if (visit[p]) {
      mine += blocks_of(p);
      ++groups;
    }
  }
  // Inclusive scan of `mine`: within each warp by shuffles, then the warps'
  // totals (counts[warp]) by warp 0; two barriers.
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  unsigned inclusive = mine;
  for (int o = 1; o < 32; o *= 2) {
    const unsigned up = __shfl_up_sync(0xFFFFFFFFu, inclusive, o);
    if (lane >= o) inclusive += up;
  }
  if (lane == 31) counts[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    unsigned t = lane < warps ? counts[lane] : 0;
    for (int o = 1; o < 32; o *= 2) {
      const unsigned up = __shfl_up_sync(0xFFFFFFFFu, t, o);
      if (lane >= o) t += up;
    }
    if (lane < warps) counts[lane] = t;
  }
  __syncthreads();
  unsigned at = (warp > 0 ? counts[warp - 1] : 0) + inclusive - mine;
  for (int p = begin; p < end; ++p) {
    offset[p] = at;
    if (visit[p]) at += blocks_of(p);
  }
  __syncthreads();
  const unsigned total = counts[warps - 1];
  // A thread per block of the row (block t of group t / g) writes the visited
  // ones: reads of the table row and writes of the list are coalesced within runs
  // of visited groups, with one division a block instead of a binary search over
  // the offsets.
  const int g = s.group_blocks, row_blocks = static_cast<int>(min(int64_t{n} * g, nb));
  if (kHeld > 0 && table.held) {
#pragma unroll
    for (int k = 0; k < kHeld; ++k) {
      const int t = static_cast<int>(threadIdx.x) + k * static_cast<int>(blockDim.x);
      if (t >= row_blocks) break;
      const int p = t / g;
      if (visit[p]) list_out[offset[p] + (t - p * g)] = table.id[k];
    }
  } else {
    const int32_t* block_row = block_table + row->table_row * s.max_blocks;
#pragma unroll 1  // unrolled, it took the 8-warp selection kernels 6-16 registers more
    for (int t = static_cast<int>(threadIdx.x); t < row_blocks; t += static_cast<int>(blockDim.x)) {
      const int p = t / g;
      if (visit[p]) list_out[offset[p] + (t - p * g)] = block_row[t];
    }
  }
  // One atomic per warp: 262K same-address atomics per step cost hundreds of µs.
  const unsigned warp_groups = __reduce_add_sync(0xFFFFFFFFu, groups);
  if (lane == 0 && warp_groups > 0) atomicAdd(&stats->groups_visited, warp_groups);
  if (threadIdx.x == blockDim.x - 1) {
    *count_out = static_cast<int32_t>(total);
    atomicAdd(&stats->blocks_visited, total);
    const int64_t last = tokens - (tokens - 1) / s.block_size * s.block_size;
    atomicAdd(&stats->visited_tokens,
              static_cast<unsigned long long>(
                  total == 0 ? 0 : (int64_t{total} - 1) * s.block_size + last));
  }
}

}  // namespace eps::gpu::kernels
