// The cooperative step's kernels (gpu/cooperative_step.cuh), instantiated in
// gpu/cooperative_kernels.cu so that step.cu's compilation does not carry them.
#pragma once

#include <span>

#include "core/bounds.h"

namespace eps::gpu {

// Every instance, so the selector can load them all up front.
std::span<const void* const> CooperativeKernels();

// The instance for a step, chosen as ScoreKernelFor chooses the scoring kernel
// (gpu/step_kernels.cuh): jl with m of 4, 8, 16 where `staged`, else generic;
// quest and questclt with passes of 4 heads where a KV head has at most 4, else 8;
// questclt's octet path for d of 64, 128 or 256 where `octets`, over the quest8
// part where `quest8`. Method::kOff: the tables' checks and every group visited.
const void* CooperativeKernelFor(Method method, int m, int ratio, bool staged, bool octets, int d,
                                 bool quest8);

}  // namespace eps::gpu
