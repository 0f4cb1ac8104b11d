// The per-step cost of epsd's telemetry on the RPC thread, alone and with
// several threads at once (contention): the metrics of one SelectPages, the
// lock-free histogram against prometheus-cpp's mutex histogram, and handing a
// step's two spans to the batch span processor.
//
//   ./build/bench/eps_telemetry_bench
#include <memory>

#include "benchmark/benchmark.h"
#include "prometheus/histogram.h"
#include "service/telemetry/batch_span_processor.h"
#include "service/telemetry/metrics.h"

namespace eps::telemetry {
namespace {

ServerMetrics& Metrics() {
  static auto* m = new ServerMetrics({});
  return *m;
}

void BM_MetricsPerSelectPages(benchmark::State& state) {
  v1::StepStats s;
  s.set_groups_total(4100);
  s.set_groups_visited(1644);
  s.set_pages_total(32800);
  s.set_pages_visited(13152);
  s.set_bytes_kv_dense(1 << 30);
  s.set_bytes_kv_read_est(1 << 28);
  s.set_prepass_us(85.0);
  for (auto _ : state) {
    Metrics().RpcStarted(RpcMethod::kSelectPages);
    Metrics().StepSelected(s, service::BackendKind::kCpu);
    Metrics().RpcHandled(RpcMethod::kSelectPages, grpc::StatusCode::OK, 120e-6);
  }
}
BENCHMARK(BM_MetricsPerSelectPages)->ThreadRange(1, 8)->UseRealTime();

void BM_ShardedHistogramObserve(benchmark::State& state) {
  static auto* h = new ShardedHistogram(LatencyBucketsSeconds());
  double v = 1e-6;
  for (auto _ : state) {
    h->Observe(v);
    v = v < 1 ? v * 1.1 : 1e-6;
  }
}
BENCHMARK(BM_ShardedHistogramObserve)->ThreadRange(1, 8)->UseRealTime();

void BM_PrometheusCppHistogramObserve(benchmark::State& state) {
  static auto* h = new prometheus::Histogram(LatencyBucketsSeconds());
  double v = 1e-6;
  for (auto _ : state) {
    h->Observe(v);
    v = v < 1 ? v * 1.1 : 1e-6;
  }
}
BENCHMARK(BM_PrometheusCppHistogramObserve)->ThreadRange(1, 8)->UseRealTime();

// An exporter that accepts everything at once: measures the hand-off, not a network.
class NullExporter final : public SpanExporter {
 public:
  ExportOutcome Export(
      const opentelemetry::proto::collector::trace::v1::ExportTraceServiceRequest& request,
      std::chrono::steady_clock::time_point) override {
    return ExportOutcome::Success(CountSpans(request), 0, "");
  }
  void Cancel() override {}
  std::string Describe() const override { return "null"; }
};

void BM_HandTwoSpansToTheProcessor(benchmark::State& state) {
  static auto* p = new BatchSpanProcessor(std::make_unique<NullExporter>(), BatchConfig{},
                                          std::chrono::milliseconds(1000), {});
  for (auto _ : state) {
    std::vector<SpanRecord> spans(2);
    for (SpanRecord& s : spans) {
      s.trace_id = NewTraceId();
      s.span_id = NewSpanId();
      s.name = "eps.v1.PageSelector/SelectPages";
      s.attributes.reserve(17);
      for (int i = 0; i < 17; ++i) s.attributes.push_back({"eps.attribute", int64_t{i}});
    }
    p->OnEnd(spans);
  }
  state.counters["dropped"] = static_cast<double>(p->counts().dropped);
}
BENCHMARK(BM_HandTwoSpansToTheProcessor)->ThreadRange(1, 8)->UseRealTime();

}  // namespace
}  // namespace eps::telemetry

BENCHMARK_MAIN();
