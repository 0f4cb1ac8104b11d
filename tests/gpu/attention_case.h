// A random paged-attention problem in host memory, for the attention tests: a KV cache
// in vLLM's layout with the rows' blocks at random physical places, and lists that
// keep a random subset of each row's blocks (the last block always, in logical order,
// so in random physical order). Slots past a row's tokens and unlisted blocks hold
// NaN: a kernel that reads them produces NaN.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gpu/attention/paged_attention.h"

namespace eps::attention::testing {

inline uint16_t ToBits(float x, int32_t dtype) {
  if (dtype == EPS_ATTN_FP16) {
    const _Float16 h = static_cast<_Float16>(x);
    uint16_t bits;
    std::memcpy(&bits, &h, sizeof(bits));
    return bits;
  }
  uint32_t word;
  std::memcpy(&word, &x, sizeof(word));
  word += 0x7fffu + ((word >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(word >> 16);
}

inline double FromBits(uint16_t bits, int32_t dtype) {
  if (dtype == EPS_ATTN_FP16) {
    _Float16 h;
    std::memcpy(&h, &bits, sizeof(h));
    return static_cast<double>(h);
  }
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &word, sizeof(f));
  return f;
}

struct CaseShape {
  int32_t dtype = EPS_ATTN_BF16;
  int batch = 3;
  int num_q_heads = 8;
  int num_kv_heads = 2;
  int head_dim = 128;
  bool per_head_lists = false;
  double keep = 0.5;          // share of each row's blocks a list keeps
  std::vector<int> contexts;  // tokens per row; empty: random in [1, 2000]
  int32_t length_kind = EPS_ATTN_SEQUSED_TOKENS;
  float softcap = 0.0f;
  float softmax_scale = 0.0f;  // 0: 1/sqrt(head_dim)
  int num_splits = 0;
};

struct AttentionCase {
  CaseShape shape;
  int max_blocks = 0;  // blocks of the longest row: the width of every list row
  int num_blocks = 0;
  std::vector<uint16_t> q, kv;  // kv: [2, num_blocks, 16, kv_heads, d]
  std::vector<int32_t> table, context, lists, lengths;
  // Selection feedback (EnableFeedback): block positions, table rows, the buffer.
  std::vector<int32_t> positions, feedback_rows;
  std::vector<float> feedback;
  int feedback_group_blocks = 0;
  EpsAttnParams params{};  // pointers into the vectors above (host memory)

  AttentionCase(const CaseShape& s, uint32_t seed) : shape(s) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    const int b = s.batch, hk = s.num_kv_heads, d = s.head_dim;
    if (shape.contexts.empty()) {
      std::uniform_int_distribution<int> len(1, 2000);
      for (int i = 0; i < b; ++i) shape.contexts.push_back(len(rng));
    }
    std::vector<int> blocks(b);
    for (int i = 0; i < b; ++i) {
      blocks[i] = (shape.contexts[i] + 15) / 16;
      max_blocks = std::max(max_blocks, blocks[i]);
    }
    num_blocks = std::accumulate(blocks.begin(), blocks.end(), 0) + 5;  // 5 never used
    std::vector<int32_t> physical(num_blocks);
    std::iota(physical.begin(), physical.end(), 0);
    std::shuffle(physical.begin(), physical.end(), rng);

    const uint16_t nan_bits = s.dtype == EPS_ATTN_FP16 ? 0x7e00 : 0x7fc0;
    kv.assign(size_t{2} * num_blocks * 16 * hk * d, nan_bits);
    q.resize(static_cast<size_t>(b) * s.num_q_heads * d);
    for (auto& x : q) x = ToBits(2.0f * uni(rng), s.dtype);
    table.assign(static_cast<size_t>(b) * max_blocks, -7);  // unused entries: invalid ids
    context.assign(shape.contexts.begin(), shape.contexts.end());
    const int list_heads = s.per_head_lists ? hk : 1;
    lists.assign(static_cast<size_t>(b) * list_heads * max_blocks, -7);
    lengths.assign(static_cast<size_t>(b) * hk, 0);
    int next = 0;
    std::bernoulli_distribution keep(s.keep);
    for (int i = 0; i < b; ++i) {
      for (int j = 0; j < blocks[i]; ++j) {
        const int32_t id = physical[next++];
        table[static_cast<size_t>(i) * max_blocks + j] = id;
        const int filled = std::min(16, shape.contexts[i] - j * 16);
        for (int half = 0; half < 2; ++half) {
          for (int t = 0; t < filled; ++t) {
            for (int h = 0; h < hk; ++h) {
              uint16_t* row =
                  &kv[((((static_cast<size_t>(half) * num_blocks + id) * 16 + t) * hk) + h) * d];
              for (int e = 0; e < d; ++e) row[e] = ToBits(uni(rng), s.dtype);
            }
          }
        }
      }
      const int last_tokens = shape.contexts[i] - (blocks[i] - 1) * 16;
      for (int h = 0; h < list_heads; ++h) {
        int32_t* list = &lists[(static_cast<size_t>(i) * list_heads + h) * max_blocks];
        int n = 0;
        for (int j = 0; j < blocks[i]; ++j) {
          if (j == blocks[i] - 1 || keep(rng))
            list[n++] = table[static_cast<size_t>(i) * max_blocks + j];
        }
        for (int hh = (s.per_head_lists ? h : 0); hh < (s.per_head_lists ? h + 1 : hk); ++hh) {
          lengths[static_cast<size_t>(i) * hk + hh] =
              s.length_kind == EPS_ATTN_VISIT_COUNT ? n : (n - 1) * 16 + last_tokens;
        }
      }
    }
    RefreshParams();
  }

  // Asks for selection feedback at `group_blocks` blocks a group: positions from the
  // table (unused blocks -9), rows b -> table row batch + 2 - b of a buffer with
  // batch + 3 table rows (so that table rows differ from batch positions and rows 0-2
  // are never written), every entry NaN.
  void EnableFeedback(int group_blocks) {
    feedback_group_blocks = group_blocks;
    positions.assign(num_blocks, -9);
    for (int i = 0; i < shape.batch; ++i) {
      for (int j = 0; j < (shape.contexts[i] + 15) / 16; ++j) {
        positions[table[static_cast<size_t>(i) * max_blocks + j]] = j;
      }
    }
    feedback_rows.resize(shape.batch);
    for (int i = 0; i < shape.batch; ++i) feedback_rows[i] = FeedbackSeqs() - 1 - i;
    feedback.assign(static_cast<size_t>(FeedbackSeqs()) * shape.num_q_heads * FeedbackGroups(),
                    NAN);
    RefreshParams();
  }
  int FeedbackSeqs() const { return shape.batch + 3; }
  int FeedbackGroups() const {
    return feedback_group_blocks ? (max_blocks + feedback_group_blocks - 1) / feedback_group_blocks
                                 : 0;
  }

  // Points params at the host vectors (call again after changing their sizes).
  void RefreshParams() {
    const CaseShape& s = shape;
    EpsAttnParams& p = params;
    p = EpsAttnParams{};
    p.struct_size = sizeof(EpsAttnParams);
    p.dtype = s.dtype;
    p.batch = s.batch;
    p.num_q_heads = s.num_q_heads;
    p.num_kv_heads = s.num_kv_heads;
    p.head_dim = s.head_dim;
    p.block_size = 16;
    p.num_blocks = num_blocks;
    p.q = q.data();
    p.q_stride_row = int64_t{s.num_q_heads} * s.head_dim;
    p.q_stride_head = s.head_dim;
    p.k_cache = kv.data();
    p.v_cache = kv.data() + kv.size() / 2;
    p.kv_stride_head = s.head_dim;
    p.kv_stride_token = int64_t{s.num_kv_heads} * s.head_dim;
    p.kv_stride_block = 16 * p.kv_stride_token;
    p.lists = lists.data();
    p.max_list_blocks = max_blocks;
    p.lists_stride_head = s.per_head_lists ? max_blocks : 0;
    p.lists_stride_row = int64_t{s.per_head_lists ? s.num_kv_heads : 1} * max_blocks;
    p.lengths = lengths.data();
    p.lengths_stride_row = s.num_kv_heads;
    p.lengths_stride_head = s.per_head_lists ? 1 : 0;  // 0: one length per row
    p.length_kind = s.length_kind;
    p.dense_table = table.data();
    p.dense_stride_row = max_blocks;
    p.dense_max_blocks = max_blocks;
    p.context_lens = context.data();
    p.out_stride_row = int64_t{s.num_q_heads} * s.head_dim;
    p.out_stride_head = s.head_dim;
    p.lse_stride_row = s.num_q_heads;
    p.lse_stride_head = 1;
    p.softmax_scale = s.softmax_scale > 0 ? s.softmax_scale : 1.0f / std::sqrt(float(s.head_dim));
    p.softcap = s.softcap;
    p.num_splits = s.num_splits;
    if (feedback_group_blocks > 0) {
      p.feedback = feedback.data();
      p.block_positions = positions.data();
      p.feedback_rows = feedback_rows.data();
      p.feedback_seqs = FeedbackSeqs();
      p.feedback_groups = FeedbackGroups();
      p.feedback_group_blocks = feedback_group_blocks;
      p.feedback_stride_head = FeedbackGroups();
      p.feedback_stride_row = int64_t{s.num_q_heads} * FeedbackGroups();
    }
  }

  size_t OutElements() const {
    return static_cast<size_t>(shape.batch) * shape.num_q_heads * shape.head_dim;
  }
  size_t LseElements() const { return static_cast<size_t>(shape.batch) * shape.num_q_heads; }
};

}  // namespace eps::attention::testing
