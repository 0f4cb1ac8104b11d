// The list one (row, KV head) reads, resolved from EpsAttnParams the same way on the
// host (the float64 reference) and on the device (the kernels): one definition of
// the seqused_k / visit_count / dense-fallback semantics of paged_attention.h.
#pragma once

#include <cstdint>

#include "gpu/attention/paged_attention.h"

#if defined(__CUDACC__)
#define EPS_ATTN_HD __host__ __device__ __forceinline__
#else
#define EPS_ATTN_HD inline
#endif

namespace eps::attention {

// Codes in word 0 of an error word; words 1-3 hold row, KV head and the offending value.
enum ListError : int32_t {
  kListOk = 0,
  kListEmpty = 1,         // tokens (or count) 0 or negative: value = the length
  kListTooLong = 2,       // more blocks than the list row holds: value = blocks needed
  kListBlockId = 3,       // a block id outside [0, num_blocks): value = the id
  kListContext = 4,       // context_lens[row] <= 0 in EPS_ATTN_VISIT_COUNT: value = it
  kFeedbackPosition = 5,  // block_positions[id] outside the feedback's groups: value = it
  kFeedbackRow = 6,       // feedback_rows[row] outside [0, feedback_seqs): value = it
  kListCount = 7,         // a visit_count above the sequence's blocks: value = the count
};

// The first feedback entry of (row, query head), -1 when params carry no feedback or
// the row's table row is out of range (*error and *value then say so). Entries are
// < 2^31 (CheckFeedback).
EPS_ATTN_HD int64_t FeedbackRowBase(const EpsAttnParams& p, int64_t row, int64_t qh, int32_t* error,
                                    int32_t* value) {
  *error = kListOk;
  if (p.feedback == nullptr) return -1;
  const int32_t table_row =
      p.feedback_rows != nullptr ? p.feedback_rows[row] : static_cast<int32_t>(row);
  if (table_row < 0 || table_row >= p.feedback_seqs) {
    *error = kFeedbackRow;
    *value = table_row;
    return -1;
  }
  return table_row * p.feedback_stride_row + qh * p.feedback_stride_head;
}

// The group of a block at `position` in its sequence, -1 (with *error, *value) when it
// lies outside the feedback buffer's groups.
EPS_ATTN_HD int32_t FeedbackGroup(const EpsAttnParams& p, int32_t position, int32_t* error,
                                  int32_t* value) {
  *error = kListOk;
  if (position < 0 || position / p.feedback_group_blocks >= p.feedback_groups) {
    *error = kFeedbackPosition;
    *value = position;
    return -1;
  }
  return position / p.feedback_group_blocks;
}

// The feedback entry of (row, query head, block id): FeedbackRowBase + FeedbackGroup of
// the block's position, -1 on either's error.
EPS_ATTN_HD int64_t FeedbackEntry(const EpsAttnParams& p, int64_t row, int64_t qh, int32_t id,
                                  int32_t* error, int32_t* value) {
  const int64_t base = FeedbackRowBase(p, row, qh, error, value);
  if (base < 0) return -1;
  const int32_t group = FeedbackGroup(p, p.block_positions[id], error, value);
  return group < 0 ? -1 : base + group;
}

struct RowList {
  const int32_t* blocks;  // count entries, in the order they are read
  int32_t count;          // blocks to read; 0 when error != kListOk
  int32_t tokens;         // tokens over them: (count - 1) * block_size < tokens <= count * bs
  int32_t error;          // ListError
  int32_t value;          // the offending value when error != kListOk
};

EPS_ATTN_HD RowList ResolveRow(const EpsAttnParams& p, int64_t row, int64_t kv_head) {
  const int64_t bs = p.block_size;
  const int32_t* list = p.lists + row * p.lists_stride_row + kv_head * p.lists_stride_head;
  const int32_t n = p.lengths[row * p.lengths_stride_row + kv_head * p.lengths_stride_head];
  RowList r{list, 0, 0, kListOk, 0};
  int64_t count = 0;
  int64_t tokens = 0;
  int64_t width = p.max_list_blocks;
  if (p.length_kind == EPS_ATTN_VISIT_COUNT) {
    const int32_t context = p.context_lens[row];
    if (context <= 0) return RowList{list, 0, 0, kListContext, context};
    if (n < 0) {  // epsd's "attend densely" marker
      r.blocks = p.dense_table + row * p.dense_stride_row;
      width = p.dense_max_blocks;
      tokens = context;
      count = (context + bs - 1) / bs;
    } else {
      // More blocks than the sequence has would read tokens past its end as if they
      // were its own (a list can name each block once).
      if (n > (context + bs - 1) / bs) return RowList{list, 0, 0, kListCount, n};
      count = n;
      tokens = n == 0 ? 0 : (n - 1) * bs + (context - (context - 1) / bs * bs);
    }
  } else {
    tokens = n;
    count = n > 0 ? (n + bs - 1) / bs : 0;
  }
  if (tokens <= 0) return RowList{list, 0, 0, kListEmpty, n};
  if (count > width) return RowList{list, 0, 0, kListTooLong, static_cast<int32_t>(count)};
  r.count = static_cast<int32_t>(count);
  r.tokens = static_cast<int32_t>(tokens);
  return r;
}

}  // namespace eps::attention
