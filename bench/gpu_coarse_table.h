// eps_gpu_bench's third table: the coarse level (gpu/coarse_select.cuh) beside the
// flat selection.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "core/layout.h"

namespace eps::bench {

// questclt at g = 1 with coarse groups of 4 blocks and coarse_candidates 2, beside
// the flat selection at g = 2 and 1, union and per-KV-head lists, at `batch` x
// `context` and `top_pages`: prints per row the summary bytes read (coarse records
// and the candidates' fine ones), the p50 GPU µs of Select (its events bracket the
// host's graph launch) and of a queued step (MeasureQueued), and the share of
// groups visited.
absl::Status MeasureCoarse(ModelLayout m, int batch, int64_t context, int top_pages);

}  // namespace eps::bench
