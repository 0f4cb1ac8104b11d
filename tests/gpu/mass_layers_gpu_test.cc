// A mass budget per layer (SelectPolicy::mass_layers) in the GPU pre-pass against
// core/, and a replayed graph reading each step's own settings; skips without a device.
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/phi.h"
#include "core/summary.h"
#include "gpu/step.h"
#include "gtest/gtest.h"
#include "tests/core/step_fixture.h"
#include "tests/core/test_util.h"
#include "tests/gpu/device_step.h"

namespace eps {
namespace {

constexpr Granularity kUnion = Granularity::kUnion, kPerKvHead = Granularity::kPerKvHead;
using testing::Download;
using testing::Upload;

// A mass budget per layer (SelectPolicy::mass_layers): each layer selects with its own
// setting, on the device as in core/, for both scopes and both list granularities.
struct MassLayersCase {
  Granularity granularity;
  MassScope scope;
};

class GpuMassLayersTest : public ::testing::TestWithParam<MassLayersCase> {
 protected:
  static constexpr int kBatch = 4;

  void SetUp() override {
    if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
    const uint64_t seed = testing::TestSeed();
    trace_ = testing::SeedTrace(seed);
    std::mt19937_64 rng(seed);
    m_ = testing::RandomModel(3, 8, 2, 128, 2, 8, rng);
    phi_.emplace(
        *PhiBank::Create(m_.phi_seed, m_.num_layers, m_.num_kv_heads, m_.head_dim, m_.sketch_dim));
    reference_.emplace(*PageSelector::Create(m_, *phi_));
    SummaryWriter writer(m_, *phi_);
    const int64_t max_context = 6000;
    buffers_.emplace(m_, kBatch, max_context, kBatch, GetParam().granularity);
    for (int r = 0; r < kBatch; ++r) {  // long rows: room for every floor and ceiling
      const int64_t tokens = max_context / 2 + static_cast<int64_t>(rng() % (max_context / 2));
      testing::WriteSequence(*buffers_, writer, r, r, tokens, 1 + r % 3,
                             testing::GroupShapes::kMixedRank, rng);
      rows_.push_back({.table_row = r, .context_tokens = tokens, .seq_id = 0});
    }
  }

  int lists() const {
    return GetParam().granularity == Granularity::kPerKvHead ? m_.num_kv_heads : 1;
  }

  // Three layers whose settings differ in every field; `other` changes every layer's.
  SelectPolicy Policy(bool other) const {
    SelectPolicy policy;
    policy.method = Method::kJl;
    policy.budget = Budget::kMass;
    policy.granularity = GetParam().granularity;
    policy.mass_scope = GetParam().scope;
    policy.mass_layers =
        other
            ? std::vector<MassSetting>{{0.99f, 4.0f, 0, 0}, {0.5f, 0.5f, 9, 0}, {0.7f, 2.0f, 0, 2}}
            : std::vector<MassSetting>{
                  {0.5f, 0.5f, 0, 0}, {0.99f, 4.0f, 0, 3}, {0.9f, 1.0f, 12, 0}};
    return policy;
  }

  // core/'s lists for `policy`, [layers, batch, lists] (left in buffers_ too).
  std::vector<std::vector<int32_t>> CoreLists(const SelectPolicy& policy) {
    EXPECT_TRUE(
        reference_->Select(buffers_->Inputs(rows_), policy, buffers_->Outputs(), nullptr).ok());
    std::vector<std::vector<int32_t>> all;
    for (int layer = 0; layer < m_.num_layers; ++layer) {
      for (int b = 0; b < kBatch; ++b) {
        for (int list = 0; list < lists(); ++list) {
          const auto l = buffers_->VisitBlocks(layer, b, list);
          all.emplace_back(l.begin(), l.end());
        }
      }
    }
    return all;
  }

  // The groups where the device's lists differ from `want` (CoreLists'), at most one
  // per list: a group whose mass sits within rounding of its cut (the GPU sums in
  // another order).
  int GroupsOffCore(const testing::DeviceStep& got,
                    const std::vector<std::vector<int32_t>>& want) const {
    int off = 0;
    for (int layer = 0, i = 0; layer < m_.num_layers; ++layer) {
      for (int b = 0; b < kBatch; ++b) {
        for (int list = 0; list < lists(); ++list, ++i) {
          const std::vector<int32_t> l =
              got.List(kBatch, lists(), buffers_->max_blocks(), layer, b, list);
          if (l == want[i]) continue;
          const int64_t n = GroupsFor(rows_[b].context_tokens, m_);
          const auto a = testing::VisitedGroups(*buffers_, b, want[i], n);
          const auto g = testing::VisitedGroups(*buffers_, b, l, n);
          const testing::GroupDifference d = testing::DifferingGroups(a, g);
          EXPECT_TRUE(d.NearCut()) << "layer " << layer << " row " << b << " list " << list;
          off += d.total();
        }
      }
    }
    return off;
  }

  // Whether two sets of lists (CoreLists') differ in every layer.
  bool DifferInEveryLayer(const std::vector<std::vector<int32_t>>& a,
                          const std::vector<std::vector<int32_t>>& b) const {
    const size_t per_layer = static_cast<size_t>(kBatch * lists());
    for (int layer = 0; layer < m_.num_layers; ++layer) {
      if (std::equal(a.begin() + layer * per_layer, a.begin() + (layer + 1) * per_layer,
                     b.begin() + layer * per_layer)) {
        return false;
      }
    }
    return true;
  }

  std::string trace_;
  ModelLayout m_;
  std::optional<PhiBank> phi_;
  std::optional<PageSelector> reference_;
  std::optional<testing::StepBuffers> buffers_;
  std::vector<StepRow> rows_;
};

TEST_P(GpuMassLayersTest, EachLayerSelectsWithItsOwnSettingAsCore) {
  SCOPED_TRACE(trace_);
  const SelectPolicy policy = Policy(false);
  SelectPolicy layer0 = policy;  // every layer with layer 0's setting
  layer0.mass_layers.assign(m_.num_layers, policy.mass_layers[0]);
  const auto uniform = CoreLists(layer0);
  const auto want = CoreLists(policy);
  ASSERT_NE(uniform, want) << "the settings per layer change no list: the case tests nothing";
  auto selector = gpu::GpuSelector::Create(m_, 0, kBatch, buffers_->max_groups());
  ASSERT_TRUE(selector.ok()) << selector.status();
  const testing::DeviceStep got =
      testing::SelectOnDevice(**selector, *buffers_, kBatch, rows_, policy);
  ASSERT_TRUE(got.status.ok()) << got.status;
  EXPECT_LE(GroupsOffCore(got, want), 4) << "more disagreements than fp32 ties explain";
}

// Steps of one shape replay one captured graph; the settings per layer live in device
// memory, so a replay after they change must select with the new ones: every step
// equals kernels launched one by one, exactly, and core/'s lists up to ties.
TEST_P(GpuMassLayersTest, AReplayedStepReadsTheStepsOwnSettings) {
  SCOPED_TRACE(trace_);
  testing::StepBuffers& b = *buffers_;  // read only (its accessors are not const)
  const StepInputs host_in = b.Inputs(rows_);
  const int64_t query_count = int64_t{m_.num_layers} * kBatch * m_.num_q_heads * m_.head_dim;
  const int64_t list_count = int64_t{m_.num_layers} * kBatch * lists();
  float* pool = Upload(b.pool());
  int32_t* groups = Upload(b.group_table());
  int32_t* blocks = Upload(b.block_table());
  float* queries =
      Upload(std::vector<float>(static_cast<const float*>(host_in.queries),
                                static_cast<const float*>(host_in.queries) + query_count));
  int32_t* visit[2] = {Upload(std::vector<int32_t>(list_count * b.max_blocks(), -1)),
                       Upload(std::vector<int32_t>(list_count * b.max_blocks(), -1))};
  int32_t* count[2] = {Upload(std::vector<int32_t>(list_count, -1)),
                       Upload(std::vector<int32_t>(list_count, -1))};
  auto graphs = gpu::GpuSelector::Create(m_, 0, kBatch, b.max_groups());
  auto direct = gpu::GpuSelector::Create(m_, 0, kBatch, b.max_groups(), {.graphs = false});
  ASSERT_TRUE(graphs.ok() && direct.ok());
  gpu::GpuSelector* selectors[2] = {graphs->get(), direct->get()};
  StepInputs in = host_in;
  in.summary_pool = pool;
  in.group_table = groups;
  in.block_table = blocks;
  in.queries = queries;
  std::vector<std::vector<int32_t>> previous;
  for (const bool other : {false, true, false}) {  // same shape: the graph is replayed
    SCOPED_TRACE(other ? "the other settings" : "the first settings");
    const SelectPolicy policy = Policy(other);
    testing::DeviceStep got[2];
    for (int k = 0; k < 2; ++k) {
      const absl::Status status =
          selectors[k]->Select(in, policy, {visit[k], count[k]}, &got[k].stats, nullptr);
      ASSERT_TRUE(status.ok()) << status;
      got[k].visit_blocks = Download(visit[k], list_count * b.max_blocks());
      got[k].visit_count = Download(count[k], list_count);
    }
    EXPECT_EQ(got[0].visit_count, got[1].visit_count);
    EXPECT_EQ(got[0].visit_blocks, got[1].visit_blocks);
    const auto want = CoreLists(policy);
    if (!previous.empty()) {
      EXPECT_TRUE(DifferInEveryLayer(previous, want))
          << "the two settings select alike in some layer: the case tests nothing of it";
    }
    EXPECT_LE(GroupsOffCore(got[0], want), 4) << "more disagreements than fp32 ties explain";
    previous = want;
  }
  for (void* p :
       {static_cast<void*>(pool), static_cast<void*>(groups), static_cast<void*>(blocks),
        static_cast<void*>(queries), static_cast<void*>(visit[0]), static_cast<void*>(visit[1]),
        static_cast<void*>(count[0]), static_cast<void*>(count[1])}) {
    cudaFree(p);
  }
}

INSTANTIATE_TEST_SUITE_P(MassLayers, GpuMassLayersTest,
                         ::testing::Values(MassLayersCase{kUnion, MassScope::kHead},
                                           MassLayersCase{kPerKvHead, MassScope::kHead},
                                           MassLayersCase{kUnion, MassScope::kList},
                                           MassLayersCase{kPerKvHead, MassScope::kList}),
                         [](const ::testing::TestParamInfo<MassLayersCase>& p) {
                           return std::string(p.param.granularity == kUnion ? "union"
                                                                            : "per_kv_head") +
                                  (p.param.scope == MassScope::kHead ? "_head" : "_list");
                         });

}  // namespace
}  // namespace eps
