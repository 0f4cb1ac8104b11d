#include "service/session_registry.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace eps::service {
namespace {

EngineKey KeyOf(const Session& session) {
  return EngineKey::Of(session.owner(), session.spec().engine_id);
}

}  // namespace

void SessionRegistry::BeginBuild(const EngineKey& key, const SessionLimits& limits,
                                 BuildStart start) {
  absl::Status admitted;
  BuildStart displaced;
  bool parked = false;
  {
    absl::MutexLock lock(&mu_);
    if (const auto build = builds_.find(key); build != builds_.end()) {
      parked = true;
      // Two builds of one engine would both be let replace its live session, and the
      // second to publish would end the first's (a retry whose first call gave up
      // replaced by that dead call's session); parked, it is admitted once the first ends.
      displaced = std::exchange(build->second.parked, std::move(start));
    } else {
      admitted = StartBuildLocked(key, limits);
    }
  }
  if (displaced) {
    std::move(displaced)(absl::AbortedError(
        absl::StrCat("a later Attach of engine '", key.engine_id,
                     "' took this one's place while an earlier one was being built")));
  }
  if (!parked) std::move(start)(std::move(admitted));
}

void SessionRegistry::EndBuild(const EngineKey& key, const SessionLimits& limits) {
  BuildStart next;
  absl::Status admitted;
  {
    absl::MutexLock lock(&mu_);
    const auto build = builds_.find(key);
    if (build == builds_.end()) return;
    const bool waits = static_cast<bool>(build->second.parked);
    next = std::move(build->second.parked);
    builds_.erase(build);
    if (!waits) return;
    admitted = StartBuildLocked(key, limits);
  }
  std::move(next)(std::move(admitted));
}

std::shared_ptr<Session> SessionRegistry::Live(const EngineKey& key) const {
  absl::MutexLock lock(&mu_);
  return LiveLocked(key);
}

std::shared_ptr<Session> SessionRegistry::LiveLocked(const EngineKey& key) const {
  const auto engine = id_by_engine_.find(key);
  if (engine == id_by_engine_.end()) return nullptr;
  const auto live = by_id_.find(engine->second);
  return live == by_id_.end() ? nullptr : live->second;
}

absl::StatusOr<std::shared_ptr<Session>> SessionRegistry::Add(std::shared_ptr<Session> session,
                                                              const SessionLimits& limits) {
  absl::MutexLock lock(&mu_);
  const EngineKey key = KeyOf(*session);
  std::shared_ptr<Session> replaced = LiveLocked(key);
  const auto build = builds_.find(key);
  if (replaced != nullptr) {
    RETURN_IF_ERROR(CheckReplaceable(key, *replaced));
  } else if (build == builds_.end() || !build->second.holds_slot) {
    // No slot held for it: the session it was admitted to replace went meanwhile.
    RETURN_IF_ERROR(RoomLocked(key, limits));
  }
  if (replaced != nullptr) by_id_.erase(replaced->id());
  if (build != builds_.end()) build->second.holds_slot = false;  // the session counts now
  id_by_engine_[key] = session->id();
  by_id_[session->id()] = std::move(session);
  return replaced;
}

absl::Status SessionRegistry::StartBuildLocked(const EngineKey& key, const SessionLimits& limits) {
  const std::shared_ptr<Session> live = LiveLocked(key);
  RETURN_IF_ERROR(live == nullptr ? RoomLocked(key, limits) : CheckReplaceable(key, *live));
  builds_[key].holds_slot = live == nullptr;
  return absl::OkStatus();
}

absl::Status SessionRegistry::CheckReplaceable(const EngineKey& key, const Session& live) {
  // A session whose user is unknown (attached over TCP) is protected by its id
  // alone: an Attach naming its engine_id, which any caller can learn, replaces it
  // only once its lease has run out (its Detach, with the id, frees it at once).
  if (key.known || live.Expired(SteadyNowMs())) return absl::OkStatus();
  return absl::AlreadyExistsError(
      absl::StrCat("engine '", key.engine_id,
                   "' has a session attached by an unknown peer (over TCP) whose lease of ",
                   live.spec().lease_ms,
                   " ms has not run out: such a session is replaced only after its lease or its "
                   "Detach"));
}

absl::Status SessionRegistry::RoomLocked(const EngineKey& key, const SessionLimits& limits) const {
  auto owned_by = [&key](const EngineKey& other) {
    return other.known == key.known && other.uid == key.uid;
  };
  size_t building = 0, owned_building = 0;
  for (const auto& [engine, build] : builds_) {
    if (!build.holds_slot) continue;
    ++building;
    if (owned_by(engine)) ++owned_building;
  }
  if (by_id_.size() + building >= limits.max_sessions) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the server holds --max-sessions=", limits.max_sessions, " sessions",
                     building > 0 ? absl::StrCat(" (", building, " of them being attached)") : ""));
  }
  if (limits.max_per_user == 0) return absl::OkStatus();
  // The owner's engines are one run of the index, ordered by (known, uid, engine_id).
  size_t owned = owned_building;
  for (auto it = id_by_engine_.lower_bound({.known = key.known, .uid = key.uid, .engine_id = {}});
       it != id_by_engine_.end() && owned_by(it->first); ++it) {
    ++owned;
  }
  if (owned < limits.max_per_user) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      key.known ? absl::StrCat("uid ", key.uid)
                : std::string("the callers of unknown credentials (TCP)"),
      " hold", key.known ? "s" : "", " --max-sessions-per-user=", limits.max_per_user, " sessions",
      owned_building > 0 ? absl::StrCat(" (", owned_building, " of them being attached)") : "",
      ": detach one, or ask the operator for a larger quota"));
}

std::shared_ptr<Session> SessionRegistry::Find(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second;
}

void SessionRegistry::ForgetEngine(const Session& session) {
  auto engine = id_by_engine_.find(KeyOf(session));
  if (engine != id_by_engine_.end() && engine->second == session.id()) {
    id_by_engine_.erase(engine);
  }
}

std::shared_ptr<Session> SessionRegistry::Remove(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return nullptr;
  ForgetEngine(*it->second);
  std::shared_ptr<Session> removed = std::move(it->second);
  by_id_.erase(it);
  return removed;
}

std::vector<std::shared_ptr<Session>> SessionRegistry::TakeExpired(int64_t now_ms) {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> expired;
  for (auto it = by_id_.begin(); it != by_id_.end();) {
    if (it->second->Expired(now_ms)) {
      ForgetEngine(*it->second);
      expired.push_back(std::move(it->second));
      it = by_id_.erase(it);
    } else {
      ++it;
    }
  }
  return expired;
}

size_t SessionRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return by_id_.size();
}

std::vector<std::shared_ptr<Session>> SessionRegistry::All() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> all;
  for (const auto& [id, session] : by_id_) all.push_back(session);
  return all;
}

}  // namespace eps::service
