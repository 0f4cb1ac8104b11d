// The live sessions, by id and by engine.
//
// An engine is named by who attached it and its engine_id (EngineKey): two users
// whose engines share an engine_id have two sessions, so no user can take or
// hold another's engine_id (docs/security.md). Callers of unknown credentials
// (TCP) share one namespace of engine ids.
//
// Sessions leave the registry (Add's replaced session, Remove, TakeExpired) as
// shared_ptrs returned to the caller: their teardown (munmap, the cuda
// backend's stream synchronisation) never runs under the registry's lock,
// where it would stall every engine's Find.
//
// Thread safety: all methods lock; sessions are shared, so a call that found
// one keeps it alive after it was removed here.
#pragma once

#include <sys/types.h>

#include <compare>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "service/peer.h"
#include "service/session.h"

namespace eps::service {

// The engine a session serves: its engine_id within its owner's namespace.
struct EngineKey {
  bool known = false;  // false: an owner of unknown credentials (TCP)
  uid_t uid = 0;       // the owner's uid when known
  std::string engine_id;

  static EngineKey Of(const Peer& owner, const std::string& engine_id) {
    return {.known = owner.known, .uid = owner.known ? owner.uid : 0, .engine_id = engine_id};
  }
  auto operator<=>(const EngineKey&) const = default;
};

// How many sessions the registry holds at most: in all, and per owner (a user, by
// uid; the callers of unknown credentials, over TCP, are one owner). A replacing
// Attach counts against neither.
struct SessionLimits {
  size_t max_sessions = 64;
  size_t max_per_user = 0;  // 0: no cap but max_sessions
};

class SessionRegistry {
 public:
  // Publishes `session`. A session of the same EngineKey is replaced (re-attach
  // after an engine restart); one attached by an unknown peer (TCP) only once its
  // lease has run out (ALREADY_EXISTS before). RESOURCE_EXHAUSTED when it would be
  // a new session beyond `limits` (checked under the lock, so concurrent attaches
  // agree). OK: the replaced session, or null; the caller retires it and lets it go
  // outside the lock.
  absl::StatusOr<std::shared_ptr<Session>> Add(std::shared_ptr<Session> session,
                                               const SessionLimits& limits);
  // What Add would do now with a session of `key`: OK with the live session it would
  // replace (null: it would add a new one), or Add's refusal (ALREADY_EXISTS,
  // RESOURCE_EXHAUSTED). Checked before an Attach maps and allocates anything, so that
  // an Attach Add would refuse builds nothing, and only one that would replace a session
  // is let build in that session's charges (Add decides, when it publishes).
  absl::StatusOr<std::shared_ptr<Session>> Admission(const EngineKey& key,
                                                     const SessionLimits& limits) const;
  std::shared_ptr<Session> Find(const std::string& id) const;
  // Removes `id` and returns its session (null when none), to be let go outside the lock.
  std::shared_ptr<Session> Remove(const std::string& id);
  // Removes and returns the sessions whose lease ran out.
  std::vector<std::shared_ptr<Session>> TakeExpired(int64_t now_ms);
  size_t size() const;
  std::vector<std::shared_ptr<Session>> All() const;

 private:
  absl::StatusOr<std::shared_ptr<Session>> AdmissionLocked(const EngineKey& key,
                                                           const SessionLimits& limits) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  absl::Status RoomLocked(const EngineKey& key, const SessionLimits& limits) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Drops `session`'s engine from the index if it still names the session.
  void ForgetEngine(const Session& session) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Session>> by_id_ ABSL_GUARDED_BY(mu_);
  std::map<EngineKey, std::string> id_by_engine_ ABSL_GUARDED_BY(mu_);
};

}  // namespace eps::service
