// eps-load's reports: a table for people and a JSON document for scripts.
//
// JSON top level: "measured_s", "stopped_early", "select" and "ping" (p50_us, p90_us, p99_us,
// p999_us, max_us, min_us, mean_us, stddev_us, count, errors, errors_by_code, rps, over_slo,
// send_lag_p50_us, send_lag_p99_us), "ratio" (SelectPages/Ping per
// percentile), "server" (selection time and round trip minus selection
// percentiles, visited fraction),
// with --ranks, "ranks" (per rank: rank, device, count, p50_us, p90_us, p99_us, max_us,
// prepass_p50_us) and "rank_spread" (steps, p50_us, p90_us, p99_us, max_us: per step, the last
// rank's reply time minus the first's), "client_fallbacks", "config", "machine", "epsd" (pid,
// samples) and "errors".
#pragma once

#include <cstdio>
#include <string>

#include "load/load_config.h"
#include "load/load_run.h"

namespace eps::load {

void PrintTable(const LoadConfig& config, RunResult& result, std::FILE* out);
std::string ToJson(const LoadConfig& config, RunResult& result);

}  // namespace eps::load
