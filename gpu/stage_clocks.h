// The fused kernel's per-block stage clocks, host side (gpu/stage_clocks.cuh).
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace eps::gpu {

// p10/p50/p90 of each stage's time over the `blocks` blocks of the last fused
// launch, as text. FailedPrecondition unless built with -DEPS_STAGE_CLOCKS=ON.
absl::StatusOr<std::string> FusedStageClocks(int blocks);

}  // namespace eps::gpu
