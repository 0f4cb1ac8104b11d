// The coarse level's test inputs (tests/gpu/coarse_step_gpu_test.cc and
// tests/gpu/feedback_gpu_test.cc): fine and coarse records of kBatch random
// sequences, and the comparison of the device's lists with core/'s.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "core/bounds.h"
#include "core/phi.h"
#include "core/select.h"
#include "core/summary.h"
#include "core/testing/synthetic.h"
#include "gtest/gtest.h"
#include "tests/core/step_fixture.h"
#include "tests/gpu/device_step.h"

namespace eps::testing {

inline constexpr int kBatch = 3;
inline constexpr int64_t kMaxContext = 9000;

inline ModelLayout CoarseModel(int group_blocks, int coarse_blocks, uint64_t phi_seed) {
  ModelLayout m;
  m.num_layers = 2;
  m.num_q_heads = 8;
  m.num_kv_heads = 2;
  m.head_dim = 128;  // questclt's octet path (and its general path by option)
  m.group_blocks = group_blocks;
  m.coarse_blocks = coarse_blocks;
  m.phi_seed = phi_seed;
  m.features = {.key_sum = true, .principal = true, .quest = true, .quest8 = true};
  return m;
}

// kBatch sequences (table row = batch position) of random lengths: fine records
// in `fine`, and coarse records written from the same keys into `coarse`, a
// StepBuffers of the model whose groups are the coarse groups (its pool and
// group table are the coarse pool and table; a row's coarse slots in reverse
// order, so that a slot is never its group's index).
struct CoarseSteps {
  CoarseSteps(int group_blocks, int coarse_blocks, Granularity granularity, std::mt19937_64& rng)
      : model(CoarseModel(group_blocks, coarse_blocks, rng())) {
    phi = std::make_unique<PhiBank>(*PhiBank::Create(
        model.phi_seed, model.num_layers, model.num_kv_heads, model.head_dim, model.sketch_dim));
    SummaryWriter writer(model, *phi);
    ModelLayout coarse_model = model;
    coarse_model.group_blocks = coarse_blocks;
    coarse_model.coarse_blocks = 0;
    fine = std::make_unique<StepBuffers>(model, kBatch, kMaxContext, kBatch, granularity);
    coarse = std::make_unique<StepBuffers>(coarse_model, kBatch, kMaxContext, kBatch, granularity);
    const int64_t ct = int64_t{coarse_blocks} * model.block_size;
    for (int32_t r = 0; r < kBatch; ++r) {
      const int64_t tokens = 1500 + static_cast<int64_t>(rng() % (kMaxContext - 1500));
      const SequenceKeys seq =
          WriteSequence(*fine, writer, r, r, tokens, 6, GroupShapes::kMixedRank, rng);
      rows.push_back({.table_row = r, .context_tokens = tokens, .seq_id = 0});
      const int64_t nc = CoarseGroupsFor(tokens, model);
      coarse->AssignRow(r, tokens, rng());
      for (int64_t c = 0; c < nc; ++c) {
        coarse->group_table()[r * coarse->max_groups() + c] =
            static_cast<int32_t>(r * coarse->max_groups() + nc - 1 - c);
      }
      for (int layer = 0; layer < model.num_layers; ++layer) {
        for (int kvh = 0; kvh < model.num_kv_heads; ++kvh) {
          const std::vector<float>& keys = seq.Of(model, layer, kvh);
          for (int64_t c = 0; c < nc; ++c) {
            const int64_t begin = c * ct, count = std::min(ct, tokens - begin);
            const KeyRows key_rows{keys.data() + begin * model.head_dim, DType::kFloat32, count,
                                   model.head_dim};
            const std::span<float> record = coarse->Record(coarse->SlotOf(r, c), layer, kvh);
            EXPECT_TRUE(writer.Reset(record).ok());
            EXPECT_TRUE(writer.Append(record, layer, kvh, key_rows).ok());
            if (count == ct) {
              EXPECT_TRUE(writer.Seal(record, layer, kvh, key_rows).ok());
            }
          }
        }
      }
    }
  }

  StepInputs Inputs() const {
    StepInputs in = fine->Inputs(rows);
    in.coarse_pool = coarse->pool().data();
    in.coarse_slots = coarse->num_slots();
    in.coarse_table = coarse->group_table().data();
    in.max_coarse_groups = coarse->max_groups();
    return in;
  }
  CoarseHost Host() const {
    return {&coarse->pool(), coarse->num_slots(), &coarse->group_table(), coarse->max_groups()};
  }
  int lists(const SelectPolicy& policy) const {
    return policy.granularity == Granularity::kPerKvHead ? model.num_kv_heads : 1;
  }

  // The heads of `list` that the policy scores in `layer` (core/step.cc's order).
  std::vector<int> ListHeads(const SelectPolicy& policy, int layer, int list) const {
    std::vector<int> heads;
    for (int h = 0; h < model.num_q_heads; ++h) {
      if ((lists(policy) > 1 && model.kv_head_of(h) != list) ||
          !policy.HeadIsScored(model, layer, h)) {
        continue;
      }
      heads.push_back(h);
    }
    return heads;
  }

  // Head h's scores of row i's groups in `layer`, over the coarse records
  // (`coarse_level`) or over the fine records of the groups `allowed` marks (−∞
  // for the others, unread; every group when `allowed` is null).
  std::vector<float> HeadScores(const SelectPolicy& policy, size_t i, int layer, int h,
                                bool coarse_level,
                                const std::vector<uint8_t>* allowed = nullptr) const {
    const SummaryLayout layout = SummaryLayout::For(model);
    const int kvh = model.kv_head_of(h);
    StepBuffers& level = coarse_level ? *coarse : *fine;  // read only
    const int64_t count = coarse_level ? CoarseGroupsFor(rows[i].context_tokens, model)
                                       : GroupsFor(rows[i].context_tokens, model);
    QueryTerms terms;
    const auto q = fine->Query(layer, static_cast<int64_t>(i), h);
    terms.Prepare(*phi, layer, kvh, std::vector<float>(q.begin(), q.end()));
    std::vector<float> scores(count, -INFINITY);
    for (int64_t p = 0; p < count; ++p) {
      if (allowed != nullptr && !(*allowed)[p]) continue;
      scores[p] = Score(policy.method, level.Record(level.SlotOf(rows[i].table_row, p), layer, kvh),
                        layout, terms);
    }
    return scores;
  }

  // The candidate coarse groups of (row i, layer, list) that the coarse scores
  // put beyond doubt: flags[c] = 2 for a candidate, 1 for a coarse group below
  // every scored head's cut by more than a float rounding of the device's sums,
  // 0 for a group that the rounding can move across a head's cut. A head's cut is
  // core/step.cc's, its k-th unforced coarse score (k = CoarseCandidates); a group
  // above it is a candidate beyond doubt when it also beats the (k+1)-th score by
  // more than the rounding (the device ranks it among the k best too), so only
  // groups around a near-tie at a cut get 0.
  std::vector<uint8_t> Candidates(const SelectPolicy& policy, size_t i, int layer, int list) {
    const ModelLayout& m = model;
    const int64_t n = GroupsFor(rows[i].context_tokens, m);
    const int64_t nc = CoarseGroupsFor(rows[i].context_tokens, m);
    std::vector<uint8_t> forced(n, 0), coarse_forced(nc, 0), out(nc, 1);
    MarkForced(policy, forced);
    MarkCoarseForced(forced, m.coarse_ratio(), coarse_forced);
    const int want = policy.CoarseCandidates(m);
    for (int h : ListHeads(policy, layer, list)) {
      const std::vector<float> scores = HeadScores(policy, i, layer, h, /*coarse_level=*/true);
      std::vector<float> unforced;
      for (int64_t c = 0; c < nc; ++c) {
        if (!coarse_forced[c]) unforced.push_back(scores[c]);
      }
      if (static_cast<int64_t>(unforced.size()) <= want) {  // all are candidates
        std::fill(out.begin(), out.end(), uint8_t{2});
        continue;
      }
      // The k-th and (k+1)-th largest unforced scores.
      std::partial_sort(unforced.begin(), unforced.begin() + want + 1, unforced.end(),
                        std::greater<float>());
      const float cut = unforced[want - 1], next = unforced[want];
      const float margin = 1e-3f * (std::fabs(cut) + 1.0f);
      for (int64_t c = 0; c < nc; ++c) {
        if (coarse_forced[c] || scores[c] >= next + margin) {
          out[c] = 2;
        } else if (out[c] == 1 && scores[c] > cut - margin) {
          out[c] = 0;  // the rounding can move it across this head's cut
        }
      }
    }
    for (int64_t c = 0; c < nc; ++c) out[c] = coarse_forced[c] ? 2 : out[c];
    return out;
  }

  // The candidate coarse groups core/ takes for (row i, layer, list): 1 for a candidate.
  std::vector<uint8_t> CoreCandidates(const SelectPolicy& policy, size_t i, int layer,
                                      int list) const {
    const int64_t n = GroupsFor(rows[i].context_tokens, model);
    const int64_t nc = CoarseGroupsFor(rows[i].context_tokens, model);
    std::vector<uint8_t> forced(n, 0), coarse_forced(nc, 0);
    MarkForced(policy, forced);
    MarkCoarseForced(forced, model.coarse_ratio(), coarse_forced);
    std::vector<uint8_t> out = coarse_forced;
    for (int h : ListHeads(policy, layer, list)) {
      MarkByThreshold(HeadScores(policy, i, layer, h, /*coarse_level=*/true), coarse_forced,
                      policy.CoarseCandidates(model), 1.0f, out);
    }
    return out;
  }

  // The groups of (row i, layer, list) that core/step.cc's fine selection visits
  // when the candidate coarse groups are `candidates` (1: a candidate): its rules
  // replayed for one list, so that a coarse cut resolved the other way (a near-tie
  // the device's rounding breaks differently) can be followed through the fine
  // level. `feedback`: StepInputs::feedback as core/ read it (before the step
  // consumed it), or null.
  std::vector<uint8_t> SelectWithCandidates(const SelectPolicy& policy, size_t i, int layer,
                                            int list, const std::vector<uint8_t>& candidates,
                                            const float* feedback = nullptr) const {
    const ModelLayout& m = model;
    const int64_t n = GroupsFor(rows[i].context_tokens, m);
    const int ratio = m.coarse_ratio();
    std::vector<uint8_t> forced(n, 0), allowed(n, 0), fed(n, 0);
    MarkForced(policy, forced);
    for (int64_t p = 0; p < n; ++p) allowed[p] = candidates[p / ratio];
    std::vector<uint8_t> visit = forced;
    std::vector<std::vector<float>> listed;
    const StepInputs in = fine->Inputs(rows);
    for (int h : ListHeads(policy, layer, list)) {
      std::vector<float> scores = HeadScores(policy, i, layer, h, /*coarse_level=*/false, &allowed);
      if (feedback != nullptr) {
        const float* entry =
            feedback + ((int64_t{layer} * in.max_seqs + rows[i].table_row) * m.num_q_heads + h) *
                           in.max_groups;
        ApplyFeedback({entry, static_cast<size_t>(n)}, m.head_dim, scores);
        for (int64_t p = 0; p < n; ++p) fed[p] |= IsFeedback(entry[p]);
      }
      const MassSetting mass = policy.MassFor(layer);
      switch (policy.budget) {
        case Budget::kThreshold:
          MarkByThreshold(scores, forced, policy.top_pages, policy.alpha, visit);
          break;
        case Budget::kTopP:
          MarkTopP(scores, forced, policy.top_p, m.head_dim, visit);
          break;
        case Budget::kMass:
          if (policy.mass_scope == MassScope::kHead) {
            MarkByMass(scores, forced, mass.target, mass.temperature, m.head_dim, mass.min_pages,
                       mass.max_pages, visit);
            break;
          }
          [[fallthrough]];
        case Budget::kFixed:
          listed.push_back(std::move(scores));
          break;
      }
    }
    if (!listed.empty()) {
      const std::vector<std::span<const float>> spans(listed.begin(), listed.end());
      if (policy.budget == Budget::kFixed) {
        MarkFixedBudget(spans, forced, policy.top_pages, visit);
      } else {
        const MassSetting mass = policy.MassFor(layer);
        MarkByMassList(spans, forced, mass.target, mass.temperature, m.head_dim, mass.min_pages,
                       mass.max_pages, visit);
      }
    }
    for (int64_t p = 0; p < n; ++p) visit[p] &= allowed[p] | fed[p];
    return visit;
  }

  // The summary bytes a step with the coarse level may read (StepStats::
  // summary_bytes_read, core/step.cc's count): per list, each KV head with a scored
  // head reads every coarse record and the fine records of the list's candidates.
  // A coarse group within rounding of a coarse cut (Candidates' 0) may be a
  // candidate on the device and not in core/, or the other way, so the count lies
  // between that of the candidates beyond doubt alone (`low`) and that of them with
  // every such group (`high`); the two are equal when no coarse score is near a cut.
  struct ByteRange {
    int64_t low = 0, high = 0;
  };
  ByteRange SummaryBytesRange(const SelectPolicy& policy) {
    const int ratio = model.coarse_ratio();
    ByteRange records;
    for (int layer = 0; layer < model.num_layers; ++layer) {
      for (size_t i = 0; i < rows.size(); ++i) {
        const int64_t n = GroupsFor(rows[i].context_tokens, model);
        const int64_t nc = CoarseGroupsFor(rows[i].context_tokens, model);
        for (int list = 0; list < lists(policy); ++list) {
          std::set<int> kv_heads;
          for (int h : ListHeads(policy, layer, list)) kv_heads.insert(model.kv_head_of(h));
          if (kv_heads.empty()) continue;
          const std::vector<uint8_t> flags = Candidates(policy, i, layer, list);
          int64_t sure = 0, near = 0;
          for (int64_t c = 0; c < nc; ++c) {
            const int64_t groups = std::min<int64_t>(n, (c + 1) * ratio) - c * ratio;
            sure += flags[c] == 2 ? groups : 0;
            near += flags[c] == 0 ? groups : 0;
          }
          const int64_t k = static_cast<int64_t>(kv_heads.size());
          records.low += k * (nc + sure);
          records.high += k * (nc + sure + near);
        }
      }
    }
    const int64_t bytes = SummaryLayout::For(model).record_bytes();
    return {records.low * bytes, records.high * bytes};
  }

  ModelLayout model;
  std::unique_ptr<PhiBank> phi;
  std::unique_ptr<StepBuffers> fine, coarse;
  std::vector<StepRow> rows;
};

// [layers, max_seqs, q_heads, max_groups], NaN but where the attention "visited":
// three heads in four have entries, each for about a third of the row's groups
// (inside the candidates or not), on the scale of the scores; a few finite entries
// lie past the row's groups, where no step may touch them.
inline std::vector<float> RandomFeedback(const CoarseSteps& steps, std::mt19937_64& rng) {
  const ModelLayout& m = steps.model;
  const int64_t max_groups = steps.fine->max_groups();
  std::vector<float> feedback(int64_t{m.num_layers} * kBatch * m.num_q_heads * max_groups,
                              std::numeric_limits<float>::quiet_NaN());
  std::normal_distribution<float> entry(0.0f, 2.0f);
  for (int layer = 0; layer < m.num_layers; ++layer) {
    for (const StepRow& row : steps.rows) {
      const int64_t n = GroupsFor(row.context_tokens, m);
      for (int h = 0; h < m.num_q_heads; ++h) {
        float* head = feedback.data() +
                      ((int64_t{layer} * kBatch + row.table_row) * m.num_q_heads + h) * max_groups;
        if (rng() % 4 == 0) continue;
        for (int64_t p = 0; p < n; ++p) {
          if (rng() % 3 == 0) head[p] = entry(rng);
        }
        if (n < max_groups) head[n] = 1.0f;  // past the row: never consumed
      }
    }
  }
  return feedback;
}

// What the reference step of CompareWithReference read besides `steps`.
struct ReferenceInputs {
  bool coarse_level = true;         // it ran with the coarse level (when the policy uses it)
  const float* feedback = nullptr;  // StepInputs::feedback as it read it (unconsumed), or null
};

// At most this many coarse groups within rounding of a coarse cut are tried
// (every subset of them in or out: 2^k replays of one list).
inline constexpr int kMaxCoarseTies = 12;

// Whether core/'s rules give the device's groups `got` of (row b, layer, list) up
// to `fine_allowed` groups (rounding at a fine cut) for some resolution of the
// coarse near-ties: the coarse groups within rounding of a head's coarse cut
// (Candidates' 0) each in or out of the candidates, the others as core/ takes them.
// A coarse group that comes in (or goes) changes every head's fine scores, so its
// groups can displace (or be displaced by) any head's last groups, in any coarse
// group: no fixed count of groups or coarse groups bounds that, a replay does.
// Returns "" when some resolution explains `got`, else why none does.
inline std::string ExplainByCoarseTies(CoarseSteps& steps, const SelectPolicy& policy, int layer,
                                       int b, int list, const std::vector<uint8_t>& want,
                                       const std::vector<uint8_t>& got, int fine_allowed,
                                       const float* feedback) {
  // The replay must give core/'s own list from core/'s own candidates.
  if (steps.SelectWithCandidates(policy, b, layer, list,
                                 steps.CoreCandidates(policy, b, layer, list), feedback) != want) {
    return "core/'s selection replayed with its own candidates differs from its list";
  }
  const std::vector<uint8_t> flags = steps.Candidates(policy, b, layer, list);
  std::vector<int64_t> ties;
  for (size_t c = 0; c < flags.size(); ++c) {
    if (flags[c] == 0) ties.push_back(static_cast<int64_t>(c));
  }
  if (ties.size() > static_cast<size_t>(kMaxCoarseTies)) {
    return std::to_string(ties.size()) + " coarse groups within rounding of a coarse cut, " +
           "more than the " + std::to_string(kMaxCoarseTies) + " tried";
  }
  int closest = std::numeric_limits<int>::max();
  for (uint32_t in = 0; in < (1u << ties.size()); ++in) {
    std::vector<uint8_t> candidates(flags.size());
    for (size_t c = 0; c < flags.size(); ++c) candidates[c] = flags[c] == 2;
    for (size_t k = 0; k < ties.size(); ++k) candidates[ties[k]] = (in >> k) & 1u;
    const std::vector<uint8_t> replay =
        steps.SelectWithCandidates(policy, b, layer, list, candidates, feedback);
    int differing = 0;
    for (size_t p = 0; p < replay.size(); ++p) differing += replay[p] != got[p];
    if (differing <= fine_allowed) return "";
    closest = std::min(closest, differing);
  }
  return "no resolution of the " + std::to_string(ties.size()) +
         " coarse groups within rounding of a coarse cut explains them (closest: " +
         std::to_string(closest) + " groups differ)";
}

// The lists of `got` against core/'s in `steps.fine` (the last reference step):
// equal, except where a score sits within float rounding of a cut (the device sums
// in another order). A fine cut moves at most one group of a list (two for the fixed
// budget, whose list lengths are exact). A coarse cut can bring a coarse group in or
// leave one out of the candidates, which moves every head's fine cut: more groups
// may then differ, in any coarse group, but core/'s rules replayed with that coarse
// tie resolved the device's way (ExplainByCoarseTies) must give the device's list up
// to the fine cut's groups. Returns the lists that differ, so that a caller can bound
// how many ties a step may hold.
inline int CompareWithReference(CoarseSteps& steps, const DeviceStep& got,
                                const SelectPolicy& policy, const ReferenceInputs& reference = {}) {
  const int lists = steps.lists(policy);
  const int fine_allowed = policy.budget == Budget::kFixed ? 2 : 1;
  const bool coarse_level = reference.coarse_level && policy.UsesCoarseLevel(steps.model);
  int near_cut = 0;
  for (int layer = 0; layer < steps.model.num_layers; ++layer) {
    for (int b = 0; b < kBatch; ++b) {
      for (int list = 0; list < lists; ++list) {
        const auto want = steps.fine->VisitBlocks(layer, b, list);
        const std::vector<int32_t> blocks =
            got.List(kBatch, lists, steps.fine->max_blocks(), layer, b, list);
        if (policy.budget == Budget::kFixed) {
          EXPECT_EQ(blocks.size(), want.size()) << "layer " << layer << " row " << b;
        }
        if (std::vector<int32_t>(want.begin(), want.end()) == blocks) continue;
        ++near_cut;
        const int64_t n = GroupsFor(steps.rows[b].context_tokens, steps.model);
        const auto a = VisitedGroups(*steps.fine, b, want, n);
        const auto g = VisitedGroups(*steps.fine, b, blocks, n);
        int differing = 0;
        std::set<int64_t> coarse_groups;
        for (size_t p = 0; p < a.size(); ++p) {
          if (a[p] == g[p]) continue;
          ++differing;
          if (coarse_level)
            coarse_groups.insert(static_cast<int64_t>(p) / steps.model.coarse_ratio());
        }
        if (differing <= fine_allowed) continue;
        const std::string why = coarse_level
                                    ? ExplainByCoarseTies(steps, policy, layer, b, list, a, g,
                                                          fine_allowed, reference.feedback)
                                    : "more than a fine cut's rounding moves";
        EXPECT_TRUE(why.empty()) << "layer " << layer << " row " << b << " list " << list << ": "
                                 << differing << " groups differ in " << coarse_groups.size()
                                 << " coarse groups: " << why;
      }
    }
  }
  return near_cut;
}

}  // namespace eps::testing
