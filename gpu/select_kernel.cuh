// The selection kernel of the GPU pre-pass (gpu/step.h), keyed by the core
// `Budget`: per-head cuts, the union, compaction and the step's statistics.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/select.h"
#include "gpu/mass_select.cuh"
#include "gpu/step_shape.cuh"
#include "gpu/visit_compaction.cuh"
#include "gpu/warp_select.cuh"

namespace eps::gpu::kernels {

// Selection: one block of 256 or 1024 threads per (layer * lists + list, row).
//   1. each warp takes query heads of the list in turn and finds its cut
//      (threshold budget and strict: the top_pages-th largest value,
//      WarpKthLargest: held and extracted for rows of up to 256 groups and
//      ranks up to 32, else 8-bit radix passes; top-p: the score where the mass reaches top_p;
//      mass: the group where the covered mass reaches mass_target, within the
//      floor and ceiling); the fixed budget ranks the groups at or above that
//      value instead;
//   2. visit flags: forced groups, plus every group a head's cut admits (the
//      threshold budget over held rows: the bits each head's warp ORed from
//      its registers, WarpThresholdMarksHeld);
//   3. compaction of the visited groups' blocks into visit_blocks, and stats.
//
// Dynamic shared memory: visit flags [max_groups] (padded to 16 bytes), then
// [max_groups] words (best ranks of the fixed budget, then block offsets).
struct SelectArgs {
  const int32_t* block_table;
  const DeviceRow* rows;
  const uint8_t* scored;  // [layers, q_heads] or null
  const float* scores;    // [rows, layers, q_heads, max_groups]; strict: lower bounds
  const float* uppers;    // strict only: upper bounds
  int32_t* visit_blocks;
  int32_t* visit_count;
  StepReport* report;
  StepReport* next_report;  // cleared here for the next step
  const uint64_t* selection_done;
  uint64_t step;
  // The coarse level's candidate flags [max_batch, layers, lists, max_coarse_groups]
  // (gpu/coarse_select.cuh), or null: a group outside them is never visited.
  const uint8_t* candidates;
  int64_t max_coarse_groups;
  int64_t coarse_ratio;  // 64 bits: no padding, the launch's bytes are a key
  // Selection feedback [layers, max_seqs, q_heads, max_groups] (gpu/feedback.cuh), or
  // null: with the coarse level a group a scored head of the list has an entry for
  // competes outside the candidates too, as core/ keeps visit &= allowed | fed.
  const float* feedback;
  // epsd's own release of the step's inputs wait (GpuSelector::Finish): the number
  // of the launch it released (0: none), and this launch's number (from 1; not part
  // of a graph's key: a replay sets it). Equal: every list is -1, "attend densely".
  const uint64_t* released;
  uint64_t launch;
};

// Whether this launch's inputs wait was released by epsd's host (SelectArgs::released).
// Each block reads it once: a release that races the engine's own late signal may
// reach only some blocks, and each list is then either selected or dense, both safe.
// In two parts, so that a caller can load the word together with others.
__device__ inline uint64_t ReleaseWord(const SelectArgs& a) {
  return a.released != nullptr ? *reinterpret_cast<const volatile uint64_t*>(a.released) : 0;
}
__device__ inline bool Released(const SelectArgs& a, uint64_t word) {
  return a.released != nullptr && word == a.launch;
}
__device__ inline bool ReleasedByHost(const SelectArgs& a) { return Released(a, ReleaseWord(a)); }

template <Budget kBudget, bool kStrict, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    SelectKernel(Shape s, SelectRule rule, SelectArgs a) {
  static_assert((kBudget != Budget::kTopP && kBudget != Budget::kMass) || kWarps <= 8,
                "top-p and mass keep 2 KiB of masses per warp");
  extern __shared__ unsigned char visit[];
  __shared__ float head_cut[256];     // threshold and strict: visit when value >= cut;
                                      // mass: the head's largest score (for MassKey)
  __shared__ unsigned head_key[256];  // top-p and mass: the cut key and tie group
  __shared__ int head_tie[256];
  __shared__ unsigned counts[kWarps * 32];
  __shared__ unsigned histograms[kWarps][256];
  // Threshold, held rows: the groups admitted by each warp's heads, a bit each.
  __shared__ unsigned held_marks[kWarps][kHeldWords];
  __shared__ bool list_any_head;  // mass, list scope: the list's cut and whether a head is scored
  __shared__ unsigned list_key;
  __shared__ int list_tie;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *a.next_report = StepReport{};
  // blockIdx.x = layer * lists + list; a list unions the query heads of one KV
  // head (per-KV-head output) or of all of them (union).
  const int layer = blockIdx.x / s.lists, list = blockIdx.x % s.lists, row = blockIdx.y;
  const int64_t list_index = (int64_t{layer} * s.max_batch + row) * s.lists + list;
  // The engine gave up on this step (its client released selection_done and
  // attends densely): leave its outputs alone.
  if (a.selection_done != nullptr &&
      *reinterpret_cast<const volatile uint64_t*>(a.selection_done) >= a.step) {
    return;
  }
  if (ReleasedByHost(a)) {
    // The queries are not this step's: every list says "attend densely", and the
    // failed report keeps the feedback (ConsumeKernel) for the step that reads it.
    if (threadIdx.x == 0) {
      a.visit_count[list_index] = -1;
      if (blockIdx.x == 0 && blockIdx.y == 0) Fail(&a.report->status, kReleased, 0, 0, 0);
    }
    return;
  }
  if (a.report->status.code != kOk) {
    // The scoring kernel failed: no list is computed. With a step fence the
    // engine's stream proceeds on selection_done regardless, so each list of
    // the step says "attend densely" (-1); without one, nothing is written.
    if (a.selection_done != nullptr && threadIdx.x == 0) a.visit_count[list_index] = -1;
    return;
  }
  const int heads_per_list = s.q_heads / s.lists, first_head = list * heads_per_list;
  const int64_t tokens = a.rows[row].context_tokens;
  const int n = GroupsOf(s, tokens);
  const int64_t head_base = (int64_t{row} * s.layers + layer) * s.q_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  unsigned* offset = reinterpret_cast<unsigned*>(visit + ((s.max_groups + 15) / 16) * 16);
  auto head_scored = [&](int h) { return a.scored == nullptr || a.scored[layer * s.q_heads + h]; };
  auto forced = [&](int p) { return IsForced(p, n, rule.first_n, rule.last_n); };
  // mass, list scope: one cut over the list's summed shares instead of one per head.
  const bool list_mass = kBudget == Budget::kMass && rule.mass_list;
  // Threshold budget, rows held in registers, lists of many heads (32 warps):
  // each warp ORs the groups its heads admit into its own held_marks words
  // (WarpThresholdMarksHeld), and the visit flags OR the warps' words, instead
  // of a thread per group reading the list's heads' scores. Not for the 8-warp
  // kernel (lists of up to 8 heads), where the path took it from 32 registers
  // to 40 and per-KV-head lists read 2 % slower (g = 2, 8 × 32k, H100).
  const bool marks_held = kBudget == Budget::kThreshold && !kStrict && kWarps == 32 &&
                          n <= kHeldGroups && rule.top_pages <= kHeldRank;
  // The warp's own words, which its lane 0 ORs into (other warps read them after step 1).
  if (marks_held) {
    if (lane < kHeldWords) held_marks[warp][lane] = 0;
    __syncwarp();
  }
  // mass: this layer's budget (SelectPolicy::MassFor).
  MassRule budget{};
  if constexpr (kBudget == Budget::kMass) budget = MassRuleOf(rule, layer);

  // Fixed budget: each group's best rank over the list's heads (ranked groups only).
  unsigned* fixed_best = offset;
  __shared__ bool fixed_any_head;
  __shared__ unsigned fixed_unforced;
  if constexpr (kBudget == Budget::kFixed) {
    if (threadIdx.x == 0) {
      fixed_any_head = false;
      fixed_unforced = 0;
    }
    __syncthreads();
    unsigned local = 0;
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
      fixed_best[p] = 0xFFFFFFFFu;
      local += !forced(p);
    }
    local = __reduce_add_sync(0xFFFFFFFFu, local);
    if (lane == 0 && local > 0) atomicAdd(&fixed_unforced, local);
    __syncthreads();
  }

  // 1. Per-head cuts (threshold, strict, top-p, mass; fixed: the ranks, as above).
  {
    if constexpr (kBudget == Budget::kFixed) {
      // core MarkFixedBudget ranks the unforced groups per head (score
      // descending, ties to the more recent group). Only a group within some
      // head's top top_pages can be taken, and only groups at or above the
      // head's top_pages-th score can rank there: a warp per head finds that
      // score, then ranks each such group with one warp-wide count (n / 32 per
      // lane) and keeps each group's best rank over the list's heads.
      for (int h = first_head + warp; h < first_head + heads_per_list && !rule.method_off;
           h += warps) {
        if (!head_scored(h)) continue;
        if (lane == 0) fixed_any_head = true;
        unsigned local = 0;
        for (int p = lane; p < n; p += 32) local += !forced(p);
        if (__reduce_add_sync(0xFFFFFFFFu, local) <= static_cast<unsigned>(rule.top_pages)) {
          continue;  // every unforced group is taken (below)
        }
        const float* sc = a.scores + (head_base + h) * s.max_groups;
        const float cut = KeyToFloat(WarpKthLargest(
            sc, n, rule.top_pages, [&](int p) { return !forced(p); }, histograms[warp], lane));
        auto candidate = [&](int p) { return p < n && !forced(p) && sc[p] >= cut; };
        // Usually the candidates are top_pages groups and a few ties: with at
        // most 32, lane i takes the i-th and ranks it against the others by
        // shuffles (the warp's histogram holds them), instead of a warp-wide
        // count over every group per candidate.
        unsigned total = 0;
        for (int base = 0; base < n; base += 32) {
          total += __popc(__ballot_sync(0xFFFFFFFFu, candidate(base + lane)));
        }
        if (total <= 32) {
          unsigned* values = histograms[warp];  // [32] the candidates' scores (bits)
          unsigned* groups = values + 32;       // [32] and groups
          unsigned filled = 0;
          for (int base = 0; base < n; base += 32) {
            const int p = base + lane;
            const bool mine = candidate(p);
            const unsigned took = __ballot_sync(0xFFFFFFFFu, mine);
            if (mine) {
              const unsigned slot = filled + __popc(took & ((1u << lane) - 1u));
              values[slot] = __float_as_uint(sc[p]);
              groups[slot] = static_cast<unsigned>(p);
            }
            filled += __popc(took);
          }
          __syncwarp();
          const bool held = static_cast<unsigned>(lane) < total;
          const float v = held ? __uint_as_float(values[lane]) : -INFINITY;
          const int c = held ? static_cast<int>(groups[lane]) : -1;
          unsigned rank = 0;
          for (unsigned j = 0; j < total; ++j) {
            const float vj = __shfl_sync(0xFFFFFFFFu, v, static_cast<int>(j));
            const int cj = __shfl_sync(0xFFFFFFFFu, c, static_cast<int>(j));
            rank += vj > v || (vj == v && cj > c);
          }
          if (held && rank < static_cast<unsigned>(rule.top_pages)) atomicMin(&fixed_best[c], rank);
          __syncwarp();  // the next head's select clears the histogram
          continue;
        }
        for (int base = 0; base < n; base += 32) {
          const int p = base + lane;
          unsigned candidates = __ballot_sync(0xFFFFFFFFu, p < n && !forced(p) && sc[p] >= cut);
          while (candidates != 0) {
            const int c = base + __ffs(candidates) - 1;
            candidates &= candidates - 1;
            const float mine = sc[c];
            unsigned above = 0;
            for (int q = lane; q < n; q += 32) {
              const float v = sc[q];
              above += !forced(q) && (v > mine || (v == mine && q > c));
            }
            const unsigned rank = __reduce_add_sync(0xFFFFFFFFu, above);
            if (lane == 0 && rank < static_cast<unsigned>(rule.top_pages)) {
              atomicMin(&fixed_best[c], rank);
            }
          }
        }
      }
    } else if constexpr (kBudget == Budget::kTopP || kBudget == Budget::kMass) {
      __shared__ double masses[kWarps][256];
      if constexpr (kBudget == Budget::kMass) {
        if (list_mass && !rule.method_off) {
          // core MarkByMassList: a warp per head finds its largest score and
          // total W; a thread per group sums its share σ_p = Σ_h w_hp / W_h over
          // the heads in order (as core/) into `offset`, which compaction reuses
          // later; one warp walks the shares to the list's cut.
          __shared__ double head_total[256];
          for (int h = first_head + warp; h < first_head + heads_per_list; h += warps) {
            float top = 0.0f;
            double total = 0.0;  // unscored heads add nothing
            if (head_scored(h)) {
              WarpHeadMass(a.scores + (head_base + h) * s.max_groups, n, budget.inv_scale, lane,
                           &top, &total);
            }
            if (lane == 0) {
              head_cut[h - first_head] = top;
              head_total[h - first_head] = total;
            }
          }
          if (threadIdx.x == 0) list_any_head = false;
          __syncthreads();
          float* share = reinterpret_cast<float*>(offset);
          for (int p = threadIdx.x; p < n; p += blockDim.x) {
            double sum = 0.0;
            for (int i = 0; i < heads_per_list; ++i) {
              if (!(head_total[i] > 0.0)) continue;
              const float value = a.scores[(head_base + first_head + i) * s.max_groups + p];
              if (MassKey(value, head_cut[i], budget.inv_scale) == 0) continue;
              sum += exp((static_cast<double>(value) - static_cast<double>(head_cut[i])) *
                         budget.inv_scale) /
                     head_total[i];
            }
            share[p] = static_cast<float>(sum);
          }
          for (int i = threadIdx.x; i < heads_per_list; i += blockDim.x) {
            if (head_scored(first_head + i)) list_any_head = true;
          }
          __syncthreads();
          if (warp == 0) {
            unsigned key = kMassNoneKey;
            int tie = kMassNoneTie;
            if (list_any_head) {
              WarpListMassCut(share, n, rule, budget, histograms[0], masses[0], lane, &key, &tie);
            }
            if (lane == 0) {
              list_key = key;
              list_tie = tie;
            }
          }
        }
      }
      for (int h = first_head + warp;
           h < first_head + heads_per_list && !rule.method_off && !list_mass; h += warps) {
        // Unscored heads take nothing.
        unsigned key = kBudget == Budget::kTopP ? 0xFFFFFFFFu : kMassNoneKey;
        int tie = kBudget == Budget::kTopP ? -1 : kMassNoneTie;
        float top = 0.0f;
        if (head_scored(h)) {
          const float* sc = a.scores + (head_base + h) * s.max_groups;
          if constexpr (kBudget == Budget::kTopP) {
            WarpTopPCut(sc, n, rule, histograms[warp], masses[warp], lane, &key, &tie);
          } else {
            WarpMassCut(sc, n, rule, budget, histograms[warp], masses[warp], lane, &top, &key,
                        &tie);
          }
        }
        if (lane == 0) {
          head_key[h - first_head] = key;
          head_tie[h - first_head] = tie;
          head_cut[h - first_head] = top;
        }
      }
    } else {
      for (int h = first_head + warp; h < first_head + heads_per_list && !rule.method_off;
           h += warps) {
        float cut = INFINITY;  // unscored heads admit nothing
        if (head_scored(h)) {
          const float* values = a.scores + (head_base + h) * s.max_groups;
          if constexpr (kStrict) {
            // core MarkStrict: L = the top_pages-th largest lower bound over all
            // groups; every group whose upper bound reaches L is visited.
            cut = -INFINITY;
            if (n > rule.top_pages) {
              cut = KeyToFloat(WarpKthLargest(
                  values, n, rule.top_pages, [](int) { return true; }, histograms[warp], lane));
            }
          } else if (marks_held) {
            WarpThresholdMarksHeld(values, n, rule, lane, held_marks[warp]);
          } else {
            // core MarkByThreshold: visit every unforced group with score >= the cut.
            cut = WarpThresholdCut(values, n, rule, histograms[warp], lane);
          }
        }
        if (lane == 0) head_cut[h - first_head] = cut;
      }
    }
    __syncthreads();
  }

  // 2. Visit flags. Held marks: warp w < kHeldWords ORs word w of every warp's
  // marks (lane l reads warp l's), the word of its own threads' groups
  // (p = threadIdx.x: n <= kHeldGroups < blockDim.x).
  if (marks_held) {
    if (warp < kHeldWords) {
      const unsigned marked =
          __reduce_or_sync(0xFFFFFFFFu, lane < warps ? held_marks[lane][warp] : 0u);
      const int p = threadIdx.x;
      if (p < n) visit[p] = rule.method_off || forced(p) || ((marked >> lane) & 1u);
    }
  } else {
    for (int p = threadIdx.x; p < n; p += blockDim.x) visit[p] = rule.method_off || forced(p);
  }
  __syncthreads();
  if constexpr (kBudget == Budget::kFixed) {
    // Take the top_pages groups of best rank over the list's heads (ties to
    // the more recent group); all unforced groups when there are no more.
    if (fixed_any_head) {
      const unsigned unforced = fixed_unforced;
      for (int p = threadIdx.x; p < n; p += blockDim.x) {
        if (forced(p)) continue;
        bool take = unforced <= static_cast<unsigned>(rule.top_pages);
        if (!take && fixed_best[p] != 0xFFFFFFFFu) {
          unsigned before = 0;
          for (int q = 0; q < n; ++q) {
            before += fixed_best[q] != 0xFFFFFFFFu &&
                      (fixed_best[q] < fixed_best[p] || (fixed_best[q] == fixed_best[p] && q > p));
          }
          take = before < static_cast<unsigned>(rule.top_pages);
        }
        if (take) visit[p] = 1;
      }
    }
    __syncthreads();
  } else {
    for (int p = threadIdx.x; p < n && !rule.method_off && list_mass; p += blockDim.x) {
      // mass, list scope: the list's one cut over the shares (written in step 1).
      if (!visit[p] &&
          MassTaken(ShareKey(reinterpret_cast<const float*>(offset)[p]), p, list_key, list_tie)) {
        visit[p] = 1;
      }
    }
    for (int p = threadIdx.x; p < n && !rule.method_off && !list_mass && !marks_held;
         p += blockDim.x) {
      if (visit[p]) continue;
      bool v = false;
      // The group's value for each head of the list, one max_groups apart.
      const float* column =
          (kStrict ? a.uppers : a.scores) + (head_base + first_head) * s.max_groups + p;
      for (int i = 0; i < heads_per_list && !v; ++i, column += s.max_groups) {
        const float value = *column;
        if constexpr (kBudget == Budget::kTopP) {
          const unsigned key = OrderedKey(value);
          v = key > head_key[i] || (key == head_key[i] && p <= head_tie[i]);
        } else if constexpr (kBudget == Budget::kMass) {
          v = MassTaken(MassKey(value, head_cut[i], budget.inv_scale), p, head_key[i], head_tie[i]);
        } else {
          v = value >= head_cut[i];
        }
      }
      if (v) visit[p] = 1;
    }
    __syncthreads();
  }

  // With the coarse level, groups outside the list's candidates were never scored
  // (−∞): a rule that took them (fewer candidates than its budget or floor) gives
  // them up, as core/ does, unless a head of the list has feedback for them; forced
  // groups lie in candidates.
  if (a.candidates != nullptr) {
    const uint8_t* candidate =
        a.candidates + ((int64_t{row} * s.layers + layer) * s.lists + list) * a.max_coarse_groups;
    const int ratio = static_cast<int>(a.coarse_ratio);
    const float* entries =
        a.feedback == nullptr ? nullptr
                              : a.feedback + (int64_t{layer} * s.max_seqs + a.rows[row].table_row) *
                                                 s.q_heads * s.max_groups;
    auto fed = [&](int p) {
      for (int h = first_head; entries != nullptr && h < first_head + heads_per_list; ++h) {
        if (head_scored(h) && fabsf(entries[int64_t{h} * s.max_groups + p]) <= kFeedbackMax) {
          return true;  // core IsFeedback
        }
      }
      return false;
    };
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
      if (visit[p] && !candidate[p / ratio] && !fed(p)) visit[p] = 0;
    }
    __syncthreads();
  }

  // 3. Compaction into the list's place in the outputs, and the statistics.
  CompactVisitList(s, n, tokens, visit, offset, counts, a.block_table, a.rows + row,
                   a.visit_blocks + list_index * s.max_blocks, a.visit_count + list_index,
                   &a.report->stats);
}

}  // namespace eps::gpu::kernels
