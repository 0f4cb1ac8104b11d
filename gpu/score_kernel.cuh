// The scoring kernel of the GPU pre-pass (gpu/step.h), keyed by the core
// `Method`; gpu/bounds.cuh holds the bounds it applies.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/bounds.h"
#include "gpu/bounds.cuh"
#include "gpu/phi.cuh"
#include "gpu/questclt_octets.cuh"
#include "gpu/stage_clocks.cuh"
#include "gpu/step_shape.cuh"
#include "gpu/terms_held.cuh"
#include "gpu/terms_kernel.cuh"
#include "gpu/warp_sums.cuh"

namespace eps::gpu::kernels {

// Scoring. Grid (group chunks of 256, layers * kv_heads, rows), 256 threads;
// questclt's octet path takes kOctetChunks chunks a block, one after the other.
// Each thread scores one group: it reads the group's slot and queues its
// record's loads first (jl with m known: the warp copies its records to shared
// memory together), then the block reads its KV head's query terms, which
// TermsKernel built before (‖q‖; for jl the packed z zᵀ), or builds them
// itself (ScoreArgs::phi set: jl's staged path), and, for the
// per-channel sums, the widened queries; then each thread scores its record
// for every query head of the KV head (GQA), the per-channel sums of 1pc taken
// for up to kHeadBatch heads per pass, those of quest and strict for kHeads
// heads per pass with the warp's lanes reading its records together
// (gpu/warp_sums.cuh).
//
// Shared memory (dynamic): the staged records of jl with m known [threads,
// StagedStride(m)] or questclt's ring of quest parts [warps, OctetRingWarpWords]
// (gpu/questclt_octets.cuh), terms [ratio, TermWords(m)], q [ratio, d], qsplit
// [ratio, d] float2 (the octet path instead: q/2 then q²/4 [ratio,
// OctetQueryStride(d)] each, from q's start; jl's staged path, which reads no
// query there, only the scratch of the terms it builds: [ratio, d] then
// [ratio, m]). Outputs [rows, layers, q_heads,
// max_groups]: `scores` (strict: the lower bounds) and, in strict mode, `uppers`.
inline constexpr int kScoreThreads = 256;

struct ScoreArgs {
  const float* pool;
  const int32_t* group_table;
  const int32_t* block_table;
  const void* queries;  // [layers, max_batch, q_heads, d]
  const float* terms;   // [max_batch, layers, q_heads, TermWords(m)] (terms_kernel.cuh)
  const DeviceRow* rows;
  const uint8_t* scored;  // [layers, q_heads] or null (every head scored)
  float* scores;
  float* uppers;
  StepReport* report;
  // The coarse level (gpu/coarse_select.cuh). `coarse`: the pool and table above
  // are the coarse level's (its errors name them; the fine pass checks the block
  // ids). `candidates` (the fine pass with the level; else null): flags
  // [max_batch, layers, lists, max_coarse_groups]; a group whose coarse group
  // (p / coarse_ratio) is not a candidate of its KV head's list scores −∞ and
  // its record is not read (its slot still is, and checked, as core/ checks
  // every slot). No padding: the launch's bytes are a key (step_launch.cuh).
  const uint8_t* candidates;
  int64_t max_coarse_groups;
  int coarse_ratio;
  int coarse;  // bool
  // jl with m known (the staged records): when set, Φ [layers, kv_heads, d, m], and
  // the block builds its heads' terms itself while its records load, instead of
  // reading what the terms kernel built; `terms` is then unused. `held_e`: d / 32
  // where the step's terms kernel would be TermsKernelHeld, whose sums the block
  // then runs (HeldHeadTerms: the same terms bit for bit at every batch); 0:
  // HeadTerms, as TermsKernel. `unused` keeps the struct free of padding.
  const float* phi;
  int held_e;
  int unused;
};

// Dynamic shared memory of ScoreKernel for `ratio` query heads per KV head;
// `staged`: jl with m known, which stages its records (StagedWords); `octets`:
// questclt's octet path, which stages its quest parts in a ring (OctetRingWarpWords).
__host__ __device__ inline size_t ScoreSharedWords(int ratio, int d, int m, bool staged,
                                                   bool octets = false) {
  return static_cast<size_t>(ratio) * (TermWords(m) + (staged ? d + m : 3 * d)) +
         (staged ? static_cast<size_t>(kScoreThreads) * StagedStride(m) : 0) +
         (octets ? kScoreThreads / 32 * OctetRingWarpWords() : 0);
}

// Scoring blocks resident per SM that the compiler must allow: the warp-read
// sums keep a pass's loads and sums in registers (up to ~170 unbounded, one
// block per SM); two blocks (128 registers) keep twice the loads in flight,
// except for strict mode's and questclt's 8-head passes, which would spill
// (questclt's octet path likewise: ScoreKernel). jl with m ≤ 8
// keeps three blocks (80 registers), as it had before it staged its records.
template <Method kMethod, int kM, bool kStrict, int kHeads>
inline constexpr int kScoreMinBlocks = kMethod == Method::kJl && !kStrict && kM > 0 && kM <= 8 ? 3
                                       : (kStrict&& kHeads <= 4) ||
                                               (!kStrict &&
                                                (kMethod == Method::kQuest ||
                                                 (kMethod == Method::kQuestClt && kHeads <= 4)))
                                           ? 2
                                           : 1;

// One scoring block's work (ScoreKernel, and the fused selection of
// gpu/fused_select.cuh): kFused keeps the block's scores in shared memory,
// head r's of thread t at fused_scores[r * kScoreThreads + t], instead of
// writing them to a.scores; the same bits either way. kOctetD (64, 128 or 256:
// the model's d): questclt takes its sums a lane per octet of channels
// (gpu/questclt_octets.cuh), a float rounding from the general path.
// kQuest8: questclt reads the quest8 part (the records hold one), on either
// path. kChunks: the block takes that many runs of blockDim.x groups (octet
// path only). A thread without a group (or with a bad slot) writes none.
// Returns early, so the caller syncs the block before reading the scores.
template <Method kMethod, int kM, bool kStrict, int kHeads, bool kFused, int kOctetD = 0,
          bool kQuest8 = false, int kChunks = 1>
__device__ __forceinline__ void ScoreGroups(const Shape& s, const ScoreArgs& a, float* shared,
                                            float* fused_scores) {
  static_assert(!kFused || (!kStrict && kMethod != Method::kOff), "fused: one score per head");
  static_assert(kOctetD == 0 || (kMethod == Method::kQuestClt && !kStrict && HasOctetPath(kOctetD)),
                "the octet path is questclt's");
  static_assert(!kQuest8 || (kMethod == Method::kQuestClt && !kStrict), "quest8 is questclt's");
  static_assert(kChunks == 1 || kOctetD > 0, "several chunks a block: the octet path only");
  constexpr bool kOctets = kOctetD > 0;
  // quest, questclt and strict read each warp's records together (gpu/warp_sums.cuh), so
  // their lanes stay to the end; the other methods leave as soon as they have
  // nothing to score.
  constexpr bool kWarpSums = kStrict || kMethod == Method::kQuest || kMethod == Method::kQuestClt;
  // quest's sign-split queries (QuestSplitQuery): quest's and strict mode's sums.
  constexpr bool kSplit = kStrict || kMethod == Method::kQuest;
  constexpr int kBatch = kWarpSums ? kHeads : kHeadBatch;
  // jl with m known copies its warp's records to shared memory together
  // (StageWarpRecords) and scores the copies; its lanes too stay until then.
  constexpr bool kStaged = kMethod == Method::kJl && kM > 0 && !kStrict;
  constexpr bool kWarpRead = kWarpSums || kStaged;
  constexpr int kStride = kStaged ? StagedStride(kM) : 0;
  static_assert(kBatch <= kHeadBatch, "HeadSums holds kHeadBatch heads");
  // q in shared memory: the per-channel sums of quest (its sign-split copy), 1pc, strict.
  constexpr bool kQueries = kWarpSums || kMethod == Method::kOnePc || kMethod == Method::kQuestClt;
  const int row = blockIdx.z;
  const int layer = blockIdx.y / s.kv_heads, kvh = blockIdx.y % s.kv_heads;
  const int ratio = s.q_heads / s.kv_heads;
  const int words = TermWords(s.m);
  float* stage = shared;  // [threads, kStride], or the ring [warps, OctetRingWarpWords]
  float* terms_sh =
      stage + (kOctets ? kScoreThreads / 32 * OctetRingWarpWords() : kScoreThreads * kStride);
  float* q_sh = terms_sh + ratio * words;                             // [ratio, d]
  float2* qsplit_sh = reinterpret_cast<float2*>(q_sh + ratio * s.d);  // [ratio, d]
  DeviceStatus* status = &a.report->status;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // The group's slot first, and (jl) the warp's record copies queued, so that
  // the record loads are in flight while the block reads its heads' terms.
  const int64_t tokens = a.rows[row].context_tokens;
  const int64_t nb = BlocksOf(s, tokens);
  const int n = GroupsOf(s, tokens);
  // kChunks > 1: the block takes kChunks runs of blockDim.x groups, one after the other.
  int64_t p = blockIdx.x * int64_t{kChunks} * blockDim.x + threadIdx.x;
  bool active = false;
  const int64_t table_row = a.rows[row].table_row;
  int32_t slot = 0;
  const float* rec = nullptr;
  auto open_group = [&] {
    active = p < n;
    slot = active ? a.group_table[table_row * s.max_groups + p] : 0;
    if (active && (slot < 0 || slot >= s.num_slots)) {
      Fail(status, a.coarse ? kBadCoarseSlot : kBadSlot, row, static_cast<int>(p), slot);
      active = false;  // never read outside the pool
    }
    if constexpr (!kFused) {
      const int list = s.lists == 1 ? 0 : kvh;
      if (active && a.candidates != nullptr &&
          !a.candidates[((int64_t{row} * s.layers + layer) * s.lists + list) * a.max_coarse_groups +
                        p / a.coarse_ratio]) {
        active = false;  // outside the list's candidates: −∞ for its heads, its record unread
        for (int r = 0; r < ratio; ++r) {
          const int h = kvh * ratio + r;
          if (a.scored != nullptr && !a.scored[layer * s.q_heads + h]) continue;
          a.scores[((int64_t{row} * s.layers + layer) * s.q_heads + h) * s.max_groups + p] =
              -INFINITY;
        }
      }
    }
    rec = active ? a.pool + ((int64_t{slot} * s.layers + layer) * s.kv_heads + kvh) * s.record_words
                 : nullptr;
    if constexpr (kStaged) {
      StageWarpRecords<StagedWords(kM), kStride>(rec, stage + warp * 32 * kStride, lane);
    }
    // Block ids are checked once per group, by the fine level's (layer 0, kv head 0) blocks.
    if (p < n && blockIdx.y == 0 && !a.coarse) {
      for (int64_t b = p * s.group_blocks; b < min(nb, (p + 1) * s.group_blocks); ++b) {
        const int32_t id = a.block_table[table_row * s.max_blocks + b];
        if (id < 0 || (s.num_physical_blocks >= 0 && id >= s.num_physical_blocks)) {
          Fail(status, kBadBlock, row, static_cast<int>(b), id);
        }
      }
    }
  };
  open_group();
  if constexpr (kFused) EPS_STAMP(kStageSlotsQueued);
  if constexpr (kMethod == Method::kOff && !kStrict) {
    // Nothing is scored; the tables were still checked, as core/ does. No
    // block finishes before the terms kernel, whose query check the selection
    // kernel (ordered after this one only) reads.
    WaitForQueryTerms();
    return;
  } else {
    // The heads' terms (zz then ‖q‖), and the widened queries where the sums
    // need them; whoever built the terms checked the queries.
    bool built = false;
    if constexpr (kStaged) {
      if (a.phi != nullptr) {
        // Built here, a warp per head, while the staged records load; q_sh and
        // the qsplit area (unused by jl) are HeadTerms' scratch.
        if (a.held_e > 0) {
          BlockHeldTerms<kM>(s, a.queries, a.phi, a.scored, a.report, a.held_e, layer, row, kvh,
                             terms_sh, warp, lane);
        } else {
          for (int r = warp; r < ratio; r += kScoreThreads / 32) {
            HeadTerms<kM>(s, a.queries, PhiOf(s, a.phi, layer, kvh), a.scored, a.report, layer, row,
                          kvh * ratio + r, q_sh + r * s.d,
                          reinterpret_cast<float*>(qsplit_sh) + r * s.m, terms_sh + r * words,
                          lane);
          }
        }
        built = true;
      }
    }
    if (!built) {
      WaitForQueryTerms();  // everything above overlaps the terms kernel, nothing below
      const float* terms =
          a.terms + ((int64_t{row} * s.layers + layer) * s.q_heads + kvh * ratio) * words;
      if constexpr (kStaged) {
        // Queued behind the staged records and waited for with them, below: the
        // block's chain holds one round trip to memory here instead of two.
        for (int e = threadIdx.x; e < ratio * words; e += blockDim.x) {
          __pipeline_memcpy_async(terms_sh + e, terms + e, sizeof(float));
        }
        __pipeline_commit();
      } else {
        for (int e = threadIdx.x; e < ratio * words; e += blockDim.x) terms_sh[e] = terms[e];
      }
    }
    if constexpr (kQueries) {
      for (int e = threadIdx.x; e < ratio * s.d; e += blockDim.x) {
        const int h = kvh * ratio + e / s.d;
        const int64_t at = ((int64_t{layer} * s.max_batch + row) * s.q_heads + h) * s.d + e % s.d;
        const float q = LoadAsFloatDevice(a.queries, s.query_dtype, at);
        if constexpr (kOctets) {  // the octet path's halves and quarters (q/2, q²/4)
          constexpr int kStride = OctetQueryStride(kOctetD);
          const int i = e / kOctetD * kStride + OctetQueryIndex(e % kOctetD);
          q_sh[i] = 0.5f * q;
          q_sh[ratio * kStride + i] = 0.25f * q * q;
        } else {
          q_sh[e] = q;
        }
      }
      if constexpr (kSplit) {
        if (s.record.quest_min >= 0) {
          __syncthreads();
          for (int e = threadIdx.x; e < ratio * s.d; e += blockDim.x) {
            qsplit_sh[e] = QuestSplitQuery(q_sh + (e / s.d) * s.d, s.d, e % s.d);
          }
        }
      }
    }
    if constexpr (kFused) EPS_STAMP(kStageTermsBuilt);
    // The terms' copies (and the records') landed before the block reads them.
    if constexpr (kStaged) {
      if (!built) __pipeline_wait_prior(0);
    }
    __syncthreads();
    if constexpr (kFused) EPS_STAMP(kStageTermsBarrier);
    for (int chunk = 0; chunk < kChunks; ++chunk) {
      if (chunk > 0) {  // no block barrier from here on: each warp walks its own groups
        p += blockDim.x;
        open_group();
      }
      // Later chunks hold only later groups: a warp past the row's end is done.
      if (kWarpRead ? __all_sync(0xFFFFFFFFu, p >= n) : p >= n) return;
      if (!kWarpRead && !active) return;
      if constexpr (kStaged) {
        WaitStagedRecords();
        if constexpr (kFused) EPS_STAMP(kStageRecords);
        if (!active) return;
        rec = stage + threadIdx.x * kStride;  // the copy holds every word jl reads
      }
      const RecordOffsets& o = s.record;
      const bool stats_ok =
          !active || (isfinite(rec[o.fro2]) && isfinite(rec[o.max_norm]) && isfinite(rec[o.count]));
      // jl with m known: the packed Gram read once from the staged copy, 16 bytes
      // at a time, and kept in registers for every head.
      constexpr int kVectors = kM > 0 ? (kM * (kM + 1) / 2 + 3) / 4 : 1;
      float4 gram[kVectors];
      if constexpr (kMethod == Method::kJl && kM > 0 && !kStrict) {
#pragma unroll
        for (int v = 0; v < kVectors; ++v) gram[v] = reinterpret_cast<const float4*>(rec)[v];
      }
      for (int r0 = 0; r0 < ratio; r0 += kBatch) {
        const int heads = min(kBatch, ratio - r0);
        const float* q = q_sh + r0 * s.d;
        HeadSums sums;
        if constexpr (kStrict) {
          BracketSumsWarp<kHeads>(rec, o, q, qsplit_sh + r0 * s.d, heads, sums, lane);
          if (!active) continue;
        } else if constexpr (kMethod == Method::kQuest) {
          if (o.quest_min >= 0) {
            QuestSumsWarp<kHeads>(rec, o, qsplit_sh + r0 * s.d, heads, sums.quest, lane);
          }
          if (!active) continue;
        } else if constexpr (kMethod == Method::kOnePc) {
          if (HasPrincipalPair(rec, o)) PrincipalDots(rec, o, q, heads, sums.principal);
        } else if constexpr (kMethod == Method::kQuestClt) {
          if constexpr (kOctets) {
            constexpr int kStride = OctetQueryStride(kOctetD);
            QuestCltSumsOctets<kOctetD, kHeads, kQuest8>(rec, o, q_sh + r0 * kStride,
                                                         q_sh + (ratio + r0) * kStride, heads, sums,
                                                         lane, stage + warp * OctetRingWarpWords());
          } else if (kQuest8 || o.quest_min >= 0) {
            QuestCltSumsWarp<kHeads, kQuest8>(rec, o, q, heads, sums, lane);
          }
          if (!active) continue;
        }
#pragma unroll
        for (int rr = 0; rr < kBatch; ++rr) {
          if (rr >= heads) break;
          const int r = r0 + rr, h = kvh * ratio + r;
          if (a.scored != nullptr && !a.scored[layer * s.q_heads + h]) continue;
          const HeadQuery hq{terms_sh + r * words, terms_sh[r * words + s.record.packed]};
          const int64_t out =
              ((int64_t{row} * s.layers + layer) * s.q_heads + h) * s.max_groups + p;
          bool bad;
          if constexpr (kStrict) {
            const MaxScoreBracket b = BracketMaxScore(rec, o, hq, sums, rr);
            a.scores[out] = b.lower;
            a.uppers[out] = b.upper;
            bad = isnan(b.lower) || isnan(b.upper);
          } else {
            const float score = Score<kMethod, kM, kQuest8>(
                rec, reinterpret_cast<const float*>(gram), o, hq, sums, rr);
            if constexpr (kFused) {
              fused_scores[r * kScoreThreads + threadIdx.x] = score;
            } else {
              a.scores[out] = score;
            }
            // core: -inf is an empty group's score only; a record with keys scores it from
            // an infinite quest half (corruption) and would be ranked as holding none.
            bad = isnan(score) || score == INFINITY || (score == -INFINITY && rec[o.count] > 0.0f);
          }
          if (bad || !stats_ok) {
            Fail(status, a.coarse ? kBadCoarseScore : kBadScore, row, static_cast<int>(p), slot);
          }
        }
      }
    }
  }
}

// kHeads: query heads per pass of the warp-read sums (quest and strict: 4 or 8);
// the other methods take kHeadBatch per pass.
// The octet path's blocks take kOctetChunks runs of kScoreThreads groups each, so
// that what a block does once (the query terms into shared memory and registers)
// is shared by more records.
inline constexpr int kOctetChunks = 4;

template <Method kMethod, int kM, bool kStrict, int kHeads = kHeadBatch, int kOctetD = 0,
          bool kQuest8 = false>
__global__ void __launch_bounds__(kScoreThreads,
                                  (kOctetD > 0 ? (kHeads <= 4 ? 2 : 1)
                                               : kScoreMinBlocks<kMethod, kM, kStrict, kHeads>))
    ScoreKernel(Shape s, ScoreArgs a) {
  extern __shared__ __align__(16) float shared[];
  ScoreGroups<kMethod, kM, kStrict, kHeads, false, kOctetD, kQuest8,
              (kOctetD > 0 ? kOctetChunks : 1)>(s, a, shared, nullptr);
}

}  // namespace eps::gpu::kernels
