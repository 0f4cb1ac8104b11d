// One decode step's selection over the shared buffers (docs/design.md §5): the
// reference pre-pass that the CPU backend runs and the CUDA backend must match.
//
// The buffers' shapes and element types are core/buffer_contract.h's table
// (queries may also be fp16 or bf16); StepInputs and StepOutputs point into them.
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "absl/status/status.h"
#include "core/layout.h"
#include "core/phi.h"
#include "core/select.h"

namespace eps {

// One sequence of the step's batch; batch position i reads queries[:, i] and
// writes visit lists [:, i].
struct StepRow {
  int32_t table_row = 0;       // row of the group and block tables
  int64_t context_tokens = 0;  // tokens in the KV cache, the newest included
  uint64_t seq_id = 0;         // the engine's id, for logs only
};

struct StepInputs {
  const float* summary_pool = nullptr;
  int64_t num_slots = 0;
  const int32_t* group_table = nullptr;
  const int32_t* block_table = nullptr;
  int64_t max_seqs = 0;
  int64_t max_groups = 0;
  int64_t max_blocks = 0;
  int64_t num_physical_blocks = -1;  // block ids must be below this; -1: not checked
  // The coarse level (ModelLayout.coarse_blocks > 0): its records, [coarse_slots,
  // layers, kv_heads, record_words], and its table [max_seqs, max_coarse_groups].
  // Needed only when the policy uses the level (SelectPolicy::UsesCoarseLevel).
  const float* coarse_pool = nullptr;
  int64_t coarse_slots = 0;
  const int32_t* coarse_table = nullptr;
  int64_t max_coarse_groups = 0;
  // Selection feedback (docs/policy-selection.md, "Selection feedback"), optional:
  // [num_layers, max_seqs, num_q_heads, max_groups] float32, by table row. The
  // engine's attention writes, for each group it visited, log Σ exp(q·k/√d) over
  // the group's keys with that step's query (any per-(row, layer, head) constant
  // added); every other entry is NaN. A scored head ranks a group with a finite
  // entry by √d times it, every other group by its score plus the head's median
  // of (√d·entry − score) over the groups that have both. After a step that
  // succeeded, every entry of its rows' groups is NaN again (consumed), so an
  // entry never outlives the step after the attention that wrote it. Strict
  // mode ranks without it but consumes it too.
  float* feedback = nullptr;
  const void* queries = nullptr;
  DType query_dtype = DType::kFloat32;
  int64_t max_batch = 0;
  std::span<const StepRow> rows;
};

struct StepOutputs {
  int32_t* visit_blocks = nullptr;
  int32_t* visit_count = nullptr;
};

// Per-step counters (docs/design.md §7), summed over rows, layers and output lists.
struct StepStats {
  int64_t groups_total = 0;
  int64_t groups_visited = 0;
  int64_t blocks_total = 0;
  int64_t blocks_visited = 0;
  int64_t kv_bytes_dense = 0;     // K and V bytes a dense step reads
  int64_t kv_bytes_read_est = 0;  // K and V bytes of the visited blocks
  int64_t summary_bytes_read = 0;

  void Add(const StepStats& other);
};

// Checks what rows[i] alone decides: its table row is in [0, max_seqs) and its
// context fits max_blocks and max_groups (and max_coarse_groups, with a coarse
// level whose table is given). Reads no buffer, so every backend
// (host or device memory) calls it before launching anything.
absl::Status CheckRowFits(const ModelLayout& model, const StepInputs& in, size_t i);

// Checks that a step whose policy uses the coarse level (SelectPolicy::UsesCoarseLevel)
// has the coarse pool and table. Reads no buffer: every backend calls it before
// launching anything.
absl::Status CheckCoarseInputs(const ModelLayout& model, const SelectPolicy& policy,
                               const StepInputs& in);

// Asked before each (row, layer) of a step: a status other than OK ends the step with it,
// the outputs untouched (a server's call whose client gave up; empty: never asked).
using StopCheck = std::function<absl::Status()>;

// The reference selector. Thread safety: Select is const and reentrant.
class PageSelector {
 public:
  // `phi` must match `model` (seed, layers, kv_heads, d, m) and outlive this.
  static absl::StatusOr<PageSelector> Create(const ModelLayout& model, const PhiBank& phi);

  // Validates every row, slot, block id and query first, then scores and
  // selects into scratch; the visit lists reach `out` only when the whole step
  // succeeded, so any error (a NaN summary too) leaves the outputs untouched.
  absl::Status Select(const StepInputs& in, const SelectPolicy& policy, const StepOutputs& out,
                      StepStats* stats, const StopCheck& stop = {}) const;

  const ModelLayout& model() const { return model_; }
  const SummaryLayout& summary_layout() const { return layout_; }

 private:
  PageSelector(const ModelLayout& model, const PhiBank& phi)
      : model_(model), layout_(SummaryLayout::For(model)), phi_(&phi) {}

  absl::Status ValidateInputs(const StepInputs& in, const SelectPolicy& policy) const;

  ModelLayout model_;
  SummaryLayout layout_;
  const PhiBank* phi_;
};

}  // namespace eps
