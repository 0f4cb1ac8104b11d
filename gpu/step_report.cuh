// The host's reading of a step's device report (gpu/step_shape.cuh StepReport):
// the first error a kernel recorded, as a status that names the table entry,
// slot or query element. Included by gpu/step.cu.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "core/step.h"
#include "gpu/step_shape.cuh"

namespace eps::gpu {

// What the messages name besides the report: the step's rows (their table
// rows) and the bounds the ids were checked against.
struct ReportBounds {
  std::span<const StepRow> rows;
  int64_t num_slots, physical_blocks, coarse_slots;
};

// OK for kernels::kOk; INVALID_ARGUMENT for a bad slot, block id, score or query;
// DEADLINE_EXCEEDED for a step whose inputs wait the host released (kReleased).
absl::Status ReportStatus(const kernels::DeviceStatus& status, const ReportBounds& bounds);

}  // namespace eps::gpu
