// The selection policy (docs/design.md §4): which groups of one (sequence, layer) a
// query head — and then the union of heads — must visit.
//
// The rules here work on score arrays and know nothing of summaries or tables;
// core/step.h applies them to a whole decode step.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/bounds.h"
#include "core/feedback_entry.h"
#include "core/layout.h"

namespace eps {

enum class HeadMode { kAll, kRetrieval };
// kThreshold: visit score ≥ T/α (T the top_pages-th largest score).
// kFixed: exactly min(groups, forced + top_pages) groups per output row, so the
//   counts are known before the step (kernels that plan on the host).
// kTopP: the fewest groups whose estimated attention mass reaches top_p.
// kMass: the adaptive budget (docs/policy-selection.md, "Mass budget"): per head, add
//   groups by decreasing calibrated mass estimate until the estimated share of
//   the whole context's attention mass, forced groups included, reaches
//   mass_target; at least min_pages and at most max_pages unforced groups.
// The largest α (SelectPolicy::alpha) a session or a call may set, as --eps-alpha: beyond
// it every finite score passes the threshold anyway.
inline constexpr float kMaxAlpha = 1e6f;

enum class Budget { kThreshold, kFixed, kTopP, kMass };
// With kMass: kHead gives every scored head of a list the target share of its own
// estimated mass (MarkByMass, then the union); kList gives the list the target
// share of its heads' mean estimated mass (MarkByMassList): a group one head needs
// counts for all of them, so a union list keeps fewer groups for the same estimate.
enum class MassScope { kHead, kList };

// One layer's mass-budget setting (SelectPolicy::mass_layers): the fields of the same
// names in SelectPolicy, for that layer alone.
struct MassSetting {
  float target = 0.95f;
  float temperature = 1.0f;
  int min_pages = 0;
  int max_pages = 0;
  bool operator==(const MassSetting&) const = default;
};
// kUnion: one visit list per (sequence, layer), the union over heads.
// kPerKvHead: one visit list per (sequence, layer, KV head).
enum class Granularity { kUnion, kPerKvHead };

const char* HeadModeName(HeadMode mode);
const char* BudgetName(Budget budget);
const char* GranularityName(Granularity granularity);
const char* MassScopeName(MassScope scope);

// A floor of unforced groups above its ceiling (max_pages 0: no ceiling) is refused, naming
// both as `<prefix>min_pages` and `<prefix>max_pages` ("" for the policy's own fields,
// "mass_layers[i]." for a layer's). SelectPolicy::Validate checks it; epsd also checks it on
// the values as sent, before they are capped (service/convert.cc).
absl::Status CheckPageBounds(int64_t min_pages, int64_t max_pages, const std::string& prefix);

struct SelectPolicy {
  // questclt: the best ranking of real keys from quest's record (docs/policy.md,
  // "The default method").
  Method method = Method::kQuestClt;
  float alpha = 1.0f;   // in [1, kMaxAlpha]; larger visits more
  int first_n = 1;      // attention-sink groups always visited
  int last_n = 2;       // most recent groups always visited, the newest among them
  int top_pages = 64;   // M (64 groups of g = 2 blocks: 2,048 tokens per head)
  bool strict = false;  // superset of the true top-M by max_i q·k_i, guaranteed
  HeadMode heads = HeadMode::kAll;
  // [num_layers * num_q_heads], 1 marks a retrieval head; used with kRetrieval.
  std::vector<uint8_t> retrieval_heads;
  Budget budget = Budget::kThreshold;
  float top_p = 0.95f;  // with kTopP, in (0, 1]
  // With kMass (defaults chosen by the evaluation, docs/eval/README.md):
  float mass_target = 0.95f;      // p, in (0, 1]
  float mass_temperature = 1.0f;  // τ, in (0, 1000]: logit estimate = score / (τ·sqrt(d))
  int min_pages = 0;              // floor: unforced groups always added per head (list), ≥ 0
  int max_pages = 0;              // ceiling: unforced groups per head (list) at most; 0 = none
  MassScope mass_scope = MassScope::kHead;
  // With kMass: empty, every layer takes the four settings above; else one setting per
  // layer (num_layers of them), which replace them: settings calibrated per layer
  // (docs/eval/issue19-budgets-feedback.md, "The adaptive budget with selection feedback").
  std::vector<MassSetting> mass_layers;
  Granularity granularity = Granularity::kUnion;
  // With a coarse level (ModelLayout.coarse_blocks; docs/policy-selection.md, "Coarse-to-fine"):
  // each scored head names its ceil(coarse_candidates · top_pages / r) best unforced
  // coarse groups as candidates (r = groups per coarse group); only the groups inside
  // the list's candidates (and the forced ones) are scored and may be visited. In
  // [1, 1024]; larger reads more fine records and misses fewer groups.
  float coarse_candidates = 2.0f;

  absl::Status Validate(const ModelLayout& model) const;
  // Whether a step under this policy uses `model`'s coarse level: there is one,
  // the method scores, and not strict mode (whose guarantee needs every group's
  // bracket: strict reads every fine record, as without a coarse level).
  bool UsesCoarseLevel(const ModelLayout& model) const {
    return model.has_coarse_level() && method != Method::kOff && !strict;
  }
  // The mass-budget setting of `layer`: mass_layers[layer], or the policy's own fields
  // when mass_layers is empty.
  MassSetting MassFor(int layer) const {
    return mass_layers.empty() ? MassSetting{mass_target, mass_temperature, min_pages, max_pages}
                               : mass_layers[static_cast<size_t>(layer)];
  }
  // The coarse groups each scored head names beyond the forced ones (see coarse_candidates).
  int CoarseCandidates(const ModelLayout& model) const;
  bool HeadIsScored(const ModelLayout& model, int layer, int q_head) const {
    return heads == HeadMode::kAll ||
           retrieval_heads[static_cast<size_t>(layer) * model.num_q_heads + q_head] != 0;
  }
  std::string DebugString() const;
};

// Marks the groups every head visits: the first first_n, the last last_n (which
// include the newest) and the newest (n-1) even when last_n = 0. `visit` has n entries.
void MarkForced(const SelectPolicy& policy, std::span<uint8_t> visit);

// Marks the coarse groups that hold a forced group: `forced` has one entry per
// group, `coarse` one per coarse group of `ratio` groups (the last may be partial).
void MarkCoarseForced(std::span<const uint8_t> forced, int ratio, std::span<uint8_t> coarse);

// Threshold rule for one head: T = the top_pages-th largest score among the
// unforced groups; marks every unforced group with score ≥ T/α (T·α when T ≤ 0).
// With at most top_pages unforced groups, marks them all.
void MarkByThreshold(std::span<const float> scores, std::span<const uint8_t> forced, int top_pages,
                     float alpha, std::span<uint8_t> visit);

// Strict rule for one head: L = the top_pages-th largest lower bound over all
// groups; marks every group whose upper bound is ≥ L. Every group left out is
// beaten by at least top_pages others, so the marks contain the true top-M.
void MarkStrict(std::span<const MaxScoreBracket> brackets, int top_pages, std::span<uint8_t> visit);

// Top-p rule for one head: estimated mass w_p = exp((s_p − s_max)/sqrt(d)),
// marks unforced groups by decreasing w until their share reaches top_p.
void MarkTopP(std::span<const float> scores, std::span<const uint8_t> forced, float top_p,
              int head_dim, std::span<uint8_t> visit);

// 1/(τ·sqrt(d)) in double: a score times it is the mass budget's logit estimate
// (MarkByMass, MarkByMassList; the device takes the same value).
double MassInvScale(float temperature, int head_dim);

// Mass budget for one head (docs/policy-selection.md, "Mass budget"). Over all n groups,
// forced ones included, w_p = exp((s_p − s_max) / (temperature·sqrt(d))),
// W = Σ w. Covered mass C starts at the forced groups' w. Unforced groups are
// taken by decreasing w (ties: the more recent group first): the first
// min_pages always, then one more while C < target·W, never more than
// max_pages in all (max_pages = 0: no ceiling). Groups with score −∞ (empty)
// have w = 0 and are only taken to fill the floor.
void MarkByMass(std::span<const float> scores, std::span<const uint8_t> forced, float target,
                float temperature, int head_dim, int min_pages, int max_pages,
                std::span<uint8_t> visit);

// Mass budget over the heads of one output list (mass_scope = list; docs/policy-selection.md,
// "Mass budget"). Each head's w_p as in MarkByMass, over its own total W_h; a
// group's share σ_p = Σ_h w_hp / W_h over the heads with W_h > 0, rounded to
// float (the device keeps shares in 4 bytes), S = Σ σ. Covered C starts at the
// forced groups' σ. Unforced groups are taken by decreasing σ (ties: the more
// recent group first): the first min_pages always, then one more while
// C < target·S, never more than max_pages (0: no ceiling). A list without
// heads takes nothing beyond its forced groups.
void MarkByMassList(std::span<const std::span<const float>> head_scores,
                    std::span<const uint8_t> forced, float target, float temperature, int head_dim,
                    int min_pages, int max_pages, std::span<uint8_t> visit);

// Whether a feedback entry (the log-sum-exp of a visited group) counts
// (core/feedback_entry.h): a bad entry costs that group its feedback and nothing else.
inline bool IsFeedback(float entry) { return std::fabs(entry) <= kFeedbackMax; }

// Selection feedback for one head (core/step.h StepInputs::feedback): `entry[p]` is
// the previous step's log Σ exp(q·k/√d) over group p (NaN: not visited). Groups with
// an entry (IsFeedback) score √d·entry; the others keep their score plus the median of
// (√d·entry − score) over the groups with an entry and a finite score (0 when
// there is none). −∞ scores (unscored groups) stay −∞.
void ApplyFeedback(std::span<const float> entry, int head_dim, std::span<float> scores);

// Fixed budget over several heads: ranks the unforced groups by their best rank
// over `head_scores` (ties to the more recent group) and marks the first
// top_pages. The marked count is exactly min(unforced, top_pages).
void MarkFixedBudget(std::span<const std::span<const float>> head_scores,
                     std::span<const uint8_t> forced, int top_pages, std::span<uint8_t> visit);

}  // namespace eps
