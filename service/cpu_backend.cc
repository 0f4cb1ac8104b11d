#include "service/cpu_backend.h"

#include <atomic>
#include <chrono>

#include "core/visit_list.h"

namespace eps::service {
namespace {

// The caller holds session.step_mu. Publishes selection_done = step after the
// visit lists when a flags buffer is attached.
absl::Status RunCpuStep(Session& session, std::span<const StepRow> rows, uint64_t step,
                        const SelectPolicy& policy, StepStats* stats) {
  const SessionBuffers& b = session.buffers;
  const StepInputs in = SessionStepInputs(session, rows);
  const StepOutputs out = SessionStepOutputs(session);
  if (absl::Status s = session.selector->Select(in, policy, out, stats); !s.ok()) return s;
  if (b.has_flags) {
    // flags = [inputs_ready, selection_done]; release orders the outputs before it.
    std::atomic_ref<uint64_t> done(reinterpret_cast<uint64_t*>(b.flags.data)[1]);
    done.store(step, std::memory_order_release);
  }
  return absl::OkStatus();
}

}  // namespace

void AppendInlineVisitLists(const Session& session, std::span<const StepRow> rows,
                            v1::SelectPagesResponse* response) {
  const SessionBuffers& b = session.buffers;
  const int lists = session.output_granularity == Granularity::kPerKvHead
                        ? session.model.num_kv_heads
                        : 1;
  const auto* blocks = reinterpret_cast<const int32_t*>(b.visit_blocks.data);
  const auto* counts = reinterpret_cast<const int32_t*>(b.visit_count.data);
  for (int layer = 0; layer < session.model.num_layers; ++layer) {
    for (size_t i = 0; i < rows.size(); ++i) {
      for (int list = 0; list < lists; ++list) {
        const int64_t index =
            (static_cast<int64_t>(layer) * session.max_batch + static_cast<int64_t>(i)) * lists +
            list;
        v1::VisitList* v = response->add_visit_lists();
        v->set_layer(layer);
        v->set_batch_index(static_cast<uint32_t>(i));
        v->set_kv_head(list);
        const int32_t count = counts[index];
        v->mutable_blocks()->Add(blocks + index * session.max_blocks,
                                 blocks + index * session.max_blocks + count);
        v->set_visited_tokens(
            VisitedTokens(count, rows[i].context_tokens, session.model.block_size));
      }
    }
  }
}

}  // namespace eps::service

namespace eps::service {
namespace {

class CpuBackend final : public StepBackend {
 public:
  const char* name() const override { return "cpu"; }
  absl::Status Run(Session& session, std::span<const StepRow> rows, uint64_t step,
                   const SelectPolicy& policy, bool /*async: never*/, StepResult* result) override {
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = RunCpuStep(session, rows, step, policy, &result->stats);
    result->prepass_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
    return s;
  }
};

}  // namespace

std::unique_ptr<StepBackend> MakeCpuBackend() { return std::make_unique<CpuBackend>(); }

}  // namespace eps::service
