#include "service/session_service.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "core/status.h"
#include "service/convert.h"
#include "service/telemetry/telemetry.h"

namespace eps::service {
namespace {

// A session id a caller named that is not attached. The message names it by its label
// (bounded, and without the capability part): the id is the caller's bytes, up to
// --max-message-bytes, and the message goes on into traces and the step log (60 calls with
// an 8 MB id once grew epsd from 18 MB to 1.39 GB, and one such span made a whole batch
// too large for a collector to accept).
absl::Status NotFound(const std::string& id, const char* hint) {
  return absl::NotFoundError(
      absl::StrCat("session '", telemetry::SessionLabel(id), "' not found", hint));
}

HostVisitLists VisitListsOf(const SessionSpec& spec, const SessionBuffers& buffers) {
  return {.blocks = buffers.data<const int32_t>(SharedBuffer::kVisitBlocks),
          .counts = buffers.data<const int32_t>(SharedBuffer::kVisitCount),
          .num_layers = spec.model.num_layers,
          .max_batch = spec.max_batch,
          .lists = spec.output_granularity == Granularity::kPerKvHead ? spec.model.num_kv_heads : 1,
          .max_blocks = buffers.max_blocks,
          .block_size = spec.model.block_size};
}

}  // namespace

absl::Status CallLiveness::Check(const char* what) const {
  if (cancelled && cancelled()) {
    return absl::CancelledError(absl::StrCat(what, ": the client cancelled the call; not run"));
  }
  if (absl::Now() > deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat(what, ": the call's deadline passed before it could run; not run"));
  }
  return absl::OkStatus();
}

SessionService::SessionService(const ServerConfig& config, DeviceLostHandler on_device_lost,
                               BackendFactory make_backend, StepExecutor* executor)
    : config_(config),
      own_executor_(executor == nullptr ? StepExecutor::ForSessions(config.max_sessions) : nullptr),
      executor_(executor == nullptr ? own_executor_.get() : executor),
      budgets_{.allocated = MemoryBudget("--max-server-bytes", config.max_server_bytes),
               .mapped = MemoryBudget("--max-server-mapped-bytes", config.max_server_mapped_bytes)},
      on_device_lost_(std::move(on_device_lost)),
      janitor_(AbandonedStreamLimit(config_),
               [this](const absl::Status& unusable) { (void)WatchDevice(unusable); }),
      make_backend_(std::move(make_backend)) {
  reaper_ = std::thread([this] {
    const auto period = absl::Milliseconds(std::max<uint32_t>(10, config_.lease_ms / 10));
    while (!stop_.WaitForNotificationWithTimeout(period)) ExpireSessions();
  });
}

SessionService::~SessionService() {
  // The steps still queued run (or answer their dead calls) while every session is live.
  if (own_executor_ != nullptr) own_executor_->Stop();
  stop_.Notify();
  reaper_.join();
  // No call runs any more (the server has shut down). Every queued async step is
  // released before any session is destroyed: a session freed first would wait for
  // another's queued wait on its engine (session_janitor.h), which only that
  // session's end would release.
  // A lost device found now changes nothing: the process is ending.
  for (const std::shared_ptr<Session>& session : sessions_.All()) (void)session->Retire(true);
}

absl::Status SessionService::CountFailure(absl::Status status) {
  if (!status.ok()) validation_failures_.fetch_add(1, std::memory_order_relaxed);
  return status;
}

absl::Status SessionService::Restarting() {
  return absl::UnavailableError(
      "epsd lost a CUDA device and is restarting; attach to the new epsd");
}

absl::Status SessionService::WatchDevice(absl::Status status) {
  if (IsDeviceLost(status) && !device_lost_.exchange(true)) {
    std::fprintf(stderr,
                 "epsd: a CUDA device is lost to this process (%s); no call can use it until "
                 "epsd restarts\n",
                 std::string(status.message()).c_str());
    if (on_device_lost_) on_device_lost_(status);
  }
  return status;
}

void SessionService::ExpireSessions() {
  for (const auto& session : sessions_.TakeExpired(SteadyNowMs())) {
    expired_total_.fetch_add(1);
    // A step still running finishes first; none runs after. The last shared_ptr
    // released (here, or by a call still running) unmaps its memory.
    (void)WatchDevice(session->Retire());
  }
}

absl::StatusOr<std::shared_ptr<Session>> SessionService::FindFor(const std::string& id,
                                                                 const Peer& caller,
                                                                 const char* hint) const {
  std::shared_ptr<Session> session = sessions_.Find(id);
  if (session == nullptr) return NotFound(id, hint);
  RETURN_IF_ERROR(session->CheckCaller(caller));
  return session;
}

namespace {

// Runs `start` (a Start* call) with a `done` that keeps its status, and waits for it.
template <typename Start>
absl::Status Await(Start&& start) {
  absl::Notification finished;
  absl::Status result;
  start([&](absl::Status status) {
    result = std::move(status);
    finished.Notify();
  });
  finished.WaitForNotification();
  return result;
}

}  // namespace

absl::Status SessionService::Attach(const v1::AttachRequest& request, v1::AttachResponse* response,
                                    const Peer& caller) {
  return Await([&](CallDone done) { StartAttach(request, response, {}, caller, std::move(done)); });
}

absl::Status SessionService::Detach(const v1::DetachRequest& request, const Peer& caller) {
  return Await([&](CallDone done) { StartDetach(request, caller, std::move(done)); });
}

void SessionService::StartDetach(const v1::DetachRequest& request, const Peer& caller,
                                 CallDone done) {
  std::shared_ptr<Session> session;
  bool removed = false;
  absl::Status found = Guarded("Detach", [&]() -> absl::Status {
    absl::StatusOr<std::shared_ptr<Session>> found_session =
        FindFor(request.session_id(), caller, "");
    if (!found_session.ok()) return CountFailure(found_session.status());
    session = *std::move(found_session);
    removed = sessions_.Remove(request.session_id()) != nullptr;
    return absl::OkStatus();
  });
  if (!found.ok()) {
    std::move(done)(std::move(found));
    return;
  }
  // Either Detach of two at once answers only once the session's steps have ended: the
  // wait runs on the executor, not on this thread (a gRPC callback thread).
  executor_->Submit(
      [this, session = std::move(session), removed, done = std::move(done)]() mutable {
        absl::Status detached = Guarded("Detach", [&] {
          // Its queued step may find the device lost: reported, though the Detach succeeded.
          (void)WatchDevice(session->Retire());
          return removed ? absl::OkStatus() : CountFailure(NotFound(session->id(), ""));
        });
        session = nullptr;  // its memory goes once no call uses it, before the reply
        std::move(done)(std::move(detached));
      });
}

absl::Status SessionService::SelectPages(const v1::SelectPagesRequest& request,
                                         v1::SelectPagesResponse* response, BackendKind* backend,
                                         const CallLiveness& liveness, const Peer& caller) {
  absl::Notification finished;
  absl::Status result;
  StartSelectPages(request, response, liveness, caller,
                   [&](absl::Status status, BackendKind kind, std::shared_ptr<UnsentReplies>) {
                     result = std::move(status);
                     if (backend != nullptr) *backend = kind;
                     finished.Notify();
                   });
  finished.WaitForNotification();
  return result;
}

void SessionService::StartSelectPages(const v1::SelectPagesRequest& request,
                                      v1::SelectPagesResponse* response, CallLiveness liveness,
                                      const Peer& caller, SelectDone done) {
  BackendKind kind = BackendKind::kCpu;
  std::shared_ptr<Session> session;
  std::vector<StepRow> rows;
  absl::StatusOr<SelectPolicy> policy;
  // Everything up to the step gate, on the caller's thread.
  absl::Status checked = Guarded("SelectPages", [&]() -> absl::Status {
    RETURN_IF_ERROR(liveness.Check("SelectPages"));
    ASSIGN_OR_RETURN(session, CheckSelect(request, caller, &kind));
    policy = MergeOptions(session->policy(), request.options());
    RETURN_IF_ERROR(CountFailure(policy.status()));
    // Before the step order and the writes (api-failures.md §4): a refused call's writes
    // stay unapplied. Without options the policy is the session's, validated at Attach.
    if (request.has_options()) {
      RETURN_IF_ERROR(CountFailure(policy->Validate(session->spec().model)));
    }
    if (policy->granularity != session->spec().output_granularity) {
      return CountFailure(absl::InvalidArgumentError(
          absl::StrCat("options.granularity=", GranularityName(policy->granularity),
                       " does not match the session's output buffers (",
                       GranularityName(session->spec().output_granularity), ")")));
    }
    rows = RowsFromProto(request.rows());
    return absl::OkStatus();
  });
  if (!checked.ok()) {
    std::move(done)(std::move(checked), kind, nullptr);
    return;
  }
  // One step of a session runs and one more is parked, holding no thread; the running
  // one on this thread within the executor's inline bound, else on the executor, the
  // parked one on the executor (step_gate.h).
  Session& gated = *session;  // kept alive by `session` until Run returns
  const CallLiveness step_alive = liveness;
  // A step holds its session until it has run on the executor.
  StepGate::Handoff handoff{.executor = executor_, .owner = session};
  gated.step_gate().Run(
      request.step(),
      [this, &request, response, kind, held = session, step_liveness = std::move(liveness),
       step_rows = std::move(rows), step_policy = *std::move(policy),
       step_done = std::move(done)](absl::Status admitted) mutable {
        if (absl::IsDeadlineExceeded(admitted) || absl::IsCancelled(admitted)) {
          // Parked, and its client gave up meanwhile: not run, as in RunStep.
        } else if (!admitted.ok()) {
          // Refused before the step lock: a failed call, not a failed step of the session
          // (SessionStats.errors counts those).
          admitted = CountFailure(absl::Status(
              admitted.code(),
              absl::StrCat("SelectPages: session '", telemetry::SessionLabel(held->id()),
                           "' of engine '", held->spec().engine_id, "': ", admitted.message())));
        } else {
          admitted = Guarded("SelectPages", [&] {
            return RunStep(*held, request, step_rows, step_policy, step_liveness, response);
          });
        }
        std::move(step_done)(std::move(admitted), kind, held->unsent_replies());
      },
      [alive = step_alive] { return alive.Check("SelectPages"); }, std::move(handoff));
}

absl::StatusOr<std::shared_ptr<Session>> SessionService::CheckSelect(
    const v1::SelectPagesRequest& request, const Peer& caller, BackendKind* kind) {
  absl::StatusOr<std::shared_ptr<Session>> found =
      FindFor(request.session_id(), caller, " (detached or lease expired): re-attach");
  if (!found.ok()) return CountFailure(found.status());
  std::shared_ptr<Session> session = *std::move(found);
  *kind = session->backend().kind();
  session->Touch();
  const bool async = request.reply_mode() == v1::REPLY_MODE_ASYNC;
  if (request.reply_mode() != v1::REPLY_MODE_UNSPECIFIED &&
      request.reply_mode() != v1::REPLY_MODE_SYNC && !async) {
    return CountFailure(absl::InvalidArgumentError(
        absl::StrCat("reply_mode=", request.reply_mode(), " is unknown")));
  }
  if (async && !session->backend().async_replies()) {
    return CountFailure(absl::UnimplementedError(
        absl::StrCat("reply_mode=REPLY_MODE_ASYNC needs the cuda backend; the ",
                     BackendKindName(session->backend().kind()), " backend answers sync")));
  }
  const SessionSpec& spec = session->spec();
  if (request.rows_size() > static_cast<int>(spec.max_batch)) {
    return CountFailure(absl::InvalidArgumentError(
        absl::StrCat("batch of ", request.rows_size(),
                     " rows exceeds the session's max_batch=", spec.max_batch)));
  }
  return session;
}

absl::Status SessionService::RunStep(Session& session, const v1::SelectPagesRequest& request,
                                     std::span<const StepRow> rows, const SelectPolicy& policy,
                                     const CallLiveness& liveness,
                                     v1::SelectPagesResponse* response) {
  auto count_step = [&](const StepStats& stats) {
    session.CountStep(stats);
    steps_total_.fetch_add(1);
  };
  const SessionBuffers& buffers = session.buffers();
  StepBackend& backend = session.backend();
  absl::MutexLock lock(&backend.step_mu());
  // Detached, replaced or expired while this call waited: the engine's buffers may
  // already belong to its next session. retiring(): its Retire waits for this lock.
  if (backend.retired() || session.retiring()) {
    return CountFailure(
        absl::NotFoundError(absl::StrCat("session '", telemetry::SessionLabel(session.id()),
                                         "' was detached, replaced or expired while step ",
                                         request.step(), " waited; not run: re-attach")));
  }
  // A call that died waiting behind a slow step is not run: its step number stays
  // free for the engine's next call.
  if (absl::Status alive = liveness.Check("SelectPages"); !alive.ok()) return alive;
  // The process is going away: the client forgets the session and re-attaches.
  if (device_lost_.load()) return CountFailure(Restarting());
  absl::Status ready = session.CheckMemoryIntact();
  if (ready.ok()) ready = backend.CheckStepOrder(request.step());
  if (ready.ok()) ready = ApplyInlineWrites(request.writes(), buffers);
  if (!ready.ok()) {
    session.errors.fetch_add(1);
    return CountFailure(ready);
  }
  const BackendStep step{
      .inputs = StepInputsOf(session.spec(), buffers, rows),
      .outputs = StepOutputsOf(buffers),
      .flags = buffers.has_flags ? buffers.data<uint64_t>(SharedBuffer::kFlags) : nullptr,
      .step = request.step(),
      .policy = policy,
      .async = request.reply_mode() == v1::REPLY_MODE_ASYNC,
      // A step its client gave up on stops (cpu backend): it held a thread for as long
      // as its work took, and its session's Detach waited for it.
      .stop = [&liveness] { return liveness.Check("SelectPages"); }};
  StepOutcome outcome;
  absl::Status run = WatchDevice(backend.Run(step, &outcome));
  session.Touch();  // the lease runs from the step's end as well as from its start
  // A SIGBUS in the engine's shm during the step left zeros in its place (shm_fault_guard.h).
  if (run.ok()) run = session.CheckMemoryIntact();
  // Async steps finished since the last call count now, whatever this step does.
  std::vector<v1::StepStats> earlier;
  for (const FinishedStep& f : outcome.earlier) {
    v1::StepStats& stats = earlier.emplace_back();
    ToProto(f.stats, f.step, f.prepass_us, &stats);
    if (!WatchDevice(f.status).ok()) {
      stats.set_error(f.status.ToString());
      session.errors.fetch_add(1);
      continue;
    }
    count_step(f.stats);
  }
  if (!run.ok()) {
    // A failed call sends no reply (grpc_service.cc): the engine hears of them with the
    // session's next successful one.
    session.KeepUndelivered(std::move(earlier));
    // Stopped because its caller gave up: not run, as a call found dead before it ran
    // (its step number stays free, nothing is counted).
    if ((absl::IsCancelled(run) || absl::IsDeadlineExceeded(run)) &&
        !liveness.Check("SelectPages").ok()) {
      return run;
    }
    session.errors.fetch_add(1);
    return CountFailure(run);
  }
  backend.StepRan(request.step());
  for (v1::StepStats& stats : session.TakeUndelivered())
    *response->add_earlier() = std::move(stats);
  for (v1::StepStats& stats : earlier) *response->add_earlier() = std::move(stats);
  session.last_step_seen.store(request.step());
  response->set_step(request.step());
  response->set_done(outcome.done);
  if (outcome.done) {
    count_step(outcome.stats);
    ToProto(outcome.stats, request.step(), outcome.prepass_us, response->mutable_stats());
  }
  const MappedTensor& visit_blocks = buffers[SharedBuffer::kVisitBlocks];
  if (visit_blocks.is_inline && !visit_blocks.is_device) {
    AppendVisitLists(VisitListsOf(session.spec(), buffers), rows, response);
  }
  session.Touch();
  return absl::OkStatus();
}

absl::Status SessionService::Heartbeat(const v1::HeartbeatRequest& request,
                                       v1::HeartbeatResponse* response, const Peer& caller) {
  return Guarded("Heartbeat", [&] { return RenewLease(request, response, caller); });
}

absl::Status SessionService::RenewLease(const v1::HeartbeatRequest& request,
                                        v1::HeartbeatResponse* response, const Peer& caller) {
  absl::StatusOr<std::shared_ptr<Session>> found =
      FindFor(request.session_id(), caller, ": re-attach");
  if (!found.ok()) return CountFailure(found.status());
  std::shared_ptr<Session> session = *std::move(found);
  session->Touch();
  response->set_lease_ms(session->spec().lease_ms);
  return absl::OkStatus();
}

absl::Status SessionService::GetStats(const v1::GetStatsRequest& request,
                                      v1::GetStatsResponse* response, const Peer& caller) {
  return Guarded("GetStats", [&] { return CollectStats(request, response, caller); });
}

absl::Status SessionService::CollectStats(const v1::GetStatsRequest& request,
                                          v1::GetStatsResponse* response, const Peer& caller) {
  if (!request.session_id().empty()) {
    absl::StatusOr<std::shared_ptr<Session>> found = FindFor(request.session_id(), caller, "");
    if (!found.ok()) return CountFailure(found.status());
  }
  response->set_sessions_active(sessions_.size());
  response->set_sessions_attached_total(attached_total_.load());
  response->set_sessions_expired_total(expired_total_.load());
  response->set_steps_total(steps_total_.load());
  response->set_validation_failures_total(validation_failures_.load());
  for (const auto& s : sessions_.All()) {
    if (!request.session_id().empty() && s->id() != request.session_id()) continue;
    if (!s->CheckCaller(caller).ok()) continue;  // another user's session is not listed
    v1::SessionStats* out = response->add_sessions();
    // A session id is a capability: shown only to a caller who named it.
    if (!request.session_id().empty()) out->set_session_id(s->id());
    out->set_engine_id(s->spec().engine_id);
    out->set_steps(s->steps.load());
    out->set_last_step(s->last_step_seen.load());
    out->set_groups_total(s->groups_total.load());
    out->set_groups_visited(s->groups_visited.load());
    out->set_bytes_kv_dense(s->bytes_dense.load());
    out->set_bytes_kv_read_est(s->bytes_read.load());
    out->set_errors(s->errors.load());
  }
  if (!request.session_id().empty() && response->sessions_size() == 0) {
    return CountFailure(NotFound(request.session_id(), ""));  // detached meanwhile
  }
  return absl::OkStatus();
}

}  // namespace eps::service
