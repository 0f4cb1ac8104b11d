// eps-load: a load generator and latency benchmark for epsd. It plays N
// engines against one epsd and reports SelectPages latency next to an empty
// Ping on the same channel (docs/benchmarks/latency.md has results and usage).
//
// Exit status: 0 when every measured call succeeded, 3 when some failed or were never
// sent, when the RPC floor ended on a failed call, or when the window measured no
// SelectPages at all (the report says which), 2 for bad flags, 1 when the run could not
// be set up.
#include <atomic>
#include <csignal>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "cli/flags.h"
#include "load/load_config.h"
#include "load/load_run.h"
#include "load/report.h"
#include "load/report_file.h"
#include "load/rpc_floor.h"

namespace {

std::atomic<bool> stop_requested{false};  // lock-free, so safe to set from a signal handler

extern "C" void RequestStop(int) { stop_requested.store(true); }

}  // namespace

int main(int argc, char** argv) {
  auto config = eps::load::ParseFlags(std::vector<std::string>(argv + 1, argv + argc));
  if (!config.ok()) {
    std::fprintf(stderr, "eps-load: %s (eps-load --help lists the flags)\n",
                 std::string(config.status().message()).c_str());
    return 2;
  }
  if (config->help) {
    std::fputs(eps::load::Usage().c_str(), stdout);
    return 0;
  }
  if (config->version) {
    std::printf("%s\n", eps::cli::VersionLine("eps-load").c_str());
    return 0;
  }
  // SIGINT / SIGTERM / SIGHUP end the run early with a report, and EngineBuffers'
  // destructors remove the shared-memory objects (a killed run would leave them). Set
  // before the report's temporary exists, so that no handled signal leaves it behind.
  struct sigaction action {};
  action.sa_handler = RequestStop;
  action.sa_flags = SA_RESTART;  // the run polls the flag; no system call should fail for it
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGHUP, &action, nullptr);  // a closed terminal: the report, and no temporary left
  // The report's temporary is created now: a path that cannot be written is a bad command
  // line, found before the run rather than after it. The report itself is replaced only
  // when the run ends with one, so a failed or interrupted run leaves an earlier report.
  std::optional<eps::load::ReportFile> json;
  if (!config->json_path.empty()) {
    auto opened = eps::load::ReportFile::Open(config->json_path);
    if (!opened.ok()) {
      std::fprintf(stderr, "eps-load: --json=%s: cannot create it: %s\n", config->json_path.c_str(),
                   std::string(opened.status().message()).c_str());
      return 2;
    }
    json.emplace(*std::move(opened));
  }
  std::optional<eps::load::FloorResult> floor;
  if (config->floor_calls > 0) {
    std::fprintf(stderr, "eps-load: measuring the RPC floor (%d rounds)\n", config->floor_calls);
    auto measured = eps::load::MeasureFloor(*config, &stop_requested);
    if (!measured.ok()) {
      std::fprintf(stderr, "eps-load: %s\n", measured.status().ToString().c_str());
      return 1;
    }
    // No load has run yet: there is nothing to report (docs/cli.md, exit codes).
    if (measured->stopped) {
      std::fprintf(stderr, "eps-load: stopped by a signal while measuring the RPC floor\n");
      return 1;
    }
    // An epsd that fails the floor's calls is reported, and the run goes on to count its
    // failures as calls, as after a failed Attach (exit 3).
    if (!measured->aborted.empty()) {
      std::fprintf(stderr, "eps-load: the RPC floor ended early: %s\n", measured->aborted.c_str());
    }
    floor = *std::move(measured);
  }
  auto result = eps::load::RunLoad(*config, &stop_requested);
  if (!result.ok()) {
    std::fprintf(stderr, "eps-load: %s\n", result.status().ToString().c_str());
    return 1;
  }
  result->floor = std::move(floor);
  eps::load::PrintTable(*config, *result, stdout);
  if (json.has_value()) {
    if (auto written = json->Commit(eps::load::ToJson(*config, *result)); !written.ok()) {
      std::fprintf(stderr, "eps-load: --json=%s: %s\n", config->json_path.c_str(),
                   std::string(written.message()).c_str());
      return 1;
    }
  }
  const bool failed = result->select.errors() + result->ping.errors() + result->select.unsent > 0;
  // A window too short for any call measured nothing: not a success. (A run stopped by a
  // signal ends as asked, with what it measured: 0.)
  const bool nothing_measured =
      !result->stopped_early && result->select.latency.size() + result->select.errors() == 0;
  const bool floor_failed = result->floor.has_value() && !result->floor->aborted.empty();
  return failed || nothing_measured || floor_failed ? 3 : 0;
}
