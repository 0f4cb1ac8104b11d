// The scores of core/bounds.h on the device, one function per core `Method`
// (the kernels take the method as a template parameter, so each instantiation
// holds only its own arithmetic). Each reads one record of core/layout.h's
// layout; the query arrives widened to float with its terms precomputed.
//
//   jl     sqrt(max(zᵀGz, 0)) = sqrt(max(Σ_p G_p zz_p, 0))
//   1pc    sqrt(λ1)|v̂·q| + sqrt(r² + pad)·‖q⊥‖, at most fro
//   fro    ‖q‖ sqrt(fro2)
//   quest  Σ_j min(q_j,0) min_j + max(q_j,0) max_j, min and max binary16 (rounded
//          outward); core/ sums the same form, so malformed records agree too
//
// NaN handling follows core/'s std::max / std::min (StdMax, StdMin): a NaN λ1,
// r² or principal scale makes 1pc NaN (the step fails) on both backends.
//
// and BracketMaxScore for strict mode. The per-channel sums (quest, u1·q, q·Σk)
// are taken for a batch of query heads in one pass over the record (HeadSums):
// 1pc's here, a thread per record, in core/'s order (j = 0..d-1); quest's and
// strict mode's by the warp's lanes together (gpu/warp_sums.cuh), in another
// order. The device contracts products into FMAs, so values agree with core/
// to float rounding, not bit for bit; strict mode's slack covers that.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "core/bounds.h"

namespace eps::gpu {

// Word offsets of the record parts (core SummaryLayout); -1 marks an absent part.
struct RecordOffsets {
  int d, packed, fro2, max_norm, count, key_sum, quest_min, quest_max, principal, quest8;
};

// One query head's terms: packed z zᵀ with doubled off-diagonal (in shared
// memory; jl only) and ‖q‖.
struct HeadQuery {
  const float* zz;
  float norm;
};

// std::max and std::min as core/ calls them: a NaN first argument is kept
// (fmaxf and fminf would drop it and score a NaN record as a finite one, where
// core/ fails the step), a NaN second one dropped.
__device__ inline float StdMax(float a, float b) { return a < b ? b : a; }
__device__ inline float StdMin(float a, float b) { return b < a ? b : a; }

__device__ inline float FroBound(const float* rec, const RecordOffsets& o, const HeadQuery& h) {
  return h.norm * sqrtf(StdMax(rec[o.fro2], 0.0f));
}

// kM > 0: m fixed at compile time, `gram` the packed Gram already in registers.
template <int kM>
__device__ inline float JlScore(const float* rec, const float* gram, const RecordOffsets& o,
                                const HeadQuery& h) {
  float quad = 0.0f;
  if constexpr (kM > 0) {
    constexpr int kPacked = kM * (kM + 1) / 2;
#pragma unroll
    for (int w = 0; w < kPacked; ++w) quad += gram[w] * h.zz[w];
  } else {
    for (int w = 0; w < o.packed; ++w) quad += rec[w] * h.zz[w];
  }
  return isnan(quad) ? quad : sqrtf(fmaxf(quad, 0.0f));  // a NaN summary must surface
}

// The per-channel sums of the record for a batch of up to kHeadBatch query
// heads at once, so the record's channels are read once for all of them (GQA).
// `q` holds the heads' queries one after the other, d floats each; sums run
// over j = 0..d-1 in order, as core/'s do. Results land in out[0, heads).
inline constexpr int kHeadBatch = 8;

// 1pc: u1·q with the int8 direction read four bytes at a time.
__device__ inline void PrincipalDots(const float* rec, const RecordOffsets& o, const float* q,
                                     int heads, float* out) {
  const char4* u = reinterpret_cast<const char4*>(rec + o.principal + 3);
#pragma unroll
  for (int r = 0; r < kHeadBatch; ++r) out[r] = 0.0f;
  for (int w = 0; w < o.d / 4; ++w) {
    const char4 c = u[w];
#pragma unroll
    for (int r = 0; r < kHeadBatch; ++r) {
      if (r < heads) {
        const float* qr = q + r * o.d + 4 * w;
        out[r] += static_cast<float>(c.x) * qr[0];
        out[r] += static_cast<float>(c.y) * qr[1];
        out[r] += static_cast<float>(c.z) * qr[2];
        out[r] += static_cast<float>(c.w) * qr[3];
      }
    }
  }
}

__device__ inline bool HasPrincipalPair(const float* rec, const RecordOffsets& o) {
  return o.principal >= 0 && rec[o.principal + 2] != 0.0f;  // scale 0: absent or unsealed
}

// 1pc from the head's u1·q (`dot`, from PrincipalDots).
__device__ inline float OnePcBound(const float* rec, const RecordOffsets& o, const HeadQuery& h,
                                   float dot) {
  const float fro = FroBound(rec, o, h);
  if (!HasPrincipalPair(rec, o)) return fro;
  const float along = fabsf(dot * rec[o.principal + 2]);
  const float q2 = h.norm * h.norm;
  const float perp =
      sqrtf(StdMax(q2 - along * along, 0.0f) + ldexpf(static_cast<float>(o.d), -22) * q2);
  const float fro2 = StdMax(rec[o.fro2], 0.0f);
  const float pad = ldexpf(rec[o.count] + static_cast<float>(o.d), -22) * fro2;
  return StdMin(sqrtf(StdMax(rec[o.principal], 0.0f)) * along +
                    sqrtf(StdMax(rec[o.principal + 1], 0.0f) + pad) * perp,
                fro);
}

// quest from the head's channel sum (`sum`, from QuestSumsWarp); fro without the part.
__device__ inline float QuestBound(const float* rec, const RecordOffsets& o, const HeadQuery& h,
                                   float sum) {
  if (o.quest_min < 0) return FroBound(rec, o, h);
  if (rec[o.count] <= 0.0f) return -INFINITY;  // no keys
  return sum;
}

// The per-head sums a score needs, for one batch of heads.
struct HeadSums {
  float principal[kHeadBatch];  // u1·q (1pc, strict with a principal pair)
  float quest[kHeadBatch];      // quest channel sum (quest, strict with the quest part)
  float key_sum[kHeadBatch];    // q·Σk (strict with key_sum)
  float centre[kHeadBatch];     // questclt: Σ_j q_j (min_j + max_j) / 2 (quest8: in codes)
  float spread[kHeadBatch];     // questclt: Σ_j (q_j (max_j − min_j) / 2)² (quest8: in codes)
};

// core QuestCltScore from its two sums over the quest part; fro without it.
__device__ inline float QuestCltScore(const float* rec, const RecordOffsets& o, const HeadQuery& h,
                                      float centre, float spread) {
  if (o.quest_min < 0) return FroBound(rec, o, h);
  if (rec[o.count] <= 0.0f) return -INFINITY;  // no keys
  return centre + sqrtf(spread);
}

// core QuestCltScore of a record with the quest8 part, from its two sums over
// the part's codes: the record's scale applies here.
__device__ inline float QuestClt8Score(const float* rec, const RecordOffsets& o, float centre,
                                       float spread) {
  if (rec[o.count] <= 0.0f) return -INFINITY;  // no keys
  const float scale = rec[o.quest8 + o.d / 2];
  return scale * centre + scale * sqrtf(spread);
}

// core Score(): kOff scores 0. `r` is the head's index in the batch of `sums`.
// kQuest8: questclt's sums ran over the quest8 part (the records hold one).
template <Method kMethod, int kM, bool kQuest8 = false>
__device__ inline float Score(const float* rec, const float* gram, const RecordOffsets& o,
                              const HeadQuery& h, const HeadSums& sums, int r) {
  if constexpr (kMethod == Method::kJl) {
    return JlScore<kM>(rec, gram, o, h);
  } else if constexpr (kMethod == Method::kOnePc) {
    return OnePcBound(rec, o, h, sums.principal[r]);
  } else if constexpr (kMethod == Method::kFro) {
    return FroBound(rec, o, h);
  } else if constexpr (kMethod == Method::kQuest) {
    return QuestBound(rec, o, h, sums.quest[r]);
  } else if constexpr (kMethod == Method::kQuestClt && kQuest8) {
    return QuestClt8Score(rec, o, sums.centre[r], sums.spread[r]);
  } else if constexpr (kMethod == Method::kQuestClt) {
    return QuestCltScore(rec, o, h, sums.centre[r], sums.spread[r]);
  } else {
    return 0.0f;
  }
}

// core BracketMaxScore(): a rigorous bracket of max_i q·k_i, slack included.
__device__ inline MaxScoreBracket BracketMaxScore(const float* rec, const RecordOffsets& o,
                                                  const HeadQuery& h, const HeadSums& sums, int r) {
  const float count = rec[o.count];
  if (count <= 0.0f) return {-INFINITY, -INFINITY};
  const float d = static_cast<float>(o.d);
  // core: below these floors ‖q‖² or fro2 lost their squares to the float range and bound
  // nothing; the group stays a candidate for every rule (core/bounds.cc says why).
  if (!(h.norm >= ldexpf(sqrtf(d), -60)) || !(rec[o.fro2] >= ldexpf(count * d, -120))) {
    return {-INFINITY, INFINITY};
  }
  const float slack =
      fmaxf(kBoundSlack, ldexpf(count + d * sqrtf(d), -22)) * h.norm * rec[o.max_norm];
  float abs_upper = FroBound(rec, o, h);
  if (o.principal >= 0) abs_upper = StdMin(abs_upper, OnePcBound(rec, o, h, sums.principal[r]));
  float upper = abs_upper;
  if (o.quest_min >= 0) upper = StdMin(upper, QuestBound(rec, o, h, sums.quest[r]));
  // core: a mean that left the float range (q·Σk overflowing) is no bound.
  const float mean = o.key_sum >= 0 ? sums.key_sum[r] / count : -abs_upper;
  const float lower = isfinite(mean) ? mean : -abs_upper;
  // core: contradicting bounds (rounding, now that the floors above return first) give no
  // upper bound.
  if (lower > upper) upper = INFINITY;
  return {lower - slack, upper + slack};
}

}  // namespace eps::gpu
