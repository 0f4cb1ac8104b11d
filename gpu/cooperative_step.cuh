// The whole threshold-budget step in one cooperative kernel (gpu/step.h): the
// query terms, the scoring, every head's cut and every list's compaction, as
// four phases of one persistent grid separated by grid-wide barriers, instead
// of three dependent kernels.
//
// Why: at small batches the three-kernel step spends most of its time between
// kernels (docs/benchmarks/gpu.md: at 1 x 32k `off`, which scores nothing,
// took 13 of the step's 27 us), and its selection runs one block per (row,
// layer, list): 32 blocks on 132 SMs at batch 1. Here each phase spreads its
// work over every resident block, and the cuts take a warp per (row, layer,
// query head) on every SM.
//
// Grid: as many blocks of kScoreThreads as are resident at once (the host asks
// the occupancy calculator), launched cooperatively so that they are. Each
// block walks the phases' work items in strides of the grid:
//   1. query terms, a warp per (row, layer, query head) (HeadTerms; the query
//      check);
//   2. scoring, a block per scoring-grid block (ScoreGroups with the block's
//      place passed in), scores to global memory as ScoreKernel writes them;
//   3. cuts, a warp per (row, layer, query head): core MarkByThreshold's cut
//      (WarpThresholdCut) into `cuts`; skipped when the step failed;
//   4. lists, a block per (row, layer, list): visit flags (forced, or some
//      head's score at or above its cut), then CompactVisitList, as
//      SelectKernel does; the released and failed steps as SelectKernel
//      treats them (nothing written, or -1 with a step fence).
// The same scores, cuts and compaction as the three kernels: the same lists and
// statistics. Launched directly, never captured: a graph of one kernel saves no
// launches.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/bounds.h"
#include "gpu/score_kernel.cuh"
#include "gpu/select_kernel.cuh"
#include "gpu/step_shape.cuh"
#include "gpu/terms_kernel.cuh"
#include "gpu/visit_compaction.cuh"
#include "gpu/warp_select.cuh"

namespace eps::gpu::kernels {

inline constexpr int kCooperativeWarps = kScoreThreads / 32;

struct CooperativeArgs {
  float* cuts;      // [max_batch, layers, q_heads]: each head's cut (phase 3)
  dim3 score_grid;  // the scoring grid ScoreKernel would be launched on
  unsigned pad;     // no padding: the launch's bytes are a key
};

// Dynamic shared memory (bytes): the largest phase's. Terms: q and z per warp;
// scoring: ScoreSharedWords; cuts: a histogram per warp; lists: the visit flags
// (padded to 16 bytes), offsets and the compaction's warp counts.
inline size_t CooperativeSharedBytes(size_t score_bytes, int d, int m, int64_t max_groups) {
  const size_t terms = sizeof(float) * kCooperativeWarps * (d + m);
  const size_t cuts = sizeof(unsigned) * kCooperativeWarps * 256;
  const size_t lists = static_cast<size_t>((max_groups + 15) / 16 * 16) +
                       sizeof(unsigned) * (static_cast<size_t>(max_groups) + kCooperativeWarps);
  size_t most = score_bytes;
  for (const size_t b : {terms, cuts, lists}) most = b > most ? b : most;
  return most;
}

template <Method kMethod, int kM, int kHeads, int kOctetD, bool kQuest8>
__global__ void __launch_bounds__(kScoreThreads,
                                  (kOctetD > 0 ? (kHeads <= 4 ? 2 : 1)
                                               : kScoreMinBlocks<kMethod, kM, false, kHeads>))
    CooperativeStepKernel(Shape s, TermsArgs t, ScoreArgs sc, SelectRule rule, SelectArgs a,
                          CooperativeArgs c) {
  namespace cg = cooperative_groups;
  extern __shared__ __align__(16) float shared[];
  // Nothing is held in registers across a barrier: each phase derives its
  // indices anew, so the scoring has every register it had in ScoreKernel.
  // (row, layer, query head) items, row-major, a warp each in phases 1 and 3.
  auto heads = [&] { return int64_t{c.score_grid.z} * s.layers * s.q_heads; };
  auto first_warp = [&] { return int64_t{blockIdx.x} * kCooperativeWarps + threadIdx.x / 32; };
  auto warps = [&] { return int64_t{gridDim.x} * kCooperativeWarps; };
  if (blockIdx.x == 0 && threadIdx.x == 0) *a.next_report = StepReport{};

  // 1. Query terms: ‖q‖ for every method, z zᵀ for jl (m known for 4, 8, 16).
  {
    constexpr int kTermsM = kMethod == Method::kJl ? kM : -1;
    const int lane = threadIdx.x % 32;
    float* q = shared + threadIdx.x / 32 * (s.d + s.m);
    for (int64_t i = first_warp(); i < heads(); i += warps()) {
      const int h = static_cast<int>(i % s.q_heads);
      const int layer = static_cast<int>(i / s.q_heads % s.layers);
      HeadTerms<kTermsM>(s, t, static_cast<int>(i / (int64_t{s.q_heads} * s.layers)), layer, h,
                         lane, q, q + s.d);
    }
  }
  cg::this_grid().sync();

  // 2. Scoring, one scoring-grid block at a time.
  {
    // 32-bit indices (the host bounds the grid's blocks below 2^31): fewer
    // registers held across the scoring than 64-bit ones.
    const dim3 g = c.score_grid;
    for (unsigned i = blockIdx.x; i < g.x * g.y * g.z; i += gridDim.x) {
      const dim3 at(i % g.x, i / g.x % g.y, i / (g.x * g.y));
      ScoreGroups<kMethod, kM, false, kHeads, false, kOctetD, kQuest8,
                  (kOctetD > 0 ? kOctetChunks : 1)>(s, sc, shared, nullptr, at);
      __syncthreads();  // the next block's scoring reuses the shared memory
    }
  }
  cg::this_grid().sync();

  // After the barrier every error of the step is in the report, and nothing
  // below fails it: every block reads the same status.
  const bool failed = *reinterpret_cast<const volatile int*>(&a.report->status.code) != kOk;

  // 3. Each scored head's cut (unscored heads admit nothing).
  if (!failed && !rule.method_off) {
    const int lane = threadIdx.x % 32;
    unsigned* histogram = reinterpret_cast<unsigned*>(shared) + threadIdx.x / 32 * 256;
    for (int64_t i = first_warp(); i < heads(); i += warps()) {
      const int h = static_cast<int>(i % s.q_heads);
      const int layer = static_cast<int>(i / s.q_heads % s.layers);
      const int row = static_cast<int>(i / (int64_t{s.q_heads} * s.layers));
      float cut = INFINITY;
      if (a.scored == nullptr || a.scored[layer * s.q_heads + h]) {
        const int n = GroupsOf(s, a.rows[row].context_tokens);
        cut = WarpThresholdCut(a.scores + i * s.max_groups, n, rule, histogram, lane);
      }
      if (lane == 0) c.cuts[i] = cut;
      __syncwarp();  // the next head's select clears the histogram
    }
  }
  cg::this_grid().sync();
  // The engine gave up on this step (its client released selection_done and
  // attends densely): leave its outputs alone. Read once per block, as each
  // SelectKernel block reads it.
  if (a.selection_done != nullptr &&
      *reinterpret_cast<const volatile uint64_t*>(a.selection_done) >= a.step) {
    return;
  }

  // 4. The lists: a block per (row, layer, list), as SelectKernel's steps 2 and 3.
  unsigned char* visit = reinterpret_cast<unsigned char*>(shared);
  unsigned* offset = reinterpret_cast<unsigned*>(visit + (s.max_groups + 15) / 16 * 16);
  unsigned* counts = offset + s.max_groups;  // [kCooperativeWarps]
  const int per_row = s.layers * s.lists, heads_per_list = s.q_heads / s.lists;
  for (int64_t i = blockIdx.x; i < int64_t{c.score_grid.z} * per_row; i += gridDim.x) {
    const int row = static_cast<int>(i / per_row);
    const int layer = static_cast<int>(i % per_row / s.lists), list = static_cast<int>(i % s.lists);
    const int64_t list_index = (int64_t{layer} * s.max_batch + row) * s.lists + list;
    if (failed) {  // with a fence the engine proceeds regardless: "attend densely"
      if (a.selection_done != nullptr && threadIdx.x == 0) a.visit_count[list_index] = -1;
      continue;
    }
    const int64_t tokens = a.rows[row].context_tokens;
    const int n = GroupsOf(s, tokens);
    const int64_t first = (int64_t{row} * s.layers + layer) * s.q_heads + list * heads_per_list;
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
      bool v = rule.method_off || IsForced(p, n, rule.first_n, rule.last_n);
      const float* column = a.scores + first * s.max_groups + p;
      for (int k = 0; k < heads_per_list && !v; ++k, column += s.max_groups) {
        v = *column >= c.cuts[first + k];
      }
      visit[p] = v;
    }
    __syncthreads();
    CompactVisitList(s, n, tokens, visit, offset, counts, a.block_table, a.rows + row,
                     a.visit_blocks + list_index * s.max_blocks, a.visit_count + list_index,
                     &a.report->stats);
    __syncthreads();  // the next list reuses the flags and offsets
  }
}

}  // namespace eps::gpu::kernels
