// A session: one engine process (per device) attached to epsd, with its
// layout, policy, validated buffers and lease (DESIGN §5-6).
//
// Thread safety: immutable fields are set before the session is published in
// the registry; steps of one session are serialised by step_mu; the lease and
// counters are atomics. A session stays alive while a call holds its
// shared_ptr, so expiry never unmaps memory under a running step.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/phi.h"
#include "core/step.h"
#include "service/backend.h"
#include "service/descriptor.h"

namespace eps::service {

struct SessionBuffers {
  HostTensor summary_pool, group_table, block_table, queries, visit_blocks, visit_count, flags;
  bool has_flags = false;
};

class Session {
 public:
  std::string id;
  std::string engine_id;
  ModelLayout model;
  SelectPolicy policy;  // the session's defaults; calls may override
  DType query_dtype = DType::kFloat32;
  uint32_t max_batch = 0;
  int64_t num_kv_blocks = -1;
  uint32_t lease_ms = 0;
  int64_t num_slots = 0, max_seqs = 0, max_groups = 0, max_blocks = 0;
  Granularity output_granularity = Granularity::kUnion;
  std::unique_ptr<PhiBank> phi;
  std::unique_ptr<PageSelector> selector;
  MappingCache mappings;
  SessionBuffers buffers;
  std::unique_ptr<StepBackend> backend;
  int device = 0;

  absl::Mutex step_mu;
  bool has_step ABSL_GUARDED_BY(step_mu) = false;
  uint64_t last_step ABSL_GUARDED_BY(step_mu) = 0;

  std::atomic<int64_t> last_active_ms{0};  // steady clock
  std::atomic<uint64_t> steps{0}, errors{0};
  std::atomic<int64_t> groups_total{0}, groups_visited{0}, bytes_dense{0}, bytes_read{0};
  std::atomic<uint64_t> last_step_seen{0};

  void Touch();
  bool Expired(int64_t now_ms) const { return now_ms - last_active_ms.load() > lease_ms; }
};

int64_t SteadyNowMs();

// The session's buffers as core/step.h inputs and outputs (host or device pointers).
StepInputs SessionStepInputs(const Session& session, std::span<const StepRow> rows);
StepOutputs SessionStepOutputs(const Session& session);

// The live sessions, by id and by engine id. Thread safety: all methods lock.
class SessionRegistry {
 public:
  // Publishes `session`; a session of the same engine_id is replaced (re-attach
  // after an engine restart). RESOURCE_EXHAUSTED when it would be a new session
  // beyond `max_sessions` (checked under the lock, so concurrent attaches agree).
  absl::Status Add(std::shared_ptr<Session> session, size_t max_sessions);
  std::shared_ptr<Session> Find(const std::string& id) const;
  bool Remove(const std::string& id);
  // Removes and returns the sessions whose lease ran out.
  std::vector<std::shared_ptr<Session>> TakeExpired(int64_t now_ms);
  size_t size() const;
  std::vector<std::shared_ptr<Session>> All() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Session>> by_id_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> id_by_engine_ ABSL_GUARDED_BY(mu_);
};

}  // namespace eps::service
