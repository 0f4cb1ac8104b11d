#include "core/select.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace eps {
namespace {

std::vector<uint8_t> Forced(const SelectPolicy& policy, int n) {
  std::vector<uint8_t> forced(n, 0);
  MarkForced(policy, forced);
  return forced;
}

int Count(const std::vector<uint8_t>& v) { return std::accumulate(v.begin(), v.end(), 0); }

TEST(SelectTest, ForcedGroupsAreSinksRecentAndNewest) {
  SelectPolicy policy;
  policy.first_n = 2;
  policy.last_n = 3;
  const std::vector<uint8_t> forced = Forced(policy, 10);
  EXPECT_EQ(forced, (std::vector<uint8_t>{1, 1, 0, 0, 0, 0, 0, 1, 1, 1}));
  policy.first_n = policy.last_n = 0;
  EXPECT_EQ(Forced(policy, 4), (std::vector<uint8_t>{0, 0, 0, 1})) << "newest group always";
}

TEST(SelectTest, ContextShorterThanSinksPlusRecentIsAllForced) {
  SelectPolicy policy;
  policy.first_n = 4;
  policy.last_n = 4;
  EXPECT_EQ(Count(Forced(policy, 7)), 7);
  EXPECT_EQ(Count(Forced(policy, 1)), 1);
  std::vector<uint8_t> empty;
  MarkForced(policy, empty);  // no groups: nothing to mark, no crash
}

TEST(SelectTest, ThresholdWithAlphaOneVisitsExactlyTopPagesOfDistinctScores) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SelectPolicy policy;
  const int n = 200;
  const std::vector<uint8_t> forced = Forced(policy, n);
  std::vector<float> scores = testing::GaussianVector(rng, n);
  std::vector<uint8_t> visit = forced;
  MarkByThreshold(scores, forced, 16, 1.0f, visit);
  EXPECT_EQ(Count(visit), Count(forced) + 16);
  // Every visited unforced group outscores every skipped one.
  float lowest_visited = 1e30f, highest_skipped = -1e30f;
  for (int p = 0; p < n; ++p) {
    if (forced[p]) continue;
    if (visit[p])
      lowest_visited = std::min(lowest_visited, scores[p]);
    else
      highest_skipped = std::max(highest_skipped, scores[p]);
  }
  EXPECT_GT(lowest_visited, highest_skipped);
}

TEST(SelectTest, LargerAlphaNeverVisitsFewerGroups) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SelectPolicy policy;
  const int n = 300;
  const std::vector<uint8_t> forced = Forced(policy, n);
  std::vector<float> scores = testing::GaussianVector(rng, n);
  for (float& s : scores) s = std::abs(s);
  int previous = 0;
  for (float alpha : {1.0f, 1.2f, 1.5f, 2.0f, 4.0f}) {
    std::vector<uint8_t> visit = forced;
    MarkByThreshold(scores, forced, 8, alpha, visit);
    EXPECT_GE(Count(visit), previous) << "alpha " << alpha;
    previous = Count(visit);
  }
}

TEST(SelectTest, ThresholdHandlesNegativeScoresAsQuestProduces) {
  SelectPolicy policy;
  policy.first_n = policy.last_n = 0;
  const std::vector<float> scores = {-5, -1, -3, -2, -4, -10};
  const std::vector<uint8_t> forced = Forced(policy, 6);  // newest (index 5) forced
  std::vector<uint8_t> visit = forced;
  MarkByThreshold(scores, forced, 2, 1.0f, visit);  // T = -2
  EXPECT_EQ(visit, (std::vector<uint8_t>{0, 1, 0, 1, 0, 1}));
  visit = forced;
  MarkByThreshold(scores, forced, 2, 1.5f, visit);  // T·α = -3 admits -3
  EXPECT_EQ(visit, (std::vector<uint8_t>{0, 1, 1, 1, 0, 1}));
}

TEST(SelectTest, ThresholdVisitsEveryCandidateWhenAtMostTopPages) {
  SelectPolicy policy;
  const std::vector<float> scores = {1, 0, 0, 0, 2};
  const std::vector<uint8_t> forced = Forced(policy, 5);
  std::vector<uint8_t> visit = forced;
  MarkByThreshold(scores, forced, 3, 1.0f, visit);
  EXPECT_EQ(Count(visit), 5);
}

TEST(SelectTest, StrictVisitsEverythingWhenNoMoreGroupsThanTopPages) {
  std::vector<MaxScoreBracket> brackets(5, {0.0f, 1.0f});
  std::vector<uint8_t> visit(5, 0);
  MarkStrict(brackets, 5, visit);
  EXPECT_EQ(Count(visit), 5);
}

TEST(SelectTest, StrictSkipsOnlyGroupsBeatenByTopPagesLowerBounds) {
  // Lower bounds of the top 2: 9 and 7, so L = 7; groups with upper < 7 go.
  const std::vector<MaxScoreBracket> brackets = {{9, 10}, {1, 6.9f}, {7, 8}, {-1, 7}, {0, 3}};
  std::vector<uint8_t> visit(5, 0);
  MarkStrict(brackets, 2, visit);
  EXPECT_EQ(visit, (std::vector<uint8_t>{1, 0, 1, 1, 0}));
}

TEST(SelectTest, TopPCoversTheRequestedEstimatedMass) {
  SelectPolicy policy;
  policy.first_n = policy.last_n = 0;
  const int n = 64, d = 64;
  std::vector<float> scores(n, 0.0f);
  scores[10] = 80;  // exp(80/8) dominates everything
  const std::vector<uint8_t> forced = Forced(policy, n);
  std::vector<uint8_t> visit = forced;
  MarkTopP(scores, forced, 0.9f, d, visit);
  EXPECT_EQ(Count(visit), 2);  // the dominant group and the newest
  EXPECT_TRUE(visit[10]);
  visit = forced;
  MarkTopP(scores, forced, 1.0f, d, visit);
  EXPECT_EQ(Count(visit), n);
}

// The estimated mass of `visit` (forced included) over the whole context, as
// MarkByMass defines it, recomputed here in the plainest way.
double EstimatedShare(const std::vector<float>& scores, const std::vector<uint8_t>& visit,
                      float temperature, int d) {
  const float top = *std::max_element(scores.begin(), scores.end());
  double total = 0, kept = 0;
  for (size_t p = 0; p < scores.size(); ++p) {
    const double w = std::exp((scores[p] - top) / (temperature * std::sqrt(double(d))));
    total += w;
    if (visit[p]) kept += w;
  }
  return kept / total;
}

TEST(SelectTest, MassBudgetTakesTheFewestGroupsReachingTheTarget) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SelectPolicy policy;
  const int d = 64;
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 300);
    std::vector<float> scores = testing::GaussianVector(rng, n);
    for (float& s : scores) s *= 20.0f;
    const float target = 0.05f + 0.95f * static_cast<float>(rng() % 1000) / 1000.0f;
    const float tau = 0.5f + static_cast<float>(rng() % 4);
    const std::vector<uint8_t> forced = Forced(policy, n);
    std::vector<uint8_t> visit = forced;
    MarkByMass(scores, forced, target, tau, d, 0, 0, visit);
    const double share = EstimatedShare(scores, visit, tau, d);
    EXPECT_GE(share, target - 1e-9) << "n=" << n << " target=" << target;
    // Minimal: without the lightest added group the share is below the target.
    int lightest = -1;
    for (int p = 0; p < n; ++p) {
      if (visit[p] && !forced[p] && (lightest < 0 || scores[p] <= scores[lightest])) lightest = p;
    }
    if (lightest >= 0) {
      visit[lightest] = 0;
      EXPECT_LT(EstimatedShare(scores, visit, tau, d), target + 1e-9) << "n=" << n;
    }
  }
}

TEST(SelectTest, MassBudgetCreditsTheForcedGroupsMass) {
  SelectPolicy policy;  // forced: group 0 and the last two
  const int n = 40, d = 64;
  std::vector<float> scores(n, 0.0f);
  scores[0] = 200;  // the sink holds nearly all the estimated mass
  scores[20] = 40;
  const std::vector<uint8_t> forced = Forced(policy, n);
  std::vector<uint8_t> visit = forced;
  MarkByMass(scores, forced, 0.99f, 1.0f, d, 0, 0, visit);
  EXPECT_EQ(visit, forced);
  // MarkTopP ignores the forced mass and must take group 20 at least.
  visit = forced;
  MarkTopP(scores, forced, 0.99f, d, visit);
  EXPECT_TRUE(visit[20]);
}

TEST(SelectTest, MassBudgetKeepsItsFloorAndCeiling) {
  SelectPolicy policy;
  const int n = 50, d = 64;
  std::vector<float> scores(n, 0.0f);
  for (int p = 0; p < n; ++p) scores[p] = static_cast<float>(p % 7);
  scores[0] = 500;
  const std::vector<uint8_t> forced = Forced(policy, n);
  std::vector<uint8_t> visit = forced;
  MarkByMass(scores, forced, 0.5f, 1.0f, d, /*min_pages=*/5, 0, visit);
  EXPECT_EQ(Count(visit), Count(forced) + 5) << "the floor, although the sink covers 0.5";
  scores[0] = 0;  // no dominant sink: target 1.0 wants every group
  visit = forced;
  MarkByMass(scores, forced, 1.0f, 1.0f, d, 0, /*max_pages=*/7, visit);
  EXPECT_EQ(Count(visit), Count(forced) + 7) << "the ceiling, although 1.0 wants every group";
  visit = forced;
  MarkByMass(scores, forced, 1.0f, 1.0f, d, 0, 0, visit);
  EXPECT_EQ(Count(visit), n);
}

TEST(SelectTest, MassBudgetNeverVisitsFewerForAHigherTarget) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SelectPolicy policy;
  const int n = 200, d = 128;
  std::vector<float> scores = testing::GaussianVector(rng, n);
  for (float& s : scores) s *= 30.0f;
  const std::vector<uint8_t> forced = Forced(policy, n);
  int last = 0;
  for (float target : {0.1f, 0.5f, 0.8f, 0.9f, 0.95f, 0.99f, 1.0f}) {
    std::vector<uint8_t> visit = forced;
    MarkByMass(scores, forced, target, 1.0f, d, 0, 0, visit);
    EXPECT_GE(Count(visit), last) << "target=" << target;
    last = Count(visit);
  }
}

TEST(SelectTest, MassBudgetLeavesEmptyGroupsOutUnlessTheFloorNeedsThem) {
  SelectPolicy policy;
  policy.first_n = policy.last_n = 0;
  const float ninf = -std::numeric_limits<float>::infinity();
  const std::vector<float> scores = {ninf, 3.0f, ninf, 1.0f};
  const std::vector<uint8_t> forced = Forced(policy, 4);
  std::vector<uint8_t> visit = forced;
  MarkByMass(scores, forced, 1.0f, 1.0f, 16, 0, 0, visit);
  EXPECT_EQ(visit, (std::vector<uint8_t>{0, 1, 0, 1}));
  visit = forced;
  MarkByMass(scores, forced, 0.01f, 1.0f, 16, 2, 0, visit);
  EXPECT_EQ(visit, (std::vector<uint8_t>{0, 1, 1, 1})) << "ties among empty: more recent first";
}

// The list's estimated mass held by `visit`: the mean over heads of each head's
// share (EstimatedShare), which is a union list's recall when the estimate is
// exact (eval/eps_eval/metrics.py).
double ListShare(const std::vector<std::vector<float>>& heads, const std::vector<uint8_t>& visit,
                 float temperature, int d) {
  double sum = 0;
  for (const std::vector<float>& scores : heads)
    sum += EstimatedShare(scores, visit, temperature, d);
  return sum / static_cast<double>(heads.size());
}

std::vector<std::span<const float>> Spans(const std::vector<std::vector<float>>& heads) {
  return {heads.begin(), heads.end()};
}

// At target 1 the walk's running sum (by decreasing mass) and the total (by index) round
// differently, and a walk left one ulp short took every remaining group, hundreds of
// zero-mass ones included, on about half the steps (the device, summing in yet another
// order, on other steps). The goal's slack (core/bounds.h MassGoal) makes every walk stop
// where the masses end.
TEST(SelectTest, AtTargetOneNoWalkTakesGroupsWithoutMass) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SelectPolicy policy;
  policy.first_n = policy.last_n = 0;
  const int n = 512, d = 128, live = 60;
  const float tau = 0.05f;
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<std::vector<float>> heads(2, std::vector<float>(n, -1e6f));  // mass 0
    for (auto& scores : heads) {
      for (int i = 0; i < live; ++i) {
        scores[rng() % (n - 1)] = static_cast<float>(rng() % 1000) / 100.0f;  // gaps of up to 10
      }
      scores[n - 1] = 10.0f;  // the newest group, forced
    }
    const std::vector<uint8_t> forced = Forced(policy, n);
    const auto massless = [&](const std::vector<uint8_t>& visit, int head) {
      int taken = 0;
      for (int p = 0; p < n; ++p) taken += visit[p] && heads[head][p] == -1e6f;
      return taken;
    };
    std::vector<uint8_t> visit = forced;
    MarkByMass(heads[0], forced, 1.0f, tau, d, 0, 0, visit);
    EXPECT_EQ(massless(visit, 0), 0) << "MarkByMass, trial " << trial;
    visit = forced;
    MarkTopP(heads[0], forced, 1.0f, d, visit);
    EXPECT_EQ(massless(visit, 0), 0) << "MarkTopP, trial " << trial;
    visit = forced;
    MarkByMassList(Spans(heads), forced, 1.0f, tau, d, 0, 0, visit);
    int either = 0;
    for (int p = 0; p < n; ++p) either += visit[p] && heads[0][p] == -1e6f && heads[1][p] == -1e6f;
    EXPECT_EQ(either, 0) << "MarkByMassList, trial " << trial;
  }
}

TEST(SelectTest, ListMassBudgetTakesTheFewestGroupsReachingTheListTarget) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SelectPolicy policy;
  const int d = 64;
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 300);
    const int h = 1 + static_cast<int>(rng() % 8);
    std::vector<std::vector<float>> heads(h);
    for (auto& scores : heads) {
      scores = testing::GaussianVector(rng, n);
      for (float& s : scores) s *= 20.0f;
    }
    const float target = 0.05f + 0.95f * static_cast<float>(rng() % 1000) / 1000.0f;
    const float tau = 0.5f + static_cast<float>(rng() % 4);
    const std::vector<uint8_t> forced = Forced(policy, n);
    std::vector<uint8_t> visit = forced;
    MarkByMassList(Spans(heads), forced, target, tau, d, 0, 0, visit);
    // Shares are rounded to float: reached within 1e-6 of the target.
    EXPECT_GE(ListShare(heads, visit, tau, d), target - 1e-6) << "n=" << n << " heads=" << h;
    // Minimal: without the added group of least list share, short of the target.
    std::vector<double> share(n, 0.0);
    for (int p = 0; p < n; ++p) {
      std::vector<uint8_t> one(n, 0);
      one[p] = 1;
      share[p] = ListShare(heads, one, tau, d);
    }
    int lightest = -1;
    for (int p = 0; p < n; ++p) {
      if (visit[p] && !forced[p] && (lightest < 0 || share[p] <= share[lightest])) lightest = p;
    }
    if (lightest >= 0) {
      visit[lightest] = 0;
      EXPECT_LT(ListShare(heads, visit, tau, d), target + 1e-6) << "n=" << n << " heads=" << h;
      visit[lightest] = 1;
    }
    // Taken groups come first in the order: none left out holds a larger share.
    for (int p = 0; p < n; ++p) {
      if (!visit[p] && lightest >= 0) {
        EXPECT_LE(share[p], share[lightest] * (1 + 1e-6)) << p;
      }
    }
  }
}

TEST(SelectTest, ListMassBudgetKeepsFewerGroupsThanEveryHeadsOwnBudget) {
  // Two heads, each with its mass on different groups: every head's own 0.9
  // needs its three groups; the list's 0.9 (the mean of the two heads' shares)
  // needs only as many as cover 0.9 of the mean.
  SelectPolicy policy;
  policy.first_n = policy.last_n = 0;
  const int n = 12, d = 1;
  std::vector<std::vector<float>> heads(2, std::vector<float>(n, -40.0f));
  for (int p : {2, 3, 4}) heads[0][p] = 0.0f;
  for (int p : {6, 7, 8}) heads[1][p] = 0.0f;
  const std::vector<uint8_t> forced = Forced(policy, n);  // the newest only
  std::vector<uint8_t> per_head = forced;
  for (const auto& scores : heads) MarkByMass(scores, forced, 0.9f, 1.0f, d, 0, 0, per_head);
  std::vector<uint8_t> list = forced;
  MarkByMassList(Spans(heads), forced, 0.9f, 1.0f, d, 0, 0, list);
  EXPECT_EQ(Count(per_head), 1 + 6);
  // Each of the six groups holds 1/6 of the mean: 0.9 needs all six but the last
  // one's 1/6 is needed: five hold 0.833. So six, and at 0.8 five.
  EXPECT_EQ(Count(list), 1 + 6);
  list = forced;
  MarkByMassList(Spans(heads), forced, 0.8f, 1.0f, d, 0, 0, list);
  EXPECT_EQ(Count(list), 1 + 5);
  std::vector<uint8_t> per_head_80 = forced;
  for (const auto& scores : heads) MarkByMass(scores, forced, 0.8f, 1.0f, d, 0, 0, per_head_80);
  EXPECT_EQ(Count(per_head_80), 1 + 6) << "each head needs its three groups for 0.8";
}

TEST(SelectTest, ListMassBudgetKeepsItsFloorAndCeilingAndSkipsEmptyHeads) {
  SelectPolicy policy;
  const int n = 50, d = 64;
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<std::vector<float>> heads(3, std::vector<float>(n, 0.0f));
  for (int p = 0; p < n; ++p) heads[1][p] = static_cast<float>(p % 7);
  heads[2].assign(n, ninf);  // an empty head: no mass, no effect
  heads[0][0] = heads[1][0] = 500;
  const std::vector<uint8_t> forced = Forced(policy, n);
  std::vector<uint8_t> visit = forced;
  MarkByMassList(Spans(heads), forced, 0.5f, 1.0f, d, /*min_pages=*/5, 0, visit);
  EXPECT_EQ(Count(visit), Count(forced) + 5) << "the floor, although the sink covers 0.5";
  heads[0][0] = heads[1][0] = 0;
  visit = forced;
  MarkByMassList(Spans(heads), forced, 1.0f, 1.0f, d, 0, /*max_pages=*/7, visit);
  EXPECT_EQ(Count(visit), Count(forced) + 7) << "the ceiling, although 1.0 wants every group";
  // The empty head changes nothing: the same marks without it.
  std::vector<uint8_t> without = forced;
  MarkByMassList(Spans({heads[0], heads[1]}), forced, 1.0f, 1.0f, d, 0, 7, without);
  EXPECT_EQ(visit, without);
  visit = forced;
  MarkByMassList({}, forced, 1.0f, 1.0f, d, 3, 0, visit);
  EXPECT_EQ(visit, forced) << "a list without heads keeps its forced groups only";
}

TEST(SelectTest, ListMassBudgetOfOneHeadIsTheHeadsBudget) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SelectPolicy policy;
  // Integer scores at d = 1: masses e^-k, whose shares stay distinct in float.
  for (int trial = 0; trial < 100; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 60);
    std::vector<float> scores(n);
    for (float& s : scores) s = -static_cast<float>(rng() % 40);
    const float target = 0.05f + 0.9f * static_cast<float>(rng() % 1000) / 1000.0f;
    const std::vector<uint8_t> forced = Forced(policy, n);
    std::vector<uint8_t> head = forced, list = forced;
    MarkByMass(scores, forced, target, 1.0f, 1, 1, 0, head);
    MarkByMassList(Spans({scores}), forced, target, 1.0f, 1, 1, 0, list);
    EXPECT_EQ(head, list) << "n=" << n << " target=" << target;
  }
}

TEST(SelectTest, FixedBudgetMarksExactlyTopPagesAcrossHeads) {
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  SelectPolicy policy;
  for (int n : {1, 3, 20, 257}) {
    const std::vector<uint8_t> forced = Forced(policy, n);
    std::vector<std::vector<float>> heads;
    for (int h = 0; h < 4; ++h) heads.push_back(testing::GaussianVector(rng, n));
    std::vector<std::span<const float>> views(heads.begin(), heads.end());
    std::vector<uint8_t> visit = forced;
    MarkFixedBudget(views, forced, 16, visit);
    EXPECT_EQ(Count(visit), std::min(n, Count(forced) + 16)) << "n=" << n;
  }
}

TEST(SelectTest, FixedBudgetGivesEveryHeadItsBestGroup) {
  SelectPolicy policy;
  policy.first_n = policy.last_n = 0;
  const std::vector<float> a = {9, 1, 1, 1, 1, 0};
  const std::vector<float> b = {1, 1, 1, 8, 7, 0};
  const std::vector<std::span<const float>> heads = {a, b};
  const std::vector<uint8_t> forced = Forced(policy, 6);
  std::vector<uint8_t> visit = forced;
  MarkFixedBudget(heads, forced, 2, visit);
  EXPECT_EQ(visit, (std::vector<uint8_t>{1, 0, 0, 1, 0, 1}));
}

TEST(SelectPolicyTest, ValidateRejectsEveryBadField) {
  ModelLayout model;
  model.num_layers = 2;
  model.num_q_heads = 4;
  model.num_kv_heads = 2;
  model.head_dim = 64;
  SelectPolicy ok;
  EXPECT_TRUE(ok.Validate(model).ok());
  SelectPolicy p = ok;
  p.alpha = 0.5f;
  EXPECT_EQ(p.Validate(model).message(), "alpha=0.5 must be finite and >= 1");
  p.alpha = 1e30f;  // the wire took any finite α, --eps-alpha only up to kMaxAlpha
  EXPECT_EQ(p.Validate(model).message(), "alpha=1e+30 exceeds 1e+06");
  p.alpha = kMaxAlpha;
  EXPECT_TRUE(p.Validate(model).ok());
  p = ok;
  p.retrieval_heads.assign(3, 1);  // wrong size, refused although heads = all
  EXPECT_EQ(p.Validate(model).message(), "retrieval_heads has 3 marks, want layers*q_heads=8");
  p = ok;
  p.top_pages = 0;
  EXPECT_FALSE(p.Validate(model).ok());
  p = ok;
  p.first_n = -1;
  EXPECT_FALSE(p.Validate(model).ok());
  p = ok;
  p.budget = Budget::kTopP;
  p.top_p = 1.5f;
  EXPECT_FALSE(p.Validate(model).ok());
  // Checked whatever the budget: a value kept for another budget is refused where it is set,
  // not at the step that switches to that budget.
  p.budget = Budget::kThreshold;
  EXPECT_EQ(p.Validate(model).message(), "top_p=1.5 not in (0, 1]");
  p = ok;
  p.mass_target = 2.0f;
  EXPECT_EQ(p.Validate(model).message(), "mass_target=2 not in (0, 1]");
  // A refused float is named as sent, not rounded to 6 digits into the range it missed.
  p = ok;
  p.top_p = std::nextafter(1.0f, 2.0f);
  EXPECT_EQ(p.Validate(model).message(), "top_p=1.0000001 not in (0, 1]");
  p = ok;
  p.alpha = std::nextafter(1.0f, 0.0f);
  EXPECT_EQ(p.Validate(model).message(), "alpha=0.99999994 must be finite and >= 1");
  p = ok;
  p.coarse_candidates = std::nextafter(1024.0f, 2000.0f);
  EXPECT_EQ(p.Validate(model).message(), "coarse_candidates=1024.0001 not in [1, 1024]");
  p = ok;
  p.budget = Budget::kMass;
  EXPECT_TRUE(p.Validate(model).ok());
  p.mass_target = 0.0f;
  EXPECT_EQ(p.Validate(model).message(), "mass_target=0 not in (0, 1]");
  p = ok;
  p.budget = Budget::kMass;
  p.mass_temperature = -1.0f;
  EXPECT_EQ(p.Validate(model).message(), "mass_temperature=-1 not in (0, 1000]");
  p = ok;
  p.budget = Budget::kMass;
  p.min_pages = 9;
  p.max_pages = 4;
  EXPECT_EQ(p.Validate(model).message(), "min_pages=9 exceeds max_pages=4");
  p.min_pages = -1;
  EXPECT_EQ(p.Validate(model).message(), "min_pages=-1, max_pages=4 must be >= 0");
  p = ok;
  p.heads = HeadMode::kRetrieval;
  p.retrieval_heads.assign(7, 1);
  EXPECT_EQ(p.Validate(model).message(), "retrieval_heads has 7 marks, want layers*q_heads=8");
  p = ok;
  p.strict = true;
  p.budget = Budget::kFixed;
  EXPECT_FALSE(p.Validate(model).ok());
}

TEST(SelectPolicyTest, ABoundWhoseRecordPartIsMissingIsRefusedNotScoredAsFro) {
  ModelLayout model;
  model.num_layers = 1;
  model.num_q_heads = 2;
  model.num_kv_heads = 1;
  model.head_dim = 32;
  SelectPolicy defaults;  // the default method reads the quest part
  ASSERT_EQ(defaults.method, Method::kQuestClt);
  EXPECT_TRUE(defaults.Validate(model).ok());  // features.quest is on by default
  SelectPolicy quest;
  quest.method = Method::kQuest;
  model.features.quest = false;
  EXPECT_THAT(quest.Validate(model).message(), ::testing::HasSubstr("method=quest needs"));
  SelectPolicy questclt;
  questclt.method = Method::kQuestClt;
  EXPECT_THAT(questclt.Validate(model).message(), ::testing::HasSubstr("method=questclt needs"));
  // quest8 serves questclt, not the quest bound, which reads the 16-bit part.
  model.features.quest8 = true;
  EXPECT_TRUE(questclt.Validate(model).ok());
  EXPECT_THAT(quest.Validate(model).message(), ::testing::HasSubstr("quest8 serves questclt only"));
  model.features.quest8 = false;
  SelectPolicy onepc;
  onepc.method = Method::kOnePc;
  EXPECT_THAT(onepc.Validate(model).message(), ::testing::HasSubstr("method=1pc needs"));
  model.features.principal = true;
  EXPECT_TRUE(onepc.Validate(model).ok());
  SelectPolicy jl;
  jl.method = Method::kJl;
  EXPECT_TRUE(jl.Validate(model).ok());
  // Strict mode scores with its bracket, not the method: no part of the method is needed.
  model.features.principal = false;
  SelectPolicy strict_quest;
  strict_quest.strict = true;
  EXPECT_TRUE(strict_quest.Validate(model).ok());
  SelectPolicy strict_onepc = onepc;
  strict_onepc.strict = true;
  EXPECT_TRUE(strict_onepc.Validate(model).ok());
}

}  // namespace
}  // namespace eps
