// Device-side ordering between an engine process and `epsd --backend=cuda`
// (docs/design.md §5-6): the engine's stream signals inputs_ready and waits on
// selection_done with stream memory operations, replies are async, and every
// way the other side can fail (inputs never signalled, sidecar killed, sidecar
// absent, a bad slot found on the device) ends with the engine's stream
// released and the lists marked "attend densely", never with a hang.
//
// This test is the engine: it allocates its buffers through the client
// library (client::DeviceBuffers, one cudaMalloc exported over CUDA IPC).
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <future>
#include <random>
#include <thread>
#include <vector>

#include "client/cpp/device_buffers.h"
#include "client/cpp/eps_client.h"
#include "client/cpp/selection_watchdog.h"
#include "core/buffer_contract.h"
#include "core/layout.h"
#include "core/phi.h"
#include "core/summary.h"
#include "core/testing/synthetic.h"
#include "gpu/ipc_mapping.h"
#include "gpu/step.h"
#include "gtest/gtest.h"
#include "tests/core/step_fixture.h"
#include "tests/core/test_util.h"
#include "tests/service/epsd_process.h"

namespace eps {
namespace {

// The records these tests write carry no quest part, so both sides score with jl.
SelectPolicy JlPolicy() {
  SelectPolicy p;
  p.method = Method::kJl;
  return p;
}

constexpr int kLayers = 4, kQHeads = 8, kKvHeads = 2, kDim = 128, kBatch = 2;
constexpr int64_t kTokens = 6000;

// Delays the engine's stream on the host (a stand-in for a slow forward pass),
// so that a sidecar reading the queries without waiting would read stale ones.
void CUDART_CB HoldStream(void* us) {
  std::this_thread::sleep_for(std::chrono::microseconds(reinterpret_cast<intptr_t>(us)));
}

class AsyncFenceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu::DeviceAvailable()) GTEST_SKIP() << "no CUDA device";
    seed_ = testing::TestSeed();
    rng_.seed(seed_);
    m_.num_layers = kLayers;
    m_.num_q_heads = kQHeads;
    m_.num_kv_heads = kKvHeads;
    m_.head_dim = kDim;
    m_.phi_seed = 91;
    m_.group_blocks = 8;
    m_.features = {.key_sum = true, .principal = false, .quest = false};
    phi_ = std::make_unique<PhiBank>(*PhiBank::Create(m_.phi_seed, kLayers, kKvHeads, kDim, 8));
    reference_ = std::make_unique<PageSelector>(*PageSelector::Create(m_, *phi_));
    host_ =
        std::make_unique<testing::StepBuffers>(m_, kBatch, kTokens, kBatch, Granularity::kUnion);
    SummaryWriter writer(m_, *phi_);
    for (int r = 0; r < kBatch; ++r) {
      testing::WriteSequence(*host_, writer, r, r, kTokens - 7 * r, 2,
                             testing::GroupShapes::kSynthetic, rng_);
      rows_.push_back({.table_row = r, .context_tokens = kTokens - 7 * r, .seq_id = 0});
    }
    client::BufferShape shape{.num_slots = host_->num_slots(),
                              .max_seqs = kBatch,
                              .max_context = kTokens,
                              .max_batch = kBatch};
    auto buffers = client::DeviceBuffers::Create(m_, shape, 0);
    ASSERT_TRUE(buffers.ok()) << buffers.status();
    buffers_ = std::move(*buffers);
    ASSERT_EQ(buffers_->plan().max_groups, host_->max_groups());
    ASSERT_EQ(buffers_->plan().max_blocks, host_->max_blocks());
    Upload(buffers_->summary_pool(), host_->pool());
    Upload(buffers_->group_table(), host_->group_table());
    Upload(buffers_->block_table(), host_->block_table());
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }

  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  template <typename T, typename V>
  void Upload(T* device, const V& host) {
    ASSERT_EQ(
        cudaMemcpy(device, host.data(), host.size() * sizeof(host[0]), cudaMemcpyHostToDevice),
        cudaSuccess);
  }

  v1::AttachRequest Attach() const {
    v1::AttachRequest attach;
    attach.set_engine_id("async-fence-engine");
    v1::ModelLayout* l = attach.mutable_layout();
    l->set_num_layers(kLayers);
    l->set_num_q_heads(kQHeads);
    l->set_num_kv_heads(kKvHeads);
    l->set_head_dim(kDim);
    l->set_summary_layout(eps::kSummaryLayoutRevision);  // core/layout.h
    l->set_block_size(16);
    l->set_group_blocks(m_.group_blocks);
    l->set_sketch_dim(8);
    l->set_phi_seed(m_.phi_seed);
    l->mutable_features()->set_key_sum(true);
    attach.mutable_options()->set_method(v1::METHOD_JL);  // records without a quest part
    *attach.mutable_buffers() = buffers_->Descriptors();
    attach.set_max_batch(kBatch);
    attach.set_num_kv_blocks(kBatch * host_->max_blocks());
    attach.set_backend(v1::BACKEND_CUDA);
    return attach;
  }

  // Async replies to `epsd`, with a deadline no GPU step here comes near.
  static client::ClientOptions AsyncOptions(testing::EpsdProcess& epsd) {
    client::ClientOptions options;
    options.target = epsd.target();
    options.deadline = std::chrono::seconds(2);
    options.reply_async = true;
    return options;
  }

  // Sync replies, and errors returned instead of falling back.
  static client::ClientOptions SyncFailClosedOptions(testing::EpsdProcess& epsd) {
    client::ClientOptions options = AsyncOptions(epsd);
    options.reply_async = false;
    options.fail_open = false;
    return options;
  }

  std::vector<v1::BatchRow> Rows() const {
    std::vector<v1::BatchRow> rows;
    for (const StepRow& r : rows_) {
      v1::BatchRow row;
      row.set_table_row(r.table_row);
      row.set_context_tokens(r.context_tokens);
      rows.push_back(row);
    }
    return rows;
  }

  // Fresh random queries on the host, copied on the engine's stream after
  // `hold_us` of host delay, then inputs_ready = step.
  void WriteQueries(uint64_t step, int hold_us) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const size_t count = size_t{kLayers} * kBatch * kQHeads * kDim;
    float* q = &host_->Query(0, 0, 0)[0];
    for (size_t i = 0; i < count; ++i) q[i] = normal(rng_);
    staged_.assign(q, q + count);
    if (hold_us > 0) {
      ASSERT_EQ(cudaLaunchHostFunc(stream_, HoldStream, reinterpret_cast<void*>(intptr_t{hold_us})),
                cudaSuccess);
    }
    ASSERT_EQ(cudaMemcpyAsync(buffers_->queries(), staged_.data(), count * 4,
                              cudaMemcpyHostToDevice, stream_),
              cudaSuccess);
    ASSERT_TRUE(buffers_->SignalInputsReady(stream_, step).ok());
  }

  // Waits (bounded) for the engine's stream; false if it is still blocked.
  bool StreamDrains(std::chrono::milliseconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (cudaStreamQuery(stream_) == cudaErrorNotReady) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::yield();
    }
    return cudaStreamQuery(stream_) == cudaSuccess;
  }

  std::vector<int32_t> Counts() {
    std::vector<int32_t> count(kLayers * kBatch);
    EXPECT_EQ(
        cudaMemcpy(count.data(), buffers_->visit_count(), count.size() * 4, cudaMemcpyDeviceToHost),
        cudaSuccess);
    return count;
  }

  // Lists in device memory against the core/ reference on the same inputs;
  // returns the number of lists that differ (by at most 2 groups: fp32 ties).
  // Step 1 is accepted while inputs_ready holds its wait; step 2 finds it still
  // waiting, has epsd release it (after --inputs-timeout-ms) and report it, then is
  // selected from its own queries (written only after the call: inputs_ready = 2
  // would also satisfy step 1's wait, which is GEQ).
  void ExpectHeldStepReleasedAndTheNextSelected(client::EpsClient& client,
                                                testing::EpsdProcess& epsd) {
    const client::StepResult first = client.SelectPages(1, Rows());
    ASSERT_FALSE(first.fallback) << first.status;
    const client::StepResult second = client.SelectPages(2, Rows());
    ASSERT_FALSE(second.fallback) << second.status << "\n" << epsd.Log();
    ASSERT_EQ(second.response.earlier_size(), 1);
    EXPECT_EQ(second.response.earlier(0).step(), 1u);
    EXPECT_NE(second.response.earlier(0).error().find("inputs_ready"), std::string::npos)
        << second.response.earlier(0).error();
    WriteQueries(2, 0);
    ASSERT_TRUE(buffers_->WaitSelection(stream_, 2).ok());
    ASSERT_TRUE(StreamDrains(std::chrono::seconds(5)));
    EXPECT_LE(CompareWithReference(), 1);
  }

  int CompareWithReference() {
    StepStats stats;
    EXPECT_TRUE(
        reference_->Select(host_->Inputs(rows_), JlPolicy(), host_->Outputs(), &stats).ok());
    std::vector<int32_t> visit(size_t{kLayers} * kBatch * host_->max_blocks());
    EXPECT_EQ(cudaMemcpy(visit.data(), buffers_->visit_blocks(), visit.size() * 4,
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    const std::vector<int32_t> count = Counts();
    int differing_lists = 0;
    for (int layer = 0; layer < kLayers; ++layer) {
      for (int r = 0; r < kBatch; ++r) {
        const auto want = host_->VisitBlocks(layer, r);
        const int64_t index = int64_t{layer} * kBatch + r;
        EXPECT_GE(count[index], 0);
        if (count[index] < 0) return kLayers * kBatch;
        const std::vector<int32_t> got(visit.begin() + index * host_->max_blocks(),
                                       visit.begin() + index * host_->max_blocks() + count[index]);
        if (std::vector<int32_t>(want.begin(), want.end()) == got) continue;
        const int64_t n = GroupsFor(rows_[r].context_tokens, m_);
        const auto a = testing::VisitedGroups(*host_, r, want, n);
        const auto c = testing::VisitedGroups(*host_, r, got, n);
        int differing = 0;
        for (int64_t p = 0; p < n; ++p) differing += a[p] != c[p];
        EXPECT_LE(differing, 2) << "layer " << layer << " row " << r;
        ++differing_lists;
      }
    }
    return differing_lists;
  }

  // The device buffers as the GPU selector reads them (the tests that drive a
  // GpuSelector directly, without epsd).
  StepInputs DeviceInputs() const {
    StepInputs in = host_->Inputs(rows_);
    in.summary_pool = buffers_->summary_pool();
    in.group_table = buffers_->group_table();
    in.block_table = buffers_->block_table();
    in.queries = buffers_->queries();
    return in;
  }
  StepOutputs DeviceOutputs() const { return {buffers_->visit_blocks(), buffers_->visit_count()}; }
  // A synchronous copy: the selector's streams are non-blocking, so it never waits on them.
  static void SetCounter(uint64_t* at, uint64_t value) {
    ASSERT_EQ(cudaMemcpy(at, &value, sizeof value, cudaMemcpyHostToDevice), cudaSuccess);
  }

  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  ModelLayout m_;
  std::unique_ptr<PhiBank> phi_;
  std::unique_ptr<PageSelector> reference_;
  std::unique_ptr<testing::StepBuffers> host_;
  std::vector<StepRow> rows_;
  std::unique_ptr<client::DeviceBuffers> buffers_;
  cudaStream_t stream_ = nullptr;
  std::vector<float> staged_;
};

TEST_F(AsyncFenceTest, AsyncStepsWaitForTheEnginesInputsOnTheDevice) {
  SCOPED_TRACE(testing::SeedTrace(seed_));
  auto epsd = testing::EpsdProcess::Start(testing::UniqueSocket("async"), {"--backend=cuda"});
  ASSERT_NE(epsd, nullptr);
  client::ClientOptions options;
  options.target = epsd->target();
  options.deadline = std::chrono::seconds(2);
  client::EpsClient sync_client(options, Attach());
  ASSERT_EQ(sync_client.Attach(), absl::OkStatus()) << epsd->Log();
  std::vector<double> sync_rtt, async_rtt, ping_rtt;
  int lists = 0, differing = 0;
  uint64_t step = 0;
  // Sync replies: the engine writes its inputs first, the RPC orders the sides.
  for (int i = 0; i < 300; ++i) {
    ++step;
    WriteQueries(step, 0);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    const client::StepResult r = sync_client.SelectPages(step, Rows());
    ASSERT_FALSE(r.fallback) << r.status << "\n" << epsd->Log();
    ASSERT_TRUE(r.response.done());
    sync_rtt.push_back(r.round_trip_us);
    ASSERT_TRUE(buffers_->WaitSelection(stream_, step).ok());
    ASSERT_TRUE(StreamDrains(std::chrono::seconds(5)));
    differing += CompareWithReference();
    lists += kLayers * kBatch;
  }
  // Async replies: the reply comes before the inputs exist (every 4th step the
  // engine's stream is held 3 ms first); only the device-side wait on
  // inputs_ready makes the lists right.
  options.reply_async = true;
  client::EpsClient async_client(options, Attach());  // same engine_id: replaces the session
  ASSERT_EQ(async_client.Attach(), absl::OkStatus()) << epsd->Log();
  uint64_t previous = 0;
  for (int i = 0; i < 300; ++i) {
    ++step;
    WriteQueries(step, i % 4 == 0 ? 3000 : 0);
    const client::StepResult r = async_client.SelectPages(step, Rows());
    ASSERT_FALSE(r.fallback) << r.status << "\n" << epsd->Log();
    ASSERT_FALSE(r.response.done());
    async_rtt.push_back(r.round_trip_us);
    if (previous != 0) {  // the previous step's statistics ride on this reply
      ASSERT_EQ(r.response.earlier_size(), 1);
      EXPECT_EQ(r.response.earlier(0).step(), previous);
      EXPECT_EQ(r.response.earlier(0).error(), "");
      EXPECT_GT(r.response.earlier(0).groups_visited(), 0);
    }
    previous = step;
    ASSERT_TRUE(buffers_->WaitSelection(stream_, step).ok());
    ASSERT_TRUE(StreamDrains(std::chrono::seconds(5))) << "engine stream blocked at step " << step;
    differing += CompareWithReference();
    lists += kLayers * kBatch;
  }
  EXPECT_LE(differing, lists / 100) << "more disagreement than fp32 ties explain";
  for (int i = 0; i < 1000; ++i) {
    const auto start = std::chrono::steady_clock::now();
    ASSERT_TRUE(async_client.Ping(std::chrono::seconds(1)).ok());
    ping_rtt.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
            .count());
  }
  const double ping50 = testing::Percentile(ping_rtt, 0.5);
  std::printf("async fence: %d lists, %d differ (fp32 ties)\n", lists, differing);
  std::printf("round trip over UDS, cuda backend, %d x %lld tokens, 4 layers:\n", kBatch,
              static_cast<long long>(kTokens));
  std::printf("  SelectPages sync  p50 %7.1f us  p99 %7.1f us  (%.2fx Ping p50)\n",
              testing::Percentile(sync_rtt, 0.5), testing::Percentile(sync_rtt, 0.99),
              testing::Percentile(sync_rtt, 0.5) / ping50);
  std::printf("  SelectPages async p50 %7.1f us  p99 %7.1f us  (%.2fx Ping p50)\n",
              testing::Percentile(async_rtt, 0.5), testing::Percentile(async_rtt, 0.99),
              testing::Percentile(async_rtt, 0.5) / ping50);
  std::printf("  Ping              p50 %7.1f us  p99 %7.1f us\n", ping50,
              testing::Percentile(ping_rtt, 0.99));
}

TEST_F(AsyncFenceTest, EpsdReleasesAStepWhoseInputsNeverArrive) {
  auto epsd = testing::EpsdProcess::Start(testing::UniqueSocket("inputs"),
                                          {"--backend=cuda", "--inputs-timeout-ms=100"});
  ASSERT_NE(epsd, nullptr);
  client::EpsClient client(AsyncOptions(*epsd), Attach());
  ASSERT_EQ(client.Attach(), absl::OkStatus()) << epsd->Log();
  // Step 1 is accepted, but the engine never signals inputs_ready = 1.
  ExpectHeldStepReleasedAndTheNextSelected(client, *epsd);
}

TEST_F(AsyncFenceTest, AWatchdogTimeoutMustBePositive) {
  for (auto timeout : {std::chrono::microseconds(0), std::chrono::microseconds(-1)}) {
    auto made = client::SelectionWatchdog::Create(*buffers_, timeout);
    EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument) << timeout.count();
  }
}

TEST_F(AsyncFenceTest, ReleaseDenseLeavesTheCallersCurrentDevice) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  // With one device the restore is unobservable through the device number alone; the
  // call must still leave device 0 current (and not fail).
  const int other = count > 1 && buffers_->device() == 0 ? 1 : 0;
  ASSERT_EQ(cudaSetDevice(other), cudaSuccess);
  ASSERT_TRUE(buffers_->ReleaseDense(1).ok());
  int current = -1;
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, other);
  ASSERT_TRUE(buffers_->ReadSelectionDone().ok());
  ASSERT_EQ(cudaGetDevice(&current), cudaSuccess);
  EXPECT_EQ(current, other);
}

TEST_F(AsyncFenceTest, WatchdogReleasesTheEngineStreamWhenTheSidecarIsKilled) {
  auto epsd = testing::EpsdProcess::Start(testing::UniqueSocket("killed"), {"--backend=cuda"});
  ASSERT_NE(epsd, nullptr);
  client::EpsClient client(AsyncOptions(*epsd), Attach());
  ASSERT_EQ(client.Attach(), absl::OkStatus()) << epsd->Log();
  auto made = client::SelectionWatchdog::Create(*buffers_, std::chrono::milliseconds(200));
  ASSERT_TRUE(made.ok()) << made.status();
  client::SelectionWatchdog& watchdog = **made;
  // Accepted, then the sidecar dies while its stream waits for the engine's
  // inputs: nothing will ever write selection_done = 1.
  const client::StepResult r = client.SelectPages(1, Rows());
  ASSERT_FALSE(r.fallback) << r.status;
  watchdog.Arm(1);
  epsd->Signal(SIGKILL);
  ASSERT_TRUE(buffers_->WaitSelection(stream_, 1).ok());
  const bool drained = StreamDrains(std::chrono::seconds(5));
  if (!drained) {
    ASSERT_TRUE(buffers_->ReleaseDense(1).ok());  // let the test end
  }
  ASSERT_TRUE(drained) << "the engine's stream stayed blocked on a dead sidecar";
  EXPECT_EQ(watchdog.releases(), 1u);
  for (int32_t c : Counts()) EXPECT_EQ(c, -1) << "lists must say: attend densely";
  // Measured, not assumed: does the killed process finish exiting while its
  // stream still waits on inputs_ready, or only once the engine writes it?
  auto exited_within = [&](std::chrono::milliseconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (epsd->Running()) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));  // polling a pid, not syncing
    }
    return true;
  };
  const bool before = exited_within(std::chrono::seconds(2));
  WriteQueries(1, 0);  // inputs_ready = 1: the dead stream's wait is satisfied
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  const auto t0 = std::chrono::steady_clock::now();
  const bool after = before || exited_within(std::chrono::seconds(20));
  std::printf(
      "killed epsd exited %s (%.0f ms after inputs_ready)\n",
      before  ? "within 2 s, before inputs_ready"
      : after ? "only after inputs_ready"
              : "not at all",
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  EXPECT_TRUE(after) << "a killed epsd never exited";
}

TEST_F(AsyncFenceTest, FallbackWithAnAbsentSidecarReleasesTheEngineStream) {
  client::ClientOptions options;
  options.target = testing::UniqueSocket("absent");  // nobody listens
  options.deadline = std::chrono::milliseconds(50);
  options.attach_deadline = std::chrono::milliseconds(50);
  options.reply_async = true;
  options.on_fallback = [this](uint64_t step) { ASSERT_TRUE(buffers_->ReleaseDense(step).ok()); };
  client::EpsClient client(options, Attach());
  WriteQueries(1, 0);
  const client::StepResult r = client.SelectPages(1, Rows());
  EXPECT_TRUE(r.fallback);
  ASSERT_TRUE(buffers_->WaitSelection(stream_, 1).ok());
  ASSERT_TRUE(StreamDrains(std::chrono::seconds(5)));
  for (int32_t c : Counts()) EXPECT_EQ(c, -1);
}

TEST_F(AsyncFenceTest, ABadSlotFoundOnTheDeviceMarksTheListsDenseAndIsReported) {
  auto epsd = testing::EpsdProcess::Start(testing::UniqueSocket("badslot"), {"--backend=cuda"});
  ASSERT_NE(epsd, nullptr);
  client::EpsClient client(AsyncOptions(*epsd), Attach());
  ASSERT_EQ(client.Attach(), absl::OkStatus()) << epsd->Log();
  const int32_t bad = static_cast<int32_t>(host_->num_slots()) + 5;
  ASSERT_EQ(cudaMemcpy(buffers_->group_table() + 3, &bad, 4, cudaMemcpyHostToDevice), cudaSuccess);
  WriteQueries(1, 0);
  ASSERT_FALSE(client.SelectPages(1, Rows()).fallback);
  ASSERT_TRUE(buffers_->WaitSelection(stream_, 1).ok());
  ASSERT_TRUE(StreamDrains(std::chrono::seconds(5)));
  for (int32_t c : Counts()) EXPECT_EQ(c, -1);
  // Repaired, the next step succeeds and carries step 1's error.
  const int32_t good = host_->SlotOf(0, 3);
  ASSERT_EQ(cudaMemcpy(buffers_->group_table() + 3, &good, 4, cudaMemcpyHostToDevice), cudaSuccess);
  WriteQueries(2, 0);
  const client::StepResult r = client.SelectPages(2, Rows());
  ASSERT_FALSE(r.fallback) << r.status;
  ASSERT_EQ(r.response.earlier_size(), 1);
  EXPECT_NE(r.response.earlier(0).error().find("group_table[0][3]"), std::string::npos)
      << r.response.earlier(0).error();
  ASSERT_TRUE(buffers_->WaitSelection(stream_, 2).ok());
  ASSERT_TRUE(StreamDrains(std::chrono::seconds(5)));
  EXPECT_LE(CompareWithReference(), 1);
}

TEST_F(AsyncFenceTest, AStepNotAfterTheBuffersSelectionDoneIsRefusedAfterReattach) {
  auto epsd = testing::EpsdProcess::Start(testing::UniqueSocket("floor"), {"--backend=cuda"});
  ASSERT_NE(epsd, nullptr);
  const client::ClientOptions options = SyncFailClosedOptions(*epsd);
  {
    client::EpsClient first(options, Attach());
    ASSERT_EQ(first.Attach(), absl::OkStatus()) << epsd->Log();
    WriteQueries(5, 0);
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    const client::StepResult r = first.SelectPages(5, Rows());
    ASSERT_TRUE(r.status.ok()) << r.status;
  }
  // A new session over the same buffers (selection_done = 5) that restarts its
  // numbering would get neither a wait nor a write: epsd refuses it instead.
  client::EpsClient second(options, Attach());
  ASSERT_EQ(second.Attach(), absl::OkStatus()) << epsd->Log();
  const client::StepResult stale = second.SelectPages(3, Rows());
  EXPECT_EQ(stale.status.code(), absl::StatusCode::kFailedPrecondition) << stale.status;
  EXPECT_NE(stale.status.message().find("selection_done=5"), std::string::npos) << stale.status;
  WriteQueries(6, 0);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  const client::StepResult next = second.SelectPages(6, Rows());
  ASSERT_TRUE(next.status.ok()) << next.status;
  EXPECT_LE(CompareWithReference(), 1);
}

// epsd warns when it maps a region that is not whole 2 MiB pages, which its pre-pass
// reads up to 2.4 times slower (docs/design.md §5): never for the client library's
// region, which is rounded up; once for a region of the buffers' exact total.
TEST_F(AsyncFenceTest, ARegionNotInWhole2MiBPagesAttachesWithAWarning) {
  auto epsd = testing::EpsdProcess::Start(testing::UniqueSocket("pages"), {"--backend=cuda"});
  ASSERT_NE(epsd, nullptr);
  const client::ClientOptions options = SyncFailClosedOptions(*epsd);
  const std::string warning = "not a whole number of 2 MiB pages";
  {
    client::EpsClient whole(options, Attach());
    ASSERT_EQ(whole.Attach(), absl::OkStatus()) << epsd->Log();
  }
  EXPECT_EQ(epsd->Log().find(warning), std::string::npos) << epsd->Log();

  const uint64_t bytes = buffers_->plan().size;
  ASSERT_NE(bytes % kRegionAlignment, 0u) << "this shape's buffers fill whole pages";
  void* exact = nullptr;
  ASSERT_EQ(cudaMalloc(&exact, bytes), cudaSuccess);
  ASSERT_EQ(cudaMemset(exact, 0, bytes), cudaSuccess);
  cudaIpcMemHandle_t handle;
  ASSERT_EQ(cudaIpcGetMemHandle(&handle, exact), cudaSuccess);
  v1::AttachRequest attach = Attach();
  attach.set_engine_id("async-fence-exact-region");
  v1::SharedBuffers* b = attach.mutable_buffers();
  ASSERT_TRUE(b->has_flags());
  for (v1::MemoryDescriptor* d :
       {b->mutable_summary_pool(), b->mutable_group_table(), b->mutable_block_table(),
        b->mutable_queries(), b->mutable_visit_blocks(), b->mutable_visit_count(),
        b->mutable_flags()}) {
    d->mutable_cuda_ipc()->set_handle(reinterpret_cast<const char*>(&handle), sizeof(handle));
  }
  {
    client::EpsClient unrounded(options, attach);
    ASSERT_EQ(unrounded.Attach(), absl::OkStatus()) << epsd->Log();
  }
  EXPECT_NE(epsd->Log().find(warning), std::string::npos) << epsd->Log();
  EXPECT_EQ(cudaFree(exact), cudaSuccess);
}

// An engine that leaves inputs_ready at step + 2^63 or more (UINT64_MAX: a counter
// initialised to -1) holds a GEQ stream wait, which compares cyclically. epsd's
// release sets the counter to the step (an unsigned atomicMax left UINT64_MAX,
// so Finish synchronised forever under the session's step lock: the second call
// fell back on the client's deadline).
TEST_F(AsyncFenceTest, EpsdReleasesAStepWhoseInputsReadyIsAtUint64Max) {
  auto epsd = testing::EpsdProcess::Start(testing::UniqueSocket("uint64max"),
                                          {"--backend=cuda", "--inputs-timeout-ms=100"});
  ASSERT_NE(epsd, nullptr);
  client::EpsClient client(AsyncOptions(*epsd), Attach());
  ASSERT_EQ(client.Attach(), absl::OkStatus()) << epsd->Log();
  SetCounter(buffers_->flags(), UINT64_MAX);
  ExpectHeldStepReleasedAndTheNextSelected(client, *epsd);
}

// The same at the selector: Finish ends in bounded time with DEADLINE_EXCEEDED,
// the counter at the step and the lists dense; so does the destructor of a
// selector whose step is still held by such a counter (the lease reaper's path:
// the old one synchronised forever, and no lease expired again).
TEST_F(AsyncFenceTest, ASelectorReleasesAndDestroysAStepHeldByAnInputsReadyAtUint64Max) {
  gpu::GpuSelectorOptions options;
  options.drain_timeout = std::chrono::milliseconds(2000);
  auto selector = gpu::GpuSelector::Create(m_, 0, kBatch, host_->max_groups(), options);
  ASSERT_TRUE(selector.ok()) << selector.status();
  uint64_t* const flags = buffers_->flags();
  SetCounter(flags, UINT64_MAX);
  gpu::GpuSelector::StepFence fence{.inputs_ready = flags, .selection_done = flags + 1, .step = 5};
  ASSERT_EQ((*selector)->Enqueue(DeviceInputs(), JlPolicy(), DeviceOutputs(), fence),
            absl::OkStatus());
  auto finish = std::async(std::launch::async, [&] {
    return (*selector)->Finish(std::chrono::milliseconds(100), nullptr, nullptr);
  });
  if (finish.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    SetCounter(flags, 5);  // let the blocked Finish end, so the test can
    FAIL() << "Finish blocked on a stream held by inputs_ready = UINT64_MAX";
  }
  EXPECT_EQ(finish.get().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(*gpu::ReadCounter(0, flags), 5u) << "raised in the wait's cyclic order";
  EXPECT_EQ(*gpu::ReadCounter(0, flags + 1), 5u);
  for (int32_t c : Counts()) EXPECT_EQ(c, -1) << "lists must say: attend densely";

  SetCounter(flags, UINT64_MAX);
  fence.step = 6;
  ASSERT_EQ((*selector)->Enqueue(DeviceInputs(), JlPolicy(), DeviceOutputs(), fence),
            absl::OkStatus());
  auto destroyed = std::async(std::launch::async, [&] { selector->reset(); });
  if (destroyed.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    SetCounter(flags, 6);
    FAIL() << "the selector's destructor blocked on inputs_ready = UINT64_MAX";
  }
  EXPECT_EQ(*gpu::ReadCounter(0, flags), 6u);
}

// An engine that lowers inputs_ready again after the release (here: a host thread
// writing 3 over and over) may keep the wait from ever passing. Finish then ends
// within the drain bound, either released (the wait saw the raise) or with the
// selector poisoned: later steps are refused by name and its destruction is
// bounded too. (The old Finish synchronised for as long as the engine wrote.)
TEST_F(AsyncFenceTest, ASelectorWhoseEngineLowersInputsReadyAgainEndsInBoundedTime) {
  gpu::GpuSelectorOptions options;
  options.drain_timeout = std::chrono::milliseconds(300);
  auto selector = gpu::GpuSelector::Create(m_, 0, kBatch, host_->max_groups(), options);
  ASSERT_TRUE(selector.ok()) << selector.status();
  uint64_t* const flags = buffers_->flags();
  SetCounter(flags, 0);
  const gpu::GpuSelector::StepFence fence{
      .inputs_ready = flags, .selection_done = flags + 1, .step = 7};
  ASSERT_EQ((*selector)->Enqueue(DeviceInputs(), JlPolicy(), DeviceOutputs(), fence),
            absl::OkStatus());
  std::atomic<bool> stop{false};
  std::thread engine([&] {
    cudaStream_t s = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    const uint64_t low = 3;
    while (!stop.load()) {
      ASSERT_EQ(cudaMemcpyAsync(flags, &low, sizeof low, cudaMemcpyHostToDevice, s), cudaSuccess);
      ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    }
    cudaStreamDestroy(s);
  });
  const auto stop_engine = [&] {
    stop = true;
    engine.join();
    SetCounter(flags, 7);  // whatever stream still waits may drain now
  };
  auto finish = std::async(std::launch::async, [&] {
    return (*selector)->Finish(std::chrono::milliseconds(50), nullptr, nullptr);
  });
  if (finish.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    stop_engine();
    FAIL() << "Finish blocked while the engine kept lowering inputs_ready";
  }
  const absl::Status s = finish.get();
  std::printf("Finish under a lowering engine: %s\n", s.ToString().c_str());
  if (s.code() == absl::StatusCode::kFailedPrecondition) {
    EXPECT_NE(s.message().find("did not drain"), std::string::npos) << s;
    const absl::Status next =
        (*selector)->Enqueue(DeviceInputs(), JlPolicy(), DeviceOutputs(),
                             {.inputs_ready = flags, .selection_done = flags + 1, .step = 8});
    EXPECT_EQ(next.code(), absl::StatusCode::kFailedPrecondition) << next;
    EXPECT_NE(next.message().find("did not drain"), std::string::npos) << next;
  } else {
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  }
  auto destroyed = std::async(std::launch::async, [&] { selector->reset(); });
  const bool bounded = destroyed.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  stop_engine();
  EXPECT_TRUE(bounded) << "the selector's destructor blocked";
}

}  // namespace
}  // namespace eps
