// Synthetic long-context workloads for tests, the demo and benchmarks.
//
// Keys of one (layer, KV head) follow a structure seen in real decoders: RoPE
// applied by position, a few outlier channels, a slowly drifting mean,
// attention sinks at the start and "needles" (keys aligned with the query) at
// random depths. Everything is a function of the seed.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "core/layout.h"
#include "core/step.h"

namespace eps::testing {

// The small GQA model both demos use: 2 layers, 8 query heads, 2 KV heads,
// d = 128, 16-token blocks, g = 8, m = 8, every optional summary part on.
ModelLayout DemoModel();

struct SyntheticConfig {
  int head_dim = 128;
  int64_t tokens = 4096;
  int num_queries = 1;          // query heads sharing this KV head (GQA)
  int num_needles = 4;          // single tokens aligned with the query
  float needle_logit = 12.0f;   // q·k/sqrt(d) of a needle above the typical key
  int num_spans = 8;            // relevant passages: runs of tokens aligned with the query
  int max_span_tokens = 256;    // span lengths are uniform in [16, max_span_tokens]
  float max_span_logit = 7.0f;  // each span's logit is uniform in [2, max_span_logit]
  int num_sinks = 4;            // leading tokens every query attends to
  float sink_logit = 8.0f;
  float outlier_fraction = 0.03f;  // channels with 4x scale
  float drift = 0.5f;              // amplitude of the slow mean drift
  float query_spread = 0.5f;       // how far GQA heads of one KV head differ
  float rope_base = 10000.0f;
  uint64_t seed = 1;
};

struct SyntheticHead {
  std::vector<float> keys;       // [tokens, d], RoPE applied
  std::vector<float> queries;    // [num_queries, d], RoPE applied at position `tokens`
  std::vector<int64_t> needles;  // positions of the needles
  std::vector<std::pair<int64_t, int64_t>> spans;  // [begin, end) of the relevant spans
};

// Rotates pairs (i, i + d/2) of `v` by pos·base^(-2i/d) (the Llama/NeoX layout).
void ApplyRope(std::span<float> v, int64_t pos, float base);

SyntheticHead MakeSyntheticHead(const SyntheticConfig& config);

// Softmax attention mass per group of `group_tokens` tokens for one query.
std::vector<double> GroupAttentionMass(std::span<const float> keys, std::span<const float> query,
                                       int head_dim, int group_tokens);

// max_i q·k_i per group (the quantity strict mode ranks by), in double.
std::vector<double> GroupMaxScore(std::span<const float> keys, std::span<const float> query,
                                  int head_dim, int group_tokens);

// Owns every buffer of a step (core/step.h layout) for tests and benchmarks.
// Sequences get contiguous slots and a shuffled block table.
class StepBuffers {
 public:
  StepBuffers(const ModelLayout& model, int64_t max_seqs, int64_t max_context, int64_t max_batch,
              Granularity granularity);

  // Gives table row `row` a context of `tokens`: slots [row*max_groups, ...)
  // and physical blocks a seeded permutation.
  void AssignRow(int32_t row, int64_t tokens, uint64_t seed);
  // The record of (slot, layer, kv_head).
  std::span<float> Record(int64_t slot, int layer, int kv_head);
  int32_t SlotOf(int32_t row, int64_t group) const {
    return group_table_[row * max_groups_ + group];
  }
  // The query of (layer, batch position, q_head).
  std::span<float> Query(int layer, int64_t batch_pos, int q_head);
  void FillRandomSummaries(uint64_t seed);  // random but well-formed records

  StepInputs Inputs(std::span<const StepRow> rows) const;
  StepOutputs Outputs();
  std::span<const int32_t> VisitBlocks(int layer, int64_t batch_pos, int list = 0) const;
  int32_t VisitCount(int layer, int64_t batch_pos, int list = 0) const;
  std::span<const int32_t> BlockRow(int32_t row) const {
    return {block_table_.data() + row * max_blocks_, static_cast<size_t>(max_blocks_)};
  }

  const ModelLayout& model() const { return model_; }
  int64_t max_blocks() const { return max_blocks_; }
  int64_t max_groups() const { return max_groups_; }
  int64_t num_slots() const { return num_slots_; }
  std::vector<float>& pool() { return pool_; }
  std::vector<int32_t>& block_table() { return block_table_; }
  std::vector<int32_t>& group_table() { return group_table_; }

 private:
  ModelLayout model_;
  SummaryLayout layout_;
  int64_t max_seqs_, max_blocks_, max_groups_, max_batch_, num_slots_, lists_;
  std::vector<float> pool_;
  std::vector<int32_t> group_table_, block_table_;
  std::vector<float> queries_;
  std::vector<int32_t> visit_blocks_, visit_count_;
};

}  // namespace eps::testing
