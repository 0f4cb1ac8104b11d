// Drives a real epsd for the observability tests and the telemetry overhead
// measurement: a TestEngine (shared memory) and the C++ client send SelectPages
// steps, optionally with a W3C traceparent and one deliberately stale step, and
// print what was sent and received as JSON lines on stdout:
//   {"step":N,"ok":true,"fallback":false,"groups_total":..,"prepass_us":..,"start_ns":..,...}
//   {"summary":true,"steps":N,"fallbacks":F,"p50_us":..,"p99_us":..,"session":".."}
//
//   observability_traffic --target=unix:///tmp/x.sock [--steps=20] [--traceparent=00-...]
//       [--stream] [--stale-after=K] [--seed=S] [--quiet]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "client/cpp/eps_client.h"
#include "tests/core/test_util.h"
#include "tests/service/test_engine.h"

namespace {

std::string Flag(int argc, char** argv, const std::string& name, const std::string& fallback) {
  const std::string prefix = "--" + name + "=";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--" + name) return "1";
    if (a.rfind(prefix, 0) == 0) return a.substr(prefix.size());
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  using eps::testing::TestEngine;
  const std::string target = Flag(argc, argv, "target", "");
  if (target.empty()) {
    std::fprintf(stderr, "observability_traffic: --target is required\n");
    return 2;
  }
  const int steps = std::atoi(Flag(argc, argv, "steps", "20").c_str());
  const int stale_after = std::atoi(Flag(argc, argv, "stale-after", "0").c_str());
  const bool quiet = Flag(argc, argv, "quiet", "") == "1";
  const uint64_t seed = std::strtoull(
      Flag(argc, argv, "seed", std::to_string(eps::testing::TestSeed())).c_str(), nullptr, 10);
  std::fprintf(stderr, "observability_traffic: seed=%llu\n", static_cast<unsigned long long>(seed));

  TestEngine engine(eps::testing::SmallServiceModel(), 2, 2048, 2, seed);
  engine.Fill(0, 0, 2048);
  engine.Fill(1, 1, 2048);
  eps::client::ClientOptions options;
  options.target = target;
  options.deadline = std::chrono::milliseconds(2000);  // generous: shared CI machines
  options.attach_deadline = std::chrono::seconds(5);   // likewise (the default is 500 ms)
  options.use_stream = Flag(argc, argv, "stream", "") == "1";
  options.traceparent = Flag(argc, argv, "traceparent", "");
  eps::client::EpsClient client(options, engine.Attach("observability-traffic"));
  if (absl::Status s = client.Attach(); !s.ok()) {
    std::fprintf(stderr, "observability_traffic: attach: %s\n", s.ToString().c_str());
    return 1;
  }
  std::vector<double> rtt;
  uint64_t step = 0;
  for (int i = 1; i <= steps; ++i) {
    // A stale step (not after the last one) makes epsd refuse it: FAILED_PRECONDITION, which
    // the fail-open client counts as a fallback and reports with the next step.
    const bool stale = stale_after > 0 && i == stale_after + 1;
    const uint64_t this_step = stale ? step : step + 1;
    // Contexts stay within the 2048 filled tokens however many steps run.
    std::vector<eps::v1::BatchRow> rows = {TestEngine::Row(0, 1500 + i % 500),
                                           TestEngine::Row(1, 700 + i % 500)};
    const int64_t start_ns = absl::GetCurrentTimeNanos();
    const eps::client::StepResult r = client.SelectPages(this_step, rows);
    const int64_t end_ns = absl::GetCurrentTimeNanos();
    if (!stale) step = this_step;
    rtt.push_back(r.round_trip_us);
    if (quiet) continue;
    const eps::v1::StepStats& s = r.response.stats();
    std::printf(
        "{\"step\":%llu,\"ok\":%s,\"fallback\":%s,\"code\":%d,\"batch\":%zu,\"groups_total\":%lld,"
        "\"groups_visited\":%lld,\"pages_total\":%lld,\"pages_visited\":%lld,"
        "\"bytes_kv_dense\":%lld,\"bytes_kv_read_est\":%lld,\"bytes_summary_read\":%lld,"
        "\"prepass_us\":%.17g,\"start_ns\":%lld,\"end_ns\":%lld}\n",
        static_cast<unsigned long long>(this_step), r.fallback ? "false" : "true",
        r.fallback ? "true" : "false", static_cast<int>(r.status.code()), rows.size(),
        static_cast<long long>(s.groups_total()), static_cast<long long>(s.groups_visited()),
        static_cast<long long>(s.pages_total()), static_cast<long long>(s.pages_visited()),
        static_cast<long long>(s.bytes_kv_dense()), static_cast<long long>(s.bytes_kv_read_est()),
        static_cast<long long>(s.bytes_summary_read()), s.prepass_us(),
        static_cast<long long>(start_ns), static_cast<long long>(end_ns));
  }
  std::sort(rtt.begin(), rtt.end());
  auto pct = [&](double p) {
    return rtt.empty() ? 0.0 : rtt[std::min(rtt.size() - 1, static_cast<size_t>(p * rtt.size()))];
  };
  const eps::client::ClientCounters c = client.counters();
  std::printf(
      "{\"summary\":true,\"steps\":%d,\"selected\":%llu,\"fallbacks\":%llu,"
      "\"fallback_error\":%llu,\"p50_us\":%.1f,\"p99_us\":%.1f,\"session\":\"%s\"}\n",
      steps, static_cast<unsigned long long>(c.selected),
      static_cast<unsigned long long>(c.fallbacks()),
      static_cast<unsigned long long>(c.fallback_error), pct(0.50), pct(0.99),
      client.session_id().c_str());
  // Stays attached: the tests read eps_sessions while the session is live.
  return 0;
}
