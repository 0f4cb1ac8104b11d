// Warp-wide order statistics for the selection kernel (gpu/select_kernel.cuh):
// the k-th largest score (held in registers and extracted for rows of up to 256
// groups and ranks up to 32, else by 8-bit radix passes), the threshold budget's
// cut, and the top-p cut by radix passes over estimated attention mass.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gpu/step_shape.cuh"

namespace eps::gpu::kernels {

// One layer's mass budget (core MassSetting; MarkByMass, MarkByMassList): 1/(τ·sqrt(d))
// in double as core MassInvScale rounds it, target p, and the floor and ceiling of
// unforced groups per head or list (max_pages 0: none).
struct MassRule {
  double inv_scale;
  float target;
  int min_pages, max_pages;
};

struct SelectRule {
  bool method_off;  // visit everything
  float alpha;
  int first_n, last_n, top_pages;
  float top_p;
  float inv_sqrt_d;  // top-p: 1/sqrt(d), rounded on the host as core/ does
  MassRule mass;     // the mass budget of every layer, unless mass_layers
  // Or one per layer (SelectPolicy::mass_layers), [layers] on the device: written
  // before each step, so a replayed graph reads the step's own (the pointer is fixed).
  const MassRule* mass_layers;
  bool mass_list;  // mass_scope = list (core MarkByMassList): one cut over the list's heads
};

// The mass budget of `layer`: its own entry when the policy gives one per layer.
__device__ inline MassRule MassRuleOf(const SelectRule& rule, int layer) {
  return rule.mass_layers != nullptr ? rule.mass_layers[layer] : rule.mass;
}

// Float -> unsigned key with the same order.
__device__ inline unsigned OrderedKey(float f) {
  const unsigned bits = __float_as_uint(f);
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}
__device__ inline float KeyToFloat(unsigned key) {
  return __uint_as_float((key & 0x80000000u) ? key & 0x7FFFFFFFu : ~key);
}

// Adds one group a lane (`member`: whether it counts; `bin` in [0, 256), `w` its mass)
// to the warp's bins, in a fixed order: the groups of one call in ascending lane
// order, calls in program order. Every lane of the warp calls it together. A bin's
// sum then does not depend on how the lanes were scheduled: double atomics from
// lanes that had diverged landed in any order, and the mass walks' cut could move
// between two runs of the same step (a graph replay and direct launches differed,
// H100, 2026-11-27).
__device__ inline void WarpBinAdd(bool member, unsigned bin, double w, unsigned* counts,
                                  double* masses, int lane) {
  const unsigned peers = __match_any_sync(0xFFFFFFFFu, member ? bin : 256u + lane);
  double sum = w;
  if (__any_sync(0xFFFFFFFFu, __popc(peers) > 1)) {  // lanes sharing a bin: in lane order
    sum = 0.0;
    for (int src = 0; src < 32; ++src) {
      const double v = __shfl_sync(0xFFFFFFFFu, w, src);
      if ((peers >> src) & 1u) sum += v;
    }
  }
  if (member && lane == __ffs(peers) - 1) {  // one lane a bin: no two write one word
    counts[bin] += __popc(peers);
    masses[bin] += sum;
  }
  __syncwarp();
}

// Finds, walking 256 histogram bins from the top, the bin where the running sum
// (started at `base`) reaches `target`: lane l holds bins [8l, 8l + 8), a warp
// scan from lane 31 down finds the lane where the sum crosses, and that lane
// walks its 8 bins. Empty bins (count 0) are passed over. Returns the bin and
// the sum of the bins above it (plus base) to every lane, or bin -1 when the
// total never reaches the target.
template <typename T>
__device__ void WarpWalkBins(const unsigned* counts, const T* values, T base, T target, int lane,
                             int* bin, T* above) {
  T own = 0;
  for (int b = 8 * lane; b < 8 * lane + 8; ++b) own += counts[b] != 0 ? values[b] : T{0};
  T inclusive = own;  // sum over lanes >= this one
  for (int o = 1; o < 32; o *= 2) {
    const T down = __shfl_down_sync(0xFFFFFFFFu, inclusive, o);
    if (lane + o < 32) inclusive += down;
  }
  const unsigned crossed = __ballot_sync(0xFFFFFFFFu, base + inclusive >= target);
  int chosen = -1;
  T chosen_above = 0;
  if (crossed != 0) {
    const int crossing = 31 - __clz(crossed);  // the highest lane whose sum reaches the target
    if (lane == crossing) {
      T acc = base + (inclusive - own);
      int last = -1;
      T last_above = acc;
      for (int b = 8 * lane + 7; b >= 8 * lane; --b) {
        if (counts[b] == 0) continue;
        if (acc + values[b] >= target) {
          chosen = b;
          chosen_above = acc;
          break;
        }
        last = b;
        last_above = acc;
        acc += values[b];
      }
      if (chosen < 0) {  // rounding between the scan and the walk: the lane's lowest bin
        chosen = last;
        chosen_above = last_above;
      }
    }
    chosen = __shfl_sync(0xFFFFFFFFu, chosen, crossing);
    chosen_above = __shfl_sync(0xFFFFFFFFu, chosen_above, crossing);
  }
  *bin = chosen;
  *above = chosen_above;
}

// The k-th largest of the keys `key(p)` (1-based) among the groups p < n that
// `take(p)` admits, by four 8-bit radix passes of a warp-wide histogram. Needs
// at least k such groups. `rank` (when given) receives the k-th's rank among
// the groups with its key (1-based), for a caller that breaks ties by group.
template <typename Key, typename Take>
__device__ __forceinline__ unsigned WarpKthLargestKey(int n, unsigned k, Key key, Take take,
                                                      unsigned* histogram, int lane,
                                                      unsigned* rank = nullptr) {
  unsigned prefix = 0, prefix_mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = lane; b < 256; b += 32) histogram[b] = 0;
    __syncwarp();
    for (int p = lane; p < n; p += 32) {
      const unsigned kp = key(p);
      if (take(p) && (kp & prefix_mask) == prefix) atomicAdd(&histogram[(kp >> shift) & 0xFFu], 1u);
    }
    __syncwarp();
    int chosen;
    unsigned before;
    WarpWalkBins<unsigned>(histogram, histogram, 0u, k, lane, &chosen, &before);
    prefix |= static_cast<unsigned>(max(chosen, 0)) << shift;
    prefix_mask |= 0xFFu << shift;
    k -= before;
    __syncwarp();
  }
  if (rank != nullptr) *rank = k;
  return prefix;
}

// The k-th largest of the keys a warp holds (kHeld per lane; 0 for a group not
// taken, below every real key), by extraction: each lane sorts its own, then k
// rounds take the warp's largest head (one REDUX) and the lanes that held it
// drop it. About 13 instructions a round and no shared memory: for small k it
// is a fraction of WarpKthLargestKey's four histogram passes. Needs at least k
// keys taken.
template <int kHeld>
__device__ __forceinline__ unsigned WarpKthLargestHeld(unsigned (&key)[kHeld], unsigned k) {
#pragma unroll
  for (int pass = 0; pass < kHeld; ++pass) {  // odd-even transposition sort, descending
#pragma unroll
    for (int j = pass & 1; j + 1 < kHeld; j += 2) {
      const unsigned hi = max(key[j], key[j + 1]), lo = min(key[j], key[j + 1]);
      key[j] = hi;
      key[j + 1] = lo;
    }
  }
  // Each round every lane holding the warp's largest key drops it, and `taken`
  // counts the keys dropped so far, ties included: the k-th largest is the round's
  // key when `taken` reaches k. The next round waits only for the drop, not for
  // the count (a lane's own test), so its chain is REDUX, a test and the moves.
  unsigned kth = 0, taken = 0;
  for (unsigned round = 0; round < k; ++round) {
    const unsigned top = __reduce_max_sync(0xFFFFFFFFu, key[0]);
    const bool holds = key[0] == top;
    const unsigned now = taken + __popc(__ballot_sync(0xFFFFFFFFu, holds));
    if (taken < k && now >= k) kth = top;
    taken = now;
    if (holds) {
#pragma unroll
      for (int j = 0; j + 1 < kHeld; ++j) key[j] = key[j + 1];
      key[kHeld - 1] = 0;
    }
  }
  return kth;
}

// core MarkByThreshold's cut from T, the top_pages-th largest unforced score:
// T/α, or T·α when T <= 0 (so the cut stays below T).
__device__ inline float ThresholdCutOf(float t, const SelectRule& rule) {
  return t > 0.0f ? t / rule.alpha : t * rule.alpha;
}

// Rows of at most this many groups, cut at a rank of at most kHeldRank, take
// WarpKthLargestHeld (32k tokens at g = 8 with top_pages 16: the benchmark's shape).
inline constexpr int kHeldGroups = 256, kHeldRank = 32;

// The k-th largest score's key among the groups `take(p)` admits: held in
// registers and extracted for small rows and ranks, else by radix passes.
template <typename Take>
__device__ unsigned WarpKthLargest(const float* values, int n, unsigned k, Take take,
                                   unsigned* histogram, int lane) {
  if (n <= kHeldGroups && k <= static_cast<unsigned>(kHeldRank)) {
    constexpr int kHeld = kHeldGroups / 32;
    unsigned key[kHeld];
#pragma unroll
    for (int j = 0; j < kHeld; ++j) {
      const int p = lane + 32 * j;
      key[j] = p < n && take(p) ? OrderedKey(values[p]) : 0u;  // a score's key is never 0
    }
    return WarpKthLargestHeld(key, k);
  }
  return WarpKthLargestKey(
      n, k, [&](int p) { return OrderedKey(values[p]); }, take, histogram, lane);
}

// Words of bits a held row's marks take: bit `lane` of word j is group 32 j + lane.
inline constexpr int kHeldWords = kHeldGroups / 32;

// core MarkByThreshold for one head of a row held in registers (n <= kHeldGroups,
// top_pages <= kHeldRank): the cut as WarpThresholdCut finds it, and the groups it
// admits (unforced, score >= cut) ORed into `marks` [kHeldWords] (shared memory,
// the warp's own), a ballot per word. The selection kernel's union of a list's
// heads is then an OR of the warps' words instead of a thread per group reading
// each head's score in turn (one dependent load per head). The scores are read
// again for the ballots (each lane's 8 loads at once, from L1) rather than kept
// beside the sorted keys: the 1,024-thread selection kernel keeps two blocks per
// SM only within 32 registers.
// (WarpThresholdCut followed by a ballot loop, the fused kernel's path above
// kHeldRank, gives the same bits but compiled to 64 registers in the selection
// kernel, half its blocks per SM.)
__device__ __forceinline__ void WarpThresholdMarksHeld(const float* values, int n,
                                                       const SelectRule& rule, int lane,
                                                       unsigned* marks) {
  auto open = [&](int p) { return p < n && !IsForced(p, n, rule.first_n, rule.last_n); };
  float cut = -INFINITY;  // no more than top_pages unforced groups: every one
  {
    unsigned key[kHeldWords];
    unsigned unforced = 0;
#pragma unroll
    for (int j = 0; j < kHeldWords; ++j) {
      const int p = lane + 32 * j;
      key[j] = open(p) ? OrderedKey(values[p]) : 0u;  // a score's key is never 0
      unforced += key[j] != 0u;
    }
    if (__reduce_add_sync(0xFFFFFFFFu, unforced) > static_cast<unsigned>(rule.top_pages)) {
      cut = ThresholdCutOf(KeyToFloat(WarpKthLargestHeld(key, rule.top_pages)), rule);
    }
  }
  float value[kHeldWords];
#pragma unroll
  for (int j = 0; j < kHeldWords; ++j) {
    const int p = lane + 32 * j;
    value[j] = p < n ? values[p] : -INFINITY;
  }
  // The warp's own words, no atomics (a shared atomic from lane 0 compiled to a
  // warp-aggregated one, ~12 instructions a word).
#pragma unroll
  for (int j = 0; j < kHeldWords; ++j) {
    const unsigned bits = __ballot_sync(0xFFFFFFFFu, open(lane + 32 * j) && value[j] >= cut);
    if (lane == 0) marks[j] |= bits;
  }
}

// The k-th largest of the values of the groups p < n that `open(p)` admits, or
// −∞ when no more than k are admitted (every one of them passes). Every lane
// returns it. The threshold budget's T (WarpThresholdCut) and the coarse
// level's candidate cut (gpu/coarse_select.cuh, α = 1) both take it.
template <typename Open>
__device__ __forceinline__ float WarpKthOpenValue(const float* values, int n, unsigned k, Open open,
                                                  unsigned* histogram, int lane) {
  unsigned local = 0;
  for (int p = lane; p < n; p += 32) local += open(p);
  if (__reduce_add_sync(0xFFFFFFFFu, local) <= k) return -INFINITY;
  return KeyToFloat(WarpKthLargest(values, n, k, open, histogram, lane));
}

// core MarkByThreshold's cut for one head: T = the top_pages-th largest unforced
// score, cut T/α (T·α when T <= 0); −∞ (every unforced group) when no more than
// top_pages groups are unforced. Every lane returns it.
__device__ __forceinline__ float WarpThresholdCut(const float* values, int n,
                                                  const SelectRule& rule, unsigned* histogram,
                                                  int lane) {
  auto unforced = [&](int p) { return !IsForced(p, n, rule.first_n, rule.last_n); };
  // −∞ stays −∞ through ThresholdCutOf (α > 0).
  return ThresholdCutOf(
      WarpKthOpenValue(values, n, static_cast<unsigned>(rule.top_pages), unforced, histogram, lane),
      rule);
}

// core MarkTopP for one head: the estimated mass w_p = exp((s_p - s_max)/sqrt(d))
// of the unforced groups, taken by decreasing score (ties by increasing group)
// until their share reaches top_p. Returns the cut as (key, tie): group p is
// taken when key_p > key, or key_p == key and p <= tie. Masses are summed in
// double, in another order than core/'s (the bins in WarpBinAdd's fixed order: the
// same cut on every run), so a group at the cut may differ from core/'s.
__device__ inline void WarpTopPCut(const float* sc, int n, const SelectRule& rule, unsigned* counts,
                                   double* masses, int lane, unsigned* cut_key, int* cut_tie) {
  float top = -INFINITY;
  bool any = false;
  for (int p = lane; p < n; p += 32) {
    if (!IsForced(p, n, rule.first_n, rule.last_n)) {
      top = fmaxf(top, sc[p]);
      any = true;
    }
  }
  for (int o = 16; o > 0; o /= 2) top = fmaxf(top, __shfl_xor_sync(0xFFFFFFFFu, top, o));
  if (!__any_sync(0xFFFFFFFFu, any)) {  // no unforced group: nothing to take
    *cut_key = 0xFFFFFFFFu;
    *cut_tie = -1;
    return;
  }
  auto mass = [&](int p) {
    return exp(static_cast<double>(sc[p] - top) * static_cast<double>(rule.inv_sqrt_d));
  };
  double total = 0.0;
  for (int p = lane; p < n; p += 32) {
    if (!IsForced(p, n, rule.first_n, rule.last_n)) total += mass(p);
  }
  for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xFFFFFFFFu, total, o);
  const double target = MassGoal(rule.top_p, total);  // core/bounds.h
  // Radix walk over keys from the top: the bin where the mass above plus the
  // bin's reaches the target; with rounding short of it, the lowest bin.
  unsigned prefix = 0, prefix_mask = 0;
  double above = 0.0;  // mass of the unforced groups with a key above the prefix range
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = lane; b < 256; b += 32) {
      counts[b] = 0;
      masses[b] = 0.0;
    }
    __syncwarp();
    for (int base = 0; base < n; base += 32) {  // the same trip count on every lane
      const int p = base + lane;
      const unsigned key = p < n ? OrderedKey(sc[p]) : 0u;
      const bool member =
          p < n && !IsForced(p, n, rule.first_n, rule.last_n) && (key & prefix_mask) == prefix;
      WarpBinAdd(member, (key >> shift) & 0xFFu, member ? mass(p) : 0.0, counts, masses, lane);
    }
    __syncwarp();
    int chosen;
    double chosen_above;
    WarpWalkBins<double>(counts, masses, above, target, lane, &chosen, &chosen_above);
    if (chosen < 0) {  // rounding kept the sum short of the target: the lowest bin
      const unsigned nonempty = __ballot_sync(
          0xFFFFFFFFu, counts[8 * lane] | counts[8 * lane + 1] | counts[8 * lane + 2] |
                           counts[8 * lane + 3] | counts[8 * lane + 4] | counts[8 * lane + 5] |
                           counts[8 * lane + 6] | counts[8 * lane + 7]);
      const int low_lane = __ffs(nonempty) - 1;
      double own = 0.0;
      int low_bin = 8 * lane + 7;
      for (int b = 8 * lane + 7; b >= 8 * lane; --b) {
        if (counts[b] == 0) continue;
        low_bin = b;
        own += masses[b];
      }
      own -= counts[low_bin] != 0 ? masses[low_bin] : 0.0;  // the bins above the lowest one
      double higher = 0.0;                                  // lanes above low_lane
      for (int b = 8 * low_lane + 8; b < 256; ++b) higher += counts[b] != 0 ? masses[b] : 0.0;
      chosen = __shfl_sync(0xFFFFFFFFu, low_bin, low_lane);
      chosen_above = above + higher + __shfl_sync(0xFFFFFFFFu, own, low_lane);
    }
    above = chosen_above;
    prefix |= static_cast<unsigned>(chosen) << shift;
    prefix_mask |= 0xFFu << shift;
    __syncwarp();
  }
  // Among the groups at the cut key, in group order: the one where the mass
  // reaches the target (all of them when rounding never gets there).
  int tie = n;
  for (int base = 0; base < n; base += 32) {
    const int p = base + lane;
    double w = 0.0;
    if (p < n && !IsForced(p, n, rule.first_n, rule.last_n) && OrderedKey(sc[p]) == prefix) {
      w = mass(p);
    }
    double inclusive = w;
    for (int o = 1; o < 32; o *= 2) {
      const double up = __shfl_up_sync(0xFFFFFFFFu, inclusive, o);
      if (lane >= o) inclusive += up;
    }
    const unsigned reached = __ballot_sync(0xFFFFFFFFu, w > 0.0 && above + inclusive >= target);
    if (reached != 0) {
      tie = base + __ffs(reached) - 1;
      break;
    }
    above += __shfl_sync(0xFFFFFFFFu, inclusive, 31);
  }
  *cut_key = prefix;
  *cut_tie = tie;
}

// kWarps warps per block: 32 for lists of many heads (a union), so each warp
// finds one head's cut, 8 otherwise (and for top-p and mass, whose double
// histograms would not fit 32 warps' static shared memory).

}  // namespace eps::gpu::kernels
