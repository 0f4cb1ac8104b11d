// Engine-ready attention inputs built on the device from epsd's visit lists
// (docs/api-memory.md §3.6, docs/integration/outputs.md), with no host copy:
//
//   FlashAttention: per (layer, batch position[, KV head]) a block-table row and
//     seqused_k, the arguments of flash_attn_with_kvcache / a paged decode kernel.
//   FlashInfer (fixed budget): the paged-KV arrays indptr, indices and
//     last_page_len of BatchDecodeWithPagedKVCacheWrapper. FlashInfer plans a
//     step on the host from indptr, so indptr must be known before selection:
//     with a fixed budget each list holds n blocks (FixedBudgetBlocks: every block of
//     a row of at most k groups, else k - 1 whole groups and the newest), and
//     FixedBudgetIndptr computes it from the contexts (for reused lists, also the
//     selection's: below).
//
// A list whose count is < 0 ("attend densely": a fallback or a failed step) is
// replaced by the engine's own block-table row: in full for FlashAttention; for
// FlashInfer, whose plan has room for n blocks only, by the sequence's newest
// n blocks, and the list is counted in `*mismatched` (so is a list whose count
// is not n), which the engine reads when it likes (it never forces a sync).
// So is a list that cannot be one of this sequence's: a count above its blocks, an
// empty list of a row with blocks (never written: epsd's lists hold the row's newest
// block), or (with `cache_blocks` > 0) a block id outside [0, cache_blocks), or a last block
// that is not one of the row's newest (below); for FlashAttention such lists are
// counted in `*refused` when it is given.
//
// epsd's lists end at the row's newest block. A list may be reused for later steps
// (docs/api.md, "Reusing a selection"): selected at a shorter context, it ends at a block
// before the row's newest. FlashAttention's views then extend it: a list whose last block
// is one of the row's newest kReuseWindowBlocks blocks, but not the newest, is followed by
// the row's blocks after it, and seqused_k counts them. A list whose last block is none of
// those, or that the row has no room to extend (count + gained > the row's blocks), cannot
// be this sequence's (another position's, or older than the window): refused as above.
// FlashInfer's fixed plan extends a reused list the same way when the plan has room for
// it: FixedBudgetIndptr given the selection's contexts plans each list as the selection's
// length and the blocks written since; a list that does not fill its plan so is mismatched.
//
// The kernels never read or write outside the rows they are given, whatever the
// device data: a context < 1 is an empty row (seqused_k 0); a context longer than
// the table's row is cut to the row (stride blocks); a plan entry whose indptr
// leaves [0, nnz] is skipped and counted, and a plan asking for more blocks than
// the row holds repeats the row's oldest block (id 0 for an empty row), counted.
//
// Shapes (int32, row-major, lists = 1 for union lists or kv_heads):
//   visit_blocks [layers, max_batch, lists, max_blocks]   visit_count [layers, max_batch, lists]
//   engine_table [batch, table_stride] (row i: batch position i's physical blocks)
//   context_tokens [batch]
// Thread safety: the functions enqueue on `stream` and return; nothing is shared.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace eps::client {

// How far back the views look for a reused list's last block (above): the row's newest 64
// blocks, so a list gains at most 63. With 16-token blocks a selection serves at least the
// 1,008 tokens decoded after it (1,023 when its context began a block).
inline constexpr int64_t kReuseWindowBlocks = 64;

struct VisitListsDevice {
  const int32_t* blocks = nullptr;  // visit_blocks
  const int32_t* count = nullptr;   // visit_count
  int layers = 0;
  int64_t max_batch = 0;
  int lists = 1;
  int64_t max_blocks = 0;
};

struct EngineTableDevice {
  const int32_t* table = nullptr;           // [batch, stride]
  int64_t stride = 0;                       // entries per row, >= blocks of the longest context
  const int32_t* context_tokens = nullptr;  // [batch], >= 1
  int64_t batch = 0;
  int block_size = 16;
  int64_t cache_blocks = 0;  // > 0: list ids must lie in [0, cache_blocks) (defence in depth)
};

// Loads this library's kernels on the current device (as gpu/stream_ops.h
// PreloadStreamOps does its own): an engine queues them behind its wait for a step's lists,
// and a first launch of a kernel not yet loaded waits for the context to go idle, which that
// wait holds up. Call once per device, before any wait is queued.
absl::Status PreloadEngineOutputs();

// Writes block_table [layers, batch, lists, max_blocks] (entries past a row's
// blocks are left as they are) and seqused_k [layers, batch, lists]; adds the
// lists it refused (above) to *refused (device int32) unless it is null.
absl::Status BuildFlashAttentionViews(const VisitListsDevice& lists,
                                      const EngineTableDevice& engine, int32_t* block_table,
                                      int32_t* seqused_k, cudaStream_t stream,
                                      int32_t* refused = nullptr);

// k, the groups of a fixed-budget list of a sequence longer than k groups: first_n sinks,
// max(last_n, 1) recent groups (the newest is always kept) and top_pages ranked ones, as
// the session's effective options give them (the Python client's fixed_budget_groups).
// InvalidArgument, naming it, for a negative first_n or last_n, top_pages < 1, or a sum
// past INT_MAX.
absl::StatusOr<int> FixedBudgetGroups(int first_n, int last_n, int top_pages);

// Blocks of a fixed-budget list: k = budget_groups groups of g = group_blocks blocks
// (0 for a context < 1). InvalidArgument, naming it, unless budget_groups, group_blocks
// and block_size are >= 1 (the Python client's fixed_budget_blocks).
absl::StatusOr<int64_t> FixedBudgetBlocks(int64_t context_tokens, int budget_groups,
                                          int group_blocks, int block_size);

// indptr [batch * lists + 1] of the fixed-budget plan (host; the same for every layer).
// `selected_context_tokens` (empty: the contexts themselves) are the contexts at the
// selection whose lists the step reuses: each list then holds that selection's
// FixedBudgetBlocks and the blocks written since. InvalidArgument for sizes
// FixedBudgetBlocks refuses, lists < 1, a plan whose entries exceed int32 (FlashInfer's
// indptr type), or selected contexts that are not one per context, each at most it.
absl::StatusOr<std::vector<int32_t>> FixedBudgetIndptr(
    const std::vector<int64_t>& context_tokens, int lists, int budget_groups, int group_blocks,
    int block_size, const std::vector<int64_t>& selected_context_tokens = {});

// Writes indices [layers, indptr.back()] and last_page_len [batch * lists] for the
// plan `indptr` (device, from FixedBudgetIndptr); adds mismatched lists to
// *mismatched (device int32). `nnz` = indptr.back().
absl::Status BuildFlashInferFixedBudget(const VisitListsDevice& lists,
                                        const EngineTableDevice& engine, const int32_t* indptr,
                                        int64_t nnz, int32_t* indices, int32_t* last_page_len,
                                        int32_t* mismatched, cudaStream_t stream);

}  // namespace eps::client
