#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/phi.h"
#include "core/saturating.h"
#include "core/status.h"
#include "gpu/cuda_check.h"
#include "gpu/device.h"
#include "gpu/fused_select.cuh"
#include "gpu/inputs_wait.h"
#include "gpu/launch.cuh"
#include "gpu/live_streams.h"
#include "gpu/phi.cuh"
#include "gpu/score_kernel.cuh"
#include "gpu/select_kernel.cuh"
#include "gpu/stage_clocks.h"
#include "gpu/step.h"
#include "gpu/step_kernels.cuh"
#include "gpu/step_launch.cuh"
#include "gpu/step_report.cuh"
#include "gpu/stream_ops.h"
#include "gpu/terms_kernel.cuh"

namespace eps::gpu {
using namespace kernels;  // NOLINT: this file launches them

struct GpuSelector::Impl {
  ModelLayout model;
  SummaryLayout layout;
  int device = 0;
  int64_t max_batch = 0, max_groups = 0;
  int max_shared = 0;  // dynamic shared memory a block may have (bytes)
  int multiprocessors = 0;
  // Blocks resident per multiprocessor, by (kernel, threads, shared bytes): asked
  // of the runtime once each (a handful of kernels per selector).
  struct Resident {
    const void* kernel;
    int threads;
    size_t shared;
    int blocks;
  };
  std::vector<Resident> resident;
  absl::StatusOr<int> ResidentBlocks(const void* kernel, int threads, size_t shared) {
    for (const Resident& r : resident) {
      if (r.kernel == kernel && r.threads == threads && r.shared == shared) return r.blocks;
    }
    int blocks = 0;
    CUDA_RETURN_IF_ERROR(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, shared));
    resident.push_back({kernel, threads, shared, blocks});
    return blocks;
  }
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  DeviceBuffer<float> phi, scores;
  DeviceBuffer<float> terms;   // the step's query terms (terms_kernel.cuh)
  DeviceBuffer<float> uppers;  // strict mode's upper bounds, allocated by its first step
  DeviceBuffer<DeviceRow> rows;
  DeviceBuffer<uint8_t> scored;
  DeviceBuffer<StepReport> reports;  // two, alternating by step (step_shape.cuh)
  // The waits on inputs_ready, their release and the bounds on draining the
  // stream (inputs_wait.h; its `released` word is SelectArgs::released).
  InputsWait inputs;
  // The fused selection's scratch (fused_select.cuh), zero between steps:
  // union masks [max_batch, layers, kFusedMaskWords]; arrivals [max_batch,
  // layers] and the step's count of finished (row, layer)s after them.
  DeviceBuffer<unsigned> fused_masks, fused_arrivals;
  // The coarse level's scratch (coarse_select.cuh), allocated by its first step and
  // grown with the steps' max_coarse_groups: coarse scores [max_batch, layers,
  // q_heads, coarse_capacity] and candidate flags [max_batch, layers, kv_heads,
  // coarse_capacity] (a step's max_coarse_groups is their row stride).
  DeviceBuffer<float> coarse_scores;
  DeviceBuffer<uint8_t> candidates;
  int64_t coarse_capacity = 0;
  // Steps launched: picks this step's report, and numbers the launch
  // (SelectArgs::launch); while a step is pending it is that step's number.
  uint64_t sequence = 0;
  GpuSelectorOptions options;
  CapturedSteps captured;  // the graphs of recent steps (step_launch.cuh)
  // The mass budget of each layer ([layers]; SelectPolicy::mass_layers), written
  // before every step that has them: the graphs keep the pointer, not the values.
  DeviceBuffer<MassRule> mass_layers;
  // Pinned host staging: the row list, the layers' mass budgets and the retrieval
  // heads' marks up, the step's report down. Pinned, since a copy queued behind the
  // engine's inputs wait from pageable memory may hold the host until the wait is released.
  DeviceRow* host_rows = nullptr;
  MassRule* host_mass_layers = nullptr;
  uint8_t* host_scored = nullptr;
  StepReport* host_report = nullptr;

  // The step queued by Enqueue and not yet finished.
  bool pending = false;
  StepFence fence;         // of the pending step (fence.step is its number)
  StepStats pending_host;  // the host-side part of its statistics
  std::vector<StepRow> pending_rows;
  int scored_kv_heads_total = 0;
  int64_t row_groups = 0, pending_num_slots = 0, pending_physical_blocks = 0;
  int64_t pending_coarse_slots = 0;
  bool pending_coarse = false;  // the step used the coarse level: the device counted its records
  bool per_head = false;        // per-KV-head lists: each reads one KV head's K and V
  bool last_fused = false;      // the last step queued fused its selection

  // A step that failed after its inputs wait was queued: releases the wait and
  // drains (InputsWait::Settle), then clears what a partly queued launch may
  // have written, since the next launch reuses its number and report.
  void Abort(uint64_t launch) {
    if (!inputs.Settle(stream, launch)) return;
    // On the step stream: before the next launch, after nothing of another stream.
    if (cudaMemsetAsync(reports.get(), 0, 2 * sizeof(StepReport), stream) != cudaSuccess) {
      ClearFailedCall();  // the step's own error is the one reported
    }
    (void)inputs.ClearReleased();
  }
  ~Impl() {
    if (host_rows != nullptr) cudaFreeHost(host_rows);
    if (host_mass_layers != nullptr) cudaFreeHost(host_mass_layers);
    if (host_scored != nullptr) cudaFreeHost(host_scored);
    if (host_report != nullptr) cudaFreeHost(host_report);
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
    if (stream != nullptr) {
      RemoveLiveStream(stream);
      cudaStreamDestroy(stream);
    }
  }
};

GpuSelector::GpuSelector(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuSelector::~GpuSelector() {
  // Sessions end on any thread (the lease reaper's device is 0): free on ours.
  (void)TrySetDevice(impl_->device);
  if (impl_->stream != nullptr && !impl_->inputs.Settle(impl_->stream, impl_->sequence)) {
    // The stream still holds a wait on engine memory that our release did not
    // end. Synchronising would block this thread (the reaper: no lease would
    // expire again) for as long as the engine likes, and freeing what the queued
    // kernels use would let them fault the context if the wait ever passes. So
    // the selector is abandoned: its stream, scratch and pinned memory leak (a
    // few MiB, only for an engine that breaks the counter contract), and the
    // device's IPC mappings stay open while the stream may still run
    // (live_streams.h NoteAbandonedStream). docs/design.md §6.
    impl_->inputs.Abandon(impl_->device, impl_->stream);
    RemoveLiveStream(impl_->stream);
    (void)impl_.release();  // NOLINT(bugprone-unused-return-value): an intended leak
  }
}

namespace {

// Loads every kernel now: a lazy load at the first launch may wait for the
// context to idle, which a stream waiting on inputs_ready prevents (stream_ops.h).
// Kernels past 48 KiB of dynamic shared memory must say so before launch; the
// attribute is per process, so every caller sets the device's maximum (a cap,
// not a reservation) rather than its own need.
absl::Status LoadKernels(int device) {
  int max_shared = 0;
  CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  RETURN_IF_ERROR(PreloadStreamOps());
  for (const auto& kernels :
       {std::span<const void* const>(kTermsKernels), std::span<const void* const>(kScoreKernels),
        std::span<const void* const>(kSelectKernels), std::span<const void* const>(kFusedKernels),
        std::span<const void* const>(kCandidateKernels),
        std::span<const void* const>(kFeedbackKernels)}) {
    for (const void* kernel : kernels) {
      cudaFuncAttributes attributes;
      CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, kernel));
      CUDA_RETURN_IF_ERROR(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               max_shared - static_cast<int>(attributes.sharedSizeBytes)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status GpuSelector::WarmUp(int device) {
  RETURN_IF_ERROR(SetDevice(device));
  CUDA_RETURN_IF_ERROR(cudaFree(nullptr));  // the primary context
  return LoadKernels(device);
}

// The selector's stream, events, pinned and device scratch and its Φ: Create's
// allocations, into `impl`, which owns whatever was made when one fails.
absl::Status GpuSelector::Allocate(Impl& impl, const ModelLayout& model, int device,
                                   int64_t max_batch, int64_t max_groups, int max_shared,
                                   const GpuSelectorOptions& options) {
  impl.model = model;
  impl.layout = SummaryLayout::For(model);
  impl.device = device;
  impl.max_batch = max_batch;
  impl.max_groups = max_groups;
  impl.max_shared = max_shared;
  CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&impl.multiprocessors, cudaDevAttrMultiProcessorCount, device));
  impl.options = options;
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&impl.stream, cudaStreamNonBlocking));
  AddLiveStream(device, impl.stream, impl.inputs.queued_ns());
  RETURN_IF_ERROR(impl.inputs.Init(options.drain_timeout));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&impl.start));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&impl.stop));
  CUDA_RETURN_IF_ERROR(cudaMallocHost(&impl.host_rows, max_batch * sizeof(DeviceRow)));
  CUDA_RETURN_IF_ERROR(cudaMallocHost(&impl.host_report, sizeof(StepReport)));
  CUDA_RETURN_IF_ERROR(cudaMallocHost(&impl.host_mass_layers, model.num_layers * sizeof(MassRule)));
  RETURN_IF_CUDA_ALLOC(impl.mass_layers, model.num_layers);
  const int64_t per_matrix = int64_t{model.head_dim} * model.sketch_dim;
  RETURN_IF_CUDA_ALLOC(impl.phi, model.num_layers * model.num_kv_heads * per_matrix);
  RETURN_IF_CUDA_ALLOC(impl.scores, max_batch * model.num_layers * model.num_q_heads * max_groups);
  RETURN_IF_CUDA_ALLOC(
      impl.terms, max_batch * model.num_layers * model.num_q_heads * TermWords(model.sketch_dim));
  RETURN_IF_CUDA_ALLOC(impl.rows, max_batch);
  RETURN_IF_CUDA_ALLOC(impl.scored, int64_t{model.num_layers} * model.num_q_heads);
  CUDA_RETURN_IF_ERROR(
      cudaMallocHost(&impl.host_scored, int64_t{model.num_layers} * model.num_q_heads));
  RETURN_IF_CUDA_ALLOC(impl.reports, 2);
  CUDA_RETURN_IF_ERROR(cudaMemset(impl.reports.get(), 0, 2 * sizeof(StepReport)));
  const int64_t row_layers = max_batch * model.num_layers;
  RETURN_IF_CUDA_ALLOC(impl.fused_masks, row_layers * kFusedMaskWords);
  RETURN_IF_CUDA_ALLOC(impl.fused_arrivals, row_layers + 1);
  CUDA_RETURN_IF_ERROR(
      cudaMemset(impl.fused_masks.get(), 0, row_layers * kFusedMaskWords * sizeof(unsigned)));
  CUDA_RETURN_IF_ERROR(
      cudaMemset(impl.fused_arrivals.get(), 0, (row_layers + 1) * sizeof(unsigned)));
  RETURN_IF_ERROR(LoadKernels(device));
  CUDA_RETURN_IF_ERROR(LaunchKernel(GeneratePhiKernel, 256, 256, 0, impl.stream, model.phi_seed,
                                    model.num_layers, model.num_kv_heads,
                                    static_cast<int>(per_matrix), PhiScale(model.sketch_dim),
                                    impl.phi.get()));
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(impl.stream));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<GpuSelector>> GpuSelector::Create(
    const ModelLayout& model, int device, int64_t max_batch, int64_t max_groups,
    GpuSelectorOptions options, std::unique_ptr<GpuSelector>* remains) {
  if (absl::Status s = model.Validate(); !s.ok()) return s;
  RETURN_IF_ERROR(CheckLaunchLimits(model, max_batch, max_groups));
  int max_shared = 0;
  RETURN_IF_ERROR(SetDevice(device));
  CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  // Static shared memory of the select kernel: at most 40 KiB (select_kernel.cuh).
  const size_t score_shared = ScoreSharedBytes(model, false);
  const size_t select_shared = SelectSharedBytes(max_groups);
  if (score_shared > static_cast<size_t>(max_shared) ||
      select_shared + 40 * 1024 > static_cast<size_t>(max_shared)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the GPU pre-pass needs ", score_shared,
                     " bytes of shared memory per scoring block "
                     "(gqa_ratio * (3 * head_dim + m(m+1)/2 + 1, padded to 4) floats) and ",
                     select_shared, " per selection block; the device offers ", max_shared));
  }
  auto impl = std::make_unique<Impl>();
  if (absl::Status s = Allocate(*impl, model, device, max_batch, max_groups, max_shared, options);
      !s.ok()) {
    // What it allocated is freed by the caller once that cannot wait on another engine.
    if (remains != nullptr) {
      *remains = std::unique_ptr<GpuSelector>(new GpuSelector(std::move(impl)));
    }
    return s;
  }
  return std::unique_ptr<GpuSelector>(new GpuSelector(std::move(impl)));
}

absl::Status GpuSelector::Select(const StepInputs& in, const SelectPolicy& policy,
                                 const StepOutputs& out, StepStats* stats, float* prepass_us) {
  if (absl::Status s = Enqueue(in, policy, out, StepFence{}); !s.ok()) return s;
  if (!pending()) {  // an empty batch queues nothing
    if (stats != nullptr) *stats = StepStats{};
    if (prepass_us != nullptr) *prepass_us = 0;
    return absl::OkStatus();
  }
  return Finish(std::chrono::microseconds::max(), stats, prepass_us);
}

bool GpuSelector::SafeToFree(std::chrono::steady_clock::duration deferred,
                             std::chrono::steady_clock::duration stale) const {
  return SafeToFreeOn(impl_->device, impl_->stream, deferred, stale);
}

bool GpuSelector::pending() const { return impl_->pending; }
uint64_t GpuSelector::pending_step() const { return impl_->fence.step; }
bool GpuSelector::last_step_fused() const { return impl_->last_fused; }

absl::Status GpuSelector::Enqueue(const StepInputs& in, const SelectPolicy& policy,
                                  const StepOutputs& out, const StepFence& fence) {
  Impl& g = *impl_;
  if (g.pending) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", g.fence.step, " is still pending: finish it first"));
  }
  RETURN_IF_ERROR(g.inputs.Usable());
  // First: steps run on any server thread, whose current device is whichever it used
  // last, and the allocations and occupancy queries below are the device's.
  RETURN_IF_ERROR(SetDevice(g.device));
  const ModelLayout& m = g.model;
  if (absl::Status s = policy.Validate(m); !s.ok()) return s;
  const bool per_head = policy.granularity == Granularity::kPerKvHead;
  const int lists = per_head ? m.num_kv_heads : 1;
  const int64_t batch = static_cast<int64_t>(in.rows.size());
  if (batch == 0) {
    g.last_fused = false;
    if (fence.selection_done != nullptr) {
      // No rows: nothing of the engine's is read, so no wait on its inputs_ready is queued
      // (one was, and nothing tracked it: it outlived Detach, or held the next sync step
      // for the drain bound). Raised, never lowered (StreamRaiseCounter): the engine may
      // have raised it past this step already.
      if (absl::Status s = StreamRaiseCounter(g.stream, fence.selection_done, fence.step);
          !s.ok()) {
        g.Abort(g.sequence + 1);
        return s;
      }
    }
    return absl::OkStatus();
  }
  if (batch > in.max_batch || batch > g.max_batch) {
    return absl::InvalidArgumentError(absl::StrCat(
        "batch of ", batch, " rows exceeds max_batch=", std::min(in.max_batch, g.max_batch)));
  }
  if (in.max_groups > g.max_groups) {  // at most kMaxGroups (Create)
    return absl::InvalidArgumentError(
        absl::StrCat("max_groups=", in.max_groups, " exceeds the selector's ", g.max_groups));
  }
  const bool coarse = policy.UsesCoarseLevel(m);  // not strict, a method that scores
  // Strict mode ranks without the feedback but consumes it, as core/ does.
  const bool feedback = in.feedback != nullptr && !policy.strict;
  RETURN_IF_ERROR(CheckCoarseInputs(m, policy, in));
  DeviceRow* rows = g.host_rows;
  StepStats host;
  const int64_t kv_token_bytes = int64_t{2} * m.head_dim * DTypeSize(m.kv_dtype);
  int64_t max_n = 0, row_groups = 0;  // the longest row's groups; all rows' groups
  int64_t max_nc = 0;                 // the longest row's coarse groups
  for (int64_t i = 0; i < batch; ++i) {
    const StepRow& r = in.rows[i];
    if (absl::Status s = CheckRowFits(m, in, static_cast<size_t>(i)); !s.ok()) return s;
    const int64_t nb = BlocksFor(r.context_tokens, m.block_size);
    const int64_t n = GroupsFor(r.context_tokens, m);
    rows[i] = {r.table_row, r.context_tokens};
    max_n = std::max(max_n, n);
    max_nc = std::max(max_nc, CoarseGroupsFor(r.context_tokens, m));
    row_groups += n;
    host.groups_total += n * m.num_layers * lists;
    host.blocks_total += nb * m.num_layers * lists;
    host.kv_bytes_dense = SaturatingMulAdd(
        host.kv_bytes_dense, {r.context_tokens, m.num_kv_heads, kv_token_bytes, m.num_layers});
  }
  const bool retrieval = policy.heads == HeadMode::kRetrieval;
  const bool method_off = policy.method == Method::kOff;
  const bool strict = policy.strict && !method_off;
  if (strict && g.uppers.get() == nullptr) {  // strict mode's second score array, once
    RETURN_IF_CUDA_ALLOC(g.uppers, g.max_batch * m.num_layers * m.num_q_heads * g.max_groups);
  }
  if (coarse && in.max_coarse_groups > g.coarse_capacity) {  // no step is pending: free to move
    g.coarse_capacity = 0;
    const int64_t row_layers = g.max_batch * m.num_layers;
    RETURN_IF_CUDA_ALLOC(g.coarse_scores, row_layers * m.num_q_heads * in.max_coarse_groups);
    RETURN_IF_CUDA_ALLOC(g.candidates, row_layers * m.num_kv_heads * in.max_coarse_groups);
    g.coarse_capacity = in.max_coarse_groups;
  }
  StepLaunch launch;
  std::memset(static_cast<void*>(&launch), 0, sizeof launch);  // the bytes are a key
  launch.PlanShape(m, g.layout, in, lists);
  launch.PlanRule(m, policy, method_off);
  SelectRule& rule = launch.rule;
  // The mass budget: one for every layer in the launch (its bytes are the graph's
  // key), or one per layer in device memory, read by the step's own graph replay.
  const auto mass_rule = [&](const MassSetting& setting) {
    return MassRule{MassInvScale(setting.temperature, m.head_dim),  // as core/
                    setting.target, setting.min_pages, setting.max_pages};
  };
  const bool per_layer_mass = policy.budget == Budget::kMass && !policy.mass_layers.empty();
  if (per_layer_mass) {
    for (int layer = 0; layer < m.num_layers; ++layer) {
      g.host_mass_layers[layer] = mass_rule(policy.MassFor(layer));
    }
    rule.mass_layers = g.mass_layers.get();
  } else if (policy.budget == Budget::kMass) {
    rule.mass = mass_rule(policy.MassFor(0));  // the policy's own, every layer
  }
  rule.mass_list = policy.mass_scope == MassScope::kList;
  StepReport* report = g.reports.get() + (g.sequence & 1);
  StepReport* next_report = g.reports.get() + ((g.sequence + 1) & 1);
  const uint8_t* scored = retrieval ? g.scored.get() : nullptr;
  if (retrieval) {  // the policy's size was validated against the model
    std::memcpy(g.host_scored, policy.retrieval_heads.data(), policy.retrieval_heads.size());
  }
  // Query terms (StepLaunch::PlanTerms).
  const auto terms =
      TermsKernelFor(policy.method, m.sketch_dim, m.head_dim, strict,
                     reinterpret_cast<uintptr_t>(in.queries) % 16 == 0 && !g.options.terms_general);
  int64_t resident_warps = 0;
  if (terms.held) {
    ASSIGN_OR_RETURN(const int per_sm, g.ResidentBlocks(terms.kernel, kTermsThreads, 0));
    resident_warps = int64_t{per_sm} * (kTermsThreads / 32) * g.multiprocessors;
  }
  launch.PlanTerms(m, {in.queries, g.phi.get(), scored, g.terms.get(), report}, batch, terms,
                   resident_warps, g.options.terms_run);
  // Scoring: one thread per group of (row, layer, KV head), 256 per block.
  launch.score = {in.summary_pool, in.group_table, in.block_table, in.queries,     g.terms.get(),
                  g.rows.get(),    scored,         g.scores.get(), g.uppers.get(), report};
  const bool staged = StagesRecords(policy.method, m.sketch_dim, strict) &&
                      ScoreSharedBytes(m, true) <= static_cast<size_t>(g.max_shared);
  const bool octets = TakesOctetPath(policy.method, strict, m.head_dim, g.layout) &&
                      !g.options.register_sums &&
                      ScoreSharedBytes(m, false, true) <= static_cast<size_t>(g.max_shared);
  launch.score_kernel = ScoreKernelFor(policy.method, m.sketch_dim, strict, m.gqa_ratio(), staged,
                                       octets, m.head_dim, g.layout.quest8 >= 0);
  const int64_t per_block = kScoreThreads * (octets ? kOctetChunks : 1);
  launch.score_grid =
      dim3(static_cast<unsigned>((max_n + per_block - 1) / per_block),
           static_cast<unsigned>(m.num_layers * m.num_kv_heads), static_cast<unsigned>(batch));
  launch.score_shared = ScoreSharedBytes(m, staged, octets);
  if (coarse) {
    launch.PlanCoarse(m, in, policy.CoarseCandidates(m), max_nc, per_block, lists,
                      g.coarse_scores.get(), g.candidates.get());
  }
  // Selection: one block per (layer, list, row).
  launch.select = {in.block_table, g.rows.get(),         scored,          g.scores.get(),
                   g.uppers.get(), out.visit_blocks,     out.visit_count, report,
                   next_report,    fence.selection_done, fence.step};
  if (coarse) {  // visit &= candidate
    launch.select.candidates = g.candidates.get();
    launch.select.max_coarse_groups = in.max_coarse_groups;
    launch.select.coarse_ratio = m.coarse_ratio();
  }
  // Or fused into scoring (fused_select.cuh): the threshold budget, not strict,
  // every row within one scoring block, and its shared memory within the
  // device's (it keeps the block's scores beside the scoring's); not with the
  // coarse level, whose selection reads the candidates too, nor with feedback,
  // which rewrites the scores between scoring and selection. A method without a
  // fused kernel (FusedKernelFor gives none) keeps the two kernels.
  const size_t fused_shared =  // its scoring takes questclt's general path: no ring
      ScoreSharedBytes(m, staged) + sizeof(float) * FusedSharedWords(m.gqa_ratio(), staged);
  const void* fused_kernel =
      FusedKernelFor(policy.method, m.sketch_dim, m.gqa_ratio(), staged, g.layout.quest8 >= 0);
  using Fusion = GpuSelectorOptions::Fusion;
  if (g.options.fusion != Fusion::kNever && policy.budget == Budget::kThreshold && !strict &&
      !method_off && !coarse && !feedback && fused_kernel != nullptr && max_n <= kScoreThreads &&
      fused_shared <= static_cast<size_t>(g.max_shared)) {
    // kAuto (step.h): jl's staged path.
    if (g.options.fusion == Fusion::kAlways || (staged && m.sketch_dim <= 8)) {
      launch.PlanFused(fused_kernel, fused_shared,
                       {g.fused_masks.get(), g.fused_arrivals.get(),
                        g.fused_arrivals.get() + g.max_batch * m.num_layers});
    }
  }
  // This launch's number (from 1), which Finish names when it releases the inputs wait.
  launch.select.released = g.inputs.released();
  launch.select.launch = g.sequence + 1;
  const auto [select_kernel, warps] = SelectKernelFor(policy.budget, strict, m.num_q_heads / lists);
  launch.select_kernel = launch.fused_selection ? nullptr : select_kernel;
  launch.select_grid = dim3(m.num_layers * lists, static_cast<unsigned>(batch));
  launch.select_block = dim3(32 * warps);
  launch.select_shared = SelectSharedBytes(in.max_groups);
  // jl's staged path, one scoring block per (row, layer, KV head), no coarse level.
  if (staged && launch.score_grid.x == 1 && !coarse && !g.options.terms_kernel) {
    ASSIGN_OR_RETURN(const int per_sm,
                     g.ResidentBlocks(launch.score_kernel, kScoreThreads, launch.score_shared));
    launch.PlanTermsInBlocks(int64_t{per_sm} * g.multiprocessors, g.phi.get(), terms.held,
                             m.head_dim, m.sketch_dim);
  }
  if (in.feedback != nullptr) {
    launch.PlanFeedback(m, in, feedback && !method_off, coarse, max_n, per_block);
  }

  if (fence.inputs_ready != nullptr) {
    RETURN_IF_ERROR(g.inputs.Queue(g.stream, fence.inputs_ready, fence.step));
  }
  // Once the wait is queued a failure releases it (Abort), or nothing might.
  const auto queue_work = [&]() -> absl::Status {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(g.rows.get(), rows, batch * sizeof(DeviceRow),
                                         cudaMemcpyHostToDevice, g.stream));
    if (per_layer_mass) {
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(g.mass_layers.get(), g.host_mass_layers,
                                           m.num_layers * sizeof(MassRule), cudaMemcpyHostToDevice,
                                           g.stream));
    }
    if (retrieval) {
      CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(g.scored.get(), g.host_scored,
                                           policy.retrieval_heads.size(), cudaMemcpyHostToDevice,
                                           g.stream));
    }
    CUDA_RETURN_IF_ERROR(cudaEventRecord(g.start, g.stream));
    if (g.options.graphs) {
      RETURN_IF_ERROR(g.captured.Replay(g.stream, launch));
    } else {
      RETURN_IF_ERROR(launch.Launch(g.stream));
    }
    CUDA_RETURN_IF_ERROR(cudaEventRecord(g.stop, g.stream));
    if (fence.selection_done != nullptr) {
      // Raised, never lowered: an engine whose call missed its deadline released this step
      // (and maybe its next) itself; a plain write could take the counter back below the
      // engine's next wait, which would then pass on a later step's lists.
      RETURN_IF_ERROR(StreamRaiseCounter(g.stream, fence.selection_done, fence.step));
    }
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(g.host_report, report, sizeof(StepReport),
                                         cudaMemcpyDeviceToHost, g.stream));
    return absl::OkStatus();
  };
  if (absl::Status s = queue_work(); !s.ok()) {
    g.Abort(launch.select.launch);
    return s;
  }
  ++g.sequence;
  int scored_kv_heads_total = 0;  // summary bytes: per layer, KV heads with a scored head
  for (int layer = 0; layer < m.num_layers; ++layer) {
    for (int kvh = 0; kvh < m.num_kv_heads; ++kvh) {
      bool any = policy.method != Method::kOff;
      if (retrieval) {
        any = false;
        for (int h = kvh * m.gqa_ratio(); h < (kvh + 1) * m.gqa_ratio(); ++h) {
          any |= policy.retrieval_heads[layer * m.num_q_heads + h] != 0;
        }
      }
      scored_kv_heads_total += any;
    }
  }
  g.pending = true;
  g.fence = fence;
  g.pending_host = host;
  g.pending_rows.assign(in.rows.begin(), in.rows.end());
  g.scored_kv_heads_total = scored_kv_heads_total;
  g.per_head = per_head;
  g.last_fused = launch.fused_selection;
  g.row_groups = row_groups;
  g.pending_num_slots = in.num_slots;
  g.pending_physical_blocks = in.num_physical_blocks;
  g.pending_coarse_slots = in.coarse_slots;
  g.pending_coarse = coarse;
  return absl::OkStatus();
}

absl::Status GpuSelector::Finish(std::chrono::microseconds timeout, StepStats* stats,
                                 float* prepass_us) {
  Impl& g = *impl_;
  if (!g.pending) return absl::FailedPreconditionError("no step is pending");
  RETURN_IF_ERROR(SetDevice(g.device));
  // Bounded whenever a wait on engine memory is queued (inputs_wait.h): released
  // after `timeout`, then poisoned if the stream still does not drain.
  g.pending = false;
  bool released = false;
  RETURN_IF_ERROR(g.inputs.Drain(g.stream, timeout, g.sequence, &released));
  if (released) {
    return absl::DeadlineExceededError(absl::StrCat(
        "inputs_ready never reached step ", g.fence.step, " within ", timeout.count(),
        " us: the wait was released and every list of the step says attend densely (-1)"));
  }
  if (prepass_us != nullptr) {
    float ms = 0.0f;
    CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, g.start, g.stop));
    *prepass_us = ms * 1000.0f;
  }
  const ModelLayout& m = g.model;
  const DeviceStatus status = g.host_report->status;
  const DeviceStats dstats = g.host_report->stats;
  if (absl::Status s = ReportStatus(status, {g.pending_rows, g.pending_num_slots,
                                             g.pending_physical_blocks, g.pending_coarse_slots});
      !s.ok()) {
    return s;
  }
  if (stats != nullptr) {
    StepStats host = g.pending_host;
    const int64_t kv_token_bytes = int64_t{2} * m.head_dim * DTypeSize(m.kv_dtype);
    host.groups_visited = static_cast<int64_t>(dstats.groups_visited);
    host.blocks_visited = static_cast<int64_t>(dstats.blocks_visited);
    host.kv_bytes_read_est = SaturatingMulAdd(0, {static_cast<int64_t>(dstats.visited_tokens),
                                                  g.per_head ? 1 : m.num_kv_heads, kv_token_bytes});
    // With the coarse level the candidate kernel counted the records read.
    // Saturating, as core/ and every other byte sum (rows may share a table row: a batch
    // of long contexts can pass 2^63 bytes).
    host.summary_bytes_read =
        g.pending_coarse
            ? SaturatingMulAdd(
                  0, {static_cast<int64_t>(dstats.summary_records), g.layout.record_bytes()})
            : SaturatingMulAdd(0, {g.row_groups, g.scored_kv_heads_total, g.layout.record_bytes()});
    *stats = host;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> FusedStageClocks(int blocks) {
#ifdef EPS_STAGE_CLOCKS
  int device = 0, sms = 0;
  CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return StageClockReport(blocks, sms);
#else
  (void)blocks;
  return absl::FailedPreconditionError("built without stage clocks (cmake -DEPS_STAGE_CLOCKS=ON)");
#endif
}

}  // namespace eps::gpu
