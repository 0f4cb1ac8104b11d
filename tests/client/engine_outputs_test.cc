// Engine-ready outputs (client/cpp/engine_outputs.h) against a host reference built
// from the visit-list contract of docs/api-memory.md §3.6, on fresh random lists (some dense,
// some malformed, some naming blocks outside the cache) and contexts (some empty,
// negative or longer than the engine's row). Skips without a device.
#include "client/cpp/engine_outputs.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "gpu/cuda_check.h"
#include "gpu/step.h"
#include "gtest/gtest.h"
#include "tests/core/test_util.h"
#include "tests/gpu/pending_error.h"

namespace eps::client {
namespace {

constexpr int64_t kCacheBlocks = 100000;  // the engine's cache: ids in [0, kCacheBlocks)

struct Case {
  int layers = 3, lists = 1, block_size = 16;
  int64_t max_batch = 5, batch = 4, max_blocks = 40;
  std::vector<int32_t> blocks, count, table, context;  // host, epsd's and the engine's layouts
  // The contexts at the selection the lists come from (reused: up to 2 blocks shorter).
  std::vector<int64_t> selected;
};

// The row the kernels use (engine_outputs.h): a context < 1 is empty, a longer one than
// the table's row (max_blocks here) is cut to it.
struct Row {
  int64_t blocks, tokens, last;
};

Row RowOf(const Case& c, int64_t b) {
  const int64_t tokens_in = std::max<int64_t>(c.context[b], 0);
  const int64_t blocks = std::min((tokens_in + c.block_size - 1) / c.block_size, c.max_blocks);
  const int64_t tokens = std::min(tokens_in, blocks * c.block_size);
  return {blocks, tokens, blocks > 0 ? tokens - (blocks - 1) * c.block_size : 0};
}

// Whether list `in` can be used: a count within its row, not 0 for a row with blocks (a
// list never written), every id inside the cache (when `cache_blocks` > 0).
bool Usable(const Case& c, int64_t in, int64_t blocks, int64_t cache_blocks) {
  const int32_t n = c.count[in];
  if (n < 0 || n > blocks || (n == 0 && blocks > 0)) return false;
  for (int32_t j = 0; j < n && cache_blocks > 0; ++j) {
    const int32_t id = c.blocks[in * c.max_blocks + j];
    if (id < 0 || id >= cache_blocks) return false;
  }
  return true;
}

// Blocks a usable list gains from its row (engine_outputs.h): the row's blocks after the
// list's last one, when that one is among the row's newest kReuseWindowBlocks and the row
// has room; -1 (not this row's list) otherwise.
int64_t Gain(const Case& c, int64_t in, int64_t b, int64_t blocks) {
  const int32_t n = c.count[in];
  if (n < 1) return 0;
  const int32_t last = c.blocks[in * c.max_blocks + n - 1];
  for (int64_t j = blocks - 1; j >= std::max<int64_t>(0, blocks - kReuseWindowBlocks); --j) {
    if (c.table[b * c.max_blocks + j] == last) {
      return n + (blocks - 1 - j) <= blocks ? blocks - 1 - j : -1;
    }
  }
  return -1;
}

// Random lists: ascending subsets of each row that end with its last block or (reused) a
// few blocks before it, some of another sequence (refused), some -1
// (dense), some with a count larger than the row or never written (count 0: malformed,
// treated as dense).
Case MakeCase(std::mt19937_64& rng, int lists, int budget_groups, int group_blocks,
              bool reused = false) {
  Case c;
  c.lists = lists;
  c.table.assign(c.batch * c.max_blocks, -7);
  c.context.resize(c.batch);
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t row_tokens = c.max_blocks * c.block_size;
    switch (rng() % 10) {  // mostly valid; an engine's bad contexts now and then
      case 0:
        c.context[b] = -static_cast<int32_t>(rng() % 3);
        break;
      case 1:
        c.context[b] = static_cast<int32_t>(row_tokens + 1 + rng() % row_tokens);
        break;
      default:
        c.context[b] = 1 + static_cast<int32_t>(rng() % row_tokens);
    }
    for (int64_t j = 0; j < RowOf(c, b).blocks; ++j) {
      c.table[b * c.max_blocks + j] = static_cast<int32_t>(rng() % kCacheBlocks);
    }
    // A reused selection was made up to 2 blocks ago (only inside the row, whose context
    // is not cut: a cut row has no tokens past its stride to have been written since).
    const int64_t back = reused ? static_cast<int64_t>(rng() % 3) : 0;
    const bool inside = c.context[b] <= c.max_blocks * c.block_size;
    c.selected.push_back(inside && c.context[b] > back * c.block_size
                             ? c.context[b] - back * c.block_size
                             : c.context[b]);
  }
  const int64_t n_lists = int64_t{c.layers} * c.max_batch * lists;
  c.blocks.assign(n_lists * c.max_blocks, -3);
  c.count.assign(n_lists, 0);
  for (int layer = 0; layer < c.layers; ++layer) {
    for (int64_t b = 0; b < c.batch; ++b) {
      const int64_t blocks = RowOf(c, b).blocks;
      for (int h = 0; h < lists; ++h) {
        const int64_t in = (layer * c.max_batch + b) * lists + h;
        const int kind = static_cast<int>(rng() % 8);
        if (kind == 0) {
          c.count[in] = -1;
          continue;
        }
        if (kind == 1) {  // a count beyond the row, or a list never written (count 0)
          c.count[in] = rng() % 2 ? static_cast<int32_t>(blocks + 1) : 0;
          continue;
        }
        if (blocks == 0) {  // an empty row's only list
          c.count[in] = 0;
          continue;
        }
        std::vector<int64_t> picked;
        if (kind <= 4 && budget_groups > 0) {  // the fixed budget's shape, at the selection
          const int64_t selected_blocks =
              std::min((c.selected[b] + c.block_size - 1) / c.block_size, blocks);
          const int64_t groups = (selected_blocks + group_blocks - 1) / group_blocks;
          std::vector<int64_t> g(groups - 1);
          std::iota(g.begin(), g.end(), 0);
          std::shuffle(g.begin(), g.end(), rng);
          g.resize(std::min<int64_t>(g.size(), budget_groups - 1));
          g.push_back(groups - 1);
          std::sort(g.begin(), g.end());
          for (int64_t p : g) {
            for (int64_t j = p * group_blocks;
                 j < std::min(selected_blocks, (p + 1) * group_blocks); ++j) {
              picked.push_back(j);
            }
          }
        } else {
          // Half of these as an earlier step's list, reused: it ends up to 3 blocks
          // before the row's newest (engine_outputs.h).
          const int64_t end = blocks - 1 - (rng() % 2 ? 0 : rng() % std::min<int64_t>(blocks, 4));
          for (int64_t j = 0; j < end; ++j)
            if (rng() % 3 == 0) picked.push_back(j);
          picked.push_back(end);
        }
        c.count[in] = static_cast<int32_t>(picked.size());
        for (size_t j = 0; j < picked.size(); ++j) {
          c.blocks[in * c.max_blocks + j] = c.table[b * c.max_blocks + picked[j]];
        }
        if (kind == 6 && rng() % 2 == 0) {  // another sequence's list: its blocks are not
          for (size_t j = 0; j < picked.size(); ++j) {  // this row's (refused)
            int32_t& id = c.blocks[in * c.max_blocks + j];
            id = static_cast<int32_t>((id + 1 + rng() % 7) % kCacheBlocks);
          }
        }
        if (kind == 7 && !picked.empty()) {  // an id outside the cache
          c.blocks[in * c.max_blocks + rng() % picked.size()] =
              rng() % 2 ? -1 : static_cast<int32_t>(kCacheBlocks + rng() % 5);
        }
      }
    }
  }
  return c;
}

template <typename T>
void Upload(const std::vector<T>& host, gpu::DeviceBuffer<T>& d) {
  ASSERT_TRUE(d.Allocate(std::max<int64_t>(host.size(), 1)).ok());
  ASSERT_EQ(cudaMemcpy(d.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
}

template <typename T>
std::vector<T> Download(const gpu::DeviceBuffer<T>& d, size_t n) {
  std::vector<T> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), d.get(), n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

class EngineOutputsTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(EngineOutputsTest, FlashAttentionViewsEqualTheHostReference) {
  const uint64_t seed = testing::TestSeed();
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 20; ++trial) {
    const Case c = MakeCase(rng, GetParam(), 0, 4);
    const int64_t cache_blocks = trial % 2 ? kCacheBlocks : 0;  // checked, then trusted
    gpu::DeviceBuffer<int32_t> blocks, count, table, context, refused;
    Upload(c.blocks, blocks), Upload(c.count, count), Upload(c.table, table),
        Upload(c.context, context), Upload(std::vector<int32_t>{5}, refused);
    const int64_t rows = int64_t{c.layers} * c.batch * c.lists;
    gpu::DeviceBuffer<int32_t> out, used;
    ASSERT_TRUE(out.Allocate(rows * c.max_blocks).ok());
    ASSERT_TRUE(used.Allocate(rows).ok());
    ASSERT_TRUE(BuildFlashAttentionViews(
                    {blocks.get(), count.get(), c.layers, c.max_batch, c.lists, c.max_blocks},
                    {table.get(), c.max_blocks, context.get(), c.batch, c.block_size, cache_blocks},
                    out.get(), used.get(), nullptr, refused.get())
                    .ok());
    const auto got = Download(out, rows * c.max_blocks);
    const auto got_used = Download(used, rows);
    int32_t want_refused = 5;
    for (int layer = 0; layer < c.layers; ++layer) {
      for (int64_t b = 0; b < c.batch; ++b) {
        const Row row = RowOf(c, b);
        for (int h = 0; h < c.lists; ++h) {
          const int64_t in = (layer * c.max_batch + b) * c.lists + h;
          const int64_t r = (layer * c.batch + b) * c.lists + h;
          const int32_t n = c.count[in];
          const int64_t gain =
              Usable(c, in, row.blocks, cache_blocks) ? Gain(c, in, b, row.blocks) : -1;
          const bool dense = gain < 0;
          if (dense && n >= 0) ++want_refused;
          std::vector<int32_t> want;
          if (dense) {
            want.assign(&c.table[b * c.max_blocks], &c.table[b * c.max_blocks] + row.blocks);
          } else {
            want.assign(&c.blocks[in * c.max_blocks], &c.blocks[in * c.max_blocks] + n);
            for (int64_t j = row.blocks - gain; j < row.blocks; ++j) {
              want.push_back(c.table[b * c.max_blocks + j]);
            }
          }
          const int64_t k = static_cast<int64_t>(want.size());
          EXPECT_EQ(got_used[r],
                    dense ? row.tokens : (k == 0 ? 0 : (k - 1) * c.block_size + row.last))
              << "seed " << seed << " layer " << layer << " b " << b << " h " << h;
          for (int64_t j = 0; j < k; ++j) {
            ASSERT_EQ(got[r * c.max_blocks + j], want[j]) << "seed " << seed << " entry " << j;
          }
        }
      }
    }
    EXPECT_EQ(Download(refused, 1)[0], want_refused) << "seed " << seed;
  }
}

TEST_P(EngineOutputsTest, FlashInferFixedBudgetArraysEqualTheHostReference) {
  const uint64_t seed = testing::TestSeed();
  std::mt19937_64 rng(seed);
  const int budget = 3, g = 4;
  int fitted = 0;  // reused lists that filled a plan made with their selection's contexts
  for (int trial = 0; trial < 20; ++trial) {
    // Trials 2 and 3 of every 4 reuse an earlier selection's lists, planned with its contexts.
    const bool reused = trial % 4 >= 2;
    const Case c = MakeCase(rng, GetParam(), budget, g, reused);
    const int64_t cache_blocks = trial % 2 ? kCacheBlocks : 0;
    std::vector<int64_t> contexts(c.context.begin(), c.context.end());
    std::vector<int32_t> indptr = *FixedBudgetIndptr(contexts, c.lists, budget, g, c.block_size,
                                                     reused ? c.selected : std::vector<int64_t>{});
    if (trial % 5 == 4) {  // a plan that is not one: an entry past nnz, one ending before it
      indptr[indptr.size() - 2] = indptr.back() + 1;  // begins (overlapping ranges would race)
    }
    const int64_t nnz = indptr.back();
    gpu::DeviceBuffer<int32_t> blocks, count, table, context, dptr;
    Upload(c.blocks, blocks), Upload(c.count, count), Upload(c.table, table),
        Upload(c.context, context), Upload(indptr, dptr);
    gpu::DeviceBuffer<int32_t> indices, last, mismatched;
    const std::vector<int32_t> sentinel(std::max<int64_t>(c.layers * nnz, 1), -9);
    Upload(sentinel, indices);
    ASSERT_TRUE(last.Allocate(c.batch * c.lists).ok());
    ASSERT_TRUE(mismatched.Allocate(1).ok());
    ASSERT_EQ(cudaMemset(mismatched.get(), 0, sizeof(int32_t)), cudaSuccess);
    ASSERT_TRUE(BuildFlashInferFixedBudget(
                    {blocks.get(), count.get(), c.layers, c.max_batch, c.lists, c.max_blocks},
                    {table.get(), c.max_blocks, context.get(), c.batch, c.block_size, cache_blocks},
                    dptr.get(), nnz, indices.get(), last.get(), mismatched.get(), nullptr)
                    .ok());
    const auto got = Download(indices, c.layers * nnz);
    const auto got_last = Download(last, c.batch * c.lists);
    int32_t want_mismatched = 0;
    for (int layer = 0; layer < c.layers; ++layer) {
      for (int64_t b = 0; b < c.batch; ++b) {
        const Row row = RowOf(c, b);
        for (int h = 0; h < c.lists; ++h) {
          const int64_t q = b * c.lists + h;
          EXPECT_EQ(got_last[q], row.last) << "seed " << seed;
          if (indptr[q] < 0 || indptr[q + 1] < indptr[q] || indptr[q + 1] > nnz) {
            ++want_mismatched;  // not a plan: nothing written for it
            continue;
          }
          const int64_t n = indptr[q + 1] - indptr[q];
          const int64_t in = (layer * c.max_batch + b) * c.lists + h;
          const int64_t gain =
              Usable(c, in, row.blocks, cache_blocks) ? Gain(c, in, b, row.blocks) : -1;
          const bool fits = gain >= 0 && c.count[in] + gain == n;
          if (!fits) ++want_mismatched;
          fitted += fits && gain > 0;
          for (int64_t j = 0; j < n; ++j) {
            const int64_t k = std::max<int64_t>(row.blocks - n + j, 0);
            const int64_t from_row = row.blocks - gain + (j - c.count[in]);
            const int32_t want = fits && j < c.count[in] ? c.blocks[in * c.max_blocks + j]
                                 : fits                  ? c.table[b * c.max_blocks + from_row]
                                 : row.blocks == 0       ? 0
                                                         : c.table[b * c.max_blocks + k];
            ASSERT_EQ(got[layer * nnz + indptr[q] + j], want) << "seed " << seed;
          }
        }
      }
    }
    EXPECT_EQ(Download(mismatched, 1)[0], want_mismatched) << "seed " << seed;
  }
  EXPECT_GT(fitted, 0) << "no reused list filled its plan: seed " << seed;
}

INSTANTIATE_TEST_SUITE_P(UnionAndPerKvHead, EngineOutputsTest, ::testing::Values(1, 3));

// An error the caller (the engine's PyTorch) left pending is not the kernels': their launches
// were checked with cudaGetLastError, which reported it as theirs and cleared it. It stays
// the caller's. One layer, one sequence of one 16-token block, one list naming block 7.
TEST(EngineOutputsDevice, ACallersPendingErrorIsNeitherReportedNorTaken) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(PreloadEngineOutputs().ok());
  gpu::DeviceBuffer<int32_t> blocks, count, table, context, indptr;
  Upload(std::vector<int32_t>{7}, blocks), Upload(std::vector<int32_t>{1}, count),
      Upload(std::vector<int32_t>{7}, table), Upload(std::vector<int32_t>{16}, context),
      Upload(std::vector<int32_t>{0, 1}, indptr);
  const VisitListsDevice lists{blocks.get(), count.get(), 1, 1, 1, 1};
  const EngineTableDevice engine{table.get(), 1, context.get(), 1, 16, 0};
  gpu::DeviceBuffer<int32_t> out, used, indices, last, mismatched;
  Upload(std::vector<int32_t>{-9}, out), Upload(std::vector<int32_t>{-9}, used),
      Upload(std::vector<int32_t>{-9}, indices), Upload(std::vector<int32_t>{-9}, last),
      Upload(std::vector<int32_t>{0}, mismatched);
  ASSERT_NO_FATAL_FAILURE(testing::LeaveErrorPending());
  const absl::Status views =
      BuildFlashAttentionViews(lists, engine, out.get(), used.get(), nullptr);
  EXPECT_TRUE(views.ok()) << views;
  EXPECT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation);
  ASSERT_NO_FATAL_FAILURE(testing::LeaveErrorPending());
  const absl::Status fixed = BuildFlashInferFixedBudget(
      lists, engine, indptr.get(), 1, indices.get(), last.get(), mismatched.get(), nullptr);
  EXPECT_TRUE(fixed.ok()) << fixed;
  EXPECT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(Download(out, 1)[0], 7);
  EXPECT_EQ(Download(used, 1)[0], 16);
  EXPECT_EQ(Download(indices, 1)[0], 7);
  EXPECT_EQ(Download(last, 1)[0], 16);
  EXPECT_EQ(Download(mismatched, 1)[0], 0);
}

// A position that joined the batch after the selection a step reuses has a list nobody
// wrote (count 0 in zeroed buffers). It was taken as an empty list: seqused_k 0, the row's
// every token unread, not refused; and it filled a plan of 0 entries. One layer, two
// positions of 3 blocks (35 tokens) and none, both lists empty.
TEST(EngineOutputsDevice, AnEmptyListOfARowWithBlocksIsRefused) {
  if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  gpu::DeviceBuffer<int32_t> blocks, count, table, context, indptr;
  Upload(std::vector<int32_t>(6, 0), blocks), Upload(std::vector<int32_t>{0, 0}, count),
      Upload(std::vector<int32_t>{10, 11, 12, 20, 21, 22}, table),
      Upload(std::vector<int32_t>{35, 0}, context), Upload(std::vector<int32_t>{0, 0, 0}, indptr);
  const VisitListsDevice lists{blocks.get(), count.get(), 1, 2, 1, 3};
  const EngineTableDevice engine{table.get(), 3, context.get(), 2, 16, 0};
  gpu::DeviceBuffer<int32_t> out, used, refused, indices, last, mismatched;
  Upload(std::vector<int32_t>(6, -9), out), Upload(std::vector<int32_t>{-9, -9}, used),
      Upload(std::vector<int32_t>{0}, refused), Upload(std::vector<int32_t>{-9}, indices),
      Upload(std::vector<int32_t>{-9, -9}, last), Upload(std::vector<int32_t>{0}, mismatched);
  ASSERT_TRUE(
      BuildFlashAttentionViews(lists, engine, out.get(), used.get(), nullptr, refused.get()).ok());
  ASSERT_TRUE(BuildFlashInferFixedBudget(lists, engine, indptr.get(), 0, indices.get(), last.get(),
                                         mismatched.get(), nullptr)
                  .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  // The engine's row instead; the empty row's empty list is its own (nothing to read).
  EXPECT_EQ(Download(out, 3), (std::vector<int32_t>{10, 11, 12}));
  EXPECT_EQ(Download(used, 2), (std::vector<int32_t>{35, 0}));
  EXPECT_EQ(Download(refused, 1)[0], 1);
  EXPECT_EQ(Download(mismatched, 1)[0], 1);
}

TEST(EngineOutputsArgs, NullPointersAndBadShapesAreInvalidArgument) {
  int32_t dummy = 0;
  const absl::Status s = BuildFlashAttentionViews(
      {&dummy, &dummy, 0, 1, 1, 1}, {&dummy, 1, &dummy, 1, 16}, &dummy, &dummy, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("layers=0"), std::string::npos) << s;
  const absl::Status t = BuildFlashAttentionViews(
      {&dummy, &dummy, 1, 2, 1, 4}, {&dummy, 4, &dummy, 3, 16}, &dummy, &dummy, nullptr);
  EXPECT_NE(t.message().find("batch=3"), std::string::npos) << t;
}

TEST(EngineOutputsArgs, FixedBudgetBlocksFollowsTheBudgetShape) {
  // 16-token blocks, g = 4: 1000 tokens = 63 blocks = 16 groups, the newest with 3 blocks.
  EXPECT_EQ(*FixedBudgetBlocks(1000, 3, 4, 16), 2 * 4 + 3);
  EXPECT_EQ(*FixedBudgetBlocks(1000, 16, 4, 16), 63);  // every group
  EXPECT_EQ(*FixedBudgetBlocks(1, 3, 4, 16), 1);
  EXPECT_EQ(*FixedBudgetBlocks(0, 3, 4, 16), 0);  // an empty (or negative) context: no blocks
  EXPECT_EQ(*FixedBudgetBlocks(-40, 3, 4, 16), 0);
  EXPECT_EQ(*FixedBudgetIndptr({1000, 1}, 2, 3, 4, 16), (std::vector<int32_t>{0, 11, 22, 23, 24}));
}

// The newest group is kept even at last_n = 0: k = first_n + last_n + top_pages, which the
// docs once gave, planned one group too few and every list then counted as mismatched.
TEST(EngineOutputsArgs, FixedBudgetGroupsCountsTheNewestGroupAndRefusesBadCounts) {
  EXPECT_EQ(*FixedBudgetGroups(1, 2, 8), 11);
  EXPECT_EQ(*FixedBudgetGroups(0, 0, 8), 9);
  for (const auto& [first_n, last_n, top_pages, name] :
       {std::tuple{-1, 2, 8, "first_n=-1"}, std::tuple{1, -2, 8, "last_n=-2"},
        std::tuple{1, 2, 0, "top_pages=0"},
        std::tuple{std::numeric_limits<int>::max(), 1, 1, "exceeds INT_MAX"}}) {
    const absl::StatusOr<int> k = FixedBudgetGroups(first_n, last_n, top_pages);
    EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_NE(k.status().message().find(name), std::string::npos) << k.status();
  }
}

TEST(EngineOutputsArgs, AFixedBudgetPlanNeedsWholeGroupsOfWholeBlocks) {
  // group_blocks 0 once divided by zero (SIGFPE), a budget <= 0 gave negative counts.
  for (const auto& [budget, g, block_size, name] :
       {std::tuple{0, 4, 16, "budget_groups=0"}, std::tuple{-5, 4, 16, "budget_groups=-5"},
        std::tuple{3, 0, 16, "group_blocks=0"}, std::tuple{3, 4, 0, "block_size=0"}}) {
    const absl::StatusOr<int64_t> n = FixedBudgetBlocks(1000, budget, g, block_size);
    EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_NE(n.status().message().find(name), std::string::npos) << n.status();
    const auto indptr = FixedBudgetIndptr({1000, 1000}, 1, budget, g, block_size);
    EXPECT_NE(indptr.status().message().find(name), std::string::npos) << indptr.status();
  }
  EXPECT_NE(FixedBudgetIndptr({1000}, 0, 3, 4, 16).status().message().find("lists=0"),
            std::string::npos);
}

TEST(EngineOutputsArgs, AFixedBudgetPlanPastInt32IsRefused) {
  // 70 contexts of 2^31 tokens in 8 lists once wrapped indptr to negative offsets.
  const auto indptr =
      FixedBudgetIndptr(std::vector<int64_t>(70, int64_t{1} << 31), 8, 1 << 30, 1, 1);
  EXPECT_EQ(indptr.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(indptr.status().message().find("exceeds 2^31-1 entries"), std::string::npos)
      << indptr.status();
  EXPECT_TRUE(
      FixedBudgetIndptr(std::vector<int64_t>(1, (int64_t{1} << 31) - 1), 1, 1 << 30, 1, 1).ok());
}

// A plan for lists reused from an earlier selection: that selection's list and the blocks
// written since. By hand, k = 2 groups of g = 2 blocks of 16 tokens: selected at 60 tokens
// (4 blocks, 2 groups: all 4), now 100 (7 blocks): 4 + 3 = 7 entries, where a plan at 100
// alone has 2 + 1 = 3 (the selection's list would not fit it).
TEST(EngineOutputsArgs, AFixedBudgetPlanForReusedListsCountsTheBlocksWrittenSince) {
  EXPECT_EQ(*FixedBudgetIndptr({100, 40}, 1, 2, 2, 16, {60, 40}), (std::vector<int32_t>{0, 7, 10}));
  EXPECT_EQ(*FixedBudgetIndptr({100, 40}, 1, 2, 2, 16), (std::vector<int32_t>{0, 3, 6}));
  const absl::Status later = FixedBudgetIndptr({100}, 1, 2, 2, 16, {101}).status();
  EXPECT_EQ(later.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(later.message().find("selected_context_tokens[0]=101 exceeds context_tokens[0]=100"),
            std::string::npos)
      << later;
  EXPECT_EQ(FixedBudgetIndptr({100, 40}, 1, 2, 2, 16, {60}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace eps::client
