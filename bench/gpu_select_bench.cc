// The GPU pre-pass for one decode step of a Llama-3-8B shape (32 layers, 32 q
// heads, 8 KV heads, d = 128, g = 8 (--group-blocks), m = 8, 160-byte records), timed with CUDA
// events, next to two floors: summary bytes ÷ the datasheet bandwidth, and
// summary bytes ÷ the bandwidth of a device-to-device copy measured in the
// same run (bytes read plus bytes written, METHOD.md's ceiling). A second
// table times every policy at one shape (default batch 8 × 32k): the budgets,
// strict mode, per-KV-head lists, and quest over its 16-bit summaries.
//
// Usage: eps_gpu_bench [--batches=1,8,64] [--contexts=8192,32768,131072]
//                      [--policy-batch=8] [--policy-context=32768] [--group-blocks=8]
//                      [--top-pages=16] [--slots=consecutive|scattered]
//                      [--policies=questclt,jl threshold]   (policy rows whose name holds one)
//                      [--pool=local|ipc] [--pool-offset=0] [--pool-pad=0]
//                      [--coarse-batches=8,64] [--coarse-context=32768]
//                      [--feedback-batches=8] [--feedback-context=32768]
//                      [--queued=off]   (no fence-held steps: queued_us nan; for profilers)
//                      [--queries=bf16]  (the step's queries in bfloat16, as an engine whose
//                                         attention runs in bf16 hands them; float32 default)
//                      [--stage-clocks]  (after each fused_us run, its blocks' stage
//                                         clocks: a build with -DEPS_STAGE_CLOCKS=ON)
//
// A third table sets the coarse level (coarse-to-fine selection) beside the flat
// selection: questclt, g = 1 with coarse groups of 4 blocks against g = 2
// (--coarse-batches= with no value skips it, as --batches= and --policy-batch=
// skip the others). A fourth times selection feedback (gpu/feedback.cuh): questclt
// at g = 2 without feedback and with 0, 25 and 100 % of the groups fed
// (--feedback-batches= with no value skips it).
//
// --pool-offset places the pool that many bytes (a multiple of 256, as the clients
// place their buffers) into its allocation, which is rounded up to whole 2 MiB pages
// as the client libraries round theirs; --pool-pad adds that many bytes past the
// rounding (4096: an IPC allocation that is not whole pages, which epsd reads up to
// 2.4x slower; docs/design.md §5).
//
// --pool=ipc puts each step's summary pool in a child process (this binary run
// with --serve-pool=BYTES) and maps it here through CUDA IPC, as epsd maps an
// engine's pool; local (the default) allocates it here.
//
// --slots=scattered gives every group a slot drawn from a random permutation of
// the pool's slots, as an engine's allocator does after churn (the reference
// engine's slots are such a permutation); consecutive (the default, and every
// table before 2026-11-25) gives a row's groups consecutive slots.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_split.h"
#include "bench/gpu_bench_util.h"
#include "bench/gpu_coarse_table.h"
#include "bench/gpu_feedback_table.h"
#include "bench/gpu_policy_cases.h"
#include "core/buffer_contract.h"
#include "core/half.h"
#include "core/status.h"
#include "core/testing/synthetic.h"
#include "gpu/cuda_check.h"
#include "gpu/stage_clocks.h"
#include "gpu/step.h"
#include "gpu/stream_ops.h"

namespace {

using eps::bench::MeasureQueued;
using eps::bench::Median;
using eps::bench::Upload;
using eps::gpu::DeviceBuffer;

// The benchmark's budget since its first table (docs/benchmarks/gpu.md), kept
// when epsd's default moved to 64 groups of g = 2 (--top-pages sets it).
int top_pages_per_head = 16;
// --queries=bf16: the queries' element type (float32 in every table before 2026-11-27).
eps::DType query_dtype = eps::DType::kFloat32;
bool scattered_slots = false;           // --slots=scattered
std::vector<std::string> policy_names;  // --policies: the rows to run (empty: all)
bool ipc_pool = false;                  // --pool=ipc
bool stage_clocks = false;              // --stage-clocks
int64_t pool_offset = 0;                // --pool-offset: the pool's bytes into its allocation
int64_t pool_pad = 0;                   // --pool-pad: bytes allocated after the pool

std::vector<int64_t> ParseList(const char* arg, const char* flag, std::vector<int64_t> fallback) {
  const size_t n = std::strlen(flag);
  if (std::strncmp(arg, flag, n) != 0) return fallback;
  std::vector<int64_t> out;
  for (const char* p = arg + n; *p != '\0';) {
    char* end = nullptr;
    out.push_back(std::strtoll(p, &end, 10));
    p = (*end == ',') ? end + 1 : end;
  }
  return out;
}

// The copy ceiling: a 1 GiB device-to-device copy, bytes read plus written.
absl::StatusOr<double> MeasureCopyGBs() {
  const int64_t bytes = int64_t{1} << 30;
  DeviceBuffer<char> a, b;
  RETURN_IF_CUDA_ALLOC(a, bytes);
  RETURN_IF_CUDA_ALLOC(b, bytes);
  CUDA_RETURN_IF_ERROR(cudaMemset(a.get(), 1, bytes));
  cudaEvent_t start, stop;
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int i = 0; i < 25; ++i) {
    CUDA_RETURN_IF_ERROR(cudaEventRecord(start));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice));
    CUDA_RETURN_IF_ERROR(cudaEventRecord(stop));
    CUDA_RETURN_IF_ERROR(cudaEventSynchronize(stop));
    float t = 0;
    CUDA_RETURN_IF_ERROR(cudaEventElapsedTime(&t, start, stop));
    if (i >= 5) ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 2.0 * bytes / (Median(ms) * 1e-3) / 1e9;
}

// A summary pool that a child process allocates and this one maps through CUDA
// IPC (--pool=ipc). The child (ServePool) lives until its stdin closes.
class IpcPool {
 public:
  static absl::StatusOr<std::unique_ptr<IpcPool>> Spawn(int64_t bytes) {
    // down: our writes to its stdin; up: its stdout to us. Close-on-exec, so that no
    // later child holds this one's stdin open (the dup2 copies in the child are not).
    int down[2], up[2];
    if (pipe2(down, O_CLOEXEC) != 0 || pipe2(up, O_CLOEXEC) != 0) {
      return absl::InternalError("pipe2 failed");
    }
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, down[0], 0);
    posix_spawn_file_actions_adddup2(&actions, up[1], 1);
    posix_spawn_file_actions_addclose(&actions, down[1]);
    posix_spawn_file_actions_addclose(&actions, up[0]);
    const std::string arg = "--serve-pool=" + std::to_string(bytes);
    char self[] = "/proc/self/exe";
    char* child_argv[] = {self, const_cast<char*>(arg.c_str()), nullptr};
    auto pool = std::unique_ptr<IpcPool>(new IpcPool());
    const int spawned = posix_spawn(&pool->pid_, self, &actions, nullptr, child_argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    close(down[0]);
    close(up[1]);
    pool->to_child_ = down[1];
    if (spawned != 0) {
      close(up[0]);
      pool->pid_ = -1;
      return absl::InternalError("posix_spawn of the pool process failed");
    }
    cudaIpcMemHandle_t handle;
    size_t got = 0;
    while (got < sizeof(handle)) {
      const ssize_t n = read(up[0], reinterpret_cast<char*>(&handle) + got, sizeof(handle) - got);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    close(up[0]);
    if (got != sizeof(handle)) return absl::InternalError("the pool process sent no handle");
    void* ptr = nullptr;
    CUDA_RETURN_IF_ERROR(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess));
    pool->data_ = static_cast<float*>(ptr);
    return pool;
  }
  ~IpcPool() {
    if (data_ != nullptr) cudaIpcCloseMemHandle(data_);
    if (to_child_ >= 0) close(to_child_);  // the child frees its pool and exits
    if (pid_ > 0) waitpid(pid_, nullptr, 0);
  }
  float* get() const { return data_; }

 private:
  IpcPool() = default;
  pid_t pid_ = -1;
  int to_child_ = -1;
  float* data_ = nullptr;
};

// The child of IpcPool::Spawn: allocates `bytes`, writes its IPC handle to
// stdout, and frees it once stdin closes.
int ServePool(int64_t bytes) {
  void* pool = nullptr;
  cudaIpcMemHandle_t handle;
  if (cudaMalloc(&pool, bytes) != cudaSuccess ||
      cudaIpcGetMemHandle(&handle, pool) != cudaSuccess) {
    return 1;
  }
  if (write(1, &handle, sizeof(handle)) != static_cast<ssize_t>(sizeof(handle))) return 1;
  char c;
  while (read(0, &c, 1) > 0) {
  }
  cudaFree(pool);
  return 0;
}

// One step's inputs on the device: `batch` rows of `context` tokens each with
// random summaries, and room for the lists; `in` points at the device copies.
struct DeviceStep {
  explicit DeviceStep(const eps::ModelLayout& m, int batch, int64_t context,
                      eps::Granularity granularity)
      : buffers(m, batch, context, batch, granularity) {}
  eps::testing::StepBuffers buffers;
  std::vector<eps::StepRow> rows;  // `in.rows` views it
  eps::StepInputs in;
  DeviceBuffer<float> pool, queries;
  std::unique_ptr<IpcPool> ipc;  // --pool=ipc: the pool, in place of `pool`
  DeviceBuffer<int32_t> groups, blocks, visit, count;
  eps::StepOutputs outputs() { return {visit.get(), count.get()}; }
};

absl::StatusOr<std::unique_ptr<DeviceStep>> MakeDeviceStep(const eps::ModelLayout& m, int batch,
                                                           int64_t context,
                                                           eps::Granularity granularity) {
  auto d = std::make_unique<DeviceStep>(m, batch, context, granularity);
  for (int b = 0; b < batch; ++b) {
    d->buffers.AssignRow(b, context, b);
    d->rows.push_back({.table_row = b, .context_tokens = context, .seq_id = 0});
  }
  if (scattered_slots) {
    std::vector<int32_t>& table = d->buffers.group_table();
    std::vector<int32_t> slots(d->buffers.num_slots());
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), std::mt19937_64(7));
    for (int b = 0; b < batch; ++b) {
      for (int64_t p = 0; p < d->buffers.max_groups(); ++p) {
        table[b * d->buffers.max_groups() + p] = slots[b * d->buffers.max_groups() + p];
      }
    }
  }
  d->buffers.FillRandomSummaries(1);
  d->in = d->buffers.Inputs(d->rows);
  const int lists = granularity == eps::Granularity::kPerKvHead ? m.num_kv_heads : 1;
  const int64_t qcount = int64_t{m.num_layers} * batch * m.num_q_heads * m.head_dim;
  eps::testing::StepBuffers& b = d->buffers;  // read only (its accessors are not const)
  // The pool at pool_offset bytes into its allocation, as an engine's region holds it
  // among the other buffers (client/cpp/buffer_plan.h), the allocation rounded up to
  // whole 2 MiB pages as the client libraries round theirs, then pool_pad bytes more.
  const int64_t bytes = static_cast<int64_t>(b.pool().size() * sizeof(float));
  const auto allocation =
      static_cast<int64_t>(eps::RegionBytes(static_cast<uint64_t>(pool_offset + bytes))) + pool_pad;
  float* pool = nullptr;
  if (ipc_pool) {
    ASSIGN_OR_RETURN(d->ipc, IpcPool::Spawn(allocation));
    pool = d->ipc->get();
  } else {
    RETURN_IF_CUDA_ALLOC(d->pool, (allocation + 3) / 4);
    pool = d->pool.get();
  }
  pool = reinterpret_cast<float*>(reinterpret_cast<std::byte*>(pool) + pool_offset);
  CUDA_RETURN_IF_ERROR(cudaMemcpy(pool, b.pool().data(), bytes, cudaMemcpyHostToDevice));
  RETURN_IF_ERROR(Upload(d->groups, b.group_table().data(), b.group_table().size()));
  RETURN_IF_ERROR(Upload(d->blocks, b.block_table().data(), b.block_table().size()));
  const auto* host_queries = static_cast<const float*>(d->in.queries);
  if (query_dtype == eps::DType::kBFloat16) {
    // Two bf16 values a float of the device buffer; the selector reads query_dtype.
    std::vector<uint16_t> narrow(static_cast<size_t>(qcount + 1) / 2 * 2);
    for (int64_t i = 0; i < qcount; ++i) narrow[i] = eps::FloatToBFloat16(host_queries[i]);
    RETURN_IF_ERROR(Upload(d->queries, reinterpret_cast<const float*>(narrow.data()),
                           static_cast<int64_t>(narrow.size() / 2)));
  } else {
    RETURN_IF_ERROR(Upload(d->queries, host_queries, qcount));
  }
  d->in.query_dtype = query_dtype;
  RETURN_IF_CUDA_ALLOC(d->visit, int64_t{m.num_layers} * batch * lists * b.max_blocks());
  RETURN_IF_CUDA_ALLOC(d->count, int64_t{m.num_layers} * batch * lists);
  d->in.summary_pool = pool;
  d->in.group_table = d->groups.get();
  d->in.block_table = d->blocks.get();
  d->in.queries = d->queries.get();
  return d;
}

struct Row {
  int64_t batch, context;
  double summary_mb, jl_us, fro_us, off_us, wall_us, visited_pct, direct_us, direct_wall_us,
      fused_us, tkernel_us, queued_us, split_us, direct_queued_us;
};

absl::StatusOr<Row> Measure(const eps::ModelLayout& m, int batch, int64_t context) {
  ASSIGN_OR_RETURN(std::unique_ptr<DeviceStep> step,
                   MakeDeviceStep(m, batch, context, eps::Granularity::kUnion));
  const eps::StepInputs& in = step->in;
  eps::testing::StepBuffers& buffers = step->buffers;
  auto selector = eps::gpu::GpuSelector::Create(m, 0, batch, buffers.max_groups());
  if (!selector.ok()) return selector.status();
  auto direct = eps::gpu::GpuSelector::Create(m, 0, batch, buffers.max_groups(), {.graphs = false});
  if (!direct.ok()) return direct.status();
  using Fusion = eps::gpu::GpuSelectorOptions::Fusion;
  auto fused =
      eps::gpu::GpuSelector::Create(m, 0, batch, buffers.max_groups(), {.fusion = Fusion::kAlways});
  if (!fused.ok()) return fused.status();
  auto split =
      eps::gpu::GpuSelector::Create(m, 0, batch, buffers.max_groups(), {.fusion = Fusion::kNever});
  if (!split.ok()) return split.status();
  auto tkernel =
      eps::gpu::GpuSelector::Create(m, 0, batch, buffers.max_groups(), {.terms_kernel = true});
  if (!tkernel.ok()) return tkernel.status();
  // jl is the product; off (no scoring, and no fused selection) and fro (one
  // word read per record) split the time into its parts by subtraction;
  // `direct` is jl with the kernels launched one by one instead of replayed as
  // a graph, `fused` and `split` jl with the selection always and never fused
  // into scoring (jl itself fuses at every batch since the eleventh session: Fusion::kAuto),
  // `tkernel` jl with its query terms from the terms kernel instead of the
  // scoring blocks (gpu/step.h).
  Row row{batch, context, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const eps::Method methods[7] = {eps::Method::kJl, eps::Method::kFro, eps::Method::kOff,
                                  eps::Method::kJl, eps::Method::kJl,  eps::Method::kJl,
                                  eps::Method::kJl};
  double* p50[7] = {&row.jl_us,    &row.fro_us,     &row.off_us,  &row.direct_us,
                    &row.fused_us, &row.tkernel_us, &row.split_us};
  for (int k = 0; k < 7; ++k) {
    eps::gpu::GpuSelector* selector_k = k == 3   ? direct->get()
                                        : k == 4 ? fused->get()
                                        : k == 5 ? tkernel->get()
                                        : k == 6 ? split->get()
                                                 : selector->get();
    eps::SelectPolicy policy;
    policy.top_pages = top_pages_per_head;
    policy.method = methods[k];
    std::vector<float> gpu_us, wall_us;
    eps::StepStats stats;
    for (int i = 0; i < 60; ++i) {
      float us = 0;
      const auto t0 = std::chrono::steady_clock::now();
      if (absl::Status s = selector_k->Select(in, policy, step->outputs(), &stats, &us); !s.ok()) {
        return s;
      }
      const auto t1 = std::chrono::steady_clock::now();
      if (i >= 10) {  // warm-up excluded
        gpu_us.push_back(us);
        wall_us.push_back(std::chrono::duration<float, std::micro>(t1 - t0).count());
      }
    }
    *p50[k] = Median(gpu_us);
    if (k == 4 && stage_clocks) {  // the fused kernel's last launch
      ASSIGN_OR_RETURN(const std::string clocks,
                       eps::gpu::FusedStageClocks(m.num_layers * m.num_kv_heads * batch));
      std::printf("# batch %d, fused: %s", batch, clocks.c_str());
    }
    if (k == 3) {
      row.direct_wall_us = Median(wall_us);
      ASSIGN_OR_RETURN(row.direct_queued_us, MeasureQueued(**direct, in, policy, step->outputs()));
    }
    if (k == 0) {
      ASSIGN_OR_RETURN(row.queued_us, MeasureQueued(**selector, in, policy, step->outputs()));
      row.wall_us = Median(wall_us);
      row.summary_mb = stats.summary_bytes_read / 1e6;
      row.visited_pct = 100.0 * stats.groups_visited / stats.groups_total;
    }
  }
  return row;
}

// One shape, many policies (bench/gpu_policy_cases.h): p50 GPU µs of each, with the
// summary bytes it read.
absl::Status MeasurePolicies(eps::ModelLayout m, int batch, int64_t context, double copy_gbs) {
  const std::vector<eps::bench::PolicyCase> cases = eps::bench::PolicyCases(top_pages_per_head);
  std::printf("\npolicies at batch %d x %lld (p50 of 50 steps):\n", batch,
              static_cast<long long>(context));
  std::printf("%-38s %8s %10s %9s %9s %8s %9s\n", "policy", "record_B", "summaryMB", "gpu_us",
              "copy_us", "%copy", "visited%");
  for (const eps::bench::PolicyCase& c : cases) {
    if (!policy_names.empty() &&
        std::none_of(policy_names.begin(), policy_names.end(), [&](const std::string& n) {
          return std::string(c.name).find(n) != std::string::npos;
        })) {
      continue;
    }
    m.features = c.features;
    ASSIGN_OR_RETURN(std::unique_ptr<DeviceStep> step,
                     MakeDeviceStep(m, batch, context, c.policy.granularity));
    eps::testing::StepBuffers& buffers = step->buffers;
    ASSIGN_OR_RETURN(auto selector,
                     eps::gpu::GpuSelector::Create(m, 0, batch, buffers.max_groups(), c.options));
    std::vector<float> gpu_us;
    eps::StepStats stats;
    for (int i = 0; i < 60; ++i) {
      float us = 0;
      RETURN_IF_ERROR(selector->Select(step->in, c.policy, step->outputs(), &stats, &us));
      if (i >= 10) gpu_us.push_back(us);
    }
    const double us = Median(gpu_us);
    const double bytes = static_cast<double>(stats.summary_bytes_read);
    const double copy_us = bytes / (copy_gbs * 1e9) * 1e6;
    std::printf("%-38s %8lld %10.1f %9.1f %9.1f %7.1f%% %8.1f%%\n", c.name,
                static_cast<long long>(eps::SummaryLayout::For(m).record_bytes()), bytes / 1e6, us,
                copy_us, 100.0 * copy_us / us, 100.0 * stats.groups_visited / stats.groups_total);
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

}  // namespace

// Every flag the bench reads; a name outside it is a typo that would run the defaults.
constexpr const char* kFlags[] = {
    "--group-blocks=",     "--batches=",        "--contexts=",       "--policy-batch=",
    "--policy-context=",   "--top-pages=",      "--slots=scattered", "--pool=ipc",
    "--queued=off",        "--stage-clocks",    "--queries=bf16",    "--pool-offset=",
    "--pool-pad=",         "--coarse-batches=", "--coarse-context=", "--feedback-batches=",
    "--feedback-context=", "--policies=",       "--pool=local"};

int main(int argc, char** argv) {
  if (argc == 2 && std::strncmp(argv[1], "--serve-pool=", 13) == 0) {
    return ServePool(std::strtoll(argv[1] + 13, nullptr, 10));
  }
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0) {
      std::printf(
          "usage: eps_gpu_bench [flags]: the GPU pre-pass benchmark "
          "(docs/benchmarks/gpu.md); needs a CUDA device. Flags:");
      for (const char* flag : kFlags) std::printf(" %s", flag);
      std::printf("\n(lists are comma-separated; an empty list skips that table)\n");
      return 0;
    }
    if (std::none_of(std::begin(kFlags), std::end(kFlags), [&](const char* flag) {
          const size_t n = std::strlen(flag);
          return flag[n - 1] == '=' ? std::strncmp(argv[i], flag, n) == 0
                                    : std::strcmp(argv[i], flag) == 0;
        })) {
      std::fprintf(stderr, "eps_gpu_bench: unknown flag %s (--help lists them)\n", argv[i]);
      return 2;
    }
  }
  std::vector<int64_t> batches{1, 8, 64}, contexts{8192, 32768, 131072};
  std::vector<int64_t> policy_batch{8}, policy_context{32768}, group_blocks{8}, top_pages{16};
  std::vector<int64_t> pool_offsets{0}, pool_pads{0};
  std::vector<int64_t> coarse_batches{8, 64}, coarse_context{32768};
  std::vector<int64_t> feedback_batches{8}, feedback_context{32768};
  for (int i = 1; i < argc; ++i) {
    group_blocks = ParseList(argv[i], "--group-blocks=", group_blocks);
    batches = ParseList(argv[i], "--batches=", batches);
    contexts = ParseList(argv[i], "--contexts=", contexts);
    policy_batch = ParseList(argv[i], "--policy-batch=", policy_batch);
    policy_context = ParseList(argv[i], "--policy-context=", policy_context);
    top_pages = ParseList(argv[i], "--top-pages=", top_pages);
    if (std::strcmp(argv[i], "--slots=scattered") == 0) scattered_slots = true;
    if (std::strcmp(argv[i], "--pool=ipc") == 0) ipc_pool = true;
    if (std::strcmp(argv[i], "--queued=off") == 0) eps::bench::SkipQueued();
    if (std::strcmp(argv[i], "--stage-clocks") == 0) stage_clocks = true;
    if (std::strcmp(argv[i], "--queries=bf16") == 0) query_dtype = eps::DType::kBFloat16;
    pool_offsets = ParseList(argv[i], "--pool-offset=", pool_offsets);
    pool_pads = ParseList(argv[i], "--pool-pad=", pool_pads);
    coarse_batches = ParseList(argv[i], "--coarse-batches=", coarse_batches);
    coarse_context = ParseList(argv[i], "--coarse-context=", coarse_context);
    feedback_batches = ParseList(argv[i], "--feedback-batches=", feedback_batches);
    feedback_context = ParseList(argv[i], "--feedback-context=", feedback_context);
    if (std::strncmp(argv[i], "--policies=", 11) == 0) {
      policy_names = absl::StrSplit(argv[i] + 11, ',', absl::SkipEmpty());
    }
  }
  if (top_pages.empty() || top_pages[0] < 1) {
    std::printf("error: --top-pages must be a positive count\n");
    return 1;
  }
  top_pages_per_head = static_cast<int>(top_pages[0]);
  if (pool_offsets.empty() || pool_offsets[0] < 0 ||
      pool_offsets[0] % static_cast<int64_t>(eps::kBufferAlignment) != 0 || pool_pads.empty() ||
      pool_pads[0] < 0) {
    std::printf("error: --pool-offset must be a multiple of %llu and --pool-pad at least 0\n",
                static_cast<unsigned long long>(eps::kBufferAlignment));
    return 1;
  }
  pool_offset = pool_offsets[0];
  pool_pad = pool_pads[0];
  if (!eps::gpu::DeviceAvailable()) {
    std::fprintf(stderr, "eps_gpu_bench: no CUDA device: nothing measured\n");
    return 1;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  int clock_khz = 0, bus_bits = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, 0);
  cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0);
  const double peak_gbs = 2.0 * clock_khz * 1e3 * (bus_bits / 8) / 1e9;
  absl::StatusOr<double> copy_gbs = MeasureCopyGBs();
  if (!copy_gbs.ok()) {
    std::printf("error: %s\n", copy_gbs.status().ToString().c_str());
    return 1;
  }
  std::printf("device: %s, theoretical %.0f GB/s, measured d2d copy %.0f GB/s (read + write)\n",
              prop.name, peak_gbs, *copy_gbs);
  std::printf("%6s %8s %10s %9s %9s %9s %8s %7s %9s %8s %8s %9s %9s %10s %10s %10s %10s %9s %10s\n",
              "batch", "context", "summaryMB", "jl_us", "floor_us", "copy_us", "GB/s", "%copy",
              "visited%", "fro_us", "off_us", "wall_us", "direct_us", "dwall_us", "fused_us",
              "tkernel_us", "queued_us", "split_us", "dqueued_us");
  eps::ModelLayout m;
  m.num_layers = 32;
  m.num_q_heads = 32;
  m.num_kv_heads = 8;
  m.head_dim = 128;
  m.group_blocks = group_blocks.empty() ? 8 : static_cast<int>(group_blocks[0]);
  if (m.group_blocks < 1 || m.group_blocks > 1024) {
    std::printf("error: --group-blocks=%d not in [1, 1024]\n", m.group_blocks);
    return 1;
  }
  std::printf("g = %d blocks of 16 tokens per group, top_pages %d, %s slots, pool %s, %s queries\n",
              m.group_blocks, top_pages_per_head, scattered_slots ? "scattered" : "consecutive",
              ipc_pool ? "mapped from another process (CUDA IPC)" : "allocated here",
              eps::DTypeName(query_dtype));
  m.features = {.key_sum = false, .principal = false, .quest = false};
  for (int64_t batch : batches) {
    for (int64_t context : contexts) {
      absl::StatusOr<Row> r = Measure(m, static_cast<int>(batch), context);
      if (!r.ok()) {
        std::printf("error at batch %lld context %lld: %s\n", static_cast<long long>(batch),
                    static_cast<long long>(context), r.status().ToString().c_str());
        return 1;
      }
      const double bytes = r->summary_mb * 1e6;
      const double gbs = bytes / (r->jl_us * 1e-6) / 1e9;
      std::printf(
          "%6lld %8lld %10.1f %9.1f %9.1f %9.1f %8.0f %6.1f%% %8.1f%% %8.1f %8.1f %9.1f %9.1f "
          "%10.1f %10.1f %10.1f %10.1f %9.1f %10.1f\n",
          static_cast<long long>(batch), static_cast<long long>(context), r->summary_mb, r->jl_us,
          bytes / (peak_gbs * 1e9) * 1e6, bytes / (*copy_gbs * 1e9) * 1e6, gbs,
          100.0 * gbs / *copy_gbs, r->visited_pct, r->fro_us, r->off_us, r->wall_us, r->direct_us,
          r->direct_wall_us, r->fused_us, r->tkernel_us, r->queued_us, r->split_us,
          r->direct_queued_us);
      std::fflush(stdout);
    }
  }
  if (!policy_batch.empty() && !policy_context.empty()) {
    if (absl::Status s =
            MeasurePolicies(m, static_cast<int>(policy_batch[0]), policy_context[0], *copy_gbs);
        !s.ok()) {
      std::printf("error in the policy table: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  if (!coarse_batches.empty() && !coarse_context.empty()) {
    std::printf("\ncoarse level, questclt, top_pages %d (p50 of 50 steps):\n", top_pages_per_head);
    std::printf("%6s %8s  %-32s %10s %9s %10s %9s\n", "batch", "context", "selection", "summaryMB",
                "gpu_us", "queued_us", "visited%");
    for (int64_t batch : coarse_batches) {
      if (absl::Status s = eps::bench::MeasureCoarse(m, static_cast<int>(batch), coarse_context[0],
                                                     top_pages_per_head);
          !s.ok()) {
        std::printf("error in the coarse table: %s\n", s.ToString().c_str());
        return 1;
      }
    }
  }
  if (!feedback_batches.empty() && !feedback_context.empty()) {
    std::printf("\nselection feedback, questclt g = 2, top_pages %d (p50 of 50 steps):\n",
                top_pages_per_head);
    for (int64_t batch : feedback_batches) {
      if (absl::Status s = eps::bench::MeasureFeedback(m, static_cast<int>(batch),
                                                       feedback_context[0], top_pages_per_head);
          !s.ok()) {
        std::printf("error in the feedback table: %s\n", s.ToString().c_str());
        return 1;
      }
    }
  }
  return 0;
}
