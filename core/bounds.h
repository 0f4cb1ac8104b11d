// Scores of a summary group for one query (docs/design.md §3).
//
//   jl     sqrt(max(zᵀGz, 0)), z = Φᵀq     estimate of sqrt(Σ_i (q·k_i)²) ≥ max_i |q·k_i|
//   1pc    sqrt(λ1)|u1·q| + sqrt(r²)‖q⊥‖   upper bound of sqrt(qᵀCq) (min with fro;
//                                          q⊥ = q − (u1·q)u1, tighter than DESIGN's ‖q‖)
//   fro    ‖q‖ sqrt(fro2)                   upper bound of sqrt(qᵀCq) (loose)
//   quest  Σ_j min(q_j,0) min_j + max(q_j,0) max_j
//                                          upper bound of max_i q·k_i in exact arithmetic
//                                          (= Σ_j max(q_j min_j, q_j max_j) for a well-formed
//                                          record; this form, the GPU's, is what both
//                                          backends score)
//   questclt  q·c + sqrt(Σ_j (q_j w_j)²)    estimate, not a bound: c = (min + max)/2 and
//                                          w = (max − min)/2 per channel of the quest part;
//                                          the spread of q·k over independent channels
//                                          (docs/policy.md "questclt"); from the
//                                          quest8 part when the record has one
//
// plus the mean-key lower bound q·k̄ ≤ max_i q·k_i used by strict mode.
//
// The kinds above are the exact formulas'. Every score is computed in float32, and rounding
// can put a computed bound below what it bounds: quest's d-term sum cancels on a key with
// large channels of opposite signs (key (65504, 2^-14, -65504, 0) and query (1, 1, 1, 0)
// score 0 against q·k = 2^-14). So the scores rank groups, and none is a guarantee; strict
// mode's guarantee is BracketMaxScore's, whose slack covers that rounding (docs/policy.md,
// "Rounding slack"). The arithmetic stays as it is: the GPU's scores are checked bit for bit
// against these.
// All functions read one record (see core/layout.h) and never allocate.
#pragma once

#include <cfloat>
#include <span>
#include <string_view>
#include <vector>

#include "core/layout.h"
#include "core/phi.h"

namespace eps {

enum class Method { kOff, kJl, kOnePc, kFro, kQuest, kQuestClt };

const char* MethodName(Method method);
bool ParseMethod(std::string_view name, Method* method);

// Per-query values that every group's score reuses: computed once per
// (query head, step), then applied to all groups of the query's KV head.
struct QueryTerms {
  std::vector<float> q;   // d, widened to float
  float norm = 0.0f;      // ‖q‖
  std::vector<float> z;   // m, Φᵀq
  std::vector<float> zz;  // P: z_i z_j packed, off-diagonal doubled, so zᵀGz = Σ G_p zz_p

  void Prepare(const PhiBank& phi, int layer, int kv_head, std::span<const float> query);
};

// The largest Σ_j q_j² a scored query may have (FLT_MAX·(1 − 2^-11) as a float): a query
// at or above it is refused with INVALID_ARGUMENT. core/ compares the sum of the squares
// in double (channel order, each square exact); the GPU compares the float sum its scores
// use as ‖q‖², one compare beside the sum (an exact re-sum there cost the fused kernel a
// spill: 4.5 % at 64 × 32k on an H100). So the two can differ only for a query whose Σq²
// lies within that float sum's rounding (relative (d−1)·2^-24 ≤ 2^-14 for d ≤ 1024) of the
// bound; below it every float sum of the squares stays finite.
inline constexpr float kMaxQueryNorm2 = static_cast<float>(FLT_MAX * (1.0 - 0x1p-11));

// The goal of the top-p and mass budgets' walks (MarkTopP, MarkByMass, MarkByMassList and
// the device's walks, which evaluate this same expression): target·(1 − 2^-30)·total. The
// walk sums its masses in another order than the total, and the device in yet another, so
// at target 1 the exact goal is reached or missed by rounding (≈ n·2^-53 of the total),
// and a walk that misses it takes every remaining group; the slack, far above that
// rounding and far below any mass that matters, makes both stop where the masses do.
inline constexpr double kMassGoalSlack = 0x1p-30;
inline constexpr double MassGoal(float target, double total) {
  return static_cast<double>(target) * (1.0 - kMassGoalSlack) * total;
}

// Relative slack that covers fp32 rounding in summaries and scores, applied in
// units of ‖q‖·max_norm (the scale of max_i |q·k_i|): at least kBoundSlack, and
// growing with the n keys summed and the d·sqrt(d) of a quest sum (docs/policy.md).
inline constexpr float kBoundSlack = 1e-4f;
float BoundSlack(float count, int head_dim);

float JlScore(std::span<const float> record, const SummaryLayout& layout, const QueryTerms& q);
float OnePcBound(std::span<const float> record, const SummaryLayout& layout, const QueryTerms& q);
float FroBound(std::span<const float> record, const SummaryLayout& layout, const QueryTerms& q);
float QuestBound(std::span<const float> record, const SummaryLayout& layout, const QueryTerms& q);
float QuestCltScore(std::span<const float> record, const SummaryLayout& layout,
                    const QueryTerms& q);

// The score of `method` (kOff scores 0). Methods whose record parts are absent
// fall back to fro (1pc before Seal) — never to something that is not a bound.
float Score(Method method, std::span<const float> record, const SummaryLayout& layout,
            const QueryTerms& q);

// Whether the record's float words (the Gram, fro2, max_norm, count, key_sum,
// λ1, r², the principal scale, the quest8 scale) are all finite and no quest
// half is NaN, nor infinite in a record with keys (count > 0): what decides
// whether a non-finite score blames the summary.
bool RecordIsFinite(std::span<const float> record, const SummaryLayout& layout);

// Rigorous bracket of max_i q·k_i over the group's keys, rounding slack included:
// lower from the mean key (or -fro without key_sum), upper the tightest of fro,
// 1pc and quest that the record holds. An empty group gets (-inf, -inf); a query or
// record whose squared norm lies below the float range (‖q‖ < sqrt(d)·2^-60, or
// fro2 < count·d·2^-120), where no bound is known, gets (-inf, +inf).
struct MaxScoreBracket {
  float lower;
  float upper;
};
MaxScoreBracket BracketMaxScore(std::span<const float> record, const SummaryLayout& layout,
                                const QueryTerms& q);

}  // namespace eps
