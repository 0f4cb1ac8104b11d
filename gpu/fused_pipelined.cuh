// The fused selection (gpu/fused_select.cuh) for jl's staged path as a
// persistent, pipelined kernel: each block takes (row, layer, KV head) units
// u = blockIdx.x, + gridDim.x, ... and stages the next unit's records and
// query terms (cp.async) while it scores and cuts the current one, in two
// stages of shared memory. FusedSelectKernel stages a unit's records, waits for
// them, scores and cuts, so an SM's DRAM reads pause while its blocks cut
// (four blocks an SM: ncu saw DRAM at 61 % of peak, a third of the stall
// samples at the cut's barriers; docs/benchmarks/gpu.md, ninth session).
//
// Grid (blocks), kScoreThreads threads, blocks <= units; two blocks an SM (two
// stages of records and terms, 95 KB a block at m = 8, d = 128, ratio 4).
// Per unit: the scores of FusedSelectKernel (ScoreGroups' staged jl path: the
// same slots checked, the same records, terms and arithmetic, hence the same
// bits), then FusedCut, which it shares. Query terms come from the terms kernel
// (ScoreArgs::terms; the step launches this kernel as its programmatic
// dependent): the first unit's records are staged before the kernel waits for
// them, each later unit's terms with its records.
//
// Shared memory (dynamic), in words: records [2][kScoreThreads, StagedStride(m)],
// terms [2][ratio, TermWords(m)], then FusedSharedWords(ratio, staged: true)
// (scores, marks, decisions); the cut's scratch is the current unit's records.
#pragma once

#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/fused_select.cuh"
#include "gpu/score_kernel.cuh"
#include "gpu/step_shape.cuh"
#include "gpu/terms_kernel.cuh"
#include "gpu/warp_sums.cuh"

namespace eps::gpu::kernels {

inline constexpr int kPipelinedStages = 2;
inline constexpr int kPipelinedMinBlocks = 2;

__host__ __device__ constexpr size_t PipelinedSharedWords(int ratio, int m) {
  return static_cast<size_t>(kPipelinedStages) *
             (static_cast<size_t>(kScoreThreads) * StagedStride(m) +
              static_cast<size_t>(ratio) * TermWords(m)) +
         FusedSharedWords(ratio, true);
}

// Whether m has a pipelined kernel (PipelinedKernelOf in step_kernels.cuh).
__host__ __device__ constexpr bool HasPipelinedKernel(int m) { return m == 4 || m == 8; }

// One unit's place in the step, and this thread's group of it.
struct PipelinedUnit {
  int row, layer, kvh;
  int n;          // the row's groups
  int32_t slot;   // this thread's group's (checked)
  bool active;    // this thread has a group with a good slot
};

// Queues the copy of a unit's heads' terms (TermsKernel's) into `terms`
// [ratio, TermWords(m)], 16 bytes a thread, uncommitted.
__device__ __forceinline__ void QueueTerms(const Shape& s, const ScoreArgs& a,
                                           const PipelinedUnit& unit, float* terms) {
  const int ratio = s.q_heads / s.kv_heads, words = TermWords(s.m);
  const float* from =
      a.terms + ((int64_t{unit.row} * s.layers + unit.layer) * s.q_heads + unit.kvh * ratio) * words;
  for (int e = 4 * threadIdx.x; e < ratio * words; e += 4 * kScoreThreads) {
    __pipeline_memcpy_async(terms + e, from + e, 16);
  }
}

// Unit u: its slots checked (OpenSlot, CheckGroupBlocks: as ScoreGroups does),
// its records queued into `stage` by each warp (StageWarpRecords), and, if
// `with_terms`, its heads' terms into `terms` by the block's first threads;
// then one commit (cp.async group) per thread, copies or none.
template <int kM>
__device__ __forceinline__ PipelinedUnit OpenUnit(const Shape& s, const ScoreArgs& a, int64_t u,
                                                  float* stage, float* terms, bool with_terms) {
  constexpr int kStride = StagedStride(kM);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int pairs = s.layers * s.kv_heads;
  PipelinedUnit unit;
  unit.row = static_cast<int>(u / pairs);
  const int y = static_cast<int>(u % pairs);
  unit.layer = y / s.kv_heads;
  unit.kvh = y % s.kv_heads;
  const int64_t tokens = a.rows[unit.row].context_tokens;
  const int64_t table_row = a.rows[unit.row].table_row;
  unit.n = GroupsOf(s, tokens);
  const int64_t p = threadIdx.x;
  unit.active = OpenSlot(s, a, unit.row, table_row, p, unit.n, unit.slot);
  const float* rec = unit.active ? RecordOf(s, a, unit.slot, unit.layer, unit.kvh) : nullptr;
  if (with_terms) QueueTerms(s, a, unit, terms);
  StageWarpRecords<StagedWords(kM), kStride>(rec, stage + warp * 32 * kStride, lane);  // commits
  CheckGroupBlocks(s, a, unit.row, y, table_row, p, unit.n,
                   (tokens + s.block_size - 1) / s.block_size);
  return unit;
}

// A unit's scores from its staged records, every query head of its KV head,
// into scores [ratio, kScoreThreads] (ScoreGroups' staged jl path).
template <int kM>
__device__ __forceinline__ void ScoreUnit(const Shape& s, const ScoreArgs& a,
                                          const PipelinedUnit& unit, const float* stage,
                                          const float* terms, float* scores) {
  if (!unit.active) return;
  const float* rec = stage + threadIdx.x * StagedStride(kM);
  const RecordOffsets& o = s.record;
  const bool stats_ok =
      isfinite(rec[o.fro2]) && isfinite(rec[o.max_norm]) && isfinite(rec[o.count]);
  constexpr int kVectors = (kM * (kM + 1) / 2 + 3) / 4;
  float4 gram[kVectors];
#pragma unroll
  for (int v = 0; v < kVectors; ++v) gram[v] = reinterpret_cast<const float4*>(rec)[v];
  const int ratio = s.q_heads / s.kv_heads, words = TermWords(s.m);
  for (int r = 0; r < ratio; ++r) {
    const int h = unit.kvh * ratio + r;
    if (a.scored != nullptr && !a.scored[unit.layer * s.q_heads + h]) continue;
    const HeadQuery hq{terms + r * words, terms[r * words + o.packed]};
    const float score = JlScore<kM>(rec, reinterpret_cast<const float*>(gram), o, hq);
    scores[r * kScoreThreads + threadIdx.x] = score;
    if (isnan(score) || score == INFINITY || !stats_ok) {
      Fail(&a.report->status, kBadScore, unit.row, static_cast<int>(threadIdx.x), unit.slot);
    }
  }
}

template <int kM>
__global__ void __launch_bounds__(kScoreThreads, kPipelinedMinBlocks)
    PipelinedSelectKernel(Shape s, ScoreArgs score, SelectRule rule, SelectArgs a, FusedArgs f) {
  static_assert(HasPipelinedKernel(kM), "jl's staged path with m of 4 or 8");
  static_assert(kScoreThreads * StagedStride(kM) >= kFusedScratchWords,
                "the cut's scratch fits where a unit's records were staged");
  constexpr int kStageWords = kScoreThreads * StagedStride(kM);
  extern __shared__ __align__(16) float shared[];
  const int ratio = s.q_heads / s.kv_heads;
  const int terms_words = ratio * TermWords(s.m);
  float* stages = shared;                                      // [2][kStageWords]
  float* terms = stages + kPipelinedStages * kStageWords;      // [2][terms_words]
  float* scores = terms + kPipelinedStages * terms_words;      // FusedSharedWords(ratio, true)
  const int64_t units = f.rows * s.layers * s.kv_heads;
  if (blockIdx.x == 0 && threadIdx.x == 0) *a.next_report = StepReport{};

  // The first unit's records before the terms kernel has finished, its terms after.
  int64_t u = blockIdx.x;
  PipelinedUnit current{};
  if (u < units) current = OpenUnit<kM>(s, score, u, stages, terms, false);
  WaitForQueryTerms();
  if (u < units) QueueTerms(s, score, current, terms);
  __pipeline_commit();
  for (int stage = 0; u < units; u += gridDim.x, stage ^= 1) {
    // The next unit's copies go where the unit before this one was staged (and
    // cut: FusedCut's barriers have passed); then this unit's have landed.
    const int64_t next = u + gridDim.x;
    PipelinedUnit upcoming{};
    if (next < units) {
      upcoming = OpenUnit<kM>(s, score, next, stages + (stage ^ 1) * kStageWords,
                              terms + (stage ^ 1) * terms_words, true);
      __pipeline_wait_prior(1);
    } else {
      __pipeline_wait_prior(0);
    }
    __syncthreads();  // the terms were copied by other warps
    ScoreUnit<kM>(s, score, current, stages + stage * kStageWords, terms + stage * terms_words,
                  scores);
    __syncthreads();
    FusedCut(s, rule, a, f, current.row, current.layer, current.kvh, static_cast<int>(f.rows), scores,
             stages + stage * kStageWords);
    current = upcoming;
  }
}

}  // namespace eps::gpu::kernels
