// The coarse level of the GPU pre-pass (coarse-to-fine selection; core/step.cc
// PageSelector::Select, docs/policy-selection.md "Coarse-to-fine"). A step with the level
// launches, between the query terms and the selection (gpu/step_launch.cuh):
//
//   1. ScoreKernel over the coarse records (its `coarse` pass: the coarse pool
//      and table, a Shape whose groups are coarse groups) into the coarse scores;
//   2. CandidateKernel (here): per (row, layer, list), the list's candidate
//      coarse groups, the forced ones (a coarse group holding a forced group)
//      and every scored head's threshold cut (core MarkByThreshold, α = 1,
//      top_pages = core CoarseCandidates) over its coarse scores;
//   3. ScoreKernel over the fine records, reading the candidates: a group outside
//      them scores −∞ and its record is not read;
//   4. the selection as without the level, then visit &= candidate.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/step_shape.cuh"
#include "gpu/warp_select.cuh"

namespace eps::gpu::kernels {

// No padding: the launch's bytes are a key (step_launch.cuh).
struct CoarseArgs {
  const DeviceRow* rows;
  const uint8_t* scored;  // [layers, q_heads] or null (every head scored)
  const float* scores;    // coarse scores [max_batch, layers, q_heads, max_coarse_groups]
  uint8_t* candidates;    // [max_batch, layers, lists, max_coarse_groups]
  StepReport* report;
  int64_t max_coarse_groups;
  int64_t per_head;   // coarse groups each scored head names (core CoarseCandidates)
  int coarse_blocks;  // blocks per coarse group
  int ratio;          // groups per coarse group (core coarse_ratio, r)
};

// One block of kWarps warps per (layer * lists + list, row), under the fine
// level's Shape: a warp per head finds its cut (the per_head-th largest
// unforced coarse score by WarpKthLargest), then a thread per coarse group
// writes its flag. Adds the records the step reads for the list to
// report.stats.summary_records, as core/ counts them: for each KV head of the
// list with a scored head, every coarse record and the fine records of the
// candidate groups.
template <int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    CandidateKernel(Shape s, SelectRule rule, CoarseArgs a) {
  __shared__ float head_cut[256];  // visit when the coarse score >= cut; +∞ for unscored heads
  __shared__ unsigned histograms[kWarps][256];
  __shared__ unsigned long long fine_records;
  // A failed scoring writes no list (the selection kernel says so): nothing to name.
  if (a.report->status.code != kOk) return;
  const int layer = blockIdx.x / s.lists, list = blockIdx.x % s.lists, row = blockIdx.y;
  const int heads_per_list = s.q_heads / s.lists, first_head = list * heads_per_list;
  const int64_t tokens = a.rows[row].context_tokens;
  const int n = GroupsOf(s, tokens);
  const int64_t nb = BlocksOf(s, tokens);
  const int nc = static_cast<int>((nb + a.coarse_blocks - 1) / a.coarse_blocks);
  const int64_t head_base = (int64_t{row} * s.layers + layer) * s.q_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  auto head_scored = [&](int h) { return a.scored == nullptr || a.scored[layer * s.q_heads + h]; };
  // core MarkCoarseForced: coarse group c holds groups [c·r, min(n, (c+1)·r)), of
  // which the forced are those below first_n, from n − last_n on, and n − 1.
  auto forced = [&](int c) {
    const int low = c * a.ratio, high = min(n, (c + 1) * a.ratio) - 1;
    return low < rule.first_n || high >= n - rule.last_n || high == n - 1;
  };
  if (threadIdx.x == 0) fine_records = 0;

  for (int h = first_head + warp; h < first_head + heads_per_list; h += kWarps) {
    float cut = INFINITY;
    if (head_scored(h)) {
      // core MarkByThreshold with α = 1: T = the per_head-th largest unforced
      // coarse score; every unforced coarse group with score >= T (all of them
      // when there are at most per_head).
      cut = WarpKthOpenValue(
          a.scores + (head_base + h) * a.max_coarse_groups, nc, static_cast<unsigned>(a.per_head),
          [&](int c) { return !forced(c); }, histograms[warp], lane);
    }
    if (lane == 0) head_cut[h - first_head] = cut;
  }
  __syncthreads();

  uint8_t* out =
      a.candidates + ((int64_t{row} * s.layers + layer) * s.lists + list) * a.max_coarse_groups;
  unsigned fine = 0;  // groups inside this thread's candidates
  for (int c = threadIdx.x; c < nc; c += blockDim.x) {
    bool take = forced(c);
    const float* column = a.scores + (head_base + first_head) * a.max_coarse_groups + c;
    for (int i = 0; i < heads_per_list && !take; ++i, column += a.max_coarse_groups) {
      take = head_scored(first_head + i) && *column >= head_cut[i];
    }
    out[c] = take;
    if (take) fine += static_cast<unsigned>(min(n, (c + 1) * a.ratio) - c * a.ratio);
  }
  fine = __reduce_add_sync(0xFFFFFFFFu, fine);
  if (lane == 0 && fine > 0) atomicAdd(&fine_records, static_cast<unsigned long long>(fine));
  __syncthreads();
  if (threadIdx.x == 0) {
    // The KV heads of the list with a scored head each read nc coarse records and
    // the candidates' fine ones.
    const int ratio = s.q_heads / s.kv_heads;
    unsigned long long kv_heads_scored = 0;
    for (int kvh = first_head / ratio; kvh < (first_head + heads_per_list) / ratio; ++kvh) {
      bool any = false;
      for (int h = kvh * ratio; h < (kvh + 1) * ratio && !any; ++h) any = head_scored(h);
      kv_heads_scored += any;
    }
    if (kv_heads_scored > 0) {
      atomicAdd(&a.report->stats.summary_records, kv_heads_scored * (nc + fine_records));
    }
  }
}

}  // namespace eps::gpu::kernels
