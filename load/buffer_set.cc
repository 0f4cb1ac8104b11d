#include "load/buffer_set.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "client/cpp/engine_buffers.h"
#include "core/status.h"

namespace eps::load {
namespace {

absl::Status NoCoarseLevel() {
  return absl::FailedPreconditionError("the layout has no coarse level (coarse_blocks=0)");
}

absl::Status CheckSize(const char* what, size_t got, int64_t want) {
  if (got != static_cast<size_t>(want)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " has ", got, " elements, want ", want));
  }
  return absl::OkStatus();
}

class ShmBufferSet final : public BufferSet {
 public:
  explicit ShmBufferSet(std::unique_ptr<client::EngineBuffers> buffers)
      : buffers_(std::move(buffers)) {}

  v1::SharedBuffers Descriptors() const override { return buffers_->Descriptors(); }
  v1::Backend backend() const override { return v1::BACKEND_CPU; }
  int64_t max_groups() const override { return buffers_->max_groups(); }
  int64_t max_blocks() const override { return buffers_->max_blocks(); }

  absl::Status WriteSummaryPool(std::span<const float> pool) override {
    auto dst = buffers_->summary_pool();
    if (absl::Status s = CheckSize("summary pool", pool.size(), dst.size()); !s.ok()) return s;
    std::copy(pool.begin(), pool.end(), dst.begin());
    return absl::OkStatus();
  }
  absl::Status WriteGroupTable(std::span<const int32_t> table) override {
    return WriteRows(table, max_groups(), [&](int64_t r) { return buffers_->GroupRow(r); });
  }
  absl::Status WriteBlockTable(std::span<const int32_t> table) override {
    return WriteRows(table, max_blocks(), [&](int64_t r) { return buffers_->BlockRow(r); });
  }
  int64_t max_coarse_groups() const override { return buffers_->max_coarse_groups(); }
  absl::Status WriteCoarsePool(std::span<const float> pool) override {
    if (!buffers_->model().has_coarse_level()) return NoCoarseLevel();
    auto dst = buffers_->CoarseRecord(0, 0, 0);
    const int64_t want = buffers_->plan().coarse_pool_words;
    if (absl::Status s = CheckSize("coarse pool", pool.size(), want); !s.ok()) return s;
    std::copy(pool.begin(), pool.end(), dst.data());
    return absl::OkStatus();
  }
  absl::Status WriteCoarseTable(std::span<const int32_t> table) override {
    if (!buffers_->model().has_coarse_level()) return NoCoarseLevel();
    return WriteRows(table, max_coarse_groups(), [&](int64_t r) { return buffers_->CoarseRow(r); });
  }
  absl::Status SetFeedbackPattern(std::span<const float> pattern) override {
    if (!buffers_->shape().with_feedback) return NoFeedbackBuffer();
    RETURN_IF_ERROR(CheckSize("feedback pattern", pattern.size(),
                              buffers_->plan().ElementsOf(SharedBuffer::kFeedback)));
    feedback_pattern_ = pattern;
    return absl::OkStatus();
  }
  absl::Status WriteFeedback(std::span<const FeedbackRows> rows) override {
    const client::BufferPlan& plan = buffers_->plan();
    RETURN_IF_ERROR(CheckFeedbackRows(rows, plan, !feedback_pattern_.empty()));
    const ModelLayout& m = plan.model;
    for (const FeedbackRows& r : rows) {
      for (int layer = 0; layer < m.num_layers; ++layer) {
        for (int h = 0; h < m.num_q_heads; ++h) {
          std::copy_n(feedback_pattern_.begin() + plan.FeedbackIndex(layer, r.row, h), r.groups,
                      buffers_->FeedbackRow(layer, r.row, h).begin());
        }
      }
    }
    return absl::OkStatus();
  }
  absl::StatusOr<float> ReadFeedback(int layer, int64_t row, int q_head, int64_t group) override {
    RETURN_IF_ERROR(FeedbackEntry(buffers_->plan(), layer, row, q_head, group).status());
    return buffers_->FeedbackRow(layer, row, q_head)[group];
  }
  absl::Status WriteQueries(std::span<const float> queries) override {
    const ModelLayout& m = buffers_->model();
    const int64_t batch = buffers_->shape().max_batch;
    const int d = m.head_dim;
    if (absl::Status s = CheckSize("queries", queries.size(),
                                   buffers_->plan().ElementsOf(SharedBuffer::kQueries));
        !s.ok()) {
      return s;
    }
    for (int layer = 0; layer < m.num_layers; ++layer) {
      for (int64_t pos = 0; pos < batch; ++pos) {
        for (int h = 0; h < m.num_q_heads; ++h) {
          const int64_t at = ((layer * batch + pos) * m.num_q_heads + h) * d;
          std::copy_n(queries.begin() + at, d, buffers_->Query(layer, pos, h).begin());
        }
      }
    }
    return absl::OkStatus();
  }

 private:
  template <typename RowOf>
  absl::Status WriteRows(std::span<const int32_t> table, int64_t width, RowOf row_of) {
    const int64_t rows = buffers_->shape().max_seqs;
    if (absl::Status s = CheckSize("table", table.size(), rows * width); !s.ok()) return s;
    for (int64_t r = 0; r < rows; ++r) {
      std::copy_n(table.begin() + r * width, width, row_of(r).begin());
    }
    return absl::OkStatus();
  }

  std::unique_ptr<client::EngineBuffers> buffers_;
  std::span<const float> feedback_pattern_;  // borrowed (SetFeedbackPattern); empty before
};

}  // namespace

absl::Status BufferSet::SignalInputsReady(uint64_t) {
  return absl::FailedPreconditionError("async replies need device buffers (--backend=cuda)");
}
absl::Status BufferSet::WaitSelection(uint64_t step) { return SignalInputsReady(step); }
absl::Status BufferSet::ReleaseDense(uint64_t step) { return SignalInputsReady(step); }

absl::Status NoFeedbackBuffer() {
  return absl::FailedPreconditionError("the buffers have no feedback buffer (--feedback-share=0)");
}

absl::Status CheckFeedbackRows(std::span<const FeedbackRows> rows, const client::BufferPlan& plan,
                               bool have_pattern) {
  if (!plan.shape.with_feedback) return NoFeedbackBuffer();
  if (!have_pattern)
    return absl::FailedPreconditionError("WriteFeedback before SetFeedbackPattern");
  for (const FeedbackRows& r : rows) {
    if (r.row < 0 || r.row >= plan.shape.max_seqs) {
      return absl::InvalidArgumentError(absl::StrCat(
          "feedback row=", r.row, " is outside [0, max_seqs=", plan.shape.max_seqs, ")"));
    }
    if (r.groups < 0 || r.groups > plan.max_groups) {
      return absl::InvalidArgumentError(
          absl::StrCat("feedback groups=", r.groups, " of row ", r.row,
                       " is outside [0, max_groups=", plan.max_groups, "]"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> FeedbackEntry(const client::BufferPlan& plan, int layer, int64_t row,
                                      int q_head, int64_t group) {
  if (!plan.shape.with_feedback) return NoFeedbackBuffer();
  const ModelLayout& m = plan.model;
  if (layer < 0 || layer >= m.num_layers || row < 0 || row >= plan.shape.max_seqs || q_head < 0 ||
      q_head >= m.num_q_heads || group < 0 || group >= plan.max_groups) {
    return absl::InvalidArgumentError(
        absl::StrCat("feedback entry (layer ", layer, ", row ", row, ", q_head ", q_head,
                     ", group ", group, ") is outside [", m.num_layers, ", ", plan.shape.max_seqs,
                     ", ", m.num_q_heads, ", ", plan.max_groups, "]"));
  }
  return plan.FeedbackIndex(layer, row, q_head) + group;
}

client::BufferShape ClientShape(const BufferSetShape& shape) {
  client::BufferShape s;
  s.num_slots = shape.num_slots;
  s.max_seqs = shape.max_seqs;
  s.max_context = shape.max_context;
  s.max_batch = shape.max_batch;
  s.coarse_slots = shape.coarse_slots;
  s.with_feedback = shape.with_feedback;
  return s;
}

absl::StatusOr<std::unique_ptr<BufferSet>> CreateBufferSet(service::BackendKind backend,
                                                           const ModelLayout& model,
                                                           const BufferSetShape& shape,
                                                           int device) {
  if (backend == service::BackendKind::kCuda) return CreateDeviceBufferSet(model, shape, device);
  auto buffers = client::EngineBuffers::Create(model, ClientShape(shape), "load");
  if (!buffers.ok()) return buffers.status();
  return std::unique_ptr<BufferSet>(std::make_unique<ShmBufferSet>(std::move(*buffers)));
}

}  // namespace eps::load
