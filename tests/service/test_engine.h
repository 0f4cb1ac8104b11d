// A test engine: shared buffers from the client library, summaries from the
// core/ writer, and a check of epsd's outputs against the core/ reference run
// on the very same memory.
#pragma once

#include <algorithm>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "client/cpp/engine_buffers.h"
#include "core/layout.h"
#include "core/phi.h"
#include "core/step.h"
#include "core/summary.h"
#include "core/testing/synthetic.h"
#include "gtest/gtest.h"

namespace eps::testing {

inline ModelLayout SmallServiceModel() {
  ModelLayout m;
  m.num_layers = 2;
  m.num_q_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 32;
  m.block_size = 16;
  m.group_blocks = 2;
  m.sketch_dim = 8;
  m.phi_seed = 99;
  m.features = {.key_sum = true, .principal = false, .quest = true};
  return m;
}

class TestEngine {
 public:
  TestEngine(const ModelLayout& model, int64_t max_seqs, int64_t max_context, int64_t max_batch,
             uint64_t seed, Granularity granularity = Granularity::kUnion,
             bool with_feedback = false)
      : model_(model), rng_(seed) {
    client::BufferShape shape;
    shape.max_seqs = max_seqs;
    shape.max_context = max_context;
    shape.max_batch = max_batch;
    shape.num_slots = max_seqs * GroupsFor(max_context, model);
    shape.granularity = granularity;
    shape.coarse_slots = max_seqs * CoarseGroupsFor(max_context, model);  // 0 without the level
    shape.with_feedback = with_feedback;
    auto b = client::EngineBuffers::Create(model, shape, "test");
    EXPECT_TRUE(b.ok()) << b.status();
    buffers_ = std::move(*b);
    phi_ = std::make_unique<PhiBank>(*PhiBank::Create(
        model.phi_seed, model.num_layers, model.num_kv_heads, model.head_dim, model.sketch_dim));
    writer_ = std::make_unique<SummaryWriter>(model, *phi_);
    std::vector<int32_t> physical(max_seqs * buffers_->max_blocks());
    std::iota(physical.begin(), physical.end(), 0);
    std::shuffle(physical.begin(), physical.end(), rng_);
    for (int64_t row = 0; row < max_seqs; ++row) {
      auto groups = buffers_->GroupRow(row);
      for (int64_t p = 0; p < buffers_->max_groups(); ++p) {
        groups[p] = static_cast<int32_t>(row * buffers_->max_groups() + p);
      }
      auto blocks = buffers_->BlockRow(row);
      for (int64_t b2 = 0; b2 < buffers_->max_blocks(); ++b2) {
        blocks[b2] = physical[row * buffers_->max_blocks() + b2];
      }
      // Coarse slots in reverse order, so that a slot is never its coarse group's index.
      auto coarse = buffers_->CoarseRow(row);
      const int64_t mc = buffers_->max_coarse_groups();
      for (int64_t c = 0; c < mc; ++c) coarse[c] = static_cast<int32_t>(row * mc + (mc - 1 - c));
    }
    num_kv_blocks_ = static_cast<int64_t>(physical.size());
  }

  // Summaries of `tokens` synthetic tokens at table row `row` (and, with a coarse level,
  // the coarse records of the same keys), queries at batch position `pos`.
  void Fill(int32_t row, int64_t pos, int64_t tokens) {
    const int d = model_.head_dim;
    const int64_t gt = model_.group_tokens();
    for (int layer = 0; layer < model_.num_layers; ++layer) {
      for (int kvh = 0; kvh < model_.num_kv_heads; ++kvh) {
        SyntheticConfig config;
        config.head_dim = d;
        config.tokens = tokens;
        config.num_queries = model_.gqa_ratio();
        config.num_needles = 2;
        config.num_spans = 1;
        config.max_span_tokens = 32;
        config.seed = rng_();
        const SyntheticHead head = MakeSyntheticHead(config);
        for (int64_t p = 0, begin = 0; begin < tokens; ++p, begin += gt) {
          const int64_t count = std::min(gt, tokens - begin);
          auto record = buffers_->Record(buffers_->GroupRow(row)[p], layer, kvh);
          EXPECT_TRUE(writer_->Reset(record).ok());
          EXPECT_TRUE(writer_
                          ->Append(record, layer, kvh,
                                   {head.keys.data() + begin * d, DType::kFloat32, count, d})
                          .ok());
        }
        const int64_t ct = int64_t{model_.coarse_blocks} * model_.block_size;
        for (int64_t c = 0, begin = 0; ct > 0 && begin < tokens; ++c, begin += ct) {
          const int64_t count = std::min(ct, tokens - begin);
          auto record = buffers_->CoarseRecord(buffers_->CoarseRow(row)[c], layer, kvh);
          EXPECT_TRUE(writer_->Reset(record).ok());
          EXPECT_TRUE(writer_
                          ->Append(record, layer, kvh,
                                   {head.keys.data() + begin * d, DType::kFloat32, count, d})
                          .ok());
        }
        for (int r = 0; r < model_.gqa_ratio(); ++r) {
          auto q = buffers_->Query(layer, pos, kvh * model_.gqa_ratio() + r);
          std::copy_n(head.queries.begin() + r * d, d, q.begin());
        }
      }
    }
  }

  // Selection feedback as an attention would leave it for table row `row` of `tokens`
  // tokens: about half of the groups of every (layer, q head) get a log-sum-exp in
  // [-4, 4], the others NaN. Needs the feedback buffer (with_feedback).
  void FillFeedback(int32_t row, int64_t tokens) {
    const int64_t groups = GroupsFor(tokens, model_);
    std::uniform_real_distribution<float> lse(-4.0f, 4.0f);
    for (int layer = 0; layer < model_.num_layers; ++layer) {
      for (int h = 0; h < model_.num_q_heads; ++h) {
        auto entries = buffers_->FeedbackRow(layer, row, h);
        EXPECT_EQ(entries.size(), static_cast<size_t>(buffers_->max_groups()));
        for (int64_t p = 0; p < groups; ++p) {
          entries[p] = rng_() % 2 == 0 ? lse(rng_) : std::numeric_limits<float>::quiet_NaN();
        }
      }
    }
  }

  // The whole feedback buffer (empty without one).
  std::vector<float> Feedback() {
    const int64_t n = buffers_->plan().ElementsOf(SharedBuffer::kFeedback);
    if (n == 0) return {};
    const float* first = buffers_->FeedbackRow(0, 0, 0).data();
    return std::vector<float>(first, first + n);
  }

  v1::AttachRequest Attach(const std::string& engine_id) const {
    v1::AttachRequest a;
    a.set_engine_id(engine_id);
    v1::ModelLayout* l = a.mutable_layout();
    l->set_num_layers(model_.num_layers);
    l->set_num_q_heads(model_.num_q_heads);
    l->set_num_kv_heads(model_.num_kv_heads);
    l->set_head_dim(model_.head_dim);
    l->set_summary_layout(eps::kSummaryLayoutRevision);  // core/layout.h
    l->set_block_size(model_.block_size);
    l->set_group_blocks(model_.group_blocks);
    l->set_coarse_blocks(model_.coarse_blocks);
    l->set_sketch_dim(model_.sketch_dim);
    l->set_phi_seed(model_.phi_seed);
    l->mutable_features()->set_key_sum(model_.features.key_sum);
    l->mutable_features()->set_principal(model_.features.principal);
    l->mutable_features()->set_quest(model_.features.quest);
    l->mutable_features()->set_quest8(model_.features.quest8);
    *a.mutable_buffers() = buffers_->Descriptors();
    a.set_max_batch(static_cast<uint32_t>(buffers_->shape().max_batch));
    a.set_num_kv_blocks(num_kv_blocks_);
    return a;
  }

  static v1::BatchRow Row(int32_t table_row, int64_t tokens) {
    v1::BatchRow r;
    r.set_table_row(table_row);
    r.set_context_tokens(tokens);
    r.set_seq_id(1000 + table_row);
    return r;
  }

  // A SelectPages request of `session` at `step` over `rows`.
  static v1::SelectPagesRequest Step(const std::string& session, uint64_t step,
                                     const std::vector<v1::BatchRow>& rows) {
    v1::SelectPagesRequest r;
    r.set_session_id(session);
    r.set_step(step);
    for (const v1::BatchRow& row : rows) *r.add_rows() = row;
    return r;
  }

  // Runs the core/ reference over the same buffers and compares every list.
  // With `feedback` (a copy of the buffer as it was before the step: epsd consumes
  // the engine's), the reference reads that.
  ::testing::AssertionResult MatchesReference(const std::vector<v1::BatchRow>& rows,
                                              const SelectPolicy& policy = SelectPolicy{},
                                              std::vector<float> feedback = {}) {
    const client::BufferShape& shape = buffers_->shape();
    const int lists = shape.granularity == Granularity::kPerKvHead ? model_.num_kv_heads : 1;
    std::vector<int32_t> blocks(model_.num_layers * shape.max_batch * lists *
                                buffers_->max_blocks());
    std::vector<int32_t> counts(model_.num_layers * shape.max_batch * lists, -1);
    std::vector<StepRow> step_rows;
    for (const auto& r : rows) {
      step_rows.push_back(
          {.table_row = r.table_row(), .context_tokens = r.context_tokens(), .seq_id = r.seq_id()});
    }
    StepInputs in;
    in.summary_pool = buffers_->summary_pool().data();
    in.num_slots = shape.num_slots;
    in.group_table = buffers_->GroupRow(0).data();
    in.block_table = buffers_->BlockRow(0).data();
    in.max_seqs = shape.max_seqs;
    in.max_groups = buffers_->max_groups();
    in.max_blocks = buffers_->max_blocks();
    in.num_physical_blocks = num_kv_blocks_;
    if (model_.has_coarse_level()) {
      in.coarse_pool = buffers_->CoarseRecord(0, 0, 0).data();
      in.coarse_slots = shape.coarse_slots;
      in.coarse_table = buffers_->CoarseRow(0).data();
      in.max_coarse_groups = buffers_->max_coarse_groups();
    }
    if (!feedback.empty()) in.feedback = feedback.data();
    in.queries = buffers_->Query(0, 0, 0).data();
    in.max_batch = shape.max_batch;
    in.rows = step_rows;
    SelectPolicy p = policy;
    p.granularity = shape.granularity;
    auto selector = PageSelector::Create(model_, *phi_);
    StepStats stats;
    if (absl::Status s = selector->Select(in, p, {blocks.data(), counts.data()}, &stats); !s.ok()) {
      return ::testing::AssertionFailure() << "reference failed: " << s;
    }
    for (int layer = 0; layer < model_.num_layers; ++layer) {
      for (size_t i = 0; i < rows.size(); ++i) {
        for (int list = 0; list < lists; ++list) {
          const int64_t index = (layer * shape.max_batch + static_cast<int64_t>(i)) * lists + list;
          const auto got = buffers_->VisitBlocks(layer, static_cast<int64_t>(i), list);
          const std::vector<int32_t> want(
              blocks.begin() + index * buffers_->max_blocks(),
              blocks.begin() + index * buffers_->max_blocks() + counts[index]);
          if (std::vector<int32_t>(got.begin(), got.end()) != want) {
            return ::testing::AssertionFailure()
                   << "layer " << layer << " row " << i << " list " << list << ": epsd wrote "
                   << got.size() << " blocks, the reference " << want.size();
          }
        }
      }
    }
    return ::testing::AssertionSuccess();
  }

  client::EngineBuffers& buffers() { return *buffers_; }
  const ModelLayout& model() const { return model_; }
  int64_t num_kv_blocks() const { return num_kv_blocks_; }

 private:
  ModelLayout model_;
  std::mt19937_64 rng_;
  std::unique_ptr<client::EngineBuffers> buffers_;
  std::unique_ptr<PhiBank> phi_;
  std::unique_ptr<SummaryWriter> writer_;
  int64_t num_kv_blocks_ = 0;
};

}  // namespace eps::testing
