#include "core/bounds.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/summary.h"

namespace eps {

const char* MethodName(Method method) {
  switch (method) {
    case Method::kOff:
      return "off";
    case Method::kJl:
      return "jl";
    case Method::kOnePc:
      return "1pc";
    case Method::kFro:
      return "fro";
    case Method::kQuest:
      return "quest";
    case Method::kQuestClt:
      return "questclt";
  }
  return "unknown";
}

bool ParseMethod(std::string_view name, Method* method) {
  for (Method m : {Method::kOff, Method::kJl, Method::kOnePc, Method::kFro, Method::kQuest,
                   Method::kQuestClt}) {
    if (name == MethodName(m)) {
      *method = m;
      return true;
    }
  }
  return false;
}

void QueryTerms::Prepare(const PhiBank& phi, int layer, int kv_head, std::span<const float> query) {
  const int d = phi.head_dim();
  const int m = phi.sketch_dim();
  q.assign(query.begin(), query.begin() + d);
  float n2 = 0.0f;
  for (float x : q) n2 += x * x;
  norm = std::sqrt(n2);
  z.resize(m);
  phi.Project(layer, kv_head, q, z);
  zz.resize(PackedSize(m));
  for (int i = 0, p = 0; i < m; ++i) {
    for (int j = i; j < m; ++j, ++p) zz[p] = (i == j ? 1.0f : 2.0f) * z[i] * z[j];
  }
}

float BoundSlack(float count, int head_dim) {
  const float d = static_cast<float>(head_dim);
  return std::max(kBoundSlack, std::ldexp(count + d * std::sqrt(d), -22));
}

float JlScore(std::span<const float> record, const SummaryLayout& layout, const QueryTerms& q) {
  float quad = 0.0f;
  for (int p = 0; p < layout.gram_words; ++p) quad += record[p] * q.zz[p];
  return std::sqrt(std::max(quad, 0.0f));
}

float FroBound(std::span<const float> record, const SummaryLayout& layout, const QueryTerms& q) {
  return q.norm * std::sqrt(std::max(record[layout.fro2], 0.0f));
}

float OnePcBound(std::span<const float> record, const SummaryLayout& layout, const QueryTerms& q) {
  if (layout.principal < 0) return FroBound(record, layout, q);
  const float lambda = record[layout.principal];
  const float r2 = record[layout.principal + 1];
  const float scale = record[layout.principal + 2];
  if (scale == 0.0f) return FroBound(record, layout, q);  // not sealed
  float dot = 0.0f;
  for (int i = 0; i < layout.head_dim; ++i) {
    dot += static_cast<float>(PrincipalComponent(record, layout, i)) * q.q[i];
  }
  // q = (v·q)v + q⊥ with v the unit dequantised direction: ‖C^½q‖ ≤ |v·q|·sqrt(λ1) +
  // ‖q⊥‖·sqrt(r²), since q⊥ᵀCq⊥ ≤ trace(P⊥CP⊥)‖q⊥‖² = r²‖q⊥‖². Never looser than fro.
  const float along = std::abs(dot * scale);
  const float q2 = q.norm * q.norm;
  const float perp = std::sqrt(std::max(q2 - along * along, 0.0f) +
                               std::ldexp(static_cast<float>(layout.head_dim), -22) * q2);
  // r² = fro2 − λ1 cancels for nearly rank-1 groups: pad it by the rounding
  // error of the two sums, ~(n + d)·u·fro2, so the bound stays a bound.
  const float fro2 = std::max(record[layout.fro2], 0.0f);
  const float pad =
      std::ldexp(record[layout.count] + static_cast<float>(layout.head_dim), -22) * fro2;
  const float bound =
      std::sqrt(std::max(lambda, 0.0f)) * along + std::sqrt(std::max(r2, 0.0f) + pad) * perp;
  return std::min(bound, FroBound(record, layout, q));
}

float QuestBound(std::span<const float> record, const SummaryLayout& layout, const QueryTerms& q) {
  if (layout.quest_min < 0) return FroBound(record, layout, q);
  if (record[layout.count] <= 0.0f) return -std::numeric_limits<float>::infinity();  // no keys
  // The sign-split form the GPU sums (gpu/warp_sums.cuh QuestSplitQuery): equal
  // to max(q·min, q·max) channel by channel for a well-formed record (min ≤ max,
  // finite), and the same on both backends for any other (an inverted range
  // scores its own way on both; a NaN half, or an infinite one that a zero side
  // of q meets, gives NaN: the step fails naming the summary).
  float sum = 0.0f;
  for (int i = 0; i < layout.head_dim; ++i) {
    sum += std::min(q.q[i], 0.0f) * QuestMin(record, layout, i) +
           std::max(q.q[i], 0.0f) * QuestMax(record, layout, i);
  }
  return sum;
}

// The quest part read as a centre and a half-width per channel. Where a
// group's keys spread over many channels, their worst cases (quest) rarely
// meet in one key: q·k varies around q·c by about the root of the channels'
// squared spreads, not their sum (docs/eval/issue19-estimators.md measured the ranking).
//
// With the quest8 part the channels are codes in units of the record's scale
// s: the sums run over the codes and take s at the end (s·centre + s·spread^½),
// as the GPU's do.
float QuestCltScore(std::span<const float> record, const SummaryLayout& layout,
                    const QueryTerms& q) {
  if (layout.quest8 >= 0) {
    if (record[layout.count] <= 0.0f) return -std::numeric_limits<float>::infinity();
    float centre = 0.0f, spread = 0.0f;
    for (int i = 0; i < layout.head_dim; ++i) {
      const float lo = static_cast<float>(Quest8MinCode(record, layout, i));
      const float hi = static_cast<float>(Quest8MaxCode(record, layout, i));
      centre += q.q[i] * 0.5f * (lo + hi);
      const float w = q.q[i] * 0.5f * (hi - lo);
      spread += w * w;
    }
    const float scale = Quest8Scale(record, layout);
    return scale * centre + scale * std::sqrt(spread);
  }
  if (layout.quest_min < 0) return FroBound(record, layout, q);
  if (record[layout.count] <= 0.0f) return -std::numeric_limits<float>::infinity();  // no keys
  float centre = 0.0f, spread = 0.0f;
  for (int i = 0; i < layout.head_dim; ++i) {
    const float lo = QuestMin(record, layout, i), hi = QuestMax(record, layout, i);
    centre += q.q[i] * 0.5f * (lo + hi);
    const float w = q.q[i] * 0.5f * (hi - lo);
    spread += w * w;
  }
  return centre + std::sqrt(spread);
}

float Score(Method method, std::span<const float> record, const SummaryLayout& layout,
            const QueryTerms& q) {
  switch (method) {
    case Method::kOff:
      return 0.0f;
    case Method::kJl:
      return JlScore(record, layout, q);
    case Method::kOnePc:
      return OnePcBound(record, layout, q);
    case Method::kFro:
      return FroBound(record, layout, q);
    case Method::kQuest:
      return QuestBound(record, layout, q);
    case Method::kQuestClt:
      return QuestCltScore(record, layout, q);
  }
  return 0.0f;
}

bool RecordIsFinite(std::span<const float> record, const SummaryLayout& layout) {
  const auto finite = [&](int from, int count) {
    return from < 0 || std::all_of(record.begin() + from, record.begin() + from + count,
                                   [](float x) { return std::isfinite(x); });
  };
  if (!finite(0, layout.fro2 + 3) || !finite(layout.key_sum, layout.head_dim) ||
      !finite(layout.principal, 3) ||
      (layout.quest8 >= 0 && !finite(layout.quest8 + layout.head_dim / 2, 1))) {
    return false;
  }
  // Reset's empty range is ±∞; a record with keys holds finite halves (Append refuses keys
  // beyond ±65504, whose outward rounding would be infinite).
  const bool has_keys = record[layout.count] > 0.0f;
  for (int i = 0; layout.quest_min >= 0 && i < layout.head_dim; ++i) {
    const float lo = QuestMin(record, layout, i), hi = QuestMax(record, layout, i);
    if (std::isnan(lo) || std::isnan(hi) || (has_keys && (std::isinf(lo) || std::isinf(hi)))) {
      return false;
    }
  }
  return true;
}

MaxScoreBracket BracketMaxScore(std::span<const float> record, const SummaryLayout& layout,
                                const QueryTerms& q) {
  const float count = record[layout.count];
  const float inf = std::numeric_limits<float>::infinity();
  if (count <= 0.0f) return {-inf, -inf};
  // ‖q‖² and fro2 are float sums of squares, and a square below the float range (an element
  // under about 2^-63) keeps few of its bits or none: ‖q‖ or fro2 can read 0 for a query or
  // keys that are not 0, and fro, 1pc and the slack, all scaled by them, then bound nothing
  // (a group of keys +k and -k got [0, 0] around its max q·k > 0). Above these floors every
  // square's loss is under 2^-30 of the sum, far inside the slack; below them no bound is
  // known, and the group stays a candidate for every rule.
  const float d = static_cast<float>(layout.head_dim);
  if (!(q.norm >= std::ldexp(std::sqrt(d), -60)) ||
      !(record[layout.fro2] >= std::ldexp(count * d, -120))) {
    return {-inf, inf};
  }
  const float slack = BoundSlack(count, layout.head_dim) * q.norm * record[layout.max_norm];
  // fro and 1pc bound max_i |q·k_i|; quest bounds the signed max only.
  float abs_upper = FroBound(record, layout, q);
  if (layout.principal >= 0) abs_upper = std::min(abs_upper, OnePcBound(record, layout, q));
  float upper = abs_upper;
  if (layout.quest_min >= 0) upper = std::min(upper, QuestBound(record, layout, q));
  float lower = -abs_upper;
  if (layout.key_sum >= 0) {
    const float* sum = record.data() + layout.key_sum;
    float dot = 0.0f;
    for (int i = 0; i < layout.head_dim; ++i) dot += q.q[i] * sum[i];
    // q·Σk may leave the float range while the mean q·k̄ does not (many large keys): an
    // infinite or NaN mean is no bound (+inf contradicted the upper bound and left the
    // group [inf, inf], so strict mode skipped every other group, the true top among them).
    if (const float mean = dot / count; std::isfinite(mean)) lower = mean;
  }
  // Bounds that contradict each other (the upper below the mean, which is a max's lower
  // bound) came from squared norms below the float range, which return above now; kept as a
  // guard against rounding putting the mean over a tight upper bound: no upper bound then.
  if (lower > upper) upper = inf;
  return {lower - slack, upper + slack};
}

}  // namespace eps
