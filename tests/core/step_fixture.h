// Builds whole sequences (keys, summaries, queries) into StepBuffers for tests.
#pragma once

#include <random>
#include <unordered_map>
#include <vector>

#include "core/summary.h"
#include "core/testing/synthetic.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"

namespace eps::testing {

// Keys of one sequence per (layer, kv_head): keys[layer * kv_heads + kvh] is [tokens, d].
struct SequenceKeys {
  std::vector<std::vector<float>> keys;
  const std::vector<float>& Of(const ModelLayout& m, int layer, int kvh) const {
    return keys[layer * m.num_kv_heads + kvh];
  }
};

// Key shapes mixed into a sequence, group by group, on top of synthetic keys.
enum class GroupShapes { kSynthetic, kMixedRank };

// Writes a sequence of `tokens` tokens at table row `row` (summaries of every
// group, sealed when full) and its queries at batch position `pos`.
inline SequenceKeys WriteSequence(StepBuffers& buffers, const SummaryWriter& writer, int32_t row,
                                  int64_t pos, int64_t tokens, int num_needles, GroupShapes shapes,
                                  std::mt19937_64& rng) {
  const ModelLayout& m = buffers.model();
  const int d = m.head_dim;
  buffers.AssignRow(row, tokens, rng());
  SequenceKeys seq;
  for (int layer = 0; layer < m.num_layers; ++layer) {
    for (int kvh = 0; kvh < m.num_kv_heads; ++kvh) {
      SyntheticConfig config;
      config.head_dim = d;
      config.tokens = tokens;
      config.num_queries = m.gqa_ratio();
      config.num_needles = num_needles;
      config.num_spans = static_cast<int>(rng() % 3);
      config.max_span_tokens = 64;
      config.num_sinks = static_cast<int>(rng() % 3);
      config.seed = rng();
      SyntheticHead head = MakeSyntheticHead(config);
      const int64_t gt = m.group_tokens();
      if (shapes == GroupShapes::kMixedRank) {
        for (int64_t begin = 0; begin < tokens; begin += gt) {
          const int64_t end = std::min(tokens, begin + gt);
          const int kind = static_cast<int>(rng() % 3);
          if (kind == 0) continue;
          const std::vector<float> dir = GaussianVector(rng, d, kind == 1 ? 3.0f : 1.0f);
          for (int64_t t = begin; t < end; ++t) {
            const float c = static_cast<float>(static_cast<int64_t>(rng() % 7) - 3);
            for (int i = 0; i < d; ++i) {
              float& k = head.keys[t * d + i];
              k = kind == 1 ? 0.05f * k + c * dir[i] : 3.0f * k;  // low rank | high rank
            }
          }
        }
      }
      for (int64_t p = 0, begin = 0; begin < tokens; ++p, begin += gt) {
        const int64_t count = std::min(gt, tokens - begin);
        const KeyRows rows{head.keys.data() + begin * d, DType::kFloat32, count, d};
        const std::span<float> record = buffers.Record(buffers.SlotOf(row, p), layer, kvh);
        EXPECT_TRUE(writer.Reset(record).ok());
        EXPECT_TRUE(writer.Append(record, layer, kvh, rows).ok());
        if (count == gt) {
          EXPECT_TRUE(writer.Seal(record, layer, kvh, rows).ok());
        }
      }
      for (int r = 0; r < m.gqa_ratio(); ++r) {
        const auto q = buffers.Query(layer, pos, kvh * m.gqa_ratio() + r);
        std::copy_n(head.queries.begin() + r * d, d, q.begin());
      }
      seq.keys.push_back(std::move(head.keys));
    }
  }
  return seq;
}

// Logical groups of a visit list (physical blocks mapped back through the row).
inline std::vector<uint8_t> VisitedGroups(const StepBuffers& buffers, int32_t row,
                                          std::span<const int32_t> visit, int64_t groups) {
  std::unordered_map<int32_t, int64_t> logical;
  const auto block_row = buffers.BlockRow(row);
  for (int64_t b = 0; b < buffers.max_blocks(); ++b) logical[block_row[b]] = b;
  std::vector<uint8_t> visited(groups, 0);
  for (int32_t block : visit) visited[logical.at(block) / buffers.model().group_blocks] = 1;
  return visited;
}

// Groups of two visit sets (VisitedGroups) that only one of them holds. A GPU
// list may differ from core/'s by groups within fp32 rounding of the cut: at
// most one on each side (the boundary moved by one group, or two near-equal
// groups traded places), which NearCut checks.
struct GroupDifference {
  int only_want = 0, only_got = 0;
  int total() const { return only_want + only_got; }
  bool NearCut() const { return only_want <= 1 && only_got <= 1; }
};
inline GroupDifference DifferingGroups(const std::vector<uint8_t>& want,
                                       const std::vector<uint8_t>& got) {
  GroupDifference d;
  for (size_t p = 0; p < want.size() && p < got.size(); ++p) {
    d.only_want += want[p] && !got[p];
    d.only_got += got[p] && !want[p];
  }
  return d;
}

}  // namespace eps::testing
