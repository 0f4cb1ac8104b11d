// The scores of core/bounds.h on the device, one function per core `Method`
// (the kernels take the method as a template parameter, so each instantiation
// holds only its own arithmetic). Each reads one record of core/layout.h's
// layout; the query arrives widened to float with its terms precomputed.
//
//   jl     sqrt(max(zᵀGz, 0)) = sqrt(max(Σ_p G_p zz_p, 0))
//   1pc    sqrt(λ1)|v̂·q| + sqrt(r² + pad)·‖q⊥‖, at most fro
//   fro    ‖q‖ sqrt(fro2)
//   quest  Σ_j max(q_j min_j, q_j max_j), min and max binary16 (rounded outward)
//
// and BracketMaxScore for strict mode. Sums run in core/'s order (j = 0..d-1),
// but the device contracts products into FMAs, so values agree with core/ to
// float rounding, not bit for bit; strict mode's slack covers that.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "core/bounds.h"

namespace eps::gpu {

// Word offsets of the record parts (core SummaryLayout); -1 marks an absent part.
struct RecordOffsets {
  int d, packed, fro2, max_norm, count, key_sum, quest_min, quest_max, principal;
};

// One query head's terms, in shared memory: q widened (d), packed z zᵀ with
// doubled off-diagonal (packed), and ‖q‖.
struct HeadQuery {
  const float* q;
  const float* zz;
  float norm;
};

__device__ inline float FroBound(const float* rec, const RecordOffsets& o, const HeadQuery& h) {
  return h.norm * sqrtf(fmaxf(rec[o.fro2], 0.0f));
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

__device__ inline float OnePcBound(const float* rec, const RecordOffsets& o, const HeadQuery& h) {
  const float fro = FroBound(rec, o, h);
  if (o.principal < 0 || rec[o.principal + 2] == 0.0f) return fro;  // absent or not sealed
  const int8_t* u = reinterpret_cast<const int8_t*>(rec + o.principal + 3);
  float dot = 0.0f;
  for (int i = 0; i < o.d; ++i) dot += static_cast<float>(u[i]) * h.q[i];
  const float along = fabsf(dot * rec[o.principal + 2]);
  const float q2 = h.norm * h.norm;
  const float perp =
      sqrtf(fmaxf(q2 - along * along, 0.0f) + ldexpf(static_cast<float>(o.d), -22) * q2);
  const float fro2 = fmaxf(rec[o.fro2], 0.0f);
  const float pad = ldexpf(rec[o.count] + static_cast<float>(o.d), -22) * fro2;
  return fminf(sqrtf(fmaxf(rec[o.principal], 0.0f)) * along +
                   sqrtf(fmaxf(rec[o.principal + 1], 0.0f) + pad) * perp,
               fro);
}

__device__ inline float QuestBound(const float* rec, const RecordOffsets& o, const HeadQuery& h) {
  if (o.quest_min < 0) return FroBound(rec, o, h);
  if (rec[o.count] <= 0.0f) return -INFINITY;  // no keys
  const __half* lo = reinterpret_cast<const __half*>(rec + o.quest_min);
  const __half* hi = reinterpret_cast<const __half*>(rec + o.quest_max);
  float sum = 0.0f;
  for (int i = 0; i < o.d; ++i) {
    const float qi = h.q[i];
    sum += fmaxf(qi * __half2float(lo[i]), qi * __half2float(hi[i]));
  }
  return sum;
}

// core Score(): kOff scores 0.
template <Method kMethod, int kM>
__device__ inline float Score(const float* rec, const float* gram, const RecordOffsets& o,
                              const HeadQuery& h) {
  if constexpr (kMethod == Method::kJl) {
    return JlScore<kM>(rec, gram, o, h);
  } else if constexpr (kMethod == Method::kOnePc) {
    return OnePcBound(rec, o, h);
  } else if constexpr (kMethod == Method::kFro) {
    return FroBound(rec, o, h);
  } else if constexpr (kMethod == Method::kQuest) {
    return QuestBound(rec, o, h);
  } else {
    return 0.0f;
  }
}

// core BracketMaxScore(): a rigorous bracket of max_i q·k_i, slack included.
__device__ inline MaxScoreBracket BracketMaxScore(const float* rec, const RecordOffsets& o,
                                                  const HeadQuery& h) {
  const float count = rec[o.count];
  if (count <= 0.0f) return {-INFINITY, -INFINITY};
  const float d = static_cast<float>(o.d);
  const float slack =
      fmaxf(kBoundSlack, ldexpf(count + d * sqrtf(d), -22)) * h.norm * rec[o.max_norm];
  float abs_upper = FroBound(rec, o, h);
  if (o.principal >= 0) abs_upper = fminf(abs_upper, OnePcBound(rec, o, h));
  float upper = abs_upper;
  if (o.quest_min >= 0) upper = fminf(upper, QuestBound(rec, o, h));
  float lower = -abs_upper;
  if (o.key_sum >= 0) {
    float dot = 0.0f;
    for (int i = 0; i < o.d; ++i) dot += h.q[i] * rec[o.key_sum + i];
    lower = dot / count;
  }
  return {lower - slack, upper + slack};
}

}  // namespace eps::gpu
