// Kernels of engine_outputs.h: one thread block per (layer, batch position, list),
// its threads copying the list's block ids.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "client/cpp/engine_outputs.h"
#include "gpu/cuda_check.h"

namespace eps::client {
namespace {

constexpr int kThreads = 128;

__device__ inline int64_t BlocksOf(int64_t context, int block_size) {
  return (context + block_size - 1) / block_size;
}

// A list epsd may have left dense (-1) or that cannot be a valid list of this
// sequence (more blocks than it has): the engine's own row is used instead.
__device__ inline bool ListUsable(int32_t count, int64_t blocks, int64_t max_blocks) {
  return count >= 0 && count <= blocks && count <= max_blocks;
}

// grid: layers * batch * lists. block_table [L, B, lists, max_blocks], seqused [L, B, lists].
__global__ void FlashAttentionViewsKernel(VisitListsDevice v, EngineTableDevice e,
                                          int32_t* block_table, int32_t* seqused) {
  const int64_t r = blockIdx.x;  // ((layer * batch) + b) * lists + h
  const int h = static_cast<int>(r % v.lists);
  const int64_t b = (r / v.lists) % e.batch;
  const int64_t layer = r / (v.lists * e.batch);
  const int64_t in = (layer * v.max_batch + b) * v.lists + h;  // list index in epsd's buffers
  const int64_t context = e.context_tokens[b];
  const int64_t blocks = BlocksOf(context, e.block_size);
  const int32_t count = v.count[in];
  int32_t* out = block_table + r * v.max_blocks;
  if (ListUsable(count, blocks, v.max_blocks)) {
    const int32_t* list = v.blocks + in * v.max_blocks;
    for (int64_t j = threadIdx.x; j < count; j += blockDim.x) out[j] = list[j];
    if (threadIdx.x == 0) {
      const int64_t last = context - (blocks - 1) * e.block_size;
      seqused[r] = count == 0 ? 0 : static_cast<int32_t>((count - 1) * e.block_size + last);
    }
  } else {
    const int32_t* row = e.table + b * e.stride;
    for (int64_t j = threadIdx.x; j < blocks; j += blockDim.x) out[j] = row[j];
    if (threadIdx.x == 0) seqused[r] = static_cast<int32_t>(context);
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
  const int64_t context = e.context_tokens[b];
  const int64_t blocks = BlocksOf(context, e.block_size);
  const int64_t n = indptr[q + 1] - indptr[q];
  int32_t* out = indices + layer * nnz + indptr[q];
  const int32_t count = v.count[in];
  if (count == n && ListUsable(count, blocks, v.max_blocks)) {
    const int32_t* list = v.blocks + in * v.max_blocks;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) out[j] = list[j];
  } else {
    // The plan has room for n blocks: the newest n of the sequence.
    const int32_t* row = e.table + b * e.stride + (blocks - n);
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) out[j] = row[j];
    if (threadIdx.x == 0) atomicAdd(mismatched, 1);
  }
  if (layer == 0 && threadIdx.x == 0) {
    last_page_len[q] = static_cast<int32_t>(context - (blocks - 1) * e.block_size);
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
  return absl::OkStatus();
}

}  // namespace

absl::Status BuildFlashAttentionViews(const VisitListsDevice& lists,
                                      const EngineTableDevice& engine, int32_t* block_table,
                                      int32_t* seqused_k, cudaStream_t stream) {
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
  FlashAttentionViewsKernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      lists, engine, block_table, seqused_k);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

int64_t FixedBudgetBlocks(int64_t context_tokens, int budget_groups, int group_blocks,
                          int block_size) {
  const int64_t blocks = (context_tokens + block_size - 1) / block_size;
  const int64_t groups = (blocks + group_blocks - 1) / group_blocks;
  if (groups <= budget_groups) return blocks;
  const int64_t newest = blocks - (groups - 1) * group_blocks;
  return int64_t{budget_groups - 1} * group_blocks + newest;
}

std::vector<int32_t> FixedBudgetIndptr(const std::vector<int64_t>& context_tokens, int lists,
                                       int budget_groups, int group_blocks, int block_size) {
  std::vector<int32_t> indptr(1, 0);
  for (const int64_t context : context_tokens) {
    const int64_t n = FixedBudgetBlocks(context, budget_groups, group_blocks, block_size);
    for (int h = 0; h < lists; ++h) indptr.push_back(static_cast<int32_t>(indptr.back() + n));
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
  FlashInferFixedKernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      lists, engine, indptr, nnz, indices, last_page_len, mismatched);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

}  // namespace eps::client
