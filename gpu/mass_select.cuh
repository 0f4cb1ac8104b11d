// The mass budget on the device (core MarkByMass and MarkByMassList,
// docs/policy-selection.md "Mass budget"): one warp finds one head's cut, or one list's
// cut over its heads' shares, for the selection kernel (gpu/select_kernel.cuh).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "gpu/step_shape.cuh"
#include "gpu/warp_select.cuh"

namespace eps::gpu::kernels {

// Logits (s_p − s_max)/(τ·sqrt(d)) below this have a mass of 0 here: exp in
// double underflows to 0 near −745.13 and is subnormal just above, so core/'s
// masses there are at most 5e-324, too small to move any sum.
constexpr double kMassMinLogit = -745.0;

// A group's place in core MarkByMass's order (decreasing mass, ties to the more
// recent group) as a key, larger first: the score's ordered key for a group of
// positive mass (the mass rises with the score), 0 for a group of mass 0 (an
// empty group, score −∞, or one past kMassMinLogit), which all tie. The ties
// within a key go to the higher group index. `top` is the head's largest score;
// when it is −∞ the logit is NaN and every group has mass 0, as in core/.
__device__ inline unsigned MassKey(float score, float top, double inv_scale) {
  const double logit = (static_cast<double>(score) - static_cast<double>(top)) * inv_scale;
  return logit >= kMassMinLogit ? OrderedKey(score) : 0u;
}

// Whether a group of key `key` is among the taken groups of a head whose cut is
// (cut_key, cut_tie): the groups before it in the order, and it.
__device__ inline bool MassTaken(unsigned key, int p, unsigned cut_key, int cut_tie) {
  return key > cut_key || (key == cut_key && p >= cut_tie);
}

// The cut that takes nothing: no key reaches it (the largest score key, +∞'s,
// is 0xFF800000).
constexpr unsigned kMassNoneKey = 0xFFFFFFFFu;
constexpr int kMassNoneTie = INT_MAX;

// One head's largest score and total mass W = Σ_p w_p, w_p = exp((s_p − s_max)·
// inv_scale) (0 for a group whose MassKey is 0), to every lane of the warp.
__device__ inline void WarpHeadMass(const float* sc, int n, double inv_scale, int lane,
                                    float* top_out, double* total_out) {
  float top = -INFINITY;
  for (int p = lane; p < n; p += 32) top = fmaxf(top, sc[p]);
  for (int o = 16; o > 0; o /= 2) top = fmaxf(top, __shfl_xor_sync(0xFFFFFFFFu, top, o));
  double total = 0.0;
  for (int p = lane; p < n; p += 32) {
    if (MassKey(sc[p], top, inv_scale) != 0) {
      total += exp((static_cast<double>(sc[p]) - static_cast<double>(top)) * inv_scale);
    }
  }
  for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xFFFFFFFFu, total, o);
  *top_out = top;
  *total_out = total;
}

// core TakeByMass for one warp: the unforced groups, in the order of key(p)
// (larger first, ties to the higher group index), are taken while `covered`
// (the forced groups' mass) plus their mass(p, key) stays short of goal (k0 of
// them), then k = min(ceiling, max(min_pages, k0)) are taken. Returns the cut
// as (key, tie): an unforced group p is taken when MassTaken(key(p), p, key,
// tie). Masses are summed in double in another order than core/'s (the bins in
// WarpBinAdd's fixed order: the same cut on every run), so the k0-th group may differ from core/'s
// when its partial sum sits within rounding of the goal; the floor and ceiling are exact counts.
// `counts` is [256] and `masses` [256], the warp's own.
template <class Unforced, class Key, class Mass>
__device__ void WarpMassWalk(int n, Unforced unforced, Key key, Mass mass, double covered,
                             double goal, const MassRule& budget, unsigned* counts, double* masses,
                             int lane, unsigned* cut_key, int* cut_tie) {
  unsigned local_unforced = 0;
  for (int p = lane; p < n; p += 32) local_unforced += unforced(p);
  const unsigned u = __reduce_add_sync(0xFFFFFFFFu, local_unforced);

  // k0: the groups taken before the covered mass reaches the goal. A radix walk
  // over the keys from the top finds the key where C plus the mass above and
  // at it reaches the goal, then the walk over that key's groups from the most
  // recent one finds the group. When rounding keeps a sum short of the goal,
  // the whole range walked so far is taken (core/ takes every group when it
  // never reaches the goal).
  unsigned k0 = 0;
  unsigned prefix = 0;
  int tie = 0;           // with prefix: the cut of the k0 groups
  bool exact = false;    // a walk to one group succeeded
  if (covered < goal) {  // else core/ takes none beyond the floor
    unsigned prefix_mask = 0;
    double above = covered;  // C and the mass of the keys above the prefix's range
    bool reached = true;
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = lane; b < 256; b += 32) {
        counts[b] = 0;
        masses[b] = 0.0;
      }
      __syncwarp();
      for (int base = 0; base < n; base += 32) {  // the same trip count on every lane
        const int p = base + lane;
        const bool counted = p < n && unforced(p);
        const unsigned k = counted ? key(p) : 0u;
        const bool member = counted && (k & prefix_mask) == prefix;
        WarpBinAdd(member, (k >> shift) & 0xFFu, member ? mass(p, k) : 0.0, counts, masses, lane);
      }
      __syncwarp();
      int chosen;
      double chosen_above;
      WarpWalkBins<double>(counts, masses, above, goal, lane, &chosen, &chosen_above);
      __syncwarp();  // every lane has read the bins before the next pass clears them
      if (chosen < 0) {
        reached = false;
        break;
      }
      above = chosen_above;
      prefix |= static_cast<unsigned>(chosen) << shift;
      prefix_mask |= 0xFFu << shift;
    }
    if (reached) {
      // The groups at the key, from the most recent: a suffix scan per 32 groups.
      for (int base = (n - 1) / 32 * 32; base >= 0 && !exact; base -= 32) {
        const int p = base + lane;
        const bool member = p < n && unforced(p) && key(p) == prefix;
        const double w = member ? mass(p, prefix) : 0.0;
        double suffix = w;  // over this lane and the ones above it
        for (int o = 1; o < 32; o *= 2) {
          const double down = __shfl_down_sync(0xFFFFFFFFu, suffix, o);
          if (lane + o < 32) suffix += down;
        }
        const unsigned hit = __ballot_sync(0xFFFFFFFFu, member && above + suffix >= goal);
        if (hit != 0) {
          tie = base + 31 - __clz(hit);
          exact = true;
        }
        above += __shfl_sync(0xFFFFFFFFu, suffix, 0);
      }
    }
    unsigned local = 0;
    for (int p = lane; p < n; p += 32) local += unforced(p) && MassTaken(key(p), p, prefix, tie);
    k0 = __reduce_add_sync(0xFFFFFFFFu, local);
  }

  // The floor and the ceiling, as counts in the same order.
  const unsigned ceiling =
      budget.max_pages > 0 ? min(u, static_cast<unsigned>(budget.max_pages)) : u;
  const unsigned k = min(ceiling, max(static_cast<unsigned>(budget.min_pages), k0));
  if (k == 0) {
    *cut_key = kMassNoneKey;
    *cut_tie = kMassNoneTie;
    return;
  }
  if (exact && k == k0) {
    *cut_key = prefix;
    *cut_tie = tie;
    return;
  }
  // The k-th group: its key by radix select, then the rank-th group of that
  // key counted from the most recent.
  unsigned rank;
  const unsigned kth = WarpKthLargestKey(n, k, key, unforced, counts, lane, &rank);
  int kth_tie = 0;
  for (int base = (n - 1) / 32 * 32; base >= 0; base -= 32) {
    const int p = base + lane;
    unsigned members = __ballot_sync(0xFFFFFFFFu, p < n && unforced(p) && key(p) == kth);
    const unsigned here = __popc(members);
    if (rank <= here) {
      for (unsigned skip = 1; skip < rank; ++skip) members &= ~(1u << (31 - __clz(members)));
      kth_tie = base + 31 - __clz(members);
      break;
    }
    rank -= here;
  }
  *cut_key = kth;
  *cut_tie = kth_tie;
}

// core MarkByMass for one head under its layer's budget `mass`: w_p as in
// WarpHeadMass, goal = target·W, the order of MassKey. Returns the head's largest
// score (for MassKey) and the cut.
__device__ inline void WarpMassCut(const float* sc, int n, const SelectRule& rule,
                                   const MassRule& budget, unsigned* counts, double* masses,
                                   int lane, float* top_out, unsigned* cut_key, int* cut_tie) {
  const double inv_scale = budget.inv_scale;
  float top;
  double total;
  WarpHeadMass(sc, n, inv_scale, lane, &top, &total);
  *top_out = top;
  auto unforced = [&](int p) { return !IsForced(p, n, rule.first_n, rule.last_n); };
  auto key = [=](int p) { return MassKey(sc[p], top, inv_scale); };
  auto mass = [=](int p, unsigned k) {
    return k != 0 ? exp((static_cast<double>(sc[p]) - static_cast<double>(top)) * inv_scale) : 0.0;
  };
  double covered = 0.0;
  for (int p = lane; p < n; p += 32) {
    if (!unforced(p)) covered += mass(p, key(p));
  }
  for (int o = 16; o > 0; o /= 2) covered += __shfl_xor_sync(0xFFFFFFFFu, covered, o);
  WarpMassWalk(n, unforced, key, mass, covered, MassGoal(budget.target, total), budget, counts,
               masses, lane, cut_key, cut_tie);
}

// A group's key in core MarkByMassList's order: its share's ordered key, 0 for
// a share of 0 (all tie, as empty groups do per head).
__device__ inline unsigned ShareKey(float share) { return share > 0.0f ? OrderedKey(share) : 0u; }

// core MarkByMassList's walk for one list under its layer's budget, from the
// groups' shares σ (float, [n]): goal = target·Σσ, the order of ShareKey.
__device__ inline void WarpListMassCut(const float* share, int n, const SelectRule& rule,
                                       const MassRule& budget, unsigned* counts, double* masses,
                                       int lane, unsigned* cut_key, int* cut_tie) {
  auto unforced = [&](int p) { return !IsForced(p, n, rule.first_n, rule.last_n); };
  auto key = [=](int p) { return ShareKey(share[p]); };
  auto mass = [=](int p, unsigned) { return static_cast<double>(share[p]); };
  double total = 0.0, covered = 0.0;
  for (int p = lane; p < n; p += 32) {
    total += share[p];
    if (!unforced(p)) covered += share[p];
  }
  for (int o = 16; o > 0; o /= 2) {
    total += __shfl_xor_sync(0xFFFFFFFFu, total, o);
    covered += __shfl_xor_sync(0xFFFFFFFFu, covered, o);
  }
  WarpMassWalk(n, unforced, key, mass, covered, MassGoal(budget.target, total), budget, counts,
               masses, lane, cut_key, cut_tie);
}

}  // namespace eps::gpu::kernels
