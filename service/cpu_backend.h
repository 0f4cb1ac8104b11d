// The CPU backend: runs one step of a session with the core/ reference
// selector over host memory, and reads inline outputs back for the reply.
#pragma once

#include <span>

#include "absl/status/status.h"
#include "core/step.h"
#include "eps/v1/page_selector.pb.h"
#include "service/backend.h"
#include "service/session.h"

namespace eps::service {

// Runs the step; the caller holds session.step_mu. Writes visit lists into the
// session's output buffers and, when a flags buffer is attached, publishes
// selection_done = step after them.
absl::Status RunCpuStep(Session& session, std::span<const StepRow> rows, uint64_t step,
                        const SelectPolicy& policy, StepStats* stats);

// Copies the visit lists of `rows` out of inline output buffers into `response`.
void AppendInlineVisitLists(const Session& session, std::span<const StepRow> rows,
                            v1::SelectPagesResponse* response);

}  // namespace eps::service
