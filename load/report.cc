#include "load/report.h"

#include <sys/utsname.h>

#include <cmath>
#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace eps::load {
namespace {

std::string Quote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string Num(double v) { return std::isfinite(v) ? absl::StrFormat("%.3f", v) : "null"; }

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

// A latency for the table: "-" when there is none.
std::string Cell(double us, uint64_t count) {
  return count == 0 ? "-" : absl::StrFormat("%.1f", us);
}

std::string CallJson(CallView v, const CallResults& c) {
  if (v.lat.count == 0) {  // no latency to report: null, not a misleading 0
    const double none = std::nan("");
    v.lat.min_us = v.lat.p50_us = v.lat.p90_us = v.lat.p99_us = v.lat.p999_us = v.lat.max_us =
        v.lat.mean_us = v.lat.stddev_us = none;
  }
  if (v.lag.count == 0) v.lag.p50_us = v.lag.p99_us = v.lag.max_us = std::nan("");
  std::vector<std::string> codes;
  for (const auto& [code, n] : c.errors_by_code)
    codes.push_back(absl::StrCat(Quote(code), ": ", n));
  return absl::StrCat(
      "{\"p50_us\": ", Num(v.lat.p50_us), ", \"p90_us\": ", Num(v.lat.p90_us),
      ", \"p99_us\": ", Num(v.lat.p99_us), ", \"p999_us\": ", Num(v.lat.p999_us),
      ", \"max_us\": ", Num(v.lat.max_us), ", \"min_us\": ", Num(v.lat.min_us),
      ", \"mean_us\": ", Num(v.lat.mean_us), ", \"stddev_us\": ", Num(v.lat.stddev_us),
      ", \"count\": ", v.lat.count, ", \"errors\": ", v.errors, ", \"errors_by_code\": {",
      absl::StrJoin(codes, ", "), "}, \"unsent\": ", c.unsent, ", \"rps\": ", Num(v.rps),
      ", \"over_slo\": ", v.over_slo, ", \"send_lag_p50_us\": ", Num(v.lag.p50_us),
      ", \"send_lag_p99_us\": ", Num(v.lag.p99_us), ", \"send_lag_max_us\": ", Num(v.lag.max_us),
      "}");
}

std::string ModeName(const LoadConfig& c) { return c.stream ? "stream" : "unary"; }

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
  std::fprintf(out,
               "server selection time p50 %.1f us p99 %.1f us; round trip minus selection p50 "
               "%.1f us p99 %.1f us; visited %.1f%% of pages; SelectPages over %lld us: %llu",
               prepass.p50_us, prepass.p99_us, overhead.p50_us, overhead.p99_us,
               r.pages_total > 0 ? 100.0 * r.pages_visited / r.pages_total : 0.0,
               static_cast<long long>(config.slo.count()),
               static_cast<unsigned long long>(sel.over_slo));
  if (!config.arrivals.closed_loop()) {
    std::fprintf(out, "; send lag p50 %.1f us p99 %.1f us", sel.lag.p50_us, sel.lag.p99_us);
  }
  std::fprintf(out, "\n");
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
    const EpsdSample& a = r.epsd_samples.front();
    const EpsdSample& b = r.epsd_samples.back();
    std::fprintf(out,
                 "epsd pid %d: RSS %lld -> %lld kB, open fds %lld -> %lld, threads %lld -> %lld "
                 "(%zu samples)\n",
                 r.epsd_pid, static_cast<long long>(a.stats.rss_kb),
                 static_cast<long long>(b.stats.rss_kb), static_cast<long long>(a.stats.open_fds),
                 static_cast<long long>(b.stats.open_fds), static_cast<long long>(a.stats.threads),
                 static_cast<long long>(b.stats.threads), r.epsd_samples.size());
  } else {
    std::fprintf(out, "epsd resources not sampled: %s\n", r.epsd_pid_note.c_str());
  }
}

std::string ToJson(const LoadConfig& config, RunResult& r) {
  const CallView sel = View(config, r, r.select);
  const CallView png = View(config, r, r.ping);
  const LatencySummary prepass = r.prepass_us.Summarize();
  const LatencySummary overhead = r.overhead_us.Summarize();
  const ModelLayout& m = config.model;
  utsname u{};
  uname(&u);
  std::vector<std::string> args;
  for (const auto& [k, v] : config.channel_args) args.push_back(absl::StrCat(Quote(k), ": ", v));
  std::vector<std::string> samples;
  for (const EpsdSample& s : r.epsd_samples) {
    samples.push_back(absl::StrCat(
        "{\"t_s\": ", Num(s.t_s), ", \"why\": ", Quote(s.why), ", \"rss_kb\": ", s.stats.rss_kb,
        ", \"open_fds\": ", s.stats.open_fds, ", \"threads\": ", s.stats.threads, "}"));
  }
  std::vector<std::string> errors;
  for (const ErrorEvent& e : r.error_log) {
    errors.push_back(absl::StrCat("{\"t_s\": ", Num(e.t_s), ", \"session\": ", e.session,
                                  ", \"call\": ", Quote(e.call), ", \"code\": ", Quote(e.code),
                                  ", \"message\": ", Quote(e.message), "}"));
  }
  const client::ClientCounters& f = r.fallbacks;
  auto us = [](std::chrono::microseconds d) { return d.count(); };
  return absl::StrCat(
      "{\n\"measured_s\": ", Num(r.measured_s),
      ", \"stopped_early\": ", r.stopped_early ? "true" : "false",
      ",\n\"select\": ", CallJson(sel, r.select), ",\n\"ping\": ", CallJson(png, r.ping),
      ",\n\"ratio\": {\"p50\": ", Num(Ratio(sel.lat.p50_us, png.lat.p50_us)),
      ", \"p90\": ", Num(Ratio(sel.lat.p90_us, png.lat.p90_us)),
      ", \"p99\": ", Num(Ratio(sel.lat.p99_us, png.lat.p99_us)),
      ", \"p999\": ", Num(Ratio(sel.lat.p999_us, png.lat.p999_us)),
      ", \"max\": ", Num(Ratio(sel.lat.max_us, png.lat.max_us)),
      ", \"mean\": ", Num(Ratio(sel.lat.mean_us, png.lat.mean_us)), "},\n",
      "\"server\": {\"prepass_p50_us\": ", Num(prepass.p50_us),
      ", \"prepass_p99_us\": ", Num(prepass.p99_us), ", \"prepass_max_us\": ", Num(prepass.max_us),
      ", \"overhead_p50_us\": ", Num(overhead.p50_us),
      ", \"overhead_p90_us\": ", Num(overhead.p90_us),
      ", \"overhead_p99_us\": ", Num(overhead.p99_us), ", \"pages_visited\": ", r.pages_visited,
      ", \"pages_total\": ", r.pages_total, "},\n",
      "\"client_fallbacks\": {\"deadline\": ", f.fallback_deadline,
      ", \"unavailable\": ", f.fallback_unavailable,
      ", \"not_attached\": ", f.fallback_not_attached, ", \"error\": ", f.fallback_error,
      ", \"reattaches\": ", f.reattaches, ", \"steps\": ", f.steps, ", \"selected\": ", f.selected,
      "},\n", "\"config\": {\"target\": ", Quote(config.target),
      ", \"preset\": ", Quote(config.preset), ", \"layers\": ", m.num_layers,
      ", \"q_heads\": ", m.num_q_heads, ", \"kv_heads\": ", m.num_kv_heads,
      ", \"head_dim\": ", m.head_dim, ", \"block_size\": ", m.block_size,
      ", \"group_blocks\": ", m.group_blocks, ", \"sketch_dim\": ", m.sketch_dim,
      ", \"batch\": ", config.batch, ", \"context\": ", Quote(config.context.ToString()),
      ", \"rate\": ", Quote(config.arrivals.ToString()), ", \"sessions\": ", config.sessions,
      ", \"mode\": ", Quote(ModeName(config)), ", \"duration_us\": ", us(config.duration),
      ", \"warmup_us\": ", us(config.warmup), ", \"deadline_us\": ", us(config.deadline),
      ", \"slo_us\": ", us(config.slo), ", \"ping_every\": ", config.ping_every,
      ", \"ping_api\": ", Quote(config.ping_sync ? "sync" : "callback"),
      ", \"backend\": ", Quote(service::BackendKindName(config.backend)),
      ", \"channel_args\": {", absl::StrJoin(args, ", "), "}, \"seed\": ", config.seed,
      ", \"soak\": ", config.soak ? "true" : "false",
      ", \"summary_bytes_per_session\": ", r.summary_bytes_per_session,
      ", \"prefill_s\": ", Num(r.prefill_s), "},\n",
      "\"machine\": {\"started_utc\": ", Quote(r.started_utc),
      ", \"cpus\": ", std::thread::hardware_concurrency(), ", \"cpu_model\": ", Quote(CpuModel()),
      ", \"kernel\": ", Quote(absl::StrCat(u.sysname, " ", u.release, " ", u.machine)),
      ", \"loadavg_start\": ", Quote(r.load_start), ", \"loadavg_end\": ", Quote(r.load_end),
      "},\n", "\"epsd\": {\"pid\": ", r.epsd_pid, ", \"note\": ", Quote(r.epsd_pid_note),
      ", \"samples\": [", absl::StrJoin(samples, ", "), "]},\n", "\"errors\": [",
      absl::StrJoin(errors, ",\n  "), "], \"errors_dropped\": ", r.error_log_dropped, "\n}\n");
}

}  // namespace eps::load
