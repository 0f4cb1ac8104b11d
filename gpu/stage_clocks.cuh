// Per-block stage clocks of the fused kernel (gpu/fused_select.cuh), in a
// profiling build only (CMake -DEPS_STAGE_CLOCKS=ON; off by default, where
// EPS_STAMP compiles to nothing). Thread 0 of each block reads clock64 after
// each stage of the block's chain (and %globaltimer at its start and end) into
// a device array, one record a block of the last launch; FusedStageClocks
// (gpu/stage_clocks.h) prints p10/p50/p90 of each stage's time over the blocks.
// Which stage holds a block up is what the ncu profiles could not show: the
// fused kernel is neither DRAM- nor issue-bound, and its time is the chain of
// dependent steps a block runs (docs/benchmarks/gpu-history-2026-11-26-sessions-8-11.md,
// eleventh session).
// The stamps cost about 1 % of the kernel's time (H100, 64 x 32k). Included
// through step.cu only.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "gpu/cuda_check.h"

namespace eps::gpu::kernels {

// The stamps, in a block's order; each stage ends at its stamp.
enum Stage : int {
  kStageEntry = 0,
  kStageSlotsQueued = 1,   // the row and its slots read, the records' copies queued
  kStageTermsBuilt = 2,    // the query terms built (in the block) or their copy queued
  kStageTermsBarrier = 3,  // the copies landed, and the block's barrier
  kStageRecords = 4,       // the warp's records landed
  kStageScored = 5,        // scores in shared memory, and a barrier
  kStageCut = 6,           // the heads' cuts and their marks
  kStageArrived = 7,       // the mask OR (union), fence and arrival counter
  kStageUnionTaken = 8,    // last block of a (row, layer): the union's words
  kStageCompacted = 9,     // ... its list written, and a fence
  kStageEnd = 10,          // the step's arrival (or the block's return)
  kStages = 11
};

#ifdef EPS_STAGE_CLOCKS
inline constexpr int kStampedBlocks = 1 << 16;  // blocks of one launch kept (by linear id)

struct StageClock {
  long long clock[kStages];
  unsigned long long start_ns, end_ns;
};

static __device__ StageClock stage_clocks[kStampedBlocks];

__device__ inline int StampedBlock() {
  const long long id = (int64_t{blockIdx.z} * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  return id < kStampedBlocks ? static_cast<int>(id) : -1;
}

__device__ inline unsigned long long GlobalNs() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ inline void Stamp(int stage) {
  const int b = StampedBlock();
  if (threadIdx.x != 0 || b < 0) return;
  StageClock& c = stage_clocks[b];
  if (stage == kStageEntry) {
    for (int i = 1; i < kStages; ++i) c.clock[i] = 0;
    c.start_ns = GlobalNs();
  }
  c.clock[stage] = clock64();
  if (stage == kStageEnd) c.end_ns = GlobalNs();
}
#define EPS_STAMP(stage) ::eps::gpu::kernels::Stamp(stage)

// The report of the last stamped launch of `blocks` blocks (step.cu's
// FusedStageClocks). Each stage's time runs from the block's previous stamp.
static std::string StageClockReport(int blocks, int sms) {
  static const char* const kNames[kStages] = {
      "entry",          "slots, copies queued", "terms",       "terms landed, barrier",
      "records landed", "scored, barrier",      "cuts, marks", "arrival",
      "union's words",  "list written",         "end"};
  blocks = std::min(blocks, kStampedBlocks);
  std::vector<StageClock> h(static_cast<size_t>(blocks));
  if (cudaMemcpyFromSymbol(h.data(), stage_clocks, sizeof(StageClock) * h.size()) != cudaSuccess) {
    ClearFailedCall();
    return "stage clocks: cudaMemcpyFromSymbol failed\n";
  }
  unsigned long long first = ~0ull, last = 0;
  double ns = 0, cycles = 0;
  for (const StageClock& c : h) {
    first = std::min(first, c.start_ns);
    last = std::max(last, c.end_ns);
    ns += static_cast<double>(c.end_ns - c.start_ns);
    cycles += static_cast<double>(c.clock[kStageEnd] - c.clock[kStageEntry]);
  }
  const double ghz = cycles / ns;
  char line[256];
  std::string out;
  std::snprintf(line, sizeof line,
                "stage clocks: %d blocks, first start to last end %.2f us, a block %.2f us on "
                "average at %.2f GHz, %.2f blocks an SM at once\n",
                blocks, (last - first) / 1e3, ns / blocks / 1e3, ghz,
                ns / static_cast<double>(last - first) / sms);
  out += line;
  // The launch's waves: blocks running at each tenth of the span, and when blocks start
  // (us after the first start), to tell a tail of short waves from long chains.
  out += "  running at each tenth of the span:";
  for (int k = 0; k < 10; ++k) {
    const unsigned long long t = first + (last - first) * (2 * k + 1) / 20;
    int running = 0;
    for (const StageClock& c : h) running += c.start_ns <= t && t < c.end_ns;
    std::snprintf(line, sizeof line, " %d", running);
    out += line;
  }
  std::vector<double> starts;
  for (const StageClock& c : h) starts.push_back(static_cast<double>(c.start_ns - first) / 1e3);
  std::sort(starts.begin(), starts.end());
  std::snprintf(line, sizeof line,
                "\n  starts (us after the first) p10 %.2f  p50 %.2f  p90 %.2f  max %.2f\n",
                starts[starts.size() / 10], starts[starts.size() / 2],
                starts[starts.size() * 9 / 10], starts.back());
  out += line;
  for (int s = 1; s < kStages; ++s) {
    std::vector<double> us;
    for (const StageClock& c : h) {
      if (c.clock[s] == 0) continue;  // not reached (only the last blocks compact)
      int before = s - 1;
      while (before > 0 && c.clock[before] == 0) --before;
      us.push_back(static_cast<double>(c.clock[s] - c.clock[before]) / ghz / 1e3);
    }
    if (us.empty()) continue;
    std::sort(us.begin(), us.end());
    auto at = [&](double q) {
      return us[static_cast<size_t>(q * static_cast<double>(us.size() - 1))];
    };
    std::snprintf(line, sizeof line, "  %-22s %6zu blocks  p10 %6.2f  p50 %6.2f  p90 %6.2f us\n",
                  kNames[s], us.size(), at(0.1), at(0.5), at(0.9));
    out += line;
  }
  return out;
}
#else
#define EPS_STAMP(stage) ((void)0)
#endif

}  // namespace eps::gpu::kernels
