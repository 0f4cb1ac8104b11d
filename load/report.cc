#include "load/report.h"

#include <sys/utsname.h>

#include <cmath>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace eps::load {
namespace {

using Json = nlohmann::ordered_json;

// A measured number in the report: rounded to 1e-3, null when there is none.
Json Num(double v) { return std::isfinite(v) ? Json(std::round(v * 1000) / 1000) : Json(nullptr); }

std::string CpuModel() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      return colon == std::string::npos ? line : line.substr(colon + 2);
    }
  }
  return "unknown";
}

struct CallView {
  LatencySummary lat;
  LatencySummary lag;
  uint64_t errors = 0;
  uint64_t over_slo = 0;
  double rps = 0;
};

CallView View(const LoadConfig& config, const RunResult& r, CallResults& c) {
  CallView v;
  v.lat = c.latency.Summarize();
  v.lag = c.send_lag.Summarize();
  v.errors = c.errors();
  v.over_slo = c.latency.CountAbove(std::chrono::duration<double, std::micro>(config.slo).count());
  v.rps = r.measured_s > 0 ? static_cast<double>(v.lat.count) / r.measured_s : 0;
  return v;
}

double Ratio(double a, double b) { return a > 0 && b > 0 ? a / b : std::nan(""); }

// The ratio of two summaries' p50s; NaN unless both measured a call.
double P50Ratio(const LatencySummary& a, const LatencySummary& b) {
  return a.count > 0 && b.count > 0 ? Ratio(a.p50_us, b.p50_us) : std::nan("");
}

// A ratio for a line of text: "n/a" when either side was not measured.
std::string RatioText(double x, const char* format = "%.2fx") {
  return std::isfinite(x) ? absl::StrFormat(format, x) : std::string("n/a");
}

// A latency for a line of text: "n/a" when there is no sample.
std::string UsText(double us, uint64_t count) {
  return count == 0 ? std::string("n/a") : absl::StrFormat("%.1f us", us);
}

// A latency for the table: "-" when there is none.
std::string Cell(double us, uint64_t count) {
  return count == 0 ? "-" : absl::StrFormat("%.1f", us);
}

Json CallJson(CallView v, const CallResults& c) {
  if (v.lat.count == 0) {  // no latency to report: null, not a misleading 0
    const double none = std::nan("");
    v.lat.min_us = v.lat.p50_us = v.lat.p90_us = v.lat.p99_us = v.lat.p999_us = v.lat.max_us =
        v.lat.mean_us = v.lat.stddev_us = none;
  }
  if (v.lag.count == 0) v.lag.p50_us = v.lag.p99_us = v.lag.max_us = std::nan("");
  Json codes = Json::object();
  for (const auto& [code, n] : c.errors_by_code) codes[code] = n;
  return Json{{"p50_us", Num(v.lat.p50_us)},
              {"p90_us", Num(v.lat.p90_us)},
              {"p99_us", Num(v.lat.p99_us)},
              {"p999_us", Num(v.lat.p999_us)},
              {"max_us", Num(v.lat.max_us)},
              {"min_us", Num(v.lat.min_us)},
              {"mean_us", Num(v.lat.mean_us)},
              {"stddev_us", Num(v.lat.stddev_us)},
              {"count", v.lat.count},
              {"errors", v.errors},
              {"errors_by_code", codes},
              {"unsent", c.unsent},
              {"rps", Num(v.rps)},
              {"over_slo", v.over_slo},
              {"send_lag_p50_us", Num(v.lag.p50_us)},
              {"send_lag_p99_us", Num(v.lag.p99_us)},
              {"send_lag_max_us", Num(v.lag.max_us)}};
}

// "stream" or "unary", and ", async replies" when the reply comes before the selection ends.
std::string ModeName(const LoadConfig& c) {
  return absl::StrCat(c.stream ? "stream" : "unary", c.reply_async ? ", async replies" : "");
}

// --ranks: one line per rank, then the spread between ranks at the same step.
void PrintRanks(RunResult& r, std::FILE* out) {
  std::fprintf(out, "%-12s %9s %7s %10s %10s %10s %10s %14s\n", "rank", "device", "count", "p50 us",
               "p90 us", "p99 us", "max us", "selection p50");
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    const LatencySummary lat = r.ranks[i].latency.Summarize();
    const LatencySummary pre = r.ranks[i].prepass_us.Summarize();
    std::fprintf(out, "%-12zu %9d %7llu %10s %10s %10s %10s %14s\n", i, r.ranks[i].device,
                 static_cast<unsigned long long>(lat.count), Cell(lat.p50_us, lat.count).c_str(),
                 Cell(lat.p90_us, lat.count).c_str(), Cell(lat.p99_us, lat.count).c_str(),
                 Cell(lat.max_us, lat.count).c_str(), Cell(pre.p50_us, pre.count).c_str());
  }
  const LatencySummary spread = r.rank_spread_us.Summarize();
  std::fprintf(out,
               "spread between ranks at the same step (last reply - first): p50 %s us, p90 %s "
               "us, p99 %s us, max %s us over %llu steps\n",
               Cell(spread.p50_us, spread.count).c_str(), Cell(spread.p90_us, spread.count).c_str(),
               Cell(spread.p99_us, spread.count).c_str(), Cell(spread.max_us, spread.count).c_str(),
               static_cast<unsigned long long>(spread.count));
}

// A latency for the JSON: null when there is none.
Json Latency(double us, uint64_t count) { return count > 0 ? Num(us) : Json(nullptr); }

Json RanksJson(RunResult& r) {
  Json ranks = Json::array();
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    const LatencySummary lat = r.ranks[i].latency.Summarize();
    const LatencySummary pre = r.ranks[i].prepass_us.Summarize();
    ranks.push_back({{"rank", i},
                     {"device", r.ranks[i].device},
                     {"count", lat.count},
                     {"p50_us", Latency(lat.p50_us, lat.count)},
                     {"p90_us", Latency(lat.p90_us, lat.count)},
                     {"p99_us", Latency(lat.p99_us, lat.count)},
                     {"max_us", Latency(lat.max_us, lat.count)},
                     {"prepass_p50_us", Latency(pre.p50_us, pre.count)}});
  }
  return ranks;
}

Json SpreadJson(RunResult& r) {
  const LatencySummary s = r.rank_spread_us.Summarize();
  return Json{{"steps", s.count},
              {"p50_us", Latency(s.p50_us, s.count)},
              {"p90_us", Latency(s.p90_us, s.count)},
              {"p99_us", Latency(s.p99_us, s.count)},
              {"max_us", Latency(s.max_us, s.count)}};
}

// The RPC floor next to epsd's Ping and SelectPages: p50 and p99 of each, and the
// ratios the latency goals are written in (docs/benchmarks/latency.md). The floor's
// calls ran before the run; "(the run)" rows are the run's own calls.
void PrintFloor(FloorResult& f, const CallView& sel, const CallView& png, std::FILE* out) {
  const LatencySummary fc = f.floor_callback.Summarize(), fs = f.floor_sync.Summarize();
  const LatencySummary pc = f.ping_callback.Summarize(), ps = f.ping_sync.Summarize();
  std::fprintf(out,
               "rpc floor: %d interleaved rounds measured after %d warm-up rounds, minimal server "
               "(%s) at %s; failed calls: %llu in warm-up, %llu measured%s%s\n",
               f.rounds, f.warmup_rounds, f.where.c_str(), f.floor_address.c_str(),
               static_cast<unsigned long long>(f.warmup_errors),
               static_cast<unsigned long long>(f.errors),
               f.aborted.empty() ? "" : absl::StrCat("; ended early: ", f.aborted).c_str(),
               f.stopped ? "; stopped by a signal" : "");
  std::fprintf(out, "%-34s %10s %10s %12s\n", "call", "p50 us", "p99 us", "p50 / floor");
  auto row = [&](const char* name, const LatencySummary& l, const LatencySummary& floor) {
    std::fprintf(out, "%-34s %10s %10s %12s\n", name, Cell(l.p50_us, l.count).c_str(),
                 Cell(l.p99_us, l.count).c_str(), RatioText(P50Ratio(l, floor)).c_str());
  };
  row("floor, callback client", fc, fc);
  row("floor, sync client", fs, fc);
  row("epsd Ping, callback client", pc, fc);
  row("epsd Ping, sync client", ps, fs);
  row("epsd Ping (the run)", png.lat, fc);
  row("epsd SelectPages (the run)", sel.lat, fc);
  // Each ratio divides calls of one phase: the run's SelectPages by the run's Ping, the
  // floor phase's Ping by the floor phase's minimal server.
  std::fprintf(out,
               "SelectPages / Ping (both of the run) p50 %s; Ping / floor (callback, both of the "
               "floor phase) p50 %s\n",
               RatioText(P50Ratio(sel.lat, png.lat)).c_str(), RatioText(P50Ratio(pc, fc)).c_str());
}

Json FloorJson(FloorResult& f, const CallView& sel, const CallView& png) {
  auto summary = [](LatencySamples& samples) {
    const LatencySummary l = samples.Summarize();
    return Json{{"p50_us", Latency(l.p50_us, l.count)},
                {"p99_us", Latency(l.p99_us, l.count)},
                {"count", l.count}};
  };
  const LatencySummary fc = f.floor_callback.Summarize(), pc = f.ping_callback.Summarize();
  return Json{{"address", f.floor_address},
              {"server", f.where},
              {"rounds", f.rounds},
              {"warmup_rounds", f.warmup_rounds},
              {"floor_callback", summary(f.floor_callback)},
              {"floor_sync", summary(f.floor_sync)},
              {"ping_callback", summary(f.ping_callback)},
              {"ping_sync", summary(f.ping_sync)},
              {"ping_over_floor_p50", Num(P50Ratio(pc, fc))},
              {"select_over_ping_p50", Num(P50Ratio(sel.lat, png.lat))},
              {"warmup_errors", f.warmup_errors},
              {"errors", f.errors},
              {"aborted", f.aborted.empty() ? Json(nullptr) : Json(f.aborted)}};
}

}  // namespace

void PrintTable(const LoadConfig& config, RunResult& r, std::FILE* out) {
  const ModelLayout& m = config.model;
  const CallView sel = View(config, r, r.select);
  const CallView png = View(config, r, r.ping);
  std::fprintf(out,
               "eps-load: %s (%d layers, %d q / %d kv heads, d %d), batch %d, context %s, "
               "rate %s, %d session%s, %s over %s, %.1f s measured after %.1f s warm-up\n",
               config.preset.c_str(), m.num_layers, m.num_q_heads, m.num_kv_heads, m.head_dim,
               config.batch, config.context.ToString().c_str(), config.arrivals.ToString().c_str(),
               config.sessions, config.sessions == 1 ? "" : "s", ModeName(config).c_str(),
               config.target.c_str(), r.measured_s,
               std::chrono::duration<double>(config.warmup).count());
  if (m.has_coarse_level()) {
    std::fprintf(
        out, "coarse level: %d blocks per coarse group, coarse_candidates %s\n", m.coarse_blocks,
        config.coarse_candidates > 0 ? absl::StrCat(config.coarse_candidates).c_str() : "epsd's");
  }
  if (config.feedback_share > 0) {
    const LatencySummary write = r.feedback_write_us.Summarize();
    std::fprintf(
        out,
        "selection feedback: share %g of each row's groups written before every step "
        "(not timed: p50 %s p99 %s); probes %lld, written %lld, consumed by "
        "epsd %lld\n",
        config.feedback_share, UsText(write.p50_us, write.count).c_str(),
        UsText(write.p99_us, write.count).c_str(), static_cast<long long>(r.feedback_probes),
        static_cast<long long>(r.feedback_written), static_cast<long long>(r.feedback_consumed));
  }
  if (r.stopped_early) std::fprintf(out, "(stopped early by a signal)\n");
  std::fprintf(out, "%-12s %9s %7s %9s %10s %10s %10s %10s %10s %10s\n", "call", "count", "errors",
               "rps", "p50 us", "p90 us", "p99 us", "p99.9 us", "max us", "mean us");
  auto row = [&](const char* name, const CallView& v) {
    const uint64_t n = v.lat.count;
    std::fprintf(out, "%-12s %9llu %7llu %9.1f %10s %10s %10s %10s %10s %10s\n", name,
                 static_cast<unsigned long long>(n), static_cast<unsigned long long>(v.errors),
                 v.rps, Cell(v.lat.p50_us, n).c_str(), Cell(v.lat.p90_us, n).c_str(),
                 Cell(v.lat.p99_us, n).c_str(), Cell(v.lat.p999_us, n).c_str(),
                 Cell(v.lat.max_us, n).c_str(), Cell(v.lat.mean_us, n).c_str());
  };
  row("SelectPages", sel);
  row("Ping", png);
  auto ratio = [&](double a, double b) {
    const double x = Ratio(a, b);
    return std::isfinite(x) ? absl::StrFormat("%.1fx", x) : std::string("-");
  };
  std::fprintf(out, "%-12s %9s %7s %9s %10s %10s %10s %10s %10s %10s\n", "Select/Ping", "", "", "",
               ratio(sel.lat.p50_us, png.lat.p50_us).c_str(),
               ratio(sel.lat.p90_us, png.lat.p90_us).c_str(),
               ratio(sel.lat.p99_us, png.lat.p99_us).c_str(),
               ratio(sel.lat.p999_us, png.lat.p999_us).c_str(),
               ratio(sel.lat.max_us, png.lat.max_us).c_str(),
               ratio(sel.lat.mean_us, png.lat.mean_us).c_str());
  const LatencySummary prepass = r.prepass_us.Summarize();
  const LatencySummary overhead = r.overhead_us.Summarize();
  std::fprintf(
      out,
      "server selection time p50 %s p99 %s; round trip minus selection p50 "
      "%s p99 %s; visited %s of pages; SelectPages over %lld us: %llu",
      UsText(prepass.p50_us, prepass.count).c_str(), UsText(prepass.p99_us, prepass.count).c_str(),
      UsText(overhead.p50_us, overhead.count).c_str(),
      UsText(overhead.p99_us, overhead.count).c_str(),
      r.pages_total > 0 ? absl::StrFormat("%.1f%%", 100.0 * r.pages_visited / r.pages_total).c_str()
                        : "n/a",
      static_cast<long long>(config.slo.count()), static_cast<unsigned long long>(sel.over_slo));
  if (!config.arrivals.closed_loop()) {
    std::fprintf(out, "; send lag p50 %s p99 %s", UsText(sel.lag.p50_us, sel.lag.count).c_str(),
                 UsText(sel.lag.p99_us, sel.lag.count).c_str());
  }
  std::fprintf(out, "\n");
  if (sel.lat.count + sel.errors == 0 && !r.stopped_early) {
    std::fprintf(out, "no SelectPages was measured: none was scheduled in the window (exit 3)\n");
  }
  if (config.ranks > 0) PrintRanks(r, out);
  const std::pair<const char*, CallResults*> calls[] = {{"SelectPages", &r.select},
                                                        {"Ping", &r.ping}};
  for (const auto& [name, c] : calls) {
    if (c->errors() == 0) continue;
    std::vector<std::string> codes;
    for (const auto& [code, n] : c->errors_by_code) codes.push_back(absl::StrCat(code, " ", n));
    std::fprintf(out, "%s errors by code: %s\n", name, absl::StrJoin(codes, ", ").c_str());
  }
  if (r.select.unsent > 0) {
    std::fprintf(
        out,
        "SelectPages unsent: %llu calls of the schedule (the sessions were more than %lld s "
        "behind it when the window ended)\n",
        static_cast<unsigned long long>(r.select.unsent), static_cast<long long>(kDrain.count()));
  }
  const client::ClientCounters& f = r.fallbacks;
  std::fprintf(out,
               "client fallbacks (warm-up included): deadline %llu, unavailable %llu, not attached "
               "%llu, error %llu; re-attaches %llu\n",
               static_cast<unsigned long long>(f.fallback_deadline),
               static_cast<unsigned long long>(f.fallback_unavailable),
               static_cast<unsigned long long>(f.fallback_not_attached),
               static_cast<unsigned long long>(f.fallback_error),
               static_cast<unsigned long long>(f.reattaches));
  if (r.epsd_pid > 0 && !r.epsd_samples.empty()) {
    // First and last samples, named: when a sample failed (epsd died, say), the last one is
    // not the end's, and the note says why.
    const EpsdSample& a = r.epsd_samples.front();
    const EpsdSample& b = r.epsd_samples.back();
    std::fprintf(out,
                 "epsd pid %d: RSS %lld -> %lld kB, open fds %lld -> %lld, threads %lld -> %lld "
                 "(%zu samples, %s at %.1f s to %s at %.1f s)%s\n",
                 r.epsd_pid, static_cast<long long>(a.stats.rss_kb),
                 static_cast<long long>(b.stats.rss_kb), static_cast<long long>(a.stats.open_fds),
                 static_cast<long long>(b.stats.open_fds), static_cast<long long>(a.stats.threads),
                 static_cast<long long>(b.stats.threads), r.epsd_samples.size(), a.why.c_str(),
                 a.t_s, b.why.c_str(), b.t_s,
                 b.why == "end" ? "" : absl::StrCat("; no end sample: ", r.epsd_pid_note).c_str());
  } else {
    std::fprintf(out, "epsd resources not sampled: %s\n", r.epsd_pid_note.c_str());
  }
  if (r.floor.has_value()) PrintFloor(*r.floor, sel, png, out);
}

std::string ToJson(const LoadConfig& config, RunResult& r) {
  const CallView sel = View(config, r, r.select);
  const CallView png = View(config, r, r.ping);
  const LatencySummary prepass = r.prepass_us.Summarize();
  const LatencySummary overhead = r.overhead_us.Summarize();
  const ModelLayout& m = config.model;
  utsname u{};
  uname(&u);
  Json channel_args = Json::object();
  for (const auto& [k, v] : config.channel_args) channel_args[k] = v;
  Json samples = Json::array();
  for (const EpsdSample& s : r.epsd_samples) {
    samples.push_back({{"t_s", Num(s.t_s)},
                       {"why", s.why},
                       {"rss_kb", s.stats.rss_kb},
                       {"open_fds", s.stats.open_fds},
                       {"threads", s.stats.threads}});
  }
  Json errors = Json::array();
  for (const ErrorEvent& e : r.error_log) {
    errors.push_back({{"t_s", Num(e.t_s)},
                      {"session", e.session},
                      {"call", e.call},
                      {"code", e.code},
                      {"message", e.message}});
  }
  const client::ClientCounters& f = r.fallbacks;
  auto us = [](std::chrono::microseconds d) { return d.count(); };
  Json report;
  report["measured_s"] = Num(r.measured_s);
  report["stopped_early"] = r.stopped_early;
  report["select"] = CallJson(sel, r.select);
  report["ping"] = CallJson(png, r.ping);
  report["ratio"] = {{"p50", Num(Ratio(sel.lat.p50_us, png.lat.p50_us))},
                     {"p90", Num(Ratio(sel.lat.p90_us, png.lat.p90_us))},
                     {"p99", Num(Ratio(sel.lat.p99_us, png.lat.p99_us))},
                     {"p999", Num(Ratio(sel.lat.p999_us, png.lat.p999_us))},
                     {"max", Num(Ratio(sel.lat.max_us, png.lat.max_us))},
                     {"mean", Num(Ratio(sel.lat.mean_us, png.lat.mean_us))}};
  report["server"] = {
      {"prepass_p50_us", Num(prepass.p50_us)},   {"prepass_p99_us", Num(prepass.p99_us)},
      {"prepass_max_us", Num(prepass.max_us)},   {"overhead_p50_us", Num(overhead.p50_us)},
      {"overhead_p90_us", Num(overhead.p90_us)}, {"overhead_p99_us", Num(overhead.p99_us)},
      {"pages_visited", r.pages_visited},        {"pages_total", r.pages_total}};
  if (config.feedback_share > 0) {
    const LatencySummary write = r.feedback_write_us.Summarize();
    report["feedback"] = {{"share", config.feedback_share},    {"write_p50_us", Num(write.p50_us)},
                          {"write_p99_us", Num(write.p99_us)}, {"probes", r.feedback_probes},
                          {"written", r.feedback_written},     {"consumed", r.feedback_consumed}};
  }
  if (config.ranks > 0) {
    report["ranks"] = RanksJson(r);
    report["rank_spread"] = SpreadJson(r);
  }
  report["client_fallbacks"] = {{"deadline", f.fallback_deadline},
                                {"unavailable", f.fallback_unavailable},
                                {"not_attached", f.fallback_not_attached},
                                {"error", f.fallback_error},
                                {"reattaches", f.reattaches},
                                {"steps", f.steps},
                                {"selected", f.selected}};
  report["config"] = {{"target", config.target},
                      {"preset", config.preset},
                      {"layers", m.num_layers},
                      {"q_heads", m.num_q_heads},
                      {"kv_heads", m.num_kv_heads},
                      {"head_dim", m.head_dim},
                      {"block_size", m.block_size},
                      {"group_blocks", m.group_blocks},
                      {"coarse_blocks", m.coarse_blocks},
                      {"coarse_candidates", config.coarse_candidates},
                      {"feedback_share", config.feedback_share},
                      {"sketch_dim", m.sketch_dim},
                      {"features",
                       {{"key_sum", m.features.key_sum},
                        {"principal", m.features.principal},
                        {"quest", m.features.quest},
                        {"quest8", m.features.quest8}}},
                      {"batch", config.batch},
                      {"context", config.context.ToString()},
                      {"rate", config.arrivals.ToString()},
                      {"sessions", config.sessions},
                      {"ranks", config.ranks},
                      {"mode", config.stream ? "stream" : "unary"},
                      {"reply", config.reply_async ? "async" : "sync"},
                      {"duration_us", us(config.duration)},
                      {"warmup_us", us(config.warmup)},
                      {"deadline_us", us(config.deadline)},
                      {"slo_us", us(config.slo)},
                      {"ping_every", config.ping_every},
                      {"ping_api", config.ping_sync ? "sync" : "callback"},
                      {"backend", service::BackendKindName(config.backend)},
                      {"channel_args", channel_args},
                      {"seed", config.seed},
                      {"soak", config.soak},
                      {"sample_every_us", us(config.sample_every)},
                      {"epsd_pid", config.epsd_pid},
                      {"floor_calls", config.floor_calls},
                      {"floor_server", config.floor_in_process ? "in-process" : "process"},
                      {"summary_bytes_per_session", r.summary_bytes_per_session},
                      {"prefill_s", Num(r.prefill_s)}};
  report["machine"] = {{"started_utc", r.started_utc},
                       {"cpus", std::thread::hardware_concurrency()},
                       {"cpu_model", CpuModel()},
                       {"kernel", absl::StrCat(u.sysname, " ", u.release, " ", u.machine)},
                       {"loadavg_start", r.load_start},
                       {"loadavg_end", r.load_end}};
  report["epsd"] = {{"pid", r.epsd_pid}, {"note", r.epsd_pid_note}, {"samples", samples}};
  if (r.floor.has_value()) report["rpc_floor"] = FloorJson(*r.floor, sel, png);
  report["errors"] = errors;
  report["errors_dropped"] = r.error_log_dropped;
  // Invalid UTF-8 in an error message is replaced, not thrown on.
  return report.dump(1, ' ', false, Json::error_handler_t::replace) + "\n";
}

}  // namespace eps::load
