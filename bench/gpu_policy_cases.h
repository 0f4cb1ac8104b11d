// The rows of eps_gpu_bench's policy table (bench/gpu_select_bench.cc, --policy-batch):
// every method, budget and record form the cuda backend serves, each with the summary
// features its method reads.
#pragma once

#include <vector>

#include "core/layout.h"
#include "core/select.h"
#include "gpu/step.h"

namespace eps::bench {

struct PolicyCase {
  const char* name;
  SummaryFeatures features;
  SelectPolicy policy;
  gpu::GpuSelectorOptions options = {};
};

// The cases in the table's order, each with `top_pages` a head.
std::vector<PolicyCase> PolicyCases(int top_pages);

}  // namespace eps::bench
