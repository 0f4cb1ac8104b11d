// eps-load's command line: the model shape, the batch, the arrival process and
// the transport of one load run. Parsing is a pure function (no globals), so
// tests call it directly.
#pragma once

#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/layout.h"
#include "service/backend_kind.h"

namespace eps::load {

// Context length of each batch row, drawn per request: fixed, or uniform in [lo, hi].
struct ContextDistribution {
  int64_t lo = 32768;
  int64_t hi = 32768;
  int64_t max() const { return hi; }
  int64_t Draw(std::mt19937_64& rng) const {
    return lo == hi ? lo : std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  }
  std::string ToString() const;
};

// Arrival process of SelectPages calls, summed over all sessions. rate == 0 is
// a closed loop: each session sends its next call as soon as the last one ended.
struct Arrivals {
  double rate = 0;       // SelectPages per second over all sessions
  bool poisson = false;  // exponential gaps (a Poisson process) instead of fixed ones
  bool closed_loop() const { return rate <= 0; }
  std::string ToString() const;
};

struct LoadConfig {
  std::string target = "unix:///tmp/epsd.sock";
  std::string preset = "llama-3-8b";
  ModelLayout model;  // the preset, then the custom shape flags (coarse_blocks included)
  // SelectOptions.coarse_candidates at Attach, with a coarse level; 0: epsd's default.
  float coarse_candidates = 0;
  // Selection feedback (docs/api-memory.md): 0, no feedback buffer; in (0, 1], each session
  // shares one and eps-load writes this share of every stepped row's groups before each
  // step, as an engine's attention would (load_run.h).
  double feedback_share = 0;
  int batch = 8;
  ContextDistribution context;
  std::chrono::microseconds duration{std::chrono::seconds(10)};
  std::chrono::microseconds warmup{std::chrono::seconds(1)};
  Arrivals arrivals;
  int sessions = 1;
  // > 0: that many tensor-parallel ranks, one session each, stepped in lockstep: every
  // step number goes to all ranks at once (closed loop, no Ping), and the report adds
  // per-rank latency and the spread between ranks at the same step (load_run.h).
  int ranks = 0;
  bool stream = true;  // the stream: 40-340 µs less per call than unary here (latency-history.md)
  // REPLY_MODE_ASYNC (--backend=cuda): epsd replies once the step is queued; each
  // step signals inputs_ready before the call and waits for selection_done after it,
  // outside the measured call, as an engine's stream would.
  bool reply_async = false;
  // The client's per-call deadline: long, so that a slow step is measured, not cut off.
  std::chrono::microseconds deadline{std::chrono::seconds(10)};
  std::chrono::microseconds slo{2000};  // a call slower than this is counted as over_slo
  int ping_every = 1;                   // one Ping per this many SelectPages; 0 = no Ping
  int floor_calls = 1000;         // rounds of the RPC floor measurement before the run; 0 = none
  bool floor_in_process = false;  // the floor's minimal server in this process, not a child
  bool ping_sync = false;         // Ping through the synchronous stub instead of the callback API
  service::BackendKind backend = service::BackendKind::kCpu;  // kCpu or kCuda
  std::vector<std::pair<std::string, int>> channel_args;
  std::string json_path;
  uint64_t seed = 1;
  // Soak mode: samples epsd's RSS and open fds every sample_every and at every
  // error, and prints every error as it happens.
  bool soak = false;
  std::chrono::microseconds sample_every{std::chrono::seconds(60)};
  int epsd_pid = 0;  // 0: the process listening on the target's socket, when found
  bool help = false;
  bool version = false;
};

// The shapes eps-load knows: llama-3-8b, qwen2.5-7b, smollm2-135m, and one
// tensor-parallel rank of Llama-3-70B: llama-3-70b-tp2, -tp4, -tp8 (64 query and
// 8 KV heads over 2, 4 or 8 ranks).
absl::StatusOr<ModelLayout> PresetModel(const std::string& name);
const std::vector<std::string>& PresetNames();

// "32768", "32k", "uniform:1024-32768" (k = 1024).
absl::StatusOr<ContextDistribution> ParseContext(const std::string& text);
// "0" (closed loop), "200" (fixed gaps), "poisson:200".
absl::StatusOr<Arrivals> ParseRate(const std::string& text);

// The flag forms of the two above (--context, --rate).
bool AbslParseFlag(absl::string_view text, ContextDistribution* out, std::string* error);
std::string AbslUnparseFlag(const ContextDistribution& d);
bool AbslParseFlag(absl::string_view text, Arrivals* out, std::string* error);
std::string AbslUnparseFlag(const Arrivals& a);

// Parses a command line (args exclude argv[0]) through eps-load's abseil flags
// (load/flags.cc); unknown flags and bad values are errors naming the flag. Each call
// starts from the defaults (not thread-safe).
absl::StatusOr<LoadConfig> ParseFlags(const std::vector<std::string>& args);
std::string Usage();

}  // namespace eps::load
