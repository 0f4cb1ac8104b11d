// A session: one engine process (per device) attached to epsd, with its
// validated spec and policy, its mapped buffers, its backend and its lease
// (docs/design.md §5-6).
//
// Thread safety: everything but the lease and the counters is immutable once
// Create returns; the backend serialises the session's steps (and keeps their
// order) under its step lock, behind the session's StepGate; the lease and
// counters are atomics. A session stays alive while a call holds its
// shared_ptr, so expiry never unmaps memory under a running step; Retire makes
// a retired session's late calls do nothing.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "core/select.h"
#include "core/step.h"
#include "eps/v1/page_selector.pb.h"
#include "service/backend.h"
#include "service/config.h"
#include "service/descriptor.h"
#include "service/memory_budget.h"
#include "service/peer.h"
#include "service/session_buffers.h"
#include "service/session_spec.h"
#include "service/step_gate.h"
#include "service/unsent_replies.h"

namespace eps::service {

// Builds a session's step backend for its validated spec and resolved buffers; on a
// failure, `*remains` may own device memory it allocated (MakeCudaBackend).
// MakeSessionBackend builds the one the spec names; tests pass their own to reach
// paths that no backend on their machine takes (a lost device, a failed allocation).
using BackendFactory = std::function<absl::StatusOr<std::unique_ptr<StepBackend>>(
    const SessionSpec& spec, const SessionBuffers& buffers, const ServerConfig& config,
    std::unique_ptr<StepBackend>* remains)>;
absl::StatusOr<std::unique_ptr<StepBackend>> MakeSessionBackend(
    const SessionSpec& spec, const SessionBuffers& buffers, const ServerConfig& config,
    std::unique_ptr<StepBackend>* remains);

class Session {
 public:
  // Validates `request` (spec, buffers, policy, in that order), maps its
  // buffers and builds the backend the spec names. Every allocation the
  // request sizes is charged first to the session's budget
  // (config.max_session_bytes), which charges `server.allocated`, and every host_shm
  // object's size to its mapped budget (config.max_session_mapped_bytes), which charges
  // `server.mapped`: RESOURCE_EXHAUSTED naming the limit before anything is allocated
  // or mapped past it.
  // `replacing`: what the live session this Attach replaces holds against the server's
  // budgets; the new session's charges made here may pass them by as much (the old one
  // gives its bytes back once the Attach has handed over), its later ones may not.
  // `caller` decides whose host_shm objects the buffers may name (ShmOwnerFor).
  // When it fails after mapping an engine's CUDA buffers or after the backend allocated
  // device memory, `*remains` (when not null) is the unfinished session holding them,
  // to be destroyed as an ended one is (DefersDestruction, SafeToDestroy) rather than
  // on the Attach's thread.
  static absl::StatusOr<std::unique_ptr<Session>> Create(
      const v1::AttachRequest& request, const ServerConfig& config, ServerBudgets& server,
      const Peer& caller, const BackendFactory& make_backend = MakeSessionBackend,
      std::unique_ptr<Session>* remains = nullptr, const ServerCharges& replacing = {});
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& id() const { return id_; }
  void set_id(std::string id) { id_ = std::move(id); }  // before the session is published
  // Who attached it (service/peer.h); set before the session is published.
  const Peer& owner() const { return owner_; }
  void set_owner(const Peer& owner) { owner_ = owner; }
  // PERMISSION_DENIED unless `caller` may use the session: its owner's user, or
  // root. A session attached over TCP (owner unknown) is reached by its id alone.
  absl::Status CheckCaller(const Peer& caller) const;
  const SessionSpec& spec() const { return spec_; }
  const SelectPolicy& policy() const { return policy_; }  // the defaults; calls may override
  const SessionBuffers& buffers() const { return buffers_; }
  // Runs the session's steps, one at a time under its step_mu().
  StepBackend& backend() const { return *backend_; }
  // Admits the session's steps before they take the step lock: one runs, one waits.
  StepGate& step_gate() const { return gate_; }
  // Its unary replies not yet read by its client (unsent_replies.h), shared with the calls
  // that hold or park one, which may outlive the session; ended by Retire.
  const std::shared_ptr<UnsentReplies>& unsent_replies() const { return unsent_replies_; }
  // Ends the session's unsent replies (UnsentReplies::End: held ones cancelled, parked
  // ones answered without their reply), then its steps under its step lock
  // (StepBackend::Retire): waits for the step running now, finishes queued work, and every
  // later step is refused (a step that ends after the replies did answers without its reply).
  // Called once the session is out of the registry, before the call that removed it
  // answers: after that nothing of the session writes the engine's buffers.
  // `release_now` (epsd's shutdown): a queued async step is released at once.
  // retiring() is true from its first line on, before it waits for the step lock: a
  // parked step, handed to the StepExecutor once the running step lets the lock go,
  // may take the lock before Retire does (absl::Mutex is not FIFO), and must not run.
  // Returns StepBackend::Retire's status: device-lost when ending the queued work found
  // the device lost (the caller reports it; the session has ended all the same).
  absl::Status Retire(bool release_now = false);
  bool retiring() const { return retiring_.load(std::memory_order_acquire); }
  // For the janitor (session_janitor.h): a session whose backend frees device memory,
  // or an unfinished cuda session (Create's remains) that holds CUDA IPC mappings, is
  // destroyed on its thread once that cannot wait for another engine (closing a mapping
  // waits as a free does: measured, docs/design.md §6).
  bool DefersDestruction() const;
  bool SafeToDestroy(std::chrono::steady_clock::duration put_off) const;
  // A device-lost status (core/status.h) naming the device once work abandoned on the
  // session's device (StepBackend::AbandonedWorkSince) has run longer than `limit`: no
  // session on the device can be destroyed until it drains; OK otherwise.
  absl::Status CheckDeviceUsable(std::chrono::steady_clock::duration limit) const;
  // FAILED_PRECONDITION naming the shm object when the engine shrank one of the
  // session's objects under epsd (service/shm_fault_guard.h).
  absl::Status CheckMemoryIntact() const { return mappings_.CheckIntact(); }
  uint64_t charged_bytes() const { return budget_->used(); }
  // What it holds against the server's two budgets.
  ServerCharges server_charges() const {
    return {.allocated = budget_->used(), .mapped = mapped_budget_->used()};
  }

  // Statistics of async steps that a failed call finished (StepOutcome::earlier): a failed
  // call sends no reply, so they wait here for the session's next successful reply. At most
  // kMaxUndelivered are kept, the oldest dropped first; they end with the session.
  static constexpr size_t kMaxUndelivered = 16;
  void KeepUndelivered(std::vector<v1::StepStats> finished)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(backend_->step_mu());
  std::vector<v1::StepStats> TakeUndelivered() ABSL_EXCLUSIVE_LOCKS_REQUIRED(backend_->step_mu());

  std::atomic<int64_t> last_active_ms{0};  // steady clock
  std::atomic<uint64_t> steps{0}, errors{0};
  std::atomic<int64_t> groups_total{0}, groups_visited{0}, bytes_dense{0}, bytes_read{0};
  std::atomic<uint64_t> last_step_seen{0};

  void Touch();
  // A replacing Attach holds its new session's lease while it waits for the old session's
  // step to end (a step may run longer than a lease), and starts it (Touch) once it has
  // handed over: a session granted to an engine is not expired before the engine heard of
  // it. A held lease does not run out.
  void HoldLease() { lease_held_.store(true); }
  void StartLease() {
    Touch();
    lease_held_.store(false);
  }
  // Past its lease, and no step of it running: a step longer than the lease neither loses
  // its session under it nor holds the reaper (which retires the expired sessions one by
  // one, each under its step lock) while other leases run out.
  bool Expired(int64_t now_ms) const;
  // Adds one finished step's statistics to the session's counters.
  void CountStep(const StepStats& stats);

 private:
  Session() = default;

  std::string id_;
  Peer owner_;
  SessionSpec spec_;
  SelectPolicy policy_;
  std::unique_ptr<MemoryBudget> budget_;         // outlives the charges below
  std::unique_ptr<MemoryBudget> mapped_budget_;  // the same
  std::vector<MemoryCharge> charges_;            // the Phi bank, step scratch, device buffers
  MappingCache mappings_;                        // owns the memory buffers_ points into
  SessionBuffers buffers_;
  std::unique_ptr<StepBackend> backend_;         // null only in Create's remains
  std::chrono::milliseconds inputs_timeout_{0};  // --inputs-timeout-ms: SafeToDestroy's "stale"
  mutable StepGate gate_;
  const std::shared_ptr<UnsentReplies> unsent_replies_ = std::make_shared<UnsentReplies>();
  std::vector<v1::StepStats> undelivered_ ABSL_GUARDED_BY(backend_->step_mu());
  std::atomic<bool> retiring_{false};  // Retire was called
  std::atomic<bool> lease_held_{false};
};

int64_t SteadyNowMs();

}  // namespace eps::service
