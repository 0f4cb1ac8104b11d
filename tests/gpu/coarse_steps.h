// The coarse level's test inputs (tests/gpu/coarse_step_gpu_test.cc and
// tests/gpu/feedback_gpu_test.cc): fine and coarse records of kBatch random
// sequences, and the comparison of the device's lists with core/'s.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <vector>

#include "core/bounds.h"
#include "core/phi.h"
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

  // The candidate coarse groups of (row i, layer, list) that the coarse scores
  // put beyond doubt: flags[c] = 2 for a candidate, 1 for a coarse group below
  // every scored head's cut by more than a float rounding of the device's sums,
  // 0 for a group within rounding of a cut (as core/step.cc and tests/core's
  // coarse_step_test.cc compute them).
  std::vector<uint8_t> Candidates(const SelectPolicy& policy, size_t i, int layer, int list) {
    const ModelLayout& m = model;
    const SummaryLayout layout = SummaryLayout::For(m);
    const int64_t n = GroupsFor(rows[i].context_tokens, m);
    const int64_t nc = CoarseGroupsFor(rows[i].context_tokens, m);
    std::vector<uint8_t> forced(n, 0), coarse_forced(nc, 0), out(nc, 1);
    MarkForced(policy, forced);
    MarkCoarseForced(forced, m.coarse_ratio(), coarse_forced);
    const int want = policy.CoarseCandidates(m);
    QueryTerms terms;
    for (int h = 0; h < m.num_q_heads; ++h) {
      const int kvh = m.kv_head_of(h);
      if ((lists(policy) > 1 && kvh != list) || !policy.HeadIsScored(m, layer, h)) continue;
      const auto q = fine->Query(layer, static_cast<int64_t>(i), h);
      terms.Prepare(*phi, layer, kvh, std::vector<float>(q.begin(), q.end()));
      std::vector<float> scores(nc), unforced;
      for (int64_t c = 0; c < nc; ++c) {
        scores[c] =
            Score(policy.method, coarse->Record(coarse->SlotOf(rows[i].table_row, c), layer, kvh),
                  layout, terms);
        if (!coarse_forced[c]) unforced.push_back(scores[c]);
      }
      float cut = -INFINITY;
      if (static_cast<int64_t>(unforced.size()) > want) {
        std::nth_element(unforced.begin(), unforced.begin() + (want - 1), unforced.end(),
                         std::greater<float>());
        cut = unforced[want - 1];
      }
      if (cut == -INFINITY) {  // at most `want` unforced coarse groups: all are candidates
        std::fill(out.begin(), out.end(), uint8_t{2});
        continue;
      }
      const float margin = 1e-3f * (std::fabs(cut) + 1.0f);
      for (int64_t c = 0; c < nc; ++c) {
        if (coarse_forced[c] || scores[c] >= cut + margin) {
          out[c] = 2;
        } else if (out[c] == 1 && scores[c] > cut - margin) {
          out[c] = 0;  // within rounding of this head's cut
        }
      }
    }
    for (int64_t c = 0; c < nc; ++c) out[c] = coarse_forced[c] ? 2 : out[c];
    return out;
  }

  ModelLayout model;
  std::unique_ptr<PhiBank> phi;
  std::unique_ptr<StepBuffers> fine, coarse;
  std::vector<StepRow> rows;
};

// The lists of `got` against core/'s in `steps.fine` (the last reference step):
// equal, except where a score sits within float rounding of a cut (the device sums
// in another order). A fine cut moves at most one group of a list (two for the fixed
// budget, whose list lengths are exact); a coarse cut (one coarse candidate in for
// another) moves groups of at most two coarse groups. Returns the lists that differ,
// so that a caller can bound how many ties a step may hold.
inline int CompareWithReference(CoarseSteps& steps, const DeviceStep& got,
                                const SelectPolicy& policy) {
  const int lists = steps.lists(policy);
  const int fine_allowed = policy.budget == Budget::kFixed ? 2 : 1;
  const int ratio = policy.UsesCoarseLevel(steps.model)
                        ? steps.model.coarse_blocks / steps.model.group_blocks
                        : 0;  // groups per coarse group; 0 without the level
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
          if (ratio > 0) coarse_groups.insert(static_cast<int64_t>(p) / ratio);
        }
        if (differing <= fine_allowed) continue;
        EXPECT_TRUE(ratio > 0 && coarse_groups.size() <= 2)
            << "layer " << layer << " row " << b << " list " << list << ": " << differing
            << " groups differ in " << coarse_groups.size() << " coarse groups";
      }
    }
  }
  return near_cut;
}

}  // namespace eps::testing
