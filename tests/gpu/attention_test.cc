// The CUDA kernels of libeps_attention.so against the float64 reference
// (eps_attn_reference_host) on fresh random problems; skips without a device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gpu/attention/paged_attention.h"
#include "tests/gpu/attention_case.h"
#include "tests/gpu/attention_device.h"

namespace eps::attention {
namespace {

using testing::AttentionCase;
using testing::CaseShape;
using testing::FromBits;
using testing::GpuResult;
using testing::RunOnDevice;

// Compares with the reference. With u the unit roundoff of the dtype (bf16 2^-8, fp16
// 2^-11): rounding the output costs u·|out|, and warp_mma also rounds the probabilities
// to the dtype before P·V (as FlashAttention does), which moves a weighted mean of
// values |v| <= 1 (attention_case.h) by at most u·max|v| = u, since the sum it divides
// by stays in float32. So every variant is within u·(1 + |ref|) plus float32
// accumulation; the tolerances are 3u (bf16: 1.2e-2) and 4u (fp16: 2e-3) of that scale.
// lse is float32 in every variant (no 16-bit probability enters it).
// Reports (up to 5) outputs and lse of `r` outside the tolerances below; returns how many.
int CountMismatches(const GpuResult& r, const std::vector<double>& ref_out,
                    const std::vector<double>& ref_lse, int32_t dtype, uint32_t seed) {
  const double tol = dtype == EPS_ATTN_BF16 ? 1.2e-2 : 2e-3;
  int bad = 0;
  for (size_t i = 0; i < ref_out.size() && bad < 5; ++i) {
    const double got = FromBits(r.out[i], dtype);
    if (!(std::abs(got - ref_out[i]) <= tol * (1.0 + std::abs(ref_out[i])))) {
      ADD_FAILURE() << "seed " << seed << " out[" << i << "] = " << got << ", reference "
                    << ref_out[i];
      ++bad;
    }
  }
  for (size_t i = 0; i < ref_lse.size() && bad < 5; ++i) {
    if (!(std::abs(r.lse[i] - ref_lse[i]) <= 2e-3 * (1.0 + std::abs(ref_lse[i])))) {
      ADD_FAILURE() << "seed " << seed << " lse[" << i << "] = " << r.lse[i] << ", reference "
                    << ref_lse[i];
      ++bad;
    }
  }
  return bad;
}

void ExpectMatchesReference(const AttentionCase& c, uint32_t seed) {
  std::vector<double> ref_out(c.OutElements()), ref_lse(c.LseElements());
  std::vector<double> ref_feedback(c.feedback.begin(), c.feedback.end());
  ASSERT_EQ(eps_attn_reference_host(&c.params, ref_out.data(), ref_lse.data(),
                                    c.feedback_group_blocks ? ref_feedback.data() : nullptr),
            EPS_ATTN_OK)
      << eps_attn_last_error();
  const GpuResult r = RunOnDevice(c);
  ASSERT_EQ(r.code, EPS_ATTN_OK) << r.message;
  ASSERT_EQ(r.list_code, EPS_ATTN_OK) << r.message;
  int bad = CountMismatches(r, ref_out, ref_lse, c.shape.dtype, seed);
  // Feedback: the same entries written (NaN where no list visits), each a float32
  // log-sum-exp like lse.
  ASSERT_EQ(r.feedback.size(), c.feedback_group_blocks ? ref_feedback.size() : 0);
  int written = 0;
  for (size_t i = 0; i < r.feedback.size() && bad < 5; ++i) {
    written += !std::isnan(ref_feedback[i]);
    const bool same = std::isnan(ref_feedback[i]) ? std::isnan(r.feedback[i])
                                                  : std::abs(r.feedback[i] - ref_feedback[i]) <=
                                                        2e-3 * (1.0 + std::abs(ref_feedback[i]));
    if (!same) {
      ADD_FAILURE() << "seed " << seed << " feedback[" << i << "] = " << r.feedback[i]
                    << ", reference " << ref_feedback[i];
      ++bad;
    }
  }
  if (c.feedback_group_blocks) {
    EXPECT_GT(written, 0) << "no feedback entry was written";
  }
}

uint32_t FreshSeed() { return std::random_device{}(); }

TEST(PagedAttention, MatchesReferenceForEveryDtypeHeadDimAndGqaRatio) {
  SKIP_WITHOUT_DEVICE();
  for (int32_t dtype : {EPS_ATTN_BF16, EPS_ATTN_FP16}) {
    for (int d : {64, 128, 256}) {
      for (int gqa : {1, 4, 8}) {
        CaseShape s;
        s.dtype = dtype;
        s.head_dim = d;
        s.num_kv_heads = 2;
        s.num_q_heads = 2 * gqa;
        const uint32_t seed = FreshSeed();
        SCOPED_TRACE("dtype " + std::to_string(dtype) + " d " + std::to_string(d) + " gqa " +
                     std::to_string(gqa) + " seed " + std::to_string(seed));
        ExpectMatchesReference(AttentionCase(s, seed), seed);
      }
    }
  }
}

TEST(PagedAttention, OneBlockOneTokenAndPartialLastBlocks) {
  SKIP_WITHOUT_DEVICE();
  CaseShape s;
  s.batch = 6;
  s.contexts = {1, 16, 17, 15, 33, 31};
  s.keep = 1.0;
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  ExpectMatchesReference(AttentionCase(s, seed), seed);
}

TEST(PagedAttention, PerKvHeadListsMatchReference) {
  SKIP_WITHOUT_DEVICE();
  CaseShape s;
  s.per_head_lists = true;
  s.num_kv_heads = 4;
  s.num_q_heads = 16;
  s.keep = 0.3;
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  ExpectMatchesReference(AttentionCase(s, seed), seed);
}

TEST(PagedAttention, GqaRatiosOfAnySizeMatchReference) {
  SKIP_WITHOUT_DEVICE();
  for (int gqa : {2, 3, 5, 12, 16}) {
    CaseShape s;
    s.num_kv_heads = 2;
    s.num_q_heads = 2 * gqa;
    const uint32_t seed = FreshSeed();
    SCOPED_TRACE("gqa " + std::to_string(gqa) + " seed " + std::to_string(seed));
    ExpectMatchesReference(AttentionCase(s, seed), seed);
  }
}

TEST(PagedAttention, EverySplitCountMatchesReference) {
  SKIP_WITHOUT_DEVICE();
  for (int splits : {1, 2, 7, 300}) {
    CaseShape s;
    s.batch = 2;
    s.contexts = {4000, 777};
    s.num_splits = splits;
    const uint32_t seed = FreshSeed();
    SCOPED_TRACE("splits " + std::to_string(splits) + " seed " + std::to_string(seed));
    ExpectMatchesReference(AttentionCase(s, seed), seed);
  }
}

// The split count follows the list width and each row's chunk its count on the device:
// rows far shorter than the buffer (epsd's full-width visit_blocks) must still cover
// exactly their own blocks, whatever the count, next to a row as long as the width.
TEST(PagedAttention, ShortListsInAWideBufferMatchReference) {
  SKIP_WITHOUT_DEVICE();
  for (int splits : {0, 5}) {
    CaseShape s;
    s.batch = 4;
    s.contexts = {20000, 17, 300, 2500};
    s.keep = 0.125;
    s.num_splits = splits;
    const uint32_t seed = FreshSeed();
    SCOPED_TRACE("splits " + std::to_string(splits) + " seed " + std::to_string(seed));
    ExpectMatchesReference(AttentionCase(s, seed), seed);
  }
}

TEST(PagedAttention, SoftcapAndScaleMatchReference) {
  SKIP_WITHOUT_DEVICE();
  CaseShape s;
  s.softcap = 5.0f;
  s.softmax_scale = 0.5f;  // large scores, so the cap bites
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  ExpectMatchesReference(AttentionCase(s, seed), seed);
}

TEST(PagedAttention, VisitCountsWithDenseFallbackMatchReference) {
  SKIP_WITHOUT_DEVICE();
  for (bool per_head : {false, true}) {
    CaseShape s;
    s.batch = 4;
    s.length_kind = EPS_ATTN_VISIT_COUNT;
    s.per_head_lists = per_head;
    const uint32_t seed = FreshSeed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    AttentionCase c(s, seed);
    c.lengths[1 * s.num_kv_heads + 0] = -1;  // epsd's "attend densely" marker
    if (!per_head) c.lengths[1 * s.num_kv_heads + 1] = -1;
    ExpectMatchesReference(c, seed);
  }
}

// Selection feedback: every variant's shape, group sizes that split and do not split
// blocks across units, per-KV-head lists, visit counts with a dense fallback row.
TEST(PagedAttention, FeedbackMatchesReference) {
  SKIP_WITHOUT_DEVICE();
  for (int32_t dtype : {EPS_ATTN_BF16, EPS_ATTN_FP16}) {
    for (int d : {64, 128, 256}) {
      for (int g : {1, 2, 8}) {
        CaseShape s;
        s.dtype = dtype;
        s.head_dim = d;
        s.num_q_heads = g == 2 ? 6 : 16;  // gqa 3 and 8
        s.num_splits = g == 8 ? 3 : 0;    // an 8-block group across splits
        const uint32_t seed = FreshSeed();
        SCOPED_TRACE("dtype " + std::to_string(dtype) + " d " + std::to_string(d) + " g " +
                     std::to_string(g) + " seed " + std::to_string(seed));
        AttentionCase c(s, seed);
        c.EnableFeedback(g);
        ExpectMatchesReference(c, seed);
      }
    }
  }
  for (bool per_head : {false, true}) {
    CaseShape s;
    s.batch = 4;
    s.length_kind = EPS_ATTN_VISIT_COUNT;
    s.per_head_lists = per_head;
    s.softcap = 5.0f;
    const uint32_t seed = FreshSeed();
    SCOPED_TRACE("per_head " + std::to_string(per_head) + " seed " + std::to_string(seed));
    AttentionCase c(s, seed);
    c.lengths[1 * s.num_kv_heads + 0] = -1;  // row 1 (KV head 0): dense, every group
    if (!per_head) c.lengths[1 * s.num_kv_heads + 1] = -1;
    c.EnableFeedback(2);
    ExpectMatchesReference(c, seed);
  }
}

// An entry that already holds a value is combined with the step's (log-add-exp), and
// a bad position or table row is reported while the attention output stays right.
TEST(PagedAttention, FeedbackCombinesAndReportsBadPositions) {
  SKIP_WITHOUT_DEVICE();
  CaseShape s;
  s.batch = 2;
  s.contexts = {700, 900};
  s.keep = 1.0;
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  AttentionCase c(s, seed);
  c.EnableFeedback(1);
  const size_t first = static_cast<size_t>(c.feedback_rows[0]) * s.num_q_heads * c.FeedbackGroups();
  c.feedback[first] = 3.0f;  // (row 0, head 0, group 0) holds a value already
  ExpectMatchesReference(c, seed);

  AttentionCase bad(s, seed);
  bad.EnableFeedback(1);
  bad.positions[bad.lists[bad.max_blocks + 2]] = bad.FeedbackGroups();  // row 1, entry 2
  const GpuResult r = RunOnDevice(bad);
  ASSERT_EQ(r.code, EPS_ATTN_OK) << r.message;
  EXPECT_EQ(r.list_code, EPS_ATTN_ELIST);
  EXPECT_NE(
      r.message.find("block_positions gives position " + std::to_string(bad.FeedbackGroups())),
      std::string::npos)
      << r.message;
  AttentionCase good(s, seed);
  good.EnableFeedback(1);
  const GpuResult ok = RunOnDevice(good);
  EXPECT_EQ(ok.out, r.out);  // the output does not depend on the feedback entries
  EXPECT_EQ(ok.lse, r.lse);

  AttentionCase bad_row(s, seed);
  bad_row.EnableFeedback(1);
  bad_row.feedback_rows[1] = bad_row.FeedbackSeqs();
  const GpuResult rr = RunOnDevice(bad_row);
  EXPECT_EQ(rr.list_code, EPS_ATTN_ELIST);
  EXPECT_NE(rr.message.find("feedback_rows gives table row"), std::string::npos) << rr.message;
}

TEST(PagedAttention, BlockPositionsFromATable) {
  SKIP_WITHOUT_DEVICE();
  CaseShape s;
  s.batch = 5;
  const uint32_t seed = FreshSeed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  AttentionCase c(s, seed);
  c.EnableFeedback(1);  // its positions are the expected result
  testing::DeviceArray<int32_t> table(c.table), context(c.context);
  testing::DeviceArray<int32_t> positions(std::vector<int32_t>(c.num_blocks, -9));
  ASSERT_EQ(eps_attn_block_positions(table.ptr, c.max_blocks, c.max_blocks, context.ptr, s.batch,
                                     16, c.num_blocks, positions.ptr, nullptr),
            EPS_ATTN_OK)
      << eps_attn_last_error();
  EXPECT_EQ(positions.Read(c.num_blocks), c.positions);
  EXPECT_EQ(eps_attn_block_positions(table.ptr, 4, c.max_blocks, context.ptr, s.batch, 16,
                                     c.num_blocks, positions.ptr, nullptr),
            EPS_ATTN_EINVAL);
}

TEST(PagedAttention, EmptyRowIsReportedAndWrittenAsZeros) {
  SKIP_WITHOUT_DEVICE();
  for (int splits : {1, 4}) {
    CaseShape s;
    s.batch = 3;
    s.num_splits = splits;
    s.contexts = {500, 600, 700};
    AttentionCase c(s, FreshSeed());
    c.lengths[1 * s.num_kv_heads + 0] = 0;
    c.lengths[1 * s.num_kv_heads + 1] = 0;
    const GpuResult r = RunOnDevice(c);
    ASSERT_EQ(r.code, EPS_ATTN_OK) << r.message;
    EXPECT_EQ(r.list_code, EPS_ATTN_ELIST);
    // Both heads of row 1 are empty; whichever CTA records first is named.
    EXPECT_NE(r.message.find("row 1 KV head "), std::string::npos) << r.message;
    EXPECT_NE(r.message.find("empty list"), std::string::npos) << r.message;
    const size_t row = static_cast<size_t>(s.num_q_heads) * s.head_dim;
    for (size_t i = 0; i < r.out.size(); ++i) {
      const double x = FromBits(r.out[i], s.dtype);
      ASSERT_TRUE(std::isfinite(x)) << "out[" << i << "]";
      if (i / row == 1) {
        ASSERT_EQ(x, 0.0) << "out[" << i << "]";
      }
    }
    for (int h = 0; h < s.num_q_heads; ++h) EXPECT_EQ(r.lse[s.num_q_heads + h], -INFINITY);
    EXPECT_TRUE(std::isfinite(r.lse[0]));
  }
}

TEST(PagedAttention, BlockIdOutOfRangeIsReportedAndNeverRead) {
  SKIP_WITHOUT_DEVICE();
  CaseShape s;
  s.batch = 2;
  s.contexts = {300, 300};
  s.keep = 1.0;
  AttentionCase c(s, FreshSeed());
  c.lists[c.max_blocks + 3] = c.num_blocks + 100000;
  const GpuResult r = RunOnDevice(c);
  ASSERT_EQ(r.code, EPS_ATTN_OK) << r.message;
  EXPECT_EQ(r.list_code, EPS_ATTN_ELIST);
  EXPECT_NE(r.message.find("block id " + std::to_string(c.num_blocks + 100000)), std::string::npos)
      << r.message;
  for (uint16_t bits : r.out) ASSERT_TRUE(std::isfinite(FromBits(bits, s.dtype)));
}

// A block id outside the cache is recorded and skipped, never read: its row attends over
// its other blocks (docs/benchmarks/attention.md), with one split or several.
TEST(PagedAttention, ABadBlockIdIsSkippedAndItsRowAttendsOverItsOtherBlocks) {
  SKIP_WITHOUT_DEVICE();
  for (int splits : {1, 3}) {
    CaseShape s;
    s.batch = 2;
    s.contexts = {300, 300};
    s.keep = 1.0;
    s.num_splits = splits;
    const uint32_t seed = FreshSeed();
    AttentionCase c(s, seed);
    AttentionCase without(s, seed);  // the same data; row 1 without its (full) block 3
    const auto row1 = static_cast<ptrdiff_t>(c.max_blocks);  // lists: [batch, max_blocks]
    c.lists[row1 + 3] = -5;
    std::copy(without.lists.begin() + row1 + 4, without.lists.begin() + 2 * row1,
              without.lists.begin() + row1 + 3);
    without.lists[2 * row1 - 1] = -7;
    without.lengths[1 * s.num_kv_heads] -= 16;
    std::vector<double> ref_out(without.OutElements()), ref_lse(without.LseElements());
    ASSERT_EQ(eps_attn_reference_host(&without.params, ref_out.data(), ref_lse.data(), nullptr),
              EPS_ATTN_OK)
        << eps_attn_last_error();
    const GpuResult r = RunOnDevice(c);
    ASSERT_EQ(r.code, EPS_ATTN_OK) << r.message;
    EXPECT_EQ(r.list_code, EPS_ATTN_ELIST);
    // Both KV heads read the row's one list: whichever records first is named.
    EXPECT_NE(r.message.find("row 1 KV head "), std::string::npos) << r.message;
    EXPECT_NE(r.message.find(": block id -5 not in"), std::string::npos) << r.message;
    EXPECT_EQ(CountMismatches(r, ref_out, ref_lse, s.dtype, seed), 0) << "splits " << splits;
  }
}

// A visit count above the sequence's blocks would read tokens past its end as its own:
// recorded, and the row written as an empty one.
TEST(PagedAttention, AVisitCountAboveTheSequencesBlocksIsReportedAndWrittenAsZeros) {
  SKIP_WITHOUT_DEVICE();
  CaseShape s;
  s.batch = 2;
  s.contexts = {20, 300};
  s.keep = 1.0;
  s.length_kind = EPS_ATTN_VISIT_COUNT;
  AttentionCase c(s, FreshSeed());
  c.lengths[0] = 3;                    // row 0 has 2 blocks
  c.lists[2] = c.table[c.max_blocks];  // a valid id (row 1's first block)
  const GpuResult r = RunOnDevice(c);
  ASSERT_EQ(r.code, EPS_ATTN_OK) << r.message;
  EXPECT_EQ(r.list_code, EPS_ATTN_ELIST);
  EXPECT_NE(r.message.find("visit_count 3 exceeds the blocks of its sequence"), std::string::npos)
      << r.message;
  const size_t row = static_cast<size_t>(s.num_q_heads) * s.head_dim;
  for (size_t i = 0; i < row; ++i) ASSERT_EQ(FromBits(r.out[i], s.dtype), 0.0) << i;
  for (int h = 0; h < s.num_q_heads; ++h) {
    EXPECT_EQ(r.lse[h], -INFINITY);
    EXPECT_TRUE(std::isfinite(r.lse[s.num_q_heads + h]));
  }
}

TEST(PagedAttention, ErrorWordIsClearedByReading) {
  SKIP_WITHOUT_DEVICE();
  int32_t* word = nullptr;
  CUDA_OK(cudaMalloc(&word, EPS_ATTN_ERROR_WORDS * sizeof(int32_t)));
  const int32_t bad[EPS_ATTN_ERROR_WORDS] = {1, 2, 0, 0};
  CUDA_OK(cudaMemcpy(word, bad, sizeof(bad), cudaMemcpyHostToDevice));
  EXPECT_EQ(eps_attn_read_error(word, nullptr, 1), EPS_ATTN_ELIST);
  EXPECT_EQ(eps_attn_read_error(word, nullptr, 1), EPS_ATTN_OK) << eps_attn_last_error();
  CUDA_OK(cudaFree(word));
}

TEST(PagedAttention, MisalignedCacheIsRefusedBeforeLaunch) {
  // No device needed: arguments are checked before any CUDA call.
  AttentionCase c(CaseShape{}, 1);
  EpsAttnParams p = c.params;
  p.k_cache = static_cast<const char*>(p.k_cache) + 2;
  p.out = c.q.data();
  EXPECT_EQ(eps_attn_paged_decode(&p, nullptr), EPS_ATTN_EINVAL);
  EXPECT_NE(std::string(eps_attn_last_error()).find("k_cache is not 16-byte aligned"),
            std::string::npos)
      << eps_attn_last_error();
}

}  // namespace
}  // namespace eps::attention
