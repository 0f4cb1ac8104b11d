#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/phi.h"
#include "core/status.h"
#include "gpu/cuda_check.h"
#include "gpu/phi.cuh"
#include "gpu/step.h"
#include "gpu/step_kernels.cuh"
#include "gpu/stream_ops.h"

namespace eps::gpu {
using namespace kernels;  // NOLINT: this file launches them

bool DeviceAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

struct GpuSelector::Impl {
  ModelLayout model;
  SummaryLayout layout;
  int device = 0;
  int64_t max_batch = 0, max_groups = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  DeviceBuffer<float> phi, terms, scores, thresholds;
  DeviceBuffer<DeviceRow> rows;
  DeviceBuffer<uint8_t> scored;
  DeviceBuffer<DeviceStatus> status;
  DeviceBuffer<DeviceStats> stats;
  cudaStream_t release_stream = nullptr;  // writes inputs_ready when the engine never did
  // Pinned host staging: the row list up, the status and statistics down.
  DeviceRow* host_rows = nullptr;
  DeviceStatus* host_status = nullptr;
  DeviceStats* host_stats = nullptr;

  // The step queued by Enqueue and not yet finished.
  bool pending = false;
  StepFence fence;  // of the pending step (fence.step is its number)
  StepStats pending_host;  // the host-side part of its statistics
  std::vector<StepRow> pending_rows;
  int scored_kv_heads_total = 0;
  int64_t row_groups = 0, pending_num_slots = 0, pending_physical_blocks = 0;
  bool per_head = false;  // per-KV-head lists: each reads one KV head's K and V

  ~Impl() {
    // Sessions end on any thread (the lease reaper's device is 0): free on ours.
    cudaSetDevice(device);
    if (pending && fence.inputs_ready != nullptr) {
      // Never leave the stream waiting on an engine that is gone.
      (void)StreamRaiseCounter(release_stream, fence.inputs_ready, fence.step);  // best effort
    }
    if (stream != nullptr) cudaStreamSynchronize(stream);
    if (host_rows != nullptr) cudaFreeHost(host_rows);
    if (host_status != nullptr) cudaFreeHost(host_status);
    if (host_stats != nullptr) cudaFreeHost(host_stats);
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
    if (release_stream != nullptr) cudaStreamDestroy(release_stream);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

GpuSelector::GpuSelector(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuSelector::~GpuSelector() = default;

absl::StatusOr<std::unique_ptr<GpuSelector>> GpuSelector::Create(const ModelLayout& model,
                                                                 int device, int64_t max_batch,
                                                                 int64_t max_groups) {
  if (absl::Status s = model.Validate(); !s.ok()) return s;
  if (model.num_q_heads > 256 || model.sketch_dim > 64) {
    return absl::InvalidArgumentError("the GPU pre-pass supports at most 256 query heads, m <= 64");
  }
  auto impl = std::make_unique<Impl>();
  impl->model = model;
  impl->layout = SummaryLayout::For(model);
  impl->device = device;
  impl->max_batch = max_batch;
  impl->max_groups = max_groups;
  CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking));
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&impl->release_stream, cudaStreamNonBlocking));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&impl->start));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&impl->stop));
  CUDA_RETURN_IF_ERROR(cudaMallocHost(&impl->host_rows, max_batch * sizeof(DeviceRow)));
  CUDA_RETURN_IF_ERROR(cudaMallocHost(&impl->host_status, sizeof(DeviceStatus)));
  CUDA_RETURN_IF_ERROR(cudaMallocHost(&impl->host_stats, sizeof(DeviceStats)));
  const int64_t per_matrix = int64_t{model.head_dim} * model.sketch_dim;
  RETURN_IF_CUDA_ALLOC(impl->phi, model.num_layers * model.num_kv_heads * per_matrix);
  RETURN_IF_CUDA_ALLOC(impl->terms, max_batch * model.num_layers * model.num_q_heads *
                                        (PackedSize(model.sketch_dim) + 1));
  RETURN_IF_CUDA_ALLOC(impl->scores, max_batch * model.num_layers * model.num_q_heads * max_groups);
  RETURN_IF_CUDA_ALLOC(impl->thresholds, max_batch * model.num_layers * model.num_q_heads);
  RETURN_IF_CUDA_ALLOC(impl->rows, max_batch);
  RETURN_IF_CUDA_ALLOC(impl->scored, int64_t{model.num_layers} * model.num_q_heads);
  RETURN_IF_CUDA_ALLOC(impl->status, 1);
  RETURN_IF_CUDA_ALLOC(impl->stats, 1);
  // Load every kernel now: a lazy load at the first launch may wait for the
  // context to idle, which a stream waiting on inputs_ready prevents (stream_ops.h).
  RETURN_IF_ERROR(PreloadStreamOps());
  {
    cudaFuncAttributes attributes;
    for (const void* kernel :
         {reinterpret_cast<const void*>(&QueryTermsKernel), reinterpret_cast<const void*>(&ScoreKernel<4>),
          reinterpret_cast<const void*>(&ScoreKernel<8>), reinterpret_cast<const void*>(&ScoreKernel<16>),
          reinterpret_cast<const void*>(&ScoreKernel<0>), reinterpret_cast<const void*>(&ThresholdKernel),
          reinterpret_cast<const void*>(&SelectKernel)}) {
      CUDA_RETURN_IF_ERROR(cudaFuncGetAttributes(&attributes, kernel));
    }
  }
  GeneratePhiKernel<<<256, 256, 0, impl->stream>>>(model.phi_seed, model.num_layers,
                                                   model.num_kv_heads, static_cast<int>(per_matrix),
                                                   PhiScale(model.sketch_dim), impl->phi.get());
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(impl->stream));
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

bool GpuSelector::pending() const { return impl_->pending; }
uint64_t GpuSelector::pending_step() const { return impl_->fence.step; }

absl::Status GpuSelector::Enqueue(const StepInputs& in, const SelectPolicy& policy,
                                  const StepOutputs& out, const StepFence& fence) {
  Impl& g = *impl_;
  if (g.pending) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", g.fence.step, " is still pending: finish it first"));
  }
  const ModelLayout& m = g.model;
  if (absl::Status s = policy.Validate(m); !s.ok()) return s;
  if (policy.strict || policy.budget != Budget::kThreshold) {
    return absl::UnimplementedError(absl::StrCat(
        "the GPU pre-pass supports the threshold budget; got strict=", policy.strict,
        " budget=", BudgetName(policy.budget)));
  }
  const bool per_head = policy.granularity == Granularity::kPerKvHead;
  const int lists = per_head ? m.num_kv_heads : 1;
  const int64_t batch = static_cast<int64_t>(in.rows.size());
  if (batch == 0) {
    if (fence.selection_done != nullptr) {
      CUDA_RETURN_IF_ERROR(cudaSetDevice(g.device));
      if (fence.inputs_ready != nullptr) {
        RETURN_IF_ERROR(StreamWaitCounter(g.stream, fence.inputs_ready, fence.step));
      }
      RETURN_IF_ERROR(StreamWriteCounter(g.stream, fence.selection_done, fence.step));
    }
    return absl::OkStatus();
  }
  if (batch > in.max_batch || batch > g.max_batch) {
    return absl::InvalidArgumentError(absl::StrCat("batch of ", batch, " rows exceeds max_batch=",
                                                   std::min(in.max_batch, g.max_batch)));
  }
  if (in.max_groups > 8192) {  // the select kernel keeps 5 bytes per group in shared memory
    return absl::InvalidArgumentError(absl::StrCat("max_groups=", in.max_groups,
                                                   " exceeds the GPU pre-pass limit of 8192"));
  }
  if (in.max_groups > g.max_groups) {
    return absl::InvalidArgumentError(absl::StrCat("max_groups=", in.max_groups,
                                                   " exceeds the selector's ", g.max_groups));
  }
  DeviceRow* rows = g.host_rows;
  StepStats host;
  const int64_t kv_token_bytes = int64_t{2} * m.head_dim * DTypeSize(m.kv_dtype);
  int64_t max_n = 0, row_groups = 0;  // the longest row's groups; all rows' groups
  for (int64_t i = 0; i < batch; ++i) {
    const StepRow& r = in.rows[i];
    if (absl::Status s = CheckRowFits(m, in, static_cast<size_t>(i)); !s.ok()) return s;
    const int64_t nb = BlocksFor(r.context_tokens, m.block_size);
    const int64_t n = GroupsFor(r.context_tokens, m);
    rows[i] = {r.table_row, r.context_tokens};
    max_n = std::max(max_n, n);
    row_groups += n;
    host.groups_total += n * m.num_layers * lists;
    host.blocks_total += nb * m.num_layers * lists;
    host.kv_bytes_dense += r.context_tokens * m.num_kv_heads * kv_token_bytes * m.num_layers;
  }
  const bool retrieval = policy.heads == HeadMode::kRetrieval;
  Shape s{};
  s.layers = m.num_layers;
  s.q_heads = m.num_q_heads;
  s.kv_heads = m.num_kv_heads;
  s.d = m.head_dim;
  s.m = m.sketch_dim;
  s.packed = PackedSize(m.sketch_dim);
  s.record_words = g.layout.record_words;
  s.block_size = m.block_size;
  s.group_blocks = m.group_blocks;
  s.fro2 = g.layout.fro2;
  s.max_norm = g.layout.max_norm;
  s.count = g.layout.count;
  s.key_sum = g.layout.key_sum;
  s.quest_min = g.layout.quest_min;
  s.quest_max = g.layout.quest_max;
  s.principal = g.layout.principal;
  s.max_batch = in.max_batch;
  s.max_seqs = in.max_seqs;
  s.max_groups = in.max_groups;
  s.max_blocks = in.max_blocks;
  s.num_slots = in.num_slots;
  s.num_physical_blocks = in.num_physical_blocks;
  s.query_dtype = static_cast<int>(in.query_dtype);
  s.method = static_cast<int>(policy.method);
  s.lists = lists;

  CUDA_RETURN_IF_ERROR(cudaSetDevice(g.device));
  if (fence.inputs_ready != nullptr) {
    RETURN_IF_ERROR(StreamWaitCounter(g.stream, fence.inputs_ready, fence.step));
  }
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(g.rows.get(), rows, batch * sizeof(DeviceRow),
                                       cudaMemcpyHostToDevice, g.stream));
  if (retrieval) {
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(g.scored.get(), policy.retrieval_heads.data(),
                                         policy.retrieval_heads.size(), cudaMemcpyHostToDevice,
                                         g.stream));
  }
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(g.status.get(), 0, sizeof(DeviceStatus), g.stream));
  CUDA_RETURN_IF_ERROR(cudaMemsetAsync(g.stats.get(), 0, sizeof(DeviceStats), g.stream));
  CUDA_RETURN_IF_ERROR(cudaEventRecord(g.start, g.stream));
  const uint8_t* scored = retrieval ? g.scored.get() : nullptr;
  const int query_warps = static_cast<int>(batch * m.num_layers * m.num_q_heads);
  QueryTermsKernel<<<(query_warps + 7) / 8, 256, 0, g.stream>>>(s, in.queries, g.phi.get(), query_warps,
                                                                 g.terms.get(), g.status.get());
  const dim3 score_grid(static_cast<unsigned>((max_n + 127) / 128),
                        static_cast<unsigned>(m.num_layers * m.num_kv_heads),
                        static_cast<unsigned>(batch));
  if (policy.method != Method::kOff) {
    auto score = [&](auto kernel) {
      kernel<<<score_grid, 128, 0, g.stream>>>(s, in.summary_pool, in.group_table, in.block_table,
                                               in.queries, g.rows.get(), g.terms.get(), scored,
                                               g.scores.get(), g.status.get());
    };
    switch (m.sketch_dim) {  // the common sketch sizes get the register-resident Gram
      case 4:
        score(ScoreKernel<4>);
        break;
      case 8:
        score(ScoreKernel<8>);
        break;
      case 16:
        score(ScoreKernel<16>);
        break;
      default:
        score(ScoreKernel<0>);
        break;
    }
  }
  const int warps = static_cast<int>(batch * m.num_layers * m.num_q_heads);
  if (policy.method != Method::kOff) {
    ThresholdKernel<<<(warps + 7) / 8, 256, 0, g.stream>>>(
        s, policy.alpha, policy.first_n, policy.last_n, policy.top_pages, warps, g.rows.get(),
        scored, g.scores.get(), g.thresholds.get(), g.status.get());
  }
  // Dynamic shared memory: visit flags (padded to 16 bytes), then group offsets.
  const size_t select_shared = (in.max_groups + 15) / 16 * 16 + in.max_groups * sizeof(unsigned);
  SelectKernel<<<dim3(m.num_layers * lists, static_cast<unsigned>(batch)), 256, select_shared,
                 g.stream>>>(
      s, policy.first_n, policy.last_n, policy.method == Method::kOff, in.block_table,
      g.rows.get(), g.scores.get(), g.thresholds.get(), out.visit_blocks, out.visit_count,
      g.status.get(), g.stats.get(), fence.selection_done, fence.step);
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  CUDA_RETURN_IF_ERROR(cudaEventRecord(g.stop, g.stream));
  if (fence.selection_done != nullptr) {
    RETURN_IF_ERROR(StreamWriteCounter(g.stream, fence.selection_done, fence.step));
  }
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(g.host_status, g.status.get(), sizeof(DeviceStatus),
                                       cudaMemcpyDeviceToHost, g.stream));
  CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(g.host_stats, g.stats.get(), sizeof(DeviceStats),
                                       cudaMemcpyDeviceToHost, g.stream));
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
  g.row_groups = row_groups;
  g.pending_num_slots = in.num_slots;
  g.pending_physical_blocks = in.num_physical_blocks;
  return absl::OkStatus();
}

absl::Status GpuSelector::Finish(std::chrono::microseconds timeout, StepStats* stats,
                                 float* prepass_us) {
  Impl& g = *impl_;
  if (!g.pending) return absl::FailedPreconditionError("no step is pending");
  CUDA_RETURN_IF_ERROR(cudaSetDevice(g.device));
  bool released = false;
  if (timeout != std::chrono::microseconds::max() && g.fence.inputs_ready != nullptr) {
    // Bounded wait: poll the stream; yield rather than spin a core.
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    cudaError_t q;
    while ((q = cudaStreamQuery(g.stream)) == cudaErrorNotReady) {
      if (std::chrono::steady_clock::now() >= deadline) {
        // The engine never wrote inputs_ready: release our own wait so the
        // stream drains (the step then runs on whatever inputs are there).
        RETURN_IF_ERROR(StreamRaiseCounter(g.release_stream, g.fence.inputs_ready, g.fence.step));
        released = true;
        break;
      }
      std::this_thread::yield();
    }
    if (q != cudaSuccess && q != cudaErrorNotReady) {
      g.pending = false;
      return absl::InternalError(absl::StrCat("step stream: ", cudaGetErrorString(q)));
    }
  }
  g.pending = false;
  CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(g.stream));
  if (released) {
    return absl::DeadlineExceededError(absl::StrCat(
        "inputs_ready never reached step ", g.fence.step, " within ", timeout.count(),
        " us: the wait was released and the step's lists are not trustworthy"));
  }
  if (prepass_us != nullptr) {
    float ms = 0.0f;
    CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&ms, g.start, g.stop));
    *prepass_us = ms * 1000.0f;
  }
  const ModelLayout& m = g.model;
  const DeviceStatus status = *g.host_status;
  const DeviceStats dstats = *g.host_stats;
  const std::vector<StepRow>& rows = g.pending_rows;
  switch (status.code) {
    case kBadSlot:
      return absl::InvalidArgumentError(absl::StrCat("group_table[", rows[status.row].table_row, "][",
                                                     status.index, "]=", status.value,
                                                     " not in [0, ", g.pending_num_slots, ")"));
    case kBadBlock:
      return absl::InvalidArgumentError(absl::StrCat("block_table[", rows[status.row].table_row, "][",
                                                     status.index, "]=", status.value, " not in [0, ",
                                                     g.pending_physical_blocks, ")"));
    case kBadScore:
      return absl::InvalidArgumentError(absl::StrCat("summary of slot ", status.value,
                                                     " gives a non-finite score: the summary "
                                                     "holds NaN or Inf"));
    case kBadQuery:
      return absl::InvalidArgumentError(absl::StrCat("query of row ", status.row,
                                                     " element ", status.index, " is not finite"));
    default:
      break;
  }
  if (stats != nullptr) {
    StepStats host = g.pending_host;
    const int64_t kv_token_bytes = int64_t{2} * m.head_dim * DTypeSize(m.kv_dtype);
    host.groups_visited = static_cast<int64_t>(dstats.groups_visited);
    host.blocks_visited = static_cast<int64_t>(dstats.blocks_visited);
    host.kv_bytes_read_est = static_cast<int64_t>(dstats.visited_tokens) *
                             (g.per_head ? 1 : m.num_kv_heads) * kv_token_bytes;
    host.summary_bytes_read = g.row_groups * g.scored_kv_heads_total * g.layout.record_bytes();
    *stats = host;
  }
  return absl::OkStatus();
}

absl::Status GeneratePhiOnDevice(uint64_t seed, int layer, int kv_head, int head_dim, int m,
                                 float* host_out) {
  const int per_matrix = head_dim * m;
  DeviceBuffer<float> all;
  RETURN_IF_CUDA_ALLOC(all, int64_t{layer + 1} * (kv_head + 1) * per_matrix);
  GeneratePhiKernel<<<64, 256>>>(seed, layer + 1, kv_head + 1, per_matrix, PhiScale(m), all.get());
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  const int64_t offset = (int64_t{layer} * (kv_head + 1) + kv_head) * per_matrix;
  CUDA_RETURN_IF_ERROR(cudaMemcpy(host_out, all.get() + offset, per_matrix * sizeof(float),
                                  cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

}  // namespace eps::gpu
