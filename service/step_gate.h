// Admission to one session's steps: one step runs, one more may be parked behind
// it, and any further call is refused at once. An admitted turn runs on the thread that
// calls Run (a gRPC callback thread, in epsd) only while the executor's bound on such
// turns allows (StepExecutor::TakeInlineTurn); otherwise it is handed to the StepExecutor
// (service/step_executor.h), at once when no step of the session runs, and a parked one
// always, once the step before it has ended. gRPC 1.51's callback API has few callback
// threads (one per two cores, 2 to 16) and processes a call's cancellation only on a free
// one: steps run on all of them held off every other engine's calls and the cancellation
// of the steps themselves (docs/design.md, SelectPages). A call refused at the gate, and a
// parked call replaced because its client gave up, are answered on the caller's thread. A parked
// step holds no thread meanwhile, so an engine with calls queued on its own slow session takes no
// more of the pool than one thread (docs/api-failures.md, "Steps in flight"). A normal engine has
// at most two calls on a session: the step running and, after a client deadline, the next one.
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
  // Where an admitted turn runs, and what keeps the gate alive meanwhile: `owner` (the
  // gate's owner, a Session) is held from Run until the handed-off turn and the gate's
  // work after it are done, however the caller's other references to it go.
  struct Handoff {
    StepExecutor* executor = nullptr;  // not null
    std::shared_ptr<const void> owner;
  };

  // When no step runs: calls `turn` with OK on this thread if `handoff.executor` grants
  // an inline turn (and returns after it), else hands it to the executor and returns; parks it when
  // one runs and none is parked, to be handed over once the running turn has ended (the
  // running turn's thread only hands it over, and returns); otherwise calls it at once,
  // on this thread, with RESOURCE_EXHAUSTED, unless the parked turn's caller gave up
  // (`alive` of that turn not OK): that turn is then called with `alive`'s status and
  // this one parked instead, so an engine whose own deadline ran out is not refused its
  // next step. A handed-off turn is called with OK on the executor; a turn checks its
  // caller's liveness itself (its step lock, not the gate, decides when it runs). The
  // caller keeps the gate alive until Run returns.
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

  // Runs an admitted turn on its executor, then EndTurn() there.
  void HandOff(Turn turn, Handoff handoff);
  // A turn of this gate has ended (and was let go): hands the parked one, if any, to its
  // executor, else frees the gate.
  void EndTurn();

  mutable absl::Mutex mu_;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t running_step_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<Parked> parked_ ABSL_GUARDED_BY(mu_);
};

}  // namespace eps::service
