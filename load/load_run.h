// One load run: N simulated engines (sessions), each with its own buffers,
// EpsClient and channel, sending SelectPages (and interleaved Pings) on a
// closed loop or on an open-loop schedule.
//
// Open loop: every call has a scheduled send time drawn from the arrival
// process, and a SelectPages's latency runs from that time, not from when the session got
// round to sending it, so a slow reply that delays later calls shows up in
// their latency too (no coordinated omission). Closed loop: the scheduled time
// is the send time.
//
// Ping: each session sends one empty Ping per `ping_every` SelectPages on the
// same channel, scheduled halfway between two SelectPages (closed loop: right
// after one), so both see the same server, machine load and connection. Ping is
// the floor a SelectPages is compared with, so its latency runs from its actual
// send even in open loop: a session behind on its SelectPages reaches a Ping's slot
// late, and that wait (the Ping's send_lag) is the SelectPages backlog, not Ping.
//
// Async replies (--reply=async): inputs_ready is signalled before the step's time is
// taken (closed loop: before it; a rank: before the barrier), so the signal stays
// outside the measured call, as selection_done's wait after it does.
//
// Ranks (--ranks=N): N sessions play the tensor-parallel ranks of one engine, rank r's
// buffers on device r mod the devices eps-load sees. They step in lockstep: a barrier
// releases step k to every rank at once (a closed loop, no Ping), and the run records each
// rank's latency and, per step, the spread between the first and the last rank's reply:
// what an engine step, which needs every rank's lists, waits for beyond the fastest rank.
//
// Selection feedback (--feedback-share=F): each session shares a feedback buffer, and
// before every step (before a rank arrives at the barrier, before a closed loop takes
// the step's time, ahead of an open loop's schedule) it writes the workload's feedback
// image for the step's rows within their contexts, as an engine's attention would have
// after the previous step; so the write is outside the measured call, while epsd's
// reading and consuming of the buffer is inside it. One entry per step (row k mod batch,
// last layer and q head, the first fed group within the context) is read back before and
// after the call: `feedback_written` counts the measured steps where the write had landed,
// `feedback_consumed` those where epsd had set the entry back to NaN.
//
// Transport: SelectPages goes through client::EpsClient (the engine's real
// path: callback-API unary or the bidirectional stream, deadline, fail-open
// bookkeeping); its deadline defaults to 10 s so that the latency tail is
// measured rather than cut at the engine's 2 ms (--slo counts the calls an
// engine with that deadline would have lost). Ping is a unary callback-API
// call on the client's stub, waited for the same way as EpsClient's unary
// calls, so the ratio compares like with like (--ping-api=sync uses the
// synchronous stub instead, to measure what the callback hop costs).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/cpp/eps_client.h"
#include "load/latency_summary.h"
#include "load/load_config.h"
#include "load/process_stats.h"
#include "load/rpc_floor.h"

namespace eps::load {

struct CallResults {
  LatencySamples latency;   // calls scheduled in the measured window that succeeded
  LatencySamples send_lag;  // actual send time - scheduled time (open loop)
  std::map<std::string, uint64_t> errors_by_code;
  // Open loop: calls scheduled in the window but never sent, because the
  // session was still more than kDrain behind its schedule when the window ended.
  uint64_t unsent = 0;
  uint64_t errors() const;
  void Merge(const CallResults& other);
};

// How long an open-loop session may go on sending calls scheduled before the
// end of the window, once the window is over.
inline constexpr std::chrono::seconds kDrain{5};

struct EpsdSample {
  double t_s = 0;   // seconds since the run started
  std::string why;  // "start", "periodic", "end", "error"
  ProcessStats stats;
};

struct ErrorEvent {
  double t_s = 0;
  int session = 0;
  std::string call;  // "SelectPages" or "Ping"
  std::string code;
  std::string message;
};

// One rank of a --ranks run.
struct RankResult {
  int device = 0;
  LatencySamples latency;  // its measured SelectPages calls
  LatencySamples prepass_us;
};

struct RunResult {
  CallResults select, ping;
  LatencySamples prepass_us;  // the server's selection time of each measured SelectPages
  // Per SelectPages: the client's round trip (from its send) minus the server's
  // selection time: transport, (de)serialisation, gRPC threads and validation.
  LatencySamples overhead_us;
  int64_t pages_visited = 0, pages_total = 0;
  client::ClientCounters fallbacks;  // summed over sessions, warm-up included
  double measured_s = 0;             // the measured window (shorter when stopped early)
  bool stopped_early = false;
  std::string started_utc;
  pid_t epsd_pid = 0;
  std::string epsd_pid_note;  // how it was found, or why not
  std::vector<EpsdSample> epsd_samples;
  std::vector<ErrorEvent> error_log;  // the first kMaxErrorLog errors
  uint64_t error_log_dropped = 0;
  std::vector<RankResult> ranks;  // --ranks only
  // Per step that every rank measured: its last rank's reply time minus its first's.
  LatencySamples rank_spread_us;
  double prefill_s = 0;
  int64_t summary_bytes_per_session = 0;
  std::string load_start, load_end;  // /proc/loadavg at start and end
  std::optional<FloorResult> floor;  // the RPC floor, measured before the run (--floor-calls)
  // --feedback-share (file comment): each measured step's write time, and its probe.
  LatencySamples feedback_write_us;
  int64_t feedback_probes = 0, feedback_written = 0, feedback_consumed = 0;
  static constexpr size_t kMaxErrorLog = 1000;
};

// Builds every session's buffers, attaches and runs the load. Errors only for
// setup failures (bad backend, shared memory); call failures are results.
// Setting `*stop` (e.g. from a signal handler) ends the run early: each session
// stops before its next call (a call in flight ends with its reply or its deadline),
// detaches, and the report covers the window run so far.
absl::StatusOr<RunResult> RunLoad(const LoadConfig& config,
                                  const std::atomic<bool>* stop = nullptr);

}  // namespace eps::load
