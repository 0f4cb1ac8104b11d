// The engine's own counters against epsd and the selector (docs/design.md §6): an
// inputs_ready left at or beyond step + 2^63, or lowered again after epsd's release,
// ends every wait in bounded time and never blocks Finish or a selector's destructor.
// Part of the async_fence_test binary (the fixture: tests/gpu/async_fence_fixture.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "client/cpp/eps_client.h"
#include "gpu/live_streams.h"
#include "gpu/step.h"
#include "gtest/gtest.h"
#include "service/backend.h"
#include "service/cuda_backend.h"
#include "service/memory_budget.h"
#include "tests/gpu/async_fence_fixture.h"
#include "tests/gpu/host_copy.h"
#include "tests/service/epsd_process.h"

namespace eps::async_fence {
namespace {

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
  // A poisoned selector's stream is abandoned, and the device's oldest abandonment that
  // may still run is known (epsd bounds it: service/session_janitor.h) until it drains.
  const auto before_abandoned = std::chrono::steady_clock::now();
  const std::optional<std::chrono::steady_clock::time_point> abandoned =
      bounded ? gpu::OldestAbandonment(0) : std::nullopt;
  stop_engine();
  EXPECT_TRUE(bounded) << "the selector's destructor blocked";
  if (bounded && s.code() == absl::StatusCode::kFailedPrecondition) {
    ASSERT_TRUE(abandoned.has_value()) << "a poisoned selector's stream was not abandoned";
    EXPECT_LE(*abandoned, before_abandoned);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (gpu::OldestAbandonment(0).has_value() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_FALSE(gpu::OldestAbandonment(0).has_value())
        << "the abandoned stream did not drain once the engine raised its counter";
  }
}

// epsd raises selection_done, never lowers it: an engine whose call missed its deadline
// released the step (and maybe the next) itself, and epsd's plain write of the late step
// took the counter back below the engine's next wait, which then passed on a later step.
TEST_F(AsyncFenceTest, ALateStepNeverLowersASelectionDoneTheEngineRaised) {
  auto selector = gpu::GpuSelector::Create(m_, 0, kBatch, host_->max_groups(), {});
  ASSERT_TRUE(selector.ok()) << selector.status();
  uint64_t* const flags = buffers_->flags();
  SetCounter(flags + 1, 9);  // the engine released steps 8 and 9 itself
  const gpu::GpuSelector::StepFence fence{.selection_done = flags + 1, .step = 8};
  ASSERT_EQ((*selector)->Enqueue(DeviceInputs(), JlPolicy(), DeviceOutputs(), fence),
            absl::OkStatus());
  (void)(*selector)->Finish(std::chrono::milliseconds(1000), nullptr, nullptr);
  EXPECT_EQ(*gpu::ReadCounter(0, flags + 1), 9u);
  // An empty async step queues no wait on inputs_ready (the engine never signals it here):
  // its counter is raised at once, and nothing is left pending.
  SetCounter(flags, 0);
  const gpu::GpuSelector::StepFence empty{
      .inputs_ready = flags, .selection_done = flags + 1, .step = 10};
  StepInputs none = DeviceInputs();
  none.rows = {};
  ASSERT_EQ((*selector)->Enqueue(none, JlPolicy(), DeviceOutputs(), empty), absl::OkStatus());
  EXPECT_FALSE((*selector)->pending());
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (*gpu::ReadCounter(0, flags + 1) < 10u && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(*gpu::ReadCounter(0, flags + 1), 10u);
  auto destroyed = std::async(std::launch::async, [&] { selector->reset(); });
  EXPECT_EQ(destroyed.wait_for(std::chrono::seconds(10)), std::future_status::ready);
}

// A step with retrieval heads copies their marks up behind the engine's inputs wait. From
// the policy's own (pageable) vector that copy could hold Enqueue until the engine released
// the wait; now the marks are staged in pinned memory at the call, so Enqueue returns while
// the wait holds, and the step selects with the marks of its call whatever the caller's
// vector holds afterwards.
TEST_F(AsyncFenceTest, ARetrievalStepQueuedBehindItsInputsUsesTheMarksOfItsCall) {
  auto selector = gpu::GpuSelector::Create(m_, 0, kBatch, host_->max_groups(), {});
  ASSERT_TRUE(selector.ok()) << selector.status();
  uint64_t* const flags = buffers_->flags();
  SetCounter(flags, 0);
  SelectPolicy policy = JlPolicy();
  policy.heads = HeadMode::kRetrieval;
  policy.retrieval_heads.assign(size_t{kLayers} * kQHeads, 0);
  for (size_t i = 0; i < policy.retrieval_heads.size(); ++i) {
    policy.retrieval_heads[i] = (rng_() % 3 == 0 || i % kQHeads == 0) ? 1 : 0;
  }
  const SelectPolicy called = policy;
  const gpu::GpuSelector::StepFence fence{
      .inputs_ready = flags, .selection_done = flags + 1, .step = 3};
  auto enqueued = std::async(std::launch::async, [&] {
    return (*selector)->Enqueue(DeviceInputs(), policy, DeviceOutputs(), fence);
  });
  if (enqueued.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    SetCounter(flags, 3);
    FAIL() << "Enqueue of a retrieval step waited for the engine's inputs_ready";
  }
  ASSERT_EQ(enqueued.get(), absl::OkStatus());
  std::fill(policy.retrieval_heads.begin(), policy.retrieval_heads.end(), uint8_t{1});
  policy.retrieval_heads.shrink_to_fit();
  WriteQueries(3, 0);
  ASSERT_EQ((*selector)->Finish(std::chrono::seconds(5), nullptr, nullptr), absl::OkStatus());
  EXPECT_EQ(*gpu::ReadCounter(0, flags + 1), 3u);
  EXPECT_LE(CompareWithReference(called), 1) << "seed " << seed_;
}

// An engine without a watchdog whose stream still waits for a step the sidecar never
// finished: destroying its buffers releases that wait densely before the device
// synchronisation that would otherwise wait for good.
TEST_F(AsyncFenceTest, DestroyingBuffersReleasesAWaitTheSidecarNeverAnswered) {
  client::BufferShape shape{.num_slots = host_->num_slots(),
                            .max_seqs = kBatch,
                            .max_context = kTokens,
                            .max_batch = kBatch};
  auto created = client::DeviceBuffers::Create(m_, shape, 0);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<client::DeviceBuffers> buffers = std::move(*created);
  uint64_t* const done = buffers->flags() + 1;
  ASSERT_TRUE(buffers->WaitSelection(stream_, 4).ok());
  auto destroyed = std::async(std::launch::async, [&] { buffers.reset(); });
  if (destroyed.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    SetCounter(done, 4);  // let the destructor end, so the test can
    FAIL() << "destroying the buffers waited for a step no one will finish";
  }
  EXPECT_TRUE(StreamDrains(std::chrono::seconds(5)));
}

// A fail-open release NaN-fills the feedback before it releases: no selection consumed
// the entries of the step before, and the released step's attention would have combined
// its own masses with them (log-add-exp), favouring the groups that step had selected.
TEST_F(AsyncFenceTest, AFailOpenReleaseClearsTheFeedbackBeforeTheAttentionWritesIt) {
  client::BufferShape shape{.num_slots = host_->num_slots(),
                            .max_seqs = kBatch,
                            .max_context = kTokens,
                            .max_batch = kBatch,
                            .with_feedback = true};
  auto created = client::DeviceBuffers::Create(m_, shape, 0);
  ASSERT_TRUE(created.ok()) << created.status();
  client::DeviceBuffers& b = **created;
  const size_t n = b.plan().ElementsOf(SharedBuffer::kFeedback);
  const std::vector<float> stale(n, 1.5f);  // the step before's masses, never consumed
  for (const bool own_stream : {false, true}) {
    ASSERT_EQ(::eps::testing::CopyToDeviceNow(b.feedback(), stale.data(), n * 4), cudaSuccess);
    const uint64_t step = own_stream ? 2 : 1;
    if (own_stream) {
      ASSERT_TRUE(b.ReleaseDense(step, stream_).ok());
      ASSERT_TRUE(b.WaitSelection(stream_, step).ok());
      ASSERT_TRUE(StreamDrains(std::chrono::seconds(5)));
    } else {
      ASSERT_TRUE(b.ReleaseDense(step).ok());  // the watchdog's form
    }
    std::vector<float> after(n);
    ASSERT_EQ(cudaMemcpy(after.data(), b.feedback(), n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_TRUE(std::all_of(after.begin(), after.end(), [](float v) { return std::isnan(v); }))
        << (own_stream ? "on the engine's stream" : "on the library's stream");
    EXPECT_EQ(*b.ReadSelectionDone(), step);
  }
}

// Strict mode's second device array (as large as the scores) is allocated by a cuda
// session's first strict step: it is charged to the session's budget first (it was not,
// so a session's device memory could reach twice its charge).
TEST_F(AsyncFenceTest, StrictModesDeviceArrayIsChargedToTheSessionsBudgetFirst) {
  const uint64_t strict_bytes =
      uint64_t{kBatch} * kLayers * kQHeads * static_cast<uint64_t>(host_->max_groups()) * 4;
  SelectPolicy strict = JlPolicy();
  strict.strict = true;
  for (const bool fits : {false, true}) {
    service::MemoryBudget budget("--max-session-bytes", fits ? strict_bytes : strict_bytes - 1);
    auto backend =
        service::MakeCudaBackend(m_, 0, kBatch, host_->max_groups(), std::chrono::seconds(1));
    ASSERT_TRUE(backend.ok()) << backend.status();
    (*backend)->set_memory_budget(&budget);
    absl::MutexLock lock(&(*backend)->step_mu());
    service::StepOutcome outcome;
    service::BackendStep step{.inputs = DeviceInputs(),
                              .outputs = DeviceOutputs(),
                              .flags = nullptr,
                              .step = 1,
                              .policy = JlPolicy(),
                              .async = false,
                              .stop = {}};
    EXPECT_TRUE((*backend)->Run(step, &outcome).ok());  // not strict: nothing charged
    EXPECT_EQ(budget.used(), 0u);
    step.step = 2;
    step.policy = strict;
    const absl::Status s = (*backend)->Run(step, &outcome);
    if (fits) {
      EXPECT_TRUE(s.ok()) << s;
      EXPECT_EQ(budget.used(), strict_bytes);
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
      EXPECT_NE(s.message().find("strict mode's upper bounds"), std::string::npos) << s;
      EXPECT_EQ(budget.used(), 0u);
    }
  }
}

}  // namespace
}  // namespace eps::async_fence
