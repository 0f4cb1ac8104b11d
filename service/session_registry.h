// The live sessions, by id and by engine.
//
// An engine is named by who attached it and its engine_id (EngineKey): two users
// whose engines share an engine_id have two sessions, so no user can take or
// hold another's engine_id (docs/security.md). Callers of unknown credentials
// (TCP) share one namespace of engine ids.
//
// An Attach builds its session between BeginBuild and EndBuild: one build at a time per
// engine, the engine's later Attach parked behind it (holding no thread), and a build of
// an engine with no live session holds a slot of the limits until it publishes, so the
// limits bound the sessions being built as well as the live ones.
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
#include "absl/functional/any_invocable.h"
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
// uid; the callers of unknown credentials, over TCP, are one owner), the sessions being
// built for engines with no live session counted. A replacing Attach counts against
// neither, unless the session it replaces goes before it publishes (SessionRegistry::Add).
struct SessionLimits {
  size_t max_sessions = 64;
  size_t max_per_user = 0;  // 0: no cap but max_sessions
};

class SessionRegistry {
 public:
  // Called once with whether an Attach may build its session now (OK, its slot held until
  // EndBuild) or why not.
  using BuildStart = absl::AnyInvocable<void(absl::Status admitted) &&>;
  // Admits an Attach of `key` to build its session. With no build of the engine in flight,
  // `start` is called here, before returning: OK when Add would take a session of `key`
  // now (a new session within `limits`, whose slot the build then holds, or the
  // replacement of the live one), else Add's refusal (ALREADY_EXISTS,
  // RESOURCE_EXHAUSTED). While one is in flight, `start` is parked behind it, holding no
  // thread, and called by that build's EndBuild, admitted then as here; a later Attach of
  // the engine parks in its place, and the one it displaces is called here with ABORTED
  // (the later Attach of an engine wins, as it would have replaced the earlier's session).
  void BeginBuild(const EngineKey& key, const SessionLimits& limits, BuildStart start);
  // Ends the build BeginBuild admitted for `key`, published or failed: frees its slot, then
  // admits the Attach parked behind it, if any, calling its `start` outside the lock.
  void EndBuild(const EngineKey& key, const SessionLimits& limits);
  // The live session of `key`, or null.
  std::shared_ptr<Session> Live(const EngineKey& key) const;
  // Publishes `session`, built by the Attach BeginBuild admitted for its engine (or by a
  // caller with no build, a test), replacing the engine's live session if it has one. One
  // that holds no slot of `limits` (admitted to replace a live session that was detached
  // or expired during the build, or added with no build) is published only within
  // `limits` (RESOURCE_EXHAUSTED). A session of unknown owner (TCP) is replaced only once
  // its lease has run out (ALREADY_EXISTS before). OK: the replaced session, or null; the
  // caller retires it and lets it go outside the lock.
  absl::StatusOr<std::shared_ptr<Session>> Add(std::shared_ptr<Session> session,
                                               const SessionLimits& limits);
  std::shared_ptr<Session> Find(const std::string& id) const;
  // Removes `id` and returns its session (null when none), to be let go outside the lock.
  std::shared_ptr<Session> Remove(const std::string& id);
  // Removes and returns the sessions whose lease ran out.
  std::vector<std::shared_ptr<Session>> TakeExpired(int64_t now_ms);
  size_t size() const;
  std::vector<std::shared_ptr<Session>> All() const;

 private:
  // Admits an Attach of `key`, whose engine has no build in flight, as Add would take its
  // session now (BeginBuild): OK with its build recorded, holding a slot of `limits` when
  // the engine has no live session; else the refusal, and no build.
  absl::Status StartBuildLocked(const EngineKey& key, const SessionLimits& limits)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::shared_ptr<Session> LiveLocked(const EngineKey& key) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // ALREADY_EXISTS when `live` was attached over TCP and its lease has not run out.
  static absl::Status CheckReplaceable(const EngineKey& key, const Session& live);
  absl::Status RoomLocked(const EngineKey& key, const SessionLimits& limits) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Drops `session`'s engine from the index if it still names the session.
  void ForgetEngine(const Session& session) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Session>> by_id_ ABSL_GUARDED_BY(mu_);
  std::map<EngineKey, std::string> id_by_engine_ ABSL_GUARDED_BY(mu_);
  // The builds in flight, one per engine.
  struct Build {
    bool holds_slot = false;  // the engine had no live session: the build counts as one
    BuildStart parked;        // the engine's next Attach, when one waits
  };
  std::map<EngineKey, Build> builds_ ABSL_GUARDED_BY(mu_);
};

}  // namespace eps::service
