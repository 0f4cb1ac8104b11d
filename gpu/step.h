// The GPU pre-pass of one decode step (DESIGN §5), the CUDA counterpart of
// core/step.h over device memory with the same buffer layouts:
//
//   1. query terms   z = Φᵀq, packed z zᵀ and ‖q‖ per (row, layer, q head)
//   2. scoring       one thread per group reads each record once and scores it
//                    for every query head of its KV head (jl, 1pc, fro, quest)
//   3. selection     per (row, layer): forced groups, the top_pages-th score by
//                    exact radix select, the T/α threshold, union over heads,
//                    and compaction into visit_blocks / visit_count
//
// Supported now: threshold budget, union output, heads all|retrieval, every
// method. Strict mode, the fixed and top-p budgets and per-KV-head output
// return UNIMPLEMENTED (the CPU backend has them).
//
// Every slot and block id is checked on the device before it is used; a bad
// one, or a NaN/Inf score, fails the step with INVALID_ARGUMENT and leaves the
// outputs unwritten. Thread safety: one Select at a time per GpuSelector.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "core/layout.h"
#include "core/select.h"
#include "core/step.h"

namespace eps::gpu {

// True when a CUDA device is usable by this process.
bool DeviceAvailable();

class GpuSelector {
 public:
  // Scratch for up to `max_batch` rows of up to `max_groups` groups, on `device`.
  static absl::StatusOr<std::unique_ptr<GpuSelector>> Create(const ModelLayout& model, int device,
                                                             int64_t max_batch,
                                                             int64_t max_groups);
  ~GpuSelector();
  GpuSelector(const GpuSelector&) = delete;
  GpuSelector& operator=(const GpuSelector&) = delete;

  // `in` and `out` hold device pointers (in.rows is host memory); runs on the
  // selector's stream and waits for it. `prepass_us` is the GPU time between
  // CUDA events around the three kernels.
  absl::Status Select(const StepInputs& in, const SelectPolicy& policy, const StepOutputs& out,
                      StepStats* stats, float* prepass_us);

 private:
  struct Impl;
  explicit GpuSelector(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Φ of (layer, kv_head) generated on the device, for the bit-exactness test.
absl::Status GeneratePhiOnDevice(uint64_t seed, int layer, int kv_head, int head_dim, int m,
                                 float* host_out);

}  // namespace eps::gpu
