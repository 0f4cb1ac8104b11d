// What the fuzz targets share: a server configuration with small limits, and a
// valid inline-buffer AttachRequest (every buffer inside the message, so that a
// fuzzed SelectPages can also write them), with and without a coarse level, also
// the seeds' starting point.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/layout.h"
#include "eps/v1/page_selector.pb.h"
#include "service/config.h"

namespace eps::fuzz {

inline service::ServerConfig FuzzConfig() {
  service::ServerConfig config;
  config.lease_ms = 3600000;  // the reaper never expires a session mid-run
  config.max_sessions = 8;
  config.max_batch = 16;
  return config;
}

inline v1::MemoryDescriptor Inline(v1::DType dtype, const std::vector<int64_t>& shape) {
  v1::MemoryDescriptor d;
  d.set_dtype(dtype);
  for (int64_t s : shape) d.add_shape(s);
  d.mutable_inline_bytes();
  return d;
}

// 2 layers, 4 query heads over 2 KV heads, d = 16, m = 4, 16-token blocks in
// groups of 2; 2 table rows of 8 groups (256 tokens); batch 2.
inline v1::AttachRequest SmallInlineAttach(const std::string& engine_id) {
  constexpr int kLayers = 2, kQHeads = 4, kKvHeads = 2, kDim = 16, kSketch = 4;
  constexpr int64_t kSeqs = 2, kGroups = 8, kBlocks = 16, kBatch = 2;
  ModelLayout model;
  model.num_layers = kLayers;
  model.num_q_heads = kQHeads;
  model.num_kv_heads = kKvHeads;
  model.head_dim = kDim;
  model.sketch_dim = kSketch;
  model.features = {.key_sum = false, .principal = false, .quest = false};
  const int64_t record_words = SummaryLayout::For(model).record_words;
  v1::AttachRequest a;
  a.set_engine_id(engine_id);
  v1::ModelLayout* l = a.mutable_layout();
  l->set_num_layers(kLayers);
  l->set_num_q_heads(kQHeads);
  l->set_num_kv_heads(kKvHeads);
  l->set_head_dim(kDim);
  l->set_block_size(16);
  l->set_group_blocks(2);
  l->set_sketch_dim(kSketch);
  l->set_phi_seed(7);
  a.set_max_batch(kBatch);
  a.mutable_options()->set_method(v1::METHOD_JL);  // minimal records: no quest part
  a.set_num_kv_blocks(kSeqs * kBlocks);
  v1::SharedBuffers* b = a.mutable_buffers();
  *b->mutable_summary_pool() =
      Inline(v1::DTYPE_FLOAT32, {kSeqs * kGroups, kLayers, kKvHeads, record_words});
  *b->mutable_group_table() = Inline(v1::DTYPE_INT32, {kSeqs, kGroups});
  *b->mutable_block_table() = Inline(v1::DTYPE_INT32, {kSeqs, kBlocks});
  *b->mutable_queries() = Inline(v1::DTYPE_FLOAT32, {kLayers, kBatch, kQHeads, kDim});
  *b->mutable_visit_blocks() = Inline(v1::DTYPE_INT32, {kLayers, kBatch, kBlocks});
  *b->mutable_visit_count() = Inline(v1::DTYPE_INT32, {kLayers, kBatch});
  // Tables that map row r's groups and blocks to distinct slots and blocks.
  std::string groups, blocks;
  for (int32_t i = 0; i < kSeqs * kGroups; ++i) groups.append(reinterpret_cast<char*>(&i), 4);
  for (int32_t i = 0; i < kSeqs * kBlocks; ++i) blocks.append(reinterpret_cast<char*>(&i), 4);
  b->mutable_group_table()->mutable_inline_bytes()->set_data(groups);
  b->mutable_block_table()->mutable_inline_bytes()->set_data(blocks);
  return a;
}

// The same session with a coarse level of 2 groups (4 blocks) per coarse group: 4 coarse
// groups a row, their inline coarse pool and table (row r, coarse group c -> r*4+c).
inline v1::AttachRequest SmallInlineCoarseAttach(const std::string& engine_id) {
  constexpr int64_t kSeqs = 2, kCoarse = 4;
  v1::AttachRequest a = SmallInlineAttach(engine_id);
  a.mutable_layout()->set_coarse_blocks(4);
  a.mutable_options()->set_top_pages(2);  // fewer than the groups: the candidates matter
  const v1::MemoryDescriptor& pool = a.buffers().summary_pool();
  v1::SharedBuffers* b = a.mutable_buffers();
  *b->mutable_coarse_pool() =
      Inline(v1::DTYPE_FLOAT32, {kSeqs * kCoarse, pool.shape(1), pool.shape(2), pool.shape(3)});
  *b->mutable_coarse_table() = Inline(v1::DTYPE_INT32, {kSeqs, kCoarse});
  std::string coarse;
  for (int32_t i = 0; i < kSeqs * kCoarse; ++i) coarse.append(reinterpret_cast<char*>(&i), 4);
  b->mutable_coarse_table()->mutable_inline_bytes()->set_data(coarse);
  return a;
}

}  // namespace eps::fuzz
