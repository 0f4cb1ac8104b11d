// The OpenTelemetry batch span processor: finished spans go into a bounded
// queue; one worker thread sends them in batches of max_export_batch_size, at
// least every schedule_delay while spans are queued (an idle worker sleeps until one
// comes), retrying a retryable failure with exponential
// backoff (100 ms doubling to 5 s, jittered) for up to export_timeout.
//
// Bounded in bytes as well as in spans (BatchConfig): the queue holds at most
// max_queue_bytes of encoded spans, and a batch is cut before its request would pass
// max_export_batch_bytes, so no span, however large, can make a request that a receiver
// refuses for its size and lose the other spans with it. A span that could not fit in any
// request is dropped at once.
//
// Promises: OnEnd never waits on the network and never blocks beyond a short
// critical section; when the queue is full (in spans or in bytes) new spans are dropped
// and counted.
// Shutdown exports what is queued within its budget and drops the rest, then cancels an
// export still in flight (SpanExporter::Cancel), so neither a dead collector nor one that
// accepts and never answers holds up epsd's exit for longer than that budget.
//
// Thread safety: OnEnd and counts() may be called from any thread.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "service/telemetry/otel_config.h"
#include "service/telemetry/span.h"
#include "service/telemetry/span_exporter.h"

namespace eps::telemetry {

class BatchSpanProcessor {
 public:
  struct Counts {
    uint64_t exported = 0;  // accepted by the receiver
    // queue full, too large for a request, export failed for good, refused by the receiver
    // (an OTLP partial success: logged once per batch), or left at shutdown
    uint64_t dropped = 0;
    uint64_t export_failures = 0;  // failed attempts, retries included
  };

  // `attempt_timeout`: the longest one export attempt may take (OTEL_EXPORTER_OTLP_TIMEOUT).
  BatchSpanProcessor(std::unique_ptr<SpanExporter> exporter, BatchConfig config,
                     std::chrono::milliseconds attempt_timeout,
                     std::vector<std::pair<std::string, std::string>> resource);
  ~BatchSpanProcessor();  // Shutdown(2 s) unless already shut down
  BatchSpanProcessor(const BatchSpanProcessor&) = delete;
  BatchSpanProcessor& operator=(const BatchSpanProcessor&) = delete;

  // Queues finished spans (moved from); drops those that do not fit.
  void OnEnd(std::vector<SpanRecord>& spans);
  // Stops taking spans, exports the queue within `budget`, cancels what is still in flight
  // at its end, joins the worker. Returns within `budget` and the time an exporter takes to
  // notice its cancellation.
  void Shutdown(std::chrono::milliseconds budget);
  Counts counts() const;
  const SpanExporter& exporter() const { return *exporter_; }

 private:
  using Clock = std::chrono::steady_clock;
  void Run();
  // Sends one batch with retries until `give_up`; returns when done or stopping past it.
  void ExportBatch(const std::vector<SpanRecord>& batch, Clock::time_point give_up);

  struct Queued {
    SpanRecord span;
    size_t bytes;  // EncodedSizeBound(span)
  };

  const std::unique_ptr<SpanExporter> exporter_;
  const BatchConfig config_;
  const std::chrono::milliseconds attempt_timeout_;
  const std::vector<std::pair<std::string, std::string>> resource_;
  // What the spans of one request may take: max_export_batch_bytes less the request's
  // own bytes (resource, scope) and their slack.
  const size_t batch_span_bytes_;

  mutable absl::Mutex mu_;
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);
  size_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool worker_done_ ABSL_GUARDED_BY(mu_) = false;  // Run returned: nothing more to cancel
  Clock::time_point shutdown_deadline_ ABSL_GUARDED_BY(mu_){};
  Counts counts_ ABSL_GUARDED_BY(mu_);
  std::thread worker_;
};

}  // namespace eps::telemetry
