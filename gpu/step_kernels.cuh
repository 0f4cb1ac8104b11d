// The two kernels of one decode step's GPU pre-pass (gpu/step.h says what each
// stage does). Included by gpu/step.cu only; shapes in comments, the launch
// configuration is computed there. The score is keyed by the core `Method`,
// the selection rule by the core `Budget` (template parameters, no integer codes).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/half.h"
#include "core/select.h"
#include "gpu/bounds.cuh"
#include "gpu/phi.cuh"

namespace eps::gpu::kernels {

// The first error a kernel meets; the host turns it into a status.
enum ErrorCode : int { kOk = 0, kBadSlot = 1, kBadBlock = 2, kBadScore = 3, kBadQuery = 4 };
struct DeviceStatus {
  int code;
  int row, index, value;
};
// Step counters, summed with atomics.
struct DeviceStats {
  unsigned long long groups_visited, blocks_visited, visited_tokens;
};
// What one step reports back: copied to the host in one transfer. The selector
// keeps two and alternates by step, so each step clears the other one for the
// next step instead of a memset before its kernels.
struct StepReport {
  DeviceStatus status;
  DeviceStats stats;
};
struct DeviceRow {
  int64_t table_row;
  int64_t context_tokens;
};

__device__ inline void Fail(DeviceStatus* status, int code, int row, int index, int value) {
  if (atomicCAS(&status->code, kOk, code) == kOk) {
    status->row = row;
    status->index = index;
    status->value = value;
  }
}

struct Shape {
  int layers, q_heads, kv_heads, d, m, record_words, block_size, group_blocks;
  RecordOffsets record;
  int64_t max_batch, max_seqs, max_groups, max_blocks, num_slots, num_physical_blocks;
  DType query_dtype;
  int lists;  // visit lists per (layer, row): 1 (union) or kv_heads (per KV head)
};

__device__ inline int GroupsOf(const Shape& s, int64_t tokens) {
  const int64_t nb = (tokens + s.block_size - 1) / s.block_size;
  return static_cast<int>((nb + s.group_blocks - 1) / s.group_blocks);
}

__device__ inline bool IsForced(int p, int n, int first_n, int last_n) {
  return p < first_n || p >= n - last_n || p == n - 1;
}

// ---------------------------------------------------------------------------
// Scoring. Grid (group chunks of 256, layers * kv_heads, rows), 256 threads.
// Each block first widens the queries of its KV head's query heads into shared
// memory and builds their terms, a warp per head (‖q‖; for jl z = Φᵀq and the
// packed z zᵀ), then each thread scores one group: it reads the record once
// and scores it for every query head of the KV head (GQA), the per-channel
// sums of quest, 1pc and strict taken for up to kHeadBatch heads per pass.
//
// Shared memory (dynamic): q [ratio, d], zz [ratio, packed], norm [ratio],
// z [ratio, m]. Outputs [rows, layers, q_heads, max_groups]: `scores` (strict:
// the lower bounds) and, in strict mode, `uppers`.
inline constexpr int kScoreThreads = 256;

struct ScoreArgs {
  const float* pool;
  const int32_t* group_table;
  const int32_t* block_table;
  const void* queries;  // [layers, max_batch, q_heads, d]
  const float* phi;     // [layers, kv_heads, d, m]
  const DeviceRow* rows;
  const uint8_t* scored;  // [layers, q_heads] or null (every head scored)
  float* scores;
  float* uppers;
  StepReport* report;
};

template <Method kMethod, int kM, bool kStrict>
__global__ void ScoreKernel(Shape s, ScoreArgs a) {
  extern __shared__ float shared[];
  const int row = blockIdx.z;
  const int layer = blockIdx.y / s.kv_heads, kvh = blockIdx.y % s.kv_heads;
  const int ratio = s.q_heads / s.kv_heads;
  const int packed = s.record.packed;
  float* q_sh = shared;                     // [ratio, d]
  float* zz_sh = q_sh + ratio * s.d;        // [ratio, packed]
  float* norm_sh = zz_sh + ratio * packed;  // [ratio]
  float* z_sh = norm_sh + ratio;            // [ratio, m]
  DeviceStatus* status = &a.report->status;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;

  // Stage the widened queries; a non-finite element of a scored head fails the step.
  for (int e = threadIdx.x; e < ratio * s.d; e += blockDim.x) {
    const int h = kvh * ratio + e / s.d;
    const int64_t at = ((int64_t{layer} * s.max_batch + row) * s.q_heads + h) * s.d + e % s.d;
    const float x = LoadAsFloatDevice(a.queries, s.query_dtype, at);
    q_sh[e] = x;
    const bool head_scored = a.scored == nullptr || a.scored[layer * s.q_heads + h];
    if (head_scored && !isfinite(x) && blockIdx.x == 0) {
      Fail(status, kBadQuery, row, (layer * s.q_heads + h) * s.d + e % s.d, 0);
    }
  }
  __syncthreads();
  if constexpr (kMethod != Method::kOff || kStrict) {
    // A warp per head: lanes split d, shuffles reduce.
    const float* matrix = a.phi + (int64_t{layer} * s.kv_heads + kvh) * s.d * s.m;
    for (int r = warp; r < ratio; r += warps) {
      const float* q = q_sh + r * s.d;
      float n2 = 0.0f;
      for (int i = lane; i < s.d; i += 32) n2 += q[i] * q[i];
      for (int o = 16; o > 0; o /= 2) n2 += __shfl_xor_sync(0xFFFFFFFFu, n2, o);
      if (lane == 0) norm_sh[r] = sqrtf(n2);
      if constexpr (kMethod == Method::kJl && !kStrict) {
        for (int j = 0; j < s.m; ++j) {
          float partial = 0.0f;
          for (int i = lane; i < s.d; i += 32) partial += matrix[i * s.m + j] * q[i];
          for (int o = 16; o > 0; o /= 2) partial += __shfl_xor_sync(0xFFFFFFFFu, partial, o);
          if (lane == 0) z_sh[r * s.m + j] = partial;
        }
      }
    }
    if constexpr (kMethod == Method::kJl && !kStrict) {
      __syncthreads();
      for (int e = threadIdx.x; e < ratio * packed; e += blockDim.x) {
        const int r = e / packed;
        int p = e % packed, i = 0;
        while (p >= s.m - i) {  // packed index -> (i, j), i ≤ j
          p -= s.m - i;
          ++i;
        }
        const int j = i + p;
        zz_sh[e] = (i == j ? 1.0f : 2.0f) * z_sh[r * s.m + i] * z_sh[r * s.m + j];
      }
    }
    __syncthreads();
  }

  const int64_t tokens = a.rows[row].context_tokens;
  const int64_t nb = (tokens + s.block_size - 1) / s.block_size;
  const int n = GroupsOf(s, tokens);
  const int64_t p = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (p >= n) return;
  const int64_t table_row = a.rows[row].table_row;
  // Block ids are checked once per group, by the (layer 0, kv head 0) blocks.
  if (blockIdx.y == 0) {
    for (int64_t b = p * s.group_blocks; b < min(nb, (p + 1) * s.group_blocks); ++b) {
      const int32_t id = a.block_table[table_row * s.max_blocks + b];
      if (id < 0 || (s.num_physical_blocks >= 0 && id >= s.num_physical_blocks)) {
        Fail(status, kBadBlock, row, static_cast<int>(b), id);
      }
    }
  }
  const int32_t slot = a.group_table[table_row * s.max_groups + p];
  if (slot < 0 || slot >= s.num_slots) {
    Fail(status, kBadSlot, row, static_cast<int>(p), slot);
    return;  // never read outside the pool
  }
  if constexpr (kMethod == Method::kOff && !kStrict) {
    return;  // nothing is scored; the tables were still checked, as core/ does
  } else {
    const float* rec =
        a.pool + ((int64_t{slot} * s.layers + layer) * s.kv_heads + kvh) * s.record_words;
    const RecordOffsets& o = s.record;
    const bool stats_ok =
        isfinite(rec[o.fro2]) && isfinite(rec[o.max_norm]) && isfinite(rec[o.count]);
    // jl with m known: the packed Gram read once, 16 bytes at a time (records are
    // 16-byte aligned and padded), and kept in registers for every head.
    constexpr int kVectors = kM > 0 ? (kM * (kM + 1) / 2 + 3) / 4 : 1;
    float4 gram[kVectors];
    if constexpr (kMethod == Method::kJl && kM > 0 && !kStrict) {
#pragma unroll
      for (int v = 0; v < kVectors; ++v) gram[v] = reinterpret_cast<const float4*>(rec)[v];
    }
    constexpr bool kQuestSums = kStrict || kMethod == Method::kQuest;
    constexpr bool kPrincipalSums = kStrict || kMethod == Method::kOnePc;
    for (int r0 = 0; r0 < ratio; r0 += kHeadBatch) {
      const int heads = min(kHeadBatch, ratio - r0);
      const float* q = q_sh + r0 * s.d;
      HeadSums sums;
      if constexpr (kQuestSums) {
        if (o.quest_min >= 0) QuestSums(rec, o, q, heads, sums.quest);
      }
      if constexpr (kPrincipalSums) {
        if (HasPrincipalPair(rec, o)) PrincipalDots(rec, o, q, heads, sums.principal);
      }
      if constexpr (kStrict) {
        if (o.key_sum >= 0) KeySumDots(rec, o, q, heads, sums.key_sum);
      }
#pragma unroll
      for (int rr = 0; rr < kHeadBatch; ++rr) {
        if (rr >= heads) break;
        const int r = r0 + rr, h = kvh * ratio + r;
        if (a.scored != nullptr && !a.scored[layer * s.q_heads + h]) continue;
        const HeadQuery hq{zz_sh + r * packed, norm_sh[r]};
        const int64_t out = ((int64_t{row} * s.layers + layer) * s.q_heads + h) * s.max_groups + p;
        bool bad;
        if constexpr (kStrict) {
          const MaxScoreBracket b = BracketMaxScore(rec, o, hq, sums, rr);
          a.scores[out] = b.lower;
          a.uppers[out] = b.upper;
          bad = isnan(b.lower) || isnan(b.upper);
        } else {
          const float score =
              Score<kMethod, kM>(rec, reinterpret_cast<const float*>(gram), o, hq, sums, rr);
          a.scores[out] = score;
          bad = isnan(score) || score == INFINITY;
        }
        if (bad || !stats_ok) Fail(status, kBadScore, row, static_cast<int>(p), slot);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Selection: one block of 256 or 1024 threads per (layer * lists + list, row).
//   1. each warp takes query heads of the list in turn and finds its cut
//      (threshold budget and strict: the top_pages-th largest value by an
//      8-bit radix select; top-p: the score where the mass reaches top_p);
//      the fixed budget ranks groups per head instead (below);
//   2. visit flags: forced groups, plus every group a head's cut admits;
//   3. compaction of the visited groups' blocks into visit_blocks, and stats.
//
// Dynamic shared memory: visit flags [max_groups] (padded to 16 bytes), then
// [max_groups] words (best ranks of the fixed budget, then block offsets),
// then [max_groups] floats (one head's scores, fixed budget only).
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
};

struct SelectRule {
  bool method_off;  // visit everything
  float alpha;
  int first_n, last_n, top_pages;
  float top_p;
  float inv_sqrt_d;  // top-p: 1/sqrt(d), rounded on the host as core/ does
};

// Float -> unsigned key with the same order.
__device__ inline unsigned OrderedKey(float f) {
  const unsigned bits = __float_as_uint(f);
  return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}
__device__ inline float KeyToFloat(unsigned key) {
  return __uint_as_float((key & 0x80000000u) ? key & 0x7FFFFFFFu : ~key);
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

// The k-th largest key (1-based) among the groups p < n that `take(p)` admits,
// by four 8-bit radix passes of a warp-wide histogram. Needs at least k such groups.
template <typename Take>
__device__ unsigned WarpKthLargest(const float* values, int n, unsigned k, Take take,
                                   unsigned* histogram, int lane) {
  unsigned prefix = 0, prefix_mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = lane; b < 256; b += 32) histogram[b] = 0;
    __syncwarp();
    for (int p = lane; p < n; p += 32) {
      const unsigned key = OrderedKey(values[p]);
      if (take(p) && (key & prefix_mask) == prefix)
        atomicAdd(&histogram[(key >> shift) & 0xFFu], 1u);
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
  return prefix;
}

// core MarkTopP for one head: the estimated mass w_p = exp((s_p - s_max)/sqrt(d))
// of the unforced groups, taken by decreasing score (ties by increasing group)
// until their share reaches top_p. Returns the cut as (key, tie): group p is
// taken when key_p > key, or key_p == key and p <= tie. Masses are summed in
// double, in another order than core/'s, so a group at the cut may differ.
__device__ void WarpTopPCut(const float* sc, int n, const SelectRule& rule, unsigned* counts,
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
  const double target = static_cast<double>(rule.top_p) * total;
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
    for (int p = lane; p < n; p += 32) {
      const unsigned key = OrderedKey(sc[p]);
      if (!IsForced(p, n, rule.first_n, rule.last_n) && (key & prefix_mask) == prefix) {
        const unsigned b = (key >> shift) & 0xFFu;
        atomicAdd(&counts[b], 1u);
        atomicAdd(&masses[b], mass(p));
      }
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
// finds one head's cut, 8 otherwise (and for top-p, whose double histograms
// would not fit 32 warps' static shared memory).
template <Budget kBudget, bool kStrict, int kWarps>
__global__ void __launch_bounds__(kWarps * 32)
    SelectKernel(Shape s, SelectRule rule, SelectArgs a) {
  static_assert(kBudget != Budget::kTopP || kWarps <= 8, "top-p keeps 2 KiB per warp");
  extern __shared__ unsigned char visit[];
  __shared__ float head_cut[256];     // threshold and strict: visit when value >= cut
  __shared__ unsigned head_key[256];  // top-p: the cut key and tie group
  __shared__ int head_tie[256];
  __shared__ unsigned counts[kWarps * 32];
  __shared__ unsigned histograms[kWarps][256];
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
  if (a.report->status.code != kOk) {
    // The scoring kernel failed: no list is computed. With a step fence the
    // engine's stream proceeds on selection_done regardless, so each list of
    // the step says "attend densely" (-1); without one, nothing is written.
    if (a.selection_done != nullptr && threadIdx.x == 0) a.visit_count[list_index] = -1;
    return;
  }
  const int heads_per_list = s.q_heads / s.lists, first_head = list * heads_per_list;
  const int64_t tokens = a.rows[row].context_tokens;
  const int64_t nb = (tokens + s.block_size - 1) / s.block_size;
  const int n = GroupsOf(s, tokens);
  const int64_t head_base = (int64_t{row} * s.layers + layer) * s.q_heads;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  unsigned* offset = reinterpret_cast<unsigned*>(visit + ((s.max_groups + 15) / 16) * 16);
  auto head_scored = [&](int h) { return a.scored == nullptr || a.scored[layer * s.q_heads + h]; };
  auto forced = [&](int p) { return IsForced(p, n, rule.first_n, rule.last_n); };

  // 1. Per-head cuts (threshold, strict, top-p; fixed: the top_pages-th score).
  {
    if constexpr (kBudget == Budget::kFixed) {
      // Only a group within some head's top top_pages can be taken (each head
      // alone has top_pages groups ranked below top_pages), so ranks are
      // counted only for groups at or above the head's top_pages-th score.
      for (int h = first_head + warp; h < first_head + heads_per_list && !rule.method_off;
           h += warps) {
        float cut = -INFINITY;
        if (head_scored(h)) {
          unsigned local = 0;
          for (int p = lane; p < n; p += 32) local += !forced(p);
          if (__reduce_add_sync(0xFFFFFFFFu, local) > static_cast<unsigned>(rule.top_pages)) {
            cut = KeyToFloat(WarpKthLargest(
                a.scores + (head_base + h) * s.max_groups, n, rule.top_pages,
                [&](int p) { return !forced(p); }, histograms[warp], lane));
          }
        }
        if (lane == 0) head_cut[h - first_head] = cut;
      }
    } else if constexpr (kBudget == Budget::kTopP) {
      __shared__ double masses[kWarps][256];
      for (int h = first_head + warp; h < first_head + heads_per_list && !rule.method_off;
           h += warps) {
        unsigned key = 0xFFFFFFFFu;
        int tie = -1;
        if (head_scored(h)) {
          WarpTopPCut(a.scores + (head_base + h) * s.max_groups, n, rule, histograms[warp],
                      masses[warp], lane, &key, &tie);
        }
        if (lane == 0) {
          head_key[h - first_head] = key;
          head_tie[h - first_head] = tie;
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
          } else {
            // core MarkByThreshold: T = the top_pages-th largest unforced score;
            // visit every unforced group with score >= T/α (T·α when T ≤ 0).
            unsigned local = 0;
            for (int p = lane; p < n; p += 32) local += !forced(p);
            const unsigned unforced = __reduce_add_sync(0xFFFFFFFFu, local);
            cut = -INFINITY;
            if (unforced > static_cast<unsigned>(rule.top_pages)) {
              const float t = KeyToFloat(WarpKthLargest(
                  values, n, rule.top_pages, [&](int p) { return !forced(p); }, histograms[warp],
                  lane));
              cut = t > 0.0f ? t / rule.alpha : t * rule.alpha;
            }
          }
        }
        if (lane == 0) head_cut[h - first_head] = cut;
      }
    }
    __syncthreads();
  }

  // 2. Visit flags.
  for (int p = threadIdx.x; p < n; p += blockDim.x) visit[p] = rule.method_off || forced(p);
  __syncthreads();
  if constexpr (kBudget == Budget::kFixed) {
    // core MarkFixedBudget: rank the unforced groups per head (score descending,
    // ties to the more recent group), keep each group's best rank over the
    // list's heads, and take the top_pages best (ties to the more recent).
    // Ranks by counting, for the groups at or above the head's cut only: O(n) per
    // such group (about top_pages per head, more with ties at the cut).
    float* stage = reinterpret_cast<float*>(offset + s.max_groups);
    unsigned* best = offset;
    __shared__ unsigned unforced_shared;
    __shared__ bool any_head_shared;
    if (threadIdx.x == 0) {
      unforced_shared = 0;
      any_head_shared = false;
    }
    for (int p = threadIdx.x; p < n; p += blockDim.x) best[p] = 0xFFFFFFFFu;
    __syncthreads();
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
      if (!forced(p)) atomicAdd(&unforced_shared, 1u);
    }
    for (int h = first_head; h < first_head + heads_per_list && !rule.method_off; ++h) {
      if (!head_scored(h)) continue;
      if (threadIdx.x == 0) any_head_shared = true;
      const float* sc = a.scores + (head_base + h) * s.max_groups;
      for (int p = threadIdx.x; p < n; p += blockDim.x) stage[p] = sc[p];
      __syncthreads();
      const float cut = head_cut[h - first_head];
      for (int p = threadIdx.x; p < n; p += blockDim.x) {
        if (forced(p) || !(stage[p] >= cut)) continue;
        const float mine = stage[p];
        unsigned rank = 0;
        for (int q = 0; q < n; ++q) {
          rank += !forced(q) && (stage[q] > mine || (stage[q] == mine && q > p));
        }
        if (rank < static_cast<unsigned>(rule.top_pages)) best[p] = min(best[p], rank);
      }
      __syncthreads();
    }
    __syncthreads();
    if (any_head_shared) {
      const unsigned unforced = unforced_shared;
      for (int p = threadIdx.x; p < n; p += blockDim.x) {
        if (forced(p)) continue;
        bool take = unforced <= static_cast<unsigned>(rule.top_pages);
        if (!take && best[p] != 0xFFFFFFFFu) {  // ranked: within some head's top top_pages
          unsigned before = 0;
          for (int q = 0; q < n; ++q) {
            before +=
                best[q] != 0xFFFFFFFFu && (best[q] < best[p] || (best[q] == best[p] && q > p));
          }
          take = before < static_cast<unsigned>(rule.top_pages);
        }
        if (take) visit[p] = 1;
      }
    }
    __syncthreads();
  } else {
    for (int p = threadIdx.x; p < n && !rule.method_off; p += blockDim.x) {
      if (visit[p]) continue;
      bool v = false;
      for (int h = first_head; h < first_head + heads_per_list && !v; ++h) {
        const float value = (kStrict ? a.uppers : a.scores)[(head_base + h) * s.max_groups + p];
        if constexpr (kBudget == Budget::kTopP) {
          const unsigned key = OrderedKey(value);
          const int i = h - first_head;
          v = key > head_key[i] || (key == head_key[i] && p <= head_tie[i]);
        } else {
          v = value >= head_cut[h - first_head];
        }
      }
      if (v) visit[p] = 1;
    }
    __syncthreads();
  }

  // 3. Compaction. Per-group output offsets by a block-wide scan over contiguous
  // chunks, then one thread per output element: it finds its group by binary
  // search over the offsets, so block-table reads and visit-list writes are
  // coalesced across the warp.
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
  counts[threadIdx.x] = mine;
  __syncthreads();
  for (int stride = 1; stride < blockDim.x; stride *= 2) {  // inclusive scan
    const unsigned add = threadIdx.x >= stride ? counts[threadIdx.x - stride] : 0;
    __syncthreads();
    counts[threadIdx.x] += add;
    __syncthreads();
  }
  unsigned at = counts[threadIdx.x] - mine;
  for (int p = begin; p < end; ++p) {
    offset[p] = at;
    if (visit[p]) at += blocks_of(p);
  }
  __syncthreads();
  const unsigned total = counts[blockDim.x - 1];
  const int64_t table_row = a.rows[row].table_row;
  const int64_t out = list_index * s.max_blocks;
  for (unsigned o = threadIdx.x; o < total; o += blockDim.x) {
    int lo = 0, hi = n;  // first group whose offset exceeds o
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (offset[mid] <= o) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    const int p = lo - 1;  // visited: an empty group's offset equals the next one's
    a.visit_blocks[out + o] =
        a.block_table[table_row * s.max_blocks + int64_t{p} * s.group_blocks + (o - offset[p])];
  }
  // One atomic per warp: 262K same-address atomics per step cost hundreds of µs.
  DeviceStats* stats = &a.report->stats;
  const unsigned warp_groups = __reduce_add_sync(0xFFFFFFFFu, groups);
  if (lane == 0 && warp_groups > 0) atomicAdd(&stats->groups_visited, warp_groups);
  if (threadIdx.x == blockDim.x - 1) {
    a.visit_count[list_index] = static_cast<int32_t>(total);
    atomicAdd(&stats->blocks_visited, total);
    const int64_t last = tokens - (tokens - 1) / s.block_size * s.block_size;
    atomicAdd(&stats->visited_tokens,
              static_cast<unsigned long long>(
                  total == 0 ? 0 : (int64_t{total} - 1) * s.block_size + last));
  }
}

}  // namespace eps::gpu::kernels
