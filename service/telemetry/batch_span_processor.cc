#include "service/telemetry/batch_span_processor.h"

#include <cstdio>
#include <random>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "service/telemetry/otlp_encode.h"
#include "service/telemetry/utf8.h"

namespace eps::telemetry {
namespace {

// The most of a receiver's message a log line quotes: the receiver's words, not ours.
constexpr size_t kMaxReceiverMessageBytes = 256;

absl::Time ToAbsl(std::chrono::steady_clock::time_point t) {
  return absl::Now() + absl::FromChrono(t - std::chrono::steady_clock::now());
}

size_t BatchSpanBytes(const BatchConfig& config,
                      const std::vector<std::pair<std::string, std::string>>& resource) {
  const size_t own = EncodeSpans(resource, {}).ByteSizeLong() + kEncodedRequestSlack;
  return config.max_export_batch_bytes > own ? config.max_export_batch_bytes - own : 0;
}

}  // namespace

BatchSpanProcessor::BatchSpanProcessor(std::unique_ptr<SpanExporter> exporter, BatchConfig config,
                                       std::chrono::milliseconds attempt_timeout,
                                       std::vector<std::pair<std::string, std::string>> resource)
    : exporter_(std::move(exporter)),
      config_(config),
      attempt_timeout_(attempt_timeout),
      resource_(std::move(resource)),
      batch_span_bytes_(BatchSpanBytes(config_, resource_)) {
  worker_ = std::thread([this] { Run(); });
}

BatchSpanProcessor::~BatchSpanProcessor() { Shutdown(std::chrono::milliseconds(2000)); }

void BatchSpanProcessor::OnEnd(std::vector<SpanRecord>& spans) {
  // Sized outside the lock: the RPC threads share it.
  std::vector<size_t> bytes(spans.size());
  for (size_t i = 0; i < spans.size(); ++i) bytes[i] = EncodedSizeBound(spans[i]);
  absl::MutexLock lock(&mu_);
  if (stopping_) {
    counts_.dropped += spans.size();
    return;
  }
  for (size_t i = 0; i < spans.size(); ++i) {
    if (queue_.size() >= config_.max_queue_size ||
        queued_bytes_ + bytes[i] > config_.max_queue_bytes || bytes[i] > batch_span_bytes_) {
      ++counts_.dropped;
      continue;
    }
    queued_bytes_ += bytes[i];
    queue_.push_back({std::move(spans[i]), bytes[i]});
  }
}

BatchSpanProcessor::Counts BatchSpanProcessor::counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

void BatchSpanProcessor::Shutdown(std::chrono::milliseconds budget) {
  bool done = false;
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      stopping_ = true;
      shutdown_deadline_ = Clock::now() + budget;
    }
    // Attempts begun from now on end by the deadline (ExportBatch); one begun before has
    // the exporter's own timeout, and a collector that accepts and never answers held the
    // exit for all of it (10 s by default, past epsd's drain backstop): cancelled below.
    const auto finished = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return worker_done_; };
    done = mu_.AwaitWithDeadline(absl::Condition(&finished), ToAbsl(shutdown_deadline_));
  }
  if (!done) exporter_->Cancel();
  if (worker_.joinable()) worker_.join();
}

void BatchSpanProcessor::Run() {
  for (;;) {
    std::vector<SpanRecord> batch;
    Clock::time_point give_up;
    {
      absl::MutexLock lock(&mu_);
      // Idle, no timer runs: the schedule delay starts with the first queued span.
      // (Waiting on the delay alone woke the thread every delay, and a delay of 0
      // spun it on an idle epsd.)
      const auto has_work = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&has_work));
      const auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stopping_ || queue_.size() >= config_.max_export_batch_size ||
               queued_bytes_ >= batch_span_bytes_;
      };
      mu_.AwaitWithDeadline(absl::Condition(&ready), ToAbsl(Clock::now() + config_.schedule_delay));
      if (stopping_ && (queue_.empty() || Clock::now() >= shutdown_deadline_)) {
        counts_.dropped += queue_.size();
        queue_.clear();
        queued_bytes_ = 0;
        worker_done_ = true;
        return;
      }
      // Up to the batch size in spans and in bytes; every queued span fits a batch alone.
      size_t bytes = 0;
      while (!queue_.empty() && batch.size() < config_.max_export_batch_size &&
             bytes + queue_.front().bytes <= batch_span_bytes_) {
        bytes += queue_.front().bytes;
        queued_bytes_ -= queue_.front().bytes;
        batch.push_back(std::move(queue_.front().span));
        queue_.pop_front();
      }
      give_up = stopping_ ? shutdown_deadline_ : Clock::now() + config_.export_timeout;
    }
    if (!batch.empty()) ExportBatch(batch, give_up);
  }
}

void BatchSpanProcessor::ExportBatch(const std::vector<SpanRecord>& batch,
                                     Clock::time_point give_up) {
  const auto request = EncodeSpans(resource_, batch);
  std::minstd_rand jitter(static_cast<uint32_t>(Clock::now().time_since_epoch().count()));
  auto backoff = std::chrono::milliseconds(100);
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) give_up = std::min(give_up, shutdown_deadline_);
    }
    const Clock::time_point attempt_deadline = std::min(give_up, Clock::now() + attempt_timeout_);
    const ExportOutcome outcome = exporter_->Export(request, attempt_deadline);
    const ExportResult result = outcome.result;
    bool last = false;
    {
      absl::MutexLock lock(&mu_);
      if (result == ExportResult::kSuccess) {
        // A partial success: the spans the receiver refused are dropped, not exported.
        counts_.exported += outcome.accepted;
        counts_.dropped += outcome.rejected;
      }
    }
    if (result == ExportResult::kSuccess) {
      if (outcome.rejected > 0) {  // once per batch, outside mu_ (see below)
        std::fprintf(stderr, "epsd: the receiver rejected %llu of %zu spans: %s: %s\n",
                     static_cast<unsigned long long>(outcome.rejected), batch.size(),
                     exporter_->Describe().c_str(),
                     BoundedUtf8(outcome.message, kMaxReceiverMessageBytes).c_str());
      }
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      ++counts_.export_failures;
      if (stopping_) give_up = std::min(give_up, shutdown_deadline_);
      last = result == ExportResult::kFailed || Clock::now() >= give_up;
      if (last) {
        counts_.dropped += batch.size();
      } else {
        // Sleep the backoff (jittered to 50-150 %); a shutdown wakes it for one last try in
        // budget.
        const auto sleep = std::chrono::duration_cast<std::chrono::milliseconds>(
            backoff * (0.5 + static_cast<double>(jitter() % 1000) / 1000.0));
        const Clock::time_point wake = std::min(give_up, Clock::now() + sleep);
        const bool was_stopping = stopping_;
        const auto shutdown_began = [this, was_stopping]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
          return stopping_ && !was_stopping;
        };
        mu_.AwaitWithDeadline(absl::Condition(&shutdown_began), ToAbsl(wake));
      }
    }
    if (last) {
      // Stderr once per failed batch, not per retry, so a dead collector cannot flood the
      // log; and outside mu_, which OnEnd takes on the RPC threads: a stderr nobody drains
      // (a full pipe) blocks this write, and must not block SelectPages with it.
      std::fprintf(stderr, "epsd: dropped %zu spans: %s: %s\n", batch.size(),
                   exporter_->Describe().c_str(),
                   BoundedUtf8(outcome.message, kMaxReceiverMessageBytes).c_str());
      return;
    }
    backoff = std::min(backoff * 2, std::chrono::milliseconds(5000));
  }
}

}  // namespace eps::telemetry
