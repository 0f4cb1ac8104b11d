// The GPU pre-pass of one decode step (docs/design.md §5), the CUDA counterpart
// of core/step.h over device memory with the same buffer layouts, in three
// kernels (gpu/terms_kernel.cuh, gpu/score_kernel.cuh, gpu/select_kernel.cuh):
//
//   1. query terms per (row, layer, query head): ‖q‖, and for jl z = Φᵀq and
//                  the packed z zᵀ, into the selector's scratch; the check
//                  that every scored query is finite. Scoring is its
//                  programmatic dependent: its blocks start while this runs
//                  and wait for the terms only before reading them. For jl
//                  (m of 4, 8 or 16) with one scoring block per (row, layer,
//                  KV head) and every scoring block resident at once (batch
//                  1 at 32k), the scoring blocks build their heads' terms
//                  themselves instead, and the step has one kernel less
//   2. scoring     per (row, layer, KV head, 256 groups): one thread per group
//                  queues its record's loads, reads the KV head's query terms,
//                  then scores the record once for every one of its query
//                  heads (jl, 1pc, fro, quest; strict mode: the bracket of
//                  max_i q·k_i); quest's and strict mode's sums and jl's record
//                  copies are read by each warp together
//   3. selection   per (row, layer, list): each head's cut (threshold budget:
//                  the top_pages-th score by exact radix select and T/α;
//                  strict: the top_pages-th lower bound; top-p: the score where
//                  the estimated mass reaches top_p; mass: the group where the
//                  covered share reaches mass_target, within min_pages and
//                  max_pages; or the layer's own, SelectPolicy::mass_layers,
//                  copied up before each step), or the fixed budget's
//                  best ranks; forced groups; the union over the list's heads;
//                  compaction into visit_blocks / visit_count; the statistics
//
// With a coarse level (ModelLayout.coarse_blocks; SelectPolicy::UsesCoarseLevel)
// scoring runs twice (gpu/coarse_select.cuh): over the coarse records, then, after
// a kernel per (row, layer, list) names the list's candidate coarse groups (each
// scored head's threshold cut over the coarse scores, and the forced ones), over
// the fine records inside the candidates only (the others score −∞ unread); the
// selection then drops any group outside them, as core/ does. summary_bytes_read
// counts the coarse records and the candidates' fine ones. Never fused.
//
// Selection feedback (StepInputs::feedback, core ApplyFeedback; gpu/feedback.cuh):
// after scoring, a kernel per (layer, query head, row) moves each scored head's
// scores as core/ does (fed groups √d·entry, the others + the head's median
// difference); with the coarse level a fed group passes the candidates' mask.
// After the selection a kernel consumes the rows' entries (NaN) when the step's
// device report says OK, so a failed step leaves them. Strict mode ranks without
// the buffer but consumes it too; the selection is never fused with it.
//
// The selection can be fused into scoring (gpu/fused_select.cuh; when it is:
// GpuSelectorOptions::fusion) for the threshold budget, not strict, a method
// that scores, union or per-KV-head lists, every row within one scoring block
// (at most 256 groups: 32k tokens at g = 8). Each scoring block keeps its
// heads' scores in shared memory and cuts them there; the union is ORed into a
// per-(row, layer) mask that the (row, layer)'s last block compacts. Same
// scores and cuts as the three kernels, so the same lists and statistics; no
// score reaches global memory, and no selection kernel waits for the whole
// scoring grid.
//
// The policies of core/select.h: threshold, fixed, top-p and mass budgets,
// strict mode, heads all|retrieval, union and per-KV-head output, every method.
// Lists equal core/'s except for groups whose score sits within float rounding
// of a cut (the device sums in another order).
//
// Every slot and block id is checked on the device before it is used; a bad
// one, or a NaN/Inf score, fails the step with INVALID_ARGUMENT and leaves the
// outputs unwritten (their counts become -1, "attend densely", when a step fence
// is given, since the engine's stream proceeds on selection_done regardless).
// With the selection fused (opt-in, GpuSelectorOptions), a list may be written before another block
// fails, so a failed step's counts all become -1, fence or not (visit_blocks partly written).
//
// Cross-process ordering (docs/design.md §5): with a StepFence the selector's stream
// first waits until inputs_ready >= step (the engine's stream wrote its
// queries), and writes selection_done = step after the outputs, so the engine's
// stream can wait for it without any host round trip. Enqueue returns once the
// work is queued (the async reply); Finish waits for it with a bound, and when
// the engine never signals inputs_ready it releases the wait itself (the host
// watchdog of docs/design.md §6). No host thread ever waits on the stream without
// a bound while such a wait is queued: a stream that does not drain after the
// release poisons the selector, and the destructor abandons it (inputs_wait.h).
//
// Thread safety: one caller at a time per GpuSelector.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "core/layout.h"
#include "core/select.h"
#include "core/step.h"
#include "gpu/device.h"

namespace eps::gpu {

struct GpuSelectorOptions {
  // Replay each step's three kernels as one captured CUDA graph (a launch per
  // step); a step whose shapes, buffers or policy change is captured anew
  // (the last 8 are kept). false: launch the kernels one by one.
  bool graphs = true;
  // Where the policy and shapes allow it (the threshold budget, not strict, no
  // coarse level or feedback, rows of one scoring block), the selection can run
  // fused into scoring (gpu/fused_select.cuh) instead of as a kernel of its own.
  // kAuto fuses jl's staged path (m of 4 or 8) at every batch: on the H100 the
  // fused step was as fast as the two kernels or faster from batch 1 × 32k up
  // since its chain of memory round trips was shortened
  // (docs/benchmarks/gpu-history-2026-11-26-sessions-8-11.md, eleventh session; until then
  // it lost below six waves of blocks); every other method keeps the two kernels. kAlways
  // and kNever are for tests and the benchmark's comparison.
  enum class Fusion { kAuto, kAlways, kNever };
  Fusion fusion = Fusion::kAuto;
  // questclt takes its general path (gpu/warp_sums.cuh QuestCltSumsWarp: the
  // warp's 32 lanes share each record, for any d) even where its octet path
  // applies (gpu/questclt_octets.cuh: d of 64, 128 or 256; the same scores to a
  // float rounding). For tests and the benchmark's comparison.
  bool register_sums = false;
  // jl's query terms from a kernel of their own (TermsKernel) even where the
  // scoring blocks build them (one block per row, layer and KV head: each
  // head's terms built once either way; no coarse level). For tests and the
  // benchmark's comparison.
  bool terms_kernel = false;
  // (Row, query head) pairs of each TermsKernelHeld warp's run
  // (TermsHeadsPerRun); 0: the selector's choice from the shape and the GPU.
  // For tests.
  int terms_run = 0;
  // The terms kernel for any d and m (TermsKernel) even where the one that
  // holds Φ in registers applies (TermsKernelHeld). For tests and the benchmark.
  bool terms_general = false;
  // How long the stream gets to drain once a wait on the engine's inputs_ready
  // was released (Finish's timeout, a failed step, the destructor). Past it the
  // selector is poisoned: later steps fail with FAILED_PRECONDITION and the
  // destructor abandons the stream instead of synchronising (gpu/inputs_wait.h).
  std::chrono::milliseconds drain_timeout{5000};
};

class GpuSelector {
 public:
  // Every call that makes the selector's device current (WarmUp, Create, Enqueue, Finish)
  // answers a device that cannot be made current as SetDevice does (gpu/cuda_check.h):
  // FAILED_PRECONDITION naming the ordinal and CUDA's error (an error that ends the context
  // stays INTERNAL, marked device-lost).
  //
  // Creates `device`'s context and loads the pre-pass and stream-op kernels, so
  // that the first Create on it (a first Attach) pays neither.
  static absl::Status WarmUp(int device);

  // Scratch for up to `max_batch` rows of up to `max_groups` groups, on `device`.
  // A shape whose launch grids exceed CUDA's (num_layers × num_kv_heads or
  // max_batch above 65535) is refused with INVALID_ARGUMENT before any device
  // is touched. When it fails after allocating anything and `remains` is not null,
  // `*remains` owns what was allocated, for the caller to destroy once SafeToFree
  // says so rather than now (freeing may wait for another engine: gpu/live_streams.h).
  static absl::StatusOr<std::unique_ptr<GpuSelector>> Create(
      const ModelLayout& model, int device, int64_t max_batch, int64_t max_groups,
      GpuSelectorOptions options = {}, std::unique_ptr<GpuSelector>* remains = nullptr);
  // The device memory Create allocates for that shape, plus what a coarse level of up to
  // `max_coarse_groups` groups a row adds at its first step, in bytes (saturating): what a
  // session is charged (strict mode's second array is charged when a step first needs it).
  static uint64_t DeviceBytes(const ModelLayout& model, int64_t max_batch, int64_t max_groups,
                              int64_t max_coarse_groups);
  ~GpuSelector();
  GpuSelector(const GpuSelector&) = delete;
  GpuSelector& operator=(const GpuSelector&) = delete;

  // Device addresses of the session's counters; null members are not used.
  struct StepFence {
    uint64_t* inputs_ready = nullptr;    // wait until >= step before reading inputs
    uint64_t* selection_done = nullptr;  // = step after the outputs
    uint64_t step = 0;
  };

  // `in` and `out` hold device pointers (in.rows is host memory); runs on the
  // selector's stream and waits for it. `prepass_us` is the GPU time between
  // CUDA events around the kernels.
  absl::Status Select(const StepInputs& in, const SelectPolicy& policy, const StepOutputs& out,
                      StepStats* stats, float* prepass_us);

  // Validates on the host and queues the step; returns without waiting. A step
  // still pending must be finished first (FAILED_PRECONDITION otherwise).
  absl::Status Enqueue(const StepInputs& in, const SelectPolicy& policy, const StepOutputs& out,
                       const StepFence& fence);
  // Waits up to `timeout` for the pending step, then (when it is still held by
  // an unsignalled inputs_ready) releases it and answers DEADLINE_EXCEEDED after
  // the stream drained; FAILED_PRECONDITION, poisoning the selector, when it does
  // not drain within drain_timeout. Reports the device-side validation result
  // and stats. A failed Enqueue leaves no wait behind: it releases its own.
  absl::Status Finish(std::chrono::microseconds timeout, StepStats* stats, float* prepass_us);
  bool pending() const;
  // Whether destroying this selector now, after putting it off for `deferred`, is safe
  // for the other selectors on its device (gpu/live_streams.h SafeToFreeOn).
  bool SafeToFree(std::chrono::steady_clock::duration deferred,
                  std::chrono::steady_clock::duration stale) const;
  uint64_t pending_step() const;
  // Whether the last step queued ran its selection fused into scoring
  // (gpu/fused_select.cuh), for tests and benchmarks.
  bool last_step_fused() const;

 private:
  struct Impl;
  explicit GpuSelector(std::unique_ptr<Impl> impl);
  static absl::Status Allocate(Impl& impl, const ModelLayout& model, int device, int64_t max_batch,
                               int64_t max_groups, int max_shared,
                               const GpuSelectorOptions& options);
  std::unique_ptr<Impl> impl_;
};

// Φ of (layer, kv_head) generated on the device, for the bit-exactness test.
absl::Status GeneratePhiOnDevice(uint64_t seed, int layer, int kv_head, int head_dim, int m,
                                 float* host_out);

}  // namespace eps::gpu
