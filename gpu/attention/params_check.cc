#include "gpu/attention/params_check.h"

#include <cstdint>
#include <string>
#include <utility>

#include "gpu/attention/row_list.h"

namespace eps::attention {
namespace {

thread_local std::string last_error;

std::string Str(int64_t v) { return std::to_string(v); }

bool Aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The selection-feedback fields (ABI 2): all unused without `feedback`, else a buffer
// whose (row, head, group) entries do not overlap.
std::string CheckFeedback(const EpsAttnParams& p, bool check_pointers) {
  if (p.feedback == nullptr) {
    if (p.block_positions != nullptr || p.feedback_rows != nullptr || p.feedback_seqs != 0 ||
        p.feedback_groups != 0 || p.feedback_group_blocks != 0) {
      return "feedback is NULL but other feedback fields are set (block_positions, "
             "feedback_rows, feedback_seqs, feedback_groups, feedback_group_blocks)";
    }
    return "";
  }
  if (p.feedback_seqs < 1) return "feedback_seqs=" + Str(p.feedback_seqs) + " must be >= 1";
  if (p.feedback_groups < 1) return "feedback_groups=" + Str(p.feedback_groups) + " must be >= 1";
  if (p.feedback_group_blocks < 1 || p.feedback_group_blocks > 4096) {
    return "feedback_group_blocks=" + Str(p.feedback_group_blocks) + " not in [1, 4096]";
  }
  // Each bound before its product: 2^31 * 4096 heads cannot wrap an int64 (a stride of
  // 6148914691236517206 times 3 heads wrapped to 2 and passed the row check).
  if (p.feedback_stride_head > (int64_t{1} << 31) || p.feedback_stride_row > (int64_t{1} << 31)) {
    return "feedback_stride_head=" + Str(p.feedback_stride_head) +
           ", feedback_stride_row=" + Str(p.feedback_stride_row) +
           ": each must be at most 2^31 entries";
  }
  if (p.feedback_stride_head < p.feedback_groups) {
    return "feedback_stride_head=" + Str(p.feedback_stride_head) +
           " is less than feedback_groups=" + Str(p.feedback_groups) + " (heads would overlap)";
  }
  if (p.feedback_stride_row < p.feedback_stride_head * p.num_q_heads) {
    return "feedback_stride_row=" + Str(p.feedback_stride_row) + " is less than num_q_heads * " +
           "feedback_stride_head=" + Str(p.feedback_stride_head * p.num_q_heads) +
           " (rows would overlap)";
  }
  if (p.feedback_stride_row > (int64_t{1} << 31) / p.feedback_seqs) {
    return "feedback_seqs * feedback_stride_row = " +
           Str(int64_t{p.feedback_seqs} * p.feedback_stride_row) +
           " entries: one layer's feedback must hold fewer than 2^31";
  }
  if (check_pointers && p.block_positions == nullptr) {
    return "feedback is set but block_positions is NULL (each block's index in its sequence)";
  }
  if (check_pointers && reinterpret_cast<uintptr_t>(p.feedback) % 4 != 0) {
    return "feedback is not 4-byte aligned";
  }
  return "";
}

// Rows and heads of an output of `width` elements each, laid out by two strides, share
// no element: the inner dimension's elements do not overlap, and the outer stride clears
// the inner dimension's whole extent.
std::string CheckNoOverlap(const char* name, int64_t rows, int64_t row_stride, int64_t heads,
                           int64_t head_stride, int64_t width) {
  struct Dim {
    int64_t count, stride;
  } inner{rows, row_stride}, outer{heads, head_stride};
  if (inner.count <= 1 || (outer.count > 1 && outer.stride < inner.stride)) {
    std::swap(inner, outer);
  }
  // outer.stride >= (inner.count - 1) * inner.stride + width, without overflow (strides
  // are non-negative here)
  const bool inner_ok = inner.count <= 1 || inner.stride >= width;
  const bool outer_ok =
      outer.count <= 1 ||
      (outer.stride >= width &&
       (inner.count <= 1 || (outer.stride - width) / (inner.count - 1) >= inner.stride));
  if (inner_ok && outer_ok) return "";
  return std::string(name) + "_stride_row=" + Str(row_stride) + " and " + name +
         "_stride_head=" + Str(head_stride) + " make rows or heads of " + Str(rows) + " x " +
         Str(heads) + " overlap (each holds " + Str(width) + " elements)";
}

}  // namespace

int32_t Fail(int32_t code, std::string message) {
  last_error = std::move(message);
  return code;
}

int32_t Succeed() {
  last_error.clear();
  return EPS_ATTN_OK;
}

std::string CheckParams(const EpsAttnParams& p, bool check_pointers) {
  if (p.struct_size != sizeof(EpsAttnParams)) {
    return "struct_size=" + Str(p.struct_size) + " but this library's EpsAttnParams has " +
           Str(sizeof(EpsAttnParams)) + " bytes (a caller built for another ABI version)";
  }
  if (p.dtype != EPS_ATTN_BF16 && p.dtype != EPS_ATTN_FP16) {
    return "dtype=" + Str(p.dtype) + " is neither EPS_ATTN_BF16 (1) nor EPS_ATTN_FP16 (2)";
  }
  struct Range {
    const char* name;
    int64_t value, lo, hi;
  };
  const Range ranges[] = {
      {"batch", p.batch, 1, 1 << 20},
      {"num_kv_heads", p.num_kv_heads, 1, 4096},
      {"num_q_heads", p.num_q_heads, 1, 4096},
      {"num_blocks", p.num_blocks, 1, INT32_MAX},
      {"max_list_blocks", p.max_list_blocks, 1, (1 << 26)},
  };
  for (const Range& r : ranges) {
    if (r.value < r.lo || r.value > r.hi) {
      return std::string(r.name) + "=" + Str(r.value) + " not in [" + Str(r.lo) + ", " + Str(r.hi) +
             "]";
    }
  }
  if (p.num_q_heads % p.num_kv_heads != 0) {
    return "num_q_heads=" + Str(p.num_q_heads) +
           " is not a multiple of num_kv_heads=" + Str(p.num_kv_heads);
  }
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) {
    return "head_dim=" + Str(p.head_dim) + " not in {64, 128, 256}";
  }
  if (p.block_size != 16) return "block_size=" + Str(p.block_size) + " must be 16";
  if (p.length_kind != EPS_ATTN_SEQUSED_TOKENS && p.length_kind != EPS_ATTN_VISIT_COUNT) {
    return "length_kind=" + Str(p.length_kind) +
           " is neither EPS_ATTN_SEQUSED_TOKENS (0) nor EPS_ATTN_VISIT_COUNT (1)";
  }
  if (p.length_kind == EPS_ATTN_VISIT_COUNT &&
      (p.dense_max_blocks < 1 || p.dense_max_blocks > (1 << 26))) {
    return "dense_max_blocks=" + Str(p.dense_max_blocks) + " not in [1, 67108864]";
  }
  if (!(p.softmax_scale > 0.0f) || p.softmax_scale > 1e30f) {
    return "softmax_scale=" + std::to_string(p.softmax_scale) + " is not a positive finite number";
  }
  if (!(p.softcap >= 0.0f) || p.softcap > 1e30f) {
    return "softcap=" + std::to_string(p.softcap) + " is not 0 or a positive finite number";
  }
  // The kernels fold softmax_scale / softcap into q in float32: it must stay finite (a
  // softcap of 1e-40 made it inf, and every score 0 * inf = NaN).
  if (p.softcap > 0.0f && !(p.softmax_scale / p.softcap <= 1e30f)) {
    return "softmax_scale / softcap = " + std::to_string(p.softmax_scale) + " / " +
           std::to_string(p.softcap) + " exceeds 1e30 (the scale applied to q in float32)";
  }
  if (p.num_splits < 0 || p.num_splits > 65535) {
    return "num_splits=" + Str(p.num_splits) + " not in [0, 65535] (0 = automatic)";
  }
  if (p.reserved != 0) return "reserved=" + Str(p.reserved) + " must be 0";
  if (p.reserved2 != 0) return "reserved2=" + Str(p.reserved2) + " must be 0";
  if (std::string why = CheckFeedback(p, check_pointers); !why.empty()) return why;
  // Vector loads read 16 bytes (8 elements) at a time from q and the caches and
  // store 16 bytes into out: element strides must keep that alignment.
  const struct {
    const char* name;
    int64_t value;
  } strides[] = {{"q_stride_row", p.q_stride_row},       {"q_stride_head", p.q_stride_head},
                 {"kv_stride_block", p.kv_stride_block}, {"kv_stride_token", p.kv_stride_token},
                 {"kv_stride_head", p.kv_stride_head},   {"out_stride_row", p.out_stride_row},
                 {"out_stride_head", p.out_stride_head}};
  for (const auto& s : strides) {
    if (s.value < 0 || s.value % 8 != 0) {
      return std::string(s.name) + "=" + Str(s.value) +
             " must be a non-negative multiple of 8 elements (16-byte vector access)";
    }
  }
  if (p.lists_stride_row < 0 || p.lists_stride_head < 0 || p.lengths_stride_row < 0 ||
      p.lengths_stride_head < 0 || p.dense_stride_row < 0 || p.lse_stride_row < 0 ||
      p.lse_stride_head < 0) {
    return "negative strides are not supported (lists, lengths, dense_table, lse)";
  }
  // Every (row, head) of out and lse is written by its own block, at once: two that share
  // memory race (a row stride of 0, or a head stride under head_dim, was accepted).
  if (std::string why = CheckNoOverlap("out", p.batch, p.out_stride_row, p.num_q_heads,
                                       p.out_stride_head, p.head_dim);
      !why.empty()) {
    return why;
  }
  if (p.lse != nullptr) {
    if (std::string why =
            CheckNoOverlap("lse", p.batch, p.lse_stride_row, p.num_q_heads, p.lse_stride_head, 1);
        !why.empty()) {
      return why;
    }
  }
  if (!check_pointers) return "";
  const struct {
    const char* name;
    const void* ptr;
    bool vector;
  } pointers[] = {
      {"q", p.q, true},     {"k_cache", p.k_cache, true}, {"v_cache", p.v_cache, true},
      {"out", p.out, true}, {"lists", p.lists, false},    {"lengths", p.lengths, false}};
  for (const auto& ptr : pointers) {
    if (ptr.ptr == nullptr) return std::string(ptr.name) + " is NULL";
    if (ptr.vector && !Aligned16(ptr.ptr)) {
      return std::string(ptr.name) + " is not 16-byte aligned";
    }
  }
  // int32 and float words: a misaligned one is a sticky cudaErrorMisalignedAddress that
  // ends the caller's CUDA context, so it is refused here (NULL: checked where required).
  const struct {
    const char* name;
    const void* ptr;
  } words[] = {{"lists", p.lists},
               {"lengths", p.lengths},
               {"dense_table", p.dense_table},
               {"context_lens", p.context_lens},
               {"lse", p.lse},
               {"error_word", p.error_word},
               {"block_positions", p.block_positions},
               {"feedback_rows", p.feedback_rows}};
  for (const auto& w : words) {
    if (reinterpret_cast<uintptr_t>(w.ptr) % 4 != 0) {
      return std::string(w.name) + " is not 4-byte aligned";
    }
  }
  if (p.length_kind == EPS_ATTN_VISIT_COUNT &&
      (p.dense_table == nullptr || p.context_lens == nullptr)) {
    return "EPS_ATTN_VISIT_COUNT needs dense_table and context_lens (dense fallback of "
           "count -1 rows, and the last block's length)";
  }
  return "";
}

std::string DescribeListError(const int32_t word[EPS_ATTN_ERROR_WORDS]) {
  const std::string where = "row " + Str(word[1]) + " KV head " + Str(word[2]) + ": ";
  switch (word[0]) {
    case kListOk:
      return "";
    case kListEmpty:
      return where + "length (seqused_k or visit_count) " + Str(word[3]) + ": an empty list";
    case kListTooLong:
      return where + "the list needs " + Str(word[3]) + " blocks, more than its row holds";
    case kListBlockId:
      return where + "block id " + Str(word[3]) + " not in [0, num_blocks)";
    case kListContext:
      return where + "context_lens=" + Str(word[3]) + " (an empty sequence)";
    case kListCount:
      return where + "visit_count " + Str(word[3]) +
             " exceeds the blocks of its sequence (ceil(context_lens / block_size))";
    case kFeedbackPosition:
      return where + "block_positions gives position " + Str(word[3]) +
             ", outside the feedback buffer's groups (feedback entry skipped)";
    case kFeedbackRow:
      return where + "feedback_rows gives table row " + Str(word[3]) +
             ", not in [0, feedback_seqs) (feedback entries skipped)";
    default:
      return "error word holds unknown code " + Str(word[0]);
  }
}

}  // namespace eps::attention

extern "C" const char* eps_attn_last_error(void) { return eps::attention::last_error.c_str(); }
