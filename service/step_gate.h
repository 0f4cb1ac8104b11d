// Admission to one session's steps: one step runs, one more may be parked behind
// it, and any further call is refused at once. A parked step holds no thread: it
// is kept as a function and, once the step before it has ended, handed to a
// StepExecutor (service/step_executor.h) to run there. A step runs inline on a gRPC
// callback thread, so a step that waited on a lock instead would hold one of the
// server's few threads, and an engine with calls queued on its own slow session
// would starve every other engine (docs/api-failures.md, "Steps in flight"); and a
// parked step run on the running step's thread after it would hold back that step's
// reply, which gRPC sends only when the callback returns (docs/design.md). A normal
// engine has at most two calls on a session: the step running and, after a client
// deadline, the next one.
//
// Thread safety: all methods may be called concurrently. Turns of one gate never
// run at the same time, and run in the order admitted.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "service/step_executor.h"

namespace eps::service {

class StepGate {
 public:
  // One step's turn: called once with OK when the step may run, or with the
  // refusal (RESOURCE_EXHAUSTED) when it may not. It must not throw.
  using Turn = absl::AnyInvocable<void(absl::Status admitted) &&>;
  // Whether a parked turn's caller still waits: OK, or why not (its deadline passed,
  // it was cancelled).
  using Liveness = absl::AnyInvocable<absl::Status() const>;
  // Where a turn parked by Run runs once the turn before it has ended, and what keeps
  // the gate alive meanwhile: `owner` (the gate's owner, a Session) is held from the
  // park until the handed-off turn and the gate's work after it are done, however the
  // caller's other references to it go.
  struct Handoff {
    StepExecutor* executor = nullptr;  // not null
    std::shared_ptr<const void> owner;
  };

  // Runs `turn` now when no step runs (on this thread, before returning); parks it
  // when one runs and none is parked, to run on `handoff.executor` once the running
  // turn has ended (the running turn's thread only hands it over, and returns);
  // otherwise calls it at once with RESOURCE_EXHAUSTED, unless the parked turn's caller
  // gave up (`alive` of that turn not OK): that turn is then called with `alive`'s
  // status and this one parked instead, so an engine whose own deadline ran out is not
  // refused its next step. The caller keeps the gate alive until Run returns.
  void Run(uint64_t step, Turn turn, Liveness alive, Handoff handoff);

  // What the gate holds now, for tests: a step running (here or handed off), one parked.
  bool running() const;
  bool parked() const;

 private:
  struct Parked {
    uint64_t step = 0;
    Turn turn;
    Liveness alive;  // may be empty
    Handoff handoff;
  };

  // A turn of this gate has ended (and was let go): hands the parked one, if any, to its
  // executor, else frees the gate.
  void EndTurn();

  mutable absl::Mutex mu_;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t running_step_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<Parked> parked_ ABSL_GUARDED_BY(mu_);
};

}  // namespace eps::service
