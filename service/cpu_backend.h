// The CPU backend (MakeCpuBackend in service/backend.h): runs one step of a
// session with the core/ reference selector over host memory, then publishes
// selection_done; and reads inline outputs back for the reply.
#pragma once

#include <span>

#include "absl/status/status.h"
#include "core/step.h"
#include "eps/v1/page_selector.pb.h"
#include "service/backend.h"
#include "service/session.h"

namespace eps::service {

// Copies the visit lists of `rows` out of inline output buffers into `response`.
void AppendInlineVisitLists(const Session& session, std::span<const StepRow> rows,
                            v1::SelectPagesResponse* response);

}  // namespace eps::service
