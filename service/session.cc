#include "service/session.h"

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/saturating.h"
#include "core/status.h"
#include "service/cpu_backend.h"
#include "service/cuda_backend.h"

namespace eps::service {
namespace {

// The allocations a session's backend makes, sized by its request: the Φ bank
// and the step's scratch (cpu: core/step.cc's lists, scores and marks; cuda:
// gpu/step.cu's device buffers), as (what, bytes).
std::vector<std::pair<std::string, uint64_t>> BackendAllocations(const SessionSpec& spec,
                                                                 const SessionBuffers& b) {
  const ModelLayout& m = spec.model;
  if (spec.backend == BackendKind::kCuda) {
    // gpu/step.cu's own count of what it allocates (a formula here undercounted it by up
    // to 3.5x for shapes of few heads and groups: 67 MB charged for 235 MB allocated).
    return {{"the cuda backend's device buffers",
             CudaBackendDeviceBytes(m, spec.max_batch, b.max_groups, b.max_coarse_groups)}};
  }
  const uint64_t L = m.num_layers, Hq = m.num_q_heads, Hkv = m.num_kv_heads, d = m.head_dim,
                 sketch = m.sketch_dim, groups = static_cast<uint64_t>(b.max_groups);
  const uint64_t phi = SaturatingProduct({L, Hkv, d, sketch, sizeof(float)});
  const uint64_t coarse_groups = static_cast<uint64_t>(b.max_coarse_groups);
  const uint64_t lists = spec.output_granularity == Granularity::kPerKvHead ? Hkv : 1;
  // Per step: the visit lists' scratch, and per row a score, bracket and mark per group
  // for each query head and list.
  // With a coarse level, the same again per coarse group (its scores and candidate marks).
  const uint64_t scratch =
      SaturatingSum({b[SharedBuffer::kVisitBlocks].bytes, b[SharedBuffer::kVisitCount].bytes,
                     SaturatingProduct({groups, SaturatingSum({Hq, lists, 4}), 8}),
                     SaturatingProduct({coarse_groups, SaturatingSum({Hq, lists, 4}), 8})});
  return {{"the Phi bank", phi}, {"the step scratch", scratch}};
}

}  // namespace

int64_t SteadyNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

absl::StatusOr<std::unique_ptr<StepBackend>> MakeSessionBackend(
    const SessionSpec& spec, const SessionBuffers& buffers, const ServerConfig& config,
    std::unique_ptr<StepBackend>* remains) {
  if (spec.backend == BackendKind::kCuda) {
    return MakeCudaBackend(spec.model, spec.device, spec.max_batch, buffers.max_groups,
                           std::chrono::milliseconds(config.inputs_timeout_ms), remains);
  }
  return MakeCpuBackend(spec.model);
}

absl::StatusOr<std::unique_ptr<Session>> Session::Create(const v1::AttachRequest& request,
                                                         const ServerConfig& config,
                                                         ServerBudgets& server, const Peer& caller,
                                                         const BackendFactory& make_backend,
                                                         std::unique_ptr<Session>* remains,
                                                         const ServerCharges& replacing) {
  std::unique_ptr<Session> s(new Session());
  s->inputs_timeout_ = std::chrono::milliseconds(config.inputs_timeout_ms);
  s->budget_ = std::make_unique<MemoryBudget>("--max-session-bytes", config.max_session_bytes,
                                              &server.allocated);
  s->mapped_budget_ = std::make_unique<MemoryBudget>(
      "--max-session-mapped-bytes", config.max_session_mapped_bytes, &server.mapped);
  // Only while the session is built: what its steps charge later finds the replaced
  // session gone, or waits for it (a refusal) as any other session's charge does.
  s->budget_->set_parent_allowance(replacing.allocated);
  s->mapped_budget_->set_parent_allowance(replacing.mapped);

  ASSIGN_OR_RETURN(s->spec_, SessionSpecFromProto(request, config));
  const SessionSpec& spec = s->spec_;
  if (spec.backend == BackendKind::kCuda) {
    s->mappings_.set_cuda_ipc_opener(MakeCudaIpcOpener(spec.device));
  }
  s->mappings_.set_budget(s->budget_.get());  // inline buffers are charged as they are made
  s->mappings_.set_mapped_budget(s->mapped_budget_.get());
  s->mappings_.set_shm_owner(ShmOwnerFor(caller));
  // Past this point a failure may leave CUDA IPC mappings or device memory behind.
  const absl::Status built = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(s->buffers_, ResolveSessionBuffers(request.buffers(), spec, s->mappings_));
    // A reply too large to send would fail every step after running it.
    if (const int64_t reply = InlineReplyBound(spec, s->buffers_);
        reply > static_cast<int64_t>(config.max_message_bytes)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "inline visit lists of ", spec.model.num_layers, " layers x max_batch ", spec.max_batch,
          " x up to ", s->buffers_.max_blocks, " blocks could take ", reply,
          " bytes in one reply, more than --max-message-bytes=", config.max_message_bytes,
          ": share visit_blocks and visit_count, attach with a smaller max_batch, or raise the "
          "flag"));
    }
    ASSIGN_OR_RETURN(s->policy_, SessionPolicy(spec, request, config.policy));
    // What the backend will allocate, charged before it does.
    for (const auto& [what, bytes] : BackendAllocations(spec, s->buffers_)) {
      ASSIGN_OR_RETURN(MemoryCharge charge, s->budget_->Charge(bytes, what));
      s->charges_.push_back(std::move(charge));
    }
    std::unique_ptr<StepBackend> partial;
    absl::StatusOr<std::unique_ptr<StepBackend>> backend =
        make_backend(spec, s->buffers_, config, &partial);
    if (!backend.ok()) {
      s->backend_ = std::move(partial);  // what it allocated, if anything
      return backend.status();
    }
    s->backend_ = *std::move(backend);
    s->backend_->set_memory_budget(s->budget_.get());  // what later steps size, charged too
    return absl::OkStatus();
  }();
  s->budget_->set_parent_allowance(0);
  s->mapped_budget_->set_parent_allowance(0);
  if (!built.ok()) {
    if (remains != nullptr && s->DefersDestruction()) *remains = std::move(s);
    return built;
  }
  return s;
}

bool Session::DefersDestruction() const {
  if (backend_ != nullptr) return backend_->frees_device_memory();
  return spec_.backend == BackendKind::kCuda && mappings_.size() > 0;
}

bool Session::SafeToDestroy(std::chrono::steady_clock::duration put_off) const {
  if (backend_ != nullptr) return backend_->SafeToDestroy(put_off);
  return CudaSafeToFree(spec_.device, put_off, inputs_timeout_);
}

absl::Status Session::CheckDeviceUsable(std::chrono::steady_clock::duration limit) const {
  const std::optional<std::chrono::steady_clock::time_point> since =
      backend_ != nullptr ? backend_->AbandonedWorkSince() : CudaAbandonedWorkSince(spec_.device);
  if (!since.has_value()) return absl::OkStatus();
  const auto running = std::chrono::steady_clock::now() - *since;
  if (running <= limit) return absl::OkStatus();
  using std::chrono::duration_cast;
  using std::chrono::milliseconds;
  return MarkDeviceLost(absl::UnavailableError(absl::StrCat(
      "device ", spec_.device, ": a stream abandoned ",
      duration_cast<milliseconds>(running).count(),
      " ms ago (its engine kept inputs_ready below its step after epsd released the wait) "
      "still has work that may run, past the bound of ",
      duration_cast<milliseconds>(limit).count(),
      " ms; until it drains no ended session's memory on the device can be freed")));
}

absl::Status Session::CheckCaller(const Peer& caller) const {
  if (!owner_.known) return absl::OkStatus();
  if (caller.known && (caller.uid == owner_.uid || caller.uid == 0)) return absl::OkStatus();
  // Not the id in the message: an Attach that may not replace the session must not learn it.
  return absl::PermissionDeniedError(absl::StrCat("the session of engine '", spec_.engine_id,
                                                  "' belongs to uid ", owner_.uid, ", not to ",
                                                  caller.Describe()));
}

absl::Status Session::Retire(bool release_now) {
  retiring_.store(true, std::memory_order_release);
  // Before the wait for the running step (on the cuda backend up to --inputs-timeout-ms): an
  // ended session's replies are of no use to its client, and no session limit counts them.
  unsent_replies_->End();
  absl::MutexLock lock(&backend_->step_mu());
  return backend_->Retire(release_now);
}

void Session::KeepUndelivered(std::vector<v1::StepStats> finished) {
  for (v1::StepStats& f : finished) undelivered_.push_back(std::move(f));
  if (undelivered_.size() > kMaxUndelivered) {
    undelivered_.erase(undelivered_.begin(),
                       undelivered_.end() - static_cast<ptrdiff_t>(kMaxUndelivered));
  }
}

std::vector<v1::StepStats> Session::TakeUndelivered() { return std::exchange(undelivered_, {}); }

void Session::Touch() { last_active_ms.store(SteadyNowMs()); }

bool Session::Expired(int64_t now_ms) const {
  if (lease_held_.load()) return false;
  if (now_ms - last_active_ms.load() <= spec_.lease_ms) return false;
  absl::Mutex& step_mu = backend_->step_mu();
  if (!step_mu.TryLock()) return false;  // a step runs: its end renews the lease
  step_mu.Unlock();
  return true;
}

namespace {

// total += bytes, stopping at INT64_MAX (a step's byte counts saturate there: the session's
// totals went negative on the next step).
void AddSaturating(std::atomic<int64_t>& total, int64_t bytes) {
  int64_t seen = total.load(std::memory_order_relaxed);
  while (!total.compare_exchange_weak(seen, SaturatingMulAdd(seen, {bytes}),
                                      std::memory_order_relaxed)) {
  }
}

}  // namespace

void Session::CountStep(const StepStats& stats) {
  steps.fetch_add(1);
  groups_total.fetch_add(stats.groups_total);
  groups_visited.fetch_add(stats.groups_visited);
  AddSaturating(bytes_dense, stats.kv_bytes_dense);
  AddSaturating(bytes_read, stats.kv_bytes_read_est);
}

}  // namespace eps::service
