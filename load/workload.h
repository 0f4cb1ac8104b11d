// Host images of one simulated engine's input buffers, prefilled with EPS
// summaries of synthetic keys (core/testing/synthetic.h).
//
// Writing a summary costs d·m flops per key, and a Llama-3-8B batch of 8 × 32k
// tokens holds 8 × 32768 × 256 (layer, KV head) keys, so eps-load writes the
// summaries of `patterns` (layer, KV head) key streams of max_context tokens,
// each with its own Φ, and copies them to every other (layer, KV head) and
// batch row. Records are well formed (real Grams and norms) and selection does
// the same work per record whatever their values; the visited fraction is that
// of this synthetic workload, not a measure of selection quality (eval/ does that).
// Every row owns distinct slots, so the server reads as many bytes as it would
// for distinct sequences.
#pragma once

#include <cstdint>
#include <vector>

#include "core/layout.h"
#include "load/buffer_set.h"

namespace eps::load {

struct WorkloadImage {
  BufferSetShape shape;
  int64_t max_groups = 0, max_blocks = 0;
  std::vector<float> summary_pool;   // [num_slots, layers, kv_heads, record_words]
  std::vector<int32_t> group_table;  // [max_seqs, max_groups]: row r, group p -> r*max_groups+p
  std::vector<int32_t> block_table;  // [max_seqs, max_blocks]: a seeded permutation
  std::vector<float> queries;        // [layers, max_batch, q_heads, d]
  int64_t num_kv_blocks = 0;
  // With a coarse level (model.coarse_blocks > 0; empty otherwise): the coarse records of
  // the same keys, copied as the fine ones, and the coarse table (row r, coarse group c ->
  // r*max_coarse_groups+c).
  int64_t max_coarse_groups = 0;
  std::vector<float> coarse_pool;     // [coarse_slots, layers, kv_heads, record_words]
  std::vector<int32_t> coarse_table;  // [max_seqs, max_coarse_groups]
  // With selection feedback (feedback_share > 0; empty otherwise): what an engine's
  // attention leaves for the next step, [layers, max_seqs, q_heads, max_groups] float32.
  // For a share of each (layer, row)'s groups, evenly spread from a seeded phase and the
  // same for every q head (as union lists visit them), the group's log Σ exp(q·k/√d) over
  // its keys with the head's query; NaN elsewhere. Not written by WriteTo: eps-load copies
  // each step's rows in before the step (BufferSet::WriteFeedback).
  std::vector<float> feedback;

  // Copies every image into `buffers`.
  absl::Status WriteTo(BufferSet& buffers) const;
};

// Builds the images for `batch` rows of up to `max_context` tokens; with feedback_share
// in (0, 1], the feedback image too. The other images do not depend on feedback_share.
WorkloadImage BuildWorkload(const ModelLayout& model, int batch, int64_t max_context, uint64_t seed,
                            double feedback_share = 0, int patterns = 4);

}  // namespace eps::load
