// The float64 reference (eps_attn_reference_host) and the argument checks of the
// attention C ABI: plain C++, run by CI without a device. The GPU test compares the
// kernels with this reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gpu/attention/paged_attention.h"
#include "gpu/attention/params_check.h"
#include "tests/gpu/attention_case.h"

namespace eps::attention {
namespace {

using testing::AttentionCase;
using testing::CaseShape;
using testing::FromBits;
using testing::ToBits;

struct Result {
  int32_t code;
  std::string message;
  std::vector<double> out, lse;
};

Result Reference(const AttentionCase& c) {
  Result r{0, "", std::vector<double>(c.OutElements()), std::vector<double>(c.LseElements())};
  r.code = eps_attn_reference_host(&c.params, r.out.data(), r.lse.data(), nullptr);
  r.message = eps_attn_last_error();
  return r;
}

uint32_t FreshSeed() { return std::random_device{}(); }

TEST(AttentionReference, OneTokenReturnsItsValueRowAndScore) {
  CaseShape s;
  s.batch = 1;
  s.contexts = {1};
  s.num_q_heads = s.num_kv_heads = 1;
  AttentionCase c(s, FreshSeed());
  const Result r = Reference(c);
  ASSERT_EQ(r.code, EPS_ATTN_OK) << r.message;
  const int32_t id = c.lists[0];
  const size_t v_row = ((static_cast<size_t>(c.num_blocks) + id) * 16) * s.head_dim;
  double dot = 0;
  for (int e = 0; e < s.head_dim; ++e) {
    EXPECT_EQ(r.out[e], FromBits(c.kv[v_row + e], s.dtype));
    dot += FromBits(c.q[e], s.dtype) *
           FromBits(c.kv[static_cast<size_t>(id) * 16 * s.head_dim + e], s.dtype);
  }
  EXPECT_NEAR(r.lse[0], dot * c.params.softmax_scale, 1e-12);
}

TEST(AttentionReference, EqualKeysAverageTheValues) {
  CaseShape s;
  s.batch = 1;
  s.contexts = {40};
  s.keep = 1.0;
  s.num_q_heads = s.num_kv_heads = 1;
  AttentionCase c(s, FreshSeed());
  std::vector<double> mean(s.head_dim, 0.0);
  for (int t = 0; t < 40; ++t) {
    const size_t k_row =
        (size_t{static_cast<uint32_t>(c.lists[t / 16])} * 16 + t % 16) * s.head_dim;
    const size_t v_row = k_row + c.kv.size() / 2;
    for (int e = 0; e < s.head_dim; ++e) {
      c.kv[k_row + e] = ToBits(0.25f, s.dtype);
      mean[e] += FromBits(c.kv[v_row + e], s.dtype) / 40;
    }
  }
  const Result r = Reference(c);
  ASSERT_EQ(r.code, EPS_ATTN_OK) << r.message;
  for (int e = 0; e < s.head_dim; ++e) EXPECT_NEAR(r.out[e], mean[e], 1e-12);
}

TEST(AttentionReference, ReadsOnlyListedBlocksAndTokens) {
  // Unlisted blocks and slots past each row's tokens hold NaN (attention_case.h).
  for (bool per_head : {false, true}) {
    CaseShape s;
    s.per_head_lists = per_head;
    s.keep = 0.4;
    const uint32_t seed = FreshSeed();
    const Result r = Reference(AttentionCase(s, seed));
    ASSERT_EQ(r.code, EPS_ATTN_OK) << r.message;
    for (double x : r.out) ASSERT_TRUE(std::isfinite(x)) << "seed " << seed;
  }
}

TEST(AttentionReference, VisitCountsEqualTheirSequsedTokensAndMinusOneIsDense) {
  CaseShape s;
  s.batch = 4;
  s.length_kind = EPS_ATTN_VISIT_COUNT;
  const uint32_t seed = FreshSeed();
  AttentionCase counts(s, seed);
  s.length_kind = EPS_ATTN_SEQUSED_TOKENS;
  AttentionCase tokens(s, seed);  // same data and lists, lengths in tokens
  EXPECT_EQ(Reference(counts).out, Reference(tokens).out) << "seed " << seed;

  // Row 2 marked -1 reads its whole block table, as a dense seqused list does.
  for (int h = 0; h < s.num_kv_heads; ++h) counts.lengths[2 * s.num_kv_heads + h] = -1;
  for (int j = 0; j < tokens.max_blocks; ++j) {
    tokens.lists[2 * tokens.max_blocks + j] = tokens.table[2 * tokens.max_blocks + j];
  }
  for (int h = 0; h < s.num_kv_heads; ++h) {
    tokens.lengths[2 * s.num_kv_heads + h] = tokens.context[2];
  }
  EXPECT_EQ(Reference(counts).out, Reference(tokens).out) << "seed " << seed;
}

TEST(AttentionReference, SoftcapBoundsEveryScore) {
  CaseShape s;
  s.softcap = 2.0f;
  s.softmax_scale = 10.0f;
  AttentionCase c(s, FreshSeed());
  const Result r = Reference(c);
  ASSERT_EQ(r.code, EPS_ATTN_OK) << r.message;
  for (int b = 0; b < s.batch; ++b) {
    for (int h = 0; h < s.num_q_heads; ++h) {
      const double n = c.lengths[b * s.num_kv_heads + h / (s.num_q_heads / s.num_kv_heads)];
      EXPECT_LE(r.lse[b * s.num_q_heads + h], 2.0 + std::log(n) + 1e-9);
      EXPECT_GE(r.lse[b * s.num_q_heads + h], -2.0 + std::log(n) - 1e-9);
    }
  }
}

TEST(AttentionReference, EmptyRowIsAnErrorNamingRowAndHead) {
  AttentionCase c(CaseShape{}, FreshSeed());
  c.lengths[1 * c.shape.num_kv_heads + 0] = 0;
  const Result r = Reference(c);
  EXPECT_EQ(r.code, EPS_ATTN_ELIST);
  EXPECT_NE(r.message.find("row 1 KV head 0"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("an empty list"), std::string::npos) << r.message;
}

TEST(AttentionReference, ListLongerThanItsRowIsAnError) {
  AttentionCase c(CaseShape{}, FreshSeed());
  c.lengths[0] = c.max_blocks * 16 + 1;
  const Result r = Reference(c);
  EXPECT_EQ(r.code, EPS_ATTN_ELIST);
  EXPECT_NE(r.message.find("more than its row holds"), std::string::npos) << r.message;
}

TEST(AttentionReference, BlockIdOutOfRangeIsAnError) {
  CaseShape s;
  s.keep = 1.0;
  AttentionCase c(s, FreshSeed());
  c.lists[0] = -3;
  const Result r = Reference(c);
  EXPECT_EQ(r.code, EPS_ATTN_ELIST);
  EXPECT_NE(r.message.find("block id -3 not in [0, num_blocks)"), std::string::npos) << r.message;
}

TEST(AttentionReference, VisitCountAboveTheSequencesBlocksIsAnError) {
  // A count of 4 for a 20-token sequence (2 blocks) read tokens past its end as its own.
  CaseShape s;
  s.batch = 1;
  s.contexts = {20};
  s.keep = 1.0;
  s.length_kind = EPS_ATTN_VISIT_COUNT;
  AttentionCase c(s, FreshSeed());
  ASSERT_EQ(c.lengths[0], 2);
  c.lengths[0] = 3;
  const Result r = Reference(c);
  EXPECT_EQ(r.code, EPS_ATTN_ELIST);
  EXPECT_NE(r.message.find("row 0 KV head 0: visit_count 3 exceeds the blocks of its sequence"),
            std::string::npos)
      << r.message;
}

TEST(AttentionReference, AHeadWhoseEveryScoreIsMinusInfinityGivesZerosAndMinusInfinityLse) {
  // As the kernels write it (the reference gave NaN: exp(-inf - -inf)).
  CaseShape s;
  s.batch = 2;
  s.contexts = {20, 20};
  s.keep = 1.0;
  s.num_q_heads = s.num_kv_heads = 1;
  s.dtype = EPS_ATTN_FP16;
  AttentionCase c(s, FreshSeed());
  const int d = s.head_dim;
  for (int e = 0; e < d; ++e) c.q[e] = ToBits(1.0f, s.dtype);  // row 0's query
  for (int j = 0; j < 2; ++j) {                                // every key of row 0's blocks: -inf
    const size_t block = static_cast<size_t>(c.lists[j]);
    for (size_t i = block * 16 * d; i < (block + 1) * 16 * d; ++i) c.kv[i] = 0xFC00;
  }
  const Result r = Reference(c);
  ASSERT_EQ(r.code, EPS_ATTN_OK) << r.message;
  for (int e = 0; e < d; ++e) ASSERT_EQ(r.out[e], 0.0) << e;
  EXPECT_EQ(r.lse[0], -INFINITY);
  EXPECT_TRUE(std::isfinite(r.lse[1]));  // row 1 is untouched
}

std::vector<double> ReferenceFeedback(const AttentionCase& c, int32_t* code = nullptr) {
  std::vector<double> out(c.OutElements()), lse(c.LseElements());
  std::vector<double> feedback(c.feedback.begin(), c.feedback.end());
  const int32_t rc = eps_attn_reference_host(&c.params, out.data(), lse.data(), feedback.data());
  if (code != nullptr) {
    *code = rc;
  } else {
    EXPECT_EQ(rc, EPS_ATTN_OK) << eps_attn_last_error();
  }
  return feedback;
}

// One group holding every block: each head's entry is the row's lse; table rows no
// batch row maps to stay NaN.
TEST(AttentionReference, FeedbackOfOneWholeGroupIsTheRowsLse) {
  CaseShape s;
  s.batch = 3;
  s.keep = 0.6;
  const uint32_t seed = FreshSeed();
  AttentionCase c(s, seed);
  c.EnableFeedback(c.max_blocks);
  ASSERT_EQ(c.FeedbackGroups(), 1);
  const Result r = Reference(c);
  const std::vector<double> feedback = ReferenceFeedback(c);
  for (int row = 0; row < c.FeedbackSeqs(); ++row) {
    for (int h = 0; h < s.num_q_heads; ++h) {
      const double got = feedback[static_cast<size_t>(row) * s.num_q_heads + h];
      const int b = c.FeedbackSeqs() - 1 - row;
      if (b >= s.batch) {
        EXPECT_TRUE(std::isnan(got)) << "table row " << row << " was written";
      } else {
        EXPECT_NEAR(got, r.lse[static_cast<size_t>(b) * s.num_q_heads + h], 1e-9)
            << "seed " << seed << " row " << b << " head " << h;
      }
    }
  }
}

// g = 1: a listed block's entry is the log-sum-exp of its tokens' scores, computed here
// from the data; unlisted blocks stay NaN.
TEST(AttentionReference, FeedbackOfABlockIsItsTokensLogSumExp) {
  CaseShape s;
  s.batch = 1;
  s.contexts = {150};
  s.num_q_heads = s.num_kv_heads = 1;
  s.keep = 0.5;
  const uint32_t seed = FreshSeed();
  AttentionCase c(s, seed);
  c.EnableFeedback(1);
  const std::vector<double> feedback = ReferenceFeedback(c);
  const size_t base = static_cast<size_t>(c.feedback_rows[0]) * c.FeedbackGroups();
  int listed = 0;
  for (int j = 0; j < c.max_blocks; ++j) {
    const int32_t id = c.table[j];
    const bool in_list = std::find(c.lists.begin(), c.lists.begin() + c.max_blocks, id) !=
                         c.lists.begin() + c.max_blocks;
    if (!in_list) {
      EXPECT_TRUE(std::isnan(feedback[base + j])) << "block " << j;
      continue;
    }
    ++listed;
    double sum = 0.0;
    for (int t = 0; t < std::min(16, 150 - 16 * j); ++t) {
      double dot = 0.0;
      for (int e = 0; e < s.head_dim; ++e) {
        dot += FromBits(c.q[e], s.dtype) *
               FromBits(c.kv[(static_cast<size_t>(id) * 16 + t) * s.head_dim + e], s.dtype);
      }
      sum += std::exp(dot * c.params.softmax_scale);
    }
    EXPECT_NEAR(feedback[base + j], std::log(sum), 1e-9) << "seed " << seed << " block " << j;
  }
  EXPECT_GT(listed, 0);
}

// A value already in an entry is log-add-exp'ed with the step's.
TEST(AttentionReference, FeedbackCombinesWithAnEntrysValue) {
  CaseShape s;
  s.batch = 1;
  s.contexts = {40};
  s.num_q_heads = s.num_kv_heads = 1;
  s.keep = 1.0;
  AttentionCase c(s, FreshSeed());
  c.EnableFeedback(1);
  const size_t entry = static_cast<size_t>(c.feedback_rows[0]) * c.FeedbackGroups() + 1;
  const double fresh = ReferenceFeedback(c)[entry];
  c.feedback[entry] = 1.5f;
  EXPECT_NEAR(ReferenceFeedback(c)[entry], std::log(std::exp(fresh) + std::exp(1.5)), 1e-9);
}

TEST(AttentionReference, FeedbackPositionOrRowOutOfRangeIsAnError) {
  CaseShape s;
  s.batch = 2;
  s.keep = 1.0;
  AttentionCase c(s, FreshSeed());
  c.EnableFeedback(2);
  c.positions[c.lists[0]] = 2 * c.FeedbackGroups();
  int32_t code = 0;
  ReferenceFeedback(c, &code);
  EXPECT_EQ(code, EPS_ATTN_ELIST);
  EXPECT_NE(std::string(eps_attn_last_error()).find("block_positions gives position"),
            std::string::npos)
      << eps_attn_last_error();
  AttentionCase d(s, FreshSeed());
  d.EnableFeedback(2);
  d.feedback_rows[1] = -1;
  ReferenceFeedback(d, &code);
  EXPECT_EQ(code, EPS_ATTN_ELIST);
  EXPECT_NE(std::string(eps_attn_last_error()).find("feedback_rows gives table row -1"),
            std::string::npos)
      << eps_attn_last_error();
}

TEST(AttentionParams, ValidParamsPass) {
  AttentionCase c(CaseShape{}, 1);
  EpsAttnParams p = c.params;
  p.out = c.q.data();
  EXPECT_EQ(CheckParams(p, true), "");
}

// Sets a feedback buffer of 4 table rows and 10 groups (block_positions left NULL) with
// these group size and strides.
std::function<void(EpsAttnParams&)> Feedback(int32_t group_blocks, int64_t stride_head,
                                             int64_t stride_row) {
  return [=](EpsAttnParams& p) {
    p.feedback = reinterpret_cast<float*>(p.out);
    p.feedback_seqs = 4;
    p.feedback_groups = 10;
    p.feedback_group_blocks = group_blocks;
    p.feedback_stride_head = stride_head;
    p.feedback_stride_row = stride_row;
  };
}

TEST(AttentionParams, EachInvalidFieldIsNamedWithItsValue) {
  AttentionCase c(CaseShape{}, 1);
  const std::vector<std::pair<std::function<void(EpsAttnParams&)>, std::string>> cases = {
      {[](EpsAttnParams& p) { p.struct_size = 8; }, "struct_size=8"},
      {[](EpsAttnParams& p) { p.dtype = 0; }, "dtype=0"},
      {[](EpsAttnParams& p) { p.batch = 0; }, "batch=0 not in"},
      {[](EpsAttnParams& p) { p.num_q_heads = 7; }, "num_q_heads=7 is not a multiple"},
      {[](EpsAttnParams& p) { p.head_dim = 96; }, "head_dim=96 not in {64, 128, 256}"},
      {[](EpsAttnParams& p) { p.block_size = 32; }, "block_size=32 must be 16"},
      {[](EpsAttnParams& p) { p.length_kind = 5; }, "length_kind=5"},
      {[](EpsAttnParams& p) { p.softmax_scale = -1; }, "softmax_scale=-1"},
      {[](EpsAttnParams& p) { p.softcap = NAN; }, "softcap=nan"},
      {[](EpsAttnParams& p) { p.num_splits = -2; }, "num_splits=-2"},
      {[](EpsAttnParams& p) { p.kv_stride_token = 100; }, "kv_stride_token=100"},
      {[](EpsAttnParams& p) { p.q_stride_head = -8; }, "q_stride_head=-8"},
      {[](EpsAttnParams& p) { p.max_list_blocks = 0; }, "max_list_blocks=0"},
      {[](EpsAttnParams& p) { p.lists = nullptr; }, "lists is NULL"},
      {[](EpsAttnParams& p) { p.out = nullptr; }, "out is NULL"},
      {[](EpsAttnParams& p) { p.q = static_cast<const char*>(p.q) + 8; },
       "q is not 16-byte aligned"},
      {[](EpsAttnParams& p) {
         p.length_kind = EPS_ATTN_VISIT_COUNT;
         p.context_lens = nullptr;
       },
       "needs dense_table and context_lens"},
      {[](EpsAttnParams& p) { p.reserved = 1; }, "reserved=1"},
      {[](EpsAttnParams& p) { p.feedback_groups = 3; }, "feedback is NULL but other"},
      {Feedback(2, 9, 1000), "feedback_stride_head=9 is less than feedback_groups=10"},
      {Feedback(0, 10, 1000), "feedback_group_blocks=0"},
      {Feedback(1, 10, 10), "feedback_stride_row=10 is less than"},
      {Feedback(1, 10, 1 << 30), "one layer's feedback must hold fewer than 2^31"},
      {Feedback(1, 10, 1000), "block_positions is NULL"},
      // 6148914691236517206 * 8 heads wrapped int64 and passed the row check.
      {Feedback(1, 6148914691236517206LL, 3), "each must be at most 2^31 entries"},
      {Feedback(1, 10, int64_t{1} << 40), "each must be at most 2^31 entries"},
      {[](EpsAttnParams& p) { p.softcap = 1e-40f; }, "exceeds 1e30"},
      {[](EpsAttnParams& p) { p.out_stride_head = 8; }, "make rows or heads of"},
      {[](EpsAttnParams& p) { p.out_stride_row = 0; }, "out_stride_row=0 and out_stride_head"},
      {[](EpsAttnParams& p) {
         p.lse = static_cast<float*>(p.out);
         p.lse_stride_row = 1;
         p.lse_stride_head = 1;
       },
       "lse_stride_row=1 and lse_stride_head=1 make rows or heads"},
      {[](EpsAttnParams& p) {
         p.lists = reinterpret_cast<const int32_t*>(reinterpret_cast<const char*>(p.lists) + 1);
       },
       "lists is not 4-byte aligned"},
      {[](EpsAttnParams& p) { p.lse = reinterpret_cast<float*>(static_cast<char*>(p.out) + 2); },
       "lse is not 4-byte aligned"},
      {[](EpsAttnParams& p) {
         p.error_word = reinterpret_cast<int32_t*>(static_cast<char*>(p.out) + 2);
       },
       "error_word is not 4-byte aligned"},
  };
  for (const auto& [mutate, expected] : cases) {
    EpsAttnParams p = c.params;
    p.out = c.q.data();
    mutate(p);
    const std::string why = CheckParams(p, true);
    EXPECT_NE(why.find(expected), std::string::npos)
        << "got \"" << why << "\", expected \"" << expected << "\"";
  }
}

TEST(AttentionParams, ReferenceRefusesInvalidParamsWithTheMessage) {
  AttentionCase c(CaseShape{}, 1);
  c.params.head_dim = 100;
  EXPECT_EQ(Reference(c).code, EPS_ATTN_EINVAL);
  EXPECT_NE(std::string(eps_attn_last_error()).find("head_dim=100"), std::string::npos);
  EXPECT_EQ(eps_attn_params_size(), sizeof(EpsAttnParams));
}

}  // namespace
}  // namespace eps::attention
