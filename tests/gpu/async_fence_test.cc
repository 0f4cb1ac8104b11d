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
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <future>
#include <memory>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "client/cpp/device_buffers.h"
#include "client/cpp/eps_client.h"
#include "client/cpp/selection_watchdog.h"
#include "core/buffer_contract.h"
#include "core/layout.h"
#include "core/phi.h"
#include "core/summary.h"
#include "core/testing/synthetic.h"
#include "gpu/device.h"
#include "gpu/ipc_mapping.h"
#include "gpu/step.h"
#include "gtest/gtest.h"
#include "tests/core/step_fixture.h"
#include "tests/core/test_util.h"
#include "tests/gpu/async_fence_fixture.h"
#include "tests/service/epsd_process.h"

namespace eps::async_fence {
namespace {

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
    auto made = client::SelectionWatchdog::Create(buffers_, timeout);
    EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument) << timeout.count();
  }
}

TEST_F(AsyncFenceTest, AWatchdogKeepsItsBuffersAliveUntilItIsDestroyed) {
  auto made = client::SelectionWatchdog::Create(buffers_, std::chrono::milliseconds(50));
  ASSERT_TRUE(made.ok()) << made.status();
  std::weak_ptr<client::DeviceBuffers> held = buffers_;
  // Never answered: released at its due time, through the buffers.
  ASSERT_TRUE((*made)->Arm(1).ok());
  buffers_.reset();  // the engine drops its buffers first
  ASSERT_FALSE(held.expired()) << "the watchdog would read and release freed memory";
  made->reset();  // finishes the armed step's watch (releases it), then lets go
  EXPECT_TRUE(held.expired());
}

TEST_F(AsyncFenceTest, ReleaseDenseLeavesTheCallersCurrentDevice) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  // With one device the restore is unobservable through the device number alone; the
  // call must still leave device 0 current (and not fail).
  const int other = count > 1 && buffers_->device() == 0 ? 1 : 0;
  int before = -1;
  ASSERT_EQ(cudaGetDevice(&before), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(other), cudaSuccess);
  // The test's own change undone whatever happens: the next test's stream (made on the
  // current device) must be on its buffers' device.
  struct Restore {
    int device;
    ~Restore() { cudaSetDevice(device); }
  } restore{before};
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
  auto made = client::SelectionWatchdog::Create(buffers_, std::chrono::milliseconds(200));
  ASSERT_TRUE(made.ok()) << made.status();
  client::SelectionWatchdog& watchdog = **made;
  // Accepted, then the sidecar dies while its stream waits for the engine's
  // inputs: nothing will ever write selection_done = 1.
  const client::StepResult r = client.SelectPages(1, Rows());
  ASSERT_FALSE(r.fallback) << r.status;
  ASSERT_TRUE(watchdog.Arm(1).ok());
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

// SIGTERM drains a cuda epsd and it exits 0. The CUDA driver starts threads of its own at
// epsd's device checks and warm-up; epsd once blocked the termination signals only after
// those, so a SIGTERM could land on a driver thread and end the process at once (exit 143,
// no drain).
TEST_F(AsyncFenceTest, SigtermDrainsACudaEpsdAndItExitsZero) {
  auto epsd = testing::EpsdProcess::Start(testing::UniqueSocket("sigterm"),
                                          {"--backend=cuda", "--drain-ms=300"});
  ASSERT_NE(epsd, nullptr);
  client::EpsClient client(AsyncOptions(*epsd), Attach());
  ASSERT_EQ(client.Attach(), absl::OkStatus()) << epsd->Log();
  epsd->Signal(SIGTERM);
  // A hang guard, not a latency target: the drain plus epsd's own 4 s backstop.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  while (epsd->Running() && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // polling a pid
  }
  if (epsd->Running()) epsd->Signal(SIGKILL);
  EXPECT_EQ(epsd->Wait(), 0) << epsd->Log();
  EXPECT_NE(epsd->Log().find("draining"), std::string::npos) << epsd->Log();
  EXPECT_NE(epsd->Log().find("epsd: stopped"), std::string::npos) << epsd->Log();
}

// Engine A's async step waits for its inputs_ready, which A's engine never writes (it
// died mid-step). Freeing another session's device memory waits for every stream on the
// device, A's wait included, and holds the device's other CUDA calls meanwhile. That
// free once ran on the thread that ended the session: engine B's Detach hung, engine
// E's expiry hung the lease reaper, which then never expired A, and engine C's Attach
// hung behind the free (measured: 1 s and 20 s deadlines passed). Now B's Detach and
// C's Attach answer at once; the freeing waits until A's wait is released (A's lease,
// then --inputs-timeout-ms) or has aged past --inputs-timeout-ms.
TEST_F(AsyncFenceTest, SessionsEndAndAttachWhileADeadEnginesStepWaitsForItsInputs) {
  auto epsd = testing::EpsdProcess::Start(testing::UniqueSocket("others"),
                                          {"--backend=cuda", "--inputs-timeout-ms=500"});
  ASSERT_NE(epsd, nullptr);
  v1::AttachRequest attach_a = Attach(), attach_b = Attach(), attach_c = Attach(),
                    attach_e = Attach();
  attach_a.set_lease_ms(1500);
  attach_b.set_engine_id("async-fence-engine-b");
  attach_c.set_engine_id("async-fence-engine-c");
  attach_e.set_engine_id("async-fence-engine-e");
  attach_e.set_lease_ms(200);  // expires first, on the reaper
  client::ClientOptions sync = SyncFailClosedOptions(*epsd);
  sync.attach_deadline = std::chrono::seconds(1);
  client::EpsClient b(sync, attach_b), e(sync, attach_e);
  ASSERT_EQ(b.Attach(), absl::OkStatus()) << epsd->Log();
  ASSERT_EQ(e.Attach(), absl::OkStatus()) << epsd->Log();
  client::EpsClient a(AsyncOptions(*epsd), attach_a);
  ASSERT_EQ(a.Attach(), absl::OkStatus()) << epsd->Log();
  const client::StepResult held = a.SelectPages(1, Rows());  // no inputs_ready: held
  ASSERT_FALSE(held.fallback) << held.status;
  auto timed = [](auto&& call) {
    const auto start = std::chrono::steady_clock::now();
    const absl::Status status = call();
    return std::make_pair(
        status, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                    .count());
  };
  const auto [detached, detach_ms] = timed([&] { return b.Detach(); });
  // A hang guard: A's lease (1.5 s) and --inputs-timeout-ms (0.5 s) end its wait.
  sync.attach_deadline = std::chrono::seconds(20);
  client::EpsClient c(sync, attach_c);
  const auto [attached, attach_ms] = timed([&] { return c.Attach(); });
  // C's first step, sync: it reads the flags buffer's selection_done first (ReadCounter).
  const auto [stepped, step_ms] = timed([&] { return c.SelectPages(1, Rows()).status; });
  // D's Attach is refused after its buffers are mapped (a granularity its visit_blocks
  // does not have): its mappings are closed on the Attach's thread.
  v1::AttachRequest attach_d = Attach();
  attach_d.set_engine_id("async-fence-engine-d");
  attach_d.mutable_options()->set_granularity(v1::GRANULARITY_PER_KV_HEAD);
  client::EpsClient d(sync, attach_d);
  const auto [refused, refuse_ms] = timed([&] { return d.Attach(); });
  std::printf(
      "while A's step waited: B's Detach %.1f ms (%s), C's Attach %.1f ms (%s) and first step "
      "%.1f ms (%s), D's refused Attach %.1f ms (%s)\n",
      detach_ms, detached.ToString().c_str(), attach_ms, attached.ToString().c_str(), step_ms,
      stepped.ToString().c_str(), refuse_ms, refused.ToString().c_str());
  WriteQueries(1, 0);  // let the engine's stream end, whatever happened above
  EXPECT_TRUE(StreamDrains(std::chrono::seconds(5)));
  EXPECT_EQ(detached, absl::OkStatus()) << "B's Detach waited for A's step\n" << epsd->Log();
  EXPECT_EQ(attached, absl::OkStatus()) << "C's Attach was never served\n" << epsd->Log();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused << "\n" << epsd->Log();
  EXPECT_EQ(stepped, absl::OkStatus()) << "C's first step waited for A's\n" << epsd->Log();
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
  SetGroupSlot(3, bad);
  WriteQueries(1, 0);
  ASSERT_FALSE(client.SelectPages(1, Rows()).fallback);
  ASSERT_TRUE(buffers_->WaitSelection(stream_, 1).ok());
  ASSERT_TRUE(StreamDrains(std::chrono::seconds(5)));
  for (int32_t c : Counts()) EXPECT_EQ(c, -1);
  // Repaired, the next step succeeds and carries step 1's error.
  const int32_t good = host_->SlotOf(0, 3);
  SetGroupSlot(3, good);
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

// A step that failed on the device has raised selection_done to its number (its lists -1):
// a resend of that number once passed the host's checks and answered OK with the failed
// step's -1 lists (the kernel found selection_done already there). Its number is used up.
TEST_F(AsyncFenceTest, AStepThatFailedOnTheDeviceCannotBeSentAgainUnderItsNumber) {
  auto epsd = testing::EpsdProcess::Start(testing::UniqueSocket("resend"), {"--backend=cuda"});
  ASSERT_NE(epsd, nullptr);
  client::EpsClient client(SyncFailClosedOptions(*epsd), Attach());
  ASSERT_EQ(client.Attach(), absl::OkStatus()) << epsd->Log();
  const int32_t bad = static_cast<int32_t>(host_->num_slots()) + 5;
  SetGroupSlot(3, bad);
  WriteQueries(1, 0);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  const client::StepResult failed = client.SelectPages(1, Rows());
  EXPECT_FALSE(failed.status.ok());
  const int32_t good = host_->SlotOf(0, 3);
  SetGroupSlot(3, good);
  const client::StepResult resent = client.SelectPages(1, Rows());
  EXPECT_EQ(resent.status.code(), absl::StatusCode::kFailedPrecondition) << resent.status;
  EXPECT_NE(resent.status.message().find("step 1 is not after selection_done=1"), std::string::npos)
      << resent.status;
  WriteQueries(2, 0);
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  const client::StepResult next = client.SelectPages(2, Rows());
  ASSERT_TRUE(next.status.ok()) << next.status;
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

TEST_F(AsyncFenceTest, TheClientNamesItsGpuByUuid) {
  const v1::AttachRequest attach = Attach();  // DeviceBuffers::DescribeTo
  const absl::StatusOr<std::string> uuid = gpu::DeviceUuid(buffers_->device());
  ASSERT_TRUE(uuid.ok()) << uuid.status();
  EXPECT_EQ(attach.device_uuid(), *uuid);
  EXPECT_EQ(attach.device(), buffers_->device());
  EXPECT_EQ(attach.buffers().summary_pool().cuda_ipc().handle(),
            buffers_->Descriptors().summary_pool().cuda_ipc().handle());
}

// A rank started with CUDA_VISIBLE_DEVICES=1 calls its GPU 0: sent as epsd's ordinal 0
// without a device_uuid, its buffers (on epsd's GPU 1) would be peer-mapped on GPU 0 and
// every step would read them across the link. epsd refuses such a mapping.
TEST_F(AsyncFenceTest, BuffersOnTheSecondGpuAttachThereByTheirUuid) {
  if (gpu::DeviceCount() < 2) GTEST_SKIP() << gpu::DeviceCount() << " CUDA device(s): needs 2";
  client::BufferShape shape{.num_slots = host_->num_slots(),
                            .max_seqs = kBatch,
                            .max_context = kTokens,
                            .max_batch = kBatch};
  auto other = client::DeviceBuffers::Create(m_, shape, 1);
  ASSERT_TRUE(other.ok()) << other.status();
  auto epsd = testing::EpsdProcess::Start(testing::UniqueSocket("othergpu"), {"--backend=cuda"});
  ASSERT_NE(epsd, nullptr);
  v1::AttachRequest attach = Attach();
  attach.set_engine_id("async-fence-other-gpu");
  (*other)->DescribeTo(&attach);
  EXPECT_EQ(attach.device_uuid().size(), 16u);
  // The ordinals are ignored with a UUID: a rank's own (0 under CUDA_VISIBLE_DEVICES) is fine.
  attach.set_device(0);
  client::EpsClient client(SyncFailClosedOptions(*epsd), attach);
  EXPECT_EQ(client.Attach(), absl::OkStatus()) << epsd->Log();
  // epsd cannot tell an allocation of another GPU from its own (the driver names the GPU
  // that opened the handle: docs/api-memory.md), so an Attach by a wrong ordinal is not
  // refused; the UUID is what keeps a rank's steps on its GPU.
}

}  // namespace
}  // namespace eps::async_fence
