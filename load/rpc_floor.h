// The RPC floor: what an empty unary call costs on this machine and transport when
// the server does nothing else, measured in the same run as epsd's Ping so that
// both see the same background load (docs/benchmarks/latency-history.md, "The RPC floor").
//
// The minimal server is the generated PageSelector callback service with only Ping,
// which finishes at once (no health or reflection service, no telemetry, default
// builder options), on the transport of --target (a Unix socket when the target is
// one, loopback TCP otherwise). It runs in a forked child process by default, as epsd
// runs in its own, or in this process (--floor-server=in-process), where it shares
// gRPC's threads with the client. Rounds interleave four calls: floor and epsd, each
// through the callback API (as EpsClient calls) and through the synchronous stub.
//
// A floor is a measurement of working servers: epsd is pinged once first, and the
// first failed call of a round ends the rounds (`aborted` says which and why), so an
// epsd that does not answer costs one --deadline here, not one per call.
#pragma once

#include <atomic>
#include <chrono>
#include <string>

#include "absl/status/statusor.h"
#include "eps/v1/page_selector.grpc.pb.h"
#include "load/latency_summary.h"
#include "load/load_config.h"

namespace eps::load {

struct FloorResult {
  std::string floor_address;                  // where the minimal server listened
  std::string where;                          // "child process" or "in-process"
  LatencySamples floor_callback, floor_sync;  // minimal server
  LatencySamples ping_callback, ping_sync;    // epsd's Ping
  int warmup_rounds = 0;                      // unrecorded rounds asked for before the rounds
  int rounds = 0;                             // measured rounds completed (all four calls OK)
  uint64_t warmup_errors = 0;                 // failed calls in the warm-up rounds
  uint64_t errors = 0;                        // failed calls in the measured rounds
  // Empty when every round ran (or *stop ended them); otherwise why the floor ended early:
  // epsd's first Ping failed, or a call of a round did ("epsd Ping, sync client failed in
  // measured round 12: DEADLINE_EXCEEDED: ...").
  std::string aborted;
  bool stopped = false;  // *stop was set before the rounds ended
};

// config.floor_calls measured rounds after a tenth as many unrecorded ones. With the
// server in a child process, call it before this process uses gRPC (it forks).
// Setting `*stop` (e.g. from a signal handler) ends the rounds before the next call;
// `stopped` then says so and the samples cover the rounds run. An unreachable epsd is
// a result (`aborted`), not an error: errors are set-up failures (fork, pipe, listen).
absl::StatusOr<FloorResult> MeasureFloor(const LoadConfig& config,
                                         const std::atomic<bool>* stop = nullptr);

// A unary Ping through the callback API, waited for on a condition variable as
// EpsClient waits for its unary calls. gRPC enforces the deadline and always runs
// the callback, so the wait cannot hang.
absl::Status CallbackPing(v1::PageSelector::Stub& stub, std::chrono::microseconds deadline);

}  // namespace eps::load
