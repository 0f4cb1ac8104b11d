// The GPU pre-pass against the core/ reference on fresh random inputs. Skips
// cleanly on machines without a CUDA device (CI); runs on the lent H100.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <ostream>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/bounds.h"
#include "core/phi.h"
#include "core/summary.h"
#include "core/testing/synthetic.h"
#include "gpu/step.h"
#include "gtest/gtest.h"
#include "tests/core/step_fixture.h"
#include "tests/core/test_util.h"
#include "tests/gpu/device_step.h"
#include "tests/gpu/host_copy.h"
#include "tests/gpu/pending_error.h"

namespace eps {
namespace {

using testing::Download;
using testing::Upload;

TEST(GpuPhiTest, DeviceGeneratorMatchesCoreBitExactly) {
  SKIP_WITHOUT_DEVICE();
  for (const auto& [seed, layer, head, d, m] :
       {std::tuple{42ull, 0, 0, 128, 8}, std::tuple{7ull, 31, 7, 128, 16},
        std::tuple{~0ull, 3, 1, 64, 4}}) {
    auto bank = PhiBank::Create(seed, layer + 1, head + 1, d, m);
    ASSERT_TRUE(bank.ok());
    std::vector<float> device(d * m);
    ASSERT_TRUE(gpu::GeneratePhiOnDevice(seed, layer, head, d, m, device.data()).ok());
    const auto want = bank->Matrix(layer, head);
    ASSERT_EQ(0, std::memcmp(device.data(), want.data(), device.size() * sizeof(float)))
        << "seed " << seed << " layer " << layer << " head " << head;
  }
}

// An error the caller left pending on the thread is not Create's: its Φ launch was checked
// with cudaGetLastError, which reported the caller's error as its own (an engine's, or in
// epsd another session's on the same gRPC thread, failed an unrelated Attach).
TEST(GpuPhiTest, CreateDoesNotReportACallersPendingError) {
  SKIP_WITHOUT_DEVICE();
  ModelLayout m;
  m.num_layers = 2;
  m.num_q_heads = 8;
  m.num_kv_heads = 2;
  m.head_dim = 64;
  m.phi_seed = 11;
  ASSERT_NO_FATAL_FAILURE(testing::LeaveErrorPending());
  auto selector = gpu::GpuSelector::Create(m, 0, 2, 64);
  EXPECT_TRUE(selector.ok()) << selector.status();
  (void)cudaGetLastError();
  ASSERT_NO_FATAL_FAILURE(testing::LeaveErrorPending());
  std::vector<float> phi(64 * 8);
  EXPECT_TRUE(gpu::GeneratePhiOnDevice(11, 0, 0, 64, 8, phi.data()).ok());
  (void)cudaGetLastError();
  // A failed Create leaves no error of its own pending.
  auto none = gpu::GpuSelector::Create(m, 1 << 20, 2, 64);
  EXPECT_FALSE(none.ok());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// The mass budget's options (docs/policy-selection.md, "Mass budget") and whether its
// floor or ceiling must change core/'s lists in the case (else not checked).
struct MassCase {
  float target = 0.95f;
  float temperature = 1.0f;
  int min_pages = 0, max_pages = 0;
  bool limits_bind = false;
  MassScope scope = MassScope::kHead;  // list: also checked to differ from the head scope's lists
};

struct GpuCase {
  Method method;
  int d, q_heads, kv_heads, group_blocks;
  bool retrieval;
  int sketch_dim = 8;  // 4, 8, 16 take the register-resident Gram; others the generic path
  Granularity granularity = Granularity::kUnion;
  Budget budget = Budget::kThreshold;
  bool strict = false;
  MassCase mass = {};
  // > 0: runs of `tied` consecutive groups of a row share one record (every
  // full group takes its run's first record), so scores tie exactly.
  int tied = 0;
  bool quest8 = false;  // the records hold the quest8 part too (questclt reads it)
  // The engine's query type: binary16 and bfloat16 queries are narrowed from the
  // buffers' fp32 ones, and core/ reads the same 16-bit values.
  DType query_dtype = DType::kFloat32;
};

class GpuStepTest : public ::testing::TestWithParam<GpuCase> {};

TEST_P(GpuStepTest, MatchesTheCoreReferenceOnFreshRandomInputs) {
  SKIP_WITHOUT_DEVICE();
  const GpuCase c = GetParam();
  const uint64_t seed = testing::TestSeed();
  SCOPED_TRACE(testing::SeedTrace(seed));
  std::mt19937_64 rng(seed);
  ModelLayout m =
      testing::RandomModel(3, c.q_heads, c.kv_heads, c.d, c.group_blocks, c.sketch_dim, rng);
  m.features.quest8 = c.quest8;
  auto phi = PhiBank::Create(m.phi_seed, m.num_layers, m.num_kv_heads, m.head_dim, m.sketch_dim);
  auto reference = PageSelector::Create(m, *phi);
  SummaryWriter writer(m, *phi);
  const int64_t max_context = 6000;
  const int batch = 4;
  testing::StepBuffers buffers(m, batch, max_context, batch, c.granularity);
  const int lists = c.granularity == Granularity::kPerKvHead ? m.num_kv_heads : 1;
  std::vector<StepRow> rows;
  for (int r = 0; r < batch; ++r) {
    // A case whose floor or ceiling must bind gets long rows (room for both).
    const int64_t shortest = c.mass.limits_bind ? max_context / 2 : 1;
    const int64_t tokens =
        shortest + static_cast<int64_t>(rng() % static_cast<uint64_t>(max_context - shortest));
    testing::WriteSequence(buffers, writer, r, r, tokens, 1 + r % 3,
                           testing::GroupShapes::kMixedRank, rng);
    rows.push_back({.table_row = r, .context_tokens = tokens, .seq_id = 0});
    const int64_t full = tokens / m.group_tokens();  // a partial last group keeps its own
    for (int64_t p = 0; c.tied > 0 && p < full; ++p) {
      for (int layer = 0; layer < m.num_layers; ++layer) {
        for (int kvh = 0; kvh < m.num_kv_heads; ++kvh) {
          const auto from = buffers.Record(buffers.SlotOf(r, p - p % c.tied), layer, kvh);
          const auto to = buffers.Record(buffers.SlotOf(r, p), layer, kvh);
          std::copy(from.begin(), from.end(), to.begin());
        }
      }
    }
  }
  // The step's inputs as core/ reads them: the buffers', with the queries
  // narrowed to 16 bits where the case says so (the device reads the same).
  std::vector<uint16_t> narrow;
  if (c.query_dtype != DType::kFloat32) {
    const StepInputs in = buffers.Inputs(rows);
    const auto* wide = static_cast<const float*>(in.queries);
    const int64_t count = int64_t{m.num_layers} * batch * m.num_q_heads * m.head_dim;
    for (int64_t i = 0; i < count; ++i) {
      narrow.push_back(c.query_dtype == DType::kFloat16 ? FloatToHalf(wide[i])
                                                        : FloatToBFloat16(wide[i]));
    }
  }
  const testing::NarrowQueries narrow_queries{c.query_dtype, &narrow};
  auto inputs = [&] {
    StepInputs in = buffers.Inputs(rows);
    if (!narrow.empty()) {
      in.queries = narrow.data();
      in.query_dtype = c.query_dtype;
    }
    return in;
  };
  SelectPolicy policy;
  policy.method = c.method;
  policy.top_pages = 8;
  policy.alpha = 1.25f;
  policy.granularity = c.granularity;
  policy.budget = c.budget;
  policy.strict = c.strict;
  policy.top_p = 0.9f;
  policy.mass_target = c.mass.target;
  policy.mass_temperature = c.mass.temperature;
  policy.min_pages = c.mass.min_pages;
  policy.max_pages = c.mass.max_pages;
  policy.mass_scope = c.mass.scope;
  if (c.retrieval) {
    policy.heads = HeadMode::kRetrieval;
    for (int i = 0; i < m.num_layers * m.num_q_heads; ++i)
      policy.retrieval_heads.push_back(rng() % 2);
  }
  // A case whose floor or ceiling must bind keeps core/'s lists without them; a
  // case of the list scope, core/'s lists of the head scope.
  std::vector<std::vector<int32_t>> unlimited_lists;
  const int heads_per_list =
      c.granularity == Granularity::kPerKvHead ? c.q_heads / c.kv_heads : c.q_heads;
  const bool list_scope = c.budget == Budget::kMass && c.mass.scope == MassScope::kList &&
                          c.method != Method::kOff && heads_per_list >= 2;
  if (c.mass.limits_bind || list_scope) {
    SelectPolicy unlimited = policy;
    if (c.mass.limits_bind) unlimited.min_pages = unlimited.max_pages = 0;
    if (list_scope) unlimited.mass_scope = MassScope::kHead;
    ASSERT_TRUE(reference->Select(inputs(), unlimited, buffers.Outputs(), nullptr).ok());
    for (int layer = 0; layer < m.num_layers; ++layer) {
      for (int b = 0; b < batch; ++b) {
        for (int list = 0; list < lists; ++list) {
          const auto l = buffers.VisitBlocks(layer, b, list);
          unlimited_lists.emplace_back(l.begin(), l.end());
        }
      }
    }
  }
  StepStats want_stats;
  ASSERT_TRUE(reference->Select(inputs(), policy, buffers.Outputs(), &want_stats).ok());
  if (c.mass.limits_bind || list_scope) {
    int changed = 0;
    for (int layer = 0, i = 0; layer < m.num_layers; ++layer) {
      for (int b = 0; b < batch; ++b) {
        for (int list = 0; list < lists; ++list, ++i) {
          const auto l = buffers.VisitBlocks(layer, b, list);
          changed += std::vector<int32_t>(l.begin(), l.end()) != unlimited_lists[i];
        }
      }
    }
    EXPECT_GT(changed, 0) << "min_pages/max_pages bind in no list, or the list scope changes no "
                             "list: the case tests nothing of them";
  }

  // Paths held to core/ each alone. questclt: its octet path (d of 64, 128,
  // 256; the default there) and the general one (any d;
  // GpuSelectorOptions::register_sums). jl's query terms: built by the scoring
  // blocks (the default where each row fits one block), by the terms kernel that
  // holds Φ in registers (TermsKernelHeld: d of 64, 128, 256) and by the one for
  // any d and m (TermsKernel; GpuSelectorOptions::terms_general; d = 96 cases
  // take it for ‖q‖). Past the default, each TermsKernelHeld warp takes runs of
  // three (row, head) pairs (GpuSelectorOptions::terms_run: runs across rows and
  // a shorter last one); questclt's second path so for ‖q‖.
  enum class Path { kDefault, kSecond, kTermsGeneral };
  std::vector<Path> paths{Path::kDefault};
  if (!c.strict && (c.method == Method::kQuestClt || c.method == Method::kJl)) {
    paths.push_back(Path::kSecond);
  }
  if (!c.strict && c.method == Method::kJl) paths.push_back(Path::kTermsGeneral);
  for (const Path path : paths) {
    const bool second = path != Path::kDefault;
    SCOPED_TRACE(!second                         ? "the default path"
                 : c.method == Method::kQuestClt ? "questclt's general path"
                 : path == Path::kSecond         ? "jl's terms kernel (Φ in registers)"
                                                 : "jl's terms kernel for any d and m");
    const gpu::GpuSelectorOptions options{.register_sums = second && c.method == Method::kQuestClt,
                                          .terms_kernel = second && c.method == Method::kJl,
                                          .terms_run = second ? 3 : 0,
                                          .terms_general = path == Path::kTermsGeneral};
    auto gpu_selector = gpu::GpuSelector::Create(m, 0, batch, buffers.max_groups(), options);
    ASSERT_TRUE(gpu_selector.ok()) << gpu_selector.status();
    const testing::DeviceStep got =
        testing::SelectOnDevice(**gpu_selector, buffers, batch, rows, policy, nullptr, -1, nullptr,
                                {}, narrow.empty() ? nullptr : &narrow_queries);
    ASSERT_TRUE(got.status.ok()) << got.status;

    // Equal visit sets, except groups whose score sits within fp32 tolerance of a
    // head's cut (the GPU sums in another order): at most one group on each side
    // of a list's cut, that is a boundary moved by one group, or two near-equal
    // groups that traded places (as the fixed budget's do; with the fixed budget
    // the count of each list is exact).
    int near_cut = 0;
    for (int layer = 0; layer < m.num_layers; ++layer) {
      for (int b = 0; b < batch; ++b) {
        for (int list = 0; list < lists; ++list) {
          const auto want = buffers.VisitBlocks(layer, b, list);
          const std::vector<int32_t> list_blocks =
              got.List(batch, lists, buffers.max_blocks(), layer, b, list);
          if (c.budget == Budget::kFixed) {
            EXPECT_EQ(list_blocks.size(), want.size()) << "layer " << layer << " row " << b;
          }
          if (std::vector<int32_t>(want.begin(), want.end()) == list_blocks) continue;
          const int64_t n = GroupsFor(rows[b].context_tokens, m);
          const auto a = testing::VisitedGroups(buffers, b, want, n);
          const auto g = testing::VisitedGroups(buffers, b, list_blocks, n);
          const testing::GroupDifference d = testing::DifferingGroups(a, g);
          near_cut += d.total();
          EXPECT_TRUE(d.NearCut())
              << "layer " << layer << " row " << b << " list " << list << ": " << d.only_want
              << " groups only core/ visits, " << d.only_got << " only the GPU";
        }
      }
    }
    EXPECT_LE(near_cut, 4) << "more disagreements than fp32 ties explain";
    EXPECT_EQ(got.stats.groups_total, want_stats.groups_total);
    EXPECT_EQ(got.stats.summary_bytes_read, want_stats.summary_bytes_read);
    if (near_cut == 0) {
      EXPECT_EQ(got.stats.groups_visited, want_stats.groups_visited);
      EXPECT_EQ(got.stats.kv_bytes_read_est, want_stats.kv_bytes_read_est);
    }
  }
}

std::string CaseName(const ::testing::TestParamInfo<GpuCase>& p) {
  const GpuCase& c = p.param;
  std::string name = std::string(MethodName(c.method)) == "1pc" ? "onepc" : MethodName(c.method);
  name += "_d" + std::to_string(c.d) + "_g" + std::to_string(c.group_blocks);
  if (c.retrieval) name += "_retrieval";
  if (c.sketch_dim != 8) name += "_m" + std::to_string(c.sketch_dim);
  if (c.granularity == Granularity::kPerKvHead) name += "_per_kv_head";
  if (c.budget != Budget::kThreshold) name += std::string("_") + BudgetName(c.budget);
  if (c.strict) name += "_strict";
  if (c.tied > 0) name += "_tied" + std::to_string(c.tied);
  if (c.quest8) name += "_quest8";
  if (c.query_dtype != DType::kFloat32) name += std::string("_q") + DTypeName(c.query_dtype);
  if (c.budget == Budget::kMass) {
    // e.g. _p099_t05_min24_max0: target 0.99, τ 0.5
    auto digits = [](float x) {
      std::string d = std::to_string(x);
      d.erase(d.find_last_not_of('0') + 1);
      if (d.back() == '.') d.pop_back();
      d.erase(std::remove(d.begin(), d.end(), '.'), d.end());
      return d;
    };
    name += "_p" + digits(c.mass.target) + "_t" + digits(c.mass.temperature) + "_min" +
            std::to_string(c.mass.min_pages) + "_max" + std::to_string(c.mass.max_pages);
    if (c.mass.scope == MassScope::kList) name += "_list";
  }
  return name;
}

// gtest prints the case by its name rather than its bytes.
void PrintTo(const GpuCase& c, std::ostream* os) {
  *os << CaseName(::testing::TestParamInfo<GpuCase>(c, 0));
}

constexpr Granularity kUnion = Granularity::kUnion, kPerKvHead = Granularity::kPerKvHead;

INSTANTIATE_TEST_SUITE_P(
    Methods, GpuStepTest,
    ::testing::Values(
        GpuCase{Method::kJl, 128, 32, 8, 8, false}, GpuCase{Method::kJl, 64, 4, 4, 1, false},
        GpuCase{Method::kJl, 256, 16, 2, 4, true}, GpuCase{Method::kOnePc, 128, 8, 2, 8, false},
        GpuCase{Method::kFro, 128, 8, 2, 8, false}, GpuCase{Method::kQuest, 128, 8, 2, 2, false},
        GpuCase{Method::kOff, 64, 4, 2, 8, false}, GpuCase{Method::kJl, 128, 8, 2, 8, false, 4},
        GpuCase{Method::kJl, 128, 8, 2, 8, false, 16},
        GpuCase{Method::kJl, 128, 8, 2, 8, false, 12},
        GpuCase{Method::kJl, 128, 8, 2, 8, false, 8, kPerKvHead},
        GpuCase{Method::kQuest, 256, 16, 4, 4, true, 8, kPerKvHead},
        GpuCase{Method::kQuestClt, 128, 8, 2, 2, false},
        GpuCase{Method::kQuestClt, 64, 9, 3, 8, false},
        GpuCase{Method::kQuestClt, 256, 16, 4, 4, true, 8, kPerKvHead}),
    CaseName);

// 16-bit queries, as engines hand them over: every kernel that loads a query
// (the terms kernel, jl's terms built in the scoring blocks, questclt's and
// quest's widened queries) reads binary16 and bfloat16.
GpuCase WithQueries(GpuCase c, DType dtype) {
  c.query_dtype = dtype;
  return c;
}
constexpr DType kHalf = DType::kFloat16, kBf16 = DType::kBFloat16;
INSTANTIATE_TEST_SUITE_P(
    QueryTypes, GpuStepTest,
    ::testing::Values(WithQueries(GpuCase{Method::kJl, 128, 32, 8, 8, false}, kHalf),
                      WithQueries(GpuCase{Method::kJl, 128, 32, 8, 8, true}, kBf16),
                      WithQueries(GpuCase{Method::kQuestClt, 128, 8, 2, 2, false}, kBf16),
                      WithQueries(GpuCase{Method::kQuestClt, 64, 9, 3, 8, false}, kHalf),
                      WithQueries(GpuCase{Method::kQuest, 128, 8, 2, 2, false}, kBf16),
                      WithQueries(GpuCase{Method::kQuest, 128, 8, 2, 8, false, 8, kUnion,
                                          Budget::kThreshold, true},
                                  kHalf)),
    CaseName);

// The warp-read sums of quest, questclt and strict mode (gpu/warp_sums.cuh): passes of 4
// heads (GQA ratio <= 4) and of 8 (ratio 8, and 16 in two batches), fewer heads
// than a pass holds (ratio 1), d = 64 (half the lanes idle) and 256 (two runs
// of 128 words), and the quest part at other offsets (m = 4, 12, 16).
INSTANTIATE_TEST_SUITE_P(
    WarpSums, GpuStepTest,
    ::testing::Values(
        GpuCase{Method::kQuest, 128, 16, 2, 8, false}, GpuCase{Method::kQuest, 64, 32, 2, 4, true},
        GpuCase{Method::kQuest, 64, 4, 4, 1, false},
        GpuCase{Method::kQuest, 128, 8, 2, 8, false, 4},
        GpuCase{Method::kQuest, 128, 8, 2, 8, false, 12},
        GpuCase{Method::kQuest, 256, 16, 2, 2, false, 16, kPerKvHead},
        GpuCase{Method::kJl, 128, 16, 2, 8, false, 8, kUnion, Budget::kThreshold, true},
        GpuCase{Method::kQuest, 64, 32, 2, 4, true, 12, kPerKvHead, Budget::kThreshold, true},
        GpuCase{Method::kJl, 256, 8, 8, 2, false, 4, kUnion, Budget::kThreshold, true},
        // questclt's warp-read sums: passes of 4 and 8 heads, one head, d 64 and 256.
        GpuCase{Method::kQuestClt, 128, 16, 2, 8, false},
        GpuCase{Method::kQuestClt, 64, 4, 4, 1, false},
        GpuCase{Method::kQuestClt, 256, 16, 2, 2, false, 16, kPerKvHead},
        GpuCase{Method::kQuestClt, 64, 32, 2, 4, true, 12, kPerKvHead},
        // d = 96 (no octet path: a partial run of words), the fixed and mass
        // budgets, and runs of 3 records that tie exactly (each case runs both
        // paths where d has an octet path).
        GpuCase{Method::kQuestClt, 96, 8, 2, 1, false, 8, kUnion, Budget::kFixed},
        GpuCase{Method::kQuestClt, 128, 8, 2, 2, false, 8, kPerKvHead, Budget::kMass},
        GpuCase{
            Method::kQuestClt, 128, 8, 2, 2, false, 8, kUnion, Budget::kThreshold, false, {}, 3}),
    CaseName);

// questclt over the quest8 part (the records also hold the 16-bit part, which
// quest and strict keep reading): the octet path (d 64, 128, 256; g = 1 and the
// fixed and mass budgets, whose rows exceed or bypass the fused kernel) and the
// general one, the fused kernel (threshold, up to 256 groups), passes of 4 and
// 8 heads, one head, and d = 96 (general path only).
GpuCase Quest8(GpuCase c) {
  c.quest8 = true;
  return c;
}
INSTANTIATE_TEST_SUITE_P(
    Quest8, GpuStepTest,
    ::testing::Values(
        Quest8({Method::kQuestClt, 128, 32, 8, 1, false}),
        Quest8({Method::kQuestClt, 64, 4, 4, 1, false, 8, kPerKvHead, Budget::kFixed}),
        Quest8({Method::kQuestClt, 256, 16, 2, 1, true}),
        Quest8({Method::kQuestClt, 128, 8, 2, 2, false}),
        Quest8({Method::kQuestClt, 128, 8, 2, 2, false, 8, kPerKvHead, Budget::kMass}),
        Quest8({Method::kQuestClt, 96, 9, 3, 1, false, 8, kUnion, Budget::kFixed}),
        Quest8(
            {Method::kQuestClt, 64, 8, 8, 1, false, 4, kUnion, Budget::kThreshold, false, {}, 3}),
        Quest8({Method::kQuest, 128, 8, 2, 2, false}),
        Quest8({Method::kQuestClt, 128, 8, 2, 2, false, 8, kUnion, Budget::kThreshold, true})),
    CaseName);

INSTANTIATE_TEST_SUITE_P(
    Budgets, GpuStepTest,
    ::testing::Values(
        GpuCase{Method::kJl, 128, 32, 8, 8, false, 8, kUnion, Budget::kFixed},
        GpuCase{Method::kJl, 128, 32, 8, 8, false, 8, kPerKvHead, Budget::kFixed},
        GpuCase{Method::kQuest, 128, 8, 2, 2, true, 8, kUnion, Budget::kFixed},
        GpuCase{Method::kJl, 128, 32, 8, 8, false, 8, kUnion, Budget::kTopP},
        GpuCase{Method::kJl, 64, 4, 4, 1, false, 8, kPerKvHead, Budget::kTopP},
        GpuCase{Method::kOnePc, 128, 8, 2, 8, true, 8, kUnion, Budget::kTopP},
        GpuCase{Method::kJl, 128, 32, 8, 8, false, 8, kUnion, Budget::kThreshold, true},
        GpuCase{Method::kQuest, 128, 8, 2, 2, false, 8, kPerKvHead, Budget::kThreshold, true},
        GpuCase{Method::kOff, 64, 4, 2, 8, false, 8, kUnion, Budget::kFixed},
        // Exact ties: a few per cut (the fixed budget ranks them by shuffles),
        // and runs longer than a warp (it counts over every group instead).
        GpuCase{Method::kQuest, 128, 8, 2, 2, false, 8, kUnion, Budget::kFixed, false, {}, 3},
        GpuCase{Method::kJl, 128, 8, 2, 2, false, 8, kPerKvHead, Budget::kFixed, false, {}, 64},
        GpuCase{Method::kQuest, 128, 8, 2, 2, false, 8, kUnion, Budget::kThreshold, false, {}, 3}),
    CaseName);

// The mass budget: union and per-KV-head lists, the methods that score, targets
// 0.5…1, temperatures 0.5…4, floors and ceilings that bind and that do not.
// A ceiling above any row's groups (100000) never binds. Target 1 takes every
// group whose mass is above double rounding, so it runs with quest at τ = 4,
// whose smallest w here is about e^-17; jl's estimates spread much further
// (a group's place past rounding is arbitrary), so jl at target 1 runs only
// under a ceiling, and at τ = 1000, so that every group's w stays near 1 and
// the ceiling binds before rounding can stop the walk. At τ = 4 a row's
// fourth-best jl group already held 8e-17 of the best one's w, under the
// rounding of the total: core/'s walk never reached the goal (249 groups
// without the ceiling, so 6 with it) and the device's list lacked three of
// those six (seed 13433998473576987947, memcheck shard, 2026-11-26).
// The per-KV-head ceiling case likewise runs at τ = 1000: at τ = 4 jl's walk often
// reached 0.99 within three groups, so the ceiling of 3 bound in no list and the
// case's own check failed (seed 8605748270751858264, 2026-11-26, sixth session).
constexpr MassCase Mass(float target, float temperature, int min_pages = 0, int max_pages = 0,
                        bool limits_bind = false) {
  return {target, temperature, min_pages, max_pages, limits_bind};
}
// The list scope (core MarkByMassList): one cut per list over its heads' shares.
constexpr MassCase ListMass(float target, float temperature, int min_pages = 0, int max_pages = 0,
                            bool limits_bind = false) {
  return {target, temperature, min_pages, max_pages, limits_bind, MassScope::kList};
}
constexpr Budget kMass = Budget::kMass;
INSTANTIATE_TEST_SUITE_P(
    Mass, GpuStepTest,
    ::testing::Values(
        GpuCase{Method::kJl, 128, 32, 8, 8, false, 8, kUnion, kMass, false, Mass(0.9f, 1.0f)},
        GpuCase{Method::kJl, 128, 32, 8, 8, false, 8, kPerKvHead, kMass, false, Mass(0.99f, 4.0f)},
        GpuCase{Method::kQuest, 128, 8, 2, 2, false, 8, kUnion, kMass, false, Mass(0.5f, 0.5f)},
        GpuCase{Method::kQuest, 128, 8, 2, 2, false, 8, kPerKvHead, kMass, false,
                Mass(0.99f, 0.5f)},
        GpuCase{Method::kQuest, 64, 4, 4, 1, false, 8, kPerKvHead, kMass, false, Mass(1.0f, 4.0f)},
        GpuCase{Method::kJl, 64, 4, 4, 1, false, 8, kPerKvHead, kMass, false,
                Mass(1.0f, 1000.0f, 0, 6, true)},
        GpuCase{Method::kQuest, 128, 8, 2, 2, false, 8, kUnion, kMass, false,
                Mass(0.5f, 0.5f, 24, 0, true)},
        GpuCase{Method::kQuest, 64, 4, 4, 1, false, 8, kPerKvHead, kMass, false,
                Mass(0.5f, 1.0f, 12, 0, true)},
        GpuCase{Method::kJl, 128, 32, 8, 8, false, 8, kPerKvHead, kMass, false,
                Mass(0.99f, 1000.0f, 0, 3, true)},
        GpuCase{Method::kJl, 128, 8, 2, 8, false, 8, kUnion, kMass, false,
                Mass(0.9f, 1.0f, 5, 5, true)},
        GpuCase{Method::kQuest, 128, 8, 2, 2, false, 8, kUnion, kMass, false,
                Mass(0.9f, 1.0f, 0, 100000)},
        GpuCase{Method::kJl, 256, 16, 2, 4, true, 8, kUnion, kMass, false, Mass(0.9f, 1.0f, 1)},
        GpuCase{Method::kOnePc, 128, 8, 2, 8, false, 8, kPerKvHead, kMass, false, Mass(0.9f, 0.5f)},
        GpuCase{Method::kFro, 128, 8, 2, 8, false, 8, kUnion, kMass, false, Mass(0.99f, 1.0f)},
        GpuCase{Method::kJl, 128, 8, 2, 8, false, 12, kUnion, kMass, false, Mass(0.9f, 4.0f)},
        // Target 1 at a small τ: many groups of mass 0, which no walk may take (MassGoal). (Not
        // the list scope: at target 1 it keeps what the head scope keeps, which its case refuses.)
        GpuCase{Method::kQuest, 128, 8, 2, 2, false, 8, kUnion, kMass, false, Mass(1.0f, 0.05f)},
        GpuCase{Method::kJl, 128, 32, 8, 8, false, 8, kPerKvHead, kMass, false, Mass(1.0f, 0.05f)},
        GpuCase{Method::kOff, 64, 4, 2, 8, false, 8, kUnion, kMass, false, Mass(0.9f, 1.0f)},
        GpuCase{Method::kJl, 128, 32, 8, 8, false, 8, kUnion, kMass, false, ListMass(0.9f, 1.0f)},
        GpuCase{Method::kQuest, 128, 8, 2, 2, false, 8, kPerKvHead, kMass, false,
                ListMass(0.99f, 0.5f)},
        GpuCase{Method::kQuest, 128, 8, 2, 2, false, 8, kUnion, kMass, false,
                ListMass(0.5f, 0.5f, 24, 0, true)},
        GpuCase{Method::kJl, 128, 8, 2, 8, false, 8, kUnion, kMass, false,
                ListMass(0.9f, 1.0f, 5, 5, true)},
        GpuCase{Method::kJl, 64, 4, 4, 1, false, 8, kPerKvHead, kMass, false,
                ListMass(1.0f, 1000.0f, 0, 6, true)},
        // τ = 8: at τ = 1 jl's d = 256 masses were so peaked that one seed's head and list
        // scopes chose the same lists (2318214466763317890, 2026-11-26), which this case's
        // precondition refuses; flatter masses make the scopes differ.
        GpuCase{Method::kJl, 256, 16, 2, 4, true, 8, kUnion, kMass, false, ListMass(0.9f, 8.0f, 1)},
        Quest8({Method::kQuestClt, 128, 8, 2, 2, false, 8, kPerKvHead, kMass, false,
                ListMass(0.95f, 1.0f)}),
        GpuCase{Method::kOff, 64, 4, 2, 8, false, 8, kUnion, kMass, false, ListMass(0.9f, 1.0f)}),
    CaseName);

}  // namespace
}  // namespace eps
