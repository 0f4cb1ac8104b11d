#include "core/select.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace eps {

const char* HeadModeName(HeadMode mode) { return mode == HeadMode::kAll ? "all" : "retrieval"; }

const char* BudgetName(Budget budget) {
  switch (budget) {
    case Budget::kThreshold:
      return "threshold";
    case Budget::kFixed:
      return "fixed";
    case Budget::kTopP:
      return "top_p";
    case Budget::kMass:
      return "mass";
  }
  return "unknown";
}

const char* GranularityName(Granularity granularity) {
  return granularity == Granularity::kUnion ? "union" : "per_kv_head";
}

const char* MassScopeName(MassScope scope) { return scope == MassScope::kHead ? "head" : "list"; }

namespace {

// A float as the caller sent it, for a refusal: absl::StrCat keeps 6 significant digits,
// so top_p=1.0000001 was refused as "top_p=1 not in (0, 1]". The shortest text that reads
// back as the same float (std::to_chars) names it, and 1e30 stays "1e+30".
std::string AsSent(float value) {
  char text[32];
  const auto [end, error] = std::to_chars(text, text + sizeof(text), value);
  return error == std::errc() ? std::string(text, end) : absl::StrCat(value);
}

// One mass-budget setting's ranges; `prefix` names where it sits ("" for the policy's own).
absl::Status ValidateMass(const MassSetting& m, const std::string& prefix) {
  if (!(m.target > 0.0f && m.target <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, prefix.empty() ? "mass_" : "",
                                                   "target=", AsSent(m.target), " not in (0, 1]"));
  }
  if (!(m.temperature > 0.0f && m.temperature <= 1000.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, prefix.empty() ? "mass_" : "",
                                                   "temperature=", AsSent(m.temperature),
                                                   " not in (0, 1000]"));
  }
  if (m.min_pages < 0 || m.max_pages < 0) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "min_pages=", m.min_pages, ", ", prefix,
                                                   "max_pages=", m.max_pages, " must be >= 0"));
  }
  return CheckPageBounds(m.min_pages, m.max_pages, prefix);
}

}  // namespace

absl::Status CheckPageBounds(int64_t min_pages, int64_t max_pages, const std::string& prefix) {
  if (max_pages > 0 && min_pages > max_pages) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "min_pages=", min_pages, " exceeds ",
                                                   prefix, "max_pages=", max_pages));
  }
  return absl::OkStatus();
}

absl::Status SelectPolicy::Validate(const ModelLayout& model) const {
  if (!(alpha >= 1.0f) || !std::isfinite(alpha)) {
    return absl::InvalidArgumentError(
        absl::StrCat("alpha=", AsSent(alpha), " must be finite and >= 1"));
  }
  if (alpha > kMaxAlpha) {
    return absl::InvalidArgumentError(
        absl::StrCat("alpha=", AsSent(alpha), " exceeds ", kMaxAlpha));
  }
  if (first_n < 0 || last_n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_n=", first_n, ", last_n=", last_n, " must be >= 0"));
  }
  // A bound whose part the records lack would silently score as fro (core/bounds.cc):
  // refuse it, so a default method never degrades quietly on an engine's layout.
  // Strict mode scores with its own bracket (BracketMaxScore), not the method.
  const bool scores_by_method = !strict || method == Method::kOff;
  // quest is a bound and reads the 16-bit part only; questclt, an estimate,
  // reads quest8 where the records hold it (half the bytes), else the 16-bit part.
  if (scores_by_method && method == Method::kQuest && !model.features.quest) {
    return absl::InvalidArgumentError(
        absl::StrCat("method=quest needs the 16-bit quest part in the summary records "
                     "(features.quest",
                     model.features.quest8 ? "; quest8 serves questclt only" : "",
                     "); write it or choose another method (questclt, jl, fro)"));
  }
  if (scores_by_method && method == Method::kQuestClt && !model.features.quest &&
      !model.features.quest8) {
    return absl::InvalidArgumentError(
        "method=questclt needs a quest part in the summary records (features.quest8 or "
        "features.quest); write one or choose another method (jl, fro)");
  }
  if (scores_by_method && method == Method::kOnePc && !model.features.principal) {
    return absl::InvalidArgumentError(
        "method=1pc needs the principal pair in the summary records (features.principal); "
        "write it or choose another method (jl, fro)");
  }
  if (top_pages < 1) {
    return absl::InvalidArgumentError(absl::StrCat("top_pages=", top_pages, " must be >= 1"));
  }
  // Every field is checked whatever the budget: a bad value kept for another budget would
  // be refused only at the step that switches to it.
  if (!(top_p > 0.0f && top_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p=", AsSent(top_p), " not in (0, 1]"));
  }
  {
    if (absl::Status s = ValidateMass({mass_target, mass_temperature, min_pages, max_pages}, "");
        !s.ok()) {
      return s;
    }
    if (!mass_layers.empty() && mass_layers.size() != static_cast<size_t>(model.num_layers)) {
      return absl::InvalidArgumentError(absl::StrCat("mass_layers has ", mass_layers.size(),
                                                     " settings, want one per layer (",
                                                     model.num_layers, ") or none"));
    }
    for (size_t layer = 0; layer < mass_layers.size(); ++layer) {
      if (absl::Status s =
              ValidateMass(mass_layers[layer], absl::StrCat("mass_layers[", layer, "]."));
          !s.ok()) {
        return s;
      }
    }
  }
  // Checked whenever given (not only in retrieval mode), so that a session's marks of the
  // wrong size are refused at Attach, not at the call that switches to retrieval.
  if (heads == HeadMode::kRetrieval || !retrieval_heads.empty()) {
    const size_t want = static_cast<size_t>(model.num_layers) * model.num_q_heads;
    if (retrieval_heads.size() != want) {
      return absl::InvalidArgumentError(absl::StrCat("retrieval_heads has ", retrieval_heads.size(),
                                                     " marks, want layers*q_heads=", want));
    }
  }
  if (!(coarse_candidates >= 1.0f && coarse_candidates <= 1024.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("coarse_candidates=", AsSent(coarse_candidates), " not in [1, 1024]"));
  }
  if (strict && budget != Budget::kThreshold) {
    return absl::InvalidArgumentError(
        absl::StrCat("strict mode replaces the budget rule; budget=", BudgetName(budget)));
  }
  return absl::OkStatus();
}

std::string SelectPolicy::DebugString() const {
  return absl::StrCat(
      "method=", MethodName(method), " alpha=", alpha, " first_n=", first_n, " last_n=", last_n,
      " top_pages=", top_pages, " strict=", strict, " heads=", HeadModeName(heads),
      " budget=", BudgetName(budget), " top_p=", top_p, " mass_target=", mass_target,
      " mass_temperature=", mass_temperature, " min_pages=", min_pages, " max_pages=", max_pages,
      " mass_scope=", MassScopeName(mass_scope), " granularity=", GranularityName(granularity),
      " coarse_candidates=", coarse_candidates,
      mass_layers.empty() ? "" : absl::StrCat(" mass_layers=", mass_layers.size()));
}

int SelectPolicy::CoarseCandidates(const ModelLayout& model) const {
  const int ratio = std::max(1, model.coarse_ratio());
  const double want = std::ceil(static_cast<double>(coarse_candidates) * top_pages / ratio);
  return static_cast<int>(std::min<double>(want, std::numeric_limits<int>::max()));
}

void MarkCoarseForced(std::span<const uint8_t> forced, int ratio, std::span<uint8_t> coarse) {
  for (size_t p = 0; p < forced.size(); ++p) {
    if (forced[p]) coarse[p / static_cast<size_t>(ratio)] = 1;
  }
}

void MarkForced(const SelectPolicy& policy, std::span<uint8_t> visit) {
  const int64_t n = static_cast<int64_t>(visit.size());
  if (n == 0) return;
  for (int64_t p = 0; p < std::min<int64_t>(policy.first_n, n); ++p) visit[p] = 1;
  for (int64_t p = std::max<int64_t>(0, n - policy.last_n); p < n; ++p) visit[p] = 1;
  visit[n - 1] = 1;
}

void MarkByThreshold(std::span<const float> scores, std::span<const uint8_t> forced, int top_pages,
                     float alpha, std::span<uint8_t> visit) {
  std::vector<float> candidates;
  candidates.reserve(scores.size());
  for (size_t p = 0; p < scores.size(); ++p) {
    if (!forced[p]) candidates.push_back(scores[p]);
  }
  if (candidates.empty()) return;
  float threshold = -std::numeric_limits<float>::infinity();
  if (static_cast<int64_t>(candidates.size()) > top_pages) {
    std::nth_element(candidates.begin(), candidates.begin() + (top_pages - 1), candidates.end(),
                     std::greater<float>());
    const float t = candidates[top_pages - 1];
    threshold = t > 0.0f ? t / alpha : t * alpha;
  }
  for (size_t p = 0; p < scores.size(); ++p) {
    if (!forced[p] && scores[p] >= threshold) visit[p] = 1;
  }
}

void MarkStrict(std::span<const MaxScoreBracket> brackets, int top_pages,
                std::span<uint8_t> visit) {
  const int64_t n = static_cast<int64_t>(brackets.size());
  if (n <= top_pages) {
    std::fill(visit.begin(), visit.end(), uint8_t{1});
    return;
  }
  std::vector<float> lower(n);
  for (int64_t p = 0; p < n; ++p) lower[p] = brackets[p].lower;
  std::nth_element(lower.begin(), lower.begin() + (top_pages - 1), lower.end(),
                   std::greater<float>());
  const float floor_of_top = lower[top_pages - 1];
  for (int64_t p = 0; p < n; ++p) {
    if (brackets[p].upper >= floor_of_top) visit[p] = 1;
  }
}

void MarkTopP(std::span<const float> scores, std::span<const uint8_t> forced, float top_p,
              int head_dim, std::span<uint8_t> visit) {
  std::vector<int64_t> order;
  float top = -std::numeric_limits<float>::infinity();
  for (size_t p = 0; p < scores.size(); ++p) {
    if (!forced[p]) {
      order.push_back(static_cast<int64_t>(p));
      top = std::max(top, scores[p]);
    }
  }
  if (order.empty()) return;
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(head_dim));
  std::vector<double> mass(scores.size(), 0.0);
  double total = 0.0;
  for (int64_t p : order) {
    mass[p] = std::exp(static_cast<double>(scores[p] - top) * inv_sqrt_d);
    total += mass[p];
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return mass[a] > mass[b]; });
  double covered = 0.0;
  for (int64_t p : order) {
    visit[p] = 1;
    covered += mass[p];
    if (covered >= MassGoal(top_p, total)) break;
  }
}

namespace {

// w_p = exp((s_p − s_max)·inv_scale) over one head's scores; 0 for an empty
// group (score −∞) and for every group when all are empty. Returns W = Σ w.
double HeadMasses(std::span<const float> scores, double inv_scale, std::vector<double>& mass) {
  const int64_t n = static_cast<int64_t>(scores.size());
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < n; ++p) top = std::max(top, scores[p]);
  mass.assign(n, 0.0);
  double total = 0.0;
  for (int64_t p = 0; p < n; ++p) {
    if (std::isfinite(top) && scores[p] > -std::numeric_limits<float>::infinity()) {
      mass[p] = std::exp((static_cast<double>(scores[p]) - top) * inv_scale);
    }
    total += mass[p];
  }
  return total;
}

// The mass budget's walk, shared by both scopes: covered C starts at the forced
// groups' mass; unforced groups by decreasing mass (ties to the more recent
// group), the first min_pages always, then one more while C < target·Σ mass,
// never more than max_pages in all (0: no ceiling).
void TakeByMass(std::span<const double> mass, std::span<const uint8_t> forced, float target,
                int min_pages, int max_pages, std::span<uint8_t> visit) {
  const int64_t n = static_cast<int64_t>(mass.size());
  double total = 0.0;
  double covered = 0.0;
  std::vector<int64_t> order;
  for (int64_t p = 0; p < n; ++p) {
    total += mass[p];
    if (forced[p]) {
      covered += mass[p];
    } else {
      order.push_back(p);
    }
  }
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return mass[a] != mass[b] ? mass[a] > mass[b] : a > b; });
  const int64_t ceiling = max_pages > 0
                              ? std::min<int64_t>(max_pages, static_cast<int64_t>(order.size()))
                              : static_cast<int64_t>(order.size());
  const double goal = MassGoal(target, total);
  for (int64_t i = 0; i < ceiling; ++i) {
    if (i >= min_pages && covered >= goal) break;
    visit[order[i]] = 1;
    covered += mass[order[i]];
  }
}

}  // namespace

double MassInvScale(float temperature, int head_dim) {
  return 1.0 / (static_cast<double>(temperature) * std::sqrt(head_dim));
}

void MarkByMass(std::span<const float> scores, std::span<const uint8_t> forced, float target,
                float temperature, int head_dim, int min_pages, int max_pages,
                std::span<uint8_t> visit) {
  // Scores are bounds or estimates of a group's largest q·k; divided by
  // τ·sqrt(d) they stand in for its largest logit. Every group counts in the
  // total, so the sinks' and recent groups' mass is credited to the target.
  std::vector<double> mass;
  HeadMasses(scores, MassInvScale(temperature, head_dim), mass);
  TakeByMass(mass, forced, target, min_pages, max_pages, visit);
}

void MarkByMassList(std::span<const std::span<const float>> head_scores,
                    std::span<const uint8_t> forced, float target, float temperature, int head_dim,
                    int min_pages, int max_pages, std::span<uint8_t> visit) {
  if (head_scores.empty()) return;
  const size_t n = forced.size();
  const double inv_scale = MassInvScale(temperature, head_dim);
  std::vector<double> share(n, 0.0);
  std::vector<double> mass;
  for (std::span<const float> scores : head_scores) {
    const double total = HeadMasses(scores, inv_scale, mass);
    if (!(total > 0.0)) continue;
    for (size_t p = 0; p < n; ++p) share[p] += mass[p] / total;
  }
  for (double& s : share) s = static_cast<double>(static_cast<float>(s));
  TakeByMass(share, forced, target, min_pages, max_pages, visit);
}

void MarkFixedBudget(std::span<const std::span<const float>> head_scores,
                     std::span<const uint8_t> forced, int top_pages, std::span<uint8_t> visit) {
  const int64_t n = static_cast<int64_t>(forced.size());
  std::vector<int64_t> candidates;
  for (int64_t p = 0; p < n; ++p) {
    if (!forced[p]) candidates.push_back(p);
  }
  if (candidates.empty()) return;
  if (static_cast<int64_t>(candidates.size()) <= top_pages) {
    for (int64_t p : candidates) visit[p] = 1;
    return;
  }
  // best_rank[p]: the best (smallest) rank of p over heads; no heads -> recency (the
  // step never calls it so: a list without a scored head keeps its forced groups).
  std::vector<int64_t> best_rank(n, std::numeric_limits<int64_t>::max());
  std::vector<int64_t> order;
  for (std::span<const float> scores : head_scores) {
    order = candidates;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return scores[a] > scores[b] || (scores[a] == scores[b] && a > b);
    });
    for (size_t r = 0; r < order.size(); ++r) {
      best_rank[order[r]] = std::min<int64_t>(best_rank[order[r]], r);
    }
  }
  std::stable_sort(candidates.begin(), candidates.end(), [&](int64_t a, int64_t b) {
    return best_rank[a] < best_rank[b] || (best_rank[a] == best_rank[b] && a > b);
  });
  for (int i = 0; i < top_pages; ++i) visit[candidates[i]] = 1;
}

void ApplyFeedback(std::span<const float> entry, int head_dim, std::span<float> scores) {
  const double scale = std::sqrt(static_cast<double>(head_dim));
  std::vector<double> diffs;
  for (size_t p = 0; p < scores.size(); ++p) {
    if (IsFeedback(entry[p]) && std::isfinite(scores[p])) {
      diffs.push_back(scale * entry[p] - scores[p]);
    }
  }
  double offset = 0.0;
  if (!diffs.empty()) {
    // The median (the mean of the two middle values for an even count).
    const size_t mid = diffs.size() / 2;
    std::nth_element(diffs.begin(), diffs.begin() + mid, diffs.end());
    offset = diffs[mid];
    if (diffs.size() % 2 == 0) {
      offset = 0.5 * (offset + *std::max_element(diffs.begin(), diffs.begin() + mid));
    }
  }
  for (size_t p = 0; p < scores.size(); ++p) {
    if (IsFeedback(entry[p])) {
      scores[p] = static_cast<float>(scale * entry[p]);
    } else if (std::isfinite(scores[p])) {
      scores[p] = static_cast<float>(scores[p] + offset);
    }
  }
}

}  // namespace eps
