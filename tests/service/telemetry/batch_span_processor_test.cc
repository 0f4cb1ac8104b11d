#include "service/telemetry/batch_span_processor.h"

#include <time.h>

#include <atomic>
#include <thread>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace eps::telemetry {
namespace {

using Request = opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest;
using std::chrono::milliseconds;

// Answers each Export from a script; records what it was sent.
class ScriptedExporter final : public SpanExporter {
 public:
  struct Shared {
    absl::Mutex mu;
    std::vector<ExportResult> script ABSL_GUARDED_BY(mu);  // then kSuccess forever
    int64_t rejected ABSL_GUARDED_BY(mu) = 0;  // what each success says the receiver refused
    std::vector<size_t> batch_sizes ABSL_GUARDED_BY(mu);
    std::vector<size_t> request_bytes ABSL_GUARDED_BY(mu);
    std::vector<std::string> span_names ABSL_GUARDED_BY(mu);
    bool block = false;  // hold every Export until `release`
    absl::Notification release;
  };
  explicit ScriptedExporter(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {}
  ExportOutcome Export(const Request& request, std::chrono::steady_clock::time_point) override {
    if (shared_->block) shared_->release.WaitForNotification();
    absl::MutexLock lock(&shared_->mu);
    const auto& spans = request.resource_spans(0).scope_spans(0).spans();
    shared_->batch_sizes.push_back(spans.size());
    shared_->request_bytes.push_back(request.ByteSizeLong());
    for (const auto& s : spans) shared_->span_names.push_back(s.name());
    if (shared_->script.empty()) {
      return ExportOutcome::Success(spans.size(), shared_->rejected, "scripted refusal");
    }
    const ExportResult r = shared_->script.front();
    shared_->script.erase(shared_->script.begin());
    if (r == ExportResult::kSuccess) return ExportOutcome::Success(spans.size(), 0, "");
    return ExportOutcome::Failure(r, "scripted failure");
  }
  void Cancel() override {}
  std::string Describe() const override { return "scripted"; }

 private:
  std::shared_ptr<Shared> shared_;
};

// An exporter whose attempt never ends by itself, like one against a collector that accepts
// the call and never answers: only Cancel ends it (or, should Cancel never come, a guard
// that lets the test fail instead of hanging).
class NeverAnsweringExporter final : public SpanExporter {
 public:
  struct Shared {
    absl::Notification exporting;  // an attempt is in flight
    absl::Notification cancelled;
    std::atomic<bool> ended_by_cancel{false};
  };
  explicit NeverAnsweringExporter(std::shared_ptr<Shared> shared) : shared_(std::move(shared)) {}
  ExportOutcome Export(const Request&, std::chrono::steady_clock::time_point) override {
    if (!shared_->exporting.HasBeenNotified()) shared_->exporting.Notify();
    if (shared_->cancelled.WaitForNotificationWithTimeout(absl::Seconds(30))) {
      shared_->ended_by_cancel = true;
    }
    return ExportOutcome::Failure(ExportResult::kFailed, "no answer");
  }
  void Cancel() override {
    if (!shared_->cancelled.HasBeenNotified()) shared_->cancelled.Notify();
  }
  std::string Describe() const override { return "never answering"; }

 private:
  std::shared_ptr<Shared> shared_;
};

std::vector<SpanRecord> Spans(int n, const std::string& prefix) {
  std::vector<SpanRecord> spans(n);
  for (int i = 0; i < n; ++i) {
    spans[i].name = prefix + std::to_string(i);
    spans[i].trace_id = NewTraceId();
    spans[i].span_id = NewSpanId();
  }
  return spans;
}

BatchConfig Config(size_t queue, size_t batch, int delay_ms) {
  BatchConfig c;
  c.max_queue_size = queue;
  c.max_export_batch_size = batch;
  c.schedule_delay = milliseconds(delay_ms);
  c.export_timeout = milliseconds(30000);
  return c;
}

TEST(BatchSpanProcessorTest, ExportsEverySpanInBatchesOfAtMostTheBatchSize) {
  auto shared = std::make_shared<ScriptedExporter::Shared>();
  BatchSpanProcessor p(std::make_unique<ScriptedExporter>(shared), Config(100, 4, 60000),
                       milliseconds(1000), {{"service.name", "t"}});
  auto spans = Spans(10, "s");
  p.OnEnd(spans);
  p.Shutdown(milliseconds(5000));  // flushes the rest without waiting for the schedule delay
  EXPECT_EQ(p.counts().exported, 10u);
  EXPECT_EQ(p.counts().dropped, 0u);
  absl::MutexLock lock(&shared->mu);
  EXPECT_EQ(shared->batch_sizes, (std::vector<size_t>{4, 4, 2}));
  EXPECT_EQ(shared->span_names.front(), "s0");
  EXPECT_EQ(shared->span_names.back(), "s9");
}

// CPU time of this whole process, in ms.
double ProcessCpuMs() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

TEST(BatchSpanProcessorTest, AnIdleWorkerDoesNotSpinEvenWithTheShortestDelay) {
  // With a delay of 0 the worker once woke without pause: ~17 % of a core on an idle epsd.
  auto shared = std::make_shared<ScriptedExporter::Shared>();
  BatchSpanProcessor p(std::make_unique<ScriptedExporter>(shared), Config(100, 4, 0),
                       milliseconds(1000), {{"service.name", "t"}});
  const double before = ProcessCpuMs();
  // A measurement window, not a synchronisation: an idle worker uses no CPU in it.
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_LT(ProcessCpuMs() - before, 30.0) << "the idle worker spins";
  // Spans still go out on the schedule, with no shutdown to flush them.
  auto spans = Spans(1, "s");
  p.OnEnd(spans);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (p.counts().exported == 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(1));
  }
  EXPECT_EQ(p.counts().exported, 1u);
}

TEST(BatchSpanProcessorTest, AFullQueueDropsAndCountsNewSpansWithoutBlocking) {
  auto shared = std::make_shared<ScriptedExporter::Shared>();
  shared->block = true;  // the exporter hangs: the queue cannot drain
  BatchSpanProcessor p(std::make_unique<ScriptedExporter>(shared), Config(5, 1, 1),
                       milliseconds(1000), {});
  auto first = Spans(1, "a");
  p.OnEnd(first);  // the worker takes it and blocks in Export
  auto more = Spans(20, "b");
  p.OnEnd(more);  // at most 5 fit
  const auto counts = p.counts();
  EXPECT_GE(counts.dropped, 15u);
  EXPECT_LE(counts.dropped, 16u);  // 16 when the worker had not yet taken the first span
  shared->release.Notify();
  p.Shutdown(milliseconds(5000));
  EXPECT_EQ(p.counts().exported + p.counts().dropped, 21u);
}

TEST(BatchSpanProcessorTest, RetriesARetryableFailureThenSucceeds) {
  auto shared = std::make_shared<ScriptedExporter::Shared>();
  {
    absl::MutexLock lock(&shared->mu);
    shared->script = {ExportResult::kRetryable, ExportResult::kRetryable};
  }
  BatchSpanProcessor p(std::make_unique<ScriptedExporter>(shared), Config(10, 2, 60000),
                       milliseconds(1000), {});
  auto spans = Spans(2, "r");
  p.OnEnd(spans);
  p.Shutdown(milliseconds(10000));  // backoff 100 ms then 200 ms (jittered) fits easily
  EXPECT_EQ(p.counts().exported, 2u);
  EXPECT_EQ(p.counts().export_failures, 2u);
  absl::MutexLock lock(&shared->mu);
  EXPECT_EQ(shared->batch_sizes.size(), 3u);
}

TEST(BatchSpanProcessorTest, APermanentFailureDropsTheBatchWithoutRetrying) {
  auto shared = std::make_shared<ScriptedExporter::Shared>();
  {
    absl::MutexLock lock(&shared->mu);
    shared->script = {ExportResult::kFailed};
  }
  BatchSpanProcessor p(std::make_unique<ScriptedExporter>(shared), Config(10, 3, 60000),
                       milliseconds(1000), {});
  auto spans = Spans(3, "f");
  p.OnEnd(spans);
  p.Shutdown(milliseconds(5000));
  EXPECT_EQ(p.counts().exported, 0u);
  EXPECT_EQ(p.counts().dropped, 3u);
  EXPECT_EQ(p.counts().export_failures, 1u);
}

TEST(BatchSpanProcessorTest, ShutdownGivesUpOnAnUnavailableReceiverWithinItsBudget) {
  auto shared = std::make_shared<ScriptedExporter::Shared>();
  {
    absl::MutexLock lock(&shared->mu);
    shared->script.assign(1000, ExportResult::kRetryable);
  }
  BatchSpanProcessor p(std::make_unique<ScriptedExporter>(shared), Config(100, 10, 60000),
                       milliseconds(1000), {});
  auto spans = Spans(30, "u");
  p.OnEnd(spans);
  const auto start = std::chrono::steady_clock::now();
  p.Shutdown(milliseconds(300));
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_LT(took, milliseconds(2000));  // the budget, with room for a slow shared machine
  EXPECT_EQ(p.counts().exported, 0u);
  EXPECT_EQ(p.counts().dropped, 30u);
  auto late = Spans(2, "late");
  p.OnEnd(late);  // after shutdown: dropped, counted
  EXPECT_EQ(p.counts().dropped, 32u);
}

// OTLP partial success: the receiver took the request and refused some of its spans. They
// were once counted as exported, and never logged.
TEST(BatchSpanProcessorTest, SpansTheReceiverRefusesAreCountedAsDroppedNotExported) {
  auto shared = std::make_shared<ScriptedExporter::Shared>();
  {
    absl::MutexLock lock(&shared->mu);
    shared->rejected = 2;
  }
  BatchSpanProcessor p(std::make_unique<ScriptedExporter>(shared), Config(100, 3, 60000),
                       milliseconds(1000), {});
  auto spans = Spans(6, "partly");
  p.OnEnd(spans);
  p.Shutdown(milliseconds(5000));
  EXPECT_EQ(p.counts().exported, 2u);  // one of each batch of 3
  EXPECT_EQ(p.counts().dropped, 4u);
  EXPECT_EQ(p.counts().export_failures, 0u);  // the attempts succeeded: nothing to retry
}

// Spans of `bytes` bytes each (one string attribute of that size).
std::vector<SpanRecord> LargeSpans(int n, size_t bytes) {
  std::vector<SpanRecord> spans = Spans(n, "big");
  for (SpanRecord& s : spans) s.attributes.push_back({"payload", std::string(bytes, 'p')});
  return spans;
}

// A batch was cut by span count alone: one 5 MB span made a request a collector refused
// (4 MiB limit), and every other span in it was lost.
TEST(BatchSpanProcessorTest, ABatchIsCutBeforeItsRequestPassesTheByteBudget) {
  auto shared = std::make_shared<ScriptedExporter::Shared>();
  BatchConfig config = Config(100, 512, 60000);
  config.max_export_batch_bytes = 64 << 10;
  BatchSpanProcessor p(std::make_unique<ScriptedExporter>(shared), config, milliseconds(1000),
                       {{"service.name", "t"}});
  auto spans = LargeSpans(10, 20 << 10);  // 200 KiB in all: 3 a request
  p.OnEnd(spans);
  p.Shutdown(milliseconds(5000));
  EXPECT_EQ(p.counts().exported, 10u);
  EXPECT_EQ(p.counts().dropped, 0u);
  absl::MutexLock lock(&shared->mu);
  EXPECT_EQ(shared->batch_sizes, (std::vector<size_t>{3, 3, 3, 1}));
  for (size_t bytes : shared->request_bytes) EXPECT_LE(bytes, config.max_export_batch_bytes);
}

TEST(BatchSpanProcessorTest, ASpanNoRequestCouldHoldIsDroppedAndTheOthersGoOut) {
  auto shared = std::make_shared<ScriptedExporter::Shared>();
  BatchConfig config = Config(100, 512, 60000);
  config.max_export_batch_bytes = 64 << 10;
  BatchSpanProcessor p(std::make_unique<ScriptedExporter>(shared), config, milliseconds(1000), {});
  auto small = Spans(3, "small");
  auto huge = LargeSpans(1, 100 << 10);
  p.OnEnd(small);
  p.OnEnd(huge);
  p.Shutdown(milliseconds(5000));
  EXPECT_EQ(p.counts().exported, 3u);
  EXPECT_EQ(p.counts().dropped, 1u);
}

// 60 calls with an 8 MB session id once held 1.39 GB of epsd in the span queue, which was
// bounded by span count only.
TEST(BatchSpanProcessorTest, TheQueueHoldsAtMostItsByteBudgetAndCountsWhatItDrops) {
  auto shared = std::make_shared<ScriptedExporter::Shared>();
  shared->block = true;  // the exporter hangs: the queue cannot drain
  BatchConfig config = Config(1000, 1, 1);
  config.max_queue_bytes = 100 << 10;
  BatchSpanProcessor p(std::make_unique<ScriptedExporter>(shared), config, milliseconds(1000), {});
  auto spans = LargeSpans(20, 20 << 10);  // 400 KiB, queued in one critical section: 4 fit
  p.OnEnd(spans);
  EXPECT_EQ(p.counts().dropped, 16u);
  shared->release.Notify();
  p.Shutdown(milliseconds(5000));
  EXPECT_EQ(p.counts().exported + p.counts().dropped, 20u);
}

// An attempt begun before the shutdown once ran to its own timeout (OTEL_EXPORTER_OTLP_TIMEOUT,
// 10 s by default), past the 2 s the shutdown promises and past epsd's drain backstop.
TEST(BatchSpanProcessorTest, ShutdownCancelsAnAttemptStillInFlightAtTheEndOfItsBudget) {
  auto shared = std::make_shared<NeverAnsweringExporter::Shared>();
  BatchSpanProcessor p(std::make_unique<NeverAnsweringExporter>(shared), Config(100, 1, 1),
                       milliseconds(60000), {});
  auto spans = Spans(3, "stuck");
  p.OnEnd(spans);
  shared->exporting.WaitForNotification();  // the worker is inside Export, deadline 60 s away
  p.Shutdown(milliseconds(200));
  EXPECT_TRUE(shared->ended_by_cancel) << "the attempt ran on to its own end";
  EXPECT_EQ(p.counts().exported, 0u);
  EXPECT_EQ(p.counts().dropped, 3u);
}

}  // namespace
}  // namespace eps::telemetry
