// Inputs at the edges of what core/ can take: records too short, a PhiBank that does not
// serve the model, keys and queries whose sums would leave the float range, norms below
// it (strict mode), and feedback entries no attention writes. Each is refused with a
// message that names it, or handled without losing what the docs promise.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/bounds.h"
#include "core/saturating.h"
#include "core/select.h"
#include "core/step.h"
#include "core/summary.h"
#include "gtest/gtest.h"

namespace eps {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// One layer, one head, d = 8, one-token blocks and groups (a group per key).
ModelLayout Tiny(SummaryFeatures features = {}) {
  ModelLayout m;
  m.num_layers = 1;
  m.num_q_heads = 1;
  m.num_kv_heads = 1;
  m.head_dim = 8;
  m.block_size = 1;
  m.group_blocks = 1;
  m.sketch_dim = 4;
  m.features = features;
  return m;
}

// A sequence of `groups` one-key groups at table row 0 (slot p = group p, block 100 + p).
struct Sequence {
  explicit Sequence(const ModelLayout& model, int64_t groups)
      : m(model),
        phi(*PhiBank::Create(m.phi_seed, m.num_layers, m.num_kv_heads, m.head_dim, m.sketch_dim)),
        writer(m, phi),
        layout(SummaryLayout::For(m)),
        pool(groups * layout.record_words),
        query(m.head_dim, 0.0f),
        blocks(groups),
        slots(groups),
        visit(groups, -1) {
    for (int64_t p = 0; p < groups; ++p) {
      slots[p] = static_cast<int32_t>(p);
      blocks[p] = static_cast<int32_t>(100 + p);
      EXPECT_TRUE(writer.Reset(Record(p)).ok());
    }
    row = {.table_row = 0, .context_tokens = groups};
  }
  std::span<float> Record(int64_t p) {
    return {pool.data() + p * layout.record_words, static_cast<size_t>(layout.record_words)};
  }
  absl::Status Append(int64_t p, const std::vector<float>& key) {
    return writer.Append(Record(p), 0, 0, {key.data(), DType::kFloat32, 1, 0});
  }
  absl::Status Select(const SelectPolicy& policy) {
    absl::StatusOr<PageSelector> selector = PageSelector::Create(m, phi);
    if (!selector.ok()) return selector.status();
    StepInputs in;
    in.summary_pool = pool.data();
    in.num_slots = static_cast<int64_t>(slots.size());
    in.group_table = slots.data();
    in.block_table = blocks.data();
    in.max_seqs = 1;
    in.max_groups = static_cast<int64_t>(slots.size());
    in.max_blocks = static_cast<int64_t>(blocks.size());
    in.queries = query.data();
    in.max_batch = 1;
    in.rows = {&row, 1};
    if (!feedback.empty()) in.feedback = feedback.data();
    return selector->Select(in, policy, {visit.data(), &count}, nullptr);
  }
  std::vector<int32_t> List() const { return {visit.begin(), visit.begin() + count}; }

  ModelLayout m;
  PhiBank phi;
  SummaryWriter writer;
  SummaryLayout layout;
  std::vector<float> pool, query, feedback;
  std::vector<int32_t> blocks, slots, visit;
  int32_t count = -7;
  StepRow row;
};

std::vector<float> Key(float first, int d = 8) {
  std::vector<float> k(d, 0.0f);
  k[0] = first;
  return k;
}

// Strict mode's list of the top group alone, by `method`, no group forced: it must hold the
// true top-1 whatever the bounds' rounding (empty, and a failure, if the step failed).
std::vector<int32_t> StrictTopOne(Sequence& seq, Method method = SelectPolicy{}.method) {
  SelectPolicy policy;
  policy.method = method;
  policy.strict = true;
  policy.first_n = policy.last_n = 0;
  policy.top_pages = 1;
  const absl::Status selected = seq.Select(policy);
  EXPECT_TRUE(selected.ok()) << selected;
  return selected.ok() ? seq.List() : std::vector<int32_t>{};
}

TEST(FloatRangeTest, ResetRefusesARecordShorterThanTheLayoutAndTouchesNothing) {
  const ModelLayout m = Tiny();
  const PhiBank phi = *PhiBank::Create(m.phi_seed, 1, 1, m.head_dim, m.sketch_dim);
  const SummaryWriter writer(m, phi);
  std::vector<float> record(writer.layout().record_words, 5.0f);
  const absl::Status s = writer.Reset(std::span<float>(record).first(4));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("record has 4 words"), std::string::npos) << s;
  EXPECT_EQ(record, std::vector<float>(record.size(), 5.0f));
}

TEST(FloatRangeTest, APhiBankThatDoesNotServeTheModelIsRefusedBeforeAnyRead) {
  ModelLayout m = Tiny();
  m.num_layers = 4;
  m.num_kv_heads = 2;
  m.num_q_heads = 2;
  const PhiBank small = *PhiBank::Create(m.phi_seed, 1, 1, m.head_dim, m.sketch_dim);
  const absl::StatusOr<PageSelector> selector = PageSelector::Create(m, small);
  ASSERT_FALSE(selector.ok());
  EXPECT_NE(selector.status().message().find("layers=1, kv_heads=1"), std::string::npos)
      << selector.status();
  const SummaryWriter writer(m, small);
  std::vector<float> record(writer.layout().record_words, 0.0f);
  const std::vector<float> key = Key(1.0f);
  EXPECT_EQ(writer.Append(record, 3, 1, {key.data(), DType::kFloat32, 1, 0}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(record, std::vector<float>(record.size(), 0.0f));
  // A bank for more layers and KV heads serves it: its matrices are the same.
  const PhiBank large = *PhiBank::Create(m.phi_seed, 8, 4, m.head_dim, m.sketch_dim);
  EXPECT_TRUE(PageSelector::Create(m, large).ok());
}

TEST(FloatRangeTest, KeysWhoseSumsWouldLeaveTheFloatRangeAreRefusedBeforeTheRecordChanges) {
  // quest8 alone takes keys beyond binary16: the sums are the limit.
  Sequence seq(Tiny({.key_sum = true, .principal = false, .quest = false, .quest8 = true}), 2);
  const std::vector<float> before(seq.Record(0).begin(), seq.Record(0).end());
  const absl::Status s = seq.Append(0, Key(1e20f));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("float range"), std::string::npos) << s;
  EXPECT_EQ(std::vector<float>(seq.Record(0).begin(), seq.Record(0).end()), before);
  // One large key fits; the record's sum of them is the limit, not each key.
  ASSERT_TRUE(seq.Append(0, Key(5e18f)).ok());
  EXPECT_EQ(seq.Append(0, Key(5e18f)).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(seq.Append(1, Key(1.0f)).ok());
  EXPECT_TRUE(std::isfinite(seq.Record(0)[seq.layout.fro2]));
  SelectPolicy policy;
  policy.method = Method::kQuestClt;
  policy.first_n = policy.last_n = 0;
  policy.top_pages = 1;
  seq.query[0] = 1.0f;
  EXPECT_TRUE(seq.Select(policy).ok());
}

TEST(FloatRangeTest, AQueryBeyondTheRangeIsNamedAndNeverBlamedOnASummary) {
  Sequence seq(Tiny({.key_sum = true, .principal = false, .quest = true, .quest8 = false}), 3);
  for (int64_t p = 0; p < 3; ++p) ASSERT_TRUE(seq.Append(p, std::vector<float>(8, 4.0f)).ok());
  SelectPolicy policy;
  policy.first_n = policy.last_n = 0;
  policy.top_pages = 1;
  int overflows = 0;
  for (Method method : {Method::kJl, Method::kQuest, Method::kQuestClt}) {
    policy.method = method;
    std::fill(seq.query.begin(), seq.query.end(), 1e20f);  // |q|^2 = 8e40
    absl::Status s = seq.Select(policy);
    EXPECT_NE(s.message().find("query[layer 0][row 0][head 0] has |q|^2"), std::string::npos)
        << MethodName(method) << ": " << s;
    std::fill(seq.query.begin(), seq.query.end(), 6e18f);  // |q|^2 in range, (q·k)^2 not
    s = seq.Select(policy);
    if (!s.ok()) {
      ++overflows;
      EXPECT_EQ(s.message().find("holds NaN"), std::string::npos)
          << MethodName(method) << ": " << s;
      EXPECT_NE(s.message().find("overflow the float range together"), std::string::npos) << s;
    }
  }
  EXPECT_GT(overflows, 0);  // jl's squared sketch overflows at this scale
}

TEST(FloatRangeTest, StrictKeepsTheTrueTopGroupWhenSquaredNormsUnderflow) {
  // Group 1's key gives the largest q·k; with q or the keys tiny their squares
  // underflow, and the bounds built from them contradict the mean. Strict mode must
  // still visit a superset of the true top-1.
  for (const float q_scale : {1e-25f, 1.0f}) {
    for (const float k_scale : {1.0f, 1e-25f}) {
      if (q_scale != 1.0f && k_scale != 1.0f) continue;
      Sequence seq(Tiny({.key_sum = true, .principal = true, .quest = false, .quest8 = false}), 4);
      const float values[4] = {1.0f, 8.0f, 2.0f, 0.5f};
      for (int64_t p = 0; p < 4; ++p) ASSERT_TRUE(seq.Append(p, Key(values[p] * k_scale)).ok());
      seq.query[0] = q_scale;
      const std::vector<int32_t> list = StrictTopOne(seq);
      EXPECT_NE(std::find(list.begin(), list.end(), 101), list.end())
          << "q " << q_scale << ", keys " << k_scale << ": " << ::testing::PrintToString(list);
    }
  }
}

TEST(FloatRangeTest, StrictKeepsATopGroupOfMixedSignsWhoseSquaresUnderflow) {
  // Group 0's keys are +k and -k: their mean scores 0, and with q or k below about 2^-75
  // the squares vanish, so fro gave group 0 the bracket [0, 0] around its maximum q·k > 0,
  // while group 1's one smaller positive key gave a mean above 0: strict mode skipped the
  // true top group 0 (the upper bound was dropped only where it fell below the mean).
  for (const float q_scale : {1e-25f, 1.0f}) {
    const float k_scale = q_scale == 1.0f ? 1e-25f : 1.0f;
    Sequence seq(Tiny({.key_sum = true, .principal = false, .quest = false, .quest8 = false}), 3);
    ASSERT_TRUE(seq.Append(0, Key(8.0f * k_scale)).ok());
    ASSERT_TRUE(seq.Append(0, Key(-8.0f * k_scale)).ok());
    ASSERT_TRUE(seq.Append(1, Key(1.0f * k_scale)).ok());
    ASSERT_TRUE(seq.Append(2, Key(0.0f)).ok());  // the newest, forced
    seq.query[0] = q_scale;
    const std::vector<int32_t> list = StrictTopOne(seq);
    EXPECT_NE(std::find(list.begin(), list.end(), 100), list.end())
        << "q " << q_scale << ", keys " << k_scale << ": " << ::testing::PrintToString(list);
  }
}

TEST(FloatRangeTest, StrictKeepsTheTrueTopGroupWhenTheMeanKeysDotOverflows) {
  // Group 0 holds 1024 equal keys and group 1 one larger key; every key and the query
  // are inside the accepted range, and every q·k is finite, but q·Σk of group 0 is not.
  // The mean key's lower bound was then +inf, which contradicted the upper bound and
  // left group 0 a bracket [inf, inf]: strict mode skipped the true top group 1.
  Sequence seq(Tiny({.key_sum = true, .principal = false, .quest = false, .quest8 = false}), 3);
  for (int i = 0; i < 1024; ++i) ASSERT_TRUE(seq.Append(0, Key(2.0e17f)).ok());
  ASSERT_TRUE(seq.Append(1, Key(6.0e18f)).ok());
  ASSERT_TRUE(seq.Append(2, Key(0.0f)).ok());
  seq.query[0] = 1.8e19f;
  QueryTerms terms;
  terms.Prepare(seq.phi, 0, 0, seq.query);
  for (int64_t p = 0; p < 2; ++p) {
    const float true_max = seq.query[0] * (p == 0 ? 2.0e17f : 6.0e18f);
    const MaxScoreBracket b = BracketMaxScore(seq.Record(p), seq.layout, terms);
    EXPECT_LE(b.lower, true_max) << "group " << p;
    EXPECT_GE(b.upper, true_max) << "group " << p;
  }
  const std::vector<int32_t> list = StrictTopOne(seq, Method::kFro);
  EXPECT_NE(std::find(list.begin(), list.end(), 101), list.end()) << ::testing::PrintToString(list);
}

TEST(FloatRangeTest, MethodOffReadsNoQueryAndSoRefusesNone) {
  // Nothing is scored with method off: a NaN query is no error (the GPU never reads it;
  // core refused it), and every group is visited.
  Sequence seq(Tiny(), 3);
  for (int64_t p = 0; p < 3; ++p) ASSERT_TRUE(seq.Append(p, Key(1.0f)).ok());
  seq.query[0] = kNaN;
  SelectPolicy policy;
  policy.method = Method::kOff;
  ASSERT_EQ(seq.Select(policy), absl::OkStatus());
  EXPECT_EQ(seq.List(), (std::vector<int32_t>{100, 101, 102}));
  policy.method = Method::kQuest;  // scored: refused, by name
  const absl::Status s = seq.Select(policy);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("query[layer 0][row 0][head 0][0] is nan"), std::string::npos) << s;
}

TEST(FloatRangeTest, StepByteCountsStopAtTheTopInsteadOfWrapping) {
  // A 2^35-token context (the largest tables a request may name) of 16 KV heads of
  // float32 keys and values at d = 1024 over 2048 layers: 2^63 bytes, past int64.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(SaturatingMulAdd(0, {int64_t{1} << 35, 16, 2 * 1024 * 4, 2048}), kMax);
  EXPECT_EQ(SaturatingMulAdd(kMax - 1, {2}), kMax);
  EXPECT_EQ(SaturatingMulAdd(5, {2, 3}), 11);
  EXPECT_EQ(SaturatingMulAdd(7, {}), 8);  // an empty product is 1
  // Every byte sum of StepStats::Add, the summary bytes' too (the session's totals).
  StepStats total;
  total.kv_bytes_dense = total.kv_bytes_read_est = total.summary_bytes_read = kMax - 5;
  StepStats step;
  step.kv_bytes_dense = step.kv_bytes_read_est = step.summary_bytes_read = 10;
  total.Add(step);
  EXPECT_EQ(total.kv_bytes_dense, kMax);
  EXPECT_EQ(total.kv_bytes_read_est, kMax);
  EXPECT_EQ(total.summary_bytes_read, kMax);
}

TEST(FloatRangeTest, FeedbackEntriesNoAttentionWritesAreNoFeedback) {
  // d = 4 (√d = 2): fed groups 1 and 2 as in the feedback tests; the entries of groups 0,
  // 3 and 4 (±inf, beyond 1e30) must change nothing.
  const std::vector<float> base = {10, 5, 7, 3, 4};
  std::vector<float> want = base;
  ApplyFeedback(std::vector<float>{kNaN, 1, 3, kNaN, kNaN}, 4, want);
  std::vector<float> got = base;
  ApplyFeedback(std::vector<float>{kInf, 1, 3, 3e38f, -kInf}, 4, got);
  EXPECT_EQ(got, want);
  EXPECT_FALSE(IsFeedback(kNaN) || IsFeedback(kInf) || IsFeedback(-kInf) || IsFeedback(2e30f));
  EXPECT_TRUE(IsFeedback(-1e30f) && IsFeedback(0.0f) && IsFeedback(-12.5f));

  // Through a step: an absurd entry leaves the list as without it.
  Sequence seq(Tiny({.key_sum = true, .principal = false, .quest = true, .quest8 = false}), 8);
  for (int64_t p = 0; p < 8; ++p) ASSERT_TRUE(seq.Append(p, Key(p == 6 ? 3.0f : 0.1f * p)).ok());
  seq.query[0] = 1.0f;
  SelectPolicy policy;
  policy.first_n = policy.last_n = 0;
  policy.top_pages = 2;
  seq.feedback.assign(8, kNaN);
  seq.feedback[3] = 0.5f;
  ASSERT_TRUE(seq.Select(policy).ok());
  const std::vector<int32_t> clean = seq.List();
  seq.feedback.assign(8, kNaN);
  seq.feedback[3] = 0.5f;
  seq.feedback[2] = 1e38f;
  ASSERT_TRUE(seq.Select(policy).ok());
  EXPECT_EQ(seq.List(), clean);
}

// core/bounds.h kMaxQueryNorm2, against Σq² summed in double in channel order: a query
// at it is refused by name, one a float below it scores (the GPU compares its float sum
// with the same bound).
TEST(FloatRangeTest, AQueryIsRefusedExactlyAtTheSquaredNormBound) {
  Sequence seq(Tiny({.key_sum = true, .principal = false, .quest = true, .quest8 = false}), 3);
  for (int64_t p = 0; p < 3; ++p) ASSERT_TRUE(seq.Append(p, Key(1e-30f)).ok());
  SelectPolicy policy;
  policy.method = Method::kQuest;
  policy.top_pages = 1;
  const float at = static_cast<float>(std::sqrt(kMaxQueryNorm2));
  const float above = double{at} * at >= kMaxQueryNorm2 ? at : std::nextafter(at, kInf);
  const float below = std::nextafter(above, 0.0f);
  ASSERT_LT(double{below} * below, kMaxQueryNorm2);
  seq.query.assign(8, 0.0f);
  seq.query[0] = above;
  const absl::Status s = seq.Select(policy);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("query[layer 0][row 0][head 0] has |q|^2"), std::string::npos) << s;
  seq.query[0] = below;
  EXPECT_TRUE(seq.Select(policy).ok()) << "a float sum of the squares stays finite below the bound";
}

// quest sums min(q,0)·min + max(q,0)·max, as the GPU does (gpu/warp_sums.cuh): equal to
// max(q·min, q·max) for a well-formed record, and the same on both backends for a record
// whose ranges are inverted (the old max form scored those its own way: rankings reversed).
TEST(FloatRangeTest, QuestScoresAnInvertedRangeAsTheGpuDoes) {
  Sequence seq(Tiny({.key_sum = true, .principal = false, .quest = true, .quest8 = false}), 1);
  ASSERT_TRUE(seq.Append(0, {1, -2, 3, -4, 0.5f, 6, -7, 8}).ok());
  ASSERT_TRUE(seq.Append(0, {-1, 2, 1, 4, 2.5f, -6, 7, 1}).ok());
  const std::vector<float> q = {0.5f, -1, 2, -0.25f, 1, 3, -2, 0.75f};
  QueryTerms terms;
  terms.Prepare(seq.phi, 0, 0, q);
  const auto split = [&](std::span<const float> r) {
    float sum = 0.0f;
    for (int i = 0; i < 8; ++i) {
      sum += std::min(q[i], 0.0f) * QuestMin(r, seq.layout, i) +
             std::max(q[i], 0.0f) * QuestMax(r, seq.layout, i);
    }
    return sum;
  };
  std::span<float> r = seq.Record(0);
  EXPECT_EQ(QuestBound(r, seq.layout, terms), split(r));
  for (int w = 0; w < 4; ++w) std::swap(r[seq.layout.quest_min + w], r[seq.layout.quest_max + w]);
  EXPECT_EQ(QuestBound(r, seq.layout, terms), split(r));
  float max_form = 0.0f;
  for (int i = 0; i < 8; ++i) {
    max_form += std::max(q[i] * QuestMin(r, seq.layout, i), q[i] * QuestMax(r, seq.layout, i));
  }
  EXPECT_GT(max_form, split(r));  // the two forms part on such a record
}

// A NaN anywhere the scores read fails the step naming the summary, whatever part
// holds it: a quest half (the max form dropped a NaN in one), λ1, r² or the principal
// scale (the message used to blame the queries: only the sums before them were scanned).
TEST(FloatRangeTest, ANaNInAQuestHalfOrThePrincipalPairIsBlamedOnTheSummary) {
  const auto expect_blamed = [](Sequence& seq, Method method, const char* what) {
    SelectPolicy policy;
    policy.method = method;
    policy.top_pages = 1;
    std::fill(seq.query.begin(), seq.query.end(), 0.5f);
    const absl::Status s = seq.Select(policy);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what << ": " << s;
    EXPECT_NE(s.message().find("summary of slot 1"), std::string::npos) << what << ": " << s;
    EXPECT_NE(s.message().find("holds NaN or Inf"), std::string::npos) << what << ": " << s;
  };
  for (const bool max_half : {false, true}) {
    Sequence seq(Tiny({.key_sum = true, .principal = false, .quest = true, .quest8 = false}), 3);
    for (int64_t p = 0; p < 3; ++p) ASSERT_TRUE(seq.Append(p, Key(1.0f + p)).ok());
    const int word = max_half ? seq.layout.quest_max : seq.layout.quest_min;
    reinterpret_cast<uint16_t*>(seq.Record(1).data() + word)[0] = 0x7E00;  // a binary16 NaN
    expect_blamed(seq, Method::kQuest, max_half ? "quest max half" : "quest min half");
  }
  for (int word = 0; word < 3; ++word) {  // λ1, r², scale
    Sequence seq(Tiny({.key_sum = true, .principal = true, .quest = false, .quest8 = false}), 3);
    for (int64_t p = 0; p < 3; ++p) {
      const std::vector<float> keys = {1.0f + p, 0.5f, 0, 0, 0, 0, 0, 0,
                                       0.25f,    1,    0, 0, 0, 0, 0, 0};
      ASSERT_TRUE(
          seq.writer.Append(seq.Record(p), 0, 0, {keys.data(), DType::kFloat32, 2, 0}).ok());
      ASSERT_TRUE(seq.writer.Seal(seq.Record(p), 0, 0, {keys.data(), DType::kFloat32, 2, 0}).ok());
    }
    ASSERT_NE(seq.Record(1)[seq.layout.principal + 2], 0.0f) << "sealed";
    seq.Record(1)[seq.layout.principal + word] = std::nanf("");
    expect_blamed(seq, Method::kOnePc, word == 0 ? "lambda1" : word == 1 ? "r2" : "scale");
  }
}

// An infinite quest half in a record that holds keys (the writer never stores one: keys
// beyond ±65504 are refused, and ±∞ are only Reset's empty range) fails the step naming the
// summary. quest scored a −∞ maximum met by a positive q_j, or a +∞ minimum met by a negative
// one, −∞, as if the group were empty, and the step passed without it; questclt's NaN was
// blamed on the queries.
TEST(FloatRangeTest, AnInfiniteQuestHalfInARecordWithKeysIsBlamedOnTheSummary) {
  for (const Method method : {Method::kQuest, Method::kQuestClt}) {
    for (const bool max_half : {true, false}) {
      Sequence seq(Tiny({.key_sum = true, .principal = false, .quest = true, .quest8 = false}), 3);
      for (int64_t p = 0; p < 3; ++p) ASSERT_TRUE(seq.Append(p, Key(1.0f + p)).ok());
      const int word = max_half ? seq.layout.quest_max : seq.layout.quest_min;
      // −∞ as the maximum, +∞ as the minimum: Reset's values, the range of no key.
      reinterpret_cast<uint16_t*>(seq.Record(1).data() + word)[0] = max_half ? 0xFC00 : 0x7C00;
      std::fill(seq.query.begin(), seq.query.end(), max_half ? 0.5f : -0.5f);
      SelectPolicy policy;
      policy.method = method;
      policy.top_pages = 1;
      const absl::Status s = seq.Select(policy);
      const std::string what = absl::StrCat(MethodName(method), max_half ? ", max" : ", min");
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what << ": " << s;
      EXPECT_NE(s.message().find("summary of slot 1"), std::string::npos) << what << ": " << s;
      EXPECT_NE(s.message().find("holds NaN or Inf"), std::string::npos) << what << ": " << s;
    }
  }
}

}  // namespace
}  // namespace eps
