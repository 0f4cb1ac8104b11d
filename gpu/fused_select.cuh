// Scoring and selection in one kernel, for the threshold budget (core
// MarkByThreshold, not strict mode), union or per-KV-head lists, and steps
// whose rows each fit one scoring block (n <= kScoreThreads groups: every
// context up to 32k tokens at g = 8). The two-kernel path (score_kernel.cuh,
// then select_kernel.cuh) wrote every score to global memory and read it back
// in four radix passes per head, and its selection waited for the whole
// scoring grid; here each scoring block cuts its own heads from shared memory
// as soon as it has scored them.
//
// Grid (1, layers * kv_heads, rows), kScoreThreads threads: one block per
// (row, layer, KV head), as ScoreKernel's for such rows.
//   1. ScoreGroups, its scores kept in shared memory [ratio, kScoreThreads];
//   2. a warp per query head: T = the top_pages-th largest unforced score,
//      cut T/α (T·α when T <= 0), by the selection kernel's own functions
//      (WarpThresholdMarksHeld at ranks up to kHeldRank, else
//      WarpThresholdCut), and the head's marks, a bit per group, ORed into
//      the block's marks;
//   3. per-KV-head lists: the block owns its list and compacts it now.
//      Union: the block ORs its marks into the (row, layer)'s mask in global
//      memory; the last of the (row, layer)'s kv_heads blocks to arrive (an
//      atomic counter after a fence) takes the mask and compacts the union.
//   4. the last (row, layer) of the step to finish: if anything in the step
//      failed (a bad slot, block id, score or query), every list's count
//      becomes -1.
// Same scores and same cuts as the two-kernel path, hence the same lists and
// statistics (visit_compaction.cuh is shared). No score reaches global memory.
//
// Failed steps: the two-kernel path leaves the outputs unwritten (counts -1
// with a step fence). Here a (row, layer) may finish before another's block
// fails, so a failed step ends with every count -1, fence or not, and its
// visit_blocks partly written.
//
// Scratch (FusedArgs) is zero between steps: each counter and mask is reset by
// the block that consumes it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/score_kernel.cuh"
#include "gpu/select_kernel.cuh"
#include "gpu/stage_clocks.cuh"
#include "gpu/step_shape.cuh"
#include "gpu/visit_compaction.cuh"
#include "gpu/warp_select.cuh"

namespace eps::gpu::kernels {

inline constexpr int kFusedWarps = kScoreThreads / 32;
inline constexpr int kFusedMaskWords = kScoreThreads / 32;  // a bit per group of a row

struct FusedArgs {
  unsigned* masks;          // [max_batch, layers, kFusedMaskWords]: union lists' marks so far
  unsigned* arrivals;       // [max_batch, layers]: KV-head blocks done
  unsigned* step_arrivals;  // (row, layer)s done
};

// Dynamic shared memory beyond ScoreSharedWords, in words: scores [ratio,
// kScoreThreads], marks [kFusedMaskWords] and the block's decisions [kDecisions]
// (one word each, so no thread rewrites a word that another may still read);
// then, unless `staged`, the cut's histograms [kFusedWarps, 256], counts and
// offsets [kScoreThreads] each, visit flags [kScoreThreads] bytes and each warp's
// marks of a held row [kFusedWarps, kFusedMaskWords]. jl's staged path keeps
// these in its staged records' area instead, which nothing reads once the block
// has scored: 10.5 KB a block less (14.4 KB with its smaller terms scratch,
// ScoreSharedWords), and four blocks an SM fit.
inline constexpr int kFusedScratchWords =
    kFusedWarps * 256 + 2 * kScoreThreads + kScoreThreads / 4 + kFusedWarps * kFusedMaskWords;
__host__ __device__ constexpr size_t FusedSharedWords(int ratio, bool staged) {
  return static_cast<size_t>(ratio) * kScoreThreads + kFusedMaskWords + 4 +
         (staged ? 0 : kFusedScratchWords);
}
// Block-table entries a thread of the fused kernel holds for its compaction:
// every row of up to 256 groups of 8 blocks (32k tokens at g = 8).
inline constexpr int kFusedHeldBlocks = 8;

enum Decision : int { kWriteDecision = 0, kRowLayerLast = 1, kStepLast = 2, kStepFailed = 3 };

// What a block may write for the step: the list, -1 (attend densely: the step
// failed and a fence lets the engine proceed regardless), or nothing (the
// engine released selection_done and attends densely already; or the step
// failed without a fence). As SelectKernel decides at its start.
enum ListWrite : int { kWriteList = 0, kWriteDense = 1, kWriteNothing = 2 };

// The three words (the engine's selection_done, the host's release word, the step's
// status) are loaded before any is tested, so that their round trips to memory
// overlap (a test, then the next load, was three in a row on every list's path).
__device__ inline int DecideListWrite(const SelectArgs& a) {
  const uint64_t done = a.selection_done != nullptr
                            ? *reinterpret_cast<const volatile uint64_t*>(a.selection_done)
                            : 0;
  const uint64_t released = ReleaseWord(a);
  const int code = *reinterpret_cast<const volatile int*>(&a.report->status.code);
  if (a.selection_done != nullptr && done >= a.step) return kWriteNothing;
  if (Released(a, released)) return kWriteDense;  // not the step's queries
  if (code != kOk) return a.selection_done != nullptr ? kWriteDense : kWriteNothing;
  return kWriteList;
}

// Blocks per SM the compiler must allow: jl's staged path four (64 registers; its
// shared memory allows them, above), the others as their scoring kernel.
template <Method kMethod, int kM, int kHeads>
inline constexpr int kFusedMinBlocks =
    kMethod == Method::kJl&& kM > 0 && kM <= 8 ? 4 : kScoreMinBlocks<kMethod, kM, false, kHeads>;

template <Method kMethod, int kM, int kHeads = kHeadBatch, bool kQuest8 = false>
__global__ void __launch_bounds__(kScoreThreads, (kFusedMinBlocks<kMethod, kM, kHeads>))
    FusedSelectKernel(Shape s, ScoreArgs score, SelectRule rule, SelectArgs a, FusedArgs f) {
  constexpr bool kStaged = kMethod == Method::kJl && kM > 0;
  static_assert(!kStaged || kScoreThreads * StagedStride(kM) >= kFusedScratchWords,
                "the cut's scratch fits where the records were staged");
  extern __shared__ float shared[];
  // Nothing is held in registers across the scoring, whose passes need them all.
  auto scores_of = [&] {
    return shared + ScoreSharedWords(s.q_heads / s.kv_heads, s.d, s.m, kStaged);
  };
  EPS_STAMP(kStageEntry);
  if (blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0) *a.next_report = StepReport{};

  // 1. Scores into shared memory [ratio, kScoreThreads].
  ScoreGroups<kMethod, kM, false, kHeads, true, 0, kQuest8>(s, score, shared, scores_of());
  __syncthreads();
  EPS_STAMP(kStageScored);
  const int row = blockIdx.z;
  const int layer = blockIdx.y / s.kv_heads, kvh = blockIdx.y % s.kv_heads;
  const int ratio = s.q_heads / s.kv_heads;
  float* scores = scores_of();
  unsigned* marks = reinterpret_cast<unsigned*>(scores + ratio * kScoreThreads);  // [mask words]
  int* decision = reinterpret_cast<int*>(marks + kFusedMaskWords);                // [4]
  // The staged records are dead after the barrier above (every warp has read its own).
  float* scratch = kStaged ? shared : reinterpret_cast<float*>(decision + 4);
  auto* histograms = reinterpret_cast<unsigned(*)[256]>(scratch);
  unsigned* counts = histograms[kFusedWarps];                              // [threads]
  unsigned* offset = counts + kScoreThreads;                               // [threads]
  auto* visit = reinterpret_cast<unsigned char*>(offset + kScoreThreads);  // [threads]
  if (threadIdx.x < kFusedMaskWords) marks[threadIdx.x] = 0;
  __syncthreads();

  // 2. Each head's cut, as SelectKernel's (core MarkByThreshold), and its marks.
  const int64_t tokens = a.rows[row].context_tokens;
  const int n = GroupsOf(s, tokens);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  auto forced = [&](int p) { return IsForced(p, n, rule.first_n, rule.last_n); };
  // Rows held in registers (the threshold's rank within kHeldRank): each warp ORs
  // its heads' marks into its own words (WarpThresholdMarksHeld, no atomics),
  // which the block then ORs together; else a ballot and an atomicOr a word.
  const bool held = rule.top_pages <= kHeldRank;  // n <= kScoreThreads = kHeldGroups
  static_assert(kFusedMaskWords == kHeldWords, "a held row's words are the block's mask words");
  unsigned* warp_marks = reinterpret_cast<unsigned*>(visit + kScoreThreads) + warp * kHeldWords;
  if (held) {
    if (lane < kHeldWords) warp_marks[lane] = 0;
    __syncwarp();
  }
  for (int r = warp; r < ratio; r += kFusedWarps) {
    const int h = kvh * ratio + r;
    if (a.scored != nullptr && !a.scored[layer * s.q_heads + h]) continue;  // admits nothing
    const float* values = scores + r * kScoreThreads;
    if (held) {
      WarpThresholdMarksHeld(values, n, rule, lane, warp_marks);
      continue;
    }
    const float cut = WarpThresholdCut(values, n, rule, histograms[warp], lane);
    for (int w = 0; w < kFusedMaskWords; ++w) {
      const int p = 32 * w + lane;
      const unsigned bits = __ballot_sync(kFullWarp, p < n && !forced(p) && values[p] >= cut);
      if (lane == 0 && bits != 0) atomicOr(&marks[w], bits);
    }
  }
  __syncthreads();
  if (held) {
    if (threadIdx.x < kFusedMaskWords) {
      const unsigned* words = reinterpret_cast<const unsigned*>(visit + kScoreThreads);
      unsigned any = 0;
      for (int w = 0; w < kFusedWarps; ++w) any |= words[w * kHeldWords + threadIdx.x];
      marks[threadIdx.x] = any;
    }
    // The union's blocks read only their own thread's word below (before the
    // arrival's barrier); a per-KV-head list's every thread reads them.
    if (s.lists != 1) __syncthreads();
  }

  EPS_STAMP(kStageCut);
  // 3. The list: this block's (per KV head), or the (row, layer)'s union once
  // its last KV-head block has arrived.
  const int64_t rl = int64_t{row} * s.layers + layer;
  unsigned* mask = f.masks + rl * kFusedMaskWords;
  const bool union_list = s.lists == 1;
  // The list's words: the row's block ids (LoadTableRow, returned) and whether to
  // write (decision[kWriteDecision], by thread 0), loaded together with whatever
  // else the block is waiting for at that point; compact() reads them after a barrier.
  using TableRow = HeldTableRow<kFusedHeldBlocks>;
  auto load_list_words = [&] {
    const TableRow table =
        LoadTableRow<kFusedHeldBlocks>(s, n, tokens, a.block_table, a.rows[row].table_row);
    if (threadIdx.x == 0) decision[kWriteDecision] = DecideListWrite(a);
    return table;
  };
  auto compact = [&](int list, const TableRow& table) {
    // visit flags: forced groups, and the marked ones (the decision, written
    // before the call, is read after the barrier below).
    if (threadIdx.x < n) {
      visit[threadIdx.x] =
          forced(threadIdx.x) || ((marks[threadIdx.x / 32] >> (threadIdx.x % 32)) & 1u);
    }
    __syncthreads();
    const int64_t list_index = (int64_t{layer} * s.max_batch + row) * s.lists + list;
    if (decision[kWriteDecision] == kWriteList) {
      CompactVisitList(s, n, tokens, visit, offset, counts, a.block_table, a.rows + row,
                       a.visit_blocks + list_index * s.max_blocks, a.visit_count + list_index,
                       &a.report->stats, table);
    } else if (decision[kWriteDecision] == kWriteDense && threadIdx.x == 0) {
      a.visit_count[list_index] = -1;
    }
  };
  if (!union_list) {
    compact(kvh, load_list_words());  // its first barrier publishes the decision
  } else if (threadIdx.x < kFusedMaskWords && marks[threadIdx.x] != 0) {
    atomicOr(&mask[threadIdx.x], marks[threadIdx.x]);
  }
  // Everything this block wrote (the mask, its list) before its arrival.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool last = atomicAdd(&f.arrivals[rl], 1u) == static_cast<unsigned>(s.kv_heads - 1);
    if (last) f.arrivals[rl] = 0;  // every block of the (row, layer) has counted: the next step's
    decision[kRowLayerLast] = last;
  }
  __syncthreads();
  EPS_STAMP(kStageArrived);
  if (!decision[kRowLayerLast]) {
    EPS_STAMP(kStageEnd);
    return;
  }
  __threadfence();  // the other blocks' masks, seen after their arrivals
  if (union_list) {
    // The union's words, the decision and the block ids: one round trip.
    const TableRow table = load_list_words();
    if (threadIdx.x < kFusedMaskWords) marks[threadIdx.x] = atomicExch(&mask[threadIdx.x], 0u);
    __syncthreads();
    EPS_STAMP(kStageUnionTaken);
    compact(0, table);
    __threadfence();
    __syncthreads();
    EPS_STAMP(kStageCompacted);
  }

  // 4. The step's last (row, layer): a failure anywhere fails every list.
  if (threadIdx.x == 0) {
    const unsigned all = gridDim.z * static_cast<unsigned>(s.layers);
    const bool last = atomicAdd(f.step_arrivals, 1u) == all - 1;
    if (last) *f.step_arrivals = 0;
    decision[kStepLast] = last;
  }
  __syncthreads();
  EPS_STAMP(kStageEnd);
  if (!decision[kStepLast]) return;
  __threadfence();
  if (threadIdx.x == 0) {
    const bool abandoned = a.selection_done != nullptr &&
                           *reinterpret_cast<const volatile uint64_t*>(a.selection_done) >= a.step;
    decision[kStepFailed] =
        !abandoned && *reinterpret_cast<const volatile int*>(&a.report->status.code) != kOk;
  }
  __syncthreads();
  if (!decision[kStepFailed]) return;
  for (int64_t i = threadIdx.x; i < int64_t{s.layers} * gridDim.z * s.lists; i += blockDim.x) {
    const int64_t l = i / (int64_t{gridDim.z} * s.lists), rest = i % (int64_t{gridDim.z} * s.lists);
    a.visit_count[(l * s.max_batch + rest / s.lists) * s.lists + rest % s.lists] = -1;
  }
}

}  // namespace eps::gpu::kernels
