// Kernels of engine_outputs.h: one thread block per (layer, batch position, list),
// its threads copying the list's block ids.
#include <algorithm>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/cpp/engine_outputs.h"
#include "core/layout.h"
#include "gpu/cuda_check.h"
#include "gpu/launch.cuh"

namespace eps::client {
namespace {

constexpr int kThreads = 128;

// A sequence's row as the kernels use it: a context < 1 is empty, one longer than
// the engine table's row is cut to the row, so no kernel reads past the row.
struct Row {
  int64_t blocks;  // entries of the engine row in use
  int64_t tokens;  // tokens they hold
  int64_t last;    // tokens of the last block (0 for an empty row)
};

__device__ inline Row RowOf(int64_t context, const EngineTableDevice& e) {
  const int64_t tokens_in = context > 0 ? context : 0;
  const int64_t blocks = min((tokens_in + e.block_size - 1) / e.block_size, e.stride);
  const int64_t tokens = min(tokens_in, blocks * e.block_size);
  return {blocks, tokens, blocks > 0 ? tokens - (blocks - 1) * e.block_size : 0};
}

// Whether epsd's list can be one of this sequence's: a count within the row and the
// output's width, not 0 for a row with blocks (epsd's lists hold the row's newest block: an
// empty one there was never written, e.g. a position that joined the batch after the
// selection a step reuses), and (when the engine names its cache's size) every id in the
// cache. Called by every thread of the block (a barrier inside).
__device__ inline bool ListUsable(const int32_t* list, int32_t count, int64_t blocks,
                                  int64_t max_blocks, int64_t cache_blocks) {
  if (count < 0 || count > blocks || count > max_blocks || (count == 0 && blocks > 0)) {
    return false;
  }
  if (cache_blocks <= 0) return true;
  bool outside = false;
  for (int64_t j = threadIdx.x; j < count; j += blockDim.x) {
    outside |= list[j] < 0 || list[j] >= cache_blocks;
  }
  return __syncthreads_or(outside) == 0;
}

// How many blocks a list of count >= 1 gains from the engine's row: a list ends at one of
// the row's blocks, the newest, or (selected at a shorter context and reused,
// engine_outputs.h) one of the newest kReuseWindowBlocks before it, and gains the row's
// blocks after it. -1 when its last block is none of those, or the row has no room for
// what it would gain: not this sequence's list. Called once by every thread of the block
// (barriers inside).
__device__ inline int64_t ReuseTail(const int32_t* list, int32_t count, const int32_t* engine_row,
                                    int64_t blocks) {
  __shared__ unsigned long long found;  // 1 + the row position of the list's last block
  if (threadIdx.x == 0) found = 0;
  __syncthreads();
  const int32_t last = list[count - 1];
  const int64_t low = blocks > kReuseWindowBlocks ? blocks - kReuseWindowBlocks : 0;
  for (int64_t j = blocks - 1 - threadIdx.x; j >= low; j -= blockDim.x) {
    if (engine_row[j] == last) atomicMax(&found, static_cast<unsigned long long>(j + 1));
  }
  __syncthreads();
  if (found == 0) return -1;
  const int64_t gain = blocks - static_cast<int64_t>(found);
  return count + gain <= blocks ? gain : -1;
}

// grid: layers * batch * lists. block_table [L, B, lists, max_blocks], seqused [L, B, lists].
__global__ void FlashAttentionViewsKernel(VisitListsDevice v, EngineTableDevice e,
                                          int32_t* block_table, int32_t* seqused,
                                          int32_t* refused) {
  const int64_t r = blockIdx.x;  // ((layer * batch) + b) * lists + h
  const int h = static_cast<int>(r % v.lists);
  const int64_t b = (r / v.lists) % e.batch;
  const int64_t layer = r / (v.lists * e.batch);
  const int64_t in = (layer * v.max_batch + b) * v.lists + h;  // list index in epsd's buffers
  const Row row = RowOf(e.context_tokens[b], e);
  const int32_t count = v.count[in];
  const int32_t* list = v.blocks + in * v.max_blocks;
  int32_t* out = block_table + r * v.max_blocks;
  const int32_t* engine_row = e.table + b * e.stride;
  const bool usable = ListUsable(list, count, row.blocks, v.max_blocks, e.cache_blocks);
  const int64_t gain = usable && count > 0 ? ReuseTail(list, count, engine_row, row.blocks) : 0;
  if (usable && gain >= 0) {
    for (int64_t j = threadIdx.x; j < count; j += blockDim.x) out[j] = list[j];
    for (int64_t j = threadIdx.x; j < gain; j += blockDim.x) {
      out[count + j] = engine_row[row.blocks - gain + j];
    }
    const int64_t n = count + gain;
    if (threadIdx.x == 0) {
      seqused[r] = n == 0 ? 0 : static_cast<int32_t>((n - 1) * e.block_size + row.last);
    }
  } else {
    for (int64_t j = threadIdx.x; j < row.blocks; j += blockDim.x) out[j] = engine_row[j];
    if (threadIdx.x == 0) {
      seqused[r] = static_cast<int32_t>(row.tokens);
      if (count >= 0 && refused != nullptr) atomicAdd(refused, 1);
    }
  }
}

// grid: layers * batch * lists. indices [L, nnz]; last_page_len [B * lists].
__global__ void FlashInferFixedKernel(VisitListsDevice v, EngineTableDevice e,
                                      const int32_t* indptr, int64_t nnz, int32_t* indices,
                                      int32_t* last_page_len, int32_t* mismatched) {
  const int64_t r = blockIdx.x;
  const int64_t per_layer = e.batch * v.lists;
  const int64_t layer = r / per_layer;
  const int64_t q = r % per_layer;  // b * lists + h: FlashInfer's request index
  const int64_t b = q / v.lists;
  const int64_t in = (layer * v.max_batch + b) * v.lists + q % v.lists;
  const Row row = RowOf(e.context_tokens[b], e);
  if (layer == 0 && threadIdx.x == 0) last_page_len[q] = static_cast<int32_t>(row.last);
  const int64_t begin = indptr[q], end = indptr[q + 1];
  if (begin < 0 || end < begin || end > nnz) {  // not a plan of nnz entries: nothing written
    if (threadIdx.x == 0) atomicAdd(mismatched, 1);
    return;
  }
  const int64_t n = end - begin;
  int32_t* out = indices + layer * nnz + begin;
  const int32_t count = v.count[in];
  const int32_t* list = v.blocks + in * v.max_blocks;
  const int32_t* engine_row = e.table + b * e.stride;
  const bool usable = ListUsable(list, count, row.blocks, v.max_blocks, e.cache_blocks);
  // A reused list gains its row's newer blocks, as FlashAttention's views do; a plan made
  // with the selection's contexts has room for them (FixedBudgetIndptr).
  const int64_t gain = usable && count > 0 ? ReuseTail(list, count, engine_row, row.blocks) : 0;
  if (usable && gain >= 0 && count + gain == n) {
    for (int64_t j = threadIdx.x; j < count; j += blockDim.x) out[j] = list[j];
    for (int64_t j = threadIdx.x; j < gain; j += blockDim.x) {
      out[count + j] = engine_row[row.blocks - gain + j];
    }
  } else {
    // The plan has room for n blocks: the newest n of the sequence (its oldest block
    // repeated where the row holds fewer, block 0 for an empty row).
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const int64_t k = row.blocks - n + j;
      out[j] = row.blocks == 0 ? 0 : engine_row[k > 0 ? k : 0];
    }
    if (threadIdx.x == 0) atomicAdd(mismatched, 1);
  }
}

absl::Status Check(const VisitListsDevice& v, const EngineTableDevice& e) {
  if (v.blocks == nullptr || v.count == nullptr || e.table == nullptr ||
      e.context_tokens == nullptr) {
    return absl::InvalidArgumentError(
        "a device pointer of the visit lists or engine table is null");
  }
  if (v.layers < 1 || v.lists < 1 || v.max_blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat("layers=", v.layers, ", lists=", v.lists,
                                                   ", max_blocks=", v.max_blocks,
                                                   " must all be >= 1"));
  }
  if (e.batch < 1 || e.batch > v.max_batch) {
    return absl::InvalidArgumentError(
        absl::StrCat("batch=", e.batch, " not in [1, max_batch=", v.max_batch, "]"));
  }
  if (e.block_size < 1 || e.stride < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_size=", e.block_size, " and stride=", e.stride, " must be >= 1"));
  }
  // One block of the kernels per (layer, row, list): the grid is a 31-bit count (a
  // cast to unsigned once launched 2^32 fewer blocks and returned OK).
  constexpr int64_t kMaxGrid = std::numeric_limits<int32_t>::max();
  if (e.batch > kMaxGrid / v.layers / v.lists) {
    return absl::InvalidArgumentError(absl::StrCat("layers=", v.layers, " x batch=", e.batch,
                                                   " x lists=", v.lists, " exceeds ", kMaxGrid,
                                                   " (the kernels' grid)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status PreloadEngineOutputs() {
  cudaFuncAttributes attributes;
  CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(
      &attributes, reinterpret_cast<const void*>(&FlashAttentionViewsKernel)));
  CUDA_RETURN_IF_ERROR(
      cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(&FlashInferFixedKernel)));
  return absl::OkStatus();
}

absl::Status BuildFlashAttentionViews(const VisitListsDevice& lists,
                                      const EngineTableDevice& engine, int32_t* block_table,
                                      int32_t* seqused_k, cudaStream_t stream, int32_t* refused) {
  if (absl::Status s = Check(lists, engine); !s.ok()) return s;
  if (block_table == nullptr || seqused_k == nullptr) {
    return absl::InvalidArgumentError("block_table or seqused_k output is null");
  }
  if (engine.stride > lists.max_blocks) {
    // A dense row must fit the output rows, which are max_blocks long.
    return absl::InvalidArgumentError(absl::StrCat("engine table stride=", engine.stride,
                                                   " exceeds max_blocks=", lists.max_blocks));
  }
  const int64_t grid = int64_t{lists.layers} * engine.batch * lists.lists;
  CUDA_RETURN_IF_ERROR(gpu::LaunchKernel(FlashAttentionViewsKernel, static_cast<unsigned>(grid),
                                         kThreads, 0, stream, lists, engine, block_table, seqused_k,
                                         refused));
  return absl::OkStatus();
}

namespace {

// A fixed-budget plan needs whole groups of whole blocks (the Python client's _check_plan).
absl::Status CheckPlan(int budget_groups, int group_blocks, int block_size) {
  for (const auto& [name, value] : {std::pair<const char*, int>{"budget_groups", budget_groups},
                                    std::pair<const char*, int>{"group_blocks", group_blocks},
                                    std::pair<const char*, int>{"block_size", block_size}}) {
    if (value < 1)
      return absl::InvalidArgumentError(absl::StrCat(name, "=", value, " must be >= 1"));
  }
  return absl::OkStatus();
}

// The plan's blocks for one list, the sizes checked. Never overflows: blocks <= 2^59 for
// an int64 context, and the budget's product is below 2^62.
int64_t PlanBlocks(int64_t context_tokens, int budget_groups, int group_blocks, int block_size) {
  if (context_tokens < 1) return 0;
  const int64_t blocks = BlocksFor(context_tokens, block_size);
  const int64_t groups = (blocks - 1) / group_blocks + 1;
  if (groups <= budget_groups) return blocks;
  const int64_t newest = blocks - (groups - 1) * group_blocks;
  return int64_t{budget_groups - 1} * group_blocks + newest;
}

}  // namespace

absl::StatusOr<int> FixedBudgetGroups(int first_n, int last_n, int top_pages) {
  for (const auto& [name, value, low] :
       {std::tuple{"first_n", first_n, 0}, std::tuple{"last_n", last_n, 0},
        std::tuple{"top_pages", top_pages, 1}}) {
    if (value < low) {
      return absl::InvalidArgumentError(absl::StrCat(name, "=", value, " must be >= ", low));
    }
  }
  const int64_t k = int64_t{first_n} + std::max(last_n, 1) + top_pages;
  if (k > std::numeric_limits<int>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_n + max(last_n, 1) + top_pages = ", k, " exceeds INT_MAX"));
  }
  return static_cast<int>(k);
}

absl::StatusOr<int64_t> FixedBudgetBlocks(int64_t context_tokens, int budget_groups,
                                          int group_blocks, int block_size) {
  if (absl::Status s = CheckPlan(budget_groups, group_blocks, block_size); !s.ok()) return s;
  return PlanBlocks(context_tokens, budget_groups, group_blocks, block_size);
}

absl::StatusOr<std::vector<int32_t>> FixedBudgetIndptr(
    const std::vector<int64_t>& context_tokens, int lists, int budget_groups, int group_blocks,
    int block_size, const std::vector<int64_t>& selected_context_tokens) {
  if (absl::Status s = CheckPlan(budget_groups, group_blocks, block_size); !s.ok()) return s;
  if (lists < 1) return absl::InvalidArgumentError(absl::StrCat("lists=", lists, " must be >= 1"));
  const bool reused = !selected_context_tokens.empty();
  if (reused && selected_context_tokens.size() != context_tokens.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("selected_context_tokens has ", selected_context_tokens.size(),
                     " entries, context_tokens ", context_tokens.size()));
  }
  std::vector<int32_t> indptr(1, 0);
  int64_t total = 0;
  for (size_t i = 0; i < context_tokens.size(); ++i) {
    int64_t n = PlanBlocks(context_tokens[i], budget_groups, group_blocks, block_size);
    if (reused) {  // the selection's list and the blocks written since (engine_outputs.h)
      const int64_t selected = selected_context_tokens[i];
      if (selected > context_tokens[i]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "selected_context_tokens[", i, "]=", selected, " exceeds context_tokens[", i,
            "]=", context_tokens[i], ": a selection is not made after the step that reuses it"));
      }
      n = PlanBlocks(selected, budget_groups, group_blocks, block_size) +
          BlocksFor(context_tokens[i], block_size) - BlocksFor(selected, block_size);
    }
    for (int h = 0; h < lists; ++h) {
      // FlashInfer's indptr is int32: a plan past 2^31-1 entries has no such array.
      if (n > std::numeric_limits<int32_t>::max() - total) {
        return absl::InvalidArgumentError(
            absl::StrCat("the plan exceeds 2^31-1 entries at context_tokens[", i,
                         "]=", context_tokens[i], " (list ", h, "): FlashInfer's indptr is int32"));
      }
      total += n;
      indptr.push_back(static_cast<int32_t>(total));
    }
  }
  return indptr;
}

absl::Status BuildFlashInferFixedBudget(const VisitListsDevice& lists,
                                        const EngineTableDevice& engine, const int32_t* indptr,
                                        int64_t nnz, int32_t* indices, int32_t* last_page_len,
                                        int32_t* mismatched, cudaStream_t stream) {
  if (absl::Status s = Check(lists, engine); !s.ok()) return s;
  if (indptr == nullptr || indices == nullptr || last_page_len == nullptr ||
      mismatched == nullptr) {
    return absl::InvalidArgumentError("indptr, indices, last_page_len or mismatched is null");
  }
  if (nnz < 0) return absl::InvalidArgumentError(absl::StrCat("nnz=", nnz, " is negative"));
  const int64_t grid = int64_t{lists.layers} * engine.batch * lists.lists;
  CUDA_RETURN_IF_ERROR(gpu::LaunchKernel(FlashInferFixedKernel, static_cast<unsigned>(grid),
                                         kThreads, 0, stream, lists, engine, indptr, nnz, indices,
                                         last_page_len, mismatched));
  return absl::OkStatus();
}

}  // namespace eps::client
