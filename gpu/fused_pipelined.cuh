// The fused selection (gpu/fused_select.cuh) for jl's staged path as a
// persistent kernel whose blocks each take whole (row, layer)s: u =
// blockIdx.x, + gridDim.x, ... of rows * layers. For each it scores and cuts
// the KV heads one after the other, staging the next KV head's records (and
// the next (row, layer)'s first) while it cuts the current one, and ORs their
// marks in shared memory, so a union list needs no other block.
//
// FusedSelectKernel (a block per (row, layer, KV head)) spends most of a
// block's life in round trips to global memory that nothing overlaps: its
// slots, then its records, then after the cut a fence and an arrival counter,
// and for the last KV head of a (row, layer) the others' masks, the list and
// another fence and counter (ncu at 64 x 32k: DRAM at 61 % of peak with four
// blocks an SM; docs/benchmarks/gpu.md, ninth and tenth sessions). Here a
// thread reads its group's slot once for all KV heads of a (row, layer), the
// records of the next KV head load during the cut, and the step's counter is
// counted once per block.
//
// Grid (blocks), kScoreThreads threads, blocks <= rows * layers, up to four
// an SM (52 KB of shared memory at m = 8, d = 128, ratio 4; 64 registers).
// Scores as ScoreGroups' staged jl path (the same slots checked, the same
// records, terms and arithmetic, hence the same bits); cuts and lists by the
// fused kernel's own functions (CutHeads, CompactFusedList); query terms from
// the terms kernel (ScoreArgs::terms; this kernel is its programmatic
// dependent): the first records are staged before the wait for them.
//
// Shared memory (dynamic), in words: the staged records [kScoreThreads,
// StagedStride(m)] (above kHeldRank the cut's histograms too, after scoring),
// terms [ratio, TermWords(m)], scores [ratio, kScoreThreads], marks
// [kFusedMaskWords], decisions [4], the warps' held words [kFusedWarps,
// kHeldWords], counts and offsets [kScoreThreads] each, visit flags
// [kScoreThreads] bytes.
//
// A failed step: the last block to finish writes every count -1 (as
// FusedSelectKernel's last (row, layer) does), after other blocks may have
// written their lists.
#pragma once

#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/fused_select.cuh"
#include "gpu/score_kernel.cuh"
#include "gpu/step_shape.cuh"
#include "gpu/terms_kernel.cuh"
#include "gpu/warp_select.cuh"
#include "gpu/warp_sums.cuh"

namespace eps::gpu::kernels {

inline constexpr int kPipelinedMinBlocks = 4;

__host__ __device__ constexpr size_t PipelinedSharedWords(int ratio, int m) {
  return static_cast<size_t>(kScoreThreads) * StagedStride(m) +
         static_cast<size_t>(ratio) * TermWords(m) + static_cast<size_t>(ratio) * kScoreThreads +
         kFusedMaskWords + 4 + kFusedWarps * kHeldWords + 2 * kScoreThreads + kScoreThreads / 4;
}

// Whether m has a pipelined kernel (PipelinedKernelFor in step_kernels.cuh).
__host__ __device__ constexpr bool HasPipelinedKernel(int m) { return m == 4 || m == 8; }

// A (row, layer) of the step, and this thread's group of it. Only `slot` and
// `active` stay in registers across a unit's KV heads; the rest is read again
// where it is needed (Place), which keeps the kernel within 64 registers.
struct PipelinedUnit {
  int32_t slot;  // this thread's group's (checked)
  bool active;   // this thread has a group with a good slot
};
struct UnitPlace {
  int row, layer, n;  // n: the row's groups
  int64_t tokens;
};
__device__ __forceinline__ UnitPlace Place(const Shape& s, const ScoreArgs& a, int u) {
  UnitPlace at;
  at.row = u / s.layers;
  at.layer = u - at.row * s.layers;
  at.tokens = a.rows[at.row].context_tokens;
  at.n = GroupsOf(s, at.tokens);
  return at;
}

// Unit u (row u / layers, layer u % layers): the thread's slot checked (OpenSlot;
// the row's block ids too, CheckGroupBlocks, where the layer is 0), as
// ScoreGroups does once per (row, layer, KV head).
__device__ __forceinline__ PipelinedUnit OpenUnit(const Shape& s, const ScoreArgs& a,
                                                  const UnitPlace& at) {
  const int64_t table_row = a.rows[at.row].table_row;
  const int64_t p = threadIdx.x;
  PipelinedUnit unit;
  unit.active = OpenSlot(s, a, at.row, table_row, p, at.n, unit.slot);
  CheckGroupBlocks(s, a, at.row, at.layer * s.kv_heads, table_row, p, at.n,
                   (at.tokens + s.block_size - 1) / s.block_size);
  return unit;
}

// Queues the copy of KV head kvh's query terms (TermsKernel's) of a unit into
// `terms` [ratio, TermWords(m)], 16 bytes a thread, uncommitted.
template <int kM>
__device__ __forceinline__ void QueueTerms(const Shape& s, const ScoreArgs& a, int u, int kvh,
                                           float* terms) {
  const int ratio = s.q_heads / s.kv_heads, words = TermWords(kM);
  const float* from =
      a.terms + (int64_t{u} * s.q_heads + kvh * ratio) * words;  // u = row * layers + layer
  for (int e = 4 * threadIdx.x; e < ratio * words; e += 4 * kScoreThreads) {
    __pipeline_memcpy_async(terms + e, from + e, 16);
  }
}

// Queues KV head kvh's records of a unit into `stage` (each warp its own
// records: StageWarpRecords) and, if `with_terms`, its terms; one commit.
template <int kM>
__device__ __forceinline__ void QueueKvHead(const Shape& s, const ScoreArgs& a,
                                            const PipelinedUnit& unit, int u, int layer, int kvh,
                                            float* stage, float* terms, bool with_terms) {
  constexpr int kStride = StagedStride(kM);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (with_terms) QueueTerms<kM>(s, a, u, kvh, terms);
  const float* rec = unit.active ? RecordOf(s, a, unit.slot, layer, kvh) : nullptr;
  // Two pieces at a time: all ten at once (m = 8) spilled at 64 registers.
  StageWarpRecords<StagedWords(kM), kStride, 2>(rec, stage + warp * 32 * kStride, lane);  // commits
}

// KV head kvh's scores of a unit from its staged records, every query head of
// the KV head, into scores [ratio, kScoreThreads] (ScoreGroups' staged jl path).
template <int kM>
__device__ __forceinline__ void ScoreKvHead(const Shape& s, const ScoreArgs& a,
                                            const PipelinedUnit& unit, int row, int layer, int kvh,
                                            const float* stage, const float* terms, float* scores) {
  if (!unit.active) return;
  const float* rec = stage + threadIdx.x * StagedStride(kM);
  const RecordOffsets& o = s.record;
  const bool stats_ok =
      isfinite(rec[o.fro2]) && isfinite(rec[o.max_norm]) && isfinite(rec[o.count]);
  const int ratio = s.q_heads / s.kv_heads;
  for (int r = 0; r < ratio; ++r) {
    const int h = kvh * ratio + r;
    if (a.scored != nullptr && !a.scored[layer * s.q_heads + h]) continue;
    const float score = JlScoreShared<kM>(rec, terms + r * TermWords(kM));
    scores[r * kScoreThreads + threadIdx.x] = score;
    if (isnan(score) || score == INFINITY || !stats_ok) {
      Fail(&a.report->status, kBadScore, row, static_cast<int>(threadIdx.x), unit.slot);
    }
  }
}

template <int kM>
__global__ void __launch_bounds__(kScoreThreads, kPipelinedMinBlocks)
    PipelinedSelectKernel(Shape s, ScoreArgs score, SelectRule rule, SelectArgs a, FusedArgs f) {
  static_assert(HasPipelinedKernel(kM), "jl's staged path with m of 4 or 8");
  static_assert(kScoreThreads * StagedStride(kM) >= kFusedWarps * 256,
                "the cut's histograms fit where the records were staged");
  extern __shared__ __align__(16) float shared[];
  const int ratio = s.q_heads / s.kv_heads;
  float* stage = shared;                                                      // [threads, stride]
  float* terms = stage + kScoreThreads * StagedStride(kM);                    // [ratio, words]
  float* scores = terms + ratio * TermWords(kM);                              // [ratio, threads]
  auto* marks = reinterpret_cast<unsigned*>(scores + ratio * kScoreThreads);  // [mask words]
  int* decision = reinterpret_cast<int*>(marks + kFusedMaskWords);            // [4]
  unsigned* warp_words = reinterpret_cast<unsigned*>(decision + 4);           // [warps, held words]
  unsigned* counts = warp_words + kFusedWarps * kHeldWords;                   // [threads]
  unsigned* offset = counts + kScoreThreads;                                  // [threads]
  auto* visit = reinterpret_cast<unsigned char*>(offset + kScoreThreads);     // [threads]
  auto* histograms = reinterpret_cast<unsigned(*)[256]>(stage);               // after scoring
  const bool held = rule.top_pages <= kHeldRank;
  const bool union_list = s.lists == 1;
  const int units = static_cast<int>(f.rows) * s.layers;  // (row, layer)s, u = row * layers + layer
  if (blockIdx.x == 0 && threadIdx.x == 0) *a.next_report = StepReport{};

  // The first unit's first records before the terms kernel has finished, its terms after.
  int u = static_cast<int>(blockIdx.x);
  UnitPlace at{};
  PipelinedUnit current{};
  if (u < units) {
    at = Place(s, score, u);
    current = OpenUnit(s, score, at);
    QueueKvHead<kM>(s, score, current, u, at.layer, 0, stage, terms, false);
  }
  WaitForQueryTerms();
  if (u < units) QueueTerms<kM>(s, score, u, 0, terms);
  __pipeline_commit();
  for (; u < units; u += gridDim.x) {
    if (union_list && threadIdx.x < kFusedMaskWords) marks[threadIdx.x] = 0;
    const int following = u + static_cast<int>(gridDim.x);
    UnitPlace next_at{};
    PipelinedUnit next{};
    for (int kvh = 0; kvh < s.kv_heads; ++kvh) {
      __pipeline_wait_prior(0);
      __syncthreads();  // (kvh)'s records and terms have landed, whoever copied them
      ScoreKvHead<kM>(s, score, current, at.row, at.layer, kvh, stage, terms, scores);
      if (!union_list && threadIdx.x < kFusedMaskWords) marks[threadIdx.x] = 0;
      __syncthreads();  // the stage and terms are read
      // The next KV head's (or unit's) copies while this one is cut; above
      // kHeldRank the cut's histograms take the stage, so after the cut.
      const bool more = kvh + 1 < s.kv_heads;
      if (!more && following < units) {
        next_at = Place(s, score, following);
        next = OpenUnit(s, score, next_at);
      }
      const bool queue = more || following < units;
      const PipelinedUnit copy = more ? current : next;
      const int copy_u = more ? u : following, copy_layer = more ? at.layer : next_at.layer;
      const int copy_kvh = more ? kvh + 1 : 0;
      if (held && queue) {
        QueueKvHead<kM>(s, score, copy, copy_u, copy_layer, copy_kvh, stage, terms, true);
      }
      CutHeads(s, rule, a, at.layer, kvh, at.n, scores, marks, warp_words, histograms);
      if (!held && queue) {
        QueueKvHead<kM>(s, score, copy, copy_u, copy_layer, copy_kvh, stage, terms, true);
      }
      if (!union_list) {
        CompactFusedList(s, rule, a, at.row, at.layer, kvh, at.n, at.tokens, marks, visit, offset,
                         counts, decision);
      }
    }
    if (union_list) {
      CompactFusedList(s, rule, a, at.row, at.layer, 0, at.n, at.tokens, marks, visit, offset,
                       counts, decision);
    }
    current = next;
    at = next_at;
  }

  // The step's last block to finish: a failure anywhere fails every list.
  __threadfence();  // this block's lists and statistics before its arrival
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool last = atomicAdd(f.step_arrivals, 1u) == gridDim.x - 1;
    if (last) *f.step_arrivals = 0;
    decision[kStepLast] = last;
  }
  __syncthreads();
  if (!decision[kStepLast]) return;
  __threadfence();
  FailEveryListOfAFailedStep(s, a, f.rows, decision);
}

}  // namespace eps::gpu::kernels
