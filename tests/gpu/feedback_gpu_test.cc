// Selection feedback on the GPU (gpu/feedback.cuh) against core/'s (core/step.cc,
// ApplyFeedback) on fresh random inputs and random feedback: the lists, the
// statistics and the consumed buffer. Skips cleanly on machines without a CUDA
// device (CI); runs on the lent H100.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/bounds.h"
#include "core/step.h"
#include "gpu/step.h"
#include "gtest/gtest.h"
#include "tests/core/coarse_policies.h"
#include "tests/core/test_util.h"
#include "tests/gpu/coarse_steps.h"
#include "tests/gpu/device_step.h"

namespace eps {
namespace {

using testing::CoarseHost;
using testing::CoarseSteps;
using testing::CompareWithReference;
using testing::kBatch;

using testing::RandomFeedback;

// One row's steps (flat and coarse records) with random feedback, from a fresh
// seed that the test prints on failure.
struct RandomFeedbackSteps {
  explicit RandomFeedbackSteps(Granularity granularity = Granularity::kUnion)
      : steps{1, 4, granularity, rng} {}
  uint64_t seed = testing::TestSeed();
  std::mt19937_64 rng{seed};
  CoarseSteps steps;
  std::vector<float> feedback = RandomFeedback(steps, rng);
  CoarseHost host = steps.Host();
};

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct FeedbackCase {
  bool coarse;
  Granularity granularity;
};

class FeedbackGpuStepTest : public ::testing::TestWithParam<FeedbackCase> {};

// Every budget's lists and statistics equal core/'s with the same feedback, up to
// float ties at a cut; the device consumes the same entries core/ does (bit for
// bit); a replayed graph and kernels launched one by one give the same lists.
TEST_P(FeedbackGpuStepTest, MatchesTheCoreReferenceAndConsumesTheSameEntries) {
  SKIP_WITHOUT_DEVICE();
  const FeedbackCase c = GetParam();
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  CoarseSteps steps(1, 4, c.granularity, rng);
  ModelLayout model = steps.model;
  if (!c.coarse) model.coarse_blocks = 0;
  auto reference = PageSelector::Create(model, *steps.phi);
  ASSERT_TRUE(reference.ok());
  const int64_t max_groups = steps.fine->max_groups();
  auto graphs = gpu::GpuSelector::Create(model, 0, kBatch, max_groups);
  auto direct = gpu::GpuSelector::Create(model, 0, kBatch, max_groups, {.graphs = false});
  ASSERT_TRUE(graphs.ok() && direct.ok());
  const CoarseHost host = steps.Host();
  const CoarseHost* coarse = c.coarse ? &host : nullptr;
  const int lists = c.granularity == Granularity::kPerKvHead ? model.num_kv_heads : 1;
  int changed = 0;
  for (const SelectPolicy& policy : testing::CoarsePolicies(c.granularity, 1.5f)) {
    SCOPED_TRACE(policy.DebugString());
    const std::vector<float> feedback = RandomFeedback(steps, rng);
    StepInputs in = c.coarse ? steps.Inputs() : steps.fine->Inputs(steps.rows);
    // core/'s lists without feedback, to see that it changes some.
    ASSERT_TRUE(reference->Select(in, policy, steps.fine->Outputs(), nullptr).ok());
    std::vector<std::vector<int32_t>> plain;
    for (int layer = 0; layer < model.num_layers; ++layer) {
      for (int b = 0; b < kBatch; ++b) {
        for (int list = 0; list < lists; ++list) {
          const auto l = steps.fine->VisitBlocks(layer, b, list);
          plain.emplace_back(l.begin(), l.end());
        }
      }
    }
    std::vector<float> want_feedback = feedback;
    in.feedback = want_feedback.data();
    StepStats want;
    ASSERT_TRUE(reference->Select(in, policy, steps.fine->Outputs(), &want).ok());
    for (int layer = 0, i = 0; layer < model.num_layers; ++layer) {
      for (int b = 0; b < kBatch; ++b) {
        for (int list = 0; list < lists; ++list, ++i) {
          const auto l = steps.fine->VisitBlocks(layer, b, list);
          changed += std::vector<int32_t>(l.begin(), l.end()) != plain[i];
        }
      }
    }

    std::vector<float> first_feedback = feedback, replayed_feedback = feedback,
                       launched_feedback = feedback;
    const testing::DeviceStep first = testing::SelectOnDevice(
        **graphs, *steps.fine, kBatch, steps.rows, policy, coarse, -1, &first_feedback);
    ASSERT_TRUE(first.status.ok()) << first.status;
    const testing::DeviceStep replayed = testing::SelectOnDevice(
        **graphs, *steps.fine, kBatch, steps.rows, policy, coarse, -1, &replayed_feedback);
    const testing::DeviceStep launched = testing::SelectOnDevice(
        **direct, *steps.fine, kBatch, steps.rows, policy, coarse, -1, &launched_feedback);
    ASSERT_TRUE(replayed.status.ok() && launched.status.ok());
    EXPECT_EQ(first.visit_count, replayed.visit_count);
    EXPECT_EQ(first.visit_blocks, replayed.visit_blocks);
    EXPECT_EQ(first.visit_count, launched.visit_count);
    EXPECT_EQ(first.visit_blocks, launched.visit_blocks);
    EXPECT_TRUE(SameBits(first_feedback, want_feedback)) << "not consumed as core/ consumes";
    EXPECT_TRUE(SameBits(replayed_feedback, want_feedback));
    EXPECT_TRUE(SameBits(launched_feedback, want_feedback));

    // `feedback`: the entries as core/ read them (it consumed want_feedback).
    const int near_cut = CompareWithReference(
        steps, first, policy, {.coarse_level = c.coarse, .feedback = feedback.data()});
    EXPECT_LE(near_cut, 4) << "more disagreements than fp32 ties explain";
    EXPECT_EQ(first.stats.groups_total, want.groups_total);
    EXPECT_EQ(first.stats.blocks_total, want.blocks_total);
    if (c.coarse) {  // the candidates' fine records, up to the coarse groups near a cut
      const CoarseSteps::ByteRange bytes = steps.SummaryBytesRange(policy);
      EXPECT_GE(want.summary_bytes_read, bytes.low);
      EXPECT_LE(want.summary_bytes_read, bytes.high);
      EXPECT_GE(first.stats.summary_bytes_read, bytes.low);
      EXPECT_LE(first.stats.summary_bytes_read, bytes.high);
    } else if (near_cut == 0) {
      EXPECT_EQ(first.stats.summary_bytes_read, want.summary_bytes_read);
    }
    if (near_cut == 0) {
      EXPECT_EQ(first.stats.groups_visited, want.groups_visited);
      EXPECT_EQ(first.stats.kv_bytes_read_est, want.kv_bytes_read_est);
    }
  }
  EXPECT_GT(changed, 0) << "the feedback changed no list: the case tests nothing of it";
}

std::string FeedbackCaseName(const ::testing::TestParamInfo<FeedbackCase>& p) {
  return std::string(p.param.coarse ? "coarse" : "flat") +
         (p.param.granularity == Granularity::kPerKvHead ? "_per_kv_head" : "_union");
}

INSTANTIATE_TEST_SUITE_P(Feedback, FeedbackGpuStepTest,
                         ::testing::Values(FeedbackCase{false, Granularity::kUnion},
                                           FeedbackCase{false, Granularity::kPerKvHead},
                                           FeedbackCase{true, Granularity::kUnion},
                                           FeedbackCase{true, Granularity::kPerKvHead}),
                         FeedbackCaseName);

// A step that fails (a bad slot in the group table) leaves every entry as it was.
TEST(FeedbackGpuValidationTest, AFailedStepLeavesTheFeedbackUntouched) {
  SKIP_WITHOUT_DEVICE();
  RandomFeedbackSteps f;
  SCOPED_TRACE(testing::SeedTrace(f.seed));
  f.steps.fine->group_table()[5] = 1 << 30;  // row 0, group 5
  for (const bool coarse : {false, true}) {
    ModelLayout model = f.steps.model;
    if (!coarse) model.coarse_blocks = 0;
    // Every coarse group a candidate: the bad slot's fine record is read.
    SelectPolicy policy;
    policy.coarse_candidates = 1024.0f;
    auto selector = gpu::GpuSelector::Create(model, 0, kBatch, f.steps.fine->max_groups());
    ASSERT_TRUE(selector.ok());
    std::vector<float> got = f.feedback;
    const testing::DeviceStep r =
        testing::SelectOnDevice(**selector, *f.steps.fine, kBatch, f.steps.rows, policy,
                                coarse ? &f.host : nullptr, -1, &got);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
    EXPECT_TRUE(SameBits(got, f.feedback)) << (coarse ? "coarse" : "flat");
  }
}

// The engine never wrote inputs_ready, so epsd's host released the step's wait
// (Finish's timeout): the queries are not the step's, so every list says attend
// densely (-1) and the feedback stays for the step that reads it; flat and with
// the coarse level, captured graphs and direct launches. The same selector's next
// step selects and consumes as usual.
TEST(FeedbackGpuValidationTest, AReleasedStepWritesDenseListsAndKeepsTheFeedback) {
  SKIP_WITHOUT_DEVICE();
  RandomFeedbackSteps f;
  SCOPED_TRACE(testing::SeedTrace(f.seed));
  for (const bool coarse : {false, true}) {
    for (const bool graphs : {true, false}) {
      SCOPED_TRACE(std::string(coarse ? "coarse" : "flat") + (graphs ? ", graphs" : ", direct"));
      ModelLayout model = f.steps.model;
      if (!coarse) model.coarse_blocks = 0;
      SelectPolicy policy;
      auto selector = gpu::GpuSelector::Create(model, 0, kBatch, f.steps.fine->max_groups(),
                                               {.graphs = graphs});
      ASSERT_TRUE(selector.ok());
      std::vector<float> got = f.feedback;
      const testing::DeviceStep released = testing::SelectOnDevice(
          **selector, *f.steps.fine, kBatch, f.steps.rows, policy, coarse ? &f.host : nullptr, 7,
          &got, std::chrono::milliseconds(50));
      EXPECT_EQ(released.status.code(), absl::StatusCode::kDeadlineExceeded) << released.status;
      EXPECT_EQ(released.visit_count, std::vector<int32_t>(released.visit_count.size(), -1));
      EXPECT_TRUE(SameBits(got, f.feedback));
      const testing::DeviceStep next =
          testing::SelectOnDevice(**selector, *f.steps.fine, kBatch, f.steps.rows, policy,
                                  coarse ? &f.host : nullptr, -1, &got);
      ASSERT_TRUE(next.status.ok()) << next.status;
      EXPECT_GT(*std::min_element(next.visit_count.begin(), next.visit_count.end()), 0);
      EXPECT_FALSE(SameBits(got, f.feedback)) << "the next step consumed nothing";
    }
  }
}

// Strict mode ranks without the buffer (the same lists as without it) but consumes it,
// the same entries core/ consumes, so that a later step of another policy never reads
// entries two attentions old; union lists and a list per KV head.
class FeedbackGpuStrictTest : public ::testing::TestWithParam<Granularity> {};

TEST_P(FeedbackGpuStrictTest, StrictModeIgnoresTheFeedbackButConsumesIt) {
  SKIP_WITHOUT_DEVICE();
  RandomFeedbackSteps f(GetParam());
  SCOPED_TRACE(testing::SeedTrace(f.seed));
  auto selector = gpu::GpuSelector::Create(f.steps.model, 0, kBatch, f.steps.fine->max_groups());
  ASSERT_TRUE(selector.ok());
  SelectPolicy policy;
  policy.method = Method::kJl;
  policy.top_pages = 6;
  policy.strict = true;
  policy.granularity = GetParam();
  const testing::DeviceStep without =
      testing::SelectOnDevice(**selector, *f.steps.fine, kBatch, f.steps.rows, policy, &f.host);
  std::vector<float> got = f.feedback;
  const testing::DeviceStep with = testing::SelectOnDevice(**selector, *f.steps.fine, kBatch,
                                                           f.steps.rows, policy, &f.host, -1, &got);
  ASSERT_TRUE(without.status.ok() && with.status.ok()) << with.status;
  EXPECT_EQ(with.visit_count, without.visit_count);
  EXPECT_EQ(with.visit_blocks, without.visit_blocks);
  auto reference = PageSelector::Create(f.steps.model, *f.steps.phi);
  ASSERT_TRUE(reference.ok());
  std::vector<float> want = f.feedback;
  StepInputs in = f.steps.Inputs();
  in.feedback = want.data();
  ASSERT_TRUE(reference->Select(in, policy, f.steps.fine->Outputs(), nullptr).ok());
  EXPECT_FALSE(SameBits(want, f.feedback)) << "core/ consumed nothing";
  EXPECT_TRUE(SameBits(got, want)) << "the device consumes what core/ consumes";
}

INSTANTIATE_TEST_SUITE_P(Granularities, FeedbackGpuStrictTest,
                         ::testing::Values(Granularity::kUnion, Granularity::kPerKvHead),
                         [](const ::testing::TestParamInfo<Granularity>& p) {
                           return std::string(p.param == Granularity::kPerKvHead ? "per_kv_head"
                                                                                 : "union");
                         });

}  // namespace
}  // namespace eps
