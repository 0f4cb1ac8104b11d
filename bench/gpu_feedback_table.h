// eps_gpu_bench's fourth table: selection feedback (gpu/feedback.cuh) in the pre-pass.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "core/layout.h"

namespace eps::bench {

// questclt at g = 2 (union lists, threshold budget, `top_pages`) at `batch` x
// `context`: the p50 GPU µs of Select without feedback, then with a feedback
// buffer in which 0 %, 25 % and 100 % of every (layer, row, head)'s groups hold a
// finite entry, restored before each step (a step consumes its entries). The
// difference to the first row is what feedback costs: its two kernels
// (FeedbackKernel before the selection, ConsumeKernel after it).
absl::Status MeasureFeedback(ModelLayout m, int batch, int64_t context, int top_pages);

}  // namespace eps::bench
